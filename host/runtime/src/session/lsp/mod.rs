//! Language servers in the guest, and the diagnostics a proposed change would bring
//! (`docs/diagnostics.md`).
//!
//! A session keeps two kinds of server in its [`Registry`]: the ones a client started with
//! `lsp.start`, which it drives itself, and pools of servers `diagnostics.for_change` takes two
//! of per request (one for each side of the change, asked at once). A pooled server is used
//! by one request at a time, so concurrent requests never see each other's changes; its
//! documents are closed (and their diagnostics cleared) before it goes back, and a server
//! that does not clear them is not reused.
//!
//! A change is never written anywhere: it lives in a server's open documents (LSP's
//! `didOpen`, as an editor's unsaved buffers), so the folder, its shadow and the host's files
//! are untouched by construction.

pub mod frame;
pub mod server;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use umbra_api::lsp::{Diagnostic, LspServerInfo};
#[cfg(test)]
use umbra_api::lsp::{Position, Range};

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
/// Most bytes of text one change may hold, its files before and after.
pub const MAX_CHANGE_BYTES: usize = 32 << 20;

/// A pool's folder root and server command.
type PoolKey = (String, Vec<String>);

/// A session's language servers.
#[derive(Default)]
pub struct Registry {
    next: AtomicU64,
    servers: Mutex<BTreeMap<u64, (LspServerInfo, Arc<Server>)>>,
    /// Servers being started for `lsp.start`: places held against [`MAX_SERVERS`].
    starting: Arc<AtomicU64>,
    pools: Mutex<HashMap<PoolKey, Arc<Pool>>>,
}

impl Registry {
    pub fn next_id(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// A place for one more server, held until the returned guard goes (keep the server with
    /// [`Self::add`] before that); refused past [`MAX_SERVERS`] running or starting ones.
    pub fn reserve(&self) -> Result<Reserved, SessionError> {
        let mut servers = self.servers.lock().unwrap();
        servers.retain(|_, (_, s)| s.ended().is_none());
        if servers.len() + self.starting.load(Ordering::Acquire) as usize >= MAX_SERVERS {
            return Err(SessionError::Busy(format!(
                "this session runs {MAX_SERVERS} language servers already: stop one (lsp.stop)"
            )));
        }
        self.starting.fetch_add(1, Ordering::AcqRel);
        Ok(Reserved(self.starting.clone()))
    }

    /// Keeps a started server in the place `_place` held for it.
    pub fn add(&self, info: LspServerInfo, server: Arc<Server>, _place: Reserved) {
        self.servers.lock().unwrap().insert(info.server, (info, server));
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

/// A place [`Registry::reserve`] holds; given back when dropped.
pub struct Reserved(Arc<AtomicU64>);

impl Drop for Reserved {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
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

    /// `n` servers (at most [`POOL_SIZE`]): idle ones, and new ones from `start` (together) for
    /// the rest; waits while too many are lent. The `n` places are taken at once, so two requests
    /// never each hold one and wait for another.
    pub async fn take<F, Fut>(&self, n: usize, start: F) -> Result<Vec<Lent>, SessionError>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<Server, SessionError>>,
    {
        let n = n.clamp(1, POOL_SIZE);
        let mut permits = self
            .permits
            .clone()
            .acquire_many_owned(n as u32)
            .await
            .map_err(|_| SessionError::Internal("the pool is closed".into()))?;
        let mut servers: Vec<Arc<Server>> = {
            let mut idle = self.idle.lock().unwrap();
            idle.retain(|(s, _)| s.ended().is_none());
            let keep = idle.len().saturating_sub(n);
            idle.drain(keep..).map(|(s, _)| s).collect()
        };
        let missing = n - servers.len();
        for started in futures_util::future::join_all((0..missing).map(|_| start())).await {
            servers.push(Arc::new(started?));
        }
        let mut lent = Vec::with_capacity(n);
        for server in servers {
            let permit = permits.split(1).expect("one permit taken per server");
            lent.push(Lent { server, _permit: permit });
        }
        Ok(lent)
    }

    /// Takes a server back for the next request; it is shut down after [`POOL_IDLE`] unused.
    pub fn give_back(self: &Arc<Self>, lent: Lent) {
        lent.server.forget_reports();
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
            "workspace": {"configuration": true},
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

/// What a server reported for one changed file, before the change and after it; `None` where
/// it did not report in time (or, after, for a deleted file): unknown, not clean.
#[derive(Debug)]
pub struct FileReport {
    pub uri: String,
    pub before: Option<Vec<Diagnostic>>,
    pub after: Option<Vec<Diagnostic>>,
}

/// The side of a change a server is asked about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The files as they are.
    Before,
    /// The files as the change makes them.
    After,
}

/// What one server said about one side of a change.
#[derive(Debug, Default)]
pub struct SideReport {
    /// Per file of the change, in its order: its diagnostics, or `None` when unknown.
    pub files: Vec<Option<Vec<Diagnostic>>>,
    /// It settled before the deadline.
    pub complete: bool,
    /// Its documents were closed and their diagnostics cleared: it can serve another change.
    pub clean: bool,
}

/// Opens the files as they are on `side`, waits for the server to settle, takes its reports and
/// closes them again. The two sides run on two servers at once (each waits out its server's
/// own lint delay and quiet period, so together they take the time of one). Nothing is
/// written to disk: the text lives in the server's open documents.
pub async fn report(
    server: &Server,
    files: &[FileChange],
    side: Side,
    deadline: tokio::time::Instant,
) -> Result<SideReport, SessionError> {
    let text = |f: &FileChange| match side {
        Side::Before => f.before.clone(),
        Side::After => f.after.clone(),
    };
    let version = server.next_version();
    let mark = server.heard();
    let mut open = Vec::new();
    for f in files {
        if let Some(text) = text(f) {
            let doc = json!({"uri": f.uri, "languageId": f.language_id, "version": version, "text": text});
            server.notify("textDocument/didOpen", json!({"textDocument": doc})).await?;
            open.push(f.uri.clone());
        }
    }
    let complete = settle(server, &open, mark, version, deadline).await?;
    let files = files
        .iter()
        .map(|f| match (text(f), side) {
            (Some(_), _) => report_since(server, &f.uri, mark, version),
            (None, Side::Before) => Some(Vec::new()), // a new file had nothing to say
            (None, Side::After) => None,              // a deleted one has nothing to say
        })
        .collect();

    // Close them; the server clears each file's diagnostics as it does.
    let mark = server.heard();
    for uri in &open {
        server.notify("textDocument/didClose", json!({"textDocument": {"uri": uri}})).await?;
    }
    let until = tokio::time::Instant::now() + Duration::from_secs(2);
    let clean = loop {
        let seen = server.heard();
        let cleared =
            open.iter().all(|u| server.published(u).is_some_and(|p| p.seq > mark && p.diagnostics.is_empty()));
        if cleared || server.ended().is_some() || tokio::time::Instant::now() >= until {
            break cleared && server.ended().is_none();
        }
        server.changed(seen, until).await;
    };
    Ok(SideReport { files, complete, clean })
}

/// What the server published for `uri` after message `mark`, for `version` or later when it
/// says which; `None` if it has not.
fn report_since(server: &Server, uri: &str, mark: u64, version: i64) -> Option<Vec<Diagnostic>> {
    server.published(uri).filter(|p| p.seq > mark && p.version.is_none_or(|v| v >= version)).map(|p| p.diagnostics)
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
        // Read before looking: whatever the server says after this wakes the wait below.
        let seen = server.heard();
        if let Some(why) = server.ended() {
            return Err(SessionError::Lsp(format!("the language server is gone: {why}")));
        }
        let all = uris.iter().all(|u| report_since(server, u, mark, version).is_some());
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
            server.changed(seen, quiet_until.min(deadline)).await;
        } else {
            server.changed(seen, deadline).await;
        }
    }
}

/// Diagnostics as the client gets them: each `path` (a server's URI) relative to `root`.
pub fn relative(root: &str, diagnostics: Vec<Diagnostic>) -> Vec<Diagnostic> {
    let prefix = format!("{}/", root.trim_end_matches('/'));
    diagnostics
        .into_iter()
        .map(|mut d| {
            if let Some(p) = uri_path(&d.path) {
                d.path = p.strip_prefix(&prefix).map_or(p.clone(), str::to_string);
            }
            d
        })
        .collect()
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
    fn reports_become_folder_relative() {
        let d = |path: String| Diagnostic {
            path,
            range: Range { start: at(1, 2), end: at(1, 5) },
            severity: Some(1),
            message: "m".into(),
            source: None,
            code: None,
        };
        let got =
            relative("/r/w/", vec![d(file_uri("/r/w/pkg/a b.py")), d(file_uri("/etc/x")), d("untitled:1".into())]);
        let paths: Vec<&str> = got.iter().map(|d| d.path.as_str()).collect();
        assert_eq!(paths, ["pkg/a b.py", "/etc/x", "untitled:1"]);
    }
}
