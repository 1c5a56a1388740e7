//! The guest console log, and what it tells us about a VM that died.

use std::path::Path;

/// How many console lines an error carries.
pub const ERROR_CONTEXT_LINES: usize = 40;

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
