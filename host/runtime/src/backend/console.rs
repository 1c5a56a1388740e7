//! The guest console log, and what it tells us about a VM that died.

use std::path::Path;

/// How many console lines an error carries.
pub const ERROR_CONTEXT_LINES: usize = 40;

/// The console log file never grows past this: a guest can print without limit, and the run
/// directory usually lives on a RAM-backed tmpfs.
pub const CONSOLE_LOG_CAP: u64 = 8 << 20;

/// A running console copier; lets a reader wait until everything the VMM printed is in the
/// file (the copier ends when the VMM's end of the pipe closes).
pub struct ConsoleCopier {
    /// In a mutex so a VM can be shared between tasks (a Receiver alone is not Sync).
    done: std::sync::Mutex<std::sync::mpsc::Receiver<()>>,
}

impl ConsoleCopier {
    pub fn start(source: impl std::io::Read + Send + 'static, path: std::path::PathBuf) -> std::io::Result<Self> {
        let (tx, done) = std::sync::mpsc::channel();
        std::thread::Builder::new().name("umbra-console".into()).spawn(move || {
            let _ = copy_capped(source, &path, CONSOLE_LOG_CAP);
            drop(tx);
        })?;
        Ok(Self { done: std::sync::Mutex::new(done) })
    }

    /// After the VMM exited: waits (briefly) until its last console bytes are in the file.
    pub fn wait_drained(&self, max: std::time::Duration) {
        let _ = self.done.lock().unwrap_or_else(|e| e.into_inner()).recv_timeout(max);
    }
}

/// Copies the guest console from `source` (QEMU's stdout) into `path`, starting the file over
/// with a marker line whenever it would pass `cap` bytes, so the newest output is always kept.
/// Returns when the source ends (the VMM exited).
pub fn copy_capped(mut source: impl std::io::Read, path: &Path, cap: u64) -> std::io::Result<()> {
    use std::io::{Seek, SeekFrom, Write};
    const MARKER: &[u8] = b"[umbra: earlier console output dropped: log reached its size cap]\n";
    let mut file = std::fs::OpenOptions::new().create(true).write(true).truncate(true).open(path)?;
    let mut written = 0u64;
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match source.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if written + n as u64 > cap {
            file.set_len(0)?;
            file.seek(SeekFrom::Start(0))?;
            file.write_all(MARKER)?;
            written = MARKER.len() as u64;
        }
        file.write_all(&buf[..n])?;
        written += n as u64;
    }
}

/// The last `n` lines of the console log (lossy UTF-8, control characters stripped).
pub fn tail(path: &Path, n: usize) -> String {
    use std::io::{Read, Seek, SeekFrom};
    // Only the end matters: a guest can flood its console, so never read the whole log.
    const WINDOW: u64 = 64 * 1024;
    let mut bytes = Vec::new();
    if let Ok(mut f) = std::fs::File::open(path) {
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        if f.seek(SeekFrom::Start(len.saturating_sub(WINDOW))).is_ok() {
            let _ = f.take(WINDOW).read_to_end(&mut bytes);
        }
    }
    let text = String::from_utf8_lossy(&bytes);
    let lines: Vec<&str> = text.lines().collect();
    let from = lines.len().saturating_sub(n);
    lines[from..]
        .iter()
        .map(|l| l.chars().filter(|c| !c.is_control() || *c == '\t').collect::<String>())
        .collect::<Vec<_>>()
        .join("\n")
}

/// Why the guest went away, as far as its console says.
pub fn diagnose(console_tail: &str) -> Option<&'static str> {
    if console_tail.contains("Kernel panic") {
        if console_tail.contains("Attempted to kill init") {
            Some("the guest agent (PID 1) died and the kernel panicked")
        } else {
            Some("the guest kernel panicked")
        }
    } else if console_tail.contains("umbra-agent: fatal:") {
        Some("the guest agent hit a fatal error and shut the VM down")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_console_log_is_capped_and_keeps_the_newest_output() {
        let path = std::env::temp_dir().join(format!("umbra-console-cap-{}", std::process::id()));
        let flood: Vec<u8> = (0..10_000).flat_map(|i| format!("line {i}\n").into_bytes()).collect();
        copy_capped(&flood[..], &path, 4096).unwrap();
        let len = std::fs::metadata(&path).unwrap().len();
        assert!(len <= 4096 + 16 * 1024, "log stays bounded: {len}");
        let t = tail(&path, 2);
        assert_eq!(t, "line 9998\nline 9999", "the newest output survives");
        assert!(std::fs::read_to_string(&path).unwrap().starts_with("[umbra: earlier console output dropped"));
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn tail_and_diagnosis() {
        let dir = std::env::temp_dir().join(format!("umbra-console-{}", std::process::id()));
        std::fs::write(&dir, "a\nb\x1b[0m\nKernel panic - not syncing: Attempted to kill init! exitcode=0x00000009\n")
            .unwrap();
        let t = tail(&dir, 2);
        assert_eq!(t.lines().count(), 2);
        assert!(t.starts_with("b[0m"), "{t:?}");
        assert_eq!(diagnose(&t), Some("the guest agent (PID 1) died and the kernel panicked"));
        assert_eq!(
            diagnose("umbra-agent: fatal: cannot mount"),
            Some("the guest agent hit a fatal error and shut the VM down")
        );
        assert_eq!(diagnose("all fine"), None);
        std::fs::remove_file(&dir).unwrap();
    }
}
