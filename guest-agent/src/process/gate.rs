//! The exec gate (`SpawnRequest::exec_gate`): every program a process and its descendants
//! execute is checked before it runs.
//!
//! The child installs a seccomp filter just before its own exec that turns `execve` and
//! `execveat` into user notifications (`SECCOMP_RET_USER_NOTIF`), and hands the filter's
//! listener to the agent over a socket pair; the descendants inherit the filter, so every exec
//! in the tree waits on the agent. For each, the agent reads the program's path and arguments
//! from the caller's memory, lets it through at once when the gate's allow patterns match its
//! words ([`umbra_proto::exec_gate::exec_words`]), and otherwise sends the host an
//! `exec_check` event and waits for its `exec_answer`. An allowed exec continues
//! (`SECCOMP_USER_NOTIF_FLAG_CONTINUE`); a refused one fails with EACCES.
//!
//! This is policy on top of the VM, not a boundary: the kernel reads the path again when the
//! exec continues, so a second thread of the caller can change it after the check (seccomp(2)
//! says as much of `CONTINUE`), and whatever is already running can do what the program it
//! would exec does. The VM is the boundary; the gate keeps an agent in the guest honest.
//! Syscalls of another ABI (i386 through `int 0x80`, x32) fail with EPERM, so a 32-bit exec
//! cannot go round the filter.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::{oneshot, watch};
use umbra_proto::exec_gate::{exec_words, MAX_EXEC_ARGS, MAX_EXEC_BYTES};
use umbra_proto::{json_frame, Event, ExecGate, FrameKind};

use super::route::Route;

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xc000_003e;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xc000_00b7;
/// x32 syscalls have this bit set in their number (x86_64 only; no aarch64 number reaches it).
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

const fn stmt(code: u32, k: u32) -> libc::sock_filter {
    libc::sock_filter { code: code as u16, jt: 0, jf: 0, k }
}

const fn jump(code: u32, k: u32, jt: u8, jf: u8) -> libc::sock_filter {
    libc::sock_filter { code: code as u16, jt, jf, k }
}

/// `seccomp_data`: `nr` at offset 0, `arch` at 4.
static FILTER: [libc::sock_filter; 9] = [
    stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 4),
    jump(libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K, AUDIT_ARCH, 0, 6),
    stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0),
    jump(libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K, X32_SYSCALL_BIT, 4, 0),
    jump(libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K, libc::SYS_execve as u32, 2, 0),
    jump(libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K, libc::SYS_execveat as u32, 1, 0),
    stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ALLOW),
    stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_USER_NOTIF),
    stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ERRNO | libc::EPERM as u32),
];

/// The two ends of the socket pair a child sends its listener over.
pub struct Handoff {
    /// Stays in the agent: the listener arrives here.
    pub agent: OwnedFd,
    /// Used by the child between fork and exec, then closed (close-on-exec); the agent closes
    /// its copy once the child is forked, so a child that dies first shows as end of file.
    pub child: OwnedFd,
}

impl Handoff {
    pub fn new() -> io::Result<Self> {
        let mut fds = [0; 2];
        let kind = libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK;
        // SAFETY: `fds` has room for the two descriptors socketpair writes.
        if unsafe { libc::socketpair(libc::AF_UNIX, kind, 0, fds.as_mut_ptr()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: socketpair returned two new descriptors nobody else owns.
        Ok(unsafe { Self { agent: OwnedFd::from_raw_fd(fds[0]), child: OwnedFd::from_raw_fd(fds[1]) } })
    }
}

/// In the child, between fork and exec (only syscalls, no allocation): installs the filter and
/// sends its listener to the agent over `sock`, then closes the child's copy — a process
/// holding its own listener could answer its own checks.
pub fn install(sock: RawFd) -> io::Result<()> {
    let prog = libc::sock_fprog { len: FILTER.len() as u16, filter: FILTER.as_ptr() as *mut libc::sock_filter };
    let set = |prog: &libc::sock_fprog| {
        // SAFETY: `prog` points at a valid filter program alive for the call.
        unsafe {
            libc::syscall(
                libc::SYS_seccomp,
                libc::SECCOMP_SET_MODE_FILTER,
                libc::SECCOMP_FILTER_FLAG_NEW_LISTENER,
                prog as *const libc::sock_fprog,
            )
        }
    };
    let mut listener = set(&prog);
    if listener < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EACCES) {
        // Without CAP_SYS_ADMIN (a spawn as another user) a filter needs no_new_privs.
        // SAFETY: prctl with integer arguments.
        if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
            return Err(io::Error::last_os_error());
        }
        listener = set(&prog);
    }
    if listener < 0 {
        return Err(io::Error::last_os_error());
    }
    let listener = listener as RawFd;
    let sent = send_fd(sock, listener);
    // SAFETY: the listener is this process's, and nothing else uses it.
    unsafe { libc::close(listener) };
    sent
}

/// A message header for one byte (`iov`) and one descriptor's control data: `control` has
/// room for a cmsghdr and an int, 8-byte aligned (CMSG_SPACE(4) is 24 on 64-bit). No
/// allocation (the child calls it between fork and exec).
fn one_fd_message(iov: &mut libc::iovec, control: &mut [u64; 4]) -> libc::msghdr {
    // SAFETY: msghdr is plain data; zeroed is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = size_of_val(control) as _;
    msg
}

/// Sends `fd` over `sock` (SCM_RIGHTS), with one byte of data. No allocation.
fn send_fd(sock: RawFd, fd: RawFd) -> io::Result<()> {
    let (mut control, mut byte) = ([0u64; 4], [1u8]);
    let mut iov = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 };
    let mut msg = one_fd_message(&mut iov, &mut control);
    // SAFETY: CMSG_SPACE only computes a size.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(size_of::<RawFd>() as u32) } as _;
    // SAFETY: the control buffer is large enough for one header with an int (above), so
    // CMSG_FIRSTHDR is non-null and CMSG_DATA points inside the buffer.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd);
        if libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) != 1 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Receives the listener a child sent (close-on-exec, so no other child inherits it); `None`
/// when the child ended without sending one (its spawn failed).
async fn receive_listener(sock: OwnedFd) -> io::Result<Option<OwnedFd>> {
    // SAFETY: the AsyncFd owns `sock`, which stays open until it is dropped.
    let sock = unsafe { AsyncFd::register_with_interest(sock, Interest::READABLE) }.map_err(|e| e.into_parts().1)?;
    loop {
        let mut guard = sock.readable().await?;
        let (mut control, mut byte) = ([0u64; 4], [0u8]);
        let mut iov = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 };
        let mut msg = one_fd_message(&mut iov, &mut control);
        // SAFETY: `msg` describes buffers alive for the call.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::WouldBlock {
                guard.clear_ready();
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Ok(None);
        }
        // SAFETY: recvmsg filled `control` up to msg_controllen; the CMSG macros walk it
        // within those bounds.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            if cmsg.is_null() || (*cmsg).cmsg_level != libc::SOL_SOCKET || (*cmsg).cmsg_type != libc::SCM_RIGHTS {
                return Err(io::Error::other("the child sent no listener"));
            }
            let fd = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>());
            return Ok(Some(OwnedFd::from_raw_fd(fd)));
        }
    }
}

/// Checks waiting for the host's answer, guest-wide (any connection may answer).
#[derive(Default)]
pub struct ExecChecks {
    waiting: Mutex<HashMap<u64, oneshot::Sender<bool>>>,
    next: AtomicU64,
}

/// At most this many execs wait for the host at once; more are refused (EAGAIN) at once.
pub const MAX_WAITING_CHECKS: usize = 1024;

impl ExecChecks {
    /// Delivers the host's answer; false when no such check waits.
    pub fn answer(&self, check: u64, allow: bool) -> bool {
        match self.waiting.lock().unwrap().remove(&check) {
            Some(tx) => tx.send(allow).is_ok(),
            None => false,
        }
    }

    fn open(&self) -> Option<(u64, oneshot::Receiver<bool>)> {
        let mut waiting = self.waiting.lock().unwrap();
        if waiting.len() >= MAX_WAITING_CHECKS {
            return None;
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let (tx, rx) = oneshot::channel();
        waiting.insert(id, tx);
        Some((id, rx))
    }

    fn forget(&self, check: u64) {
        self.waiting.lock().unwrap().remove(&check);
    }
}

/// What a gate serves: its patterns, the argv the host already approved (its first exec, which
/// runs before the process has a route), where its checks go once it has one, and the
/// guest-wide table of waiting checks.
pub struct Served {
    pub gate: ExecGate,
    pub approved: Vec<String>,
    pub route: watch::Receiver<Option<Arc<Route>>>,
    pub checks: Arc<ExecChecks>,
    pub answered: Answered,
}

/// The host's recent answers by caller and words. A shell whose exec is refused tries the
/// next PATH directory (`/usr/bin/id`, then `/bin/id`: the same program, the same words); the
/// same caller asking the same again within [`REMEMBER`] gets the same answer without asking
/// the host twice.
#[derive(Default)]
pub struct Answered(Mutex<HashMap<Caller, (bool, std::time::Instant)>>);

/// A caller's pid and an exec's words.
type Caller = (u32, Vec<String>);

const REMEMBER: Duration = Duration::from_secs(10);
const REMEMBERED: usize = 256;

impl Answered {
    fn get(&self, pid: u32, words: &[String]) -> Option<bool> {
        let map = self.0.lock().unwrap();
        let (allow, at) = map.get(&(pid, words.to_vec()))?;
        (at.elapsed() < REMEMBER).then_some(*allow)
    }

    fn put(&self, pid: u32, words: Vec<String>, allow: bool) {
        let mut map = self.0.lock().unwrap();
        if map.len() >= REMEMBERED {
            map.retain(|_, (_, at)| at.elapsed() < REMEMBER);
            if map.len() >= REMEMBERED {
                map.clear();
            }
        }
        map.insert((pid, words), (allow, std::time::Instant::now()));
    }
}

/// Serves one spawn's gate until every process under its filter has gone.
pub async fn serve(sock: OwnedFd, served: Served) {
    let listener = match receive_listener(sock).await {
        Ok(Some(listener)) => listener,
        Ok(None) => return,
        Err(e) => {
            tracing::warn!("exec gate: no listener from the child: {e}");
            return;
        }
    };
    // SAFETY: the AsyncFd owns the listener, which stays open until it is dropped.
    let listener = match unsafe { AsyncFd::register_with_interest(listener, Interest::READABLE) } {
        Ok(l) => Arc::new(l),
        Err(e) => {
            let e = e.into_parts().1;
            tracing::warn!("exec gate: cannot watch the listener: {e}");
            return;
        }
    };
    let served = Arc::new(served);
    loop {
        let Ok(mut guard) = listener.readable().await else { return };
        match pending(listener.as_raw_fd()) {
            Pending::Notification => {}
            Pending::Nothing => {
                guard.clear_ready();
                continue;
            }
            Pending::Gone => return,
        }
        let notif = match receive(listener.as_raw_fd()) {
            Ok(n) => n,
            // The caller died between the wake-up and the receive.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
            Err(e) => {
                tracing::warn!("exec gate: cannot receive a notification: {e}");
                return;
            }
        };
        tracing::debug!(pid = notif.pid, nr = notif.data.nr, "exec gate: a check");
        tokio::spawn(decide(listener.clone(), served.clone(), notif));
    }
}

enum Pending {
    Notification,
    Nothing,
    /// No process is under the filter any more.
    Gone,
}

fn pending(fd: RawFd) -> Pending {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, no waiting.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    if n > 0 && p.revents & libc::POLLIN != 0 {
        Pending::Notification
    } else if n > 0 && p.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
        Pending::Gone
    } else {
        Pending::Nothing
    }
}

/// One notification. Called only when one is pending, so the receive does not block.
fn receive(fd: RawFd) -> io::Result<libc::seccomp_notif> {
    // The kernel wants a zeroed buffer; its struct may be larger than ours on a newer kernel,
    // which `sizes` guards against.
    sizes()?;
    // SAFETY: seccomp_notif is plain data.
    let mut notif: libc::seccomp_notif = unsafe { std::mem::zeroed() };
    // SAFETY: RECV writes one seccomp_notif (at most our size, checked above).
    if unsafe { libc::ioctl(fd, libc::SECCOMP_IOCTL_NOTIF_RECV, &mut notif) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(notif)
}

/// Refuses to run on a kernel whose notification struct is larger than the one we pass.
fn sizes() -> io::Result<()> {
    static CHECKED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    let checked = CHECKED.get_or_init(|| {
        // SAFETY: seccomp_notif_sizes is plain data the call fills.
        let mut sizes: libc::seccomp_notif_sizes = unsafe { std::mem::zeroed() };
        // SAFETY: GET_NOTIF_SIZES writes one seccomp_notif_sizes.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_seccomp,
                libc::SECCOMP_GET_NOTIF_SIZES,
                0,
                &mut sizes as *mut libc::seccomp_notif_sizes,
            )
        };
        if rc != 0 {
            return Err(format!("seccomp notification sizes: {}", io::Error::last_os_error()));
        }
        if usize::from(sizes.seccomp_notif) > size_of::<libc::seccomp_notif>()
            || usize::from(sizes.seccomp_notif_resp) > size_of::<libc::seccomp_notif_resp>()
        {
            return Err(format!(
                "the kernel's seccomp notification ({} bytes) is larger than the agent's",
                sizes.seccomp_notif
            ));
        }
        Ok(())
    });
    checked.clone().map_err(io::Error::other)
}

/// Whether notification `id` still waits (its caller is alive and it is unanswered).
fn still_waiting(fd: RawFd, id: u64) -> bool {
    // SAFETY: ID_VALID reads one u64.
    unsafe { libc::ioctl(fd, libc::SECCOMP_IOCTL_NOTIF_ID_VALID, &id) == 0 }
}

/// Lets the exec go on, or fails it with `error`.
fn answer(fd: RawFd, id: u64, allow: Result<(), i32>) {
    let (error, flags) = match allow {
        Ok(()) => (0, libc::SECCOMP_USER_NOTIF_FLAG_CONTINUE as u32),
        Err(errno) => (-errno, 0),
    };
    let mut resp = libc::seccomp_notif_resp { id, val: 0, error, flags };
    // SAFETY: SEND reads one seccomp_notif_resp. ENOENT (the caller died) needs nothing.
    unsafe { libc::ioctl(fd, libc::SECCOMP_IOCTL_NOTIF_SEND, &mut resp) };
}

/// An exec as the caller asked for it.
#[derive(Debug)]
struct Exec {
    path: String,
    argv: Vec<String>,
    cwd: Option<String>,
}

async fn decide(listener: Arc<AsyncFd<OwnedFd>>, served: Arc<Served>, notif: libc::seccomp_notif) {
    let fd = listener.as_raw_fd();
    let exec = match read_exec(&notif) {
        Ok(exec) => exec,
        Err(e) => {
            // A bad pointer would fail the exec anyway; nothing unread ever runs.
            answer(fd, notif.id, Err(e.raw_os_error().unwrap_or(libc::EFAULT)));
            return;
        }
    };
    // Read first, then checked: the pid was still this caller's while we read its memory.
    if !still_waiting(fd, notif.id) {
        return;
    }
    // A program that is not there fails as the kernel would fail it, without asking anyone:
    // shells try each PATH directory in turn.
    if let Err(e) = std::fs::metadata(&exec.path) {
        answer(fd, notif.id, Err(e.raw_os_error().unwrap_or(libc::ENOENT)));
        return;
    }
    let words = exec_words(&exec.path, &exec.argv);
    tracing::debug!(?exec, "exec gate: deciding");
    let first = served.route.borrow().is_none() && exec.argv == served.approved;
    if first || served.gate.allows(&words) {
        answer(fd, notif.id, Ok(()));
        return;
    }
    if let Some(allow) = served.answered.get(notif.pid, &words) {
        answer(fd, notif.id, if allow { Ok(()) } else { Err(libc::EACCES) });
        return;
    }
    let verdict = ask_host(&listener, &served, notif.id, notif.pid, exec).await;
    served.answered.put(notif.pid, words, verdict.is_ok());
    answer(fd, notif.id, verdict);
}

/// Sends the check on the process's connection and waits for the answer; refuses when there
/// is nobody to ask. Gives up when the caller dies while it waits.
async fn ask_host(listener: &AsyncFd<OwnedFd>, served: &Served, id: u64, pid: u32, exec: Exec) -> Result<(), i32> {
    let Some((check, mut rx)) = served.checks.open() else { return Err(libc::EAGAIN) };
    let refuse = |errno| {
        served.checks.forget(check);
        Err(errno)
    };
    let route = served.route.borrow().clone();
    let route = match route {
        Some(route) => route,
        None => {
            let mut waiting = served.route.clone();
            let route = waiting.wait_for(Option::is_some).await.map(|r| r.clone());
            match route {
                Ok(Some(route)) => route,
                _ => return refuse(libc::EACCES),
            }
        }
    };
    {
        // Parked, this waits for the adoption; closed, nobody can answer.
        let Some(to) = route.current().await else { return refuse(libc::EACCES) };
        let event = Event::ExecCheck { check, pid, path: exec.path, argv: exec.argv, cwd: exec.cwd };
        if to.sink.send(json_frame(FrameKind::Event, to.id, &event).into()).await.is_err() {
            return refuse(libc::EACCES);
        }
    }
    loop {
        tokio::select! {
            answer = &mut rx => return match answer {
                Ok(true) => Ok(()),
                _ => Err(libc::EACCES),
            },
            _ = tokio::time::sleep(Duration::from_secs(1)) => {
                if !still_waiting(listener.as_raw_fd(), id) {
                    served.checks.forget(check);
                    return Err(libc::EACCES);
                }
            }
        }
    }
}

/// The path (made absolute against the caller's cwd or `execveat`'s directory), the arguments
/// (at most [`MAX_EXEC_ARGS`] and [`MAX_EXEC_BYTES`]; cut short, the last word is `…`) and the
/// cwd of an exec.
fn read_exec(notif: &libc::seccomp_notif) -> io::Result<Exec> {
    let pid = notif.pid;
    let args = notif.data.args;
    let (dirfd, path_at, argv_at, flags) = if i64::from(notif.data.nr) == libc::SYS_execveat {
        (args[0] as i32, args[1], args[2], args[4] as i32)
    } else {
        (libc::AT_FDCWD, args[0], args[1], 0)
    };
    let memory = Memory(File::open(format!("/proc/{pid}/mem"))?);
    let mut budget = MAX_EXEC_BYTES;
    let path = memory.string(path_at, &mut budget)?;
    let mut argv = Vec::new();
    if argv_at != 0 {
        for i in 0..=MAX_EXEC_ARGS as u64 {
            let at = memory.word(argv_at + 8 * i)?;
            if at == 0 {
                break;
            }
            if i as usize == MAX_EXEC_ARGS || budget == 0 {
                argv.push("…".to_string());
                break;
            }
            argv.push(memory.string(at, &mut budget)?);
        }
    }
    let link = |what: String| std::fs::read_link(format!("/proc/{pid}/{what}")).ok();
    let cwd = link("cwd".into());
    // `/proc/self` is the caller's, not ours (busybox runs its applets through
    // `/proc/self/exe`); a process's `exe` link is the program it names.
    let path = match path.strip_prefix("/proc/self/") {
        Some("exe") => link("exe".into()).map_or(path.clone(), |p| p.display().to_string()),
        Some(rest) => format!("/proc/{pid}/{rest}"),
        None => path,
    };
    let path = if path.starts_with('/') {
        path
    } else {
        let base = if dirfd == libc::AT_FDCWD { cwd.clone() } else { link(format!("fd/{dirfd}")) };
        match base {
            Some(base) if path.is_empty() && flags & libc::AT_EMPTY_PATH != 0 => base.display().to_string(),
            Some(base) => base.join(&path).display().to_string(),
            None => path,
        }
    };
    Ok(Exec { path, argv, cwd: cwd.map(|c| c.display().to_string()) })
}

/// Another process's memory, through `/proc/PID/mem`.
struct Memory(File);

const PAGE: u64 = 4096;

impl Memory {
    fn word(&self, at: u64) -> io::Result<u64> {
        let mut b = [0u8; 8];
        self.0.read_exact_at(&mut b, at)?;
        Ok(u64::from_ne_bytes(b))
    }

    /// A NUL-terminated string at `at`, read a page at a time (a string may end just before an
    /// unmapped page), at most `budget` bytes of it; invalid UTF-8 is replaced.
    fn string(&self, mut at: u64, budget: &mut usize) -> io::Result<String> {
        let mut out = Vec::new();
        loop {
            let room = (PAGE - at % PAGE).min(*budget as u64) as usize;
            if room == 0 {
                out.extend_from_slice("…".as_bytes());
                break;
            }
            let mut chunk = vec![0u8; room];
            let n = self.0.read_at(&mut chunk, at)?;
            if n == 0 {
                return Err(io::Error::from_raw_os_error(libc::EFAULT));
            }
            match chunk[..n].iter().position(|&b| b == 0) {
                Some(end) => {
                    out.extend_from_slice(&chunk[..end]);
                    *budget -= end + 1;
                    break;
                }
                None => {
                    out.extend_from_slice(&chunk[..n]);
                    *budget -= n;
                    at += n as u64;
                }
            }
        }
        Ok(String::from_utf8_lossy(&out).into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_filter_jumps_land_on_its_returns() {
        // Each conditional jump's targets are inside the program and on the right return.
        for (i, ins) in FILTER.iter().enumerate() {
            if ins.code as u32 & 0x07 == libc::BPF_JMP {
                for off in [ins.jt, ins.jf] {
                    assert!(i + 1 + (off as usize) < FILTER.len(), "instruction {i}");
                }
            }
        }
        let ret = |i: usize| FILTER[i].k;
        assert_eq!(ret(1 + 1 + FILTER[1].jf as usize), libc::SECCOMP_RET_ERRNO | libc::EPERM as u32);
        assert_eq!(ret(3 + 1 + FILTER[3].jt as usize), libc::SECCOMP_RET_ERRNO | libc::EPERM as u32);
        assert_eq!(ret(4 + 1 + FILTER[4].jt as usize), libc::SECCOMP_RET_USER_NOTIF);
        assert_eq!(ret(5 + 1 + FILTER[5].jt as usize), libc::SECCOMP_RET_USER_NOTIF);
        assert_eq!(ret(6), libc::SECCOMP_RET_ALLOW);
    }

    #[test]
    fn checks_are_answered_once_and_bounded() {
        let checks = ExecChecks::default();
        let (id, rx) = checks.open().unwrap();
        assert!(!checks.answer(id + 1, true));
        assert!(checks.answer(id, true));
        assert!(!checks.answer(id, true), "answered already");
        drop(rx);
        let held: Vec<_> = (0..MAX_WAITING_CHECKS).map(|_| checks.open().unwrap()).collect();
        assert!(checks.open().is_none());
        checks.forget(held[0].0);
        assert!(checks.open().is_some());
    }
}
