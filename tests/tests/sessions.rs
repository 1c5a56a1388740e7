//! The session layer as a library (what vmctl and umbrad build on), with real VMs: the
//! lifecycle rules and the exec lifecycle.

use std::time::Duration;

use umbra_api::methods::StartParams;
use umbra_api::{ErrorCode, EventKind, SessionStatus};
use umbra_runtime::session::ExecRequest;
use umbra_tests::{session_manager as manager, TempDir};

fn sh(script: &str) -> ExecRequest {
    ExecRequest { argv: vec!["sh".into(), "-c".into(), script.into()], ..Default::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_of_a_starting_session_waits_for_it_and_never_boots_twice() {
    let dir = TempDir::new("sessions-once");
    let m = manager(&dir);
    let mut bus = m.subscribe();
    let params = || StartParams { name: "once".into(), ..Default::default() };
    let (a, b) = tokio::join!(m.start(params()), m.start(params()));
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.info().vm.unwrap().pids, b.info().vm.unwrap().pids, "one VM");
    let mut readies = 0;
    while let Ok(ev) = bus.try_recv() {
        if matches!(ev.kind, EventKind::Ready { .. }) {
            readies += 1;
        }
    }
    assert_eq!(readies, 1, "booted once");
    // Resuming a running session is a no-op; starting a stopped one is an error that says so.
    assert_eq!(m.resume("once").await.unwrap().info().vm.unwrap().pids, a.info().vm.unwrap().pids);
    m.stop("once").await.unwrap();
    let e = m.start(params()).await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::SessionExists, "{e}");
    let e = a.spawn(sh("true")).await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidState);
    assert!(e.to_string().contains("resume it first"), "{e}");
    m.resume("once").await.unwrap();
    assert_eq!(a.status(), SessionStatus::Ready);
    let storage = a.storage_dir().unwrap();
    assert!(storage.join("outputs").is_dir());
    m.delete("once").await.unwrap();
    assert!(!storage.exists(), "delete removes the session's storage");
    assert_eq!(m.get("once").unwrap_err().code(), ErrorCode::SessionNotFound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exec_lifecycle_times_out_escalates_and_always_ends_with_an_exit() {
    let dir = TempDir::new("sessions-exec");
    let m = manager(&dir);
    let s = m.start(StartParams { name: "x".into(), ..Default::default() }).await.unwrap();
    let mut bus = m.subscribe();

    // A timeout: SIGTERM, which this command ignores, then SIGKILL.
    let mut req = sh("trap '' TERM; echo waiting; sleep 60");
    req.timeout = Some(Duration::from_secs(1));
    let out = s.spawn(req).await.unwrap().output().await;
    assert!(out.exit.timed_out && out.exit.signal == Some(9), "{:?}", out.exit);
    assert_eq!(out.exit.shell_status(), 124);
    assert_eq!(out.stdout, b"waiting\n");

    // A forwarded Ctrl-C reaches the command and is remembered.
    let exec = s.spawn(sh("sleep 60")).await.unwrap();
    exec.control().interrupt(2);
    let out = exec.output().await;
    assert_eq!((out.exit.signal, out.exit.interrupted, out.exit.shell_status()), (Some(2), Some(2), 130));

    // A process nobody watches any more is killed, and its exit still reaches the bus.
    let exec = s.spawn(sh("sleep 60")).await.unwrap();
    let id = exec.id();
    drop(exec);
    let exit = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            if let Ok(ev) = bus.recv().await {
                if let EventKind::Exit(e) = ev.kind {
                    if e.process == id {
                        return e;
                    }
                }
            }
        }
    })
    .await
    .expect("an exit for the dropped process");
    assert_eq!(exit.signal, Some(9));
    assert_eq!(s.info().processes, 0);

    // Spawn failures carry codes.
    let e = s.spawn(ExecRequest { argv: vec!["/no/such".into()], ..Default::default() }).await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::NotFound);
    let e = s.spawn(ExecRequest { argv: vec!["/etc/passwd".into()], ..Default::default() }).await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::PermissionDenied);
    m.shutdown().await;
    assert_eq!(s.status(), SessionStatus::Stopped);
}

/// Free page reporting on the QEMU backend (issue 37 item 3): after the guest fills 600 MiB and
/// frees it, the VM's host memory falls by at least half of that within 30 s, and
/// `SessionInfo` reports it. (The kvm backend's: `snapshot_kvm.rs`, in the nested lane.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_the_guest_frees_goes_back_to_the_host() {
    let dir = TempDir::new("sessions-balloon");
    let m = umbra_tests::session_manager_for(&dir, "minimal", 1024);
    let settings =
        umbra_api::session::SettingsPatch { backend: Some(umbra_api::BackendChoice::Qemu), ..Default::default() };
    let s = m.start(StartParams { name: "b".into(), settings, ..Default::default() }).await.unwrap();
    umbra_tests::freed_memory_goes_back(&s, 600).await;
}
