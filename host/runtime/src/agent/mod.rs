//! The client of the in-guest agent (see `docs/protocol.md`).
//!
//! One reader task routes incoming frames: responses to the waiting request, process output and
//! exits to that process's event channel, stdin credit to its writer. The reader never blocks —
//! event channels are unbounded but bounded by the output credit, which is granted back only as
//! the caller consumes output, and which the reader enforces: the guest is not trusted, and
//! output beyond its credit (or stdin credit beyond what was sent) ends the connection. When the
//! connection drops, every pending request fails and every open process receives a final error
//! event that names the cause. Every request has a deadline ([`DEFAULT_CALL_TIMEOUT`]).

mod connect;
pub(crate) use connect::hybrid_vsock as dial_hybrid_vsock;
mod error;
mod events;
mod process;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio_util::codec::{FramedRead, FramedWrite};
use umbra_proto::{
    json_frame, json_frame_with_attachment, parse_body, Channel, DirEntry, ErrorBody, Event, FileStat, Frame,
    FrameCodec, FrameKind, Hello, MountRequest, Request, Response, ResponseBody, ShadowChange, ShareRequest, Stats,
    WriteFileRequest, LARGE_OUTPUT_CHUNK, MAX_BODY_LEN, MAX_FILE_CHUNK, PROTOCOL_VERSION,
};

pub use connect::{hybrid_handshake, HandshakeError};
pub use error::ClientError;
pub use events::{ProcessEvent, ProcessOutput};
pub use process::{PendingStdin, Process, ProcessStdin};

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a request waits for its response unless set with [`AgentClient::with_call_timeout`].
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// `error` events accepted per process. The agent sends one when it cannot supervise a process;
/// a stream of them is a guest flooding the host's memory.
const MAX_ERROR_EVENTS: u32 = 16;

type Reply = Result<(Response, Option<Bytes>), ClientError>;

/// A connection to one agent. Cheap to clone; all clones share the connection.
#[derive(Clone)]
pub struct AgentClient {
    inner: Arc<Inner>,
    call_timeout: Duration,
}

struct Inner {
    out: mpsc::UnboundedSender<Frame>,
    next_id: AtomicU32,
    state: Mutex<State>,
    agent: Hello,
    /// Where exec checks go until someone takes them ([`AgentClient::exec_checks`]).
    exec_checks: Mutex<Option<mpsc::Receiver<ExecCheck>>>,
}

#[derive(Default)]
struct State {
    pending: HashMap<u32, oneshot::Sender<Reply>>,
    processes: HashMap<u32, ProcessSlot>,
    /// Set once the connection is gone; later calls fail with it.
    lost: Option<String>,
    exec_checks: Option<mpsc::Sender<ExecCheck>>,
}

/// An exec in the guest that waits for the host's word (protocol 1.9, `exec_check`): answer
/// it with [`AgentClient::exec_answer`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecCheck {
    /// The process (of this connection) whose tree it runs in.
    pub process: u32,
    pub check: u64,
    /// The caller's pid in the guest.
    pub pid: u32,
    pub path: String,
    pub argv: Vec<String>,
    pub cwd: Option<String>,
}

/// Exec checks queued for the taker at most; past it (or with nobody taking them) the reader
/// refuses a check itself, so a guest cannot grow the host's memory with them.
const MAX_QUEUED_EXEC_CHECKS: usize = 64;

struct ProcessSlot {
    events: mpsc::UnboundedSender<ProcessEvent>,
    stdin_credit: Arc<Semaphore>,
    /// Stdin bytes sent and not yet credited back; the agent may return no more than this.
    stdin_unacked: u64,
    /// Output the agent may still send per stream: the initial credit, plus what the caller
    /// consumed (and was granted back), minus what arrived.
    stdout_window: u64,
    stderr_window: u64,
    error_events: u32,
    /// Taken when the spawn response arrives.
    confirm: Option<oneshot::Sender<Result<u32, ClientError>>>,
}

impl ProcessSlot {
    fn output_window(&mut self, channel: Channel) -> Option<&mut u64> {
        match channel {
            Channel::Stdout => Some(&mut self.stdout_window),
            Channel::Stderr => Some(&mut self.stderr_window),
            _ => None,
        }
    }
}

impl AgentClient {
    /// Connects to an agent listening on a Unix socket.
    pub async fn connect_unix(path: &Path) -> Result<Self, ClientError> {
        Self::handshake(connect::unix(path).await?).await
    }

    /// Connects through a hybrid vsock socket (Firecracker / vhost-device-vsock / umbra-vmm).
    pub async fn connect_hybrid_vsock(path: &Path, port: u32) -> Result<Self, ClientError> {
        Self::handshake(connect::hybrid_vsock(path, port).await?).await
    }

    /// Runs the protocol handshake over any byte stream and starts the connection's tasks.
    pub async fn handshake<S: AsyncRead + AsyncWrite + Send + 'static>(stream: S) -> Result<Self, ClientError> {
        let (r, w) = tokio::io::split(stream);
        let mut frames = FramedRead::new(r, FrameCodec::new());
        let mut sink = FramedWrite::new(w, FrameCodec::new());
        let hello = Hello {
            protocol: PROTOCOL_VERSION,
            software: format!("umbra-runtime {}", env!("CARGO_PKG_VERSION")),
            hostname: None,
            pid1: false,
            capabilities: vec![umbra_proto::CAP_LARGE_OUTPUT.into()],
        };
        let lost = |e: &dyn std::fmt::Display| ClientError::Handshake(e.to_string());
        sink.send(json_frame(FrameKind::Hello, 0, &hello)).await.map_err(|e| lost(&e))?;
        let first = tokio::time::timeout(HANDSHAKE_TIMEOUT, frames.next())
            .await
            .map_err(|_| ClientError::Timeout(HANDSHAKE_TIMEOUT))?;
        let frame = match first {
            Some(Ok(f)) => f,
            Some(Err(e)) => return Err(lost(&e)),
            None => return Err(lost(&"agent closed the connection before answering Hello")),
        };
        let agent: Hello = match frame.kind {
            FrameKind::Hello => parse_body(&frame.body).map(|(h, _)| h).map_err(|e| lost(&e))?,
            FrameKind::Error => {
                let err = parse_body::<ErrorBody>(&frame.body).map(|(e, _)| e).map_err(|e| lost(&e))?;
                return Err(match err.code {
                    umbra_proto::ErrorCode::IncompatibleVersion => ClientError::IncompatibleVersion(err.message),
                    _ => ClientError::Handshake(err.to_string()),
                });
            }
            other => return Err(lost(&format!("expected Hello, got a {other:?} frame"))),
        };
        if !agent.protocol.compatible_with(&PROTOCOL_VERSION) {
            return Err(ClientError::IncompatibleVersion(format!(
                "agent {} speaks protocol {}, this runtime speaks {}",
                agent.software, agent.protocol, PROTOCOL_VERSION
            )));
        }

        let (out, out_rx) = mpsc::unbounded_channel();
        let (checks_tx, checks_rx) = mpsc::channel(MAX_QUEUED_EXEC_CHECKS);
        let state = State { exec_checks: Some(checks_tx), ..State::default() };
        let inner = Arc::new(Inner {
            out,
            next_id: AtomicU32::new(1),
            state: Mutex::new(state),
            agent,
            exec_checks: Mutex::new(Some(checks_rx)),
        });
        // Dropped when the read loop ends, however it ends: the writer then closes the socket.
        let (read_done, read_ended) = oneshot::channel::<()>();
        tokio::spawn(write_loop(Arc::downgrade(&inner), sink, out_rx, read_ended));
        tokio::spawn(read_loop(Arc::downgrade(&inner), frames, read_done));
        Ok(Self { inner, call_timeout: DEFAULT_CALL_TIMEOUT })
    }

    /// This client (and the processes it spawns) with another per-request deadline.
    pub fn with_call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// What the agent said about itself in the handshake.
    pub fn agent_info(&self) -> &Hello {
        &self.inner.agent
    }

    fn next_id(&self) -> u32 {
        loop {
            let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
            if id != 0 {
                return id;
            }
        }
    }

    fn send(&self, frame: Frame) -> Result<(), ClientError> {
        self.inner.out.send(frame).map_err(|_| self.lost_error())
    }

    fn lost_error(&self) -> ClientError {
        let state = self.inner.state.lock().unwrap();
        ClientError::ConnectionLost(state.lost.clone().unwrap_or_else(|| "connection closed".into()))
    }

    /// Grants the agent `bytes` more output on `channel` of process `id`: what the caller has
    /// consumed. The window grows before the grant is sent, so the agent can never use a grant
    /// the reader does not know about yet.
    fn grant_output(&self, id: u32, channel: Channel, bytes: usize) {
        let mut state = self.inner.state.lock().unwrap();
        // Gone means exited: no more output comes.
        let Some(window) = state.processes.get_mut(&id).and_then(|s| s.output_window(channel)) else { return };
        *window += bytes as u64;
        let _ = self.inner.out.send(Frame::credit(id, channel, bytes as u32));
    }

    /// Sends one chunk (≤ MAX_DATA_CHUNK) of stdin, within credit the caller already holds.
    fn send_stdin(&self, id: u32, chunk: Bytes) -> Result<(), ClientError> {
        let mut state = self.inner.state.lock().unwrap();
        // Gone means exited: the agent would drop the bytes.
        let Some(slot) = state.processes.get_mut(&id) else { return Ok(()) };
        slot.stdin_unacked += chunk.len() as u64;
        drop(state);
        self.send(Frame::data(id, Channel::Stdin, chunk))
    }

    /// Sends a request and waits for its response, at most the call timeout.
    async fn call_with(
        &self,
        request: &Request,
        attachment: Option<&[u8]>,
    ) -> Result<(ResponseBody, Option<Bytes>), ClientError> {
        let id = self.next_id();
        let frame = match attachment {
            Some(data) => json_frame_with_attachment(FrameKind::Request, id, request, data),
            None => json_frame(FrameKind::Request, id, request),
        };
        // An unencodable frame would only fail in the writer, far from the caller.
        check_frame_size(&frame, request.method())?;
        let (tx, rx) = oneshot::channel();
        {
            let mut state = self.inner.state.lock().unwrap();
            if let Some(cause) = &state.lost {
                return Err(ClientError::ConnectionLost(cause.clone()));
            }
            state.pending.insert(id, tx);
        }
        if let Err(e) = self.send(frame) {
            self.inner.state.lock().unwrap().pending.remove(&id);
            return Err(e);
        }
        let reply = match tokio::time::timeout(self.call_timeout, rx).await {
            Ok(reply) => reply,
            Err(_) => {
                // A late response finds no pending entry and is dropped.
                self.inner.state.lock().unwrap().pending.remove(&id);
                return Err(ClientError::Timeout(self.call_timeout));
            }
        };
        let (response, attachment) = reply.map_err(|_| self.lost_error())??;
        match response {
            Response::Ok(body) => Ok((body, attachment)),
            Response::Error(e) => Err(ClientError::Agent(e)),
        }
    }

    async fn call(&self, request: &Request) -> Result<ResponseBody, ClientError> {
        self.call_with(request, None).await.map(|(body, _)| body)
    }

    /// Round-trips a ping; returns the agent's uptime.
    pub async fn ping(&self) -> Result<Duration, ClientError> {
        match self.call(&Request::Ping).await? {
            ResponseBody::Pong { uptime_ms } => Ok(Duration::from_millis(uptime_ms)),
            other => Err(unexpected("ping", &other)),
        }
    }

    pub async fn stats(&self) -> Result<Stats, ClientError> {
        match self.call(&Request::Stats).await? {
            ResponseBody::Stats(s) => Ok(s),
            other => Err(unexpected("stats", &other)),
        }
    }

    /// The guest ports programs listen on that an exposed port reaches (protocol 1.7).
    pub async fn listening(&self) -> Result<Vec<umbra_proto::ListeningPort>, ClientError> {
        match self.call(&Request::Listening).await? {
            ResponseBody::Listening { ports } => Ok(ports),
            other => Err(unexpected("listening", &other)),
        }
    }

    /// Whether the agent parks and adopts processes (protocol 1.8).
    pub fn parks(&self) -> bool {
        self.inner.agent.capabilities.iter().any(|c| c == umbra_proto::CAP_PARK)
    }

    /// Parks processes `ids` of this connection (see [`Request::Park`]): each one parked ends
    /// here with [`ProcessEvent::Parked`], after all the output it sent before. Returns them
    /// with their tokens; the ones the agent left out had already ended.
    pub async fn park(&self, ids: &[u32]) -> Result<Vec<umbra_proto::ParkedProcess>, ClientError> {
        let parked = match self.call(&Request::Park { processes: ids.to_vec() }).await {
            Ok(ResponseBody::Parked { processes }) => processes,
            failed => {
                // The guest may have parked them all the same: nothing more of theirs will come
                // here, so their streams end now (as lost), rather than waiting forever.
                let e = match failed {
                    Err(e) => e,
                    Ok(other) => unexpected("park", &other),
                };
                let mut state = self.inner.state.lock().unwrap();
                for id in ids {
                    if let Some(slot) = state.processes.remove(id) {
                        slot.stdin_credit.close();
                        let _ = slot.events.send(ProcessEvent::Error(format!("parking it failed: {e}")));
                    }
                }
                return Err(e);
            }
        };
        // Only what was asked for: the guest does not get to end other processes' streams.
        let parked: Vec<_> = parked.into_iter().filter(|p| ids.contains(&p.process)).collect();
        let mut state = self.inner.state.lock().unwrap();
        for p in &parked {
            if let Some(slot) = state.processes.remove(&p.process) {
                slot.stdin_credit.close();
                let _ = slot.events.send(ProcessEvent::Parked { token: p.token });
            }
        }
        Ok(parked)
    }

    /// Whether the agent runs exec gates (protocol 1.9, `SpawnRequest::exec_gate`).
    pub fn gates_execs(&self) -> bool {
        self.inner.agent.capabilities.iter().any(|c| c == umbra_proto::CAP_EXEC_GATE)
    }

    /// The exec checks of this connection's processes, in arrival order; `None` after the
    /// first call (one taker). Checks arriving while nobody holds the receiver — before the
    /// call, or once it is dropped — are refused.
    pub fn exec_checks(&self) -> Option<mpsc::Receiver<ExecCheck>> {
        self.inner.exec_checks.lock().unwrap().take()
    }

    /// Answers an exec check: the exec goes on, or fails with EACCES.
    pub async fn exec_answer(&self, check: u64, allow: bool) -> Result<(), ClientError> {
        self.call(&Request::ExecAnswer { check, allow }).await.map(drop)
    }

    /// Kills the parked processes nobody adopted.
    pub async fn drop_parked(&self) -> Result<(), ClientError> {
        self.call(&Request::DropParked).await.map(drop)
    }

    /// Sends `signal` to the process group of process `id` (a [`Process::id`]).
    pub async fn kill_process(&self, id: u32, signal: i32) -> Result<(), ClientError> {
        self.call(&Request::Kill { process: id, signal }).await.map(drop)
    }

    /// Resizes the pseudo-terminal of process `id`.
    pub async fn resize_process(&self, id: u32, rows: u16, cols: u16) -> Result<(), ClientError> {
        self.call(&Request::Resize { process: id, size: umbra_proto::TtySize { rows, cols } }).await.map(drop)
    }

    pub async fn kill_all(&self, signal: i32) -> Result<(), ClientError> {
        self.call(&Request::KillAll { signal }).await.map(drop)
    }

    /// Reads up to `len` bytes at `offset`; returns the bytes and whether the end was reached.
    pub async fn read_file(&self, path: &str, offset: u64, len: u32) -> Result<(Bytes, bool), ClientError> {
        match self.call_with(&Request::ReadFile { path: path.into(), offset, len }, None).await? {
            (ResponseBody::FileData { eof, .. }, data) => Ok((data.unwrap_or_default(), eof)),
            (other, _) => Err(unexpected("read_file", &other)),
        }
    }

    pub async fn write_file(&self, request: WriteFileRequest, data: &[u8]) -> Result<u64, ClientError> {
        if data.len() > MAX_FILE_CHUNK {
            return Err(ClientError::TooLarge(format!(
                "write_file of {} bytes exceeds the {MAX_FILE_CHUNK}-byte limit per request; write in chunks",
                data.len()
            )));
        }
        match self.call_with(&Request::WriteFile(request), Some(data)).await? {
            (ResponseBody::Written { bytes }, _) => Ok(bytes),
            (other, _) => Err(unexpected("write_file", &other)),
        }
    }

    pub async fn stat(&self, path: &str) -> Result<FileStat, ClientError> {
        match self.call(&Request::Stat { path: path.into() }).await? {
            ResponseBody::Stat(s) => Ok(s),
            other => Err(unexpected("stat", &other)),
        }
    }

    pub async fn list_dir(&self, path: &str, limit: Option<u32>) -> Result<(Vec<DirEntry>, bool), ClientError> {
        match self.call(&Request::ListDir { path: path.into(), limit }).await? {
            ResponseBody::DirList { entries, truncated } => Ok((entries, truncated)),
            other => Err(unexpected("list_dir", &other)),
        }
    }

    pub async fn mount(&self, request: MountRequest) -> Result<(), ClientError> {
        self.call(&Request::Mount(request)).await.map(drop)
    }

    pub async fn unmount(&self, path: &str) -> Result<(), ClientError> {
        self.call(&Request::Unmount { path: path.into() }).await.map(drop)
    }

    /// Mounts share `name` of the VM's virtio-fs root at `/sessions/<session>/mnt/<name>`;
    /// returns the guest path.
    pub async fn share(&self, request: ShareRequest) -> Result<String, ClientError> {
        match self.call(&Request::Share(request)).await? {
            ResponseBody::Shared { path } => Ok(path),
            other => Err(unexpected("share", &other)),
        }
    }

    pub async fn unshare(&self, session: &str, name: &str) -> Result<(), ClientError> {
        self.call(&Request::Unshare { session: session.into(), name: name.into() }).await.map(drop)
    }

    /// The changes in a shadow share; `true` if the list was cut short.
    pub async fn shadow_diff(&self, session: &str, name: &str) -> Result<(Vec<ShadowChange>, bool), ClientError> {
        match self.call(&Request::ShadowDiff { session: session.into(), name: name.into() }).await? {
            ResponseBody::ShadowDiff { changes, truncated } => Ok((changes, truncated)),
            other => Err(unexpected("shadow_diff", &other)),
        }
    }

    pub async fn shadow_reset(&self, session: &str, name: &str) -> Result<(), ClientError> {
        self.call(&Request::ShadowReset { session: session.into(), name: name.into() }).await.map(drop)
    }

    /// Gives a guest restored from a snapshot its own identity (protocol 1.5): 64 bytes of this
    /// host's entropy for the guest kernel's pool and an immediate CRNG reseed, this host's
    /// wall clock, and `hostname`. See `Request::Reidentify`.
    pub async fn reidentify(&self, hostname: &str) -> Result<(), ClientError> {
        let mut entropy = [0u8; 64];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut entropy))
            .map_err(|e| ClientError::Host(format!("cannot read /dev/urandom: {e}")))?;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let request =
            umbra_proto::ReidentifyRequest { hostname: hostname.into(), unix_time_ms: now.as_millis() as u64 };
        match self.call_with(&Request::Reidentify(request), Some(&entropy)).await? {
            (ResponseBody::Done, _) => Ok(()),
            (other, _) => Err(unexpected("reidentify", &other)),
        }
    }

    /// Makes the guest trust `pem`, the session's CA (protocol 1.6; `Request::InstallCa`).
    pub async fn install_ca(&self, pem: &str) -> Result<(), ClientError> {
        self.call(&Request::InstallCa { pem: pem.into() }).await.map(drop)
    }

    /// Asks the guest to power off (or a host-side agent to exit).
    pub async fn shutdown(&self) -> Result<(), ClientError> {
        self.call(&Request::Shutdown).await.map(drop)
    }
}

fn check_frame_size(frame: &Frame, method: &str) -> Result<(), ClientError> {
    if frame.body.len() > MAX_BODY_LEN {
        return Err(ClientError::TooLarge(format!(
            "{method} request of {} bytes exceeds the {MAX_BODY_LEN}-byte frame limit",
            frame.body.len()
        )));
    }
    Ok(())
}

fn unexpected(method: &str, body: &ResponseBody) -> ClientError {
    ClientError::Protocol(format!("{method} answered with {body:?}"))
}

/// Sends queued frames until the client is dropped, a write fails, or the read loop ends; then
/// shuts the socket's write side down. Dropping the write half would not do: the read half
/// shares the socket, and the agent must see the close to kill this connection's processes.
async fn write_loop<W: AsyncWrite + Unpin>(
    inner: std::sync::Weak<Inner>,
    mut sink: FramedWrite<W, FrameCodec>,
    mut rx: mpsc::UnboundedReceiver<Frame>,
    read_ended: oneshot::Receiver<()>,
) {
    let failed = tokio::select! {
        r = write_frames(&mut sink, &mut rx) => r.err(),
        // The read loop has already failed everything pending.
        _ = read_ended => None,
    };
    let _ = sink.get_mut().shutdown().await;
    if let (Some(e), Some(inner)) = (failed, inner.upgrade()) {
        connection_lost(&inner, format!("cannot write to the agent: {e}"));
    }
}

async fn write_frames<W: AsyncWrite + Unpin>(
    sink: &mut FramedWrite<W, FrameCodec>,
    rx: &mut mpsc::UnboundedReceiver<Frame>,
) -> Result<(), umbra_proto::codec::EncodeError> {
    while let Some(frame) = rx.recv().await {
        sink.feed(frame).await?;
        while let Ok(frame) = rx.try_recv() {
            sink.feed(frame).await?;
        }
        sink.flush().await?;
    }
    Ok(())
}

/// Runs until the connection ends; dropping `_done` on the way out tells the writer to close.
async fn read_loop<R: AsyncRead + Unpin>(
    inner: std::sync::Weak<Inner>,
    mut frames: FramedRead<R, FrameCodec>,
    _done: oneshot::Sender<()>,
) {
    // The agent's last connection-level Error frame, to explain a close that follows it.
    let mut last_error: Option<String> = None;
    let cause = loop {
        let frame = match frames.next().await {
            Some(Ok(f)) => f,
            Some(Err(e)) => break format!("undecodable data from the agent: {e}"),
            None => {
                break match last_error.take() {
                    Some(e) => format!("agent closed the connection after: {e}"),
                    None => "agent closed the connection".to_string(),
                }
            }
        };
        let Some(inner) = inner.upgrade() else { return };
        if let Err(e) = route(&inner, frame, &mut last_error) {
            break e;
        }
    };
    if let Some(inner) = inner.upgrade() {
        connection_lost(&inner, cause);
    }
}

impl Inner {
    /// Whether nobody has taken the exec checks' receiver yet (nobody would answer). Once taken
    /// and dropped, the queue is closed, which refuses too.
    fn exec_checks_untaken(&self) -> bool {
        self.exec_checks.lock().unwrap().is_some()
    }
}

/// Whether a check is of a size the agent sends (it cuts longer ones short).
fn exec_check_fits(check: &ExecCheck) -> bool {
    let bytes = check.path.len() + check.argv.iter().map(String::len).sum::<usize>();
    check.argv.len() <= umbra_proto::exec_gate::MAX_EXEC_ARGS + 1
        && bytes <= 2 * umbra_proto::exec_gate::MAX_EXEC_BYTES
        && check.cwd.as_ref().is_none_or(|c| c.len() <= 4096)
}

/// Refuses check `check` without asking anyone; its answer is not waited for.
fn refuse_exec(inner: &Inner, state: &mut State, check: u64) {
    let id = loop {
        let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
        if id != 0 {
            break id;
        }
    };
    // A pending entry whose receiver is gone: the response lands there and is dropped.
    state.pending.insert(id, oneshot::channel().0);
    let _ = inner.out.send(json_frame(FrameKind::Request, id, &Request::ExecAnswer { check, allow: false }));
}

/// Fails every pending request and ends every open process with an error naming the cause.
/// The first cause sticks: later calls fail with it.
fn connection_lost(inner: &Inner, cause: String) {
    let mut state = inner.state.lock().unwrap();
    let cause = state.lost.get_or_insert(cause).clone();
    for (_, tx) in state.pending.drain() {
        let _ = tx.send(Err(ClientError::ConnectionLost(cause.clone())));
    }
    for (_, slot) in state.processes.drain() {
        if let Some(confirm) = slot.confirm {
            let _ = confirm.send(Err(ClientError::ConnectionLost(cause.clone())));
        }
        slot.stdin_credit.close();
        let _ = slot.events.send(ProcessEvent::Error(format!("agent connection lost: {cause}")));
    }
}

/// Delivers one frame. An Err ends the connection with that cause.
fn route(inner: &Inner, frame: Frame, last_error: &mut Option<String>) -> Result<(), String> {
    let mut state = inner.state.lock().unwrap();
    match frame.kind {
        FrameKind::Response => {
            let (response, attachment): (Response, _) =
                parse_body(&frame.body).map_err(|e| format!("bad response {}: {e}", frame.id))?;
            if let Some(tx) = state.pending.remove(&frame.id) {
                let _ = tx.send(Ok((response, attachment)));
            } else if let Some(slot) = state.processes.get_mut(&frame.id) {
                let Some(confirm) = slot.confirm.take() else {
                    return Err(format!("second spawn response for process {}", frame.id));
                };
                match response {
                    Response::Ok(ResponseBody::Spawned { pid }) => {
                        let _ = slot.events.send(ProcessEvent::Spawned { pid });
                        let _ = confirm.send(Ok(pid));
                    }
                    Response::Ok(other) => return Err(format!("spawn answered with {other:?}")),
                    Response::Error(e) => {
                        let slot = state.processes.remove(&frame.id).expect("slot present");
                        slot.stdin_credit.close();
                        let _ = slot.events.send(ProcessEvent::SpawnFailed(e.clone()));
                        let _ = confirm.send(Err(ClientError::Agent(e)));
                    }
                }
            }
        }
        FrameKind::Event => {
            let (event, _): (Event, _) =
                parse_body(&frame.body).map_err(|e| format!("bad event for process {}: {e}", frame.id))?;
            match event {
                Event::Exit(status) => {
                    if let Some(slot) = state.processes.remove(&frame.id) {
                        slot.stdin_credit.close();
                        let _ = slot.events.send(ProcessEvent::Exit(status));
                    }
                }
                Event::ExecCheck { check, pid, path, argv, cwd } => {
                    let check = ExecCheck { process: frame.id, check, pid, path, argv, cwd };
                    let queued = match (&state.exec_checks, state.processes.contains_key(&frame.id)) {
                        (Some(tx), true) if exec_check_fits(&check) && !inner.exec_checks_untaken() => {
                            tx.try_send(check).map_err(|e| e.into_inner())
                        }
                        _ => Err(check),
                    };
                    if let Err(check) = queued {
                        refuse_exec(inner, &mut state, check.check);
                    }
                }
                Event::Error { message } => {
                    if let Some(slot) = state.processes.get_mut(&frame.id) {
                        slot.error_events += 1;
                        if slot.error_events > MAX_ERROR_EVENTS {
                            return Err(format!(
                                "agent sent more than {MAX_ERROR_EVENTS} error events for process {}",
                                frame.id
                            ));
                        }
                        let _ = slot.events.send(ProcessEvent::Error(message));
                    }
                }
            }
        }
        FrameKind::Data => {
            let (id, channel, len) = (frame.id, frame.channel, frame.body.len());
            // This client lists CAP_LARGE_OUTPUT in its Hello.
            if len > LARGE_OUTPUT_CHUNK {
                return Err(format!("agent sent a {len}-byte Data frame, above the {LARGE_OUTPUT_CHUNK}-byte limit"));
            }
            if let Some(slot) = state.processes.get_mut(&id) {
                let Some(window) = slot.output_window(channel) else {
                    return Err(format!("agent sent data on {channel:?}"));
                };
                // Output beyond the credit is what would let a guest grow this process's memory.
                if len as u64 > *window {
                    return Err(format!(
                        "agent sent {len} bytes of {channel:?} for process {id} with only {window} bytes of credit"
                    ));
                }
                *window -= len as u64;
                let event = match channel {
                    Channel::Stdout => ProcessEvent::Stdout(frame.body),
                    _ => ProcessEvent::Stderr(frame.body),
                };
                // Nobody is reading (the Process was dropped): discard, but keep the agent's
                // pump moving so the process can finish and report its exit.
                if slot.events.send(event).is_err() {
                    if let Some(window) = slot.output_window(channel) {
                        *window += len as u64;
                    }
                    let _ = inner.out.send(Frame::credit(id, channel, len as u32));
                }
            }
        }
        FrameKind::Credit => {
            let bytes = frame.credit_bytes().ok_or("malformed credit frame")?;
            if frame.channel != Channel::Stdin {
                return Err(format!("agent sent credit for {:?}; it only grants stdin", frame.channel));
            }
            if let Some(slot) = state.processes.get_mut(&frame.id) {
                // More than was sent would inflate the window (and overflow the semaphore).
                if bytes as u64 > slot.stdin_unacked {
                    return Err(format!(
                        "agent returned {bytes} bytes of stdin credit for process {} with only {} outstanding",
                        frame.id, slot.stdin_unacked
                    ));
                }
                slot.stdin_unacked -= bytes as u64;
                slot.stdin_credit.add_permits(bytes as usize);
            }
        }
        FrameKind::Error => {
            let (err, _): (ErrorBody, _) = parse_body(&frame.body).map_err(|e| format!("bad error frame: {e}"))?;
            if let Some(tx) = state.pending.remove(&frame.id) {
                let _ = tx.send(Err(ClientError::Agent(err)));
            } else if let Some(slot) = state.processes.get_mut(&frame.id).filter(|s| s.confirm.is_some()) {
                let confirm = slot.confirm.take().expect("checked");
                let _ = confirm.send(Err(ClientError::Agent(err.clone())));
                let slot = state.processes.remove(&frame.id).expect("slot present");
                let _ = slot.events.send(ProcessEvent::SpawnFailed(err));
            } else {
                tracing::warn!(id = frame.id, "agent reported: {err}");
                *last_error = Some(err.to_string());
            }
        }
        FrameKind::Hello | FrameKind::Request => {
            return Err(format!("agent sent an unexpected {:?} frame", frame.kind));
        }
    }
    Ok(())
}
