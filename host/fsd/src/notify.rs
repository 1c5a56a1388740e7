//! Hidden files without root: virtiofsd's opens checked through seccomp user notification.
//!
//! fanotify's permission events (`hide.rs`) need `CAP_SYS_ADMIN` in the initial user
//! namespace. Without it, virtiofsd starts under one more seccomp filter, installed between
//! fork and exec: every `open` and `openat` that could read or write a file (any
//! without `O_PATH`) stops in the kernel and waits for this process's answer; `creat`, `openat2`,
//! `open_by_handle_at`, `io_uring_setup` and the x32 system calls are refused outright
//! (virtiofsd's start-up falls back from `openat2` by itself; the no-privilege filter refuses it
//! already). The answering thread resolves what the call would open — from virtiofsd's own
//! directory descriptor, read through `/proc/<pid>/fd`, with the same `O_NOFOLLOW` and
//! `O_DIRECTORY` — with an `O_PATH` open of its own, and matches the path of what it found
//! against the shares' patterns, as the fanotify answer does with the file being opened. A
//! match, or anything it cannot tell, is refused with `EACCES`; anything else continues.
//!
//! The check and virtiofsd's own open are two resolutions, not one; what can change between
//! them is what a guest can rename, and renaming an ignored entry present at the start is
//! refused by its pin (`pins.rs`), as with fanotify. virtiofsd's non-`O_PATH` opens are reopens
//! of an inode it holds (`/proc/self/fd/N`, one fixed inode) and creations of one name; a path
//! with a `..` component is refused, so the resolution never depends on virtiofsd's chroot.

use std::ffi::{CString, OsStr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::hide::{describe, refused, Rules};

// The notification ioctls (linux/seccomp.h): _IOWR('!', 0, struct seccomp_notif),
// _IOWR('!', 1, struct seccomp_notif_resp), _IOW('!', 2, __u64).
const NOTIF_RECV: libc::c_ulong = 0xc050_2100;
const NOTIF_SEND: libc::c_ulong = 0xc018_2101;
const NOTIF_ID_VALID: libc::c_ulong = 0x4008_2102;

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xc000_003e;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xc000_00b7;
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// Where a filter instruction jumps: ahead by a count, or to one of the returns at the end.
#[derive(Clone, Copy, PartialEq)]
enum To {
    Skip(u8),
    Allow,
    Notify,
    Refuse,
    Kill,
}

/// The notifying filter as classic BPF.
pub struct Filter(Vec<libc::sock_filter>);

/// Builds the filter (before the fork: the child may not allocate).
pub fn filter() -> Filter {
    const LD_W_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
    const JEQ: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
    const JGE: u16 = (libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K) as u16;
    const JSET: u16 = (libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K) as u16;
    const RET: u16 = (libc::BPF_RET | libc::BPF_K) as u16;
    const NEXT: To = To::Skip(0);
    // struct seccomp_data: nr at 0, arch at 4, args at 16 (8 bytes each; low word first on
    // these little-endian machines).
    let arg_low = |i: u32| 16 + 8 * i;
    let mut code: Vec<(u16, To, To, u32)> = vec![
        (LD_W_ABS, NEXT, NEXT, 4),
        (JEQ, NEXT, To::Kill, AUDIT_ARCH),
        (LD_W_ABS, NEXT, NEXT, 0),
        (JGE, To::Refuse, NEXT, X32_SYSCALL_BIT),
    ];
    #[allow(unused_mut)]
    let mut refused = vec![libc::SYS_openat2, libc::SYS_open_by_handle_at, libc::SYS_io_uring_setup];
    #[allow(unused_mut)]
    let mut checked = vec![(libc::SYS_openat, 2)];
    #[cfg(target_arch = "x86_64")]
    {
        checked.push((libc::SYS_open, 1));
        refused.push(libc::SYS_creat);
    }
    for nr in refused {
        code.push((JEQ, To::Refuse, NEXT, nr as u32));
    }
    // Per checked call: not this call, skip its test; an O_PATH open goes on (it reads and
    // writes nothing), any other is asked about.
    for (nr, flags_arg) in checked {
        code.push((JEQ, NEXT, To::Skip(2), nr as u32));
        code.push((LD_W_ABS, NEXT, NEXT, arg_low(flags_arg)));
        code.push((JSET, To::Allow, To::Notify, libc::O_PATH as u32));
    }
    // Anything else falls through to the first return: allowed.
    let ends = [
        (To::Allow, libc::SECCOMP_RET_ALLOW),
        (To::Notify, libc::SECCOMP_RET_USER_NOTIF),
        (To::Refuse, libc::SECCOMP_RET_ERRNO | libc::EPERM as u32),
        (To::Kill, libc::SECCOMP_RET_KILL_PROCESS),
    ];
    let body = code.len();
    let offset = |to: To, pc: usize| -> u8 {
        match to {
            To::Skip(n) => n,
            end => {
                let at = body + ends.iter().position(|(t, _)| *t == end).expect("an end");
                u8::try_from(at - pc - 1).expect("a short filter")
            }
        }
    };
    let mut program: Vec<libc::sock_filter> = code
        .iter()
        .enumerate()
        .map(|(pc, (op, jt, jf, k))| libc::sock_filter { code: *op, jt: offset(*jt, pc), jf: offset(*jf, pc), k: *k })
        .collect();
    program.extend(ends.iter().map(|(_, ret)| libc::sock_filter { code: RET, jt: 0, jf: 0, k: *ret }));
    Filter(program)
}

/// Installs `filter` on the calling thread and sends its listener over `socket`. Only
/// async-signal-safe calls: it runs between fork and exec, after `no_new_privs`.
///
/// # Safety
/// Between fork and exec only; `socket` is an open `AF_UNIX` socket.
pub unsafe fn install_and_send(filter: &Filter, socket: RawFd) -> std::io::Result<()> {
    let prog = libc::sock_fprog { len: filter.0.len() as u16, filter: filter.0.as_ptr() as *mut libc::sock_filter };
    // SAFETY: `prog` points at `filter`'s instructions, which outlive the call (the kernel copies
    // them); the flag asks for a listener descriptor as the result.
    let listener = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            libc::SECCOMP_FILTER_FLAG_NEW_LISTENER,
            &prog as *const libc::sock_fprog,
        )
    };
    if listener < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let listener = listener as RawFd;
    // SAFETY: a message with one SCM_RIGHTS descriptor, built in local buffers; sendmsg and
    // close are async-signal-safe.
    unsafe {
        let mut byte = [0u8; 1];
        let mut iov = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 };
        let mut space = [0u64; 4];
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = space.as_mut_ptr().cast();
        msg.msg_controllen = libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) as usize;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), listener);
        let sent = libc::sendmsg(socket, &msg, libc::MSG_NOSIGNAL);
        let error = std::io::Error::last_os_error();
        libc::close(listener);
        if sent != 1 {
            return Err(error);
        }
    }
    Ok(())
}

/// Receives the listener the child sent (waiting up to `timeout_ms`).
pub fn receive(socket: &impl AsRawFd, timeout_ms: i32) -> Result<OwnedFd, String> {
    let mut poll = libc::pollfd { fd: socket.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    if unsafe { libc::poll(&mut poll, 1, timeout_ms) } != 1 {
        return Err("virtiofsd's open check was not set up (no listener from the child)".into());
    }
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 };
    let mut space = [0u64; 4];
    // SAFETY: an all-zero msghdr is valid; its pointers are set to local buffers below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = space.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&space);
    // SAFETY: msg's buffers are valid for the sizes given; the kernel fills them.
    let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n != 1 {
        return Err(format!("virtiofsd's open check: no listener ({})", std::io::Error::last_os_error()));
    }
    // SAFETY: the kernel wrote msg_controllen bytes of control messages into `space`.
    let cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    // SAFETY: a non-null header lies within `space`.
    if cmsg.is_null() || unsafe { (*cmsg).cmsg_level != libc::SOL_SOCKET || (*cmsg).cmsg_type != libc::SCM_RIGHTS } {
        return Err("virtiofsd's open check: the child sent no descriptor".into());
    }
    // SAFETY: an SCM_RIGHTS message carries at least one descriptor, now ours.
    let fd = unsafe { std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>()) };
    // SAFETY: a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Starts the thread that answers `listener`'s notifications with `rules`; returns once it
/// runs (before umbra-fsd's own filter, which allows no new thread).
pub fn start(listener: OwnedFd, rules: Rules) -> Result<(), String> {
    let (running_tx, running) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("open-check".into())
        .spawn(move || {
            let _ = running_tx.send(());
            answer_loop(&listener, &rules);
        })
        .map_err(|e| format!("cannot start the open-check thread: {e}"))?;
    running.recv().map_err(|_| "the open-check thread died at start".to_string())
}

fn answer_loop(listener: &OwnedFd, rules: &Rules) {
    loop {
        // SAFETY: an all-zero seccomp_notif is the required input of NOTIF_RECV.
        let mut req: libc::seccomp_notif = unsafe { std::mem::zeroed() };
        // SAFETY: `req` is a valid out buffer of the size the ioctl number encodes.
        if unsafe { libc::ioctl(listener.as_raw_fd(), NOTIF_RECV, &mut req) } != 0 {
            match std::io::Error::last_os_error().raw_os_error() {
                // Interrupted, or the caller died before we read its call.
                Some(libc::EINTR) | Some(libc::ENOENT) => continue,
                _ => {
                    // Opens would wait forever: better to end (virtiofsd goes with us).
                    eprintln!("umbra-fsd: reading open checks failed: {}", std::io::Error::last_os_error());
                    std::process::abort();
                }
            }
        }
        let answer = decide(listener, &req, rules);
        let resp = libc::seccomp_notif_resp {
            id: req.id,
            val: 0,
            error: answer.err().map_or(0, |e| -e),
            flags: if answer.is_ok() { libc::SECCOMP_USER_NOTIF_FLAG_CONTINUE as u32 } else { 0 },
        };
        // SAFETY: `resp` is a valid seccomp_notif_resp; ENOENT (the caller was killed
        // meanwhile) needs nothing more.
        unsafe { libc::ioctl(listener.as_raw_fd(), NOTIF_SEND, &resp) };
    }
}

/// `Ok`: the call goes on; `Err(errno)`: it fails with that error.
fn decide(listener: &OwnedFd, req: &libc::seccomp_notif, rules: &Rules) -> Result<(), i32> {
    if rules.lock().unwrap().is_empty() {
        return Ok(());
    }
    let args = req.data.args;
    let (dirfd, path_at, flags) = match i64::from(req.data.nr) {
        libc::SYS_openat => (args[0] as i32, args[1], args[2] as i32),
        #[cfg(target_arch = "x86_64")]
        libc::SYS_open => (libc::AT_FDCWD, args[0], args[1] as i32),
        _ => return Err(libc::EPERM),
    };
    if flags & libc::O_PATH != 0 {
        return Ok(());
    }
    let pid = req.pid;
    let path = read_path(pid, path_at)?;
    // The memory read was the caller's: its pid still names the task waiting in this call.
    let id = req.id;
    // SAFETY: `id` is a valid u64 the ioctl reads.
    if unsafe { libc::ioctl(listener.as_raw_fd(), NOTIF_ID_VALID, &id) } != 0 {
        return Err(libc::EACCES);
    }
    let path = Path::new(OsStr::from_bytes(&path));
    if path.components().any(|c| c == std::path::Component::ParentDir) {
        return Err(libc::EACCES);
    }
    let base = match (path.is_absolute(), dirfd) {
        (true, _) => format!("/proc/{pid}/root"),
        (false, libc::AT_FDCWD) => format!("/proc/{pid}/cwd"),
        (false, fd) => format!("/proc/{pid}/fd/{fd}"),
    };
    let base = open_path(libc::AT_FDCWD, Path::new(&base), 0).map_err(|_| libc::EACCES)?;
    let rel = match path.strip_prefix("/") {
        Ok(r) if r.as_os_str().is_empty() => Path::new("."),
        Ok(r) => r,
        Err(_) => path,
    };
    let follow = flags & (libc::O_NOFOLLOW | libc::O_DIRECTORY);
    match open_path(base.as_raw_fd(), rel, follow) {
        Ok(found) => {
            let (at, is_dir) = describe(&found).ok_or(libc::EACCES)?;
            match refused(rules, &at, is_dir) {
                true => Err(libc::EACCES),
                false => Ok(()),
            }
        }
        Err(libc::ENOENT) if flags & libc::O_CREAT != 0 => {
            // A file this call would create: its name is checked.
            let (dir, _) = describe(&base).ok_or(libc::EACCES)?;
            match refused(rules, &dir.join(rel), false) {
                true => Err(libc::EACCES),
                false => Ok(()),
            }
        }
        Err(errno) => Err(errno),
    }
}

/// `O_PATH` open of `path` relative to `dir` (extra flags from `O_NOFOLLOW`/`O_DIRECTORY`).
fn open_path(dir: RawFd, path: &Path, extra: i32) -> Result<OwnedFd, i32> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| libc::EINVAL)?;
    // SAFETY: `c` is NUL-terminated; openat returns a new descriptor or -1.
    let fd = unsafe { libc::openat(dir, c.as_ptr(), libc::O_PATH | libc::O_CLOEXEC | extra) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EACCES));
    }
    // SAFETY: a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The NUL-terminated path at `at` in process `pid` (at most `PATH_MAX` bytes), read page by
/// page so a string ending near unmapped memory is still read.
fn read_path(pid: u32, at: u64) -> Result<Vec<u8>, i32> {
    const PAGE: u64 = 4096;
    let mut out = Vec::new();
    let mut addr = at;
    while out.len() < libc::PATH_MAX as usize {
        let chunk = (PAGE - addr % PAGE) as usize;
        let mut buf = vec![0u8; chunk];
        let local = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: chunk };
        let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: chunk };
        // SAFETY: `local` is a valid buffer of `chunk` bytes; the remote range is only read by
        // the kernel, which checks it.
        let n = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
        if n <= 0 {
            return Err(libc::EFAULT);
        }
        let n = n as usize;
        if let Some(end) = buf[..n].iter().position(|b| *b == 0) {
            out.extend_from_slice(&buf[..end]);
            return Ok(out);
        }
        out.extend_from_slice(&buf[..n]);
        addr += n as u64;
    }
    Err(libc::ENAMETOOLONG)
}

#[cfg(test)]
mod tests;
