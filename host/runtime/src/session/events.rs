//! The event bus: lifecycle events to every subscriber, and a per-session log of them.
//!
//! A broadcast channel never blocks the sender: a subscriber that falls more than
//! [`BUS_CAPACITY`] events behind loses the oldest and is told how many
//! (`broadcast::error::RecvError::Lagged`), so a stuck client can neither slow the runtime nor
//! grow its memory. Process output does not travel here; it goes only to the process's owner,
//! under flow control (see `exec`).
//!
//! Event logs are written by one background thread ([`LogWriter`]) that keeps the files open
//! and flushes when it has caught up, so emitting an event never waits for the disk (it used
//! to open, append and close the file inline, on the runtime's threads). Reads (`recent`) and
//! `forget` first wait for what was emitted before them to be written.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Mutex;

use tokio::sync::broadcast;
use umbra_api::{EventKind, SessionEvent};

/// The most of an event log one `recent` reads.
const TAIL_MAX_BYTES: u64 = 8 << 20;

/// The last `n` lines of a file, reading backwards from its end (at most [`TAIL_MAX_BYTES`]).
fn tail_lines(path: &std::path::Path, n: usize) -> Vec<String> {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else { return Vec::new() };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let mut start = len;
    let mut buf: Vec<u8> = Vec::new();
    while start > 0 && len - start < TAIL_MAX_BYTES && buf.iter().filter(|&&b| b == b'\n').count() <= n {
        let step = start.min(64 * 1024);
        start -= step;
        let mut chunk = vec![0; step as usize];
        if f.seek(SeekFrom::Start(start)).is_err() || f.read_exact(&mut chunk).is_err() {
            break;
        }
        chunk.extend_from_slice(&buf);
        buf = chunk;
    }
    let text = String::from_utf8_lossy(&buf);
    let mut lines: Vec<&str> = text.lines().collect();
    if start > 0 && !lines.is_empty() {
        lines.remove(0); // cut mid-line
    }
    lines[lines.len().saturating_sub(n)..].iter().map(|l| l.to_string()).collect()
}

/// Events a subscriber may fall behind before it starts losing them.
pub const BUS_CAPACITY: usize = 1024;
/// Lifecycle events kept in memory per session (for `session.logs` without a log directory).
const RECENT: usize = 500;
/// A session's event log is rotated (to `<name>.events.1`) when it passes this size.
const LOG_ROTATE_BYTES: u64 = 1 << 20;

/// Log lines waiting for the writer thread; beyond this, lines are dropped (and counted) rather
/// than block the runtime.
const LOG_QUEUE: usize = 8192;
/// Event log files the writer keeps open at once.
const LOG_OPEN_FILES: usize = 64;
/// How long a read waits for the writer to catch up before it reads what is there.
const LOG_FLUSH_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

enum LogOp {
    Append { session: String, line: String },
    Forget(String),
    Flush(mpsc::SyncSender<()>),
}

/// The thread that appends to the event logs.
struct LogWriter {
    tx: Option<mpsc::SyncSender<LogOp>>,
    thread: Option<std::thread::JoinHandle<()>>,
    dropped: AtomicU64,
}

impl LogWriter {
    fn start(dir: PathBuf) -> Self {
        let (tx, rx) = mpsc::sync_channel(LOG_QUEUE);
        let thread = std::thread::Builder::new()
            .name("umbra-event-log".into())
            .spawn(move || write_logs(&dir, rx))
            .expect("spawn the event log writer");
        Self { tx: Some(tx), thread: Some(thread), dropped: AtomicU64::new(0) }
    }

    fn append(&self, session: &str, line: String) {
        let op = LogOp::Append { session: session.to_string(), line };
        if let Some(Err(mpsc::TrySendError::Full(_))) = self.tx.as_ref().map(|tx| tx.try_send(op)) {
            let n = self.dropped.fetch_add(1, Ordering::Relaxed);
            if n.is_power_of_two() {
                tracing::warn!("the event log writer is behind: {} event(s) not logged", n + 1);
            }
        }
    }

    /// Waits (boundedly) until every operation sent before has been carried out.
    fn flush(&self) {
        let (done, wait) = mpsc::sync_channel(1);
        if let Some(tx) = &self.tx {
            if tx.send(LogOp::Flush(done)).is_ok() {
                let _ = wait.recv_timeout(LOG_FLUSH_WAIT);
            }
        }
    }

    fn forget(&self, session: &str) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(LogOp::Forget(session.to_string()));
        }
        self.flush();
    }
}

impl Drop for LogWriter {
    fn drop(&mut self) {
        // The thread writes what is queued, then ends.
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The writer thread: appends lines, rotating a log past [`LOG_ROTATE_BYTES`]; flushes its
/// buffers whenever the queue is empty.
fn write_logs(dir: &std::path::Path, rx: mpsc::Receiver<LogOp>) {
    struct Log {
        out: BufWriter<File>,
        size: u64,
    }
    let mut open: HashMap<String, Log> = HashMap::new();
    let flush_all = |open: &mut HashMap<String, Log>| {
        for (session, log) in open.iter_mut() {
            if let Err(e) = log.out.flush() {
                tracing::warn!("cannot write the event log of {session}: {e}");
            }
        }
    };
    let path = |session: &str| dir.join(format!("{session}.events"));
    loop {
        let op = match rx.try_recv() {
            Ok(op) => op,
            Err(mpsc::TryRecvError::Empty) => {
                flush_all(&mut open);
                match rx.recv() {
                    Ok(op) => op,
                    Err(_) => break,
                }
            }
            Err(mpsc::TryRecvError::Disconnected) => break,
        };
        match op {
            LogOp::Append { session, line } => {
                if !open.contains_key(&session) {
                    if open.len() >= LOG_OPEN_FILES {
                        flush_all(&mut open);
                        open.clear();
                    }
                    let _ = std::fs::create_dir_all(dir);
                    let opened = std::fs::OpenOptions::new().create(true).append(true).open(path(&session));
                    match opened {
                        Ok(f) => {
                            let size = f.metadata().map(|m| m.len()).unwrap_or(0);
                            open.insert(session.clone(), Log { out: BufWriter::new(f), size });
                        }
                        Err(e) => {
                            tracing::warn!("cannot append to {}: {e}", path(&session).display());
                            continue;
                        }
                    }
                }
                let log = open.get_mut(&session).expect("opened above");
                if log.size > LOG_ROTATE_BYTES {
                    let _ = log.out.flush();
                    open.remove(&session);
                    let _ = std::fs::rename(path(&session), dir.join(format!("{session}.events.1")));
                    match std::fs::OpenOptions::new().create(true).append(true).open(path(&session)) {
                        Ok(f) => open.insert(session.clone(), Log { out: BufWriter::new(f), size: 0 }),
                        Err(e) => {
                            tracing::warn!("cannot append to {}: {e}", path(&session).display());
                            continue;
                        }
                    };
                }
                let log = open.get_mut(&session).expect("opened above");
                match writeln!(log.out, "{line}") {
                    Ok(()) => log.size += line.len() as u64 + 1,
                    Err(e) => tracing::warn!("cannot append to {}: {e}", path(&session).display()),
                }
            }
            LogOp::Forget(session) => {
                open.remove(&session);
                let _ = std::fs::remove_file(path(&session));
                let _ = std::fs::remove_file(dir.join(format!("{session}.events.1")));
            }
            LogOp::Flush(done) => {
                flush_all(&mut open);
                let _ = done.try_send(());
            }
        }
    }
    flush_all(&mut open);
}

pub struct EventBus {
    tx: broadcast::Sender<SessionEvent>,
    /// Events sent so far, counted under this lock with the send itself, so a subscriber can
    /// know exactly which events it will receive (see [`Self::subscribe_counted`]).
    sent: Mutex<u64>,
    recent: Mutex<HashMap<String, VecDeque<SessionEvent>>>,
    /// Where each session's events are appended (`<name>.events`), if anywhere.
    log_dir: Option<PathBuf>,
    writer: Option<LogWriter>,
}

impl EventBus {
    pub fn new(log_dir: Option<PathBuf>) -> Self {
        let (tx, _) = broadcast::channel(BUS_CAPACITY);
        let writer = log_dir.clone().map(LogWriter::start);
        Self { tx, sent: Mutex::new(0), recent: Mutex::new(HashMap::new()), log_dir, writer }
    }

    /// Waits until every event emitted so far is in its log (the owner is going away).
    pub fn flush(&self) {
        if let Some(w) = &self.writer {
            w.flush();
        }
    }

    /// Publishes a lifecycle event: to subscribers, and to its session's log.
    pub fn emit(&self, event: SessionEvent) {
        debug_assert!(!event.is_process_output(), "process output goes to its owner only");
        if let Some(session) = event.session.clone() {
            // Not logged: progress, and a language server's chatter (a guest's, at its pace).
            if !matches!(event.kind, EventKind::DownloadProgress(_) | EventKind::LspNotification { .. }) {
                self.record(&session, &event);
            }
        }
        let mut sent = self.sent.lock().unwrap();
        // No subscribers is not an error.
        let _ = self.tx.send(event);
        *sent += 1;
    }

    pub fn subscribe(&self) -> broadcast::Receiver<SessionEvent> {
        self.tx.subscribe()
    }

    /// A receiver, and how many events were sent before it: the receiver gets every later
    /// one (or is told how many it lost), so that count plus what it received (lost ones
    /// included) is how far it has got, comparable with [`Self::sent`].
    pub fn subscribe_counted(&self) -> (broadcast::Receiver<SessionEvent>, u64) {
        let sent = self.sent.lock().unwrap();
        (self.tx.subscribe(), *sent)
    }

    /// How many events were sent so far.
    pub fn sent(&self) -> u64 {
        *self.sent.lock().unwrap()
    }

    fn record(&self, session: &str, event: &SessionEvent) {
        match &self.writer {
            Some(w) => w.append(session, serde_json::to_string(event).expect("events serialize")),
            None => {
                let mut recent = self.recent.lock().unwrap();
                let ring = recent.entry(session.to_string()).or_default();
                if ring.len() == RECENT {
                    ring.pop_front();
                }
                ring.push_back(event.clone());
            }
        }
    }

    /// The last `n` lifecycle events of `session`, oldest first.
    pub fn recent(&self, session: &str, n: usize) -> Vec<SessionEvent> {
        self.flush();
        match &self.log_dir {
            Some(dir) => tail_lines(&dir.join(format!("{session}.events")), n)
                .iter()
                .filter_map(|l| serde_json::from_str(l).ok())
                .collect(),
            None => {
                let recent = self.recent.lock().unwrap();
                let ring = recent.get(session).map(|r| r.iter().cloned().collect::<Vec<_>>()).unwrap_or_default();
                ring[ring.len().saturating_sub(n)..].to_vec()
            }
        }
    }

    /// Drops what is kept about a deleted session.
    pub fn forget(&self, session: &str) {
        self.recent.lock().unwrap().remove(session);
        if let Some(w) = &self.writer {
            w.forget(session);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use umbra_api::SessionStatus;

    fn status(s: SessionStatus) -> SessionEvent {
        SessionEvent::new(Some("a"), EventKind::Status { status: s, reason: None })
    }

    #[tokio::test]
    async fn a_slow_subscriber_is_told_what_it_lost_and_never_blocks_the_sender() {
        let bus = EventBus::new(None);
        let mut slow = bus.subscribe();
        for _ in 0..BUS_CAPACITY + 10 {
            bus.emit(status(SessionStatus::Ready));
        }
        match slow.recv().await {
            Err(broadcast::error::RecvError::Lagged(n)) => assert_eq!(n, 10),
            other => panic!("expected a lag report, got {other:?}"),
        }
        assert!(slow.recv().await.is_ok());
    }

    #[test]
    fn recent_events_come_from_the_log_file_when_there_is_one() {
        let dir = tempfile::tempdir().unwrap();
        let bus = EventBus::new(Some(dir.path().to_path_buf()));
        bus.emit(status(SessionStatus::Starting));
        bus.emit(status(SessionStatus::Ready));
        drop(bus); // its writer finishes what was queued
        let again = EventBus::new(Some(dir.path().to_path_buf()));
        let names: Vec<_> = again
            .recent("a", 10)
            .into_iter()
            .map(|e| match e.kind {
                EventKind::Status { status, .. } => status,
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(names, [SessionStatus::Starting, SessionStatus::Ready], "a restarted daemon still has them");
        for _ in 0..2000 {
            again.emit(status(SessionStatus::Ready));
        }
        assert_eq!(again.recent("a", 1500).len(), 1500, "beyond the last 64 KiB of the log");
        again.forget("a");
        assert!(again.recent("a", 10).is_empty());

        let memory = EventBus::new(None);
        for _ in 0..RECENT + 5 {
            memory.emit(status(SessionStatus::Ready));
        }
        assert_eq!(memory.recent("a", 1000).len(), RECENT);
    }
}
