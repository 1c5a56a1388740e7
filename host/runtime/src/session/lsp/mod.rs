//! Language servers in the guest, and the diagnostics a proposed change would bring
//! (`docs/diagnostics.md`).
//!
//! A session keeps two kinds of server in its [`Registry`]: the ones a client started with
//! `lsp.start`, which it drives itself, and pools of servers `diagnostics.for_change` takes one
//! of per request. A pooled server is used by one request at a time, so concurrent requests
//! never see each other's changes; its documents are closed (and their diagnostics cleared)
//! before it goes back, and a server that does not clear them is not reused.
//!
//! A change is never written anywhere: it lives in the server's open documents (LSP's
//! `didOpen` / `didChange`, as an editor's unsaved buffers do), so the folder, its shadow
//! and the host's files are untouched by construction.

pub mod frame;
pub mod server;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
#[cfg(test)]
use umbra_api::lsp::Position;
use umbra_api::lsp::{Diagnostic, LspServerInfo, Range};

pub use server::{Published, Server, Sink};

use crate::session::error::SessionError;

/// Servers a session runs for `lsp.start` at once.
pub const MAX_SERVERS: usize = 8;
/// Servers a pool keeps for one folder and command: more concurrent requests wait for one.
pub const POOL_SIZE: usize = 4;
/// A pooled server unused this long is shut down.
pub const POOL_IDLE: Duration = Duration::from_secs(120);
/// How long a server has to answer `initialize` (pylsp imports jedi first).
pub const INITIALIZE_TIMEOUT: Duration = Duration::from_secs(90);
/// How long after its last message a server that published for every file and has no work
/// in progress counts as done.
pub const QUIET: Duration = Duration::from_millis(300);
/// Most files one `diagnostics.for_change` may change.
pub const MAX_CHANGED_FILES: usize = 256;
/// Largest file a change may read or write (LSP sends a document whole).
pub const MAX_FILE_BYTES: usize = 8 << 20;

/// A pool's folder root and server command.
type PoolKey = (String, Vec<String>);

/// A session's language servers.
#[derive(Default)]
pub struct Registry {
    next: AtomicU64,
    servers: Mutex<BTreeMap<u64, (LspServerInfo, Arc<Server>)>>,
    pools: Mutex<HashMap<PoolKey, Arc<Pool>>>,
}

impl Registry {
    pub fn next_id(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Keeps a started server; refused past [`MAX_SERVERS`] running ones.
    pub fn add(&self, info: LspServerInfo, server: Arc<Server>) -> Result<(), SessionError> {
        let mut servers = self.servers.lock().unwrap();
        servers.retain(|_, (_, s)| s.ended().is_none());
        if servers.len() >= MAX_SERVERS {
            return Err(SessionError::Busy(format!(
                "this session runs {MAX_SERVERS} language servers already: stop one (lsp.stop)"
            )));
        }
        servers.insert(info.server, (info, server));
        Ok(())
    }

    /// A running server; one that has ended is forgotten, and the error says why it ended.
    pub fn get(&self, id: u64) -> Result<Arc<Server>, SessionError> {
        let mut servers = self.servers.lock().unwrap();
        let Some((_, server)) = servers.get(&id) else { return Err(SessionError::NoSuchLspServer(id)) };
        if let Some(why) = server.ended() {
            servers.remove(&id);
            return Err(SessionError::Lsp(format!("language server {id} is gone: {why}")));
        }
        Ok(server.clone())
    }

    pub fn remove(&self, id: u64) -> Result<Arc<Server>, SessionError> {
        self.servers.lock().unwrap().remove(&id).map(|(_, s)| s).ok_or(SessionError::NoSuchLspServer(id))
    }

    pub fn list(&self) -> Vec<LspServerInfo> {
        let mut servers = self.servers.lock().unwrap();
        servers.retain(|_, (_, s)| s.ended().is_none());
        servers.values().map(|(info, _)| info.clone()).collect()
    }

    /// The pool of servers running `command` on `root`.
    pub fn pool(&self, root: &str, command: &[String]) -> Arc<Pool> {
        let mut pools = self.pools.lock().unwrap();
        pools.entry((root.to_string(), command.to_vec())).or_insert_with(|| Arc::new(Pool::new())).clone()
    }

    /// Forgets every server (the VM they ran in is gone): dropping them ends their readers.
    pub fn clear(&self) {
        self.servers.lock().unwrap().clear();
        self.pools.lock().unwrap().clear();
    }
}

/// Servers for `diagnostics.for_change`, each lent to one request at a time.
pub struct Pool {
    permits: Arc<tokio::sync::Semaphore>,
    idle: Mutex<Vec<(Arc<Server>, Instant)>>,
}

/// A server lent by a [`Pool`]; [`Lent::give_back`] returns it, dropping it ends it.
pub struct Lent {
    pub server: Arc<Server>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Pool {
    fn new() -> Self {
        Self { permits: Arc::new(tokio::sync::Semaphore::new(POOL_SIZE)), idle: Mutex::new(Vec::new()) }
    }

    /// An idle server, or a new one from `start` when none is idle; waits while
    /// [`POOL_SIZE`] are lent.
    pub async fn take<F, Fut>(&self, start: F) -> Result<Lent, SessionError>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<Server, SessionError>>,
    {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| SessionError::Internal("the pool is closed".into()))?;
        let reused = {
            let mut idle = self.idle.lock().unwrap();
            idle.retain(|(s, _)| s.ended().is_none());
            idle.pop()
        };
        let server = match reused {
            Some((server, _)) => server,
            None => Arc::new(start().await?),
        };
        Ok(Lent { server, _permit: permit })
    }

    /// Takes a server back for the next request; it is shut down after [`POOL_IDLE`] unused.
    pub fn give_back(self: &Arc<Self>, lent: Lent) {
        let stamp = Instant::now();
        self.idle.lock().unwrap().push((lent.server.clone(), stamp));
        drop(lent);
        let pool = Arc::downgrade(self);
        tokio::spawn(async move {
            tokio::time::sleep(POOL_IDLE).await;
            let Some(pool) = pool.upgrade() else { return };
            let expired = {
                let mut idle = pool.idle.lock().unwrap();
                let at = idle.iter().position(|(_, s)| *s == stamp);
                at.map(|i| idle.remove(i).0)
            };
            if let Some(server) = expired {
                server.stop(Duration::from_secs(2)).await;
            }
        });
    }
}

/// `file://` and the path, each byte outside LSP's unreserved characters and `/` percent-encoded.
pub fn file_uri(path: &str) -> String {
    let mut uri = String::from("file://");
    for b in path.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            uri.push(b as char);
        } else {
            uri.push_str(&format!("%{b:02X}"));
        }
    }
    uri
}

/// The path of a `file://` URI (percent-decoded); `None` for another scheme or bad escapes.
pub fn uri_path(uri: &str) -> Option<String> {
    let rest = uri.strip_prefix("file://")?;
    let mut out = Vec::with_capacity(rest.len());
    let mut bytes = rest.bytes();
    while let Some(b) = bytes.next() {
        if b == b'%' {
            let hex = [bytes.next()?, bytes.next()?];
            out.push(u8::from_str_radix(std::str::from_utf8(&hex).ok()?, 16).ok()?);
        } else {
            out.push(b);
        }
    }
    String::from_utf8(out).ok()
}

/// The URI a server's URI stands for, spelled as [`file_uri`] spells it (servers differ in
/// what they escape).
pub fn normal_uri(uri: &str) -> String {
    uri_path(uri).map_or_else(|| uri.to_string(), |p| file_uri(&p))
}

/// A path a change names: relative to its folder, without `.` or `..` parts.
pub fn check_relative(path: &str) -> Result<(), SessionError> {
    let bad = path.is_empty()
        || path.starts_with('/')
        || path.contains('\0')
        || path.split('/').any(|part| part.is_empty() || part == "." || part == "..");
    if bad {
        return Err(SessionError::InvalidArgument(format!(
            "{path:?} is not a path inside the folder (relative, no empty, `.` or `..` parts)"
        )));
    }
    Ok(())
}

/// `initialize` and `initialized`, as a client of the capabilities Umbra passes through; the
/// server's answer.
pub async fn initialize(
    server: &Server,
    root: &str,
    folder: &str,
    options: Option<Value>,
) -> Result<Value, SessionError> {
    let uri = file_uri(root);
    let mut params = json!({
        "processId": null,
        "clientInfo": {"name": "umbra", "version": env!("CARGO_PKG_VERSION")},
        "rootPath": root,
        "rootUri": uri,
        "workspaceFolders": [{"uri": uri, "name": folder}],
        "capabilities": {
            "workspace": {"configuration": true, "workspaceFolders": true},
            "window": {"workDoneProgress": true},
            "textDocument": {
                "synchronization": {"didSave": true},
                "publishDiagnostics": {"relatedInformation": true, "versionSupport": true},
                "definition": {"linkSupport": false},
                "references": {},
                "hover": {"contentFormat": ["markdown", "plaintext"]},
                "completion": {"completionItem": {"snippetSupport": false}},
                "documentSymbol": {"hierarchicalDocumentSymbolSupport": true},
            },
        },
    });
    if let Some(options) = options {
        params["initializationOptions"] = options;
    }
    let answer = server
        .request("initialize", params, INITIALIZE_TIMEOUT)
        .await?
        .map_err(|e| SessionError::Lsp(format!("the language server refused to initialize: {}", lsp_error_text(&e))))?;
    server.notify("initialized", json!({})).await?;
    Ok(answer)
}

/// An LSP error answer, as a line.
pub fn lsp_error_text(error: &Value) -> String {
    let code = error.get("code").and_then(Value::as_i64).unwrap_or(0);
    let message = error.get("message").and_then(Value::as_str).unwrap_or("(no message)");
    format!("error {code}: {message:.500}")
}

/// One file of a change, with its content before (`None`: it does not exist) and after (`None`:
/// deleted).
#[derive(Debug, Clone)]
pub struct FileChange {
    pub path: String,
    pub uri: String,
    pub language_id: String,
    pub before: Option<String>,
    pub after: Option<String>,
}

/// What a server reported for a change's files, before it and after it.
#[derive(Debug, Default)]
pub struct Reported {
    pub before: Vec<(String, Vec<Value>)>,
    pub after: Vec<(String, Vec<Value>)>,
    /// It settled both times before the deadline.
    pub complete: bool,
    /// Its documents were closed and their diagnostics cleared: it can serve another change.
    pub clean: bool,
}

/// Opens the files as they are, waits for the server to settle, changes them, waits again, and
/// closes them. Nothing is written to disk.
pub async fn diagnose(
    server: &Server,
    files: &[FileChange],
    deadline: tokio::time::Instant,
) -> Result<Reported, SessionError> {
    let mut reported = Reported::default();
    let v1 = server.next_version();
    let mark = server.heard();
    let mut open = Vec::new();
    for f in files {
        if let Some(text) = &f.before {
            let doc = json!({"uri": f.uri, "languageId": f.language_id, "version": v1, "text": text});
            server.notify("textDocument/didOpen", json!({"textDocument": doc})).await?;
            open.push(f.uri.clone());
        }
    }
    let settled_before = settle(server, &open, mark, v1, deadline).await?;
    reported.before = open.iter().map(|u| (u.clone(), diagnostics_since(server, u, mark))).collect();

    let v2 = server.next_version();
    let mark = server.heard();
    let mut changed = Vec::new();
    for f in files {
        let doc = |text: &str| json!({"uri": f.uri, "languageId": f.language_id, "version": v2, "text": text});
        match (&f.before, &f.after) {
            (Some(_), Some(text)) => {
                let params = json!({"textDocument": {"uri": f.uri, "version": v2}, "contentChanges": [{"text": text}]});
                server.notify("textDocument/didChange", params).await?;
            }
            (None, Some(text)) => {
                server.notify("textDocument/didOpen", json!({"textDocument": doc(text)})).await?;
                open.push(f.uri.clone());
            }
            (Some(_), None) => {
                server.notify("textDocument/didClose", json!({"textDocument": {"uri": f.uri}})).await?;
                open.retain(|u| u != &f.uri);
            }
            (None, None) => continue,
        }
        if f.after.is_some() {
            changed.push(f.uri.clone());
        }
    }
    let settled_after = settle(server, &changed, mark, v2, deadline).await?;
    reported.after = changed.iter().map(|u| (u.clone(), diagnostics_since(server, u, mark))).collect();
    reported.complete = settled_before && settled_after;

    // Close what is open; the server clears each file's diagnostics as it does.
    let mark = server.heard();
    for uri in &open {
        server.notify("textDocument/didClose", json!({"textDocument": {"uri": uri}})).await?;
    }
    let until = tokio::time::Instant::now() + Duration::from_secs(2);
    loop {
        let cleared =
            open.iter().all(|u| server.published(u).is_some_and(|p| p.seq > mark && p.diagnostics.is_empty()));
        if cleared || server.ended().is_some() || tokio::time::Instant::now() >= until {
            reported.clean = cleared && server.ended().is_none();
            break;
        }
        server.changed(until).await;
    }
    Ok(reported)
}

/// The diagnostics the server published for `uri` after message `mark` (none if it did not).
fn diagnostics_since(server: &Server, uri: &str, mark: u64) -> Vec<Value> {
    server.published(uri).filter(|p| p.seq > mark).map(|p| p.diagnostics).unwrap_or_default()
}

/// Waits until the server published for each of `uris` after message `mark` (for `version`
/// or later, when it says which), has no work in progress, and then said nothing for
/// [`QUIET`]. False if `deadline` came first.
async fn settle(
    server: &Server,
    uris: &[String],
    mark: u64,
    version: i64,
    deadline: tokio::time::Instant,
) -> Result<bool, SessionError> {
    loop {
        if let Some(why) = server.ended() {
            return Err(SessionError::Lsp(format!("the language server is gone: {why}")));
        }
        let all = uris
            .iter()
            .all(|u| server.published(u).is_some_and(|p| p.seq > mark && p.version.is_none_or(|v| v >= version)));
        let (busy, last) = server.busy();
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return Ok(false);
        }
        if all && !busy {
            let quiet_until = last.map_or(now, |l| tokio::time::Instant::from_std(l + QUIET));
            if now >= quiet_until {
                return Ok(true);
            }
            server.changed(quiet_until.min(deadline)).await;
        } else {
            server.changed(deadline).await;
        }
    }
}

/// The diagnostics of a server's report, for the client: paths relative to `root`, malformed
/// entries (the guest's) left out, at most 1000 per file.
pub fn convert(root: &str, reports: &[(String, Vec<Value>)]) -> Vec<Diagnostic> {
    let prefix = format!("{}/", root.trim_end_matches('/'));
    let mut out = Vec::new();
    for (uri, items) in reports {
        let path = match uri_path(uri) {
            Some(p) => p.strip_prefix(&prefix).map_or(p.clone(), str::to_string),
            None => uri.clone(),
        };
        for item in items.iter().take(1000) {
            let Some(range) = item.get("range").and_then(|r| serde_json::from_value::<Range>(r.clone()).ok()) else {
                continue;
            };
            let Some(message) = item.get("message").and_then(Value::as_str) else { continue };
            out.push(Diagnostic {
                path: path.clone(),
                range,
                severity: item.get("severity").and_then(Value::as_u64).and_then(|s| u8::try_from(s).ok()),
                message: message.chars().take(4000).collect(),
                source: item.get("source").and_then(Value::as_str).map(|s| s.chars().take(100).collect()),
                code: item.get("code").filter(|c| c.is_string() || c.is_number()).cloned(),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(line: u32, character: u32) -> Position {
        Position { line, character }
    }

    #[test]
    fn uris_round_trip_and_servers_spellings_meet() {
        let p = "/sessions/s/mnt/work/dir with space/é#?.py";
        let u = file_uri(p);
        assert_eq!(u, "file:///sessions/s/mnt/work/dir%20with%20space/%C3%A9%23%3F.py");
        assert_eq!(uri_path(&u).as_deref(), Some(p));
        // A server that leaves `é` and spaces as they are names the same file.
        assert_eq!(normal_uri("file:///sessions/s/mnt/work/dir with space/é%23%3F.py"), u);
        assert_eq!(uri_path("file:///bad%zz"), None);
        assert_eq!(uri_path("untitled:1"), None);
    }

    #[test]
    fn change_paths_stay_in_their_folder() {
        for ok in ["a.py", "pkg/mod.py", ".hidden/x.c", "a..b"] {
            check_relative(ok).unwrap();
        }
        for bad in ["", "/etc/passwd", "../x", "a/../../x", "a//b", "./a", "a/.", "a\0b", "a/"] {
            assert!(check_relative(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_report_becomes_folder_relative_and_malformed_entries_are_dropped() {
        let reports = vec![(
            file_uri("/r/w/a.py"),
            vec![
                json!({"range": {"start": {"line": 1, "character": 2}, "end": {"line": 1, "character": 5}},
                       "severity": 1, "message": "undefined name 'x'", "source": "pyflakes"}),
                json!({"range": "nonsense", "message": "dropped"}),
                json!({"range": {"start": {"line": 0, "character": 0}, "end": {"line": 0, "character": 0}}}),
                json!({"range": {"start": {"line": 0, "character": 0}, "end": {"line": 0, "character": 1}},
                       "severity": 999, "message": "kept", "code": {"an": "object"}}),
            ],
        )];
        let d = convert("/r/w", &reports);
        assert_eq!(d.len(), 2);
        assert_eq!((d[0].path.as_str(), d[0].range.start, d[0].severity), ("a.py", at(1, 2), Some(1)));
        assert_eq!((d[1].severity, d[1].code.as_ref()), (None, None));
    }
}
