//! envd's `process.Process` service over a sandbox's session: every command is a kept
//! (`detach`) process, so it outlives the stream that started it (`background=True`, then
//! `commands.connect(pid)`), and its lifetime is the call's `Connect-Timeout-Ms`, as in envd.
//! Each stream has a connection to umbrad of its own (its process events are its own); stdin
//! goes through a connection attached for the call, since only an attached client may write it.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use http::{HeaderMap, Response};
use umbra_api::client::Client;
use umbra_api::kept::{AttachParams, InSession, OutputOffsets};
use umbra_api::methods::{
    KillParams, ProcessAttach, ProcessCloseStdin, ProcessKill, ProcessListMethod, ProcessRef, ProcessResize,
    ProcessSpawn, ProcessStdin, ResizeParams, SpawnParams, StdinParams, Stream,
};
use umbra_api::rpc::NOTIFY_PROCESS;
use umbra_api::{Data, EventKind, ProcessExit, SessionEvent};
use umbra_proto::TtySize;

use crate::connect::{self, Body, ConnectError, StreamTx};
use crate::sandboxes::{ack, connect_error, resolve, Dedicated, E2b, Proc, Sandbox, HOME};
use crate::wire::{
    DataEvent, EndEvent, EventCase, ListResponse, ProcessEvent, ProcessInfo, ProcessInput, SendInputRequest,
    SendSignalRequest, StartRequest, UpdateRequest,
};

/// Seconds between keepalive messages on a quiet stream, unless the client asks otherwise.
const KEEPALIVE_DEFAULT: u64 = 50;
/// Bytes of stdin per `process.stdin` request (umbrad reads request lines of up to 4 MiB).
const STDIN_PIECE: usize = 512 * 1024;

/// What a stream call's headers say: its deadline (the process's lifetime) and keepalive.
pub struct StreamHeaders {
    pub timeout_secs: Option<u64>,
    pub keepalive: Duration,
}

impl StreamHeaders {
    pub fn from(headers: &HeaderMap) -> Self {
        let number =
            |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<u64>().ok());
        Self {
            // envd ends the process when the call's deadline passes; 0 or none: no deadline.
            timeout_secs: number("connect-timeout-ms").filter(|ms| *ms > 0).map(|ms| ms.div_ceil(1000)),
            keepalive: Duration::from_secs(
                number("keepalive-ping-interval").unwrap_or(KEEPALIVE_DEFAULT).clamp(1, 300),
            ),
        }
    }
}

pub async fn start(e2b: &E2b, sb: &Arc<Sandbox>, req: StartRequest, headers: StreamHeaders) -> Response<Body> {
    let conn = match e2b.dedicated().await {
        Ok(c) => c,
        Err(e) => return connect::stream_error(&connect_error(e)),
    };
    let mut env = sb.env.clone();
    env.extend(req.process.envs.clone());
    let size = req.pty.as_ref().map(|p| p.size.unwrap_or(crate::wire::PtySize { cols: 80, rows: 24 }));
    let params = SpawnParams {
        session: sb.id.clone(),
        argv: std::iter::once(req.process.cmd.clone()).chain(req.process.args.iter().cloned()).collect(),
        cwd: Some(req.process.cwd.as_deref().map(resolve).unwrap_or_else(|| HOME.into())),
        env,
        tty: size.map(|s| TtySize { cols: s.cols.clamp(1, 1000) as u16, rows: s.rows.clamp(1, 1000) as u16 }),
        timeout_secs: headers.timeout_secs,
        detach: true,
    };
    let spawned = match conn.client.call::<ProcessSpawn>(params).await {
        Ok(s) => s,
        Err(e) => return connect::stream_error(&connect_error(e)),
    };
    if req.stdin == Some(false) {
        let close = ProcessRef { session: sb.id.clone(), process: spawned.process };
        if let Err(e) = conn.client.call::<ProcessCloseStdin>(close).await {
            tracing::debug!(sandbox = %sb.id, "E2B: closing a process's stdin: {}", e.message);
        }
    }
    let proc = Proc { process: spawned.process, config: req.process, tag: req.tag, pty: size.is_some() };
    sb.procs.lock().unwrap().insert(spawned.pid, proc.clone());
    let (response, tx) = connect::stream_response();
    tokio::spawn(pump(sb.clone(), conn, spawned.pid, proc, tx, headers.keepalive));
    response
}

/// `Connect`: a new view of a running process, from its output to come.
pub async fn attach(
    e2b: &E2b,
    sb: &Arc<Sandbox>,
    pid: Option<u32>,
    tag: Option<&str>,
    headers: StreamHeaders,
) -> Response<Body> {
    let (pid, proc) = match sb.find(pid, tag) {
        Ok(found) => found,
        Err(e) => return connect::stream_error(&e),
    };
    let conn = match attached(e2b, sb, pid, &proc).await {
        Ok(c) => c,
        Err(e) => return connect::stream_error(&e),
    };
    let (response, tx) = connect::stream_response();
    tokio::spawn(pump(sb.clone(), conn, pid, proc, tx, headers.keepalive));
    response
}

/// A connection of its own attached to a kept process from its output's current end (so
/// nothing is replayed). Each connection has its own view: a stream's is not disturbed.
async fn attached(e2b: &E2b, sb: &Sandbox, pid: u32, proc: &Proc) -> Result<Dedicated, ConnectError> {
    let conn = e2b.dedicated().await.map_err(connect_error)?;
    let from = current_ends(&conn.client, &sb.id, proc.process).await?;
    let params = AttachParams { session: sb.id.clone(), process: proc.process, from };
    conn.client.call::<ProcessAttach>(params).await.map_err(|e| not_found_if_gone(connect_error(e), pid))?;
    Ok(conn)
}

/// Where a kept process's streams are now: a new view starts there.
async fn current_ends(client: &Client, session: &str, process: u64) -> Result<OutputOffsets, ConnectError> {
    let list = client.call::<ProcessListMethod>(InSession { session: session.into() }).await.map_err(connect_error)?;
    let info = list.processes.into_iter().find(|p| p.process == process);
    Ok(match info {
        Some(p) => OutputOffsets { stdout: p.stdout.map_or(0, |r| r.end), stderr: p.stderr.map_or(0, |r| r.end) },
        None => OutputOffsets::default(),
    })
}

fn not_found_if_gone(e: ConnectError, pid: u32) -> ConnectError {
    match e.code {
        "not_found" | "invalid_argument" => {
            ConnectError::new("not_found", format!("process with pid {pid} not found: {}", e.message))
        }
        _ => e,
    }
}

/// Streams one view of a process: its start, its output as it comes (acknowledged to umbrad
/// only once the client's connection took it, so a slow reader slows the process), keepalives,
/// and its end.
async fn pump(sb: Arc<Sandbox>, conn: Dedicated, pid: u32, proc: Proc, tx: StreamTx, keepalive: Duration) {
    let Dedicated { client, mut notes, .. } = conn;
    let ended = async {
        if tx.send(&ProcessEvent { event: EventCase::Start { pid } }).await.is_err() {
            return None;
        }
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
        loop {
            let note = tokio::select! {
                n = notes.recv() => n,
                _ = ticks.tick() => {
                    if tx.send(&ProcessEvent { event: EventCase::Keepalive {} }).await.is_err() {
                        return None;
                    }
                    continue;
                }
                _ = tx.closed() => return None,
            };
            let Some(note) = note else {
                return Some(Err(ConnectError::new(
                    "unavailable",
                    "umbrad closed the connection before the process ended",
                )));
            };
            if note.method != NOTIFY_PROCESS {
                continue;
            }
            let Ok(ev) = serde_json::from_value::<SessionEvent>(note.params) else { continue };
            let (stream, data) = match ev.kind {
                EventKind::Stdout { process, data, .. } if process == proc.process => (Stream::Stdout, data),
                EventKind::Stderr { process, data, .. } if process == proc.process => (Stream::Stderr, data),
                EventKind::Exit(e) if e.process == proc.process => return Some(Ok(end_event(&e))),
                _ => continue,
            };
            let Ok(bytes) = data.to_bytes() else { continue };
            let b64 = base64::engine::general_purpose::STANDARD.encode(&bytes);
            let event = match (stream, proc.pty) {
                (_, true) => DataEvent::Pty(b64),
                (Stream::Stdout, false) => DataEvent::Stdout(b64),
                (Stream::Stderr, false) => DataEvent::Stderr(b64),
            };
            if tx.send(&ProcessEvent { event: EventCase::Data(event) }).await.is_err() {
                return None;
            }
            ack(&client, &sb.id, proc.process, stream, bytes.len()).await;
        }
    };
    let outcome = ended.await;
    if let Some(Ok(_)) = &outcome {
        // It ended: nothing to find by its pid any more (unless the pid is another's now).
        let mut procs = sb.procs.lock().unwrap();
        if procs.get(&pid).is_some_and(|p| p.process == proc.process) {
            procs.remove(&pid);
        }
    }
    // Otherwise the client went (a background command): the process runs on, unviewed.
    let error = match outcome {
        None => return,
        Some(Ok(end)) => {
            if tx.send(&ProcessEvent { event: EventCase::End(end) }).await.is_err() {
                return;
            }
            None
        }
        Some(Err(e)) => Some(e),
    };
    tx.end(error).await;
}

/// umbrad's exit as envd's end event.
fn end_event(e: &ProcessExit) -> EndEvent {
    if e.lost {
        let why = format!("the sandbox's VM went away: {}", e.reason.as_deref().unwrap_or("no reason given"));
        return EndEvent { exit_code: -1, exited: false, status: why.clone(), error: Some(why) };
    }
    match (e.code, e.signal) {
        (Some(code), _) => {
            let status = format!("exit status {code}");
            EndEvent { exit_code: code, exited: true, error: (code != 0).then(|| status.clone()), status }
        }
        (None, Some(signal)) => {
            let status = format!("signal: {}", signal_word(signal));
            EndEvent { exit_code: -1, exited: false, status: status.clone(), error: Some(status) }
        }
        (None, None) => {
            let status = "ended without a status".to_string();
            EndEvent { exit_code: -1, exited: false, status: status.clone(), error: Some(status) }
        }
    }
}

/// Go's words for signals (envd is Go: its statuses read `signal: killed`).
fn signal_word(signal: i32) -> String {
    match signal {
        1 => "hangup".into(),
        2 => "interrupt".into(),
        3 => "quit".into(),
        6 => "aborted".into(),
        9 => "killed".into(),
        13 => "broken pipe".into(),
        15 => "terminated".into(),
        n => format!("signal {n}"),
    }
}

pub async fn list(e2b: &E2b, sb: &Sandbox) -> Result<ListResponse, ConnectError> {
    let known: Vec<u32> = sb.procs.lock().unwrap().keys().copied().collect();
    let client = e2b.shared().await.map_err(connect_error)?;
    let running =
        client.call::<ProcessListMethod>(InSession { session: sb.id.clone() }).await.map_err(connect_error)?;
    let live: std::collections::HashSet<u64> =
        running.processes.iter().filter(|p| p.exit.is_none()).map(|p| p.process).collect();
    let mut procs = sb.procs.lock().unwrap();
    // Only what was known before the list: a process started meanwhile is not in it yet.
    procs.retain(|pid, p| !known.contains(pid) || live.contains(&p.process));
    let processes =
        procs.iter().map(|(pid, p)| ProcessInfo { config: p.config.clone(), pid: *pid, tag: p.tag.clone() }).collect();
    Ok(ListResponse { processes })
}

pub async fn send_input(e2b: &E2b, sb: &Sandbox, req: SendInputRequest) -> Result<serde_json::Value, ConnectError> {
    let (pid, proc) = sb.find(req.process.pid, req.process.tag.as_deref())?;
    let conn = attached(e2b, sb, pid, &proc).await?;
    write_input(&conn.client, sb, pid, &proc, &req.input).await?;
    Ok(serde_json::json!({}))
}

/// Writes `input` through `client` (attached to the process), in pieces umbrad takes.
async fn write_input(
    client: &Client,
    sb: &Sandbox,
    pid: u32,
    proc: &Proc,
    input: &ProcessInput,
) -> Result<(), ConnectError> {
    let Some(b64) = input.stdin.as_ref().or(input.pty.as_ref()) else { return Ok(()) };
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| ConnectError::new("invalid_argument", format!("input that is not base64: {e}")))?;
    for piece in bytes.chunks(STDIN_PIECE) {
        let params = StdinParams {
            session: sb.id.clone(),
            process: proc.process,
            data: Data::base64(piece),
            writer: None,
            offset: None,
        };
        client.call::<ProcessStdin>(params).await.map_err(|e| not_found_if_gone(connect_error(e), pid))?;
    }
    Ok(())
}

pub async fn close_stdin(
    e2b: &E2b,
    sb: &Sandbox,
    pid: Option<u32>,
    tag: Option<&str>,
) -> Result<serde_json::Value, ConnectError> {
    let (pid, proc) = sb.find(pid, tag)?;
    let conn = attached(e2b, sb, pid, &proc).await?;
    let params = ProcessRef { session: sb.id.clone(), process: proc.process };
    conn.client.call::<ProcessCloseStdin>(params).await.map_err(|e| not_found_if_gone(connect_error(e), pid))?;
    Ok(serde_json::json!({}))
}

pub async fn send_signal(e2b: &E2b, sb: &Sandbox, req: SendSignalRequest) -> Result<serde_json::Value, ConnectError> {
    let (pid, proc) = sb.find(req.process.pid, req.process.tag.as_deref())?;
    let signal = match &req.signal {
        serde_json::Value::String(s) if s == "SIGNAL_SIGKILL" => 9,
        serde_json::Value::String(s) if s == "SIGNAL_SIGTERM" => 15,
        serde_json::Value::Number(n) if n.as_i64() == Some(9) || n.as_i64() == Some(15) => {
            n.as_i64().unwrap_or(9) as i32
        }
        other => {
            return Err(ConnectError::new(
                "invalid_argument",
                format!("signal {other}: SIGNAL_SIGKILL or SIGNAL_SIGTERM"),
            ))
        }
    };
    let client = e2b.shared().await.map_err(connect_error)?;
    let params = KillParams { session: sb.id.clone(), process: proc.process, signal };
    client.call::<ProcessKill>(params).await.map_err(|e| not_found_if_gone(connect_error(e), pid))?;
    Ok(serde_json::json!({}))
}

pub async fn update(e2b: &E2b, sb: &Sandbox, req: UpdateRequest) -> Result<serde_json::Value, ConnectError> {
    let (pid, proc) = sb.find(req.process.pid, req.process.tag.as_deref())?;
    let Some(size) = req.pty.and_then(|p| p.size) else { return Ok(serde_json::json!({})) };
    let client = e2b.shared().await.map_err(connect_error)?;
    let params = ResizeParams {
        session: sb.id.clone(),
        process: proc.process,
        cols: size.cols.clamp(1, 1000) as u16,
        rows: size.rows.clamp(1, 1000) as u16,
    };
    client.call::<ProcessResize>(params).await.map_err(|e| not_found_if_gone(connect_error(e), pid))?;
    Ok(serde_json::json!({}))
}

/// `StreamInput` (a client stream, the Python SDK's `stream_input`): a start message naming
/// the process, then input messages, each written as it arrives through one attached
/// connection.
pub async fn stream_input(
    e2b: &E2b,
    sb: &Sandbox,
    mut body: hyper::body::Incoming,
) -> Result<serde_json::Value, ConnectError> {
    use http_body_util::BodyExt;
    let mut envelopes = connect::Envelopes::default();
    let mut target: Option<(u32, Proc, Dedicated)> = None;
    loop {
        while let Some((flags, message)) = envelopes.next_message()? {
            if flags & 0x02 != 0 {
                return Ok(serde_json::json!({}));
            }
            let input: crate::wire::StreamInput = serde_json::from_slice(&message)
                .map_err(|e| ConnectError::new("invalid_argument", format!("a malformed message: {e}")))?;
            match input {
                crate::wire::StreamInput::Start { process } => {
                    let (pid, proc) = sb.find(process.pid, process.tag.as_deref())?;
                    let conn = attached(e2b, sb, pid, &proc).await?;
                    target = Some((pid, proc, conn));
                }
                crate::wire::StreamInput::Data { input } => {
                    let Some((pid, proc, conn)) = &target else {
                        return Err(ConnectError::new("invalid_argument", "input before the start message"));
                    };
                    write_input(&conn.client, sb, *pid, proc, &input).await?;
                }
                crate::wire::StreamInput::Keepalive {} => {}
            }
        }
        match body.frame().await {
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    envelopes.push(data);
                }
            }
            Some(Err(e)) => return Err(ConnectError::new("canceled", format!("the request body failed: {e}"))),
            None if envelopes.pending() == 0 => return Ok(serde_json::json!({})),
            None => return Err(ConnectError::new("invalid_argument", "the request ended inside a message")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exit(code: Option<i32>, signal: Option<i32>, lost: bool) -> ProcessExit {
        serde_json::from_value(serde_json::json!({
            "process": 1, "duration_ms": 5, "code": code, "signal": signal, "lost": lost, "reason": "the VM stopped"
        }))
        .unwrap()
    }

    #[test]
    fn exits_read_as_envd_reports_them() {
        let e = end_event(&exit(Some(3), None, false));
        assert_eq!(
            (e.exit_code, e.exited, e.status.as_str(), e.error.as_deref()),
            (3, true, "exit status 3", Some("exit status 3"))
        );
        assert_eq!(end_event(&exit(Some(0), None, false)).error, None);
        let k = end_event(&exit(None, Some(9), false));
        assert_eq!((k.exit_code, k.exited, k.status.as_str()), (-1, false, "signal: killed"));
        let lost = end_event(&exit(None, Some(9), true));
        assert!(lost.status.contains("VM went away") && lost.status.contains("the VM stopped"), "{}", lost.status);
    }

    #[test]
    fn a_calls_deadline_is_its_processs_lifetime() {
        let mut h = HeaderMap::new();
        h.insert("connect-timeout-ms", "60000".parse().unwrap());
        h.insert("keepalive-ping-interval", "50".parse().unwrap());
        let s = StreamHeaders::from(&h);
        assert_eq!((s.timeout_secs, s.keepalive), (Some(60), Duration::from_secs(50)));
        h.insert("connect-timeout-ms", "1500".parse().unwrap());
        h.insert("keepalive-ping-interval", "0".parse().unwrap());
        let s = StreamHeaders::from(&h);
        assert_eq!((s.timeout_secs, s.keepalive), (Some(2), Duration::from_secs(1)));
        let none = StreamHeaders::from(&HeaderMap::new());
        assert_eq!((none.timeout_secs, none.keepalive), (None, Duration::from_secs(KEEPALIVE_DEFAULT)));
    }
}
