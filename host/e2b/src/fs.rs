//! envd's `filesystem.Filesystem` service and its `/files` upload and download, over the
//! guest agent's file calls (`file.*`); what the agent has no call for (make a directory,
//! move, remove) runs as a command in the guest, one word per argument, never a shell.
//! Watching polls: the agent reports no file events, so a watcher lists the directory a few
//! times a second and reports what changed.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use umbra_api::client::Client;
use umbra_api::methods::{
    FileList, FileRead, FileStatMethod, FileWrite, ListParams, ReadParams, WriteParams, MAX_FILE_CHUNK,
};
use umbra_api::{Data, ErrorCode};
use umbra_proto::{FileKind, FileStat};

use crate::connect::{self, Body, ConnectError, StreamTx};
use crate::sandboxes::{
    connect_error, path_params, random_hex, resolve, run_in_guest, E2b, Sandbox, WATCHERS_PER_SANDBOX,
};
use crate::wire::{
    CreateWatcherResponse, EntryInfo, EntryResponse, FilesystemEvent, ListDirResponse, WatchEvent, WatchRequest,
    WatcherEvents, WrittenFile,
};

/// How often a watcher looks.
const POLL: Duration = Duration::from_millis(200);
/// Entries a watcher follows at most (beyond, it reports what it follows).
const WATCH_LIMIT: usize = 4096;
/// Bytes of an upload that are not file data (multipart preambles and part headers) held at
/// most, plus one piece of the body.
const MULTIPART_SLACK: u64 = 1 << 20;
/// Events a `WatchDir` stream holds for a client that reads slowly.
const WATCH_QUEUE: usize = 4096;
/// Events a `CreateWatcher` keeps for its next `GetWatcherEvents`.
const WATCHER_EVENTS: usize = 4096;
/// Entries one `ListDir` returns at most.
const LIST_LIMIT: usize = 100_000;
/// Levels one `ListDir` or recursive watch descends at most.
const MAX_DEPTH: u32 = 64;
/// Directories a recursive watch lists per look at most.
const WATCH_DIRS: usize = 1024;

fn not_found_is_file(e: umbra_api::ApiError, path: &str) -> ConnectError {
    match e.code {
        ErrorCode::NotFound => ConnectError::new("not_found", format!("path {path:?} not found: {}", e.message)),
        _ => connect_error(e),
    }
}

fn entry(path: &str, st: &FileStat) -> EntryInfo {
    let name = path.rsplit('/').find(|s| !s.is_empty()).unwrap_or("/").to_string();
    EntryInfo {
        name,
        kind: match st.kind {
            FileKind::Dir => "FILE_TYPE_DIRECTORY",
            FileKind::Symlink => "FILE_TYPE_SYMLINK",
            FileKind::File | FileKind::Other => "FILE_TYPE_FILE",
        },
        path: path.to_string(),
        size: st.size.to_string(),
        mode: st.mode & 0o7777,
        permissions: permissions(st),
        owner: user_name(st.uid),
        group: user_name(st.gid),
        modified_time: mtime(st.mtime_ms),
    }
}

/// A guest's modification time as RFC 3339.
fn mtime(ms: i64) -> String {
    crate::sandboxes::rfc3339_ms(ms)
}

fn user_name(id: u32) -> String {
    match id {
        0 => "root".into(),
        n => n.to_string(),
    }
}

/// `ls -l`'s mode string.
fn permissions(st: &FileStat) -> String {
    let kind = match st.kind {
        FileKind::Dir => 'd',
        FileKind::Symlink => 'l',
        _ => '-',
    };
    let bits = "rwxrwxrwx";
    std::iter::once(kind)
        .chain(bits.chars().enumerate().map(|(i, c)| if st.mode & (0o400 >> i) != 0 { c } else { '-' }))
        .collect()
}

async fn stat(client: &Client, session: &str, path: &str) -> Result<FileStat, ConnectError> {
    client.call::<FileStatMethod>(path_params(session, path)).await.map_err(|e| not_found_is_file(e, path))
}

async fn exists(client: &Client, session: &str, path: &str) -> Result<bool, ConnectError> {
    match client.call::<FileStatMethod>(path_params(session, path)).await {
        Ok(_) => Ok(true),
        Err(e) if e.code == ErrorCode::NotFound => Ok(false),
        Err(e) => Err(connect_error(e)),
    }
}

pub async fn stat_entry(e2b: &E2b, sb: &Sandbox, path: &str) -> Result<EntryResponse, ConnectError> {
    let path = resolve(path);
    let client = e2b.shared().await.map_err(connect_error)?;
    let st = stat(&client, &sb.id, &path).await?;
    Ok(EntryResponse { entry: entry(&path, &st) })
}

pub async fn list_dir(e2b: &E2b, sb: &Sandbox, path: &str, depth: u32) -> Result<ListDirResponse, ConnectError> {
    let root = resolve(path);
    let client = e2b.shared().await.map_err(connect_error)?;
    let st = stat(&client, &sb.id, &root).await?;
    if st.kind != FileKind::Dir {
        return Err(ConnectError::new("invalid_argument", format!("path {root:?} is not a directory")));
    }
    let mut entries = Vec::new();
    let mut level = vec![root];
    for _ in 0..depth.clamp(1, MAX_DEPTH) {
        if level.is_empty() {
            break;
        }
        let mut next = Vec::new();
        for dir in level {
            for (path, st) in children(&client, &sb.id, &dir, LIST_LIMIT - entries.len()).await? {
                if st.kind == FileKind::Dir {
                    next.push(path.clone());
                }
                entries.push(entry(&path, &st));
                if entries.len() >= LIST_LIMIT {
                    return Ok(ListDirResponse { entries });
                }
            }
        }
        level = next;
    }
    Ok(ListDirResponse { entries })
}

/// A directory's entries with their stat, at most `limit` of them (umbrad's listing would stop
/// at its default 10 000 otherwise; each entry costs a stat).
async fn children(
    client: &Client,
    session: &str,
    dir: &str,
    limit: usize,
) -> Result<Vec<(String, FileStat)>, ConnectError> {
    let limit = limit.min(LIST_LIMIT);
    let params =
        ListParams { session: session.into(), path: dir.into(), host: false, limit: Some(limit.max(1) as u32) };
    let list = client.call::<FileList>(params).await.map_err(|e| not_found_is_file(e, dir))?;
    let mut out = Vec::with_capacity(list.entries.len().min(limit));
    for e in list.entries.into_iter().take(limit) {
        // The guest names its entries: one path component each, or nothing.
        if e.name.is_empty() || e.name == "." || e.name == ".." || e.name.contains(['/', '\0']) {
            continue;
        }
        let path = format!("{}/{}", dir.trim_end_matches('/'), e.name);
        // Gone between the list and the stat: not there.
        if let Ok(st) = client.call::<FileStatMethod>(path_params(session, &path)).await {
            out.push((path, st));
        }
    }
    Ok(out)
}

pub async fn make_dir(e2b: &E2b, sb: &Sandbox, path: &str) -> Result<EntryResponse, ConnectError> {
    let path = resolve(path);
    let client = e2b.shared().await.map_err(connect_error)?;
    if exists(&client, &sb.id, &path).await? {
        return Err(ConnectError::new("already_exists", format!("path {path:?} already exists")));
    }
    run_in_guest(e2b.dedicated().await.map_err(connect_error)?, &sb.id, &["mkdir", "-p", "--", &path]).await?;
    Ok(EntryResponse { entry: entry(&path, &stat(&client, &sb.id, &path).await?) })
}

pub async fn move_entry(
    e2b: &E2b,
    sb: &Sandbox,
    source: &str,
    destination: &str,
) -> Result<EntryResponse, ConnectError> {
    let (source, destination) = (resolve(source), resolve(destination));
    let client = e2b.shared().await.map_err(connect_error)?;
    stat(&client, &sb.id, &source).await?;
    let conn = e2b.dedicated().await.map_err(connect_error)?;
    run_in_guest(conn, &sb.id, &["mv", "--", &source, &destination]).await?;
    Ok(EntryResponse { entry: entry(&destination, &stat(&client, &sb.id, &destination).await?) })
}

pub async fn remove(e2b: &E2b, sb: &Sandbox, path: &str) -> Result<serde_json::Value, ConnectError> {
    let path = resolve(path);
    let client = e2b.shared().await.map_err(connect_error)?;
    stat(&client, &sb.id, &path).await?;
    run_in_guest(e2b.dedicated().await.map_err(connect_error)?, &sb.id, &["rm", "-rf", "--", &path]).await?;
    Ok(serde_json::json!({}))
}

// ---- watching

/// What a watcher saw last: each path's kind, size and modification time.
type Seen = BTreeMap<String, (FileKind, u64, i64)>;

async fn look(client: &Client, session: &str, root: &str, recursive: bool) -> Result<Seen, ConnectError> {
    let mut seen = Seen::new();
    let mut dirs = vec![root.to_string()];
    let mut visited = 0;
    while let Some(dir) = dirs.pop() {
        visited += 1;
        if visited > WATCH_DIRS {
            break;
        }
        for (path, st) in children(client, session, &dir, WATCH_LIMIT - seen.len()).await? {
            if recursive && st.kind == FileKind::Dir {
                dirs.push(path.clone());
            }
            seen.insert(path, (st.kind, st.size, st.mtime_ms));
            if seen.len() >= WATCH_LIMIT {
                return Ok(seen);
            }
        }
    }
    Ok(seen)
}

/// What changed between two looks, as envd's events (names relative to the watched
/// directory; a new file that has content also gets a write, as inotify would report it).
fn changes(root: &str, before: &Seen, after: &Seen) -> Vec<(String, &'static str)> {
    let rel = |p: &str| p.strip_prefix(root).unwrap_or(p).trim_start_matches('/').to_string();
    let mut out = Vec::new();
    for (path, now) in after {
        match before.get(path) {
            None => {
                out.push((rel(path), "EVENT_TYPE_CREATE"));
                if now.0 == FileKind::File && now.1 > 0 {
                    out.push((rel(path), "EVENT_TYPE_WRITE"));
                }
            }
            Some(was) if was != now => out.push((rel(path), "EVENT_TYPE_WRITE")),
            Some(_) => {}
        }
    }
    for path in before.keys().filter(|p| !after.contains_key(*p)) {
        out.push((rel(path), "EVENT_TYPE_REMOVE"));
    }
    out
}

/// Looks at `root` every [`POLL`] and hands each change to `emit` (which says whether to go
/// on); ends with the error that stopped it.
async fn watch(
    e2b: &E2b,
    sb: &Sandbox,
    root: &str,
    req: &WatchRequest,
    mut emit: impl FnMut(FilesystemEvent) -> Result<(), ConnectError>,
) -> ConnectError {
    let client = match e2b.shared().await {
        Ok(c) => c,
        Err(e) => return connect_error(e),
    };
    let mut before = match look(&client, &sb.id, root, req.recursive).await {
        Ok(s) => s,
        Err(e) => return e,
    };
    loop {
        tokio::time::sleep(POLL).await;
        let after = match look(&client, &sb.id, root, req.recursive).await {
            Ok(s) => s,
            Err(e) => return e,
        };
        for (name, kind) in changes(root, &before, &after) {
            let entry = match req.include_entry {
                true => {
                    let path = format!("{}/{name}", root.trim_end_matches('/'));
                    client.call::<FileStatMethod>(path_params(&sb.id, &path)).await.ok().map(|st| entry(&path, &st))
                }
                false => None,
            };
            if let Err(e) = emit(FilesystemEvent { name, kind, entry }) {
                return e;
            }
        }
        before = after;
    }
}

async fn watched_dir(e2b: &E2b, sb: &Sandbox, path: &str) -> Result<String, ConnectError> {
    let root = resolve(path);
    let client = e2b.shared().await.map_err(connect_error)?;
    match stat(&client, &sb.id, &root).await?.kind {
        FileKind::Dir => Ok(root),
        _ => Err(ConnectError::new("invalid_argument", format!("path {root:?} is not a directory"))),
    }
}

/// `WatchDir`: a stream of changes, from a start message on.
pub async fn watch_dir(e2b: Arc<E2b>, sb: Arc<Sandbox>, req: WatchRequest, keepalive: Duration) -> Response<Body> {
    let root = match watched_dir(&e2b, &sb, &req.path).await {
        Ok(r) => r,
        Err(e) => return connect::stream_error(&e),
    };
    let (response, tx) = connect::stream_response();
    tokio::spawn(async move {
        if tx.send(&WatchEvent::Start {}).await.is_err() {
            return;
        }
        let (events, mut rx) = tokio::sync::mpsc::channel(WATCH_QUEUE);
        // A client that falls this far behind ends its watch with a clear error; the queue,
        // not the guest's churn, bounds what is held.
        let watching = watch(&e2b, &sb, &root, &req, |ev| match events.try_send(ev) {
            Ok(()) => Ok(()),
            Err(tokio::sync::mpsc::error::TrySendError::Full(_)) => Err(ConnectError::new(
                "resource_exhausted",
                format!("the watcher's client fell {WATCH_QUEUE} events behind"),
            )),
            Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => {
                Err(ConnectError::new("canceled", "the watcher was stopped"))
            }
        });
        tokio::pin!(watching);
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
        let error = loop {
            tokio::select! {
                e = &mut watching => break Some(e),
                ev = rx.recv() => {
                    let Some(ev) = ev else { break None };
                    if forward(&tx, WatchEvent::Filesystem(Box::new(ev))).await.is_err() {
                        return;
                    }
                }
                _ = ticks.tick() => {
                    if forward(&tx, WatchEvent::Keepalive {}).await.is_err() {
                        return;
                    }
                }
                _ = tx.closed() => return,
            }
        };
        tx.end(error).await;
    });
    response
}

async fn forward(tx: &StreamTx, ev: WatchEvent) -> Result<(), connect::Gone> {
    tx.send(&ev).await
}

pub async fn create_watcher(
    e2b: Arc<E2b>,
    sb: Arc<Sandbox>,
    req: WatchRequest,
) -> Result<CreateWatcherResponse, ConnectError> {
    if sb.watchers.lock().unwrap().len() >= WATCHERS_PER_SANDBOX {
        return Err(ConnectError::new(
            "resource_exhausted",
            format!("a sandbox keeps at most {WATCHERS_PER_SANDBOX} watchers: remove one first"),
        ));
    }
    let root = watched_dir(&e2b, &sb, &req.path).await?;
    let id = random_hex(8);
    let events: Arc<Mutex<Vec<FilesystemEvent>>> = Arc::default();
    let kept = events.clone();
    let (sandbox, e2b2) = (sb.clone(), e2b.clone());
    let task = tokio::spawn(async move {
        let e = watch(&e2b2, &sandbox, &root, &req, |ev| {
            let mut events = kept.lock().unwrap();
            if events.len() < WATCHER_EVENTS {
                events.push(ev);
            }
            Ok(())
        })
        .await;
        tracing::debug!(sandbox = %sandbox.id, "E2B: a watcher stopped: {e}");
    });
    sb.watchers.lock().unwrap().insert(id.clone(), (events, task.abort_handle()));
    Ok(CreateWatcherResponse { watcher_id: id })
}

pub fn watcher_events(sb: &Sandbox, id: &str) -> Result<WatcherEvents, ConnectError> {
    let watchers = sb.watchers.lock().unwrap();
    let (events, _) =
        watchers.get(id).ok_or_else(|| ConnectError::new("not_found", format!("watcher {id:?} not found")))?;
    let taken = std::mem::take(&mut *events.lock().unwrap());
    Ok(WatcherEvents { events: taken })
}

pub fn remove_watcher(sb: &Sandbox, id: &str) -> Result<serde_json::Value, ConnectError> {
    let (_, task) = sb
        .watchers
        .lock()
        .unwrap()
        .remove(id)
        .ok_or_else(|| ConnectError::new("not_found", format!("watcher {id:?} not found")))?;
    task.abort();
    Ok(serde_json::json!({}))
}

// ---- /files

/// envd's HTTP errors: `{code, message}` with the status.
pub fn http_error(status: StatusCode, message: impl Into<String>) -> Response<Body> {
    let body = serde_json::json!({ "code": status.as_u16(), "message": message.into() });
    let mut r = Response::new(connect::full(body.to_string()));
    *r.status_mut() = status;
    r.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    r
}

fn file_error(e: umbra_api::ApiError, path: &str) -> Response<Body> {
    let status = match e.code {
        ErrorCode::NotFound => StatusCode::NOT_FOUND,
        ErrorCode::InvalidParams => StatusCode::BAD_REQUEST,
        ErrorCode::PermissionDenied => StatusCode::FORBIDDEN,
        ErrorCode::SessionNotFound | ErrorCode::SessionLost => StatusCode::BAD_GATEWAY,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    http_error(status, format!("{path}: {}", e.message))
}

/// `GET /files?path=…`: the file's bytes, streamed as the guest gives them.
pub async fn download(e2b: Arc<E2b>, sb: Arc<Sandbox>, path: &str) -> Response<Body> {
    let path = resolve(path);
    let client = match e2b.shared().await {
        Ok(c) => c,
        Err(e) => return file_error(e, &path),
    };
    match client.call::<FileStatMethod>(path_params(&sb.id, &path)).await {
        Ok(st) if st.kind == FileKind::Dir => {
            return http_error(StatusCode::BAD_REQUEST, format!("path {path:?} is a directory"))
        }
        Ok(_) => {}
        Err(e) => return file_error(e, &path),
    }
    let (session, file) = (sb.id.clone(), path.clone());
    let read = move |offset: u64| ReadParams {
        session: session.clone(),
        path: file.clone(),
        host: false,
        offset,
        len: Some(MAX_FILE_CHUNK),
    };
    // The first piece decides the status; the rest follows as it comes.
    let first = match client.call::<FileRead>(read(0)).await {
        Ok(d) => d,
        Err(e) => return file_error(e, &path),
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
    tokio::spawn(async move {
        let mut piece = first;
        let mut offset = 0u64;
        loop {
            let Ok(bytes) = piece.data.to_bytes() else {
                let _ = tx.send(Err(std::io::Error::other("umbrad sent data that is not base64"))).await;
                return;
            };
            offset += bytes.len() as u64;
            let done = piece.eof || bytes.is_empty();
            if !bytes.is_empty() && tx.send(Ok(Bytes::from(bytes))).await.is_err() {
                return;
            }
            if done {
                return;
            }
            piece = match client.call::<FileRead>(read(offset)).await {
                Ok(d) => d,
                // The response is aborted: the client sees a failed transfer, not a short file.
                Err(e) => {
                    tracing::warn!(path = %path, "E2B: reading a file stopped: {}", e.message);
                    let _ = tx.send(Err(std::io::Error::other(e.message))).await;
                    return;
                }
            };
        }
    });
    let frames = tokio_stream::wrappers::ReceiverStream::new(rx);
    let body = StreamBody::new(futures_util::StreamExt::map(frames, |b| b.map(Frame::data)));
    let mut r = Response::new(BodyExt::boxed(body));
    r.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/octet-stream"));
    r
}

/// Writes one file from a stream of byte pieces, in requests of at most `MAX_FILE_CHUNK`.
struct FileWriter<'a> {
    client: &'a Client,
    session: &'a str,
    path: String,
    written: u64,
    pending: Vec<u8>,
}

impl<'a> FileWriter<'a> {
    fn new(client: &'a Client, session: &'a str, path: String) -> Self {
        Self { client, session, path, written: 0, pending: Vec::new() }
    }

    async fn push(&mut self, bytes: &[u8]) -> Result<(), umbra_api::ApiError> {
        self.pending.extend_from_slice(bytes);
        while self.pending.len() >= MAX_FILE_CHUNK as usize {
            let rest = self.pending.split_off(MAX_FILE_CHUNK as usize);
            let piece = std::mem::replace(&mut self.pending, rest);
            self.write(&piece).await?;
        }
        Ok(())
    }

    async fn write(&mut self, piece: &[u8]) -> Result<(), umbra_api::ApiError> {
        let params = WriteParams {
            session: self.session.into(),
            path: self.path.clone(),
            host: false,
            data: Data::base64(piece),
            append: false,
            // The first piece replaces the file; the rest go after it.
            offset: (self.written > 0).then_some(self.written),
            create_dirs: true,
            permissions: None,
        };
        self.client.call::<FileWrite>(params).await?;
        self.written += piece.len() as u64;
        Ok(())
    }

    async fn finish(mut self) -> Result<WrittenFile, umbra_api::ApiError> {
        // An empty file, or the last piece.
        if !self.pending.is_empty() || self.written == 0 {
            let piece = std::mem::take(&mut self.pending);
            self.write(&piece).await?;
        }
        let name = self.path.rsplit('/').next().unwrap_or_default().to_string();
        Ok(WrittenFile { name, kind: "file", path: self.path })
    }
}

/// `POST /files`: multipart (`file` parts, each named by its path) or a raw body to `path`.
pub async fn upload(
    e2b: Arc<E2b>,
    sb: Arc<Sandbox>,
    headers: &HeaderMap,
    query_path: Option<String>,
    body: hyper::body::Incoming,
) -> Response<Body> {
    let client = match e2b.shared().await {
        Ok(c) => c,
        Err(e) => return file_error(e, "/files"),
    };
    let content_type = headers.get(http::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default();
    if headers.get(http::header::CONTENT_ENCODING).is_some_and(|v| v.as_bytes() != b"identity") {
        return http_error(StatusCode::BAD_REQUEST, "compressed uploads are not supported here: send them plain");
    }
    let stream = http_body_util::BodyStream::new(body);
    let data = futures_util::StreamExt::filter_map(stream, |frame| async move {
        match frame {
            Ok(f) => f.into_data().ok().map(Ok::<Bytes, std::io::Error>),
            Err(e) => Some(Err(std::io::Error::other(e))),
        }
    });
    // What the multipart parser holds is what it read less what it handed out as file data
    // (preambles, part headers): bounded, or a client could grow it without end.
    let (pulled, handed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let (p, h) = (pulled.clone(), handed.clone());
    let data = futures_util::StreamExt::map(data, move |piece| {
        let bytes = piece?;
        let held = p.fetch_add(bytes.len() as u64, Ordering::Relaxed) + bytes.len() as u64 - h.load(Ordering::Relaxed);
        match held > MULTIPART_SLACK {
            true => Err(std::io::Error::other(format!("more than {MULTIPART_SLACK} bytes of multipart headers"))),
            false => Ok(bytes),
        }
    });
    let mut written = Vec::new();
    if let Ok(boundary) = multer::parse_boundary(content_type) {
        let mut multipart = multer::Multipart::new(data, boundary);
        let single = query_path;
        loop {
            let mut field = match multipart.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => return http_error(StatusCode::BAD_REQUEST, format!("a malformed multipart body: {e}")),
            };
            if field.name() != Some("file") {
                continue;
            }
            let path = match (&single, field.file_name()) {
                (Some(p), _) => resolve(p),
                (None, Some(name)) => resolve(name),
                (None, None) => {
                    return http_error(StatusCode::BAD_REQUEST, "a file part without a path (its filename)")
                }
            };
            let mut w = FileWriter::new(&client, &sb.id, path.clone());
            loop {
                match field.chunk().await {
                    Ok(Some(bytes)) => {
                        handed.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                        if let Err(e) = w.push(&bytes).await {
                            return file_error(e, &path);
                        }
                    }
                    Ok(None) => break,
                    Err(e) => return http_error(StatusCode::BAD_REQUEST, format!("a malformed multipart body: {e}")),
                }
            }
            match w.finish().await {
                Ok(f) => written.push(f),
                Err(e) => return file_error(e, &path),
            }
        }
    } else {
        let Some(path) = query_path.map(|p| resolve(&p)) else {
            return http_error(StatusCode::BAD_REQUEST, "an upload that is not multipart needs ?path=");
        };
        let mut w = FileWriter::new(&client, &sb.id, path.clone());
        tokio::pin!(data);
        while let Some(piece) = futures_util::StreamExt::next(&mut data).await {
            match piece {
                Ok(bytes) => {
                    if let Err(e) = w.push(&bytes).await {
                        return file_error(e, &path);
                    }
                }
                Err(e) => return http_error(StatusCode::BAD_REQUEST, format!("the request body failed: {e}")),
            }
        }
        match w.finish().await {
            Ok(f) => written.push(f),
            Err(e) => return file_error(e, &path),
        }
    }
    if written.is_empty() {
        return http_error(StatusCode::BAD_REQUEST, "no file in the upload");
    }
    connect::unary(Ok::<_, ConnectError>(written))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(kind: FileKind, mode: u32) -> FileStat {
        FileStat { kind, size: 5, mode, uid: 0, gid: 1000, mtime_ms: 1_000 }
    }

    #[test]
    fn entries_read_as_envd_writes_them() {
        let e = entry("/home/user/a.txt", &st(FileKind::File, 0o100644));
        assert_eq!((e.name.as_str(), e.kind, e.size.as_str(), e.mode), ("a.txt", "FILE_TYPE_FILE", "5", 0o644));
        assert_eq!((e.permissions.as_str(), e.owner.as_str(), e.group.as_str()), ("-rw-r--r--", "root", "1000"));
        assert_eq!(e.modified_time, "1970-01-01T00:00:01.000Z");
        assert_eq!(entry("/home/user/d/", &st(FileKind::Dir, 0o40755)).permissions, "drwxr-xr-x");
        // The guest picks its times: any of them reads as a time, none panics.
        assert_eq!(mtime(i64::MAX), "1970-01-01T00:00:00.000Z");
        assert_eq!(mtime(i64::MIN), "1970-01-01T00:00:00.000Z");
        assert_eq!(mtime(-1_000), "1969-12-31T23:59:59.000Z");
    }

    #[test]
    fn changes_are_created_written_and_removed() {
        let a = |size, mtime| (FileKind::File, size, mtime);
        let before: Seen =
            [("/w/old".to_string(), a(1, 1)), ("/w/same".to_string(), a(1, 1)), ("/w/gone".to_string(), a(1, 1))]
                .into();
        let after: Seen = [
            ("/w/old".to_string(), a(2, 2)),
            ("/w/same".to_string(), a(1, 1)),
            ("/w/new".to_string(), a(3, 3)),
            ("/w/empty".to_string(), a(0, 3)),
        ]
        .into();
        let got = changes("/w", &before, &after);
        assert_eq!(
            got,
            vec![
                ("empty".to_string(), "EVENT_TYPE_CREATE"),
                ("new".to_string(), "EVENT_TYPE_CREATE"),
                ("new".to_string(), "EVENT_TYPE_WRITE"),
                ("old".to_string(), "EVENT_TYPE_WRITE"),
                ("gone".to_string(), "EVENT_TYPE_REMOVE"),
            ]
        );
    }
}
