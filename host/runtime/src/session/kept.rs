//! Processes their session keeps when the client that started them goes (`process.spawn
//! {detach: true}`, terminals): a recorder task owns the [`Exec`] and writes its output into a
//! bounded log per stream, so any number of readers, each at its own pace, can replay it from
//! an offset and then follow it (`process.attach`, `terminal.attach`).
//!
//! The recorder reads as fast as the guest writes: a kept process is never stopped by a client
//! that reads slowly or not at all. What it costs the host is bounded instead: at most
//! [`KEPT_OUTPUT_BYTES`] per stream (the oldest bytes go first; a reader that fell behind
//! continues from the oldest kept byte, and the offsets it receives say what it missed).
//!
//! A terminal's `terminal.run` learns a command's exit status and the shell's working directory
//! from the shell itself: the command line it types ends with a `printf` of an OSC sequence
//! carrying a nonce of this run, and the recorder watches the terminal's output for it. The
//! echo of the typed line holds the nonce too, but never after the sequence's ESC byte, which
//! only the `printf` produces; an OSC sequence terminals do not know is ignored by them.

use std::collections::{BTreeMap, VecDeque};
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, watch};
use umbra_api::kept::{KeptRange, OutputOffsets, TerminalInfo, KEPT_OUTPUT_BYTES};
use umbra_api::methods::Stream;
use umbra_api::{EventKind, ProcessExit};
use umbra_proto::TtySize;

use super::error::SessionError;
use super::exec::{Exec, ExecControl};

/// The most a reader receives in one event.
const CHUNK: usize = 64 * 1024;
/// The OSC number of `terminal.run`'s marker (no terminal gives it a meaning).
const MARK_OSC: &str = "6973";
/// The longest marker the recorder looks for (exit status and working directory included); a
/// longer one is not recognised, and the run waits on.
const MARK_MAX: usize = 4096 + 64;
/// The longest command `terminal.run` runs.
pub const MAX_RUN_COMMAND: usize = 64 * 1024;

/// A terminal to open.
#[derive(Debug, Clone)]
pub struct TerminalRequest {
    /// Empty: [`DEFAULT_SHELL`].
    /// Empty: a login shell (bash where the image has it, else sh).
    pub shell: Vec<String>,
    pub cwd: Option<String>,
    pub env: BTreeMap<String, String>,
    pub size: TtySize,
}

/// A process its session keeps.
pub struct Kept {
    id: u64,
    pid: u32,
    argv: Vec<String>,
    /// The terminal's size, for a terminal.
    terminal: Option<Mutex<TtySize>>,
    control: ExecControl,
    log: Mutex<Log>,
    /// Bumped after every change to the log, for readers waiting at its end.
    changed: watch::Sender<u64>,
    /// One `terminal.run` at a time.
    running: tokio::sync::Mutex<()>,
    last_cwd: Mutex<Option<String>>,
}

/// Where a `terminal.run` waits for its command's status and working directory.
type RunAnswer = oneshot::Sender<(i32, String)>;

#[derive(Default)]
struct Log {
    streams: [Ring; 2],
    exit: Option<ProcessExit>,
    ended_at: Option<Instant>,
    /// A `terminal.run` waiting for its marker: the marker's bytes up to the exit status, and
    /// where to send what follows.
    mark: Option<(Vec<u8>, RunAnswer)>,
    /// The end of the terminal's output not yet searched completely (a marker may be split
    /// across chunks).
    mark_tail: Vec<u8>,
}

/// One stream's kept output: the bytes `[start, start + bytes.len())`.
#[derive(Default)]
struct Ring {
    start: u64,
    bytes: VecDeque<u8>,
}

impl Ring {
    fn end(&self) -> u64 {
        self.start + self.bytes.len() as u64
    }

    fn range(&self) -> KeptRange {
        KeptRange { start: self.start, end: self.end() }
    }

    fn push(&mut self, data: &[u8], cap: usize) {
        let end = self.end() + data.len() as u64;
        // Room made first, so the buffer never holds (or allocates for) more than `cap`.
        let data = &data[data.len().saturating_sub(cap)..];
        let keep_old = (cap - data.len()).min(self.bytes.len());
        self.bytes.drain(..self.bytes.len() - keep_old);
        self.bytes.extend(data);
        self.start = end - self.bytes.len() as u64;
    }

    /// Frees the bytes; the offsets stay.
    fn clear(&mut self) {
        self.start = self.end();
        self.bytes = VecDeque::new();
    }

    /// Up to `max` bytes from `from` (or from the oldest kept byte, if `from` is older), with
    /// the offset they start at; `None` when nothing is past `from`.
    fn read(&self, from: u64, max: usize) -> Option<(u64, Vec<u8>)> {
        let from = from.max(self.start);
        if from >= self.end() {
            return None;
        }
        let i = (from - self.start) as usize;
        let n = (self.bytes.len() - i).min(max);
        Some((from, self.bytes.range(i..i + n).copied().collect()))
    }
}

/// What a reader receives next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeptEvent {
    Output { stream: Stream, offset: u64, data: Vec<u8> },
    Exit(ProcessExit),
}

impl Kept {
    /// Starts keeping `exec`: the recorder owns it from now on.
    pub(super) fn start(exec: Exec, argv: Vec<String>, terminal: Option<TtySize>) -> Arc<Kept> {
        let kept = Arc::new(Kept {
            id: exec.id(),
            pid: exec.pid(),
            argv,
            terminal: terminal.map(Mutex::new),
            control: exec.control(),
            log: Mutex::new(Log::default()),
            changed: watch::channel(0).0,
            running: tokio::sync::Mutex::new(()),
            last_cwd: Mutex::new(None),
        });
        tokio::spawn(record(kept.clone(), exec));
        kept
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn argv(&self) -> &[String] {
        &self.argv
    }

    pub fn control(&self) -> &ExecControl {
        &self.control
    }

    pub fn is_terminal(&self) -> bool {
        self.terminal.is_some()
    }

    /// A terminal's size (`None` for another process).
    pub fn size(&self) -> Option<TtySize> {
        self.terminal.as_ref().map(|t| *t.lock().unwrap())
    }

    /// What is kept of each stream.
    pub fn ranges(&self) -> (KeptRange, KeptRange) {
        let log = self.log.lock().unwrap();
        (log.streams[0].range(), log.streams[1].range())
    }

    pub fn exit(&self) -> Option<ProcessExit> {
        self.log.lock().unwrap().exit.clone()
    }

    /// How long ago it ended, if it has.
    pub fn ended_for(&self) -> Option<Duration> {
        self.log.lock().unwrap().ended_at.map(|t| t.elapsed())
    }

    /// What `terminal.open` and `terminal.list` say of a terminal.
    pub fn terminal_info(&self) -> TerminalInfo {
        TerminalInfo {
            terminal: self.id,
            pid: self.pid,
            shell: self.argv.clone(),
            size: self.size().unwrap_or(TtySize { rows: 0, cols: 0 }),
            output: self.ranges().0,
            exit: self.exit(),
        }
    }

    /// A reader of its output from `from`, then its exit.
    pub fn reader(self: &Arc<Self>, from: OutputOffsets) -> KeptReader {
        KeptReader {
            kept: self.clone(),
            next: [from.stdout, from.stderr],
            exit_sent: false,
            changed: self.changed.subscribe(),
        }
    }

    /// Resizes a terminal.
    pub async fn resize(&self, rows: u16, cols: u16) -> Result<(), SessionError> {
        let Some(size) = &self.terminal else {
            return Err(SessionError::InvalidArgument(format!("process {} is not a terminal", self.id)));
        };
        self.control.resize(rows, cols).await?;
        *size.lock().unwrap() = TtySize { rows, cols };
        Ok(())
    }

    /// Takes the terminal's one `terminal.run` slot; `busy` while another run waits.
    pub fn begin_run(&self) -> Result<tokio::sync::MutexGuard<'_, ()>, SessionError> {
        if !self.is_terminal() {
            return Err(SessionError::InvalidArgument(format!("process {} is not a terminal", self.id)));
        }
        self.running.try_lock().map_err(|_| {
            SessionError::Busy(format!(
                "terminal {} is still running a command of terminal.run; wait for it first",
                self.id
            ))
        })
    }

    /// Has the terminal's shell run the script at `path` (a file in the guest holding the
    /// command; removed after) as if typed, and waits for its marker: the command's exit status
    /// and the shell's working directory after it. The caller holds [`Kept::begin_run`]'s slot;
    /// dropping the future stops waiting (the command runs on).
    ///
    /// The typed line is short and fixed, whatever the command holds (control characters, many
    /// lines, more than a line editor takes): the command is in the file, which the shell
    /// checks first (`-n`) and then sources, so a syntax error is status 2 and still ends with
    /// the marker.
    pub async fn run_script(&self, path: &str, nonce: &str) -> Result<(i32, String), SessionError> {
        let (tx, rx) = oneshot::channel();
        {
            let mut log = self.log.lock().unwrap();
            if log.exit.is_some() {
                return Err(SessionError::InvalidArgument(format!("terminal {}'s shell has ended", self.id)));
            }
            log.mark = Some((format!("\x1b]{MARK_OSC};{nonce};").into_bytes(), tx));
            log.mark_tail.clear();
        }
        // Whatever ends this future (an answer, an error, a timeout), the marker is no longer
        // waited for.
        struct Unmark<'a>(&'a Mutex<Log>);
        impl Drop for Unmark<'_> {
            fn drop(&mut self) {
                self.0.lock().unwrap().mark = None;
            }
        }
        let _unmark = Unmark(&self.log);
        // A leading space keeps the line out of the shell's history (HISTCONTROL=ignorespace).
        let line = format!(
            " if ${{BASH:-sh}} -n {path}; then . {path}; else (exit 2); fi; \
             printf '\\033]{MARK_OSC};%s;%s;%s\\007' {nonce} \"$?\" \"$PWD\"; rm -f {path}\n"
        );
        self.control.write_stdin(line.into_bytes()).await?;
        let (status, cwd) = rx.await.map_err(|_| {
            SessionError::InvalidArgument(format!("terminal {}'s shell ended before the command finished", self.id))
        })?;
        *self.last_cwd.lock().unwrap() = Some(cwd.clone());
        Ok((status, cwd))
    }

    /// The shell's working directory after the last `terminal.run`.
    pub fn last_cwd(&self) -> Option<String> {
        self.last_cwd.lock().unwrap().clone()
    }

    /// Frees the kept output (the session forgot this process); readers get the exit.
    pub(super) fn release(&self) {
        let mut log = self.log.lock().unwrap();
        for ring in &mut log.streams {
            ring.clear();
        }
        drop(log);
        self.changed.send_modify(|v| *v += 1);
    }

    fn append(&self, stream: Stream, data: &[u8]) {
        let mut log = self.log.lock().unwrap();
        log.streams[stream as usize].push(data, KEPT_OUTPUT_BYTES as usize);
        if stream == Stream::Stdout && log.mark.is_some() {
            find_mark(&mut log, data);
        }
        drop(log);
        self.changed.send_modify(|v| *v += 1);
    }

    fn finish(&self, exit: ProcessExit) {
        let mut log = self.log.lock().unwrap();
        log.exit = Some(exit);
        log.ended_at = Some(Instant::now());
        // A waiting run learns the shell ended (its sender dropped).
        log.mark = None;
        drop(log);
        self.changed.send_modify(|v| *v += 1);
    }
}

/// Reads the process's events into its log until it ends.
async fn record(kept: Arc<Kept>, mut exec: Exec) {
    while let Some(event) = exec.next_event().await {
        match event.kind {
            EventKind::Stdout { data, .. } => kept.append(Stream::Stdout, &data.to_bytes().unwrap_or_default()),
            EventKind::Stderr { data, .. } => kept.append(Stream::Stderr, &data.to_bytes().unwrap_or_default()),
            EventKind::Exit(exit) => {
                kept.finish(exit);
                return;
            }
            _ => {}
        }
    }
    // The pump always ends with an exit; only a runtime shutting down gets here.
    kept.finish(super::exec::shutdown_exit(kept.id));
}

/// Looks for the waiting run's marker in what the terminal printed (with the unsearched end of
/// what it printed before); answers the run when the marker is complete. Linear in the output,
/// whatever it holds (the guest can read the nonce from the echo and repeat the marker's start):
/// the next BEL is searched for once, not once per start.
fn find_mark(log: &mut Log, data: &[u8]) {
    let Some((prefix, _)) = &log.mark else { return };
    let prefix = prefix.clone();
    let mut buf = std::mem::take(&mut log.mark_tail);
    buf.extend_from_slice(data);
    let mut pos = 0;
    let mut bel: Option<usize> = None; // the first BEL at or after the current body; MAX: none
    while let Some(i) = memchr::memmem::find(&buf[pos..], &prefix) {
        let at = pos + i;
        let body = at + prefix.len();
        if bel.is_none_or(|b| b < body) {
            bel = Some(memchr::memchr(0x07, &buf[body..]).map_or(usize::MAX, |e| body + e));
        }
        let end = bel.expect("set above");
        if end == usize::MAX {
            if buf.len() - body < MARK_MAX {
                // Perhaps a marker whose end has not come yet: kept from its start.
                buf.drain(..at);
                log.mark_tail = buf;
                return;
            }
        } else if end - body <= MARK_MAX {
            if let Some(result) = parse_mark(&buf[body..end]) {
                if let Some((_, tx)) = log.mark.take() {
                    let _ = tx.send(result);
                }
                return;
            }
        }
        // Too long, or malformed: not a marker; search on after its start.
        pos = body;
    }
    // Only the start of a marker split across chunks can be left.
    let keep = (buf.len() - pos).min(prefix.len() - 1);
    log.mark_tail = buf.split_off(buf.len() - keep);
}

/// `STATUS;CWD` as the marker carries them (a directory that is not UTF-8 is shown lossily).
fn parse_mark(body: &[u8]) -> Option<(i32, String)> {
    let split = memchr::memchr(b';', body)?;
    let status = std::str::from_utf8(&body[..split]).ok()?.parse().ok()?;
    Some((status, String::from_utf8_lossy(&body[split + 1..]).into_owned()))
}

/// A marker nonce no output before this run holds by chance.
pub(super) fn nonce(id: u64) -> String {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(id);
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
    format!("{:016x}", h.finish())
}

/// One reader of a kept process: its output from where it started, in order per stream, then
/// its exit; each at the reader's own pace.
pub struct KeptReader {
    kept: Arc<Kept>,
    next: [u64; 2],
    exit_sent: bool,
    changed: watch::Receiver<u64>,
}

impl KeptReader {
    pub fn kept(&self) -> &Arc<Kept> {
        &self.kept
    }

    /// The next output chunk (stdout's first when both have some), or the exit; `None` after
    /// the exit.
    pub async fn next(&mut self) -> Option<KeptEvent> {
        loop {
            // Marked seen before the log is read: a change after the read wakes the wait below.
            self.changed.borrow_and_update();
            {
                let log = self.kept.log.lock().unwrap();
                for (i, stream) in [Stream::Stdout, Stream::Stderr].into_iter().enumerate() {
                    if let Some((offset, data)) = log.streams[i].read(self.next[i], CHUNK) {
                        self.next[i] = offset + data.len() as u64;
                        return Some(KeptEvent::Output { stream, offset, data });
                    }
                }
                if let Some(exit) = &log.exit {
                    if self.exit_sent {
                        return None;
                    }
                    self.exit_sent = true;
                    return Some(KeptEvent::Exit(exit.clone()));
                }
            }
            // The sender lives as long as the process it belongs to, which this reader holds.
            if self.changed.changed().await.is_err() {
                return None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_keeps_the_newest_bytes_and_says_where_they_start() {
        let mut r = Ring::default();
        r.push(b"hello ", 8);
        assert_eq!(r.read(0, 100), Some((0, b"hello ".to_vec())));
        r.push(b"world", 8);
        assert_eq!(r.range(), KeptRange { start: 3, end: 11 });
        assert_eq!(r.read(0, 100), Some((3, b"lo world".to_vec())), "from before the start: the oldest kept");
        assert_eq!(r.read(9, 100), Some((9, b"ld".to_vec())));
        assert_eq!(r.read(4, 3), Some((4, b"o w".to_vec())));
        assert_eq!(r.read(11, 100), None);
        r.push(&[b'x'; 20], 8);
        assert_eq!(r.range(), KeptRange { start: 23, end: 31 });
    }

    fn log_waiting() -> (Log, oneshot::Receiver<(i32, String)>) {
        let (tx, rx) = oneshot::channel();
        let log = Log { mark: Some((b"\x1b]6973;abc;".to_vec(), tx)), ..Default::default() };
        (log, rx)
    }

    #[test]
    fn a_marker_split_across_chunks_answers_the_run() {
        let (mut log, mut rx) = log_waiting();
        // The echo of the typed line holds the nonce, but not after ESC ] 6973.
        find_mark(&mut log, b" eval 'cd /tmp'; printf '\\033]6973;%s;%s;%s\\007' abc \"$?\" \"$PWD\"\r\n");
        find_mark(&mut log, b"output\x1b]69");
        find_mark(&mut log, b"73;abc;0;/tm");
        assert!(rx.try_recv().is_err(), "not complete yet");
        find_mark(&mut log, b"p/a b\x07$ ");
        assert_eq!(rx.try_recv().unwrap(), (0, "/tmp/a b".to_string()));
        assert!(log.mark.is_none());
    }

    #[test]
    fn another_runs_marker_or_a_malformed_one_does_not_answer() {
        let (mut log, mut rx) = log_waiting();
        find_mark(&mut log, b"\x1b]6973;zzz;0;/\x07\x1b]6973;abc;x;/\x07");
        assert!(rx.try_recv().is_err());
        find_mark(&mut log, b"\x1b]6973;abc;;/\x07\x1b]6973;abc;127;/root\x07");
        assert_eq!(rx.try_recv().unwrap(), (127, "/root".to_string()));
    }

    #[test]
    fn the_searched_tail_stays_bounded() {
        let (mut log, _rx) = log_waiting();
        for _ in 0..100 {
            find_mark(&mut log, &[b'a'; 10_000]);
        }
        assert!(log.mark_tail.len() <= MARK_MAX);
        // An unterminated marker is given up once it is longer than any real one.
        find_mark(&mut log, b"\x1b]6973;abc;0;");
        find_mark(&mut log, &[b'/'; 2 * MARK_MAX]);
        assert!(log.mark_tail.len() <= MARK_MAX);
    }

    #[test]
    fn repeated_marker_starts_cost_linear_time_and_the_real_one_still_answers() {
        let (mut log, mut rx) = log_waiting();
        // 1 MiB of marker starts with one BEL far after them, in 64 KiB chunks.
        let mut flood = b"\x1b]6973;abc;".repeat(80_000);
        flood.extend_from_slice(&[b'x'; 5000]);
        flood.push(0x07);
        let started = std::time::Instant::now();
        for chunk in flood.chunks(64 * 1024) {
            find_mark(&mut log, chunk);
        }
        assert!(started.elapsed() < std::time::Duration::from_secs(2), "{:?}", started.elapsed());
        assert!(rx.try_recv().is_err() && log.mark_tail.len() <= MARK_MAX + 16);
        find_mark(&mut log, b"\x1b]6973;abc;2;/w\xffx\x07");
        assert_eq!(rx.try_recv().unwrap(), (2, "/w\u{fffd}x".to_string()), "a non-UTF-8 directory, shown lossily");
    }

    #[test]
    fn a_ring_never_holds_more_than_its_bound() {
        let mut r = Ring::default();
        r.push(&[1; 5], 8);
        r.push(&[2; 20], 8);
        assert_eq!((r.range(), r.bytes.len()), (KeptRange { start: 17, end: 25 }, 8));
        assert_eq!(r.read(0, 100), Some((17, vec![2; 8])));
        r.push(&[3; 3], 8);
        assert_eq!(r.read(0, 100), Some((20, [vec![2; 5], vec![3; 3]].concat())));
        r.clear();
        assert_eq!((r.range(), r.read(0, 100)), (KeptRange { start: 28, end: 28 }, None));
    }
}
