//! What a VM's processes were doing when its boot timed out: a silent guest (the kernel runs
//! with `quiet`) and an unanswered agent say nothing by themselves. Whether the VMM burnt CPU
//! (a guest spinning) or sat idle (blocked on a daemon), and what the daemons logged, tell a
//! hung guest from a hung helper.

use std::fmt::Write as _;
use std::path::Path;

use super::children::Supervised;

/// Lines kept from each helper log.
const LOG_TAIL_LINES: usize = 8;

/// One line per helper (pid, alive, CPU seconds), the console's size, and the tail of every
/// helper log in the run directory.
pub fn report(run: &Path, children: &mut [Supervised]) -> String {
    let mut out = String::new();
    for child in children.iter_mut() {
        let state = match child.try_exited() {
            Some(status) => format!("exited ({status})"),
            None => match cpu_seconds(child.pid()) {
                Some(cpu) => format!("running, {cpu:.1} s CPU"),
                None => "running".to_string(),
            },
        };
        let _ = writeln!(out, "  {} (pid {}): {state}", child.name, child.pid());
    }
    let console = std::fs::metadata(run.join("console.log")).map(|m| m.len()).unwrap_or(0);
    let _ = writeln!(out, "  console: {console} bytes");
    let mut logs: Vec<_> = std::fs::read_dir(run)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "log") && !p.ends_with("console.log"))
        .collect();
    logs.sort();
    for log in logs {
        let tail = super::console::tail(&log, LOG_TAIL_LINES);
        if !tail.trim().is_empty() {
            let name = log.file_name().unwrap_or_default().to_string_lossy();
            let _ = writeln!(out, "  {name}:");
            for line in tail.lines() {
                let _ = writeln!(out, "    {line}");
            }
        }
    }
    out
}

/// User + system CPU time of `pid` from /proc/PID/stat (fields 14 and 15, in clock ticks).
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_cpu_ticks(&stat).map(|ticks| ticks as f64 / clock_ticks_per_second())
}

/// The comm field (2) is in parentheses and may contain spaces; the fields after its closing
/// parenthesis start at field 3.
fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf has no memory effects.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        hz as f64
    } else {
        100.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_survive_a_comm_with_spaces_and_parentheses() {
        let stat = "4242 (qemu (x) 86) S 1 4242 4242 0 -1 4194560 100 0 0 0 1500 250 0 0 20 0 3 0 99 0 0";
        assert_eq!(parse_cpu_ticks(stat), Some(1750));
        assert_eq!(parse_cpu_ticks("garbage"), None);
        assert_eq!(parse_cpu_ticks("1 (x) S 1 2"), None);
    }

    #[test]
    fn the_current_process_has_a_cpu_time() {
        assert!(cpu_seconds(std::process::id()).is_some());
    }

    #[test]
    fn report_lists_helper_logs_but_not_the_console() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("console.log"), "boot\n").unwrap();
        std::fs::write(dir.path().join("vhost-vsock.log"), "thread panicked at x\n").unwrap();
        std::fs::write(dir.path().join("qemu.log"), "").unwrap();
        let text = report(dir.path(), &mut []);
        assert!(text.contains("console: 5 bytes"), "{text}");
        assert!(text.contains("vhost-vsock.log:\n    thread panicked at x"), "{text}");
        assert!(!text.contains("qemu.log") && !text.contains("console.log"), "{text}");
    }
}
