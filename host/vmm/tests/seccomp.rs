//! umbra-vmm's confinement, on the process (test lanes (b) and, in the nested lane, on a real
//! SVM KVM): every thread kind's filter kills the VMM at a syscall it does not list (the debug
//! build's trigger, `UMBRA_VMM_SECCOMP_TRIGGER`), while the same machine runs normally without
//! it; a running VMM has no privileges and every thread filtered; and a jailed VMM runs as
//! nobody in its own namespaces with the jail directory as its whole filesystem.

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
    machine_at(dir, &dir.join("vsock.sock"), fs, guest)
}

/// [`machine`] with its vsock socket at `vsock`.
fn machine_at(dir: &Path, vsock: &Path, fs: &Virtiofsd, guest: &BareGuest) -> Command {
    let elf = dir.join("guest.elf");
    std::fs::write(&elf, guest.to_elf()).unwrap();
    let disk = dir.join("disk.img");
    std::fs::write(&disk, vec![0u8; 4096]).unwrap();
    // A killed VMM leaves its socket behind (the runtime gives each VM a fresh run directory).
    let _ = std::fs::remove_file(vsock);
    let control = vsock.with_file_name("control.sock");
    let _ = std::fs::remove_file(&control);
    let mut cmd = Command::new(vmm_bin());
    cmd.arg("--kernel")
        .arg(&elf)
        .args(["--memory", "32", "--disk"])
        .arg(&disk)
        .arg("--vsock-uds")
        .arg(vsock)
        .arg("--fs")
        .arg(format!("work={}", fs.socket.display()))
        .arg("--control")
        .arg(&control)
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

    let kinds = ["main", "vcpu", "block", "rng", "vsock", "fs_calls", "fs_watchdog", "control"];
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

/// The jailed VMM under the relay process `relay` (see umbra_vmm::jail), once it exists.
fn jailed_vmm(relay: u32, child: &mut std::process::Child) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let child_of_relay = std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .find(|pid| status_field(*pid, None, "PPid").as_deref() == Some(relay.to_string().as_str()));
        if let Some(pid) = child_of_relay {
            return pid;
        }
        assert!(Instant::now() < deadline, "the relay never forked the VMM");
        assert!(child.try_wait().unwrap().is_none(), "the VMM exited");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn ns(pid: &str, kind: &str) -> std::path::PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).unwrap()
}

#[test]
fn a_jailed_vmm_runs_unprivileged_in_its_own_namespaces_and_sees_only_its_sockets() {
    use std::os::unix::fs::MetadataExt;
    let dir = process::scratch_dir("seccomp", "jail");
    let jail = dir.join("jail");
    std::fs::create_dir_all(&jail).unwrap();
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if root {
        std::os::unix::fs::chown(&jail, Some(65534), Some(65534)).unwrap();
    }
    let vsock = jail.join("vsock.sock");

    // A jailed run ends as the VMM ended: a clean exit, and the kill of a filter.
    let guest = BareGuest::new().print("ran\n").reset();
    let out = machine_at(&dir, &vsock, &start_virtiofsd(&dir), &guest).arg("--jail").arg(&jail).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr: {stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ran\n");
    assert!(stderr.contains("umbra-vmm: jailed: mount, pid, ipc, uts and net namespaces"), "{stderr}");
    eprintln!("jail: {}", stderr.lines().find(|l| l.contains("jailed")).unwrap_or_default());
    assert!(!vsock.exists(), "the jailed VMM removes its socket as it ends");
    let out = machine_at(&dir, &vsock, &start_virtiofsd(&dir), &guest)
        .arg("--jail")
        .arg(&jail)
        .env("UMBRA_VMM_SECCOMP_TRIGGER", "vcpu")
        .output()
        .unwrap();
    assert_eq!(out.status.signal(), Some(libc::SIGSYS), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let _ = std::fs::remove_file(&vsock);

    let fs = start_virtiofsd(&dir);
    let mut child = machine_at(&dir, &vsock, &fs, &BareGuest::new().spin())
        .arg("--jail")
        .arg(&jail)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let relay = child.id();
    let pid = jailed_vmm(relay, &mut child);
    let deadline = Instant::now() + Duration::from_secs(20);
    while status_field(pid, None, "Seccomp").as_deref() != Some("2") {
        assert!(Instant::now() < deadline, "the jailed VMM was never filtered");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(status_field(pid, None, "NoNewPrivs").as_deref(), Some("1"));
    for set in ["CapEff", "CapPrm", "CapInh", "CapBnd", "CapAmb"] {
        assert_eq!(status_field(pid, None, set).as_deref(), Some("0000000000000000"), "{set}");
    }
    if root {
        for id in ["Uid", "Gid"] {
            assert_eq!(status_field(pid, None, id).as_deref(), Some("65534\t65534\t65534\t65534"), "{id}");
        }
        assert_eq!(status_field(pid, None, "Groups").as_deref(), Some(""));
    }
    // pid 1 of its own pid namespace.
    assert!(status_field(pid, None, "NSpid").unwrap().ends_with("\t1"), "{:?}", status_field(pid, None, "NSpid"));
    let me = std::process::id().to_string();
    for kind in ["mnt", "pid", "net", "ipc", "uts"] {
        assert_ne!(ns(&pid.to_string(), kind), ns(&me, kind), "{kind} namespace");
    }
    // Its root is the jail, and the jail holds its sockets and nothing else.
    let seen = std::fs::metadata(format!("/proc/{pid}/root")).unwrap();
    let want = std::fs::metadata(&jail).unwrap();
    assert_eq!((seen.dev(), seen.ino()), (want.dev(), want.ino()), "/proc/{pid}/root is not the jail");
    let mut names: Vec<_> = std::fs::read_dir(format!("/proc/{pid}/root"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["control.sock", "vsock.sock"]);
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let limit = |name: &str| {
        let line = limits.lines().find_map(|l| l.strip_prefix(name)).unwrap();
        line.split_whitespace().take(2).map(str::to_string).collect::<Vec<_>>()
    };
    assert_eq!(limit("Max core file size"), ["0", "0"]);
    assert_eq!(limit("Max open files"), ["4096", "4096"]);
    // The relay holds nothing and can do nothing either.
    assert_eq!(status_field(relay, None, "NoNewPrivs").as_deref(), Some("1"));
    assert_eq!(status_field(relay, None, "CapEff").as_deref(), Some("0000000000000000"));
    // It holds nothing of the VM's: no KVM, socket, disk or kernel.
    let relay_fds: Vec<_> = std::fs::read_dir(format!("/proc/{relay}/fd"))
        .unwrap()
        .map(|e| std::fs::read_link(e.unwrap().path()).unwrap_or_default().display().to_string())
        .collect();
    assert!(
        !relay_fds.iter().any(|l| ["kvm", "socket:", "disk.img", "guest.elf", "memfd"].iter().any(|v| l.contains(v))),
        "the relay holds {relay_fds:?}"
    );

    // Killing the relay (how the runtime stops a VMM) kills the VMM too.
    child.kill().unwrap();
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    // Gone, or a zombie its new parent (this namespace's init) has not reaped yet.
    while status_field(pid, None, "State").is_some_and(|s| !s.starts_with('Z')) {
        assert!(Instant::now() < deadline, "the jailed VMM outlived its relay: {:?}", status_field(pid, None, "State"));
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = std::fs::remove_dir_all(&dir);
}
