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
            (request_id, command, serde_json::to_value(&decision.reason).unwrap())
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
        client.call::<PermissionRespond>(RespondPermissionParams { request_id: id, approved: true }).await.unwrap();
    };
    let (spawned, ()) = tokio::join!(spawn, answer);
    let p = spawned.expect("an approved command runs");
    let (out, _, _) = process_output(&client, &mut inbox, "ap", p.process, run).await;
    assert_eq!(out, b"approved-ran\n");

    // Denied by the person: an error naming the answer and the rule.
    let spawn = client.call::<ProcessSpawn>(argv("ap", &["ls", "/"]));
    let answer = async {
        let (id, _, _) = next_request(&mut inbox).await;
        client.call::<PermissionRespond>(RespondPermissionParams { request_id: id, approved: false }).await.unwrap();
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
    let late = client.call::<PermissionRespond>(RespondPermissionParams { request_id: id, approved: true }).await;
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
        let rule = serde_json::to_value(&decision.reason).unwrap();
        assert_eq!(rule["rule"], "env_not_allowed", "{rule}");
        assert_eq!(rule["variable"], "BASH_ENV=/tmp/rc", "{rule}");
        client.call::<PermissionRespond>(RespondPermissionParams { request_id, approved: false }).await.unwrap();
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
        client.call::<PermissionRespond>(RespondPermissionParams { request_id: id, approved: false }).await.unwrap();
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
