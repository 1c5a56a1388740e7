//! One language server: a process in the guest, spoken to in LSP over its stdin and stdout.
//!
//! A reader task owns the process and reads its output as it comes: responses go to the
//! request waiting for them, the server's own requests get the answers a minimal client gives
//! (`workspace/configuration`: nothing set; progress tokens: accepted), and notifications are
//! recorded (`publishDiagnostics` per file, `$/progress` begun and ended) and passed on. The
//! output is the guest's: a malformed message ends the server with the reason, never the host.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::sync::{oneshot, watch};
use umbra_api::lsp::{Diagnostic, Range};
use umbra_api::EventKind;

use super::frame::{encode, Decoder};
use crate::session::error::SessionError;
use crate::session::exec::{Exec, ExecControl};

/// What a server's notification is handed to (the session's event bus, for `lsp.start`'s).
pub type Sink = Box<dyn Fn(&str, &Value) + Send + Sync>;

/// The latest diagnostics a server published for one file: parsed and bounded as they come
/// (each one's `path` is the file's URI, as [`super::normal_uri`] spells it).
#[derive(Debug, Clone)]
pub struct Published {
    /// Its place among everything the server said ([`Server::heard`]).
    pub seq: u64,
    /// The document version they are for, when the server says (clangd does, pylsp does not).
    pub version: Option<i64>,
    pub diagnostics: Vec<Diagnostic>,
    /// What keeping them costs, counted against [`MAX_KEPT_BYTES`].
    bytes: usize,
}

/// What the reader learned, for whoever waits on it.
#[derive(Default)]
struct State {
    pending: HashMap<i64, oneshot::Sender<Result<Value, Value>>>,
    published: HashMap<String, Published>,
    published_bytes: usize,
    /// Messages heard so far.
    seq: u64,
    /// `$/progress` tokens begun and not ended.
    progress: HashSet<String>,
    last_heard: Option<Instant>,
    /// Why it is gone, once it is.
    ended: Option<String>,
    /// The end of its stderr, for the reason an exit gives.
    stderr: String,
}

/// How long a message may wait for the server to read it.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// Keeps at most this much of a server's stderr.
const STDERR_TAIL: usize = 2048;
/// What the host keeps of a server's diagnostics: the guest chooses how many it sends, so
/// past these bounds the server is ended instead.
const MAX_KEPT_FILES: usize = 4096;
const MAX_KEPT_BYTES: usize = 64 << 20;
/// Diagnostics kept per file (the rest are dropped).
const MAX_KEPT_PER_FILE: usize = 1000;
/// Longest URI, message and progress token kept; a publish for a longer URI is ignored.
const MAX_URI: usize = 4096;
const MAX_MESSAGE: usize = 4000;
const MAX_TOKEN: usize = 256;
/// Notifications of a server passed on as events: at most this many a second, each with
/// params of at most [`MAX_EVENT_PARAMS`] bytes (larger ones say only their size).
const EVENTS_PER_SECOND: u32 = 200;
const MAX_EVENT_PARAMS: usize = 256 << 10;

struct Shared {
    control: ExecControl,
    /// Held across one framed write, so messages never interleave.
    write: tokio::sync::Mutex<()>,
    state: Mutex<State>,
    /// Bumped whenever `state` changes.
    changed: watch::Sender<u64>,
    sink: Option<Sink>,
    /// The current second, and the notifications passed to `sink` in it.
    sunk: Mutex<(Instant, u32)>,
}

/// A running language server. Dropping it kills the process.
pub struct Server {
    shared: Arc<Shared>,
    reader: tokio::task::JoinHandle<()>,
    next_id: AtomicI64,
    next_version: AtomicI64,
}

impl Drop for Server {
    fn drop(&mut self) {
        // The reader owns the process: ending it drops the `Exec`, which kills the process.
        self.reader.abort();
    }
}

impl Server {
    /// Takes over a started process, whose notifications go to `sink`.
    pub fn new(exec: Exec, sink: Option<Sink>) -> Self {
        let shared = Arc::new(Shared {
            control: exec.control(),
            write: tokio::sync::Mutex::new(()),
            state: Mutex::new(State::default()),
            changed: watch::channel(0).0,
            sink,
            sunk: Mutex::new((Instant::now(), 0)),
        });
        let reader = tokio::spawn(read(exec, shared.clone()));
        Self { shared, reader, next_id: AtomicI64::new(1), next_version: AtomicI64::new(1) }
    }

    /// A document version no earlier message of this server used.
    pub fn next_version(&self) -> i64 {
        self.next_version.fetch_add(1, Ordering::Relaxed)
    }

    /// Why it is gone, once it is.
    pub fn ended(&self) -> Option<String> {
        self.shared.state.lock().unwrap().ended.clone()
    }

    /// How many messages it has sent so far.
    pub fn heard(&self) -> u64 {
        self.shared.state.lock().unwrap().seq
    }

    /// The latest diagnostics it published for `uri`.
    pub fn published(&self, uri: &str) -> Option<Published> {
        self.shared.state.lock().unwrap().published.get(uri).cloned()
    }

    /// Forgets its reports and open progress (a pooled server, between two requests).
    pub fn forget_reports(&self) {
        let mut state = self.shared.state.lock().unwrap();
        state.published.clear();
        state.published_bytes = 0;
        state.progress.clear();
    }

    /// Whether it has work in progress, and when it last said anything.
    pub fn busy(&self) -> (bool, Option<Instant>) {
        let state = self.shared.state.lock().unwrap();
        (!state.progress.is_empty(), state.last_heard)
    }

    /// Waits until the server has said more than `seen` messages ([`Self::heard`], read before
    /// the caller looked at its state: nothing said in between is missed), or ended, or `until`.
    pub async fn changed(&self, seen: u64, until: tokio::time::Instant) {
        let mut rx = self.shared.changed.subscribe();
        let _ = tokio::time::timeout_at(until, rx.wait_for(|heard| *heard > seen)).await;
    }

    /// Sends a notification; an error if the server has not taken it within
    /// [`WRITE_TIMEOUT`] (it does not read its input).
    pub async fn notify(&self, method: &str, params: Value) -> Result<(), SessionError> {
        let message = json!({"jsonrpc": "2.0", "method": method, "params": params});
        match tokio::time::timeout(WRITE_TIMEOUT, self.shared.send(&message)).await {
            Ok(sent) => sent,
            Err(_) => Err(SessionError::Timeout(format!(
                "the language server did not take {method} within {} s (it does not read its input)",
                WRITE_TIMEOUT.as_secs()
            ))),
        }
    }

    /// Sends a request and waits `timeout` for its answer (the sending included): `Ok(Err(error))`
    /// is the server's error answer.
    pub async fn request(
        &self,
        method: &str,
        params: Value,
        timeout: Duration,
    ) -> Result<Result<Value, Value>, SessionError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut state = self.shared.state.lock().unwrap();
            if let Some(why) = &state.ended {
                return Err(SessionError::Lsp(format!("the language server is gone: {why}")));
            }
            state.pending.insert(id, tx);
        }
        let message = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        let exchange = async {
            self.shared.send(&message).await?;
            rx.await.map_err(|_| {
                SessionError::Lsp(format!(
                    "the language server is gone: {}",
                    self.ended().unwrap_or_else(|| "ended".into())
                ))
            })
        };
        match tokio::time::timeout(timeout, exchange).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(e)) => {
                self.shared.state.lock().unwrap().pending.remove(&id);
                Err(e)
            }
            Err(_) => {
                self.shared.state.lock().unwrap().pending.remove(&id);
                let cancel = json!({"jsonrpc": "2.0", "method": "$/cancelRequest", "params": {"id": id}});
                let _ = tokio::time::timeout(Duration::from_secs(1), self.shared.send(&cancel)).await;
                Err(SessionError::Timeout(format!(
                    "the language server did not answer {method} within {} ms",
                    timeout.as_millis()
                )))
            }
        }
    }

    /// `shutdown` then `exit`, as LSP asks; killed if it has not gone `grace` later.
    pub async fn stop(&self, grace: Duration) {
        if self.ended().is_none() {
            let deadline = tokio::time::Instant::now() + grace;
            let _ = self.request("shutdown", Value::Null, grace).await;
            let exit = json!({"jsonrpc": "2.0", "method": "exit"});
            let _ = tokio::time::timeout_at(deadline, self.shared.send(&exit)).await;
            loop {
                let seen = self.heard();
                if self.ended().is_some() || tokio::time::Instant::now() >= deadline {
                    break;
                }
                self.changed(seen, deadline).await;
            }
        }
        self.shared.control.interrupt(9);
    }
}

impl Shared {
    async fn send(&self, message: &Value) -> Result<(), SessionError> {
        let _one = self.write.lock().await;
        self.control.write_stdin(encode(message)).await
    }

    /// Records why the server is gone (the first reason wins) and fails what waits on it.
    fn end(&self, why: String) {
        let mut state = self.state.lock().unwrap();
        if state.ended.is_none() {
            let tail = state.stderr.trim().lines().last().unwrap_or_default().to_string();
            state.ended = Some(if tail.is_empty() { why } else { format!("{why}; its last error line: {tail}") });
        }
        state.pending.clear(); // the waiting requests learn it from their dropped senders
        self.bump(&mut state);
    }

    /// Whether another notification may go to the sink this second.
    fn may_pass_on(&self) -> bool {
        let mut sunk = self.sunk.lock().unwrap();
        if sunk.0.elapsed() >= Duration::from_secs(1) {
            *sunk = (Instant::now(), 0);
        }
        sunk.1 += 1;
        sunk.1 <= EVENTS_PER_SECOND
    }

    fn bump(&self, state: &mut State) {
        state.seq += 1;
        state.last_heard = Some(Instant::now());
        self.changed.send_replace(state.seq);
    }
}

async fn read(mut exec: Exec, shared: Arc<Shared>) {
    let mut decoder = Decoder::default();
    let why = loop {
        let Some(event) = exec.next_event().await else { break "its process ended".to_string() };
        match event.kind {
            EventKind::Stdout { data, .. } => {
                let bytes = data.to_bytes().unwrap_or_default();
                match decoder.push(&bytes) {
                    Ok(messages) => {
                        for m in messages {
                            handle(&shared, m).await;
                        }
                    }
                    Err(e) => {
                        shared.control.interrupt(9);
                        break format!("it sent {e}");
                    }
                }
            }
            EventKind::Stderr { data, .. } => {
                let mut state = shared.state.lock().unwrap();
                state.stderr.push_str(&String::from_utf8_lossy(&data.to_bytes().unwrap_or_default()));
                if state.stderr.len() > STDERR_TAIL {
                    let cut = state.stderr.len() - STDERR_TAIL;
                    let cut = (cut..state.stderr.len()).find(|&i| state.stderr.is_char_boundary(i)).unwrap_or(0);
                    state.stderr.drain(..cut);
                }
            }
            EventKind::Exit(exit) => {
                let how = match (exit.code, exit.signal) {
                    (Some(code), _) => format!("it exited with code {code}"),
                    (_, Some(signal)) => format!("it was killed by signal {signal}"),
                    _ => "it ended".to_string(),
                };
                break match exit.reason {
                    Some(reason) => format!("{how} ({reason})"),
                    None => how,
                };
            }
            _ => {}
        }
    };
    shared.end(why);
}

async fn handle(shared: &Shared, message: Value) {
    let method = message.get("method").and_then(Value::as_str).map(str::to_string);
    let id = message.get("id").cloned().filter(|id| id.is_i64() || id.is_string());
    match (method, id) {
        // A response.
        (None, Some(id)) => {
            let waiting = id.as_i64().and_then(|id| shared.state.lock().unwrap().pending.remove(&id));
            if let Some(tx) = waiting {
                let answer = match message.get("error") {
                    Some(e) => Err(e.clone()),
                    None => Ok(message.get("result").cloned().unwrap_or(Value::Null)),
                };
                let _ = tx.send(answer);
            }
            shared.bump(&mut shared.state.lock().unwrap());
        }
        // A request of the server's: the answers of a client that keeps no settings.
        (Some(method), Some(id)) => {
            let params = message.get("params").cloned().unwrap_or(Value::Null);
            let result = match method.as_str() {
                "workspace/configuration" => {
                    let n = params.get("items").and_then(Value::as_array).map_or(0, Vec::len).min(1024);
                    Ok(Value::Array(vec![Value::Null; n]))
                }
                "window/workDoneProgress/create" | "client/registerCapability" | "client/unregisterCapability" => {
                    Ok(Value::Null)
                }
                "workspace/workspaceFolders" => Ok(Value::Null),
                "window/showMessageRequest" => Ok(Value::Null),
                "workspace/applyEdit" => Ok(json!({"applied": false, "failureReason": "read-only client"})),
                _ => Err(json!({"code": -32601, "message": format!("the client does not handle {method:.100}")})),
            };
            let reply = match result {
                Ok(r) => json!({"jsonrpc": "2.0", "id": id, "result": r}),
                Err(e) => json!({"jsonrpc": "2.0", "id": id, "error": e}),
            };
            // Bounded: a server that does not read its input must not stop this reader.
            let _ = tokio::time::timeout(Duration::from_secs(5), shared.send(&reply)).await;
            shared.bump(&mut shared.state.lock().unwrap());
        }
        (Some(method), None) => {
            let params = message.get("params").cloned().unwrap_or(Value::Null);
            {
                let mut state = shared.state.lock().unwrap();
                match method.as_str() {
                    "textDocument/publishDiagnostics" => {
                        let uri = params.get("uri").and_then(Value::as_str).filter(|u| u.len() <= MAX_URI);
                        if let Some(uri) = uri {
                            let uri = super::normal_uri(uri);
                            let items = params.get("diagnostics").and_then(Value::as_array);
                            let diagnostics: Vec<Diagnostic> = items
                                .into_iter()
                                .flatten()
                                .filter_map(|d| parse_diagnostic(&uri, d))
                                .take(MAX_KEPT_PER_FILE)
                                .collect();
                            let bytes = uri.len()
                                + diagnostics
                                    .iter()
                                    .map(|d| 128 + d.message.len() + d.source.as_ref().map_or(0, String::len))
                                    .sum::<usize>();
                            let version = params.get("version").and_then(Value::as_i64);
                            let seq = state.seq + 1;
                            let replaced = state.published.get(&uri).map_or(0, |p| p.bytes);
                            let kept = state.published_bytes - replaced + bytes;
                            if kept > MAX_KEPT_BYTES || (replaced == 0 && state.published.len() >= MAX_KEPT_FILES) {
                                drop(state);
                                shared.control.interrupt(9);
                                shared.end(format!(
                                    "it published more diagnostics than the host keeps ({MAX_KEPT_FILES} files, \
                                     {} MiB)",
                                    MAX_KEPT_BYTES >> 20
                                ));
                                return;
                            }
                            state.published_bytes = kept;
                            state.published.insert(uri, Published { seq, version, diagnostics, bytes });
                        }
                    }
                    "$/progress" => {
                        let token = params.get("token").map(Value::to_string).unwrap_or_default();
                        if token.len() > MAX_TOKEN {
                            shared.bump(&mut state);
                            drop(state);
                            return;
                        }
                        match params.pointer("/value/kind").and_then(Value::as_str) {
                            // Bounded: a server that only begins cannot grow this forever.
                            Some("begin") if state.progress.len() < 4096 => {
                                state.progress.insert(token);
                            }
                            Some("end") => {
                                state.progress.remove(&token);
                            }
                            _ => {}
                        }
                    }
                    _ => {}
                }
                shared.bump(&mut state);
            }
            if let Some(sink) = &shared.sink {
                if shared.may_pass_on() {
                    sink(&method, &bounded_params(params));
                }
            }
        }
        (None, None) => shared.bump(&mut shared.state.lock().unwrap()),
    }
}

/// A notification's params as an event carries them: whole up to [`MAX_EVENT_PARAMS`] bytes
/// of JSON, else only their size (and the file, for diagnostics).
fn bounded_params(params: Value) -> Value {
    let size = params.to_string().len();
    if size <= MAX_EVENT_PARAMS {
        return params;
    }
    let uri = params.get("uri").and_then(Value::as_str).filter(|u| u.len() <= MAX_URI).map(str::to_string);
    json!({"uri": uri, "omitted": format!("params of {size} bytes (more than {MAX_EVENT_PARAMS})")})
}

/// One diagnostic of a report, if well formed (the guest's: malformed ones are dropped).
fn parse_diagnostic(uri: &str, item: &Value) -> Option<Diagnostic> {
    let range = serde_json::from_value::<Range>(item.get("range")?.clone()).ok()?;
    let message = item.get("message")?.as_str()?;
    Some(Diagnostic {
        path: uri.to_string(),
        range,
        severity: item.get("severity").and_then(Value::as_u64).and_then(|s| u8::try_from(s).ok()),
        message: message.chars().take(MAX_MESSAGE).collect(),
        source: item.get("source").and_then(Value::as_str).map(|s| s.chars().take(100).collect()),
        code: item.get("code").filter(|c| c.is_number() || c.as_str().is_some_and(|s| s.len() <= 100)).cloned(),
    })
}
