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

/// Starts `vmctl run` with its own runtime dir (whose path marks its helpers' command lines)
/// and returns once the command is running in the guest.
fn start_long_running(tag: &str) -> (umbra_tests::TempDir, String, std::process::Child) {
    let runtime_dir = umbra_tests::TempDir::new(tag);
    let marker = runtime_dir.0.display().to_string();
    let mut child = vmctl()
        .args(["sh", "-c", "echo started; sleep 60"])
        .env("XDG_RUNTIME_DIR", &runtime_dir.0)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut buf = [0u8; 8];
    std::io::Read::read_exact(child.stdout.as_mut().unwrap(), &mut buf).unwrap();
    assert_eq!(&buf, b"started\n");
    (runtime_dir, marker, child)
}

/// vmctl's QEMU and vhost-device-vsock (jailed: each is the child of its relay).
fn helpers_of(vmctl: u32) -> Vec<u32> {
    umbra_tests::with_descendants(&[vmctl])
        .into_iter()
        .filter(|p| ["qemu-system-x86", "vhost-device-vs"].contains(&umbra_tests::comm(*p).as_str()))
        .collect()
}

#[test]
fn sigkill_of_vmctl_leaves_no_qemu_or_vhost_daemon_behind() {
    let (_runtime_dir, marker, mut child) = start_long_running("xdg-kill");
    let helpers = helpers_of(child.id());
    assert_eq!(helpers.len(), 2, "qemu and vhost-device-vsock are running");
    // vhost-device-vsock's command line names the run directory: these are this test's.
    assert_eq!(descendants_named(&["vhost-device-vsock"], &marker).len(), 1);
    // QEMU runs under its own seccomp filter (-sandbox on,...).
    let qemu = *helpers.iter().find(|p| umbra_tests::comm(**p) == "qemu-system-x86").unwrap();
    let status = std::fs::read_to_string(format!("/proc/{qemu}/status")).unwrap();
    assert!(status.lines().any(|l| l == "Seccomp:\t2"), "QEMU is not seccomp-filtered:\n{status}");

    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left: Vec<u32> =
            helpers.iter().copied().filter(|p| umbra_tests::process_state(*p).is_some_and(|s| s != 'Z')).collect();
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "still running 5 s after SIGKILL: {left:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn ctrl_c_ends_the_command_and_the_vm() {
    let (runtime_dir, _marker, mut child) = start_long_running("xdg-int");
    let helpers = helpers_of(child.id());
    assert_eq!(helpers.len(), 2, "qemu and vhost-device-vsock are running");
    let t = Instant::now();
    // SAFETY: plain kill(2) on our own child.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "128 + SIGINT");
    assert!(t.elapsed() < Duration::from_secs(15), "ended promptly: {:?}", t.elapsed());
    // vmctl SIGKILLs each helper's process group and reaps the jail's leader; the helper, pid
    // 1 of its own namespace below it, dies of the same signal in its own time (on a loaded
    // machine, after vmctl has gone).
    let alive = |p: &u32| umbra_tests::process_state(*p).is_some_and(|s| s != 'Z');
    let deadline = Instant::now() + Duration::from_secs(2);
    while helpers.iter().any(alive) {
        assert!(Instant::now() < deadline, "helpers outlived vmctl by 2 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(std::fs::read_dir(runtime_dir.0.join("umbra/vms")).unwrap().count(), 0, "run directory removed");
}

#[test]
fn timeout_json_and_tty() {
    let out = Command::new(workspace_bin("vmctl"))
        .args(["run", "--timeout", "1", "--bundle"])
        .arg(test_bundle("minimal"))
        .args(["--", "sleep", "30"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(124));

    let out = Command::new(workspace_bin("vmctl"))
        .args(["run", "--json", "--bundle"])
        .arg(test_bundle("minimal"))
        .args(["--", "sh", "-c", "echo hi; exit 7"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(7));
    let events: Vec<String> = String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect();
    let kinds: Vec<&str> =
        events.iter().map(|l| l.split("\"event\":\"").nth(1).unwrap().split('"').next().unwrap()).collect();
    assert_eq!(kinds, ["ready", "spawned", "stdout", "exit"], "{events:?}");
    assert!(events[2].contains("\"data\":\"hi\\n\""), "{}", events[2]);
    assert!(events[3].contains("\"code\":7"), "{}", events[3]);

    // Without a host terminal the guest still gets a pseudo-terminal of a default size.
    let out = Command::new(workspace_bin("vmctl"))
        .args(["run", "--tty", "--bundle"])
        .arg(test_bundle("minimal"))
        .args(["--", "sh", "-c", "test -t 0 && test -t 1 && echo on-a-tty; stty size"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("on-a-tty") && text.contains("24 80"), "{text:?}");
}

#[test]
fn exits_when_the_command_ends_even_if_stdin_stays_open() {
    // Like a terminal nobody types into: stdin is open and never delivers EOF.
    let mut child = vmctl().args(["echo", "hi"]).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let _keep_stdin_open = child.stdin.take();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("vmctl did not exit after the command ended");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(0));
}

fn vmctl_with(flags: &[&str]) -> Command {
    let mut c = Command::new(workspace_bin("vmctl"));
    c.arg("run").arg("--bundle").arg(test_bundle("minimal")).args(flags).arg("--");
    c
}

#[test]
fn mounts_start_the_command_in_the_folder_and_honour_their_mode() {
    let dir = umbra_tests::TempDir::new("vmctl-mount");
    let proj = dir.0.join("proj");
    std::fs::create_dir(&proj).unwrap();
    std::fs::write(proj.join("a.txt"), b"hello\n").unwrap();
    let spec = format!("{}:ro", proj.display());
    let out = vmctl_with(&["--mount", &spec]).args(["sh", "-c", "pwd; cat a.txt; echo x > b.txt"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "/sessions/run/mnt/proj\nhello\n");
    assert_ne!(out.status.code(), Some(0), "a write to a ro mount fails");
    assert!(!proj.join("b.txt").exists());

    let spec = format!("{}:work:shadow", proj.display());
    let out = vmctl_with(&["--mount", &spec, "--shadow-diff"])
        .args(["sh", "-c", "echo new > b.txt; rm a.txt"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    // The line shows the captured size and the first 12 digits of its SHA-256 ("new\n").
    assert!(err.contains("deleted  a.txt") && err.contains("added    b.txt (4 bytes, sha256 7aa7a5359173)"), "{err}");
    assert!(proj.join("a.txt").exists() && !proj.join("b.txt").exists(), "shadow leaves the host alone");

    // The apply shows what it captured and applies exactly that; `.git` is listed, not applied.
    let out = vmctl_with(&["--mount", &spec, "--shadow-apply"])
        .args(["sh", "-c", "echo new > b.txt; rm a.txt; mkdir .git; echo evil > .git/config"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("added    .git/config (5 bytes, sha256 ") && err.contains("[applied only when named]"),
        "{err}"
    );
    assert!(err.contains("skipped: .git/config"), "{err}");
    assert!(!proj.join("a.txt").exists());
    assert_eq!(std::fs::read(proj.join("b.txt")).unwrap(), b"new\n");
    assert!(!proj.join(".git").exists(), "{err}");

    let out = vmctl_with(&["--mount", "/x:a:b:c"]).arg("true").output().unwrap();
    assert_eq!(out.status.code(), Some(2), "clap rejects a malformed --mount");
}

#[test]
fn a_policy_file_is_enforced_and_a_bad_one_refused_with_its_name() {
    let dir = umbra_tests::TempDir::new("vmctl-policy");
    let proj = dir.0.join("proj");
    std::fs::create_dir(&proj).unwrap();
    std::fs::write(proj.join(".env"), b"SECRET=host\n").unwrap();
    std::fs::write(proj.join("a.txt"), b"hello\n").unwrap();
    let policy = dir.0.join("policy.json");
    std::fs::write(&policy, br#"{"type": "workspace_readonly", "ignore": [".env"], "disable_tmp_write": true}"#)
        .unwrap();
    let spec = format!("{}:rw", proj.display());
    let p = policy.display().to_string();
    let script = "cat a.txt; cat .env; echo env=$?; echo x > b.txt; echo write=$?; echo y > /tmp/y; echo tmp=$?";
    let out = vmctl_with(&["--mount", &spec, "--policy", &p]).args(["sh", "-c", script]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.starts_with("hello\n") && !stdout.contains("SECRET"), "{stdout}");
    for field in ["env", "write", "tmp"] {
        assert!(stdout.contains(&format!("{field}=")) && !stdout.contains(&format!("{field}=0")), "{stdout}");
    }
    assert!(!proj.join("b.txt").exists());

    // Refused before anything boots, naming the file and the problem.
    let cases: [(&[u8], &str); 3] = [
        (br#"{"type": "workspace_readonly", "bogus": 1}"#, "unknown field `bogus`"),
        (br#"{"additional_readonly_paths": ["relative"]}"#, "additional_readonly_paths"),
        (br#"{"network": {"mode": "any"}}"#, "give it in one place"),
    ];
    for (body, want) in cases {
        std::fs::write(&policy, body).unwrap();
        let out = vmctl_with(&["--policy", &p, "--network", "none"]).arg("true").output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(125), "vmctl's own error, as docker run's: {err}");
        assert!(err.contains(&p) && err.contains(want), "{want}: {err}");
    }
    let missing = dir.0.join("missing.json").display().to_string();
    let out = vmctl_with(&["--policy", &missing]).arg("true").output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing.json"));
}
