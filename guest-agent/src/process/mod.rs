//! The process model: one supervised child per spawn request.
//!
//! A [`ProcessHandle`] is what the connection keeps to talk to a child (stdin queue, credits,
//! PTY for resizes). The supervisor task owns the rest: it pumps stdin and output, waits for the
//! reaper's exit notice, drains what the child left in its pipes, and only then emits the exit
//! event — so the host always sees all output before the exit.

pub mod cgroup;
mod credit;
pub mod gate;
pub mod landlock;
mod outgoing;
mod route;
pub mod spawn;
mod vfork;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::sync::{mpsc, watch};
use umbra_proto::{json_frame, Channel, Event, ExitStatus, Frame, FrameHeader, FrameKind, HEADER_LEN};

pub use credit::Credit;
pub use outgoing::{FrameSink, Outgoing};
pub use route::{Route, Target};

/// The processes of one connection, by the id the host gave them.
pub type ProcessTable = Arc<std::sync::Mutex<std::collections::HashMap<u32, ProcessHandle>>>;
use spawn::{ChildStdio, SpawnedChild};

use crate::fdio::FdIo;
use crate::reaper::ChildExit;

/// After the child exits, a pipe still open (held by a background grandchild) that stays idle
/// this long is treated as finished, so `sh -c 'sleep 100 &'` still reports its exit promptly.
const DRAIN_IDLE: Duration = Duration::from_millis(50);

pub enum StdinMsg {
    /// Bytes, and the route epoch they arrived in (their credit goes back on that connection
    /// only).
    Data(Bytes, u64),
    Close,
}

/// Output reads shorter than this are copied into a buffer of their own size, so a trickle of
/// small writes does not pin a whole chunk-sized allocation per frame while it waits in the
/// outbox.
const SMALL_READ: usize = 4096;

pub struct ProcessHandle {
    pub pid: u32,
    pub stdin: mpsc::UnboundedSender<StdinMsg>,
    /// Stdin bytes the host may still send; the connection spends it, the stdin pump refills it.
    pub stdin_window: Arc<AtomicU64>,
    pub stdout_credit: Arc<Credit>,
    pub stderr_credit: Arc<Credit>,
    pub pty: Option<Arc<FdIo>>,
    /// Set by the reaper when the child is collected; the entry lives on while output drains.
    pub reaped: Arc<AtomicBool>,
    /// Where its frames go (`route.rs`).
    pub route: Arc<Route>,
}

impl ProcessHandle {
    pub fn credit(&self, channel: Channel) -> Option<&Arc<Credit>> {
        match channel {
            Channel::Stdout => Some(&self.stdout_credit),
            Channel::Stderr => Some(&self.stderr_credit),
            _ => None,
        }
    }

    /// Signals the process's whole group. Once the child is reaped its pid — and so its group
    /// id — may be reused by an unrelated process, so nothing is signalled: instead the pumps
    /// stop draining what background children still write, and the exit follows.
    pub fn kill(&self, signal: Signal) {
        if self.reaped.load(Ordering::Acquire) {
            self.close_credits();
        } else {
            // ESRCH means the tree is already gone while the exit is still being reported.
            let _ = killpg(Pid::from_raw(self.pid as i32), signal);
        }
    }

    /// Releases output pumps blocked on credit (the host is gone), and makes them stop.
    pub fn close_credits(&self) {
        self.stdout_credit.close();
        self.stderr_credit.close();
    }

    /// The credits a new connection starts with (an adoption).
    pub fn reset_credits(&self) {
        self.stdin_window.store(umbra_proto::INITIAL_STDIN_CREDIT as u64, Ordering::Release);
        self.stdout_credit.reset(umbra_proto::INITIAL_OUTPUT_CREDIT);
        self.stderr_credit.reset(umbra_proto::INITIAL_OUTPUT_CREDIT);
    }
}

/// Starts supervising `child`, its frames going to `to` (until parked), its output in Data
/// frames of at most `chunk` bytes. At its exit, the exit event is queued, the process leaves
/// its connection's table, then `on_exit` runs.
pub fn supervise(
    to: Target,
    child: SpawnedChild,
    chunk: usize,
    on_exit: impl FnOnce() + Send + 'static,
) -> std::io::Result<ProcessHandle> {
    let route = Route::new(to);
    let started = Instant::now();
    let stdout_credit = Arc::new(Credit::new(umbra_proto::INITIAL_OUTPUT_CREDIT));
    let stderr_credit = Arc::new(Credit::new(umbra_proto::INITIAL_OUTPUT_CREDIT));
    let (stdin_tx, stdin_rx) = mpsc::unbounded_channel();
    let (exited_tx, exited_rx) = watch::channel(false);

    let (stdin_io, pumps, pty) = match child.stdio {
        ChildStdio::Pipes { stdin, stdout, stderr } => {
            let out = Arc::new(FdIo::new(stdout, false)?);
            let err = Arc::new(FdIo::new(stderr, false)?);
            let pumps = vec![
                tokio::spawn(pump_output(
                    route.clone(),
                    Channel::Stdout,
                    chunk,
                    out,
                    stdout_credit.clone(),
                    exited_rx.clone(),
                )),
                tokio::spawn(pump_output(route.clone(), Channel::Stderr, chunk, err, stderr_credit.clone(), exited_rx)),
            ];
            (StdinTarget::Pipe(FdIo::new(stdin, false)?), pumps, None)
        }
        ChildStdio::Pty { master } => {
            let master = Arc::new(FdIo::new(master, true)?);
            let pumps = vec![tokio::spawn(pump_output(
                route.clone(),
                Channel::Stdout,
                chunk,
                master.clone(),
                stdout_credit.clone(),
                exited_rx,
            ))];
            (StdinTarget::Pty(master.clone()), pumps, Some(master))
        }
    };
    let stdin_window = Arc::new(AtomicU64::new(umbra_proto::INITIAL_STDIN_CREDIT as u64));
    let stdin_pump = tokio::spawn(pump_stdin(route.clone(), stdin_io, stdin_rx, stdin_window.clone()));

    let exit = child.exit;
    let exit_route = route.clone();
    tokio::spawn(async move {
        // The reaper only drops the sender if its loop died; report that rather than hang.
        let status = match exit.await {
            Ok(ChildExit::Code(c)) => ExitStatus { code: Some(c), signal: None, duration_ms: 0 },
            Ok(ChildExit::Signal(s)) => ExitStatus { code: None, signal: Some(s), duration_ms: 0 },
            Err(_) => ExitStatus { code: None, signal: None, duration_ms: 0 },
        };
        let duration_ms = started.elapsed().as_millis() as u64;
        let _ = exited_tx.send(true);
        for pump in pumps {
            let _ = pump.await;
        }
        stdin_pump.abort();
        // Parked, the exit waits for an adoption too; dropped, nobody hears of it.
        exit_route
            .send_last(|id| json_frame(FrameKind::Event, id, &Event::Exit(ExitStatus { duration_ms, ..status })))
            .await;
        on_exit();
    });

    Ok(ProcessHandle {
        pid: child.pid,
        stdin: stdin_tx,
        stdin_window,
        stdout_credit,
        stderr_credit,
        pty,
        reaped: child.reaped,
        route,
    })
}

enum StdinTarget {
    Pipe(FdIo),
    Pty(Arc<FdIo>),
}

async fn pump_stdin(
    route: Arc<Route>,
    target: StdinTarget,
    mut rx: mpsc::UnboundedReceiver<StdinMsg>,
    window: Arc<AtomicU64>,
) {
    let mut target = Some(target);
    while let Some(msg) = rx.recv().await {
        match msg {
            StdinMsg::Data(bytes, epoch) => {
                if let Some(t) = &target {
                    let io = match t {
                        StdinTarget::Pipe(io) => io,
                        StdinTarget::Pty(io) => io,
                    };
                    // A child that closed its stdin (EPIPE) just stops receiving; the host still
                    // gets its credit back so its writer never hangs.
                    if io.write_all(&bytes).await.is_err() {
                        target = None;
                    }
                }
                // Back to the connection it came from, if it is still the current one (an
                // adoption starts the window afresh).
                if let Some(to) = route.current_at(epoch).await {
                    window.fetch_add(bytes.len() as u64, Ordering::AcqRel);
                    if to.sink.send(Frame::credit(to.id, Channel::Stdin, bytes.len() as u32).into()).await.is_err() {
                        return;
                    }
                }
            }
            StdinMsg::Close => match target.take() {
                // Dropping the write end is EOF for a pipe.
                Some(StdinTarget::Pipe(io)) => drop(io),
                // A terminal has no end of input; VEOF (^D) at line start is what a shell reads as one.
                Some(StdinTarget::Pty(io)) => {
                    let _ = io.write_all(b"\x04").await;
                }
                None => {}
            },
        }
    }
}

async fn pump_output(
    route: Arc<Route>,
    channel: Channel,
    chunk: usize,
    io: Arc<FdIo>,
    credit: Arc<Credit>,
    mut exited: watch::Receiver<bool>,
) {
    loop {
        let Some(allowed) = credit.available(chunk).await else { return };
        // The frame is built where the bytes land: header room, then the read.
        let mut frame = BytesMut::with_capacity(HEADER_LEN + allowed);
        frame.put_bytes(0, HEADER_LEN);
        let read = loop {
            if *exited.borrow() {
                break tokio::time::timeout(DRAIN_IDLE, io.read_buf(&mut frame, allowed)).await.unwrap_or(Ok(0));
            }
            tokio::select! {
                r = io.read_buf(&mut frame, allowed) => break r,
                changed = exited.changed() => if changed.is_err() { break Ok(0) },
            }
        };
        match read {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                // Parked, this chunk waits here for an adoption; the credit it spends is that of
                // the connection it goes to.
                let Some(to) = route.current().await else { return };
                credit.spend(n);
                let header = FrameHeader { kind: FrameKind::Data, channel, id: to.id, len: n as u32 };
                frame[..HEADER_LEN].copy_from_slice(&header.to_bytes());
                // A short read is copied out so it pins no chunk-sized buffer in the outbox.
                let short = n < SMALL_READ || n < allowed / 2;
                let frame = if short { Bytes::copy_from_slice(&frame) } else { frame.freeze() };
                if to.sink.send(Outgoing::Encoded(frame)).await.is_err() {
                    return;
                }
            }
        }
    }
}
