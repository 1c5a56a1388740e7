//! The guest console log, and what it tells us about a VM that died.

use std::path::Path;

/// How many console lines an error carries.
pub const ERROR_CONTEXT_LINES: usize = 40;

/// The last `n` lines of the console log (lossy UTF-8, control characters stripped).
pub fn tail(path: &Path, n: usize) -> String {
    let bytes = std::fs::read(path).unwrap_or_default();
    // Only the end matters; don't decode a huge log.
    let start = bytes.len().saturating_sub(64 * 1024);
    let text = String::from_utf8_lossy(&bytes[start..]);
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
