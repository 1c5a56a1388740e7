//! Command approval through umbrad's real socket (issue 15): a command that needs approval
//! raises a `permission_request` event and waits; approving runs it, denying and silence refuse
//! it with the rule; deny lists and hooks refuse without asking.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use umbra_api::methods::*;
use umbra_api::session::SettingsPatch;
use umbra_api::{ErrorCode, EventKind};
use umbra_tests::daemon::{boot_timeout_secs, process_output, wait_event, Inbox, TestDaemon};

fn argv(session: &str, words: &[&str]) -> SpawnParams {
    SpawnParams { session: session.into(), argv: words.iter().map(|w| w.to_string()).collect(), ..Default::default() }
}

/// The next permission request: its id, command and rule.
async fn next_request(inbox: &mut Inbox) -> (String, String, serde_json::Value) {
    let ev = wait_event(inbox, Duration::from_secs(60), "a permission_request", |e| {
        matches!(e.kind, EventKind::PermissionRequest { .. })
    })
    .await;
    match ev.kind {
        EventKind::PermissionRequest { request_id, command, decision, .. } => {
            (request_id, command, serde_json::to_value(&decision.expect("a command has a decision").reason).unwrap())
        }
        _ => unreachable!(),
    }
}

/// A client subscribed to session `name`, started on `daemon` under `approval`.
async fn start_under(
    daemon: &TestDaemon,
    name: &str,
    approval: umbra_policy::approval::ApprovalSettings,
) -> (umbra_api::client::Client, Inbox) {
    let (client, inbox) = daemon.client().await;
    client.call::<EventsSubscribe>(SubscribeParams { session: Some(name.into()) }).await.unwrap();
    let start = StartParams {
        name: name.into(),
        settings: SettingsPatch { approval: Some(approval), ..Default::default() },
        ..Default::default()
    };
    tokio::time::timeout(Duration::from_secs(boot_timeout_secs() + 30), client.call::<SessionStart>(start))
        .await
        .expect("boots in time")
        .unwrap();
    (client, inbox)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_needing_approval_wait_for_an_answer_and_silence_denies() {
    let daemon = TestDaemon::start("daemon-approval", serde_json::json!({}));
    let hook = daemon.dir.0.join("hook.sh");
    std::fs::write(
        &hook,
        "#!/bin/sh\nif grep -q forbidden-by-hook; then echo '{\"permission\":\"deny\",\"reason\":\"the test hook says no\"}'; else echo allow; fi\n",
    )
    .unwrap();
    std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755)).unwrap();
    let approval = serde_json::from_value(serde_json::json!({
        "mode": "allowlist",
        "allow": ["echo"],
        "deny": ["curl"],
        "hooks": [{"command": hook, "timeout_ms": 5000}],
        "timeout_secs": 3,
    }))
    .unwrap();
    let (client, mut inbox) = start_under(&daemon, "ap", approval).await;
    let run = Duration::from_secs(60);

    // Allowlisted: runs without asking.
    let p = client.call::<ProcessSpawn>(argv("ap", &["echo", "allowed"])).await.unwrap();
    let (out, _, exit) = process_output(&client, &mut inbox, "ap", p.process, run).await;
    assert_eq!((out.as_slice(), exit.code), (&b"allowed\n"[..], Some(0)));

    // Not allowlisted: asks; approving runs it.
    let spawn = client.call::<ProcessSpawn>(argv("ap", &["sh", "-c", "echo approved-ran"]));
    let answer = async {
        let (id, command, rule) = next_request(&mut inbox).await;
        assert_eq!(command, "sh -c 'echo approved-ran'");
        assert_eq!(rule["rule"], "not_allowlisted", "{rule}");
        client
            .call::<PermissionRespond>(RespondPermissionParams {
                request_id: id,
                approved: true,
                scope: Default::default(),
                decision: None,
                remember: false,
            })
            .await
            .unwrap();
    };
    let (spawned, ()) = tokio::join!(spawn, answer);
    let p = spawned.expect("an approved command runs");
    let (out, _, _) = process_output(&client, &mut inbox, "ap", p.process, run).await;
    assert_eq!(out, b"approved-ran\n");

    // Denied by the person: an error naming the answer and the rule.
    let spawn = client.call::<ProcessSpawn>(argv("ap", &["ls", "/"]));
    let answer = async {
        let (id, _, _) = next_request(&mut inbox).await;
        client
            .call::<PermissionRespond>(RespondPermissionParams {
                request_id: id,
                approved: false,
                scope: Default::default(),
                decision: None,
                remember: false,
            })
            .await
            .unwrap();
    };
    let (spawned, ()) = tokio::join!(spawn, answer);
    let e = spawned.unwrap_err();
    assert_eq!(e.code, ErrorCode::PermissionDenied, "{e:?}");
    assert!(e.message.contains("denied by the user") && e.message.contains("matches no allow pattern"), "{e:?}");

    // Silence: denied once the timeout passes, and the resolution is announced.
    let asked = std::time::Instant::now();
    let spawn = client.call::<ProcessSpawn>(argv("ap", &["ls", "-la"]));
    let watch = async {
        let (id, _, _) = next_request(&mut inbox).await;
        let ev = wait_event(
            &mut inbox,
            Duration::from_secs(30),
            "permission_resolved",
            |e| matches!(&e.kind, EventKind::PermissionResolved { request_id, .. } if *request_id == id),
        )
        .await;
        let EventKind::PermissionResolved { approved, reason, .. } = ev.kind else { unreachable!() };
        assert!(!approved && reason.contains("no answer within 3 s"), "{reason}");
        id
    };
    let (spawned, id) = tokio::join!(spawn, watch);
    let e = spawned.unwrap_err();
    assert_eq!(e.code, ErrorCode::PermissionDenied, "{e:?}");
    assert!(e.message.contains("no answer within 3 s"), "{e:?}");
    assert!(asked.elapsed() >= Duration::from_secs(3), "waited the timeout");
    // Too late: the request is gone.
    let late = client
        .call::<PermissionRespond>(RespondPermissionParams {
            request_id: id,
            approved: true,
            scope: Default::default(),
            decision: None,
            remember: false,
        })
        .await;
    assert_eq!(late.unwrap_err().code, ErrorCode::NotFound);

    // The deny list wins over everything, inside a compound command too, without asking.
    let e = client.call::<ProcessSpawn>(argv("ap", &["sh", "-c", "echo hi && curl http://x"])).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::PermissionDenied, "{e:?}");
    assert!(e.message.contains("deny pattern `curl`"), "{e:?}");

    // A hook that denies stops an allowlisted command.
    let e = client.call::<ProcessSpawn>(argv("ap", &["echo", "forbidden-by-hook"])).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::PermissionDenied, "{e:?}");
    assert!(e.message.contains("the test hook says no"), "{e:?}");

    client.call::<SessionDelete>(SessionRef { name: "ap".into() }).await.unwrap();
}

/// The command's variables are part of the decision (issue 28): an allow rule for `echo` does
/// not approve `echo` run with `BASH_ENV` (or with `LD_PRELOAD` set in its line); the request
/// shows the variables and which of them change what runs; a rule that names the variable
/// allows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn variables_that_change_what_runs_need_a_rule_that_names_them() {
    let daemon = TestDaemon::start("daemon-approval-env", serde_json::json!({}));
    let approval = serde_json::from_value(serde_json::json!({
        "mode": "allowlist",
        "allow": ["echo", "sh -c", "BASH_ENV=* cat"],
        "timeout_secs": 30,
    }))
    .unwrap();
    let (client, mut inbox) = start_under(&daemon, "env", approval).await;
    let run = Duration::from_secs(60);
    let with_env = |words: &[&str], env: &[(&str, &str)]| SpawnParams {
        env: env.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect(),
        ..argv("env", words)
    };

    // Variables that do not change what runs: allowlisted as before.
    let p = client.call::<ProcessSpawn>(with_env(&["echo", "plain"], &[("CI", "1")])).await.unwrap();
    let (out, _, _) = process_output(&client, &mut inbox, "env", p.process, run).await;
    assert_eq!(out, b"plain\n");

    // BASH_ENV with an allow rule for `echo` only: a person is asked, and sees the variables.
    let spawn = client.call::<ProcessSpawn>(with_env(&["echo", "sourced"], &[("BASH_ENV", "/tmp/rc"), ("CI", "1")]));
    let answer = async {
        let ev = wait_event(&mut inbox, Duration::from_secs(60), "a permission_request", |e| {
            matches!(e.kind, EventKind::PermissionRequest { .. })
        })
        .await;
        let EventKind::PermissionRequest { request_id, env, env_changes_what_runs, decision, cwd, .. } = ev.kind else {
            unreachable!()
        };
        assert_eq!(env.get("BASH_ENV").map(String::as_str), Some("/tmp/rc"));
        assert_eq!(env.get("CI").map(String::as_str), Some("1"));
        assert_eq!(env_changes_what_runs, ["BASH_ENV"]);
        assert_eq!(cwd, "/");
        let rule = serde_json::to_value(&decision.expect("a command has a decision").reason).unwrap();
        assert_eq!(rule["rule"], "env_not_allowed", "{rule}");
        assert_eq!(rule["variable"], "BASH_ENV=/tmp/rc", "{rule}");
        client
            .call::<PermissionRespond>(RespondPermissionParams {
                request_id,
                approved: false,
                scope: Default::default(),
                decision: None,
                remember: false,
            })
            .await
            .unwrap();
    };
    let (spawned, ()) = tokio::join!(spawn, answer);
    let e = spawned.unwrap_err();
    assert_eq!(e.code, ErrorCode::PermissionDenied, "{e:?}");
    assert!(e.message.contains("BASH_ENV=/tmp/rc"), "{e:?}");

    // Set in the line itself, inside an allowed shell: asked too (here: silence is not waited
    // for, the person denies).
    let spawn = client.call::<ProcessSpawn>(argv("env", &["sh", "-c", "LD_PRELOAD=/tmp/x.so echo hi"]));
    let answer = async {
        let (id, _, rule) = next_request(&mut inbox).await;
        assert_eq!(rule["rule"], "env_not_allowed", "{rule}");
        assert_eq!(rule["variable"], "LD_PRELOAD=/tmp/x.so", "{rule}");
        client
            .call::<PermissionRespond>(RespondPermissionParams {
                request_id: id,
                approved: false,
                scope: Default::default(),
                decision: None,
                remember: false,
            })
            .await
            .unwrap();
    };
    let (spawned, ()) = tokio::join!(spawn, answer);
    assert_eq!(spawned.unwrap_err().code, ErrorCode::PermissionDenied);

    // A rule that names the variable allows it, and it reaches the command.
    // (The minimal image's busybox has no printenv: the command reads its own environment.)
    let p = client
        .call::<ProcessSpawn>(with_env(&["cat", "/proc/self/environ"], &[("BASH_ENV", "/tmp/rc")]))
        .await
        .unwrap();
    let (out, _, _) = process_output(&client, &mut inbox, "env", p.process, run).await;
    assert!(out.split(|b| *b == 0).any(|v| v == b"BASH_ENV=/tmp/rc"), "{}", String::from_utf8_lossy(&out));

    client.call::<SessionDelete>(SessionRef { name: "env".into() }).await.unwrap();
}

/// Network mode `ask` through umbrad's socket (issue 30): a connection to a name outside the
/// allowlist waits for the answer — allowed once (asked again next time), for the session (not
/// asked again), denied, or left unanswered (denied at the timeout) — and the guest sees each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_ask_mode_holds_a_connection_until_the_user_answers() {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    // An echo server on 127.0.0.1: answers each line with "pong <line>".
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut s = tokio::io::BufReader::new(s);
                let mut line = String::new();
                if s.read_line(&mut line).await.unwrap_or(0) > 0 {
                    let _ = s.get_mut().write_all(format!("pong {line}").as_bytes()).await;
                }
            });
        }
    });
    let daemon = TestDaemon::start("daemon-ask", serde_json::json!({}));
    let (client, mut inbox) = daemon.client().await;
    client.call::<EventsSubscribe>(SubscribeParams { session: Some("ask".into()) }).await.unwrap();
    let network = serde_json::from_value(serde_json::json!({
        "mode": "ask",
        "allow_domains": ["listed.test"],
        "allow_cidrs": ["127.0.0.1/32"],
        "resolve": {"listed.test": "127.0.0.1", "asked.test": "127.0.0.1", "other.test": "127.0.0.1", "typed.test": "127.0.0.1"},
        "ask_timeout_secs": 3,
    }))
    .unwrap();
    let start = StartParams {
        name: "ask".into(),
        settings: SettingsPatch { network: Some(network), ..Default::default() },
        ..Default::default()
    };
    tokio::time::timeout(Duration::from_secs(boot_timeout_secs() + 30), client.call::<SessionStart>(start))
        .await
        .expect("boots in time")
        .unwrap();
    let run = Duration::from_secs(60);
    // busybox nc through the transparent path: the guest's DNS, a fake address, the redirect.
    let connect = |name: &str| argv("ask", &["sh", "-c", &format!("echo ping | nc -w 20 {name} {port}; echo exit=$?")]);
    let answer = |approved: bool, scope: umbra_api::event::PermissionScope| {
        let client = &client;
        move |id: String| async move {
            client
                .call::<PermissionRespond>(RespondPermissionParams {
                    request_id: id,
                    approved,
                    scope,
                    decision: None,
                    remember: false,
                })
                .await
                .unwrap();
        }
    };
    // Each question names the guest process that asked: `program` is the start of its command.
    async fn request(inbox: &mut Inbox, host: &str, program: &str) -> String {
        let ev = wait_event(inbox, Duration::from_secs(60), "a network permission_request", |e| {
            matches!(&e.kind, EventKind::PermissionRequest { kind: umbra_api::event::PermissionKind::Network, .. })
        })
        .await;
        let EventKind::PermissionRequest { request_id, host: Some(h), port: Some(_), timeout_secs, process, .. } =
            ev.kind
        else {
            panic!("{ev:?}")
        };
        assert_eq!((h.as_str(), timeout_secs), (host, 3));
        let process = process.unwrap_or_else(|| panic!("{host}: no process named"));
        assert!(process.pid.is_some_and(|p| p > 1) && process.command.starts_with(program), "{process:?}");
        assert!(process.command.contains(host), "{process:?}");
        request_id
    }
    use umbra_api::event::PermissionScope::{Once, Session};

    // A listed name: no question.
    let p = client.call::<ProcessSpawn>(connect("listed.test")).await.unwrap();
    let (out, _, _) = process_output(&client, &mut inbox, "ask", p.process, run).await;
    assert_eq!(String::from_utf8_lossy(&out), "pong ping\nexit=0\n");

    // Allowed once, twice: asked each time.
    for _ in 0..2 {
        let p = client.call::<ProcessSpawn>(connect("asked.test")).await.unwrap();
        answer(true, Once)(request(&mut inbox, "asked.test", "nc -w 20").await).await;
        let (out, _, _) = process_output(&client, &mut inbox, "ask", p.process, run).await;
        assert_eq!(String::from_utf8_lossy(&out), "pong ping\nexit=0\n");
    }
    // Allowed for the session: then not asked again (a question would time out and fail it).
    let p = client.call::<ProcessSpawn>(connect("asked.test")).await.unwrap();
    answer(true, Session)(request(&mut inbox, "asked.test", "nc -w 20").await).await;
    let (out, _, _) = process_output(&client, &mut inbox, "ask", p.process, run).await;
    assert_eq!(String::from_utf8_lossy(&out), "pong ping\nexit=0\n");
    let p = client.call::<ProcessSpawn>(connect("asked.test")).await.unwrap();
    let (out, _, _) = process_output(&client, &mut inbox, "ask", p.process, run).await;
    assert_eq!(String::from_utf8_lossy(&out), "pong ping\nexit=0\n", "not asked again");

    // Denied: through the HTTP proxy the guest hears a 403 (through the transparent path the
    // connection just closes).
    let wget = argv("ask", &["sh", "-c", &format!("wget -q -O- http://other.test:{port}/ 2>&1; echo exit=$?")]);
    let p = client.call::<ProcessSpawn>(wget.clone()).await.unwrap();
    answer(false, Once)(request(&mut inbox, "other.test", "wget -q").await).await;
    let (out, _, _) = process_output(&client, &mut inbox, "ask", p.process, run).await;
    let out = String::from_utf8_lossy(&out);
    assert!(out.contains("403") && out.contains("exit=1") && !out.contains("pong"), "{out}");

    // Silence: denied after the 3 s timeout, announced as such.
    let asked = std::time::Instant::now();
    let p = client.call::<ProcessSpawn>(wget).await.unwrap();
    let id = request(&mut inbox, "other.test", "wget -q").await;
    let ev = wait_event(
        &mut inbox,
        Duration::from_secs(30),
        "permission_resolved",
        |e| matches!(&e.kind, EventKind::PermissionResolved { request_id, .. } if *request_id == id),
    )
    .await;
    let EventKind::PermissionResolved { approved, reason, .. } = ev.kind else { unreachable!() };
    assert!(!approved && reason == "no answer within 3 s", "{reason}");
    let (out, _, _) = process_output(&client, &mut inbox, "ask", p.process, run).await;
    let out = String::from_utf8_lossy(&out);
    assert!(out.contains("403") && out.contains("exit=1") && !out.contains("pong"), "{out}");
    assert!(asked.elapsed() >= Duration::from_secs(3));

    // `vmctl session exec` on a terminal puts the question to its user: the line typed answers.
    let script = format!("echo ping | nc -w 20 typed.test {port}; echo exit=$?");
    let vmctl = umbra_tests::workspace_bin("vmctl");
    let args = ["session", "exec", "ask", "--", "sh", "-c", &script];
    let env = [("UMBRA_SOCKET", daemon.socket.to_str().unwrap())];
    let (typed, _) = umbra_tests::pty::on_a_terminal(&vmctl, &args, &env, &[("[s]ession, or [d]eny?", "o\n")]).await;
    assert!(typed.contains("the guest wants to connect to typed.test:"), "{typed}");
    assert!(
        typed.contains(&format!("typed.test:{port} (process ")) && typed.contains(": nc -w 20 typed.test"),
        "{typed}"
    );
    assert!(typed.contains("pong ping\nexit=0"), "{typed}");

    client.call::<SessionDelete>(SessionRef { name: "ask".into() }).await.unwrap();
    server.abort();
}

/// `allow_always` grows the session's allow list; mode `auto` runs what the sandbox contains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allow_always_remembers_and_auto_runs_what_the_sandbox_contains() {
    let daemon = TestDaemon::start("daemon-approval-always", serde_json::json!({}));
    let approval = serde_json::from_value(serde_json::json!({"mode": "allowlist", "timeout_secs": 30})).unwrap();
    let (client, mut inbox) = start_under(&daemon, "al", approval).await;
    let run = Duration::from_secs(60);
    let always = |id: String| RespondPermissionParams {
        request_id: id,
        approved: false,
        scope: Default::default(),
        decision: Some(umbra_api::event::PermissionDecision::AllowAlways),
        remember: false,
    };
    let spawn = client.call::<ProcessSpawn>(argv("al", &["sh", "-c", "uname -s && ls /sessions"]));
    let answer = async {
        let (id, command, _) = next_request(&mut inbox).await;
        assert_eq!(command, "sh -c 'uname -s && ls /sessions'");
        client.call::<PermissionRespond>(always(id)).await.unwrap();
    };
    let (spawned, ()) = tokio::join!(spawn, answer);
    let p = spawned.expect("allowed (the decision wins over `approved`)");
    let (out, _, _) = process_output(&client, &mut inbox, "al", p.process, run).await;
    assert!(String::from_utf8_lossy(&out).starts_with("Linux\n"));
    let info = client.call::<SessionGet>(SessionRef { name: "al".into() }).await.unwrap();
    let allow = info.settings.approval.expect("approval").allow;
    assert_eq!(allow, ["uname -s", "ls /sessions"], "the line's simple commands, not the shell running them");
    // Those run without a request now (one would wait 30 s, then be refused).
    let p = client.call::<ProcessSpawn>(argv("al", &["uname", "-s"])).await.unwrap();
    let (out, _, _) = process_output(&client, &mut inbox, "al", p.process, run).await;
    assert_eq!(out, b"Linux\n");

    // `vmctl session exec` on a terminal asks the person running it, and `a` allows always.
    let vmctl = umbra_tests::workspace_bin("vmctl");
    let env = [("UMBRA_SOCKET", daemon.socket.to_str().unwrap())];
    let args = ["session", "exec", "al", "--", "uname", "-m"];
    let (typed, _) = umbra_tests::pty::on_a_terminal(&vmctl, &args, &env, &[("[a]lways, or [d]eny?", "a\n")]).await;
    assert!(typed.contains("\"uname -m\" needs approval (`uname -m` matches no allow pattern)"), "{typed}");
    assert!(typed.contains(std::env::consts::ARCH), "it ran: {typed}");
    let info = client.call::<SessionGet>(SessionRef { name: "al".into() }).await.unwrap();
    assert!(info.settings.approval.expect("approval").allow.contains(&"uname -m".to_string()));
    drop((client, inbox));

    // Mode auto: contained (no network, .git read-only, the folder shadow), anything runs and
    // the decision says why; with a read-write folder it asks.
    let work = daemon.dir.0.join("work");
    std::fs::create_dir_all(work.join(".git")).unwrap();
    let start_auto = |name: &str, mode: umbra_proto::ShareMode| StartParams {
        name: name.into(),
        folders: vec![umbra_api::FolderSpec { path: work.clone(), name: Some("work".into()), mode }],
        settings: SettingsPatch {
            approval: Some(
                serde_json::from_value(
                    serde_json::json!({"mode": "auto", "timeout_secs": 2, "protect_dotfiles": true}),
                )
                .unwrap(),
            ),
            policy: Some(serde_json::from_value(serde_json::json!({"block_git_writes": true})).unwrap()),
            ..Default::default()
        },
        ..Default::default()
    };
    let (client, mut inbox) = daemon.client().await;
    client.call::<EventsSubscribe>(SubscribeParams { session: None }).await.unwrap();
    client.call::<SessionStart>(start_auto("contained", umbra_proto::ShareMode::Shadow)).await.unwrap();
    let p = client.call::<ProcessSpawn>(argv("contained", &["sh", "-c", "echo in-the-sandbox"])).await.unwrap();
    let (out, _, _) = process_output(&client, &mut inbox, "contained", p.process, run).await;
    assert_eq!(out, b"in-the-sandbox\n");
    client.call::<SessionStart>(start_auto("writable", umbra_proto::ShareMode::Rw)).await.unwrap();
    let e = client.call::<ProcessSpawn>(argv("writable", &["sh", "-c", "echo asked"])).await.unwrap_err();
    assert!(e.message.contains("no answer within 2 s") && e.message.contains("matches no allow pattern"), "{e:?}");
    // protect_dotfiles: a write to a dotfile of the read-write folder asks, in every mode.
    let line = "echo KEY=1 > /sessions/writable/mnt/work/.env";
    let e = client.call::<ProcessSpawn>(argv("writable", &["sh", "-c", line])).await.unwrap_err();
    assert!(e.message.contains("a dotfile in a writable folder"), "{e:?}");
    assert!(!work.join(".env").exists(), "nothing was written");
}

/// `allow_always` with `remember`: the commands join umbrad's configuration, so a new session
/// allows them too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remember_puts_the_commands_in_umbrads_configuration() {
    let config = serde_json::json!({"approval": {"mode": "allowlist", "timeout_secs": 30}});
    let daemon = TestDaemon::start("daemon-approval-remember", config);
    let (client, mut inbox) = daemon.client().await;
    client.call::<EventsSubscribe>(SubscribeParams { session: None }).await.unwrap();
    client.call::<SessionStart>(StartParams { name: "r1".into(), ..Default::default() }).await.unwrap();
    let spawn = client.call::<ProcessSpawn>(argv("r1", &["uname", "-s"]));
    let answer = async {
        let (id, _, _) = next_request(&mut inbox).await;
        let respond = |decision, remember| RespondPermissionParams {
            request_id: id.clone(),
            approved: false,
            scope: Default::default(),
            decision: Some(decision),
            remember,
        };
        // Remembering an answer for this request only is refused, and the request still waits.
        let e = client
            .call::<PermissionRespond>(respond(umbra_api::event::PermissionDecision::AllowOnce, true))
            .await
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidParams, "{e:?}");
        client
            .call::<PermissionRespond>(respond(umbra_api::event::PermissionDecision::AllowAlways, true))
            .await
            .unwrap();
    };
    let (spawned, ()) = tokio::join!(spawn, answer);
    let p = spawned.unwrap();
    let (out, _, _) = process_output(&client, &mut inbox, "r1", p.process, Duration::from_secs(60)).await;
    assert_eq!(out, b"Linux\n");
    let config = client.call::<ConfigGet>(NoParams {}).await.unwrap();
    assert_eq!(config.session.approval.expect("approval").allow, ["uname -s"]);
    wait_event(
        &mut inbox,
        Duration::from_secs(10),
        "config_changed",
        |e| matches!(&e.kind, EventKind::ConfigChanged { what, .. } if what == "configuration"),
    )
    .await;
    // Saved (a new umbrad would have it), and a session started from now on allows it.
    let saved = std::fs::read_to_string(daemon.dir.0.join("config/umbra/umbrad.json")).unwrap();
    assert!(saved.contains("uname -s"), "{saved}");
    client.call::<SessionStart>(StartParams { name: "r3".into(), ..Default::default() }).await.unwrap();
    let p = client.call::<ProcessSpawn>(argv("r3", &["uname", "-s"])).await.unwrap();
    let (out, _, _) = process_output(&client, &mut inbox, "r3", p.process, Duration::from_secs(60)).await;
    assert_eq!(out, b"Linux\n");
}

/// Approval scope `guest` (issue 32 item 4): every program a session's command executes in the
/// guest is checked. An allowlisted one runs without a request; an unlisted one waits for the
/// person and runs or fails with the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_scope_checks_every_program_a_script_executes() {
    let daemon = TestDaemon::start("daemon-approval-guest", serde_json::json!({}));
    let approval =
        serde_json::json!({"mode": "allowlist", "scope": "guest", "allow": ["sh", "uname -s"], "timeout_secs": 30});
    let (client, mut inbox) = start_under(&daemon, "g", serde_json::from_value(approval).unwrap()).await;
    // Paths, not names: the minimal image's busybox shell runs its applets by name in-process,
    // without an exec (docs/policy.md). The output is held until the end, so none of it passes
    // while the test waits for the requests.
    let script = "out=$({ /bin/uname -s; /bin/id -u && echo approved; /bin/id -g || echo refused; } 2>&1); \
                  echo \"$out\"";
    let p = client.call::<ProcessSpawn>(argv("g", &["sh", "-c", script])).await.expect("sh is allowlisted");
    let respond = |request_id: String, approved: bool| RespondPermissionParams {
        request_id,
        approved,
        scope: Default::default(),
        decision: None,
        remember: false,
    };
    let (id, command, reason) = next_request(&mut inbox).await;
    assert_eq!(command, "id -u", "the first program the script runs that is not allowlisted");
    assert_eq!(reason["rule"], "not_allowlisted", "{reason}");
    client.call::<PermissionRespond>(respond(id, true)).await.unwrap();
    let (id, command, _) = next_request(&mut inbox).await;
    assert_eq!(command, "id -g");
    client.call::<PermissionRespond>(respond(id, false)).await.unwrap();
    let (out, _, _) = process_output(&client, &mut inbox, "g", p.process, Duration::from_secs(60)).await;
    let out = String::from_utf8_lossy(&out);
    assert!(out.starts_with("Linux\n0\napproved\n") && out.ends_with("refused\n"), "{out}");
    assert!(out.contains("/bin/id: Permission denied"), "{out}");
    // `uname -s` never asked: the only requests were the two answered above.
    while let Ok(Some(n)) = tokio::time::timeout(Duration::from_millis(500), inbox.next_raw()).await {
        assert_ne!(n.params["event"], "permission_request", "{n:?}");
    }
}
