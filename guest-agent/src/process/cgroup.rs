//! The cgroup every command runs in when the agent is the guest's PID 1: at most
//! [`MAX_PIDS`] tasks, and always [`TASK_RESERVE`] fewer than the kernel allows in all (its
//! `threads-max` follows the guest's memory: about 4096 in 512 MiB), and the guest's memory
//! less [`MEMORY_RESERVE`]; and for the CPU scheduler the commands together weigh
//! [`CPU_WEIGHT`], a hundredth of one agent thread: they have every cycle the agent does not
//! want, and the agent gets the ones it does. A fork bomb or a runaway allocation inside a
//! command exhausts that cgroup, not the guest: the agent, in the root cgroup, can still
//! fork, allocate and answer, and the kernel's OOM killer picks its victim among the commands. `kill_all` with SIGKILL empties it through `cgroup.kill`, which also
//! reaches processes that left their process group.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;

pub const PATH: &str = "/sys/fs/cgroup/umbra-commands";
/// Tasks the commands may have together, at most.
pub const MAX_PIDS: u64 = 8192;
/// Tasks kept out of the commands' reach: the agent must always be able to start a thread
/// (its runtime panics when it cannot) and fork the next command.
pub const TASK_RESERVE: u64 = 256;
/// Memory kept out of the commands' reach, for the agent, the kernel and the page cache it
/// needs to answer.
pub const MEMORY_RESERVE: u64 = 64 << 20;
/// cgroup v2 `cpu.weight` of all commands together (1–10000; a nice-0 task weighs 100).
pub const CPU_WEIGHT: u32 = 1;

struct Cgroup {
    procs: OwnedFd,
}

static COMMANDS: OnceLock<Cgroup> = OnceLock::new();

/// Creates the cgroup (called once by PID 1 at start-up, cgroup2 mounted).
pub fn create() -> io::Result<()> {
    // cpu: the commands compete with the agent as one light scheduling entity, not as
    // thousands of tasks, so a fork bomb cannot starve the agent's answers (and heartbeats).
    std::fs::write("/sys/fs/cgroup/cgroup.subtree_control", "+memory +pids +cpu")?;
    match std::fs::create_dir(PATH) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let kernel_max = ["/proc/sys/kernel/threads-max", "/proc/sys/kernel/pid_max"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok()?.trim().parse::<u64>().ok())
        .min()
        .unwrap_or(MAX_PIDS);
    let pids = MAX_PIDS.min(kernel_max.saturating_sub(TASK_RESERVE)).max(64);
    std::fs::write(format!("{PATH}/pids.max"), pids.to_string())?;
    let total = mem_total()?;
    // A small guest still leaves its commands at least half of its memory.
    let limit = total.saturating_sub(MEMORY_RESERVE).max(total / 2);
    std::fs::write(format!("{PATH}/memory.max"), limit.to_string())?;
    std::fs::write(format!("{PATH}/cpu.weight"), CPU_WEIGHT.to_string())?;
    let procs = std::fs::OpenOptions::new().write(true).open(format!("{PATH}/cgroup.procs"))?;
    let _ = COMMANDS.set(Cgroup { procs: procs.into() });
    Ok(())
}

fn mem_total() -> io::Result<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")?;
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|kib| kib << 10)
        .ok_or_else(|| io::Error::other("no MemTotal in /proc/meminfo"))
}

/// The `cgroup.procs` descriptor a child writes itself into, when the cgroup exists.
pub fn procs_fd() -> Option<RawFd> {
    COMMANDS.get().map(|c| c.procs.as_raw_fd())
}

/// In a forked child, before exec: moves the calling process into the cgroup ("0" is the
/// writer itself). Async-signal-safe: one write(2).
pub fn join(procs: RawFd) -> io::Result<()> {
    // SAFETY: writes one byte from a static buffer to a descriptor the agent keeps open.
    if unsafe { libc::write(procs, b"0".as_ptr().cast(), 1) } != 1 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Kills every process in the cgroup, wherever its process group went; false when there is
/// no cgroup (or the kernel predates `cgroup.kill`).
pub fn kill_all() -> bool {
    COMMANDS.get().is_some() && std::fs::write(format!("{PATH}/cgroup.kill"), "1").is_ok()
}
