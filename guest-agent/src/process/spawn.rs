//! Turning a [`SpawnRequest`] into a running child: environment, cwd, credentials, and stdio
//! as pipes or a pseudo-terminal. Every child leads its own session (so `kill` reaches its whole
//! process tree through the group, and a PTY can become its controlling terminal).

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use nix::fcntl::{fcntl, FcntlArg, FdFlag};
use nix::pty::{openpty, Winsize};
use umbra_proto::{SpawnRequest, TtySize};

use super::landlock::Ruleset;
use super::vfork::{self, ChildSpec};
use crate::reaper::{ChildExit, Reaper};

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The host side of a new child's stdio.
pub enum ChildStdio {
    Pipes {
        stdin: OwnedFd,
        stdout: OwnedFd,
        stderr: OwnedFd,
    },
    /// One master fd carries input and the merged output.
    Pty {
        master: OwnedFd,
    },
}

pub struct SpawnedChild {
    pub pid: u32,
    pub stdio: ChildStdio,
    pub exit: tokio::sync::oneshot::Receiver<ChildExit>,
    /// Set once the reaper has collected the child: its pid may be reused from then on.
    pub reaped: Arc<AtomicBool>,
}

/// The environment a child sees: a small fixed base and the egress proxies, then the request's
/// entries. The agent's own
/// environment is not inherited — in a guest it is the kernel's, in tests the test runner's.
pub fn child_env(req: &SpawnRequest) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    env.insert("PATH".to_string(), DEFAULT_PATH.to_string());
    let home = if req.uid.unwrap_or(0) == 0 { "/root" } else { "/" };
    env.insert("HOME".to_string(), home.to_string());
    if req.tty.is_some() {
        env.insert("TERM".to_string(), "xterm-256color".to_string());
    }
    // The egress proxies (HTTP_PROXY, ALL_PROXY, NO_PROXY, … in both cases), when the agent
    // serves them.
    env.extend(crate::net::proxy_env().iter().cloned());
    // The session CA's bundle (SSL_CERT_FILE, NODE_EXTRA_CA_CERTS, …), once the host gave one.
    env.extend(crate::trust::trust_env());
    env.extend(req.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    env
}

pub fn winsize(size: TtySize) -> Winsize {
    Winsize { ws_row: size.rows, ws_col: size.cols, ws_xpixel: 0, ws_ypixel: 0 }
}

/// Starts the request's program (`vfork.rs`: the agent's memory is shared until the exec, not
/// copied). Errors carry the OS reason (missing binary, bad cwd, EPERM).
/// With a `landlock` ruleset, the child restricts itself with it just before exec; with a
/// `gate` socket, it then installs the exec gate's filter and sends its listener there
/// (`gate.rs`), whose server must already run: the child's own exec waits on it.
/// Blocks until the child has exec'd: call it from a blocking thread.
pub fn spawn(
    reaper: &Reaper,
    req: &SpawnRequest,
    landlock: Option<&Ruleset>,
    gate: Option<RawFd>,
) -> io::Result<SpawnedChild> {
    if req.argv.is_empty() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "argv is empty"));
    }
    if req.argv.iter().any(|a| a.contains('\0')) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "argv contains a NUL byte"));
    }
    let env = child_env(req);
    if let Some(cwd) = &req.cwd {
        // Look the directory up before forking, outside the reaper lock: on a slow or hung
        // filesystem it is this thread that waits, not every other spawn and the reaping with it.
        if !std::fs::metadata(cwd)?.is_dir() {
            return Err(io::Error::from_raw_os_error(libc::ENOTDIR));
        }
    }
    let (uid, gid) = (req.uid, req.gid);
    let cgroup = super::cgroup::procs_fd();
    // The ruleset fd is close-on-exec: open in the child until its exec, then gone.
    let landlock = landlock.map(Ruleset::raw_fd);
    // In the child, after its setsid: into the commands' cgroup while still root (moving needs
    // write access to cgroup.procs), then the requested identity, then landlock, then the exec
    // gate (last: from there on every exec waits for the agent). Only system calls: the child
    // shares the agent's memory. Credentials change through the raw syscalls, not libc's
    // wrappers, which would signal every thread of what they take for a multi-threaded process.
    let mut restrict = move || {
        if let Some(procs) = cgroup {
            super::cgroup::join(procs)?;
        }
        // SAFETY: setgid, getuid, setgroups with no groups and setuid are plain syscalls with
        // integer arguments (and a null list).
        unsafe {
            if let Some(gid) = gid {
                if libc::syscall(libc::SYS_setgid, gid) != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            if let Some(uid) = uid {
                // Root's supplementary groups must not survive into the new identity.
                if libc::syscall(libc::SYS_getuid) == 0
                    && libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) != 0
                {
                    return Err(io::Error::last_os_error());
                }
                if libc::syscall(libc::SYS_setuid, uid) != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
        }
        landlock.map_or(Ok(()), Ruleset::restrict_self)?;
        gate.map_or(Ok(()), super::gate::install)
    };
    // Reaping is paused while we spawn, so the pty fds opened here cannot leak into another
    // child started concurrently (all agent spawns go through the reaper lock).
    let (stdio, pid, registration) = reaper.spawn(|| {
        let child = |stdio: [RawFd; 3], controlling_tty: bool, restrict: &mut dyn FnMut() -> io::Result<()>| {
            let spec = ChildSpec { argv: &req.argv, env: &env, cwd: req.cwd.as_deref(), stdio, controlling_tty };
            vfork::spawn(&spec, restrict)
        };
        if let Some(size) = req.tty {
            let pty = openpty(Some(&winsize(size)), None).map_err(io::Error::from)?;
            fcntl(&pty.master, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))?;
            fcntl(&pty.slave, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))?;
            let slave = pty.slave.as_raw_fd();
            let pid = child([slave; 3], true, &mut restrict)?;
            // Our copy of the slave closes here, so the master reports EIO exactly when the
            // child side is gone.
            drop(pty.slave);
            Ok((ChildStdio::Pty { master: pty.master }, pid))
        } else {
            let (stdin_child, stdin) = pipe()?;
            let (stdout, stdout_child) = pipe()?;
            let (stderr, stderr_child) = pipe()?;
            let stdio = [stdin_child.as_raw_fd(), stdout_child.as_raw_fd(), stderr_child.as_raw_fd()];
            let pid = child(stdio, false, &mut restrict)?;
            // The child's ends close here: its exit is end of file on ours.
            drop((stdin_child, stdout_child, stderr_child));
            for out in [&stdout, &stderr] {
                grow_pipe(out);
            }
            Ok((ChildStdio::Pipes { stdin, stdout, stderr }, pid))
        }
    })?;
    Ok(SpawnedChild { pid, stdio, exit: registration.exit, reaped: registration.reaped })
}

/// A close-on-exec pipe: (read end, write end).
fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors are new and ours alone.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Output pipes of OUTPUT_PIPE_SIZE, not the default 64 KiB: a fast producer then writes in
/// larger batches and is switched out less often. Best effort (the limit is
/// /proc/sys/fs/pipe-max-size for unprivileged callers; the agent is root in the guest).
const OUTPUT_PIPE_SIZE: libc::c_int = 1 << 20;

fn grow_pipe(fd: &OwnedFd) {
    // SAFETY: F_SETPIPE_SZ takes an int argument and changes only the pipe's capacity.
    unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETPIPE_SZ, OUTPUT_PIPE_SIZE) };
}

/// Sets a PTY's window size; the kernel delivers SIGWINCH to the foreground group.
pub fn resize(master: &impl AsRawFd, size: TtySize) -> io::Result<()> {
    let ws = winsize(size);
    // SAFETY: TIOCSWINSZ reads one `struct winsize` from the pointer, which is valid for the call.
    let rc = unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &ws as *const Winsize) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_env_overrides_the_base_and_tty_sets_term() {
        let mut req = SpawnRequest { argv: vec!["x".into()], ..Default::default() };
        req.env.insert("PATH".into(), "/opt/bin".into());
        req.env.insert("FOO".into(), "bar".into());
        let env = child_env(&req);
        assert_eq!(env["PATH"], "/opt/bin");
        assert_eq!(env["FOO"], "bar");
        assert_eq!(env["HOME"], "/root");
        assert!(!env.contains_key("TERM"));
        req.tty = Some(TtySize { rows: 24, cols: 80 });
        req.uid = Some(1000);
        let env = child_env(&req);
        assert_eq!(env["TERM"], "xterm-256color");
        assert_eq!(env["HOME"], "/");
    }
}
