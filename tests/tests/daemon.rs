//! umbrad over its real socket, with real VMs: what a desktop app relies on. Each test runs its
//! own daemon in private XDG directories (`umbra_tests::daemon`).

use std::time::Duration;

use umbra_api::methods::*;
use umbra_api::{Data, ErrorCode, EventKind, FolderSpec, SessionStatus};
use umbra_proto::{ShareMode, TtySize};
use umbra_tests::daemon::{boot_timeout_secs, process_output, wait_event, TestDaemon};

fn sh(session: &str, script: &str) -> SpawnParams {
    SpawnParams { session: session.into(), argv: vec!["sh".into(), "-c".into(), script.into()], ..Default::default() }
}

fn boot_wait() -> Duration {
    Duration::from_secs(boot_timeout_secs() + 30)
}

const RUN: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_runs_processes_in_separate_sessions_over_the_socket() {
    let daemon = TestDaemon::start("daemon-basics", serde_json::json!({}));
    let (client, mut notes) = daemon.client().await;
    let (a_dir, b_dir) = (daemon.dir.0.join("folder-a"), daemon.dir.0.join("folder-b"));
    std::fs::create_dir_all(&a_dir).unwrap();
    std::fs::create_dir_all(&b_dir).unwrap();
    std::fs::write(a_dir.join("only-in-a"), b"a\n").unwrap();
    std::fs::write(b_dir.join("only-in-b"), b"b\n").unwrap();
    let folder =
        |path: &std::path::Path| FolderSpec { path: path.into(), name: Some("work".into()), mode: ShareMode::Rw };
    let (a, b) = tokio::join!(
        client.call::<SessionStart>(StartParams {
            name: "a".into(),
            folders: vec![folder(&a_dir)],
            ..Default::default()
        }),
        client.call::<SessionStart>(StartParams {
            name: "b".into(),
            folders: vec![folder(&b_dir)],
            ..Default::default()
        }),
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!((a.status, b.status), (SessionStatus::Ready, SessionStatus::Ready));
    assert_eq!(a.folders[0].guest_path, "/sessions/a/mnt/work");

    // stdout and the exit code
    let p = client.call::<ProcessSpawn>(sh("a", "echo hi; exit 7")).await.unwrap();
    let (out, _, exit) = process_output(&client, &mut notes, "a", p.process, RUN).await;
    assert_eq!((out.as_slice(), exit.code), (&b"hi\n"[..], Some(7)));

    // cat echoes stdin
    let p = client.call::<ProcessSpawn>(SpawnParams { argv: vec!["cat".into()], ..sh("a", "") }).await.unwrap();
    let stdin = StdinParams { session: "a".into(), process: p.process, data: Data::from_bytes(b"through stdin\n") };
    client.call::<ProcessStdin>(stdin).await.unwrap();
    client.call::<ProcessCloseStdin>(ProcessRef { session: "a".into(), process: p.process }).await.unwrap();
    let (out, _, exit) = process_output(&client, &mut notes, "a", p.process, RUN).await;
    assert_eq!((out.as_slice(), exit.code), (&b"through stdin\n"[..], Some(0)));

    // a pseudo-terminal sees a resize
    let tty = SpawnParams { tty: Some(TtySize { rows: 24, cols: 80 }), ..sh("a", "read line; stty size") };
    let p = client.call::<ProcessSpawn>(tty).await.unwrap();
    client
        .call::<ProcessResize>(ResizeParams { session: "a".into(), process: p.process, rows: 33, cols: 101 })
        .await
        .unwrap();
    let stdin = StdinParams { session: "a".into(), process: p.process, data: Data::from_bytes(b"go\r") };
    client.call::<ProcessStdin>(stdin).await.unwrap();
    let (out, _, _) = process_output(&client, &mut notes, "a", p.process, RUN).await;
    assert!(String::from_utf8_lossy(&out).contains("33 101"), "{:?}", String::from_utf8_lossy(&out));

    // kill ends a process with its signal
    let p = client.call::<ProcessSpawn>(sh("a", "sleep 600")).await.unwrap();
    client.call::<ProcessKill>(KillParams { session: "a".into(), process: p.process, signal: 15 }).await.unwrap();
    let (_, _, exit) = process_output(&client, &mut notes, "a", p.process, RUN).await;
    assert_eq!((exit.signal, exit.lost), (Some(15), false));

    // two sessions, two kernels, and neither sees the other's folders
    let mut boot_ids = Vec::new();
    for s in ["a", "b"] {
        let p = client
            .call::<ProcessSpawn>(sh(s, "cat /proc/sys/kernel/random/boot_id; ls /sessions/*/mnt/work; ls /sessions"))
            .await
            .unwrap();
        let (out, _, _) = process_output(&client, &mut notes, s, p.process, RUN).await;
        let text = String::from_utf8_lossy(&out).into_owned();
        let other = if s == "a" { "b" } else { "a" };
        assert!(text.contains(&format!("only-in-{s}")), "{s}: {text}");
        assert!(!text.contains(&format!("only-in-{other}")), "{s} sees {other}'s folder: {text}");
        assert_eq!(text.lines().last(), Some(s), "{s}: only its own session directory: {text}");
        boot_ids.push(text.lines().next().unwrap().to_string());
    }
    assert_ne!(boot_ids[0], boot_ids[1], "each session has its own kernel");

    // errors keep their codes
    let e = client.call::<ProcessSpawn>(SpawnParams { argv: vec!["no-such-command".into()], ..sh("a", "") }).await;
    assert_eq!(e.unwrap_err().code, ErrorCode::NotFound);
    let e = client.call::<SessionGet>(SessionRef { name: "nope".into() }).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::SessionNotFound);
    let e = client.call::<SessionStart>(StartParams { name: "a/../b".into(), ..Default::default() }).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidParams);

    // files through path translation: a host path inside a folder is the guest's file
    let w = WriteParams {
        session: "a".into(),
        path: a_dir.join("written.txt").display().to_string(),
        data: Data::from_bytes(b"via the daemon\n"),
        append: false,
        offset: None,
        create_dirs: false,
        permissions: None,
    };
    client.call::<FileWrite>(w).await.unwrap();
    let r = client
        .call::<FileRead>(ReadParams {
            session: "a".into(),
            path: "/sessions/a/mnt/work/written.txt".into(),
            offset: 0,
            len: None,
        })
        .await
        .unwrap();
    assert_eq!(r.data.to_bytes().unwrap(), b"via the daemon\n");
    assert_eq!(std::fs::read(a_dir.join("written.txt")).unwrap(), b"via the daemon\n");
    let e = client
        .call::<FileRead>(ReadParams {
            session: "a".into(),
            path: "/sessions/a/mnt/work/../../b".into(),
            offset: 0,
            len: None,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidParams);

    let list = client.call::<SessionListMethod>(NoParams {}).await.unwrap();
    assert_eq!(list.sessions.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), ["a", "b"]);
    client.call::<SessionDelete>(SessionRef { name: "b".into() }).await.unwrap();
    client.call::<SessionStop>(SessionRef { name: "a".into() }).await.unwrap();
    daemon.assert_no_helpers_within(Duration::from_secs(10));
}

/// Overwrites PID 1's code through /proc/1/mem, so the agent faults (see conformance.rs).
const KILL_AGENT: &str = "set -- $(grep ' r-xp ' /proc/1/maps | head -1 | cut -d' ' -f1 | tr - ' '); \
    dd if=/dev/zero of=/proc/1/mem bs=4096 seek=$((0x$1 / 4096)) count=$(((0x$2 - 0x$1) / 4096)) conv=notrunc; \
    while true; do echo wake-the-agent; sleep 0.1; done";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_vm_is_restarted_with_its_folders_and_disk() {
    let daemon = TestDaemon::start("daemon-restart", serde_json::json!({ "max_restarts": 5 }));
    let (client, mut notes) = daemon.client().await;
    let work = daemon.dir.0.join("work");
    std::fs::create_dir_all(&work).unwrap();
    std::fs::write(work.join("seen.txt"), b"host\n").unwrap();
    client.call::<EventsSubscribe>(SubscribeParams { session: Some("r".into()) }).await.unwrap();
    // rwd, not rw: an rw share puts spawned processes under landlock, which (rightly) denies
    // them the ptrace access that writing /proc/1/mem needs.
    let folder = FolderSpec { path: work.clone(), name: None, mode: ShareMode::Rwd };
    let start = StartParams { name: "r".into(), folders: vec![folder], ..Default::default() };
    client.call::<SessionStart>(start).await.unwrap();
    let p = client.call::<ProcessSpawn>(sh("r", "echo kept > /root/on-disk.txt && sync")).await.unwrap();
    let (_, _, exit) = process_output(&client, &mut notes, "r", p.process, RUN).await;
    assert_eq!(exit.code, Some(0));

    for (how, breaker) in [("killed agent", KILL_AGENT), ("kernel panic", "echo c > /proc/sysrq-trigger")] {
        let sleeper = client.call::<ProcessSpawn>(sh("r", "sleep 600")).await.unwrap();
        let breaker = client.call::<ProcessSpawn>(sh("r", breaker)).await.unwrap();
        let (_, _, exit) = process_output(&client, &mut notes, "r", sleeper.process, boot_wait()).await;
        assert!(exit.lost && exit.signal == Some(9), "{how}: {exit:?}");
        let reason = exit.reason.clone().unwrap_or_default();
        assert!(reason.contains("restart"), "{how}: the exit names the restart: {reason}");
        let _ = breaker;
        wait_event(&mut notes, RUN, &format!("{how}: restarting"), |e| {
            matches!(e.kind, EventKind::Status { status: SessionStatus::Restarting, .. })
        })
        .await;
        wait_event(
            &mut notes,
            boot_wait(),
            &format!("{how}: the folder mounted again"),
            |e| matches!(&e.kind, EventKind::FolderMounted { name, .. } if name == "work"),
        )
        .await;
        wait_event(&mut notes, boot_wait(), &format!("{how}: ready again"), |e| {
            matches!(e.kind, EventKind::Status { status: SessionStatus::Ready, .. })
        })
        .await;
        let p = client
            .call::<ProcessSpawn>(sh("r", "cat /root/on-disk.txt /sessions/r/mnt/work/seen.txt"))
            .await
            .unwrap_or_else(|e| panic!("{how}: a new command runs: {e}"));
        let (out, err, exit) = process_output(&client, &mut notes, "r", p.process, RUN).await;
        assert_eq!(
            (String::from_utf8_lossy(&out).as_ref(), exit.code),
            ("kept\nhost\n", Some(0)),
            "{how}: the disk and the folder survive: {}",
            String::from_utf8_lossy(&err)
        );
    }
    let info = client.call::<SessionGet>(SessionRef { name: "r".into() }).await.unwrap();
    assert_eq!((info.status, info.restarts), (SessionStatus::Ready, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_session_stops_and_resumes_with_its_outputs_and_disk() {
    let daemon = TestDaemon::start("daemon-idle", serde_json::json!({}));
    let (client, mut notes) = daemon.client().await;
    client.call::<EventsSubscribe>(SubscribeParams { session: None }).await.unwrap();
    let info = client
        .call::<SessionStart>(StartParams { name: "idle".into(), idle_timeout_secs: Some(5), ..Default::default() })
        .await
        .unwrap();
    let outputs = info.storage_dir.join("outputs");

    let p = client
        .call::<ProcessSpawn>(sh(
            "idle",
            "set -e; echo report > /sessions/idle/mnt/outputs/report.md; echo state > /root/on-disk; sync",
        ))
        .await
        .unwrap();
    let (_, err, exit) = process_output(&client, &mut notes, "idle", p.process, RUN).await;
    assert_eq!(exit.code, Some(0), "{}", String::from_utf8_lossy(&err));
    let created =
        wait_event(&mut notes, RUN, "outputs_file_created", |e| matches!(e.kind, EventKind::OutputsFileCreated { .. }))
            .await;
    match created.kind {
        EventKind::OutputsFileCreated { path, host_path } => {
            assert_eq!(path, "report.md");
            assert_eq!(host_path, outputs.canonicalize().unwrap().join("report.md"));
        }
        _ => unreachable!(),
    }

    wait_event(&mut notes, Duration::from_secs(30), "idle_stop", |e| {
        matches!(e.kind, EventKind::IdleStop { idle_secs: 5 })
    })
    .await;
    wait_event(&mut notes, Duration::from_secs(30), "stopped", |e| {
        matches!(e.kind, EventKind::Status { status: SessionStatus::Stopped, .. })
    })
    .await;
    daemon.assert_no_helpers_within(Duration::from_secs(5));
    let info = client.call::<SessionGet>(SessionRef { name: "idle".into() }).await.unwrap();
    assert_eq!(info.status, SessionStatus::Stopped);
    assert!(info.vm.is_none());

    let info = client.call::<SessionResume>(SessionRef { name: "idle".into() }).await.unwrap();
    assert_eq!(info.status, SessionStatus::Ready);
    let p = client
        .call::<ProcessSpawn>(sh("idle", "cat /sessions/idle/mnt/outputs/report.md /root/on-disk"))
        .await
        .unwrap();
    let (out, _, _) = process_output(&client, &mut notes, "idle", p.process, RUN).await;
    assert_eq!(String::from_utf8_lossy(&out), "report\nstate\n");
}
