//! The client of the in-guest agent (see `docs/protocol.md`).
//!
//! One reader task routes incoming frames: responses to the waiting request, process output and
//! exits to that process's event channel, stdin credit to its writer. The reader never blocks —
//! event channels are unbounded but bounded in practice by the output credit, which is granted
//! back only as the caller consumes output. When the connection drops, every pending request
//! fails and every open process receives a final error event that names the cause.

mod connect;
mod error;
mod process;

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio_util::codec::{FramedRead, FramedWrite};
use umbra_proto::{
    json_frame, json_frame_with_attachment, parse_body, Channel, DirEntry, ErrorBody, Event, FileStat, Frame,
    FrameCodec, FrameKind, Hello, MountRequest, Request, Response, ResponseBody, SpawnRequest, Stats, WriteFileRequest,
    PROTOCOL_VERSION,
};

pub use connect::hybrid_handshake;
pub use error::ClientError;
pub use process::{Process, ProcessEvent, ProcessOutput, ProcessStdin};

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

type Reply = Result<(Response, Option<Bytes>), ClientError>;

/// A connection to one agent. Cheap to clone; all clones share the connection.
#[derive(Clone)]
pub struct AgentClient {
    inner: Arc<Inner>,
}

struct Inner {
    out: mpsc::UnboundedSender<Frame>,
    next_id: AtomicU32,
    state: Mutex<State>,
    agent: Hello,
}

#[derive(Default)]
struct State {
    pending: HashMap<u32, oneshot::Sender<Reply>>,
    processes: HashMap<u32, ProcessSlot>,
    /// Set once the connection is gone; later calls fail with it.
    lost: Option<String>,
}

struct ProcessSlot {
    events: mpsc::UnboundedSender<ProcessEvent>,
    stdin_credit: Arc<Semaphore>,
    /// Taken when the spawn response arrives.
    confirm: Option<oneshot::Sender<Result<u32, ClientError>>>,
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
            capabilities: vec![],
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
        let inner = Arc::new(Inner { out, next_id: AtomicU32::new(1), state: Mutex::new(State::default()), agent });
        tokio::spawn(write_loop(sink, out_rx));
        tokio::spawn(read_loop(Arc::downgrade(&inner), frames));
        Ok(Self { inner })
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

    /// Sends a request and waits for its response.
    async fn call_with(
        &self,
        request: &Request,
        attachment: Option<&[u8]>,
    ) -> Result<(ResponseBody, Option<Bytes>), ClientError> {
        let id = self.next_id();
        let (tx, rx) = oneshot::channel();
        {
            let mut state = self.inner.state.lock().unwrap();
            if let Some(cause) = &state.lost {
                return Err(ClientError::ConnectionLost(cause.clone()));
            }
            state.pending.insert(id, tx);
        }
        let frame = match attachment {
            Some(data) => json_frame_with_attachment(FrameKind::Request, id, request, data),
            None => json_frame(FrameKind::Request, id, request),
        };
        self.send(frame)?;
        let (response, attachment) = rx.await.map_err(|_| self.lost_error())??;
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

    /// Starts a process. Returns at once: the first event is `Spawned` (or `SpawnFailed`), and
    /// stdin written before that is held here and sent once the agent confirms the spawn.
    pub fn spawn(&self, request: SpawnRequest) -> Result<Process, ClientError> {
        let id = self.next_id();
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        let (confirm_tx, confirm_rx) = oneshot::channel();
        let stdin_credit = Arc::new(Semaphore::new(umbra_proto::INITIAL_STDIN_CREDIT as usize));
        {
            let mut state = self.inner.state.lock().unwrap();
            if let Some(cause) = &state.lost {
                return Err(ClientError::ConnectionLost(cause.clone()));
            }
            state.processes.insert(
                id,
                ProcessSlot { events: events_tx, stdin_credit: stdin_credit.clone(), confirm: Some(confirm_tx) },
            );
        }
        self.send(json_frame(FrameKind::Request, id, &Request::Spawn(request)))?;
        Ok(Process::new(self.clone(), id, events_rx, confirm_rx, stdin_credit))
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

    /// Asks the guest to power off (or a host-side agent to exit).
    pub async fn shutdown(&self) -> Result<(), ClientError> {
        self.call(&Request::Shutdown).await.map(drop)
    }
}

fn frame_len(event: &ProcessEvent) -> u32 {
    match event {
        ProcessEvent::Stdout(b) | ProcessEvent::Stderr(b) => b.len() as u32,
        _ => 0,
    }
}

fn unexpected(method: &str, body: &ResponseBody) -> ClientError {
    ClientError::Protocol(format!("{method} answered with {body:?}"))
}

async fn write_loop<W: AsyncWrite + Unpin>(
    mut sink: FramedWrite<W, FrameCodec>,
    mut rx: mpsc::UnboundedReceiver<Frame>,
) {
    while let Some(frame) = rx.recv().await {
        if sink.feed(frame).await.is_err() {
            return;
        }
        while let Ok(frame) = rx.try_recv() {
            if sink.feed(frame).await.is_err() {
                return;
            }
        }
        if sink.flush().await.is_err() {
            return;
        }
    }
}

async fn read_loop<R: AsyncRead + Unpin>(inner: std::sync::Weak<Inner>, mut frames: FramedRead<R, FrameCodec>) {
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
    let Some(inner) = inner.upgrade() else { return };
    let mut state = inner.state.lock().unwrap();
    state.lost = Some(cause.clone());
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
                Event::Error { message } => {
                    if let Some(slot) = state.processes.get(&frame.id) {
                        let _ = slot.events.send(ProcessEvent::Error(message));
                    }
                }
            }
        }
        FrameKind::Data => {
            if let Some(slot) = state.processes.get(&frame.id) {
                let event = match frame.channel {
                    Channel::Stdout => ProcessEvent::Stdout(frame.body),
                    Channel::Stderr => ProcessEvent::Stderr(frame.body),
                    other => return Err(format!("agent sent data on {other:?}")),
                };
                let len = frame_len(&event);
                // Nobody is reading (the Process was dropped): discard, but keep the agent's
                // pump moving so the process can finish and report its exit.
                if slot.events.send(event).is_err() {
                    let _ = inner.out.send(Frame::credit(frame.id, frame.channel, len));
                }
            }
        }
        FrameKind::Credit => {
            let bytes = frame.credit_bytes().ok_or("malformed credit frame")?;
            if let Some(slot) = state.processes.get(&frame.id) {
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
