//! `vmctl run` as a user runs it: exit statuses, stdio, and no leftovers after a SIGKILL.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use umbra_tests::{test_bundle, workspace_bin};

fn vmctl() -> Command {
    let mut c = Command::new(workspace_bin("vmctl"));
    c.arg("run").arg("--bundle").arg(test_bundle("minimal")).arg("--");
    c
}

#[test]
fn exit_status_stdout_and_stderr() {
    let out = vmctl().args(["sh", "-c", "echo out; echo err >&2; exit 3"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "out\n");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "err\n");
    assert_eq!(out.status.code(), Some(3));

    let out = vmctl().args(["sh", "-c", "kill -TERM $$"]).output().unwrap();
    assert_eq!(out.status.code(), Some(143));

    let out = vmctl().args(["no-such-command"]).output().unwrap();
    assert_eq!(out.status.code(), Some(127), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn stdin_is_forwarded() {
    let mut child = vmctl().arg("cat").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    child.stdin.take().unwrap().write_all(b"abc").unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.stdout, b"abc");
    assert_eq!(out.status.code(), Some(0));
}

fn descendants_named(names: &[&str], marker: &str) -> Vec<u32> {
    // Helpers are found by the run directory in their command line, unique to this test's vmctl.
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else { continue };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if names.iter().any(|n| cmd.contains(n)) && cmd.contains(marker) {
            found.push(pid);
        }
    }
    found
}

#[test]
fn sigkill_of_vmctl_leaves_no_qemu_or_vhost_daemon_behind() {
    let runtime_dir = umbra_tests::TempDir::new("xdg-run");
    let marker = runtime_dir.0.display().to_string();
    let mut child = vmctl()
        .args(["sh", "-c", "echo started; sleep 60"])
        .env("XDG_RUNTIME_DIR", &runtime_dir.0)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until the command runs in the guest.
    let mut stdout = child.stdout.take().unwrap();
    let mut buf = [0u8; 8];
    std::io::Read::read_exact(&mut stdout, &mut buf).unwrap();
    assert_eq!(&buf, b"started\n");
    let helpers = descendants_named(&["qemu-system-x86_64", "vhost-device-vsock"], &marker);
    assert_eq!(helpers.len(), 2, "qemu and vhost-device-vsock are running");

    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = descendants_named(&["qemu-system-x86_64", "vhost-device-vsock"], &marker);
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "still running 5 s after SIGKILL: {left:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
