//! One host connection: handshake, then a reader loop that routes frames, and a writer task.
//!
//! The reader never blocks on a single process: stdin goes to per-process queues bounded by the
//! stdin credit the host was granted, output credit goes to the pumps, and slow requests (files,
//! mounts) run as their own tasks, at most [`MAX_BLOCKING`] at a time. Frames that cannot be
//! decoded close the connection after an Error frame; well-framed but invalid ones get an error
//! and the connection goes on.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::BytesMut;
use futures_util::StreamExt;
use nix::sys::signal::Signal;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, Semaphore};
use tokio_util::codec::FramedRead;
use umbra_proto::{
    json_frame, parse_body, Channel, ErrorBody, ErrorCode, Frame, FrameCodec, FrameKind, Hello, Request, Response,
    CAP_LARGE_OUTPUT, LARGE_OUTPUT_CHUNK, MAX_BODY_LEN, MAX_DATA_CHUNK, PROTOCOL_VERSION,
};

use super::Agent;
use crate::process::{FrameSink, Outgoing, ProcessTable, StdinMsg};
use crate::text::clip;

/// Frames queued for the writer. Output is credit-limited, so this bounds memory, not throughput.
const OUTBOX: usize = 64;
/// Blocking requests (files, mounts, stats) served at once per connection. Each may hold a
/// 1 MiB file chunk; past this the reader waits, which pushes back on a host that pipelines.
const MAX_BLOCKING: usize = 8;
/// Encoded frames buffered before a write.
const WRITE_BATCH: usize = 64 * 1024;
/// How long the parting Error frame of a failed connection may wait for room in the outbox.
const PARTING_ERROR_WAIT: Duration = Duration::from_millis(500);

pub struct Connection {
    pub agent: Arc<Agent>,
    pub sink: FrameSink,
    pub processes: ProcessTable,
    /// Ids of requests still being served by a task.
    pub in_flight: Arc<Mutex<HashSet<u32>>>,
    /// Permits for blocking requests, see [`MAX_BLOCKING`].
    pub blocking: Arc<Semaphore>,
    /// The largest output Data frame the host accepts (set by its Hello).
    pub output_chunk: usize,
}

/// Why the connection must end.
#[derive(Debug, thiserror::Error)]
pub enum ConnectionError {
    #[error("undecodable input: {0}")]
    Decode(#[from] umbra_proto::DecodeError),
    #[error("{0}")]
    Protocol(String),
    #[error("host stopped reading (writer closed)")]
    WriterGone,
}

impl ConnectionError {
    /// Whether the stream failed the way Linux's vsock fails every connected socket when the
    /// transport is reset (a VM restored from a snapshot): the socket is closed with
    /// `sk_err = ECONNRESET`, and a read then fails with ENOTCONN (the socket is no longer
    /// established and the peer never shut it down) or ECONNRESET. A host that closes its end
    /// gives end-of-stream instead.
    pub fn is_transport_reset(&self) -> bool {
        use std::io::ErrorKind::{ConnectionReset, NotConnected};
        matches!(self, ConnectionError::Decode(umbra_proto::DecodeError::Io(e)) if matches!(e.kind(), ConnectionReset | NotConnected))
    }
}

pub async fn serve_connection<S: AsyncRead + AsyncWrite + Send + 'static>(
    agent: Arc<Agent>,
    stream: S,
) -> Result<(), ConnectionError> {
    let (r, w) = tokio::io::split(stream);
    let mut frames = FramedRead::new(r, FrameCodec::new());
    let (sink, outbox) = mpsc::channel(OUTBOX);
    let writer = tokio::spawn(write_frames(w, outbox));

    let conn = Connection {
        agent,
        sink,
        processes: Arc::new(Mutex::new(HashMap::new())),
        in_flight: Arc::new(Mutex::new(HashSet::new())),
        blocking: Arc::new(Semaphore::new(MAX_BLOCKING)),
        output_chunk: MAX_DATA_CHUNK,
    };
    let mut conn = conn;
    let result = match handshake(&mut conn, &mut frames).await {
        Ok(true) => conn.read_loop(&mut frames).await,
        Ok(false) => Ok(()),
        Err(e) => Err(e),
    };
    if let Err(e) = &result {
        // Best effort: tell the host why before closing. The outbox may be full (output the host
        // has not read yet), so wait for room a little rather than drop the explanation.
        let _ = tokio::time::timeout(PARTING_ERROR_WAIT, conn.sink.send(protocol_error(0, e.to_string()).into())).await;
    }
    conn.teardown();
    drop(conn);
    let _ = writer.await;
    result
}

fn protocol_error(id: u32, message: impl Into<String>) -> Frame {
    json_frame(FrameKind::Error, id, &ErrorBody::new(ErrorCode::Protocol, message))
}

/// Returns Ok(false) if the peer closed before saying hello.
async fn handshake<R: AsyncRead + Unpin>(
    conn: &mut Connection,
    frames: &mut FramedRead<R, FrameCodec>,
) -> Result<bool, ConnectionError> {
    let Some(frame) = frames.next().await.transpose()? else { return Ok(false) };
    if frame.kind != FrameKind::Hello {
        return Err(ConnectionError::Protocol(format!("expected Hello as the first frame, got {:?}", frame.kind)));
    }
    let (hello, _): (Hello, _) =
        parse_body(&frame.body).map_err(|e| ConnectionError::Protocol(format!("bad Hello: {e}")))?;
    if !hello.protocol.compatible_with(&PROTOCOL_VERSION) {
        let err = ErrorBody::new(
            ErrorCode::IncompatibleVersion,
            format!(
                "host speaks protocol {} but this agent speaks {}; use a runtime and guest image of the same major version",
                hello.protocol, PROTOCOL_VERSION
            ),
        );
        conn.send(json_frame(FrameKind::Error, 0, &err)).await?;
        return Ok(false);
    }
    tracing::debug!(peer = %hello.software, protocol = %hello.protocol, "handshake");
    if hello.capabilities.iter().any(|c| c == CAP_LARGE_OUTPUT) {
        conn.output_chunk = LARGE_OUTPUT_CHUNK;
    }
    let ours = Hello {
        protocol: PROTOCOL_VERSION,
        software: format!("umbra-agent {}", env!("CARGO_PKG_VERSION")),
        // Read now, not at start: a reidentify request may have changed it.
        hostname: nix::unistd::gethostname().ok().map(|h| h.to_string_lossy().into_owned()),
        pid1: conn.agent.pid1,
        capabilities: ["pty", "files", "mount", "stats", "shares", umbra_proto::CAP_PARK, umbra_proto::CAP_EXEC_GATE]
            .map(String::from)
            .to_vec(),
    };
    conn.send(json_frame(FrameKind::Hello, 0, &ours)).await?;
    Ok(true)
}

impl Connection {
    pub async fn send(&self, frame: Frame) -> Result<(), ConnectionError> {
        self.sink.send(frame.into()).await.map_err(|_| ConnectionError::WriterGone)
    }

    async fn read_loop<R: AsyncRead + Unpin>(
        &self,
        frames: &mut FramedRead<R, FrameCodec>,
    ) -> Result<(), ConnectionError> {
        while let Some(frame) = frames.next().await.transpose()? {
            match frame.kind {
                FrameKind::Request => self.on_request(frame).await?,
                FrameKind::Data => self.on_stdin(frame)?,
                FrameKind::Credit => self.on_credit(frame).await?,
                other => {
                    self.send(protocol_error(frame.id, format!("the host may not send {other:?} frames"))).await?;
                }
            }
        }
        Ok(())
    }

    async fn on_request(&self, frame: Frame) -> Result<(), ConnectionError> {
        let id = frame.id;
        if id == 0 {
            return self.send(protocol_error(0, "request id 0 is reserved")).await;
        }
        let duplicate =
            self.in_flight.lock().unwrap().contains(&id) || self.processes.lock().unwrap().contains_key(&id);
        if duplicate {
            let err = ErrorBody::new(ErrorCode::DuplicateId, format!("request id {id} is already in use"));
            return self.send(json_frame(FrameKind::Error, id, &err)).await;
        }
        match parse_body::<Request>(&frame.body) {
            Ok((request, attachment)) => self.dispatch(id, request, attachment).await,
            Err(e) => {
                // serde's message may quote the input (an unknown method name) at any length.
                let err = ErrorBody::new(ErrorCode::BadRequest, clip(format!("request {id}: {e}")));
                self.send(json_frame(FrameKind::Response, id, &umbra_proto::Response::Error(err))).await
            }
        }
    }

    fn on_stdin(&self, frame: Frame) -> Result<(), ConnectionError> {
        if frame.channel != Channel::Stdin {
            return Err(ConnectionError::Protocol(format!("the host may not send {:?} data", frame.channel)));
        }
        if frame.body.len() > MAX_DATA_CHUNK {
            return Err(ConnectionError::Protocol(format!(
                "process {}: a Data frame of {} bytes exceeds the {MAX_DATA_CHUNK}-byte limit",
                frame.id,
                frame.body.len()
            )));
        }
        let processes = self.processes.lock().unwrap();
        // Stdin for a process that already exited is dropped: the host may race the exit.
        let Some(p) = processes.get(&frame.id) else { return Ok(()) };
        let len = frame.body.len() as u64;
        // Only this loop spends the window, so load-then-subtract cannot race another spender.
        let window = p.stdin_window.load(Ordering::Acquire);
        if len > window {
            return Err(ConnectionError::Protocol(format!(
                "process {}: {len} bytes of stdin exceed the {window} bytes of credit granted",
                frame.id
            )));
        }
        p.stdin_window.fetch_sub(len, Ordering::AcqRel);
        let _ = p.stdin.send(StdinMsg::Data(frame.body, p.route.epoch()));
        Ok(())
    }

    async fn on_credit(&self, frame: Frame) -> Result<(), ConnectionError> {
        let Some(bytes) = frame.credit_bytes() else {
            return self.send(protocol_error(frame.id, "a Credit body is exactly 4 bytes")).await;
        };
        let processes = self.processes.lock().unwrap();
        if let Some(credit) = processes.get(&frame.id).and_then(|p| p.credit(frame.channel)) {
            credit.grant(bytes);
        }
        Ok(())
    }

    /// The host is gone: its processes must not outlive it, nor wait for credit forever (parked
    /// ones are no longer its: they wait for an adoption).
    fn teardown(&self) {
        let processes = self.processes.lock().unwrap();
        for p in processes.values() {
            p.kill(Signal::SIGKILL);
            p.close_credits();
        }
    }
}

/// Encodes queued frames into one buffer and writes it, batching whatever is already queued
/// into one write; a pre-encoded Data frame is written as it is, after what was buffered.
async fn write_frames<W: AsyncWrite + Unpin>(mut out: W, mut rx: mpsc::Receiver<Outgoing>) {
    let mut buf = BytesMut::with_capacity(WRITE_BATCH);
    while let Some(first) = rx.recv().await {
        let mut item = Some(first);
        while let Some(next) = item.take().or_else(|| rx.try_recv().ok()) {
            match next {
                Outgoing::Frame(frame) => fit(frame).encode_into(&mut buf),
                Outgoing::Encoded(frame) => {
                    if write_out(&mut out, &mut buf).await.is_err() || out.write_all(&frame).await.is_err() {
                        return;
                    }
                }
            }
            if buf.len() >= WRITE_BATCH && write_out(&mut out, &mut buf).await.is_err() {
                return;
            }
        }
        if write_out(&mut out, &mut buf).await.is_err() || out.flush().await.is_err() {
            return;
        }
    }
}

/// Writes and empties `buf` (keeping its allocation).
async fn write_out<W: AsyncWrite + Unpin>(out: &mut W, buf: &mut BytesMut) -> std::io::Result<()> {
    if !buf.is_empty() {
        out.write_all(buf).await?;
        buf.clear();
    }
    Ok(())
}

/// A frame too large to encode (a response that outgrew the limit despite the caps on listings
/// and messages) becomes a `too_large` error about that id: the host still gets an answer, and
/// the writer goes on instead of failing the whole connection.
fn fit(frame: Frame) -> Frame {
    if frame.body.len() <= MAX_BODY_LEN {
        return frame;
    }
    let err = ErrorBody::new(
        ErrorCode::TooLarge,
        format!(
            "the {:?} to {} would take {} bytes, more than the {MAX_BODY_LEN}-byte frame limit",
            frame.kind,
            frame.id,
            frame.body.len()
        ),
    );
    tracing::warn!("{err}");
    match frame.kind {
        FrameKind::Response => json_frame(FrameKind::Response, frame.id, &Response::Error(err)),
        _ => json_frame(FrameKind::Error, frame.id, &err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oversized_frames_become_too_large_errors_for_their_id() {
        let big = Frame::new(FrameKind::Response, 7, vec![b' '; MAX_BODY_LEN + 1]);
        let f = fit(big);
        assert_eq!((f.kind, f.id), (FrameKind::Response, 7));
        let (resp, _): (Response, _) = parse_body(&f.body).unwrap();
        assert!(matches!(resp, Response::Error(ErrorBody { code: ErrorCode::TooLarge, .. })), "{resp:?}");
        let f = fit(Frame::new(FrameKind::Event, 9, vec![b' '; MAX_BODY_LEN + 1]));
        assert_eq!((f.kind, f.id), (FrameKind::Error, 9));
        let small = Frame::new(FrameKind::Response, 1, &b"{}"[..]);
        assert_eq!(fit(small.clone()), small);
    }

    /// A reader that fails the way a vsock socket does after a transport reset.
    struct Reset(std::io::ErrorKind);

    impl AsyncRead for Reset {
        fn poll_read(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            _: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Err(self.0.into()))
        }
    }

    #[tokio::test]
    async fn only_a_reset_stream_counts_as_a_transport_reset() {
        let first_error =
            |e: Option<Result<Frame, umbra_proto::DecodeError>>| ConnectionError::Decode(e.unwrap().unwrap_err());
        for kind in [std::io::ErrorKind::NotConnected, std::io::ErrorKind::ConnectionReset] {
            let reset = first_error(FramedRead::new(Reset(kind), FrameCodec::new()).next().await);
            assert!(reset.is_transport_reset(), "{reset}");
        }
        // A host that hangs up mid-frame, or sends garbage, is not a restore.
        let truncated = first_error(FramedRead::new(&[0u8, 0, 0][..], FrameCodec::new()).next().await);
        assert!(!truncated.is_transport_reset(), "{truncated}");
        let other = ConnectionError::Decode(std::io::Error::from(std::io::ErrorKind::BrokenPipe).into());
        assert!(!other.is_transport_reset());
        assert!(!ConnectionError::WriterGone.is_transport_reset());
    }
}
