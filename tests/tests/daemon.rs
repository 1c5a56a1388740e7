//! umbrad over its real socket, with real VMs: what a desktop app relies on. Each test runs its
//! own daemon in private XDG directories (`umbra_tests::daemon`).

use std::os::unix::process::CommandExt;
use std::time::Duration;

use umbra_api::methods::*;
use umbra_api::session::SettingsPatch;
use umbra_api::{Data, ErrorCode, EventKind, FolderSpec, SessionStatus};
use umbra_proto::{ShareMode, TtySize};
use umbra_tests::daemon::{process_output, wait_event, TestDaemon};

fn sh(session: &str, script: &str) -> SpawnParams {
    SpawnParams { session: session.into(), argv: vec!["sh".into(), "-c".into(), script.into()], ..Default::default() }
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
    let stdin = StdinParams {
        session: "a".into(),
        process: p.process,
        data: Data::from_bytes(b"through stdin\n"),
        writer: None,
        offset: None,
    };
    client.call::<ProcessStdin>(stdin).await.unwrap();
    // With offsets (a client sending again what a lost connection may have delivered): the
    // bytes umbrad already took are skipped, and a piece past them is refused.
    let piece = |offset: u64, data: &[u8]| StdinParams {
        session: "a".into(),
        process: p.process,
        data: Data::from_bytes(data),
        writer: Some("test".into()),
        offset: Some(offset),
    };
    client.call::<ProcessStdin>(piece(0, b"again\n")).await.unwrap();
    client.call::<ProcessStdin>(piece(0, b"again\nand more\n")).await.unwrap();
    client.call::<ProcessStdin>(piece(6, b"and more\n")).await.unwrap();
    let gap = client.call::<ProcessStdin>(piece(40, b"late\n")).await.unwrap_err();
    assert_eq!(gap.code, ErrorCode::InvalidParams, "{gap:?}");
    let mut lone = piece(0, b"x");
    lone.writer = None;
    let e = client.call::<ProcessStdin>(lone).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidParams, "an offset needs a writer: {e:?}");
    client.call::<ProcessCloseStdin>(ProcessRef { session: "a".into(), process: p.process }).await.unwrap();
    let (out, _, exit) = process_output(&client, &mut notes, "a", p.process, RUN).await;
    assert_eq!((out.as_slice(), exit.code), (&b"through stdin\nagain\nand more\n"[..], Some(0)));

    // a pseudo-terminal sees a resize
    let tty = SpawnParams { tty: Some(TtySize { rows: 24, cols: 80 }), ..sh("a", "read line; stty size") };
    let p = client.call::<ProcessSpawn>(tty).await.unwrap();
    client
        .call::<ProcessResize>(ResizeParams { session: "a".into(), process: p.process, rows: 33, cols: 101 })
        .await
        .unwrap();
    let stdin = StdinParams {
        session: "a".into(),
        process: p.process,
        data: Data::from_bytes(b"go\r"),
        writer: None,
        offset: None,
    };
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
        host: true,
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
            host: false,
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
            host: false,
            offset: 0,
            len: None,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidParams);
    // A host path outside every shared folder is not translated (and not guessed at).
    let stat = PathParams { session: "a".into(), path: daemon.dir.0.display().to_string(), host: true };
    assert_eq!(client.call::<FileStatMethod>(stat).await.unwrap_err().code, ErrorCode::NotFound);
    // Unknown params are refused, not ignored.
    let raw = serde_json::json!({"name": "c", "memory": 1});
    let e = client.call_raw("session.start", raw).await.unwrap_err();
    assert!(e.code == ErrorCode::InvalidParams && e.message.contains("memory_mib"), "{e:?}");

    let list = client.call::<SessionListMethod>(NoParams {}).await.unwrap();
    assert_eq!(list.sessions.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), ["a", "b"]);
    client.call::<SessionDelete>(SessionRef { name: "b".into() }).await.unwrap();
    client.call::<SessionStop>(SessionRef { name: "a".into() }).await.unwrap();
    daemon.assert_no_helpers_within(Duration::from_secs(10));
}

/// Asked to suspend when idle, a session on qemu (which cannot snapshot) stops, as the setting
/// says (`idle_action: suspend` is the nested lane's, `snapshot_kvm.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_session_stops_and_resumes_with_its_outputs_and_disk() {
    let daemon = TestDaemon::start("daemon-idle", serde_json::json!({}));
    let (client, mut notes) = daemon.client().await;
    client.call::<EventsSubscribe>(SubscribeParams { session: None }).await.unwrap();
    let info = client
        .call::<SessionStart>(StartParams {
            name: "idle".into(),
            settings: SettingsPatch {
                idle_timeout_secs: Some(5),
                idle_action: Some(umbra_api::IdleAction::Suspend),
                backend: Some(umbra_api::BackendChoice::Qemu),
                ..Default::default()
            },
            ..Default::default()
        })
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
    assert!(info.vm.is_none() && !info.suspended && info.snapshot.is_none(), "{info:?}");

    let info =
        client.call::<SessionResume>(ResumeParams { name: "idle".into(), discard_snapshot: false }).await.unwrap();
    assert_eq!(info.status, SessionStatus::Ready);
    let p = client
        .call::<ProcessSpawn>(sh("idle", "cat /sessions/idle/mnt/outputs/report.md /root/on-disk"))
        .await
        .unwrap();
    let (out, _, _) = process_output(&client, &mut notes, "idle", p.process, RUN).await;
    assert_eq!(String::from_utf8_lossy(&out), "report\nstate\n");
}

/// Sends raw lines and reads one response line per request.
struct RawClient {
    stream: tokio::io::BufReader<tokio::net::UnixStream>,
}

impl RawClient {
    async fn connect(daemon: &TestDaemon) -> Self {
        Self { stream: tokio::io::BufReader::new(tokio::net::UnixStream::connect(&daemon.socket).await.unwrap()) }
    }

    async fn send(&mut self, bytes: &[u8]) {
        use tokio::io::AsyncWriteExt;
        self.stream.get_mut().write_all(bytes).await.unwrap();
    }

    async fn response(&mut self) -> serde_json::Value {
        use tokio::io::AsyncBufReadExt;
        let mut line = String::new();
        tokio::time::timeout(Duration::from_secs(10), self.stream.read_line(&mut line)).await.unwrap().unwrap();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line:?}"))
    }
}

fn error_code(v: &serde_json::Value) -> (i64, String) {
    (v["error"]["code"].as_i64().unwrap_or(0), v["error"]["data"]["code"].as_str().unwrap_or("").to_string())
}

/// umbrad's peak resident memory so far, from /proc.
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_and_slow_clients_hurt_neither_the_daemon_nor_other_clients() {
    let daemon = TestDaemon::start("daemon-hostile", serde_json::json!({}));

    // Another uid is refused before a request is read, even where file modes would let it in.
    for dir in [daemon.dir.0.join("run"), daemon.dir.0.join("run/umbra")] {
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    }
    std::fs::set_permissions(&daemon.socket, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
    let script = "import socket,sys\ns=socket.socket(socket.AF_UNIX)\ns.connect(sys.argv[1])\n\
                  try: s.sendall(b'{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"session.list\"}\\n')\n\
                  except BrokenPipeError: pass  # refused before reading: the answer is waiting\n\
                  print(s.makefile().readline(), end='')";
    let out = std::process::Command::new("python3")
        .args(["-c", script])
        .arg(&daemon.socket)
        .uid(65534)
        .gid(65534)
        .output()
        .expect("run python3 as nobody");
    let answer = String::from_utf8_lossy(&out.stdout);
    assert!(
        answer.contains("\"unauthorized\"") && answer.contains("uid 65534"),
        "{answer} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(daemon.log().contains("refused a client of uid 65534"), "the refusal is logged");
    // Opened that wide, the runtime directory is no longer private: VMs are refused a run
    // directory in it until it is again.
    for dir in [daemon.dir.0.join("run"), daemon.dir.0.join("run/umbra")] {
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    }

    // Malformed input gets JSON-RPC errors and the connection carries on.
    let mut raw = RawClient::connect(&daemon).await;
    raw.send(b"{oops\n").await;
    assert_eq!(error_code(&raw.response().await), (-32700, "parse_error".into()));
    let mut huge = vec![b' '; 5 << 20];
    huge.push(b'\n');
    raw.send(&huge).await;
    let r = raw.response().await;
    assert_eq!(error_code(&r), (-32600, "invalid_request".into()));
    assert!(r["error"]["message"].as_str().unwrap().contains("longer than"), "{r}");
    raw.send(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"no.such\"}\n").await;
    let r = raw.response().await;
    assert_eq!((error_code(&r), r["id"].as_i64()), ((-32601, "method_not_found".into()), Some(1)));
    raw.send(b"{\"jsonrpc\":\"2.0\",\"id\":2,\"method\":\"session.get\",\"params\":{\"nom\":1}}\n").await;
    assert_eq!(error_code(&raw.response().await), (-32602, "invalid_params".into()));
    raw.send(b"{\"jsonrpc\":\"2.0\",\"id\":3,\"method\":\"daemon.info\"}\n").await;
    let r = raw.response().await;
    assert_eq!((r["id"].as_i64(), r["result"]["pid"].as_u64()), (Some(3), Some(daemon.pid() as u64)), "{r}");

    // A response follows the events sent before it: a start that fails (no such bundle) has
    // its `failed` status queued ahead of the error that answers it.
    raw.send(b"{\"jsonrpc\":\"2.0\",\"id\":4,\"method\":\"events.subscribe\"}\n").await;
    assert!(raw.response().await["result"]["subscription"].is_u64());
    raw.send(
        b"{\"jsonrpc\":\"2.0\",\"id\":5,\"method\":\"session.start\",\
          \"params\":{\"name\":\"nobundle\",\"bundle\":\"/no/such/bundle\"}}\n",
    )
    .await;
    let mut before = Vec::new();
    let answer = loop {
        let line = raw.response().await;
        if line["id"].as_i64() == Some(5) {
            break line;
        }
        before.push(line);
    };
    assert!(answer["error"]["message"].as_str().unwrap_or("").contains("/no/such/bundle"), "{answer}");
    let failed = |n: &serde_json::Value| n["params"]["event"] == "status" && n["params"]["status"] == "failed";
    assert!(before.iter().any(failed), "the failed status came first: {before:?} then {answer}");

    // A subscriber that never reads does not stall a 100 MiB stream to another client.
    let mut stuck = RawClient::connect(&daemon).await;
    stuck.send(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"events.subscribe\"}\n").await;
    let (client, mut notes) = daemon.client().await;
    client.call::<SessionStart>(StartParams { name: "big".into(), ..Default::default() }).await.unwrap();
    let before = peak_rss_kib(daemon.pid());
    let p = client.call::<ProcessSpawn>(sh("big", "head -c 104857600 /dev/zero")).await.unwrap();
    let started = std::time::Instant::now();
    let (out, _, exit) = process_output(&client, &mut notes, "big", p.process, Duration::from_secs(600)).await;
    let took = started.elapsed();
    assert_eq!((out.len(), exit.code), (100 << 20, Some(0)));
    assert!(out.iter().all(|&b| b == 0));
    let after = peak_rss_kib(daemon.pid());
    eprintln!("100 MiB through umbrad in {took:?}; umbrad peak RSS {before} KiB before, {after} KiB after");
    assert!(after < before + 64 * 1024, "umbrad's memory stays bounded: peak {before} KiB -> {after} KiB");
    // The stuck client is still connected, and the daemon still answers everyone.
    client.call::<SessionStop>(SessionRef { name: "big".into() }).await.unwrap();
    drop(stuck);
    let info = client.call::<DaemonInfoMethod>(NoParams {}).await.unwrap();
    assert_eq!(info.pid, daemon.pid());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bundles_config_folders_files_and_shadows_through_the_daemon() {
    let mut daemon = TestDaemon::start("daemon-surface", serde_json::json!({}));
    let (client, mut notes) = daemon.client().await;
    client.call::<EventsSubscribe>(SubscribeParams { session: None }).await.unwrap();

    // Bundles: download with progress events, status, reinstall, and boot from the store.
    let url = format!("file://{}", umbra_tests::test_bundle("minimal").display());
    let got = client.call::<BundleDownload>(DownloadParams { url: Some(url.clone()), warm: false }).await.unwrap();
    assert_eq!(got.how, umbra_bundle::PulledHow::Downloaded);
    wait_event(&mut notes, RUN, "download progress", |e| matches!(e.kind, EventKind::DownloadProgress(_))).await;
    let status = client.call::<BundleStatusMethod>(NoParams {}).await.unwrap();
    assert_eq!(status.current.as_deref(), Some(got.version.as_str()));
    let again = client.call::<BundleDeleteAndReinstall>(ReinstallParams { url: Some(url) }).await.unwrap();
    assert_eq!((again.version.as_str(), again.how), (got.version.as_str(), umbra_bundle::PulledHow::Downloaded));

    // Config: set, validated, persisted across a daemon restart.
    let e = client
        .call::<ConfigSet>(umbra_api::ConfigPatch {
            session: SettingsPatch { cpus: Some(0), ..Default::default() },
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidParams);
    let patch = umbra_api::ConfigPatch {
        session: SettingsPatch { bundle: Some("current".into()), memory_mib: Some(200), ..Default::default() },
        ..Default::default()
    };
    let config = client.call::<ConfigSet>(patch).await.unwrap();
    assert_eq!((config.session.bundle.as_str(), config.session.memory_mib), ("current", 200));
    drop(client);
    daemon.terminate();
    daemon.launch();
    let (client, mut notes) = daemon.client().await;
    let config = client.call::<ConfigGet>(NoParams {}).await.unwrap();
    assert_eq!((config.session.bundle.as_str(), config.session.memory_mib), ("current", 200));

    // A session from the installed bundle, folders mounted and unmounted while it runs.
    let info = client.call::<SessionStart>(StartParams { name: "f".into(), ..Default::default() }).await.unwrap();
    assert_eq!((info.settings.memory_mib, info.vm.unwrap().bundle_version), (200, got.version.clone()));
    let proj = daemon.dir.0.join("proj");
    std::fs::create_dir_all(proj.join("src")).unwrap();
    std::fs::write(proj.join("src/lib.rs"), b"old\n").unwrap();
    let mounted = client
        .call::<FolderMount>(MountParams {
            session: "f".into(),
            folder: FolderSpec { path: proj.clone(), name: None, mode: ShareMode::Shadow },
        })
        .await
        .unwrap();
    assert_eq!(mounted.guest_path, "/sessions/f/mnt/proj");
    let p = client
        .call::<ProcessSpawn>(sh("f", "cd /sessions/f/mnt/proj && echo new > src/lib.rs && echo x > added.txt"))
        .await
        .unwrap();
    process_output(&client, &mut notes, "f", p.process, RUN).await;
    let stat = client
        .call::<FileStatMethod>(PathParams {
            session: "f".into(),
            path: "/sessions/f/mnt/proj/added.txt".into(),
            host: false,
        })
        .await
        .unwrap();
    assert_eq!(stat.size, 2);
    let list = client
        .call::<FileList>(ListParams { session: "f".into(), path: proj.display().to_string(), host: true, limit: None })
        .await
        .unwrap();
    let mut names: Vec<_> = list.entries.iter().map(|e| e.name.as_str()).collect();
    names.sort();
    assert_eq!(names, ["added.txt", "src"]);

    let diff = client.call::<ShadowDiff>(ShadowParams { session: "f".into(), folder: "proj".into() }).await.unwrap();
    let mut paths: Vec<_> = diff.changes.iter().map(|c| c.path.as_str()).collect();
    paths.sort();
    assert_eq!(paths, ["added.txt", "src/lib.rs"]);
    assert_eq!(std::fs::read(proj.join("src/lib.rs")).unwrap(), b"old\n", "the host is untouched");
    let exported = client
        .call::<ShadowExport>(ExportParams { session: "f".into(), folder: "proj".into(), dest: None })
        .await
        .unwrap();
    assert!(exported.bytes > 0 && exported.path.exists(), "{exported:?}");
    // An apply names the change-set the diff captured: without one it is refused.
    let apply = |changeset: Option<&str>| ShadowApplyParams {
        session: "f".into(),
        folder: "proj".into(),
        changeset: changeset.map(str::to_owned),
        paths: None,
    };
    let refused = client.call::<ShadowApply>(apply(None)).await.unwrap_err();
    assert_eq!(refused.code, ErrorCode::InvalidParams, "{refused:?}");
    assert!(refused.message.contains("changeset"), "{refused:?}");
    let report = client.call::<ShadowApply>(apply(Some(&diff.changeset))).await.unwrap();
    assert_eq!(report.applied.len(), 2, "{report:?}");
    assert_eq!(std::fs::read(proj.join("src/lib.rs")).unwrap(), b"new\n");
    client.call::<ShadowReset>(ShadowParams { session: "f".into(), folder: "proj".into() }).await.unwrap();

    // Unapplied changes are saved before a shadow folder goes away.
    let p = client.call::<ProcessSpawn>(sh("f", "echo later > /sessions/f/mnt/proj/later.txt")).await.unwrap();
    process_output(&client, &mut notes, "f", p.process, RUN).await;
    client.call::<EventsSubscribe>(SubscribeParams { session: Some("f".into()) }).await.unwrap();
    client.call::<FolderUnmount>(UnmountParams { session: "f".into(), name: "proj".into() }).await.unwrap();
    let saved =
        wait_event(&mut notes, RUN, "shadow_exported", |e| matches!(e.kind, EventKind::ShadowExported { .. })).await;
    match saved.kind {
        EventKind::ShadowExported { folder, path } => {
            assert_eq!(folder, "proj");
            assert!(std::fs::metadata(&path).unwrap().len() > 0, "{}", path.display());
        }
        _ => unreachable!(),
    }
    let info = client.call::<SessionGet>(SessionRef { name: "f".into() }).await.unwrap();
    assert!(!info.folders.iter().any(|f| f.name == "proj"), "{:?}", info.folders);
    let e =
        client.call::<FolderUnmount>(UnmountParams { session: "f".into(), name: "outputs".into() }).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidParams);
    let logs = client.call::<SessionLogsMethod>(LogsParams { name: "f".into(), lines: None }).await.unwrap();
    assert!(logs.events.iter().any(|e| matches!(e.kind, EventKind::FolderUnmounted { .. })));
}

/// A WebSocket echo server in the guest's Python (the standard image has no websockets
/// package): the RFC 6455 handshake, then each frame sent back unmasked; a close ends it.
const WS_ECHO_PY: &str = r#"
import base64, hashlib, socket, sys, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(64)
def serve(c):
    def recvn(n):
        b = b""
        while len(b) < n:
            x = c.recv(n - len(b))
            if not x: raise EOFError
            b += x
        return b
    head = b""
    while b"\r\n\r\n" not in head:
        head += recvn(1)
    key = [l.split(b":", 1)[1].strip() for l in head.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key")][0]
    accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n")
    try:
        while True:
            h = recvn(2); op = h[0] & 15; n = h[1] & 127
            if n == 126: n = int.from_bytes(recvn(2), "big")
            mask = recvn(4) if h[1] & 128 else b"\0\0\0\0"
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(recvn(n)))
            if op == 8:
                c.sendall(b"\x88\x00"); break
            c.sendall(bytes([0x80 | op, len(data)]) + data)
    except EOFError:
        pass
    c.close()
while True:
    c, _ = s.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
"#;

/// HTTP/1.0 GET through an exposed port, retried while the guest's server is not up yet.
async fn http_get(port: u16, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let attempt = async {
            let mut c = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
            c.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes()).await.ok()?;
            let mut out = Vec::new();
            tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut out)).await.ok()?.ok()?;
            Some(String::from_utf8_lossy(&out).into_owned()).filter(|r| r.starts_with("HTTP/1.0 200"))
        };
        if let Some(response) = attempt.await {
            return response;
        }
        assert!(std::time::Instant::now() < deadline, "no 200 for {path} through host port {port}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A WebSocket client: the handshake, then `messages` echoed one by one.
async fn websocket_echo(port: u16, messages: &[&str]) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut c = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let request = "GET /echo HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
                   Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n";
    c.write_all(request.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        head.push(c.read_u8().await.unwrap());
    }
    let head = String::from_utf8_lossy(&head);
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    // RFC 6455's own example key and answer.
    assert!(head.contains("Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo="), "{head}");
    for m in messages {
        let mask = [7u8, 1, 9, 3];
        let mut frame = vec![0x81, 0x80 | m.len() as u8];
        frame.extend_from_slice(&mask);
        frame.extend(m.bytes().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        c.write_all(&frame).await.unwrap();
        let mut h = [0u8; 2];
        c.read_exact(&mut h).await.unwrap();
        assert_eq!(h, [0x81, m.len() as u8]);
        let mut payload = vec![0u8; m.len()];
        c.read_exact(&mut payload).await.unwrap();
        assert_eq!(payload, m.as_bytes());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    c.write_all(&[0x88, 0x80, 0, 0, 0, 0]).await.unwrap();
    let mut h = [0u8; 2];
    c.read_exact(&mut h).await.unwrap();
    assert_eq!(h, [0x88, 0]);
}

/// Exposed ports (issue 31): a guest's `python3 -m http.server` reached from the host through a
/// port exposed at start, and a WebSocket echo server through the port `auto_expose` gave it
/// when it started listening (announced, with its process, by `port_opened`; taken away with
/// `port_closed` when it stops); the ports stay through a stop and resume (a new VM) on the
/// recorded host port; an unexposed port is closed; a bind beyond loopback is refused without
/// umbrad's setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_servers_are_reached_through_exposed_ports() {
    let daemon = TestDaemon::start(
        "daemon-ports",
        serde_json::json!({"bundle": umbra_tests::test_bundle("standard"), "memory_mib": 512}),
    );
    let (client, mut inbox) = daemon.client().await;
    client.call::<EventsSubscribe>(SubscribeParams { session: Some("web".into()) }).await.unwrap();
    let start = StartParams {
        name: "web".into(),
        settings: SettingsPatch { auto_expose: Some(true), ..Default::default() },
        ports: vec![umbra_api::ports::PortSpec { guest_port: 8000, host_port: None, bind: None }],
        ..Default::default()
    };
    let info = client.call::<SessionStart>(start).await.unwrap();
    assert_eq!(info.ports.len(), 1, "{:?}", info.ports);
    let http = info.ports[0].host_port;
    assert!(http != 0 && info.ports[0].bind.is_loopback(), "{:?}", info.ports);

    let serve = |client: &umbra_api::client::Client| {
        let client = client.clone();
        async move {
            let web = sh("web", "mkdir -p /tmp/site && echo hello-from-the-guest > /tmp/site/index.txt && cd /tmp/site && exec python3 -m http.server 8000 --bind 127.0.0.1");
            client.call::<ProcessSpawn>(web).await.unwrap();
            let ws = SpawnParams {
                session: "web".into(),
                argv: vec!["python3".into(), "-c".into(), WS_ECHO_PY.into(), "8765".into()],
                ..Default::default()
            };
            client.call::<ProcessSpawn>(ws).await.unwrap().process
        }
    };
    let ws_process = serve(&client).await;
    let response = http_get(http, "/index.txt").await;
    assert!(response.ends_with("hello-from-the-guest\n"), "{response}");
    // Both servers announced; the WebSocket one exposed on a host port of its own.
    let (mut web_seen, mut ws_port) = (false, None);
    while !web_seen || ws_port.is_none() {
        let ev = wait_event(&mut inbox, Duration::from_secs(30), "port_opened for 8000 and 8765", |e| {
            matches!(e.kind, EventKind::PortOpened { port: 8000 | 8765, .. })
        })
        .await;
        let EventKind::PortOpened { port, process, exposed } = ev.kind else { unreachable!() };
        let process = process.unwrap_or_else(|| panic!("port {port}: no process named"));
        assert!(process.command.starts_with("python3"), "{process:?}");
        let exposed = exposed.unwrap_or_else(|| panic!("port {port} is not exposed"));
        if port == 8000 {
            assert_eq!(exposed.host_port, http, "the port exposed at start");
            web_seen = true;
        } else {
            assert_ne!(exposed.host_port, http);
            ws_port = Some(exposed.host_port);
        }
    }
    let ws_port = ws_port.unwrap();
    websocket_echo(ws_port, &["ping", "a longer message, sent after a pause"]).await;
    // The server stops: announced, and its automatic exposure ends.
    client.call::<ProcessKill>(KillParams { session: "web".into(), process: ws_process, signal: 9 }).await.unwrap();
    wait_event(&mut inbox, Duration::from_secs(30), "port_closed for 8765", |e| {
        matches!(e.kind, EventKind::PortClosed { port: 8765 })
    })
    .await;
    assert!(tokio::net::TcpStream::connect(("127.0.0.1", ws_port)).await.is_err(), "no longer exposed");

    // Beyond loopback needs umbrad's setting.
    let wide = umbra_api::ports::ExposeParams {
        session: "web".into(),
        port: umbra_api::ports::PortSpec { guest_port: 9000, host_port: None, bind: Some("0.0.0.0".parse().unwrap()) },
    };
    let e = client.call::<SessionExpose>(wide).await.unwrap_err();
    assert!(e.message.contains("ports_beyond_loopback"), "{}", e.message);

    // A new VM (stop, resume): the same host port carries to the new guest's server.
    client.call::<SessionStop>(SessionRef { name: "web".into() }).await.unwrap();
    // No VM: a connection is reset at once (the reset may already meet the connect).
    if let Ok(mut c) = tokio::net::TcpStream::connect(("127.0.0.1", http)).await {
        let mut byte = [0u8; 1];
        let closed =
            tokio::time::timeout(Duration::from_secs(10), tokio::io::AsyncReadExt::read(&mut c, &mut byte)).await;
        assert!(matches!(closed, Ok(Ok(0) | Err(_))), "no VM: the connection is closed at once ({closed:?})");
    }
    client.call::<SessionResume>(ResumeParams { name: "web".into(), discard_snapshot: false }).await.unwrap();
    serve(&client).await;
    assert!(http_get(http, "/index.txt").await.ends_with("hello-from-the-guest\n"));
    let list = client.call::<SessionPorts>(SessionRef { name: "web".into() }).await.unwrap();
    assert_eq!(list.ports.iter().find(|p| p.guest_port == 8000).map(|p| p.host_port), Some(http), "{list:?}");

    client
        .call::<SessionUnexpose>(umbra_api::ports::UnexposeParams { session: "web".into(), guest_port: 8000 })
        .await
        .unwrap();
    assert!(tokio::net::TcpStream::connect(("127.0.0.1", http)).await.is_err(), "unexposed: nothing listens");
    client.call::<SessionDelete>(SessionRef { name: "web".into() }).await.unwrap();
}

/// Output of kept process `process` from its `process.event`s (acknowledged as consumed), until
/// `done` says the bytes so far are enough or the process exits: (stdout, stderr, exit). Each
/// chunk must start where the previous one of its stream ended (after the first).
async fn kept_output(
    client: &umbra_api::client::Client,
    inbox: &mut umbra_tests::daemon::Inbox,
    session: &str,
    process: u64,
    done: impl Fn(&[u8]) -> bool,
) -> (Vec<u8>, Vec<u8>, Option<umbra_api::ProcessExit>, [Option<u64>; 2]) {
    let (mut out, mut err, mut first, mut next) = (Vec::new(), Vec::new(), [None; 2], [None::<u64>; 2]);
    loop {
        let ev = wait_event(inbox, RUN, "output of the kept process", |e| match &e.kind {
            EventKind::Stdout { process: p, .. } | EventKind::Stderr { process: p, .. } => *p == process,
            EventKind::Exit(x) => x.process == process,
            _ => false,
        })
        .await;
        let (stream, data, offset) = match ev.kind {
            EventKind::Stdout { data, offset, .. } => (Stream::Stdout, data, offset),
            EventKind::Stderr { data, offset, .. } => (Stream::Stderr, data, offset),
            EventKind::Exit(x) => return (out, err, Some(x), first),
            _ => unreachable!(),
        };
        let bytes = data.to_bytes().unwrap();
        let i = stream as usize;
        let offset = offset.expect("a kept process's output says where it starts");
        first[i].get_or_insert(offset);
        if let Some(n) = next[i] {
            assert_eq!(offset, n, "{stream:?} continues where it left off");
        }
        next[i] = Some(offset + bytes.len() as u64);
        let ack = AckParams { session: session.into(), process, stream, bytes: bytes.len() as u64 };
        client.notify::<ProcessAck>(ack).await.unwrap();
        match stream {
            Stream::Stdout => out.extend(bytes),
            Stream::Stderr => err.extend(bytes),
        }
        if done(&out) {
            return (out, err, None, first);
        }
    }
}

/// A detached process survives its client: another lists it, attaches, and receives all of its
/// output byte for byte, then its exit (and again from an offset). A terminal keeps its shell's
/// variables, working directory and scrollback across clients; `terminal.run` reports the exit
/// status and the working directory through the shell's marker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detached_processes_and_terminals_outlive_their_client() {
    use umbra_api::kept::*;
    let daemon = TestDaemon::start("daemon-kept", serde_json::json!({}));
    let (client, mut inbox) = daemon.client().await;
    client.call::<SessionStart>(StartParams { name: "k".into(), ..Default::default() }).await.unwrap();
    let counter = "i=0; while [ $i -lt 300 ]; do echo line-$i; i=$((i+1)); sleep 0.01; done; echo done >&2; exit 3";
    let expected: Vec<u8> = (0..300).flat_map(|i| format!("line-{i}\n").into_bytes()).collect();
    let spawned = client.call::<ProcessSpawn>(SpawnParams { detach: true, ..sh("k", counter) }).await.unwrap();
    let (some, _, exit, _) = kept_output(&client, &mut inbox, "k", spawned.process, |o| o.len() >= 7).await;
    assert!(exit.is_none() && expected.starts_with(&some), "{:?}", String::from_utf8_lossy(&some));
    // The client is killed mid-command.
    drop((client, inbox));

    let (client, mut inbox) = daemon.client().await;
    let list = client.call::<ProcessListMethod>(InSession { session: "k".into() }).await.unwrap();
    let info = list.processes.iter().find(|p| p.process == spawned.process).expect("listed");
    assert!(info.detached && !info.terminal && info.argv[0] == "sh", "{info:?}");
    let attach = AttachParams { session: "k".into(), process: spawned.process, from: Default::default() };
    let attached = client.call::<ProcessAttach>(attach.clone()).await.unwrap();
    assert_eq!(attached.pid, spawned.pid);
    let (out, err, exit, first) = kept_output(&client, &mut inbox, "k", spawned.process, |_| false).await;
    assert_eq!(String::from_utf8_lossy(&out), String::from_utf8_lossy(&expected), "every byte, in order");
    assert_eq!((err.as_slice(), exit.unwrap().code, first[0]), (&b"done\n"[..], Some(3), Some(0)));
    // Finished, it stays: attached again from an offset, the rest of it and the exit.
    let from = OutputOffsets { stdout: 1000, stderr: 5 };
    client.call::<ProcessAttach>(AttachParams { from, ..attach.clone() }).await.unwrap();
    let (rest, err, exit, first) = kept_output(&client, &mut inbox, "k", spawned.process, |_| false).await;
    assert_eq!((rest.as_slice(), err.len(), first[0]), (&expected[1000..], 0, Some(1000)));
    assert_eq!(exit.unwrap().code, Some(3));
    let e = client.call::<ProcessAttach>(AttachParams { process: 999_999, ..attach }).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::NotFound, "{}", e.message);

    // A terminal: state set by terminal.run and by typing stays across clients.
    let open = TerminalOpenParams {
        session: "k".into(),
        shell: Vec::new(),
        cwd: None,
        env: Default::default(),
        size: TtySize { rows: 24, cols: 80 },
    };
    let term = client.call::<TerminalOpen>(open).await.unwrap().terminal;
    let run = |command: &str| TerminalRunParams {
        session: "k".into(),
        terminal: term,
        command: command.into(),
        timeout_secs: Some(60),
    };
    let r = client.call::<TerminalRun>(run("cd /tmp && mkdir -p 'a dir' && cd 'a dir' && FOO=bar-baz")).await.unwrap();
    assert_eq!((r.exit_code, r.cwd.as_str()), (0, "/tmp/a dir"));
    let r = client.call::<TerminalRun>(run("false")).await.unwrap();
    assert_eq!((r.exit_code, r.cwd.as_str()), (1, "/tmp/a dir"));
    let r = client.call::<TerminalRun>(run("echo 'it''s'\necho two lines; (exit 42)")).await.unwrap();
    assert_eq!(r.exit_code, 42, "a command of several lines, quotes included");
    let r = client.call::<TerminalRun>(run("echo 'unterminated")).await.unwrap();
    assert_eq!((r.exit_code, r.cwd.as_str()), (2, "/tmp/a dir"), "a syntax error is status 2, the shell unharmed");
    // Longer than a line editor takes, with control characters (Ctrl-U would erase a typed
    // line): run as written.
    let long = format!(": {}; [ \"$(printf 'a\x15b')\" = \"$(printf 'a\\025b')\" ]", "x".repeat(10_000));
    assert_eq!(client.call::<TerminalRun>(run(&long)).await.unwrap().exit_code, 0);
    let typed = StdinParams {
        session: "k".into(),
        process: term,
        data: Data::from_bytes(b"echo typed-$FOO\n"),
        writer: None,
        offset: None,
    };
    client.call::<ProcessStdin>(typed).await.unwrap();
    kept_output(&client, &mut inbox, "k", term, |o| o.windows(13).any(|w| w == b"typed-bar-baz")).await;
    drop((client, inbox));

    let (client, mut inbox) = daemon.client().await;
    let terms = client.call::<TerminalListMethod>(InSession { session: "k".into() }).await.unwrap().terminals;
    assert_eq!(terms.iter().map(|t| t.terminal).collect::<Vec<_>>(), vec![term]);
    assert!(terms[0].exit.is_none() && terms[0].output.end > 0, "{:?}", terms[0]);
    client.call::<TerminalAttach>(TerminalAttachParams { session: "k".into(), terminal: term, from: 0 }).await.unwrap();
    // The scrollback comes back first: what was typed and printed before.
    let (scrollback, _, _, first) =
        kept_output(&client, &mut inbox, "k", term, |o| o.windows(13).any(|w| w == b"typed-bar-baz")).await;
    assert_eq!(first[0], Some(0));
    assert!(String::from_utf8_lossy(&scrollback).contains("two lines"), "{}", String::from_utf8_lossy(&scrollback));
    let r = client.call::<TerminalRun>(run("[ \"$FOO\" = bar-baz ]")).await.unwrap();
    assert_eq!((r.exit_code, r.cwd.as_str()), (0, "/tmp/a dir"), "the shell kept its variables and directory");
    let resize = TerminalResizeParams { session: "k".into(), terminal: term, rows: 40, cols: 100 };
    client.call::<TerminalResize>(resize).await.unwrap();
    assert_eq!(client.call::<TerminalRun>(run("[ \"$(stty size)\" = '40 100' ]")).await.unwrap().exit_code, 0);
    client.call::<TerminalClose>(TerminalRef { session: "k".into(), terminal: term }).await.unwrap();
    let (_, _, exit, _) = kept_output(&client, &mut inbox, "k", term, |_| false).await;
    assert!(exit.is_some(), "the attached client hears the shell end");
    let e = client.call::<TerminalRun>(run("true")).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidParams, "{}", e.message);

    // vmctl on a terminal: a new terminal, Ctrl-] detaches, `ps` lists it, attaching again
    // shows it, and the shell's exit is vmctl's status.
    let (out, status) = on_a_terminal(
        &daemon.socket,
        &["session", "attach", "k"],
        &[("Ctrl-] detaches", "echo hi-$((6*7))\n"), ("hi-42", "\x1d")],
    )
    .await;
    assert!(status == 0 && out.contains("detached; terminal "), "{status}: {out}");
    let id: u64 = out
        .split("vmctl session attach k ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("{out}"));
    let ps = std::process::Command::new(umbra_tests::workspace_bin("vmctl"))
        .args(["session", "ps", "k"])
        .env("UMBRA_SOCKET", &daemon.socket)
        .output()
        .unwrap();
    let ps = String::from_utf8_lossy(&ps.stdout).into_owned();
    assert!(
        ps.lines().any(|l| l.starts_with(&id.to_string()) && l.contains("terminal") && l.contains("running")),
        "{ps}"
    );
    let id = id.to_string();
    let (out, status) = on_a_terminal(&daemon.socket, &["session", "attach", "k", &id], &[("hi-42", "exit 3\n")]).await;
    assert_eq!(status, 3, "{out}");
}

/// vmctl on a pseudo-terminal, talking to `socket`'s umbrad.
async fn on_a_terminal(socket: &std::path::Path, args: &[&str], steps: &[(&str, &str)]) -> (String, i32) {
    let vmctl = umbra_tests::workspace_bin("vmctl");
    let socket = socket.to_str().unwrap();
    umbra_tests::pty::on_a_terminal(&vmctl, args, &[("UMBRA_SOCKET", socket)], steps).await
}

/// The machine's system policy (issue: the administrator's layer): run as root, which owns it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_system_policy_is_a_ceiling_no_client_can_loosen() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: a system policy must be root's (run the suite as root)");
        return;
    }
    // Turned off: no session starts; the daemon says why it is so.
    let off = serde_json::json!({"enabled": false});
    let daemon = TestDaemon::start_with_system_policy("daemon-system-off", serde_json::json!({}), &off);
    let (client, _notes) = daemon.client().await;
    let info = client.call::<DaemonInfoMethod>(NoParams {}).await.unwrap();
    let system = info.system_policy.expect("daemon.info shows the system policy");
    assert!(!system.policy.enabled && system.path == TestDaemon::system_policy_path(&daemon.dir.0));
    let e = client.call::<SessionStart>(StartParams { name: "s".into(), ..Default::default() }).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::DisabledByAdmin, "{e:?}");
    assert!(e.message.contains("administrator"), "{}", e.message);
    drop((client, daemon));

    // Ceilings: what a client asks beyond one, it is held to.
    let dir = umbra_tests::TempDir::new("daemon-system-ceilings");
    let trusted = dir.0.join("trusted");
    std::fs::create_dir_all(trusted.join("project/.git")).unwrap();
    let elsewhere = dir.0.join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    let ceilings = serde_json::json!({
        "trusted_roots": [trusted],
        "max_memory_mib": 256,
        "max_cpus": 1,
        "network": {"mode": "none"},
        "approval_mode": "allowlist",
        "block_git_writes": true,
    });
    umbra_tests::daemon::write_system_policy(&dir.0.join("d"), &ceilings);
    let daemon = TestDaemon::start_in(dir.0.join("d"), serde_json::json!({}));
    let (client, _notes) = daemon.client().await;
    let loosen = SettingsPatch {
        memory_mib: Some(4096),
        cpus: Some(4),
        network: Some(umbra_api::session::NetworkPolicy {
            mode: umbra_api::session::NetworkMode::Any,
            ..Default::default()
        }),
        ..Default::default()
    };
    let config = client
        .call::<ConfigSet>(umbra_api::ConfigPatch { session: loosen.clone(), ..Default::default() })
        .await
        .unwrap();
    assert_eq!((config.session.memory_mib, config.session.cpus), (256, 1), "config.set gets the ceiling");
    assert_eq!(config.session.network.mode, umbra_api::session::NetworkMode::None);
    let folder = |path: std::path::PathBuf| FolderSpec { path, name: None, mode: ShareMode::Rw };
    let e = client
        .call::<SessionStart>(StartParams {
            name: "out".into(),
            folders: vec![folder(elsewhere)],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::PermissionDenied, "{e:?}");
    assert!(e.message.contains("not beneath a folder the system policy trusts"), "{}", e.message);
    let info = client
        .call::<SessionStart>(StartParams {
            name: "in".into(),
            folders: vec![folder(trusted.join("project"))],
            settings: loosen,
            ..Default::default()
        })
        .await
        .unwrap();
    let s = &info.settings;
    assert_eq!((s.memory_mib, s.cpus, s.network.mode), (256, 1, umbra_api::session::NetworkMode::None), "{s:?}");
    assert_eq!(s.policy.block_git_writes, Some(true));
    assert_eq!(s.approval.as_ref().map(|a| a.mode), Some(umbra_policy::approval::ApprovalMode::Allowlist));
    let decided = info.policy_decided_by.expect("who decided");
    assert_eq!(decided.network.first(), Some(&umbra_policy::PolicySource::System), "{decided:?}");
    assert_eq!(decided.block_git_writes.first(), Some(&umbra_policy::PolicySource::System), "{decided:?}");
    // Nor can a running session's network go beyond it.
    let wider = umbra_api::session::NetworkPolicy { mode: umbra_api::session::NetworkMode::Any, ..Default::default() };
    let e = client.call::<SessionSetNetwork>(SetNetworkParams { name: "in".into(), network: wider }).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::PermissionDenied, "{e:?}");
    client.call::<SessionStop>(SessionRef { name: "in".into() }).await.unwrap();
    drop((client, daemon));

    // A policy file the user could have written is refused, and umbrad does not start.
    use std::os::unix::fs::PermissionsExt;
    umbra_tests::daemon::write_system_policy(&dir.0.join("r"), &ceilings);
    let path = TestDaemon::system_policy_path(&dir.0.join("r"));
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
    let out = std::process::Command::new(umbra_tests::workspace_bin("umbrad"))
        .arg("--socket")
        .arg(dir.0.join("refused.sock"))
        .arg("--config")
        .arg(dir.0.join("refused.json"))
        .arg("--system-policy")
        .arg(&path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("writable by its group or by everyone (mode 0666)") && stderr.contains("refusing"),
        "{stderr}"
    );
    assert!(!dir.0.join("refused.sock").exists(), "it never listened");
}

/// `session.update` on a running session, and configuration edits on disk announced and in
/// force without a restart (issue: settings that change on a live session).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_change_on_a_live_session_and_edited_files_take_effect() {
    let daemon = TestDaemon::start("daemon-update", serde_json::json!({}));
    let (client, mut notes) = daemon.client().await;
    client.call::<EventsSubscribe>(SubscribeParams { session: None }).await.unwrap();
    client.call::<SessionStart>(StartParams { name: "u".into(), ..Default::default() }).await.unwrap();

    let deny_echo = umbra_policy::approval::ApprovalSettings {
        mode: umbra_policy::approval::ApprovalMode::RunEverything,
        deny: vec!["echo".into()],
        ..Default::default()
    };
    let allowlist = umbra_api::session::NetworkPolicy {
        mode: umbra_api::session::NetworkMode::Allowlist,
        allow_domains: vec!["example.com".into()],
        ..Default::default()
    };
    let update = UpdateParams {
        name: "u".into(),
        settings: SettingsPatch {
            approval: Some(deny_echo),
            network: Some(allowlist),
            idle_timeout_secs: Some(600),
            memory_mib: Some(300),
            ..Default::default()
        },
    };
    let updated = client.call::<SessionUpdate>(update).await.unwrap();
    assert_eq!(updated.applied, ["approval", "network", "idle_timeout_secs"], "{updated:?}");
    assert_eq!(updated.next_boot, ["memory_mib"]);
    let s = &updated.session.settings;
    assert_eq!((s.memory_mib, s.idle_timeout_secs), (300, 600));
    assert_eq!(
        updated.session.vm.as_ref().map(|_| updated.session.status),
        Some(SessionStatus::Ready),
        "still running"
    );
    // The approval rules are in force at once, on the same VM.
    let e = client.call::<ProcessSpawn>(sh("u", "echo refused")).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::PermissionDenied, "{e:?}");
    let p = client.call::<ProcessSpawn>(sh("u", "true")).await.unwrap();
    let (_, _, exit) = process_output(&client, &mut notes, "u", p.process, RUN).await;
    assert_eq!(exit.code, Some(0));
    let e = client
        .call::<SessionUpdate>(UpdateParams {
            name: "nope".into(),
            settings: SettingsPatch { cpus: Some(2), ..Default::default() },
        })
        .await
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::SessionNotFound);

    // The configuration file edited by hand: in force, and announced.
    let path = daemon.dir.0.join("config/umbra/umbrad.json");
    let mut config: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    config["memory_mib"] = serde_json::json!(320);
    std::fs::write(&path, serde_json::to_vec(&config).unwrap()).unwrap();
    let changed = wait_event(
        &mut notes,
        Duration::from_secs(20),
        "config_changed",
        |e| matches!(&e.kind, EventKind::ConfigChanged { what, .. } if what == "configuration"),
    )
    .await;
    assert!(matches!(changed.kind, EventKind::ConfigChanged { path: p, .. } if p == path));
    assert_eq!(client.call::<ConfigGet>(NoParams {}).await.unwrap().session.memory_mib, 320);
    // A broken edit is not used: the configuration in force stays.
    std::fs::write(&path, b"{\"memory_mib\": \"lots\"}").unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(client.call::<ConfigGet>(NoParams {}).await.unwrap().session.memory_mib, 320);

    // The system policy appearing (as root, who alone may write one) holds the configuration.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        umbra_tests::daemon::write_system_policy(&daemon.dir.0, &serde_json::json!({"max_memory_mib": 256}));
        wait_event(
            &mut notes,
            Duration::from_secs(20),
            "config_changed",
            |e| matches!(&e.kind, EventKind::ConfigChanged { what, .. } if what == "system_policy"),
        )
        .await;
        let info = client.call::<DaemonInfoMethod>(NoParams {}).await.unwrap();
        assert_eq!(info.system_policy.map(|s| s.policy.max_memory_mib), Some(Some(256)));
        assert_eq!(client.call::<ConfigGet>(NoParams {}).await.unwrap().session.memory_mib, 256);
        let info = client.call::<SessionGet>(SessionRef { name: "u".into() }).await.unwrap();
        assert_eq!(info.settings.memory_mib, 256, "the session's record is held to it too");
    }
}
