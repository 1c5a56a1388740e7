//! The agent on a Unix socket with real processes: output, exit codes, signals, stdin, env, cwd,
//! PTYs, many concurrent processes, file requests and a dropped connection.

use std::time::Duration;

use umbra_proto::{ErrorCode, SpawnRequest, TtySize, WriteFileRequest, WriteMode};
use umbra_runtime::agent::{ClientError, ExecCheck, ProcessEvent};
use umbra_tests::{process_state, zombie_children, HostAgent, TempDir};

fn sh(script: &str) -> SpawnRequest {
    SpawnRequest { argv: vec!["sh".into(), "-c".into(), script.into()], ..Default::default() }
}

#[tokio::test]
async fn echo_output_and_exit_codes() {
    let agent = HostAgent::start().await;
    let client = agent.connect().await;
    assert!(client.agent_info().software.starts_with("umbra-agent"));
    assert!(!client.agent_info().pid1);

    let out = client.spawn(SpawnRequest { argv: vec!["echo".into(), "hello".into()], ..Default::default() }).unwrap();
    let out = out.output().await.unwrap();
    assert_eq!(out.stdout, b"hello\n");
    assert_eq!((out.status.code, out.status.signal), (Some(0), None));
    assert!(out.pid > 0);

    let out = client.spawn(sh("echo out; echo err >&2; exit 3")).unwrap().output().await.unwrap();
    assert_eq!((out.stdout.as_slice(), out.stderr.as_slice()), (&b"out\n"[..], &b"err\n"[..]));
    assert_eq!(out.status.code, Some(3));
}

#[tokio::test]
async fn signals_are_reported_as_signals() {
    let agent = HostAgent::start().await;
    let client = agent.connect().await;
    let out = client.spawn(sh("kill -TERM $$")).unwrap().output().await.unwrap();
    assert_eq!((out.status.code, out.status.signal), (None, Some(15)));
    assert_eq!(out.status.shell_code(), 143);

    // kill() from the host reaches the process (and its group).
    let mut p = client.spawn(sh("sleep 30 & wait")).unwrap();
    assert!(matches!(p.next_event().await, Some(ProcessEvent::Spawned { .. })));
    p.kill(15).await.unwrap();
    let out = p.output().await.unwrap();
    assert_eq!(out.status.signal, Some(15));
    assert!(out.status.duration_ms < 10_000);

    // kill_all refuses a bogus signal and reaches every process of the connection.
    let e = client.kill_all(999).await.unwrap_err();
    assert_eq!(e.agent_error().unwrap().code, ErrorCode::BadRequest);
    let mut a = client.spawn(sh("sleep 30")).unwrap();
    let mut b = client.spawn(sh("sleep 30")).unwrap();
    for p in [&mut a, &mut b] {
        assert!(matches!(p.next_event().await, Some(ProcessEvent::Spawned { .. })));
    }
    client.kill_all(9).await.unwrap();
    assert_eq!(a.output().await.unwrap().status.signal, Some(9));
    assert_eq!(b.output().await.unwrap().status.signal, Some(9));
}

#[tokio::test]
async fn stdin_is_echoed_through_cat_even_when_written_before_the_spawn_is_confirmed() {
    let agent = HostAgent::start().await;
    let client = agent.connect().await;
    let p = client.spawn(SpawnRequest { argv: vec!["cat".into()], ..Default::default() }).unwrap();
    let stdin = p.stdin();
    // Written immediately: the client holds it until the spawn confirmation arrives.
    let payload: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let writer = {
        let payload = payload.clone();
        tokio::spawn(async move {
            stdin.write(&b"first line\n"[..]).await.unwrap();
            stdin.write(payload).await.unwrap();
            stdin.close().await.unwrap();
        })
    };
    let out = p.output().await.unwrap();
    writer.await.unwrap();
    assert_eq!(&out.stdout[..11], b"first line\n");
    assert!(out.stdout[11..] == payload[..], "3 MB through cat came back intact (more than the stdin credit window)");
    assert_eq!(out.status.code, Some(0));
}

#[tokio::test]
async fn env_and_cwd_are_honoured() {
    let agent = HostAgent::start().await;
    let client = agent.connect().await;
    let dir = TempDir::new("cwd");
    let mut req = sh("echo \"$GREETING\"; pwd; echo \"$HOME\"");
    req.env.insert("GREETING".into(), "hi there".into());
    req.cwd = Some(dir.0.display().to_string());
    let out = client.spawn(req).unwrap().output().await.unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text, format!("hi there\n{}\n/root\n", dir.0.display()));

    // A missing cwd or program is a spawn failure that says what and why.
    let mut req = sh("true");
    req.cwd = Some("/nonexistent-umbra-dir".into());
    let e = client.spawn(req).unwrap().output().await.unwrap_err();
    let e = e.agent_error().expect("agent error").clone();
    assert_eq!(e.code, ErrorCode::SpawnFailed);
    assert!(e.message.contains("/nonexistent-umbra-dir"), "{}", e.message);
    let e = client.spawn(SpawnRequest { argv: vec!["no-such-program-umbra".into()], ..Default::default() }).unwrap();
    let e = e.output().await.unwrap_err();
    assert!(e.to_string().contains("no-such-program-umbra"), "{e}");
    assert_eq!(e.agent_error().expect("agent error").code, ErrorCode::NotFound, "{e}");
    let missing = dir.0.join("missing-program");
    let e = client.spawn(SpawnRequest { argv: vec![missing.display().to_string()], ..Default::default() }).unwrap();
    let e = e.output().await.unwrap_err();
    assert_eq!(e.agent_error().expect("agent error").code, ErrorCode::NotFound, "{e}");
    // A file without execute permission cannot be run (EACCES).
    let not_executable = dir.0.join("not-executable");
    std::fs::write(&not_executable, "#!/bin/sh\necho ran\n").unwrap();
    let e = client.spawn(SpawnRequest { argv: vec![not_executable.display().to_string()], ..Default::default() });
    let e = e.unwrap().output().await.unwrap_err();
    assert_eq!(e.agent_error().expect("agent error").code, ErrorCode::PermissionDenied, "{e}");
    assert!(e.to_string().contains("not-executable"), "{e}");

    // Paths must be absolute: a relative cwd (or unmount path) is a bad request.
    let mut req = sh("true");
    req.cwd = Some("tmp".into());
    let e = client.spawn(req).unwrap().output().await.unwrap_err();
    assert_eq!(e.agent_error().expect("agent error").code, ErrorCode::BadRequest, "{e}");
    let e = client.unmount("mnt").await.unwrap_err();
    assert_eq!(e.agent_error().expect("agent error").code, ErrorCode::BadRequest, "{e}");
}

#[tokio::test]
async fn pty_process_sees_a_terminal_and_its_new_size() {
    let agent = HostAgent::start().await;
    let client = agent.connect().await;
    let mut req = sh("test -t 0 && test -t 1 && echo is-a-tty; stty size; read line; stty size");
    req.tty = Some(TtySize { rows: 24, cols: 80 });
    let mut p = client.spawn(req).unwrap();
    let mut seen = String::new();
    let mut resized = false;
    let status = loop {
        match tokio::time::timeout(Duration::from_secs(10), p.next_event()).await.expect("pty output") {
            Some(ProcessEvent::Stdout(b)) => seen.push_str(&String::from_utf8_lossy(&b)),
            Some(ProcessEvent::Exit(s)) => break s,
            Some(ProcessEvent::Spawned { .. }) => {}
            other => panic!("unexpected {other:?}"),
        }
        if !resized && seen.contains("24 80") {
            p.resize(40, 100).await.unwrap();
            p.stdin().write(&b"go\n"[..]).await.unwrap();
            resized = true;
        }
    };
    assert!(seen.contains("is-a-tty"), "{seen:?}");
    assert!(seen.contains("40 100"), "new size after resize: {seen:?}");
    assert_eq!(status.code, Some(0));

    // Resizing a process without a terminal is a clear error.
    let p = client.spawn(sh("sleep 5")).unwrap();
    let e = p.resize(1, 1).await.unwrap_err();
    assert_eq!(e.agent_error().unwrap().code, ErrorCode::Unsupported);
}

#[tokio::test]
async fn two_hundred_concurrent_processes_all_exit_and_leave_no_zombie() {
    let agent = HostAgent::start().await;
    let client = agent.connect().await;
    let procs: Vec<_> = (0..200).map(|i| client.spawn(sh(&format!("echo {i}; exit $(({i} % 7))"))).unwrap()).collect();
    let results = futures_util::future::join_all(procs.into_iter().map(|p| p.output())).await;
    for (i, r) in results.into_iter().enumerate() {
        let out = r.unwrap();
        assert_eq!(out.stdout, format!("{i}\n").into_bytes());
        assert_eq!(out.status.code, Some((i % 7) as i32));
    }
    // Orphans too: the background child outlives its parent and is reaped by the agent.
    let out = client.spawn(sh("sleep 0.2 >/dev/null 2>&1 & echo parent-done")).unwrap().output().await.unwrap();
    assert_eq!(out.stdout, b"parent-done\n");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(zombie_children(agent.pid()), Vec::<u32>::new());
    assert_eq!(client.stats().await.unwrap().agent_processes, 0);
}

#[tokio::test]
async fn files_and_stats() {
    let agent = HostAgent::start().await;
    let client = agent.connect().await;
    let dir = TempDir::new("files");
    let path = dir.0.join("a/b.bin").display().to_string();
    let data: Vec<u8> = (0..=255u8).cycle().take(100_000).collect();
    let req =
        WriteFileRequest { path: path.clone(), mode: WriteMode::Truncate, permissions: Some(0o600), create_dirs: true };
    assert_eq!(client.write_file(req, &data).await.unwrap(), 100_000);
    let (back, eof) = client.read_file(&path, 0, 1 << 20).await.unwrap();
    assert!(eof && back == data);
    let st = client.stat(&path).await.unwrap();
    assert_eq!((st.size, st.mode & 0o777), (100_000, 0o600));
    let (entries, _) = client.list_dir(&dir.0.join("a").display().to_string(), None).await.unwrap();
    assert_eq!(entries.len(), 1);
    let e = client.read_file("/nonexistent/f", 0, 10).await.unwrap_err();
    assert_eq!(e.agent_error().unwrap().code, ErrorCode::NotFound);
    let e = client.read_file(&path, 0, u32::MAX).await.unwrap_err();
    assert_eq!(e.agent_error().unwrap().code, ErrorCode::TooLarge);
    // A FIFO is refused at once instead of blocking the request on its other end.
    let fifo = dir.0.join("fifo");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let fifo = fifo.display().to_string();
    let read = tokio::time::timeout(Duration::from_secs(5), client.read_file(&fifo, 0, 10));
    let e = read.await.expect("answered, not blocked").unwrap_err();
    assert_eq!(e.agent_error().unwrap().code, ErrorCode::BadRequest, "{e}");
    let stats = client.stats().await.unwrap();
    assert!(stats.mem_total_kib > 0 && stats.processes > 0);
    assert!(client.ping().await.unwrap() < Duration::from_secs(60));
}

#[tokio::test]
async fn a_dropped_connection_ends_open_processes_with_an_error_naming_the_cause() {
    let mut agent = HostAgent::start().await;
    let client = agent.connect().await;
    let mut p = client.spawn(sh("sleep 30")).unwrap();
    assert!(matches!(p.next_event().await, Some(ProcessEvent::Spawned { .. })));
    agent.child.kill().unwrap();
    let event = tokio::time::timeout(Duration::from_secs(5), p.next_event()).await.expect("error event, not a hang");
    match event {
        Some(ProcessEvent::Error(msg)) => assert!(msg.contains("agent closed the connection"), "{msg}"),
        other => panic!("expected an error event, got {other:?}"),
    }
    assert!(p.next_event().await.is_none());
    let e = client.ping().await.unwrap_err();
    assert!(matches!(e, ClientError::ConnectionLost(_)), "{e}");
}

#[tokio::test]
async fn listing_a_huge_directory_is_truncated_to_fit_one_response() {
    let agent = HostAgent::start().await;
    let client = agent.connect().await.with_call_timeout(Duration::from_secs(20));
    let dir = TempDir::new("bigdir");
    // 12 000 names of 200 bytes: about 2.8 MB of listing, more than one frame holds.
    for i in 0..12_000 {
        std::fs::File::create(dir.0.join(format!("{i:0>200}"))).unwrap();
    }
    let (entries, truncated) = client.list_dir(&dir.0.display().to_string(), Some(100_000)).await.unwrap();
    assert!(truncated);
    assert!(entries.len() > 5_000 && entries.len() < 12_000, "{} entries", entries.len());
}

#[tokio::test]
async fn kill_after_the_exit_ends_the_drain_of_background_output() {
    let agent = HostAgent::start().await;
    let client = agent.connect().await;
    // The shell exits at once; its background loop keeps stdout busy, so the drain never idles.
    let mut p = client.spawn(sh("(while :; do echo x; sleep 0.01; done) & exit 0")).unwrap();
    assert!(matches!(p.next_event().await, Some(ProcessEvent::Spawned { .. })));
    assert!(matches!(p.next_event().await, Some(ProcessEvent::Stdout(_))));
    tokio::time::sleep(Duration::from_millis(200)).await;
    p.kill(9).await.unwrap();
    let status = loop {
        match tokio::time::timeout(Duration::from_secs(5), p.next_event()).await.expect("exit after kill") {
            Some(ProcessEvent::Stdout(_)) => {}
            Some(ProcessEvent::Exit(s)) => break s,
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(status.code, Some(0), "the shell itself exited normally");
}

#[tokio::test]
async fn shutdown_of_a_host_side_agent_kills_its_processes() {
    let mut agent = HostAgent::start().await;
    let client = agent.connect().await;
    let mut p = client.spawn(sh("exec sleep 30")).unwrap();
    let Some(ProcessEvent::Spawned { pid }) = p.next_event().await else { panic!("spawned") };
    client.shutdown().await.unwrap();
    let exited = tokio::task::spawn_blocking(move || agent.child.wait().map(|_| agent));
    let _agent = tokio::time::timeout(Duration::from_secs(5), exited).await.expect("agent exits").unwrap().unwrap();
    // Killed, then reaped by whoever inherited it (or a zombie until then): not running.
    let mut state = process_state(pid);
    for _ in 0..50 {
        if matches!(state, None | Some('Z')) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        state = process_state(pid);
    }
    assert!(matches!(state, None | Some('Z')), "pid {pid} outlived the agent in state {state:?}");
}

/// Reads a running process's stdout into `out` until it holds at least `n` bytes.
async fn stdout_at_least(p: &mut umbra_runtime::agent::Process, out: &mut Vec<u8>, n: usize) {
    while out.len() < n {
        match p.next_event().await.unwrap() {
            ProcessEvent::Stdout(b) => out.extend_from_slice(&b),
            ProcessEvent::Spawned { .. } => {}
            other => panic!("{other:?}"),
        }
    }
}

/// Reads a process's stdout until it is parked (its token) or exits (`None`).
async fn stdout_until_parked(p: &mut umbra_runtime::agent::Process, out: &mut Vec<u8>) -> Option<u64> {
    loop {
        match tokio::time::timeout(Duration::from_secs(30), p.next_event()).await.expect("an event") {
            Some(ProcessEvent::Stdout(b)) => out.extend_from_slice(&b),
            Some(ProcessEvent::Parked { token }) => return Some(token),
            Some(ProcessEvent::Exit(_)) | None => return None,
            Some(_) => {}
        }
    }
}

#[tokio::test]
async fn a_parked_process_outlives_its_connection_and_another_adopts_it_with_nothing_lost() {
    let agent = HostAgent::start().await;
    let first = agent.connect().await;
    assert!(first.parks(), "{:?}", first.agent_info().capabilities);
    // Counts to 200000 (1.3 MB, more than the 1 MiB of output credit, which this test does not
    // give back before the park): some of it before the park, some while parked (in its pipe),
    // the rest after the adoption.
    let mut counter = first.spawn(sh("i=0; while [ $i -lt 200000 ]; do i=$((i+1)); echo $i; done")).unwrap();
    let mut cat = first.spawn(SpawnRequest { argv: vec!["cat".into()], ..Default::default() }).unwrap();
    let mut owned = first.spawn(sh("sleep 30")).unwrap();
    let Some(ProcessEvent::Spawned { pid: owned_pid }) = owned.next_event().await else { panic!("no spawn") };
    let mut seen = Vec::new();
    stdout_at_least(&mut counter, &mut seen, 100).await;
    cat.stdin().write(&b"before\n"[..]).await.unwrap();
    let mut cat_out = Vec::new();
    stdout_at_least(&mut cat, &mut cat_out, 7).await;
    let parked = first.park(&[counter.id(), cat.id(), 999]).await.unwrap();
    assert_eq!(parked.len(), 2, "only running processes of the connection: {parked:?}");
    let counter_token = stdout_until_parked(&mut counter, &mut seen).await.expect("parked");
    let cat_token = stdout_until_parked(&mut cat, &mut cat_out).await.expect("parked");
    assert_eq!(cat_out, b"before\n");
    drop((counter, cat, owned, first));
    tokio::time::sleep(Duration::from_millis(300)).await;

    let second = agent.connect().await;
    let mut counter = second.adopt(counter_token).unwrap();
    assert!(matches!(counter.next_event().await, Some(ProcessEvent::Spawned { .. })));
    let out = counter.output().await.unwrap();
    seen.extend_from_slice(&out.stdout);
    let expected: String = (1..=200000).map(|i| format!("{i}\n")).collect();
    assert!(seen == expected.as_bytes(), "every line once, in order, across the two connections");
    assert_eq!(out.status.code, Some(0));

    // Stdin goes on with the new connection's credit (more than a window of it).
    let mut cat = second.adopt(cat_token).unwrap();
    assert!(matches!(cat.next_event().await, Some(ProcessEvent::Spawned { .. })));
    let payload: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
    let stdin = cat.stdin();
    let writer = {
        let payload = payload.clone();
        tokio::spawn(async move {
            stdin.write(payload).await.unwrap();
            stdin.close().await.unwrap();
        })
    };
    let out = cat.output().await.unwrap();
    writer.await.unwrap();
    assert!(out.stdout == payload, "1 MB through the adopted cat");

    // A token is used once; the process the first connection did not park ended with it.
    let e = second.adopt(counter_token).unwrap().output().await.unwrap_err();
    assert_eq!(e.agent_error().map(|e| e.code), Some(ErrorCode::NotFound), "{e}");
    let gone = |pid: u32| async move {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while process_state(pid).is_some_and(|s| s != 'Z') {
            assert!(std::time::Instant::now() < deadline, "process {pid} was not killed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    gone(owned_pid).await;

    // What nobody adopts, drop_parked kills.
    let mut sleeper = second.spawn(sh("sleep 30")).unwrap();
    let Some(ProcessEvent::Spawned { pid }) = sleeper.next_event().await else { panic!("no spawn") };
    let token = second.park(&[sleeper.id()]).await.unwrap()[0].token;
    assert_eq!(stdout_until_parked(&mut sleeper, &mut Vec::new()).await, Some(token));
    second.drop_parked().await.unwrap();
    gone(pid).await;
    let e = second.adopt(token).unwrap().output().await.unwrap_err();
    assert_eq!(e.agent_error().map(|e| e.code), Some(ErrorCode::NotFound), "{e}");
}

#[tokio::test]
async fn stdin_queued_on_the_host_at_a_park_reaches_the_adopted_process_in_order() {
    let agent = HostAgent::start().await;
    let first = agent.connect().await;
    // The process reads nothing for a while: its pipe fills, the agent stops granting credit,
    // and the rest of what is written waits on the host.
    let mut cat = first.spawn(sh("sleep 1; exec cat")).unwrap();
    assert!(matches!(cat.next_event().await, Some(ProcessEvent::Spawned { .. })));
    let chunks: Vec<Vec<u8>> = (0..48u32).map(|n| vec![(n % 251) as u8; 64 * 1024]).collect();
    let stdin = cat.stdin();
    let writer = tokio::spawn({
        let (stdin, chunks) = (stdin.clone(), chunks.clone());
        async move {
            let mut accepted = 0;
            for chunk in chunks {
                if stdin.write(chunk).await.is_err() {
                    break;
                }
                accepted += 1;
            }
            accepted
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pending = stdin.detach().await;
    let accepted = writer.await.unwrap();
    assert!(accepted < chunks.len(), "the writer was held back by the credit: {accepted}");
    assert!(pending.bytes() > 0, "something was still queued on the host");
    assert!(stdin.write(&b"late"[..]).await.is_err(), "a detached stream takes no more");
    let parked = first.park(&[cat.id()]).await.unwrap();
    let mut out = Vec::new();
    let token = stdout_until_parked(&mut cat, &mut out).await.expect("parked");
    assert_eq!(parked.len(), 1);
    drop((cat, first));

    let second = agent.connect().await;
    let mut cat = second.adopt(token).unwrap();
    assert!(matches!(cat.next_event().await, Some(ProcessEvent::Spawned { .. })));
    let stdin = cat.stdin();
    pending.requeue(&stdin).await.unwrap();
    let rest = tokio::spawn({
        let (stdin, chunks) = (stdin.clone(), chunks[accepted..].to_vec());
        async move {
            for chunk in chunks {
                stdin.write(chunk).await.unwrap();
            }
            stdin.close().await.unwrap();
        }
    });
    let tail = cat.output().await.unwrap();
    rest.await.unwrap();
    out.extend_from_slice(&tail.stdout);
    let expected: Vec<u8> = chunks.concat();
    assert_eq!(out.len(), expected.len(), "every byte written arrived once");
    assert!(out == expected, "in order");
}

#[tokio::test]
async fn an_exec_gate_runs_allowlisted_programs_at_once_and_asks_the_host_for_the_rest() {
    let agent = HostAgent::start().await;
    let client = agent.connect().await;
    assert!(client.gates_execs());
    let mut checks = client.exec_checks().unwrap();
    assert!(client.exec_checks().is_none(), "one taker");
    let gate = umbra_proto::ExecGate { allow: vec!["sh".into(), "true".into(), "id -u".into()], deny: vec![] };
    // `sh` is the approved command itself, `true` and `id -u` are allowlisted; `id -g` and
    // `id -n -u` are not, and the host allows the first and refuses the second. A program
    // that does not exist fails as it would without the gate, without a check.
    let script = "true && echo listed; id -u; id -g && echo approved; id -n -u || echo refused $?; \
                  no-such-program 2>/dev/null || echo missing $?";
    let spawn = SpawnRequest { exec_gate: Some(gate), ..sh(script) };
    let process = client.spawn(spawn).unwrap();
    async fn next(checks: &mut tokio::sync::mpsc::Receiver<ExecCheck>) -> ExecCheck {
        let recv = tokio::time::timeout(Duration::from_secs(20), checks.recv());
        recv.await.expect("a check in time").expect("checks open")
    }
    let first = next(&mut checks).await;
    assert_eq!(first.argv, ["id", "-g"]);
    assert!(first.path.ends_with("/id"), "{first:?}");
    assert!(first.pid > 0 && first.cwd.is_some(), "{first:?}");
    client.exec_answer(first.check, true).await.unwrap();
    let second = next(&mut checks).await;
    assert_eq!(second.argv, ["id", "-n", "-u"]);
    client.exec_answer(second.check, false).await.unwrap();
    let e = client.exec_answer(second.check, true).await.unwrap_err();
    assert_eq!(e.agent_error().unwrap().code, ErrorCode::NotFound, "answered already");

    let out = process.output().await.unwrap();
    // SAFETY: getuid and getgid take no arguments and cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("listed\n{uid}\n{gid}\napproved\nrefused 126\nmissing 127\n"),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(checks.try_recv().is_err(), "no other exec asked");
}
