//! The event bus: lifecycle events to every subscriber, and a per-session log of them.
//!
//! A broadcast channel never blocks the sender: a subscriber that falls more than
//! [`BUS_CAPACITY`] events behind loses the oldest and is told how many
//! (`broadcast::error::RecvError::Lagged`), so a stuck client can neither slow the runtime nor
//! grow its memory. Process output does not travel here; it goes only to the process's owner,
//! under flow control (see `exec`).

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::path::PathBuf;
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

pub struct EventBus {
    tx: broadcast::Sender<SessionEvent>,
    recent: Mutex<HashMap<String, VecDeque<SessionEvent>>>,
    /// Where each session's events are appended (`<name>.events`), if anywhere.
    log_dir: Option<PathBuf>,
}

impl EventBus {
    pub fn new(log_dir: Option<PathBuf>) -> Self {
        let (tx, _) = broadcast::channel(BUS_CAPACITY);
        Self { tx, recent: Mutex::new(HashMap::new()), log_dir }
    }

    /// Publishes a lifecycle event: to subscribers, and to its session's log.
    pub fn emit(&self, event: SessionEvent) {
        debug_assert!(!event.is_process_output(), "process output goes to its owner only");
        if let Some(session) = event.session.clone() {
            if !matches!(event.kind, EventKind::DownloadProgress(_)) {
                self.record(&session, &event);
            }
        }
        // No subscribers is not an error.
        let _ = self.tx.send(event);
    }

    pub fn subscribe(&self) -> broadcast::Receiver<SessionEvent> {
        self.tx.subscribe()
    }

    fn record(&self, session: &str, event: &SessionEvent) {
        match &self.log_dir {
            Some(dir) => {
                let path = dir.join(format!("{session}.events"));
                let _ = std::fs::create_dir_all(dir);
                if std::fs::metadata(&path).map(|m| m.len() > LOG_ROTATE_BYTES).unwrap_or(false) {
                    let _ = std::fs::rename(&path, dir.join(format!("{session}.events.1")));
                }
                let line = serde_json::to_string(event).expect("events serialize");
                let appended = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .and_then(|mut f| writeln!(f, "{line}"));
                if let Err(e) = appended {
                    tracing::warn!("cannot append to {}: {e}", path.display());
                }
            }
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
        if let Some(dir) = &self.log_dir {
            let _ = std::fs::remove_file(dir.join(format!("{session}.events")));
            let _ = std::fs::remove_file(dir.join(format!("{session}.events.1")));
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
