//! A process running in the guest, as seen by the host: an event stream, a stdin writer, and
//! kill/resize. Consuming output grants the agent credit for more, so a caller that stops
//! reading stalls that process (in its pipe) and nothing else.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot, Semaphore};
use umbra_proto::{json_frame, Channel, FrameKind, Request, SpawnRequest, INITIAL_OUTPUT_CREDIT, MAX_DATA_CHUNK};

use super::events::{ProcessEvent, ProcessOutput};
use super::{check_frame_size, AgentClient, ClientError, ProcessSlot};

/// Stdin writes queued ahead of the credit; small so `write` applies backpressure.
const STDIN_QUEUE: usize = 16;

/// Consumed output is handed back to the agent as credit once this much has gathered on a
/// stream, not per chunk: a quarter of the window keeps the agent's pump supplied with a
/// quarter of the Credit frames (and agent wake-ups). Never stalls: a pump out of credit means
/// the whole window is in flight or consumed, and consuming it crosses this threshold.
const GRANT_BATCH: usize = umbra_proto::INITIAL_OUTPUT_CREDIT as usize / 4;

impl AgentClient {
    /// Starts a process. Returns at once: the first event is `Spawned` (or `SpawnFailed`), and
    /// stdin written before that is held here and sent once the agent confirms the spawn.
    pub fn spawn(&self, request: SpawnRequest) -> Result<Process, ClientError> {
        self.start_process(&Request::Spawn(request))
    }

    /// Takes over a process the agent parked (protocol 1.8, [`Self::parks`]): a `Process` as a
    /// spawn's, whose first event is `Spawned` (its pid) or `SpawnFailed` (`not_found`: no
    /// process is parked with `token`).
    pub fn adopt(&self, token: u64) -> Result<Process, ClientError> {
        self.start_process(&Request::Adopt { token })
    }

    /// A request whose id becomes a process's (spawn, adopt).
    fn start_process(&self, request: &Request) -> Result<Process, ClientError> {
        let id = self.next_id();
        let frame = json_frame(FrameKind::Request, id, request);
        check_frame_size(&frame, request.method())?;
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        let (confirm_tx, confirm_rx) = oneshot::channel();
        let stdin_credit = Arc::new(Semaphore::new(umbra_proto::INITIAL_STDIN_CREDIT as usize));
        {
            let mut state = self.inner.state.lock().unwrap();
            if let Some(cause) = &state.lost {
                return Err(ClientError::ConnectionLost(cause.clone()));
            }
            let slot = ProcessSlot {
                events: events_tx,
                stdin_credit: stdin_credit.clone(),
                stdin_unacked: 0,
                stdout_window: INITIAL_OUTPUT_CREDIT as u64,
                stderr_window: INITIAL_OUTPUT_CREDIT as u64,
                error_events: 0,
                confirm: Some(confirm_tx),
            };
            state.processes.insert(id, slot);
        }
        self.send(frame)?;
        Ok(Process::new(self.clone(), id, events_rx, confirm_rx, stdin_credit))
    }
}

pub struct Process {
    client: AgentClient,
    id: u32,
    events: mpsc::UnboundedReceiver<ProcessEvent>,
    stdin: ProcessStdin,
    finished: bool,
    /// Output consumed but not yet granted back: stdout, stderr.
    ungranted: [usize; 2],
}

/// Writes to a process's stdin. Clones share the stream.
#[derive(Clone)]
pub struct ProcessStdin {
    tx: mpsc::Sender<StdinCmd>,
    /// Asks the sending task to stop and hand back what it has not sent ([`Self::detach`]).
    detach: Arc<Mutex<Option<oneshot::Sender<oneshot::Sender<PendingStdin>>>>>,
}

/// Stdin written on the host but not yet sent to the agent when it was detached, in order (a
/// `close` included): to be sent to the process where it is adopted ([`Self::requeue`]).
#[derive(Default)]
pub struct PendingStdin(Vec<StdinCmd>);

enum StdinCmd {
    Data(Bytes),
    Close,
}

impl Process {
    pub(super) fn new(
        client: AgentClient,
        id: u32,
        events: mpsc::UnboundedReceiver<ProcessEvent>,
        confirmed: oneshot::Receiver<Result<u32, ClientError>>,
        credit: Arc<Semaphore>,
    ) -> Self {
        let stdin = ProcessStdin::start(client.clone(), id, confirmed, credit);
        Self { client, id, events, stdin, finished: false, ungranted: [0; 2] }
    }

    /// The protocol id of this process (not its guest pid).
    pub fn id(&self) -> u32 {
        self.id
    }

    pub fn stdin(&self) -> ProcessStdin {
        self.stdin.clone()
    }

    /// The next event, or `None` after the last one.
    pub async fn next_event(&mut self) -> Option<ProcessEvent> {
        let event = self.events.recv().await;
        match &event {
            Some(ProcessEvent::Stdout(b)) => self.grant(Channel::Stdout, b.len()),
            Some(ProcessEvent::Stderr(b)) => self.grant(Channel::Stderr, b.len()),
            Some(
                ProcessEvent::Exit(_)
                | ProcessEvent::SpawnFailed(_)
                | ProcessEvent::Error(_)
                | ProcessEvent::Parked { .. },
            )
            | None => self.finished = true,
            Some(ProcessEvent::Spawned { .. }) => {}
        }
        event
    }

    /// Counts `bytes` of `channel` as consumed; grants them (and what gathered before) once
    /// [`GRANT_BATCH`] is reached.
    fn grant(&mut self, channel: Channel, bytes: usize) {
        let i = usize::from(channel == Channel::Stderr);
        self.ungranted[i] += bytes;
        if self.ungranted[i] >= GRANT_BATCH {
            self.flush_grant(channel);
        }
    }

    fn flush_grant(&mut self, channel: Channel) {
        let i = usize::from(channel == Channel::Stderr);
        let bytes = std::mem::take(&mut self.ungranted[i]);
        if bytes > 0 {
            self.client.grant_output(self.id, channel, bytes);
        }
    }

    /// Sends `signal` to the process's group in the guest.
    pub async fn kill(&self, signal: i32) -> Result<(), ClientError> {
        self.client.kill_process(self.id, signal).await
    }

    pub async fn resize(&self, rows: u16, cols: u16) -> Result<(), ClientError> {
        self.client.resize_process(self.id, rows, cols).await
    }

    /// Collects all output until the process exits.
    pub async fn output(mut self) -> Result<ProcessOutput, ClientError> {
        let (mut pid, mut stdout, mut stderr) = (0, Vec::new(), Vec::new());
        while let Some(event) = self.next_event().await {
            match event {
                ProcessEvent::Spawned { pid: p } => pid = p,
                ProcessEvent::SpawnFailed(e) => return Err(ClientError::Agent(e)),
                ProcessEvent::Stdout(b) => stdout.extend_from_slice(&b),
                ProcessEvent::Stderr(b) => stderr.extend_from_slice(&b),
                ProcessEvent::Exit(status) => return Ok(ProcessOutput { pid, stdout, stderr, status }),
                ProcessEvent::Error(e) => return Err(ClientError::ConnectionLost(e)),
                ProcessEvent::Parked { .. } => return Err(ClientError::Protocol("the process was parked".into())),
            }
        }
        Err(self.client.lost_error())
    }
}

impl Drop for Process {
    /// A process nobody can observe any more is killed, like `kill_on_drop`.
    fn drop(&mut self) {
        // Output queued but never read still counts against the agent's credit: hand it back,
        // or a pump short of credit waits forever and the exit never comes. Closing first makes
        // the reader grant anything that arrives from now on itself.
        self.events.close();
        while let Ok(event) = self.events.try_recv() {
            match event {
                ProcessEvent::Stdout(b) => self.grant(Channel::Stdout, b.len()),
                ProcessEvent::Stderr(b) => self.grant(Channel::Stderr, b.len()),
                ProcessEvent::Exit(_)
                | ProcessEvent::SpawnFailed(_)
                | ProcessEvent::Error(_)
                | ProcessEvent::Parked { .. } => self.finished = true,
                ProcessEvent::Spawned { .. } => {}
            }
        }
        self.flush_grant(Channel::Stdout);
        self.flush_grant(Channel::Stderr);
        if !self.finished {
            let id = self.client.next_id();
            let kill = Request::Kill { process: self.id, signal: SIGKILL };
            let _ = self.client.send(umbra_proto::json_frame(umbra_proto::FrameKind::Request, id, &kill));
        }
    }
}

/// Linux's SIGKILL; the signal numbers on the wire are the guest's, which is always Linux.
const SIGKILL: i32 = 9;

impl AgentClient {
    /// A new stdin stream for process `id` of this connection, after [`ProcessStdin::detach`]
    /// for a park that did not happen; `None` if the process is gone.
    pub fn reopen_stdin(&self, id: u32) -> Option<ProcessStdin> {
        let credit = self.inner.state.lock().unwrap().processes.get(&id)?.stdin_credit.clone();
        let (confirm, confirmed) = oneshot::channel();
        let _ = confirm.send(Ok(id));
        Some(ProcessStdin::start(self.clone(), id, confirmed, credit))
    }
}

impl ProcessStdin {
    /// The stream and its sending task.
    fn start(
        client: AgentClient,
        id: u32,
        confirmed: oneshot::Receiver<Result<u32, ClientError>>,
        credit: Arc<Semaphore>,
    ) -> Self {
        let (tx, rx) = mpsc::channel(STDIN_QUEUE);
        let (detach_tx, detach) = oneshot::channel();
        tokio::spawn(stdin_task(client, id, confirmed, credit, rx, detach));
        ProcessStdin { tx, detach: Arc::new(Mutex::new(Some(detach_tx))) }
    }

    /// Queues bytes for the process's stdin; waits while the agent has no room for them.
    pub async fn write(&self, data: impl Into<Bytes>) -> Result<(), ClientError> {
        self.tx
            .send(StdinCmd::Data(data.into()))
            .await
            .map_err(|_| ClientError::Protocol("process stdin is closed (process ended or spawn failed)".into()))
    }

    /// Ends stdin after everything written so far.
    pub async fn close(&self) -> Result<(), ClientError> {
        self.tx
            .send(StdinCmd::Close)
            .await
            .map_err(|_| ClientError::Protocol("process stdin is closed (process ended or spawn failed)".into()))
    }

    /// Stops sending stdin on this connection and hands back, in order, what was written and
    /// not yet sent (waiting for the agent's credit or in the queue). Called before the process
    /// is parked: the agent drops stdin that reaches a parked process, so none may follow the
    /// `park` request. Writes through this stream fail from now on. Empty if nothing was
    /// pending, the stream was already detached, or its process is gone.
    pub async fn detach(&self) -> PendingStdin {
        let Some(ask) = self.detach.lock().unwrap().take() else { return PendingStdin::default() };
        let (back, pending) = oneshot::channel();
        if ask.send(back).is_err() {
            return PendingStdin::default();
        }
        pending.await.unwrap_or_default()
    }
}

impl PendingStdin {
    /// The bytes waiting.
    pub fn bytes(&self) -> usize {
        self.0.iter().map(|c| if let StdinCmd::Data(b) = c { b.len() } else { 0 }).sum()
    }

    /// Queues it on `stdin` (the adopted process's, before anyone else writes to it).
    pub async fn requeue(self, stdin: &ProcessStdin) -> Result<(), ClientError> {
        for cmd in self.0 {
            stdin.tx.send(cmd).await.map_err(|_| {
                ClientError::Protocol("the adopted process's stdin is closed (it ended or was not confirmed)".into())
            })?;
        }
        Ok(())
    }
}

/// Holds stdin until the spawn is confirmed, then sends it within the agent's credit; asked to
/// detach ([`ProcessStdin::detach`]), hands back what it has not sent and ends.
async fn stdin_task(
    client: AgentClient,
    id: u32,
    mut confirmed: oneshot::Receiver<Result<u32, ClientError>>,
    credit: Arc<Semaphore>,
    mut rx: mpsc::Receiver<StdinCmd>,
    mut detach: oneshot::Receiver<oneshot::Sender<PendingStdin>>,
) {
    // Until every handle is gone: then the queue still drains, with nobody left to detach it.
    let mut detachable = true;
    let confirmed = loop {
        tokio::select! {
            c = &mut confirmed => break matches!(c, Ok(Ok(_))),
            asked = &mut detach, if detachable => match asked {
                Ok(back) => return hand_back(back, None, &mut rx).await,
                Err(_) => detachable = false,
            },
        }
    };
    if !confirmed {
        return;
    }
    loop {
        let cmd = tokio::select! {
            cmd = rx.recv() => match cmd {
                Some(cmd) => cmd,
                None => return,
            },
            asked = &mut detach, if detachable => {
                match asked {
                    Ok(back) => return hand_back(back, None, &mut rx).await,
                    Err(_) => detachable = false,
                }
                continue;
            }
        };
        match cmd {
            StdinCmd::Data(mut bytes) => {
                while !bytes.is_empty() {
                    let n = bytes.len().min(MAX_DATA_CHUNK);
                    let permit = tokio::select! {
                        permit = credit.acquire_many(n as u32) => match permit {
                            Ok(permit) => permit,
                            Err(_) => return,
                        },
                        asked = &mut detach, if detachable => {
                            match asked {
                                Ok(back) => return hand_back(back, Some(bytes), &mut rx).await,
                                Err(_) => detachable = false,
                            }
                            continue;
                        }
                    };
                    permit.forget();
                    if client.send_stdin(id, bytes.split_to(n)).is_err() {
                        return;
                    }
                }
            }
            StdinCmd::Close => {
                let _ = client.call(&Request::CloseStdin { process: id }).await;
            }
        }
    }
}

/// Sends back what a detached stream had not sent: `head` (the rest of the write being sent),
/// then the queue, closed first so that no write can slip in behind it. Drained with `recv`
/// to its end: a send that had its slot before the close still lands, and is handed back too.
async fn hand_back(back: oneshot::Sender<PendingStdin>, head: Option<Bytes>, rx: &mut mpsc::Receiver<StdinCmd>) {
    rx.close();
    let mut pending: Vec<StdinCmd> = head.map(StdinCmd::Data).into_iter().collect();
    while let Some(cmd) = rx.recv().await {
        pending.push(cmd);
    }
    let _ = back.send(PendingStdin(pending));
}
