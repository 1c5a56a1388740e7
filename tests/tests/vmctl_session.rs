//! `vmctl session …` as an operator runs it, against a real umbrad.

use std::process::{Command, Stdio};

use umbra_tests::daemon::TestDaemon;
use umbra_tests::workspace_bin;

fn vmctl(daemon: &TestDaemon) -> Command {
    let mut c = Command::new(workspace_bin("vmctl"));
    c.env("UMBRA_SOCKET", &daemon.socket).stdin(Stdio::null()).arg("session");
    c
}

fn text(out: &[u8]) -> String {
    String::from_utf8_lossy(out).into_owned()
}

#[test]
fn session_commands_drive_umbrad() {
    let daemon = TestDaemon::start("vmctl-session", serde_json::json!({}));
    let proj = daemon.dir.0.join("proj");
    std::fs::create_dir_all(&proj).unwrap();
    std::fs::write(proj.join("hello.txt"), b"from the host\n").unwrap();

    let out = vmctl(&daemon)
        .args(["start", "dev", "--mount"])
        .arg(format!("{}:code:ro", proj.display()))
        .args(["--memory", "192", "--idle-timeout", "600"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(err.contains("session dev ready") && err.contains("/sessions/dev/mnt/code"), "{err}");

    let out = vmctl(&daemon)
        .args([
            "exec",
            "dev",
            "--workdir",
            "/sessions/dev/mnt",
            "--",
            "sh",
            "-c",
            "cat code/hello.txt; echo oops >&2; exit 7",
        ])
        .output()
        .unwrap();
    assert_eq!(
        (text(&out.stdout), text(&out.stderr), out.status.code()),
        ("from the host\n".into(), "oops\n".into(), Some(7))
    );

    let out = vmctl(&daemon).args(["exec", "dev", "--", "no-such-command"]).output().unwrap();
    assert_eq!(out.status.code(), Some(127), "{}", text(&out.stderr));

    let mut child =
        vmctl(&daemon).args(["exec", "dev", "--", "cat"]).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), b"piped\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!((text(&out.stdout), out.status.code()), ("piped\n".into(), Some(0)));

    let out = vmctl(&daemon).args(["ls", "--json"]).output().unwrap();
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list[0]["name"], "dev");
    assert_eq!(list[0]["status"], "ready");
    assert_eq!(list[0]["settings"]["memory_mib"], 192);

    // Snapshots need umbra-vmm: on qemu both front ends say so, and the session runs on.
    for args in [&["snapshot", "dev"][..], &["fork", "dev", "branch"]] {
        let out = vmctl(&daemon).args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert!(text(&out.stderr).contains("qemu backend, which cannot snapshot"), "{}", text(&out.stderr));
    }
    let out = vmctl(&daemon).args(["resume", "--discard-snapshot", "dev"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("cannot discard its snapshot (stop it first)"), "{}", text(&out.stderr));
    let out = vmctl(&daemon).args(["ls", "--json"]).output().unwrap();
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((list.as_array().unwrap().len(), &list[0]["status"]), (1, &serde_json::json!("ready")));

    assert!(vmctl(&daemon).args(["stop", "dev"]).status().unwrap().success());
    let out = vmctl(&daemon).arg("ls").output().unwrap();
    assert!(text(&out.stdout).contains("stopped"), "{}", text(&out.stdout));
    let out = vmctl(&daemon).args(["exec", "dev", "--", "true"]).output().unwrap();
    assert_ne!(out.status.code(), Some(0), "a stopped session runs nothing");
    assert!(text(&out.stderr).contains("resume"), "{}", text(&out.stderr));

    assert!(vmctl(&daemon).args(["resume", "dev"]).status().unwrap().success());
    let out = vmctl(&daemon).args(["exec", "dev", "--", "cat", "/sessions/dev/mnt/code/hello.txt"]).output().unwrap();
    assert_eq!(text(&out.stdout), "from the host\n");

    let out = vmctl(&daemon).args(["logs", "dev"]).output().unwrap();
    let logs = text(&out.stdout);
    assert!(logs.contains("== console") && logs.contains("status stopped") && logs.contains("ready:"), "{logs}");

    assert!(vmctl(&daemon).args(["rm", "dev"]).status().unwrap().success());
    let out = vmctl(&daemon).args(["ls", "--json"]).output().unwrap();
    assert_eq!(text(&out.stdout).trim(), "[]");
    daemon.assert_no_helpers_within(std::time::Duration::from_secs(10));
}

#[test]
fn without_umbrad_session_commands_say_how_to_start_it_and_run_still_works() {
    let dir = umbra_tests::TempDir::new("no-daemon");
    let out = Command::new(workspace_bin("vmctl"))
        .env("UMBRA_SOCKET", dir.0.join("umbrad.sock"))
        .args(["session", "ls"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("umbrad is not reachable") && err.contains("start it with `umbrad`"), "{err}");

    let out = Command::new(workspace_bin("vmctl"))
        .env("UMBRA_SOCKET", dir.0.join("umbrad.sock"))
        .args(["run", "--bundle"])
        .arg(umbra_tests::test_bundle("minimal"))
        .args(["--", "echo", "no daemon needed"])
        .output()
        .unwrap();
    assert_eq!((text(&out.stdout), out.status.code()), ("no daemon needed\n".into(), Some(0)));
}

/// The README's quick start: umbrad with its defaults and `vmctl session start dev` naming no
/// bundle. Nothing is installed in this daemon's store, so the default (`current`) boots the
/// flavor this machine built; the same default as `vmctl run` and the clients'.
#[test]
fn the_quick_start_needs_no_bundle_named() {
    let daemon = TestDaemon::start("vmctl-quick-start", serde_json::json!({ "bundle": "current" }));
    let out = vmctl(&daemon).args(["start", "dev", "--memory", "192"]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = vmctl(&daemon).args(["exec", "dev", "--", "cat", "/etc/os-release"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(umbra_tests::test_bundle("minimal").join("manifest.json")).unwrap())
            .unwrap();
    let out = vmctl(&daemon).args(["ls", "--json"]).output().unwrap();
    let listed = text(&out.stdout);
    assert!(listed.contains(manifest["bundle_version"].as_str().unwrap()), "{listed}");
    assert!(vmctl(&daemon).args(["rm", "dev"]).status().unwrap().success());
}
