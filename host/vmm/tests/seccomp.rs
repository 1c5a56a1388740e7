//! umbra-vmm's confinement, on the process (test lanes (b) and, in the nested lane, on a real
//! SVM KVM): every thread kind's filter kills the VMM at a syscall it does not list (the debug
//! build's trigger, `UMBRA_VMM_SECCOMP_TRIGGER`), while the same machine runs normally without
//! it; and a running VMM has no privileges and every thread filtered.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use umbra_vmm::bare::BareGuest;

#[path = "support/process.rs"]
mod process;
#[path = "support/virtiofsd.rs"]
mod virtiofsd;
use process::vmm_bin;
use virtiofsd::Virtiofsd;

/// virtiofsd serves one connection: each VMM run gets its own.
fn start_virtiofsd(dir: &Path) -> Virtiofsd {
    static RUN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let fs_dir = dir.join(format!("fs{}", RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
    std::fs::create_dir_all(&fs_dir).unwrap();
    Virtiofsd::start(fs_dir, &[])
}

/// A VMM with every kind of thread: a disk, vsock, a shared folder, the rng.
fn machine(dir: &Path, fs: &Virtiofsd, guest: &BareGuest) -> Command {
    let elf = dir.join("guest.elf");
    std::fs::write(&elf, guest.to_elf()).unwrap();
    let disk = dir.join("disk.img");
    std::fs::write(&disk, vec![0u8; 4096]).unwrap();
    // A killed VMM leaves its socket behind (the runtime gives each VM a fresh run directory).
    let _ = std::fs::remove_file(dir.join("vsock.sock"));
    let mut cmd = Command::new(vmm_bin());
    cmd.arg("--kernel")
        .arg(&elf)
        .args(["--memory", "32", "--disk"])
        .arg(&disk)
        .arg("--vsock-uds")
        .arg(dir.join("vsock.sock"))
        .arg("--fs")
        .arg(format!("work={}", fs.socket.display()))
        .env_remove("UMBRA_VMM_SECCOMP");
    cmd
}

#[test]
fn each_thread_kinds_filter_kills_the_vmm_at_a_forbidden_syscall() {
    let dir = process::scratch_dir("seccomp", "kinds");
    let guest = BareGuest::new().print("ran\n").reset();

    // The control: the same machine, filtered, runs and exits cleanly.
    let out = machine(&dir, &start_virtiofsd(&dir), &guest).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ran\n");

    let kinds = ["main", "vcpu", "block", "rng", "vsock", "fs_calls", "fs_watchdog"];
    for kind in kinds {
        let fs = start_virtiofsd(&dir);
        let out = machine(&dir, &fs, &guest).env("UMBRA_VMM_SECCOMP_TRIGGER", kind).output().unwrap();
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGSYS),
            "{kind}: a forbidden syscall must kill the VMM (status {:?}, stderr {})",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.stdout.is_empty(), "{kind}: the guest never ran");
    }
    // Without filters the trigger's syscall is harmless: the kinds really were filtered.
    let fs = start_virtiofsd(&dir);
    let out = machine(&dir, &fs, &guest)
        .args(["--seccomp", "off"])
        .env("UMBRA_VMM_SECCOMP_TRIGGER", "vcpu")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    eprintln!("seccomp: {} thread kinds, each killed at a forbidden syscall", kinds.len());
    let _ = std::fs::remove_dir_all(&dir);
}

fn status_field(pid: u32, task: Option<&str>, field: &str) -> Option<String> {
    let path = match task {
        Some(t) => format!("/proc/{pid}/task/{t}/status"),
        None => format!("/proc/{pid}/status"),
    };
    let status = std::fs::read_to_string(path).ok()?;
    status.lines().find_map(|l| l.strip_prefix(&format!("{field}:")).map(|v| v.trim().to_string()))
}

#[test]
fn a_running_vmm_has_no_privileges_and_every_thread_is_filtered() {
    let dir = process::scratch_dir("seccomp", "status");
    let fs = start_virtiofsd(&dir);
    let mut child =
        machine(&dir, &fs, &BareGuest::new().spin()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let pid = child.id();
    // The main thread installs its filter just before the vCPUs start.
    let deadline = Instant::now() + Duration::from_secs(20);
    while status_field(pid, None, "Seccomp").as_deref() != Some("2") {
        assert!(Instant::now() < deadline, "the main thread was never filtered");
        assert!(child.try_wait().unwrap().is_none(), "the VMM exited");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(status_field(pid, None, "NoNewPrivs").as_deref(), Some("1"));
    for set in ["CapEff", "CapPrm", "CapInh", "CapBnd", "CapAmb"] {
        assert_eq!(status_field(pid, None, set).as_deref(), Some("0000000000000000"), "{set}");
    }
    let mut names = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let task = task.unwrap().file_name().into_string().unwrap();
        let name = std::fs::read_to_string(format!("/proc/{pid}/task/{task}/comm")).unwrap().trim().to_string();
        assert_eq!(status_field(pid, Some(&task), "Seccomp").as_deref(), Some("2"), "thread {name} is unfiltered");
        names.push(name);
    }
    names.sort();
    // comm is cut at 15 bytes.
    for want in ["umbra-blk", "umbra-fs", "umbra-fs-watchd", "umbra-rng", "umbra-vsock", "vcpu0"] {
        assert!(names.iter().any(|n| n == want), "no {want} thread among {names:?}");
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
