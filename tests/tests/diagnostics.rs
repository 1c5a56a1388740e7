//! Language servers in the guest and diagnostics for a proposed change (issue 33), through
//! umbrad's socket, with the standard image's pylsp (pyflakes) and clangd on small projects in a
//! shadow folder.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde_json::json;
use umbra_api::lsp::{
    Diagnostic, ForChange, ForChangeParams, LspNotifyParams, LspRef, LspRequestParams, LspStartParams,
};
use umbra_api::methods::*;
use umbra_api::{EventKind, FolderSpec};
use umbra_proto::ShareMode;
use umbra_tests::daemon::{wait_event, TestDaemon};

const MAIN_PY: &str = "from util import helper\n\nprint(helper(1))\n";
const UTIL_PY: &str = "def helper(x):\n    return x + 1\n";
const BROKEN_PY: &str = "import os\n\nx = y\n";

async fn start(daemon: &TestDaemon, project: &Path) -> (umbra_api::client::Client, umbra_tests::daemon::Inbox) {
    let (client, inbox) = daemon.client().await;
    client.call::<EventsSubscribe>(SubscribeParams { session: Some("lint".into()) }).await.unwrap();
    let start = StartParams {
        name: "lint".into(),
        folders: vec![FolderSpec { path: project.into(), name: Some("work".into()), mode: ShareMode::Shadow }],
        ..Default::default()
    };
    client.call::<SessionStart>(start).await.unwrap();
    (client, inbox)
}

fn change(files: &[(&str, Option<&str>)]) -> ForChangeParams {
    ForChangeParams {
        session: "lint".into(),
        folder: "work".into(),
        changes: files.iter().map(|(p, c)| (p.to_string(), c.map(str::to_string))).collect(),
        language: None,
        timeout_ms: Some(60_000),
    }
}

fn messages(d: &[Diagnostic]) -> Vec<String> {
    let mut m: Vec<String> = d.iter().map(|d| format!("{}:{}: {}", d.path, d.range.start.line, d.message)).collect();
    m.sort();
    m
}

/// Every file under `dir`, with its bytes.
fn tree(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    for e in walk(dir) {
        out.insert(e.strip_prefix(dir).unwrap().display().to_string(), std::fs::read(&e).unwrap());
    }
    out
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

async fn for_change(client: &umbra_api::client::Client, p: ForChangeParams) -> ForChange {
    let r = client.call::<DiagnosticsForChange>(p).await.unwrap();
    assert!(r.complete, "the server settled: {r:?}");
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_diagnostics_for_a_change_and_definitions_in_changed_files() {
    let daemon = TestDaemon::start(
        "diagnostics-py",
        json!({"bundle": umbra_tests::test_bundle("standard"), "memory_mib": 1024, "cpus": 2}),
    );
    let project = daemon.dir.0.join("project");
    std::fs::create_dir_all(project.join("pkg")).unwrap();
    std::fs::write(project.join("main.py"), MAIN_PY).unwrap();
    std::fs::write(project.join("util.py"), UTIL_PY).unwrap();
    std::fs::write(project.join("pkg/broken.py"), BROKEN_PY).unwrap();
    let host_before = tree(&project);
    let (client, mut inbox) = start(&daemon, &project).await;

    // An introduced error comes back with its file, range and message; nothing else does.
    let r = for_change(&client, change(&[("main.py", Some("from util import helper\n\nprint(helper(nope))\n"))])).await;
    assert_eq!(messages(&r.diagnostics), ["main.py:2: undefined name 'nope'"], "{r:?}");
    let d = &r.diagnostics[0];
    assert_eq!((d.severity, d.source.as_deref()), (Some(1), Some("pyflakes")));
    assert_eq!((d.range.start.character, d.range.end.line), (13, 2), "{d:?}");
    assert!(r.resolved.is_empty(), "{r:?}");
    assert_eq!(r.languages, ["python"]);

    // A fix makes the file's errors disappear: they come back as resolved, and none is new.
    let fixed = "import os\n\nx = 1\nprint(os.sep, x)\n";
    let r = for_change(&client, change(&[("pkg/broken.py", Some(fixed))])).await;
    assert_eq!(
        messages(&r.resolved),
        ["pkg/broken.py:0: 'os' imported but unused", "pkg/broken.py:2: undefined name 'y'"],
        "{r:?}"
    );
    assert!(r.diagnostics.is_empty() && r.after.is_empty(), "{r:?}");

    // A moved error is not new; a new file and a deletion in one change.
    let moved = "# a line above\nimport os\n\nx = y\nz = w\n";
    let r = for_change(
        &client,
        change(&[("pkg/broken.py", Some(moved)), ("pkg/new.py", Some("import sys\n")), ("util.py", None)]),
    )
    .await;
    assert_eq!(
        messages(&r.diagnostics),
        ["pkg/broken.py:4: undefined name 'w'", "pkg/new.py:0: 'sys' imported but unused"],
        "{r:?}"
    );
    assert!(r.resolved.is_empty(), "{r:?}");

    // Ten concurrent requests on one session: each gets its own answer.
    let requests = (0..10).map(|i| {
        let client = client.clone();
        async move {
            let text = format!("from util import helper\n\nprint(helper(name_{i}))\n");
            (i, client.call::<DiagnosticsForChange>(change(&[("main.py", Some(&text))])).await.unwrap())
        }
    });
    for (i, r) in futures_util::future::join_all(requests).await {
        assert!(r.complete, "{i}: {r:?}");
        assert_eq!(messages(&r.diagnostics), [format!("main.py:2: undefined name 'name_{i}'")], "request {i}");
    }

    // Go to definition of a symbol used in a changed (unsaved) file, on a server of one's own.
    let info = client
        .call::<LspStart>(LspStartParams {
            session: "lint".into(),
            folder: "work".into(),
            language: Some("python".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(info.initialize["capabilities"]["definitionProvider"].as_bool().unwrap_or(true), "{info:?}");
    let root = format!("file://{}", info.root);
    let changed = "from util import helper\n\n\ndef twice(v):\n    return helper(helper(v))\n";
    let open = json!({"textDocument": {"uri": format!("{root}/main.py"), "languageId": "python", "version": 1, "text": changed}});
    let notify = |method: &str, params| LspNotifyParams {
        session: "lint".into(),
        server: info.server,
        method: method.into(),
        params,
    };
    client.call::<LspNotify>(notify("textDocument/didOpen", open)).await.unwrap();
    // Its diagnostics come as events.
    wait_event(&mut inbox, Duration::from_secs(60), "publishDiagnostics for main.py", |e| {
        matches!(&e.kind, EventKind::LspNotification { method, params, .. }
            if method == "textDocument/publishDiagnostics" && params["uri"].as_str().is_some_and(|u| u.ends_with("/main.py")))
    })
    .await;
    let definition = client
        .call::<LspRequest>(LspRequestParams {
            session: "lint".into(),
            server: info.server,
            method: "textDocument/definition".into(),
            // `helper` in `return helper(...)`, line 4 of the changed text.
            params: json!({"textDocument": {"uri": format!("{root}/main.py")}, "position": {"line": 4, "character": 12}}),
            timeout_ms: Some(60_000),
        })
        .await
        .unwrap()
        .result;
    // jedi follows the import to `def helper` in util.py.
    let first = definition.as_array().and_then(|a| a.first()).cloned().unwrap_or(definition.clone());
    assert!(first["uri"].as_str().unwrap_or_default().ends_with("/work/util.py"), "{definition}");
    assert_eq!(first["range"]["start"], json!({"line": 0, "character": 4}), "{definition}");
    let e = client
        .call::<LspRequest>(LspRequestParams {
            session: "lint".into(),
            server: info.server,
            method: "no/such/method".into(),
            params: json!({}),
            timeout_ms: Some(30_000),
        })
        .await
        .unwrap_err();
    assert!(e.message.contains("no/such/method"), "{e:?}");
    assert_eq!(
        client
            .call::<LspListMethod>(umbra_api::kept::InSession { session: "lint".into() })
            .await
            .unwrap()
            .servers
            .len(),
        1
    );
    client.call::<LspStop>(LspRef { session: "lint".into(), server: info.server }).await.unwrap();
    let e = client.call::<LspNotify>(notify("exit", json!(null))).await.unwrap_err();
    assert_eq!(e.code, umbra_api::ErrorCode::NotFound, "{e:?}");

    // Nothing was written: the host's files and the shadow are as they were.
    assert_eq!(tree(&project), host_before, "the host folder is untouched");
    let diff = client.call::<ShadowDiff>(ShadowParams { session: "lint".into(), folder: "work".into() }).await.unwrap();
    assert!(diff.changes.is_empty(), "the shadow is untouched: {:?}", diff.changes);

    // The same from the command line: compiler-style lines, status 2 for new diagnostics.
    let proposed = daemon.dir.0.join("proposed.py");
    std::fs::write(&proposed, "from util import helper\nprint(helper(q))\n").unwrap();
    let out = std::process::Command::new(umbra_tests::workspace_bin("vmctl"))
        .env("UMBRA_SOCKET", &daemon.socket)
        .args(["session", "lint", "lint", "--change"])
        .arg(format!("main.py=@{}", proposed.display()))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "main.py:2:14: error: undefined name 'q' [pyflakes]\n");
    assert!(stderr.contains("1 new, 0 resolved"), "{stderr}");

    // Bad requests are refused by name.
    let e = client.call::<DiagnosticsForChange>(change(&[("../escape.py", Some("x"))])).await.unwrap_err();
    assert!(e.message.contains("../escape.py"), "{e:?}");
    let e = client.call::<DiagnosticsForChange>(change(&[("Makefile", Some("x"))])).await.unwrap_err();
    assert!(e.message.contains("pass language"), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c_diagnostics_for_a_change_with_clangd() {
    let daemon = TestDaemon::start(
        "diagnostics-c",
        json!({"bundle": umbra_tests::test_bundle("standard"), "memory_mib": 1024, "cpus": 2}),
    );
    let project = daemon.dir.0.join("project");
    std::fs::create_dir_all(&project).unwrap();
    std::fs::write(project.join("util.h"), "int helper(int x);\n").unwrap();
    std::fs::write(project.join("main.c"), "#include \"util.h\"\n\nint main(void) { return helper(1); }\n").unwrap();
    std::fs::write(project.join("bad.c"), "int f(void) { return nope; }\n").unwrap();
    let host_before = tree(&project);
    let (client, _inbox) = start(&daemon, &project).await;

    let broken = "#include \"util.h\"\n\nint main(void) { return helper(1) + missing; }\n";
    let r = for_change(&client, change(&[("main.c", Some(broken))])).await;
    assert_eq!(messages(&r.diagnostics), ["main.c:2: Use of undeclared identifier 'missing'"], "{r:?}");
    assert_eq!((r.diagnostics[0].severity, r.diagnostics[0].range.start.character), (Some(1), 36));
    assert_eq!(r.languages, ["c"]);

    // A change to the header reaches the file that includes it (an open document of the same
    // server); the fix of the header resolves it.
    let r = for_change(
        &client,
        change(&[
            ("util.h", Some("int helper(int x, int y);\n")),
            ("main.c", Some(broken.replace(" + missing", "").as_str())),
        ]),
    )
    .await;
    assert!(messages(&r.diagnostics).iter().any(|m| m.starts_with("main.c:2: Too few arguments")), "{r:?}");

    // A fix makes an error the folder has disappear.
    let r = for_change(&client, change(&[("bad.c", Some("int f(void) { return 0; }\n"))])).await;
    assert_eq!(messages(&r.resolved), ["bad.c:0: Use of undeclared identifier 'nope'"], "{r:?}");
    assert!(r.diagnostics.is_empty() && r.after.is_empty(), "{r:?}");
    assert_eq!(tree(&project), host_before, "the host folder is untouched");
}
