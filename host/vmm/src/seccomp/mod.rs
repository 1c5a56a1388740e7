//! Seccomp filters, one per thread kind, and the threads that run under them.
//!
//! The filters are data: `filters.json` (seccompiler's JSON format), one filter per
//! [`ThreadKind`], each syscall with the reason it is allowed; anything else kills the process.
//! Every thread of the VMM exists before the guest's first instruction and installs its own
//! filter before it touches guest state:
//! - the vCPU threads, when [`crate::machine::Machine::run`] starts them (then they wait until
//!   every thread is filtered);
//! - each device's worker, a [`Lane`] started with the device (the work it runs later, at
//!   activation, is handed to it: no thread is ever created while the guest runs, so no filter
//!   allows a thread's `clone`, and no thread inherits a wider filter than its own);
//! - the main thread last, just before it lets the vCPUs run.
//!
//! One process is created while the guest runs: a live fork's memory writer, which the control
//! thread forks (`clone` without CLONE_THREAD, allowed in its filter alone) and which keeps
//! that filter: it can open, map or execute nothing.
//!
//! A filter is installed only after [`enable`] (the `umbra-vmm` binary does so by default);
//! library users and unit tests run unfiltered. [`Mode::Log`] allows and logs what the filters
//! would refuse (the kernel's audit log, `dmesg`): how a missing syscall is found.

mod lane;

use std::collections::HashMap;
use std::sync::OnceLock;

pub use lane::{Lane, Running};

/// The filters, as shipped.
pub const FILTERS_JSON: &str = include_str!("filters.json");

/// A kind of VMM thread; each has its own filter in `filters.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ThreadKind {
    Main,
    Vcpu,
    Block,
    Rng,
    Balloon,
    Vsock,
    FsCalls,
    FsWatchdog,
    Control,
}

impl ThreadKind {
    pub const ALL: [ThreadKind; 9] = [
        ThreadKind::Main,
        ThreadKind::Vcpu,
        ThreadKind::Block,
        ThreadKind::Rng,
        ThreadKind::Balloon,
        ThreadKind::Vsock,
        ThreadKind::FsCalls,
        ThreadKind::FsWatchdog,
        ThreadKind::Control,
    ];

    /// Its filter's key in `filters.json`.
    pub fn name(self) -> &'static str {
        match self {
            ThreadKind::Main => "main",
            ThreadKind::Vcpu => "vcpu",
            ThreadKind::Block => "block",
            ThreadKind::Rng => "rng",
            ThreadKind::Balloon => "balloon",
            ThreadKind::Vsock => "vsock",
            ThreadKind::FsCalls => "fs_calls",
            ThreadKind::FsWatchdog => "fs_watchdog",
            ThreadKind::Control => "control",
        }
    }
}

/// What a filter does with a syscall it does not list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Kills the process (the default of the binary).
    Kill,
    /// Allows it and logs it (for finding what a filter lacks).
    Log,
}

struct Enabled {
    mode: Mode,
    filters: HashMap<String, seccompiler::BpfProgram>,
}

static ENABLED: OnceLock<Enabled> = OnceLock::new();

/// Compiles the filters for this architecture; from now on [`install`] applies them. Call
/// once, before any VMM thread starts.
pub fn enable(mode: Mode) -> Result<(), String> {
    let filters = compile(mode)?;
    ENABLED.set(Enabled { mode, filters }).map_err(|_| "seccomp filters enabled twice".to_string())
}

/// `filters.json` compiled for this architecture. Each filter's own `comment` (seccompiler
/// takes comments on rules only) is dropped first; in [`Mode::Log`] every filter logs instead
/// of killing.
fn compile(mode: Mode) -> Result<HashMap<String, seccompiler::BpfProgram>, String> {
    let mut json: serde_json::Value =
        serde_json::from_str(FILTERS_JSON).map_err(|e| format!("seccomp filters: {e}"))?;
    for filter in json.as_object_mut().into_iter().flat_map(|m| m.values_mut()) {
        if let Some(filter) = filter.as_object_mut() {
            filter.remove("comment");
            if mode == Mode::Log {
                filter.insert("mismatch_action".into(), "log".into());
            }
        }
    }
    let arch = std::env::consts::ARCH
        .try_into()
        .map_err(|e| format!("seccomp filters: no syscall table for {}: {e:?}", std::env::consts::ARCH))?;
    let filters = seccompiler::compile_from_json(json.to_string().as_bytes(), arch)
        .map_err(|e| format!("seccomp filters: {e}"))?;
    for kind in ThreadKind::ALL {
        if !filters.contains_key(kind.name()) {
            return Err(format!("seccomp filters: no filter for thread kind {:?}", kind.name()));
        }
    }
    Ok(filters)
}

/// The mode in force, if filters are enabled.
pub fn mode() -> Option<Mode> {
    ENABLED.get().map(|e| e.mode)
}

/// Installs `kind`'s filter on the calling thread (with `no_new_privs`), if filters are
/// enabled. Filters only ever add up: a thread keeps those it inherited.
pub fn install(kind: ThreadKind) -> Result<(), String> {
    let Some(enabled) = ENABLED.get() else { return Ok(()) };
    let filter = &enabled.filters[kind.name()];
    seccompiler::apply_filter(filter).map_err(|e| format!("install the {} seccomp filter: {e}", kind.name()))?;
    test_trigger(kind);
    Ok(())
}

/// Test (debug) builds only — release builds, what `scripts/install` ships, lack it: with
/// `UMBRA_VMM_SECCOMP_TRIGGER` naming this thread's kind, make a syscall no filter allows,
/// right after the filter is in place — how the tests show that each kind's filter kills the
/// process.
#[cfg(debug_assertions)]
fn test_trigger(kind: ThreadKind) {
    if std::env::var("UMBRA_VMM_SECCOMP_TRIGGER").is_ok_and(|k| k == kind.name()) {
        // SAFETY: ptrace(PTRACE_TRACEME) takes no pointers; no filter allows ptrace, so the
        // process is killed before it could matter.
        unsafe { libc::syscall(libc::SYS_ptrace, libc::PTRACE_TRACEME, 0, 0, 0) };
    }
}

#[cfg(not(debug_assertions))]
fn test_trigger(_: ThreadKind) {}

/// Starts a thread that installs `kind`'s filter, then runs `f` — for threads started before
/// the guest runs (from the main thread, which is unfiltered until then). Returns once the
/// filter is in place, so nothing the caller does next (starting the guest) can overtake it. A
/// thread whose filter cannot be installed ends the process: it must never run unfiltered.
pub fn spawn_filtered<F, T>(kind: ThreadKind, name: &str, f: F) -> std::io::Result<std::thread::JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let (filtered_tx, filtered) = std::sync::mpsc::sync_channel(1);
    let handle = std::thread::Builder::new().name(name.to_string()).spawn(move || {
        install_or_exit(kind);
        let _ = filtered_tx.send(());
        f()
    })?;
    filtered.recv().map_err(|_| std::io::Error::other(format!("the {name} thread ended before its filter")))?;
    Ok(handle)
}

fn install_or_exit(kind: ThreadKind) {
    if let Err(e) = install(kind) {
        eprintln!("umbra-vmm: {e}");
        std::process::exit(crate::exit::VMM_ERROR_STATUS);
    }
}

/// Makes the process unable to gain privileges or use any it has: `no_new_privs`, every
/// capability dropped from the effective, permitted, inheritable, ambient and bounding sets.
/// Call before any thread starts (threads inherit both).
pub fn drop_privileges() -> Result<(), String> {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(format!("prctl(PR_SET_NO_NEW_PRIVS): {}", std::io::Error::last_os_error()));
    }
    // SAFETY: prctl with integer arguments only.
    unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) };
    for cap in 0..=63 {
        // SAFETY: prctl with integer arguments only; EINVAL past the last capability is fine,
        // EPERM without CAP_SETPCAP is fine too (then there was nothing to drop).
        unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) };
    }
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
    let mut header = Header { version: LINUX_CAPABILITY_VERSION_3, pid: 0 };
    let data = [Data { effective: 0, permitted: 0, inheritable: 0 }; 2];
    // SAFETY: capset reads a version-3 header and two data structs, both valid for the call.
    if unsafe { libc::syscall(libc::SYS_capset, &mut header as *mut Header, data.as_ptr()) } != 0 {
        return Err(format!("capset: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_a_filter_that_compiles_and_every_rule_says_why() {
        let json: serde_json::Value = serde_json::from_str(FILTERS_JSON).unwrap();
        for kind in ThreadKind::ALL {
            let filter = &json[kind.name()];
            assert_eq!(filter["mismatch_action"], "kill_process", "{}", kind.name());
            assert!(filter["comment"].as_str().is_some_and(|c| !c.is_empty()), "{}", kind.name());
            for rule in filter["filter"].as_array().unwrap() {
                assert!(rule["comment"].as_str().is_some_and(|c| !c.is_empty()), "{}: {rule}", kind.name());
            }
            let names: Vec<&str> =
                filter["filter"].as_array().unwrap().iter().map(|r| r["syscall"].as_str().unwrap()).collect();
            for forbidden in ["clone3", "fork", "vfork", "execve", "ptrace", "open", "openat", "mount"] {
                assert!(!names.contains(&forbidden), "{} allows {forbidden}", kind.name());
            }
            // No thread is created while the guest runs; the one process is a fork's memory
            // writer, started by the control thread: clone only with glibc fork()'s flags.
            for rule in filter["filter"].as_array().unwrap().iter().filter(|r| r["syscall"] == "clone") {
                assert_eq!(kind, ThreadKind::Control, "{} allows clone", kind.name());
                let arg = &rule["args"][0];
                let fork_flags = libc::CLONE_CHILD_SETTID | libc::CLONE_CHILD_CLEARTID | libc::SIGCHLD;
                assert_eq!((&arg["index"], &arg["op"], &arg["val"]), (&0.into(), &"eq".into(), &fork_flags.into()));
            }
        }
        assert_eq!(compile(Mode::Kill).unwrap().len(), ThreadKind::ALL.len());
        assert_eq!(compile(Mode::Log).unwrap().len(), ThreadKind::ALL.len());
    }
}
