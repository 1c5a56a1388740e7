//! Turning a [`SpawnRequest`] into a running child: environment, cwd, credentials, and stdio
//! as pipes or a pseudo-terminal. Every child leads its own session (so `kill` reaches its whole
//! process tree through the group, and a PTY can become its controlling terminal).

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use nix::fcntl::{fcntl, FcntlArg, FdFlag};
use nix::pty::{openpty, Winsize};
use umbra_proto::{SpawnRequest, TtySize};

use super::landlock::Ruleset;
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

/// Forks and execs the request. Errors carry the OS reason (missing binary, bad cwd, EPERM).
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
    let Some(program) = req.argv.first() else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "argv is empty"));
    };
    if req.argv.iter().any(|a| a.contains('\0')) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "argv contains a NUL byte"));
    }
    let mut cmd = Command::new(program);
    cmd.args(&req.argv[1..]).env_clear().envs(child_env(req));
    if let Some(cwd) = &req.cwd {
        // Look the directory up before forking, outside the reaper lock: on a slow or hung
        // filesystem it is this thread that waits, not every other spawn and the reaping with it.
        if !std::fs::metadata(cwd)?.is_dir() {
            return Err(io::Error::from_raw_os_error(libc::ENOTDIR));
        }
        cmd.current_dir(cwd);
    }
    let (uid, gid) = (req.uid, req.gid);
    let cgroup = super::cgroup::procs_fd();
    let tty = req.tty;
    // The ruleset fd is close-on-exec: open in the child until its exec, then gone.
    let landlock = landlock.map(Ruleset::raw_fd);
    // In the child: into the commands' cgroup while still root (moving needs write access to
    // cgroup.procs), then the requested identity (as std's `Command::uid`/`gid` would, which
    // run before any pre_exec hook), then landlock, then the exec gate (last: from there on
    // every exec waits for the agent).
    let restrict = move || {
        if let Some(procs) = cgroup {
            super::cgroup::join(procs)?;
        }
        // SAFETY: setgid, getuid, setgroups with no groups and setuid are async-signal-safe.
        unsafe {
            if let Some(gid) = gid {
                if libc::setgid(gid) != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            if let Some(uid) = uid {
                if libc::getuid() == 0 {
                    libc::setgroups(0, std::ptr::null());
                }
                if libc::setuid(uid) != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
        }
        landlock.map_or(Ok(()), Ruleset::restrict_self)?;
        gate.map_or(Ok(()), super::gate::install)
    };
    // Reaping is paused while we fork, so the pty fds opened here cannot leak into another
    // child forked concurrently (all agent forks go through the reaper lock).
    let (stdio, pid, registration) = reaper.spawn(|| {
        if let Some(size) = tty {
            let pty = openpty(Some(&winsize(size)), None).map_err(io::Error::from)?;
            fcntl(&pty.master, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))?;
            fcntl(&pty.slave, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))?;
            cmd.stdin(Stdio::from(pty.slave.try_clone()?))
                .stdout(Stdio::from(pty.slave.try_clone()?))
                .stderr(Stdio::from(pty.slave.try_clone()?));
            // SAFETY: between fork and exec we only call async-signal-safe functions
            // (setsid, ioctl, write, the credential calls, the landlock and seccomp syscalls, sendmsg,
            // close and prctl)
            // and touch no heap state.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::setsid() < 0 {
                        return Err(io::Error::last_os_error());
                    }
                    if libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                        return Err(io::Error::last_os_error());
                    }
                    restrict()
                });
            }
            let child = cmd.spawn()?;
            // Our copy of the slave closes here (and the Stdio copies with `cmd`), so the
            // master reports EIO exactly when the child side is gone.
            drop(pty.slave);
            let pid = child.id();
            Ok((ChildStdio::Pty { master: pty.master }, pid))
        } else {
            cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
            // SAFETY: setsid, write, the credential calls, the landlock and seccomp syscalls,
            // sendmsg, close and prctl are async-signal-safe and touch no heap state.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::setsid() < 0 {
                        return Err(io::Error::last_os_error());
                    }
                    restrict()
                });
            }
            let mut child = cmd.spawn()?;
            let pid = child.id();
            let stdin = OwnedFd::from(child.stdin.take().expect("stdin piped"));
            let stdout = OwnedFd::from(child.stdout.take().expect("stdout piped"));
            let stderr = OwnedFd::from(child.stderr.take().expect("stderr piped"));
            for out in [&stdout, &stderr] {
                grow_pipe(out);
            }
            // `child` is dropped without waiting: the reaper owns its exit.
            Ok((ChildStdio::Pipes { stdin, stdout, stderr }, pid))
        }
    })?;
    Ok(SpawnedChild { pid, stdio, exit: registration.exit, reaped: registration.reaped })
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
