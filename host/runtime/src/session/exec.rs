//! A process running in a session, and the lifecycle around it: output delivered to its owner
//! under flow control, a timeout (SIGTERM, then SIGKILL after a grace period), forwarded
//! signals with the same escalation, and an exit event that always comes — with the reason
//! when the VM went away instead of the process ending.
//!
//! One pump task per process reads the agent's events only when its owner has room for the
//! next one. The agent's output credit is granted back as events are read, so an owner that
//! stops reading stops the process (it blocks writing to its pipe in the guest) and nothing
//! else. Signals and resizes go straight to the agent, so they work even then.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{mpsc, watch};
use tokio::time::sleep_until;
use umbra_api::{Data, EventKind, ProcessExit, SessionEvent};
use umbra_proto::TtySize;

use super::error::SessionError;
use super::events::EventBus;
use crate::agent::{AgentClient, PendingStdin, Process, ProcessEvent, ProcessStdin};

/// How long a process may take to stop after SIGTERM (a timeout, a forwarded signal) before it
/// is SIGKILLed, and after SIGKILL before the guest counts as not responding.
pub const KILL_GRACE: Duration = Duration::from_secs(3);
/// Events queued for an owner ahead of its reading: with 64 KiB chunks, at most this many
/// times 64 KiB of output waits on the host per process (the agent's credit bounds the rest).
const OWNER_QUEUE: usize = 4;
/// How long a process whose connection dropped waits to learn why from its session.
const REASON_WAIT: Duration = Duration::from_secs(5);

const SIGTERM: i32 = 15;
const SIGKILL: i32 = 9;

/// What to run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecRequest {
    pub argv: Vec<String>,
    pub cwd: Option<String>,
    pub env: BTreeMap<String, String>,
    pub tty: Option<TtySize>,
    /// SIGTERM after this long (then SIGKILL after [`KILL_GRACE`]); the exit says `timed_out`.
    pub timeout: Option<Duration>,
}

/// A running process, owned by whoever spawned it: its events (`spawned`, then `stdout` /
/// `stderr`, then `exit`) and its controls. Dropping it kills the process.
pub struct Exec {
    id: u64,
    pid: u32,
    events: mpsc::Receiver<SessionEvent>,
    control: ExecControl,
}

impl std::fmt::Debug for Exec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exec").field("id", &self.id).field("pid", &self.pid).finish_non_exhaustive()
    }
}

/// Controls a running process; cheap to clone, usable while another task reads its events.
#[derive(Clone)]
pub struct ExecControl {
    id: u64,
    link: Arc<Mutex<Link>>,
    interrupts: mpsc::UnboundedSender<i32>,
    /// A kept process's: resumes its suspended session before input or a signal.
    wake: Option<Wake>,
    /// Bytes taken from each named writer of its stdin ([`Self::write_client_stdin`]), and
    /// when it last wrote; at most [`MAX_STDIN_WRITERS`].
    stdin_taken: Arc<Mutex<BTreeMap<String, (u64, Instant)>>>,
    /// Held across a client's piece: its offset's check and its write ([`Self::write_client_stdin`]).
    stdin_order: Arc<tokio::sync::Mutex<()>>,
    /// Stdin writes under way: a client waiting for one keeps the session from idling.
    stdin_writers: Arc<std::sync::atomic::AtomicUsize>,
}

/// Named stdin writers a process remembers (`process.stdin`'s `writer`): a client each, in
/// practice; a bound against a client that makes up a new name for every piece.
pub const MAX_STDIN_WRITERS: usize = 64;

/// Counts a stdin write under way while it lives.
struct Writing(Arc<std::sync::atomic::AtomicUsize>);

impl Writing {
    fn new(count: &Arc<std::sync::atomic::AtomicUsize>) -> Self {
        count.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Self(count.clone())
    }
}

impl Drop for Writing {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// Resumes a suspended session (`Session::wake`).
pub(super) type Wake = Arc<
    dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), SessionError>> + Send>> + Send + Sync,
>;

/// The agent connection a process is reached through: the one that spawned it, until a
/// suspended session's restore adopts it on the new VM's (`rebind`).
#[derive(Clone)]
struct Link {
    agent: AgentClient,
    proto_id: u32,
    stdin: ProcessStdin,
    /// Bumped at each rebind: a write that failed on an older link is tried on the new one.
    generation: u64,
}

impl Link {
    fn of(process: &Process, agent: AgentClient, generation: u64) -> Self {
        Self { agent, proto_id: process.id(), stdin: process.stdin(), generation }
    }
}

/// Hands a kept process's pump the process adopted on another agent connection, after a
/// suspension parked it (`instance/kept.rs`); or why it cannot be had, and the pump ends the
/// process as lost (also when this is dropped).
pub(super) type Rebind = mpsc::UnboundedSender<Result<Adopted, String>>;

/// A kept process taken over on another agent connection.
pub(super) struct Adopted {
    pub process: Process,
    /// Why the VM it now runs in ended, once it has.
    pub ended: watch::Receiver<Option<String>>,
}

/// Everything a process printed, and how it ended (for callers that just want the result).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub exit: ProcessExit,
}

impl Exec {
    /// The process's id in the session manager (events name it).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Its pid in the guest.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn control(&self) -> ExecControl {
        self.control.clone()
    }

    /// Its controls resume its suspended session first (a kept process).
    pub(super) fn waking(mut self, wake: Wake) -> Self {
        self.control.wake = Some(wake);
        self
    }

    /// The next event; `None` after the exit.
    pub async fn next_event(&mut self) -> Option<SessionEvent> {
        self.events.recv().await
    }

    /// Collects the output until the process ends.
    pub async fn output(mut self) -> ExecOutput {
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        while let Some(ev) = self.next_event().await {
            match ev.kind {
                EventKind::Stdout { data, .. } => stdout.extend(data.to_bytes().unwrap_or_default()),
                EventKind::Stderr { data, .. } => stderr.extend(data.to_bytes().unwrap_or_default()),
                EventKind::Exit(exit) => return ExecOutput { stdout, stderr, exit },
                _ => {}
            }
        }
        // The pump always ends with an exit; only a runtime shutting down gets here.
        ExecOutput { stdout, stderr, exit: shutdown_exit(self.id) }
    }
}

impl ExecControl {
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The link to use now, once the session runs (a kept process's wakes it).
    async fn awake(&self) -> Result<Link, SessionError> {
        if let Some(wake) = &self.wake {
            wake().await?;
        }
        Ok(self.link.lock().unwrap().clone())
    }

    /// The agent's id of the process on its current connection.
    pub(super) fn proto_id(&self) -> u32 {
        self.link.lock().unwrap().proto_id
    }

    /// Reaches the process through `process` (an adoption on `agent`) from now on.
    pub(super) fn rebind(&self, process: &Process, agent: AgentClient) {
        let mut link = self.link.lock().unwrap();
        *link = Link::of(process, agent, link.generation + 1);
    }

    /// Stops its stdin on the current connection before a park, and hands back what was
    /// written and not yet sent, for the adopted process ([`PendingStdin::requeue`]).
    pub(super) async fn detach_stdin(&self) -> PendingStdin {
        let stdin = self.link.lock().unwrap().stdin.clone();
        stdin.detach().await
    }

    /// Undoes [`Self::detach_stdin`] when the process was not parked after all: a new stdin
    /// stream on the same connection, `pending` first; a write that failed meanwhile is sent
    /// again on it (a new link generation).
    pub(super) async fn reattach_stdin(&self, pending: PendingStdin) {
        let (agent, proto_id) = {
            let link = self.link.lock().unwrap();
            (link.agent.clone(), link.proto_id)
        };
        let Some(stdin) = agent.reopen_stdin(proto_id) else { return };
        if let Err(e) = pending.requeue(&stdin).await {
            tracing::warn!(process = self.id, "stdin held for a park that did not happen is lost: {e}");
        }
        let mut link = self.link.lock().unwrap();
        link.stdin = stdin;
        link.generation += 1;
    }

    /// Writes (or closes) stdin through the current link; a write the link refused because it
    /// was detached for a park goes to the process adopted after it, once there is one.
    async fn on_stdin<F, Fut>(&self, op: F) -> Result<(), SessionError>
    where
        F: Fn(ProcessStdin) -> Fut,
        Fut: std::future::Future<Output = Result<(), crate::agent::ClientError>>,
    {
        let mut link = self.awake().await?;
        loop {
            match op(link.stdin.clone()).await {
                Ok(()) => return Ok(()),
                Err(e) => {
                    let now = self.awake().await?;
                    if now.generation == link.generation {
                        return Err(e.into());
                    }
                    link = now;
                }
            }
        }
    }

    /// Sends `signal` to the process's group.
    pub async fn signal(&self, signal: i32) -> Result<(), SessionError> {
        let link = self.awake().await?;
        Ok(link.agent.kill_process(link.proto_id, signal).await?)
    }

    /// Passes on a signal the user sent (Ctrl-C): the process gets it, then SIGKILL if it has not
    /// ended [`KILL_GRACE`] later; the exit reports it as `interrupted`.
    /// A kept process's suspended session is resumed first.
    pub fn interrupt(&self, signal: i32) {
        match &self.wake {
            None => {
                let _ = self.interrupts.send(signal);
            }
            Some(wake) => {
                let (wake, interrupts) = (wake.clone(), self.interrupts.clone());
                tokio::spawn(async move {
                    // A resume that fails ends the process as lost; the signal has nobody to reach.
                    if wake().await.is_ok() {
                        let _ = interrupts.send(signal);
                    }
                });
            }
        }
    }

    pub async fn resize(&self, rows: u16, cols: u16) -> Result<(), SessionError> {
        let link = self.awake().await?;
        Ok(link.agent.resize_process(link.proto_id, rows, cols).await?)
    }

    /// Queues bytes for stdin; waits while the guest has no room for them. Across a
    /// suspension, bytes queued here reach the process in the restored guest, in order.
    pub async fn write_stdin(&self, data: impl Into<Bytes>) -> Result<(), SessionError> {
        // Not under `stdin_order`: with it, a terminal's `terminal.run` hung in the daemon
        // test (the lock orders only clients' numbered pieces among themselves).
        let _writing = Writing::new(&self.stdin_writers);
        self.send_stdin(data.into()).await
    }

    async fn send_stdin(&self, data: Bytes) -> Result<(), SessionError> {
        self.on_stdin(|stdin| {
            let data = data.clone();
            async move { stdin.write(data).await }
        })
        .await
    }

    /// A client's stdin (`process.stdin`). With `at`, a writer's name and where the piece's
    /// first byte falls among the bytes that writer wrote: only what lies past the bytes taken
    /// from it is written, so a piece a client sends again after losing its connection is
    /// written once; a piece that starts past them is refused (the bytes between are missing).
    pub async fn write_client_stdin(&self, at: Option<(String, u64)>, data: Bytes) -> Result<(), SessionError> {
        let _writing = Writing::new(&self.stdin_writers);
        let _order = self.stdin_order.lock().await;
        let Some((writer, offset)) = at else { return self.send_stdin(data).await };
        let taken = self.stdin_taken.lock().unwrap().get(&writer).map_or(0, |(n, _)| *n);
        if offset > taken {
            return Err(SessionError::InvalidArgument(format!(
                "a stdin piece at offset {offset}, but umbrad took only {taken} bytes from writer {writer:?}: the \
                 bytes between are missing"
            )));
        }
        let skip = ((taken - offset) as usize).min(data.len());
        let data = data.slice(skip..);
        if data.is_empty() {
            return Ok(());
        }
        let len = data.len() as u64;
        self.send_stdin(data).await?;
        let mut writers = self.stdin_taken.lock().unwrap();
        let entry = writers.entry(writer).or_insert((0, Instant::now()));
        entry.0 += len;
        entry.1 = Instant::now();
        if writers.len() > MAX_STDIN_WRITERS {
            // The writer heard from longest ago goes (a resend of its then fails as a gap).
            let oldest = writers.iter().min_by_key(|(_, (_, at))| *at).map(|(w, _)| w.clone());
            if let Some(oldest) = oldest {
                writers.remove(&oldest);
            }
        }
        Ok(())
    }

    /// Whether a stdin write waits for the process (it has not read what came before).
    pub(super) fn writing_stdin(&self) -> bool {
        self.stdin_writers.load(std::sync::atomic::Ordering::Acquire) > 0
    }

    /// Ends stdin after what was written.
    pub async fn close_stdin(&self) -> Result<(), SessionError> {
        self.on_stdin(|stdin| async move { stdin.close().await }).await
    }
}

/// The exit of process `id` when the runtime shut down before its pump reported one.
pub(super) fn shutdown_exit(id: u64) -> ProcessExit {
    ProcessExit {
        process: id,
        code: None,
        signal: None,
        duration_ms: 0,
        timed_out: false,
        interrupted: None,
        lost: true,
        reason: Some("the runtime shut down before the process ended".into()),
    }
}

/// What a pump needs from its session.
pub(super) struct PumpContext {
    pub session: String,
    pub bus: Arc<EventBus>,
    /// Why the VM this process runs in ended, once it has.
    pub ended: watch::Receiver<Option<String>>,
    /// Called once the process has ended (the session stops counting it).
    pub on_exit: Box<dyn FnOnce() + Send>,
}

/// Starts the pump for a process whose spawn the agent confirmed. With `rebind`, a kept
/// process: parked, its pump waits for the process adopted on another connection.
#[allow(clippy::too_many_arguments)]
pub(super) fn start(
    id: u64,
    pid: u32,
    argv: Vec<String>,
    process: Process,
    agent: AgentClient,
    timeout: Option<Duration>,
    ctx: PumpContext,
    rebind: Option<mpsc::UnboundedReceiver<Result<Adopted, String>>>,
) -> Exec {
    let (out, events) = mpsc::channel(OWNER_QUEUE);
    let (interrupts, interrupts_rx) = mpsc::unbounded_channel();
    let link = Arc::new(Mutex::new(Link::of(&process, agent, 0)));
    let control = ExecControl {
        id,
        link: link.clone(),
        interrupts,
        wake: None,
        stdin_taken: Default::default(),
        stdin_order: Default::default(),
        stdin_writers: Default::default(),
    };
    let spawned = SessionEvent::new(Some(&ctx.session), EventKind::Spawned { process: id, pid, argv });
    ctx.bus.emit(spawned.clone());
    out.try_send(spawned).expect("a new queue has room");
    let pump = Pump { id, process, link, out, started: Instant::now(), timeout };
    tokio::spawn(pump.run(ctx, interrupts_rx, rebind));
    Exec { id, pid, events, control }
}

struct Pump {
    id: u64,
    process: Process,
    link: Arc<Mutex<Link>>,
    out: mpsc::Sender<SessionEvent>,
    started: Instant,
    timeout: Option<Duration>,
}

impl Pump {
    /// Signals the process without letting an unresponsive agent stall the pump.
    fn send_signal(&self, signal: i32) {
        let link = self.link.lock().unwrap().clone();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(2), link.agent.kill_process(link.proto_id, signal)).await;
        });
    }

    fn exit(&self, code: Option<i32>, signal: Option<i32>) -> ProcessExit {
        ProcessExit {
            process: self.id,
            code,
            signal,
            duration_ms: self.started.elapsed().as_millis() as u64,
            timed_out: false,
            interrupted: None,
            lost: false,
            reason: None,
        }
    }

    async fn run(
        mut self,
        mut ctx: PumpContext,
        mut interrupts: mpsc::UnboundedReceiver<i32>,
        mut rebind: Option<mpsc::UnboundedReceiver<Result<Adopted, String>>>,
    ) {
        let session = ctx.session.clone();
        let output = |kind: fn(u64, Data) -> EventKind, id: u64, bytes: &[u8]| {
            SessionEvent::new(Some(&session), kind(id, Data::from_bytes(bytes)))
        };
        // An event read from the agent and waiting for room in the owner's queue.
        let mut next: Option<SessionEvent> = None;
        let mut owner_gone = false;
        let mut interrupts_open = true;
        // Parked: its events come from the process its session adopts next (`rebind`).
        let mut parked = false;
        let (mut timed_out, mut interrupted) = (false, None::<i32>);
        let deadline = self.timeout.map(|t| tokio::time::Instant::now() + t);
        let (mut escalate_at, mut give_up_at) = (None::<tokio::time::Instant>, None::<tokio::time::Instant>);
        let far = || tokio::time::Instant::now() + Duration::from_secs(86400 * 365);
        let mut exit = loop {
            tokio::select! {
                // The owner dropped its `Exec` while the process was quiet.
                _ = self.out.closed(), if next.is_none() && !owner_gone => {
                    owner_gone = true;
                    self.send_signal(SIGKILL);
                }
                permit = self.out.reserve(), if next.is_some() && !owner_gone => match permit {
                    Ok(p) => p.send(next.take().expect("checked")),
                    Err(_) => {
                        // The owner is gone: nobody can see this process any more.
                        owner_gone = true;
                        next = None;
                        self.send_signal(SIGKILL);
                    }
                },
                // Only once it is parked: what the old connection delivered before comes first.
                adopted = recv_rebind(&mut rebind), if parked => match adopted {
                    Some(Ok(adopted)) => {
                        self.process = adopted.process;
                        ctx.ended = adopted.ended;
                        parked = false;
                    }
                    gone => {
                        rebind = None;
                        if parked {
                            let reason = match gone {
                                Some(Err(why)) => why,
                                _ => "its session ended without resuming the snapshot it was parked in".into(),
                            };
                            let mut exit = self.exit(None, Some(SIGKILL));
                            (exit.lost, exit.reason) = (true, Some(reason));
                            break exit;
                        }
                    }
                },
                ev = self.process.next_event(), if next.is_none() && !parked => match ev {
                    Some(ProcessEvent::Stdout(b)) => {
                        if !owner_gone {
                            next = Some(output(|process, data| EventKind::Stdout { process, data, offset: None }, self.id, &b));
                        }
                    }
                    Some(ProcessEvent::Stderr(b)) => {
                        if !owner_gone {
                            next = Some(output(|process, data| EventKind::Stderr { process, data, offset: None }, self.id, &b));
                        }
                    }
                    Some(ProcessEvent::Exit(status)) => {
                        let mut exit = self.exit(status.code, status.signal);
                        // Killed because its VM is ending (a stop): say so.
                        if status.signal.is_some() {
                            exit.reason = ctx.ended.borrow().clone();
                        }
                        break exit;
                    }
                    Some(ProcessEvent::Spawned { .. }) => {}
                    Some(ProcessEvent::Parked { .. }) if rebind.is_some() => parked = true,
                    Some(ProcessEvent::SpawnFailed(e)) => {
                        let mut exit = self.exit(None, Some(SIGKILL));
                        (exit.lost, exit.reason) = (true, Some(format!("the agent reported a failed spawn late: {e}")));
                        break exit;
                    }
                    other => {
                        let msg = match other {
                            Some(ProcessEvent::Error(m)) => m,
                            _ => "the agent connection ended".to_string(),
                        };
                        let reason = wait_for_reason(&mut ctx.ended).await.unwrap_or(msg);
                        let mut exit = self.exit(None, Some(SIGKILL));
                        (exit.lost, exit.reason) = (true, Some(reason));
                        break exit;
                    }
                },
                sig = interrupts.recv(), if interrupts_open => match sig {
                    Some(sig) => {
                        interrupted.get_or_insert(sig);
                        self.send_signal(sig);
                        escalate_at.get_or_insert(tokio::time::Instant::now() + KILL_GRACE);
                    }
                    None => interrupts_open = false,
                },
                // Parked (its VM suspended), it cannot be signalled: its timers wait for the resume.
                _ = sleep_until(deadline.unwrap_or_else(far)), if deadline.is_some() && !timed_out && !parked => {
                    timed_out = true;
                    self.send_signal(SIGTERM);
                    escalate_at.get_or_insert(tokio::time::Instant::now() + KILL_GRACE);
                }
                _ = sleep_until(escalate_at.unwrap_or_else(far)), if escalate_at.is_some() && !parked => {
                    self.send_signal(SIGKILL);
                    escalate_at = None;
                    give_up_at = Some(tokio::time::Instant::now() + KILL_GRACE);
                }
                _ = sleep_until(give_up_at.unwrap_or_else(far)), if give_up_at.is_some() && !parked => {
                    let mut exit = self.exit(None, Some(SIGKILL));
                    exit.lost = true;
                    exit.reason = Some(format!(
                        "the process did not end {KILL_GRACE:?} after SIGKILL: the guest is not responding"
                    ));
                    break exit;
                }
            }
        };
        (exit.timed_out, exit.interrupted) = (timed_out, interrupted);
        let exit = SessionEvent::new(Some(&ctx.session), EventKind::Exit(exit));
        // Counted and announced first: an owner that never reads must not keep the session busy.
        (ctx.on_exit)();
        ctx.bus.emit(exit.clone());
        if !owner_gone {
            if let Some(pending) = next.take() {
                if self.out.send(pending).await.is_err() {
                    return;
                }
            }
            let _ = self.out.send(exit).await;
        }
    }
}

/// The next process adopted for a kept process; pending forever for any other.
async fn recv_rebind(
    rebind: &mut Option<mpsc::UnboundedReceiver<Result<Adopted, String>>>,
) -> Option<Result<Adopted, String>> {
    match rebind {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// The reason the VM ended, if its session says so within [`REASON_WAIT`].
async fn wait_for_reason(ended: &mut watch::Receiver<Option<String>>) -> Option<String> {
    let found = match tokio::time::timeout(REASON_WAIT, ended.wait_for(Option::is_some)).await {
        Ok(Ok(reason)) => reason.clone(),
        _ => None,
    };
    found.or_else(|| ended.borrow().clone())
}
