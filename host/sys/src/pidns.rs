//! Starting a program as pid 1 of its own pid namespace, between fork and exec.
//!
//! `unshare(CLONE_NEWPID)` applies to the caller's children only, so the forked process splits
//! once more: the child goes on to exec as pid 1 of the new namespace (it sees no other
//! process, and none outside can be named by it); the parent — the relay — closes every
//! descriptor, waits, and exits as the child did. Killing the relay kills the child
//! (`PR_SET_PDEATHSIG`), and both stay in the process group the spawner kills.

use std::io;

/// Forks after an `unshare(CLONE_NEWPID)`: returns `Ok` in the child, which is pid 1 of the new
/// namespace and about to exec; the relay never returns. `spawner` is the pid of the process
/// that forked the caller: if it is gone by the time the relay has asked for its death signal,
/// nothing would ever send it, so both end.
///
/// # Safety
/// Only between fork and exec (it forks again and makes only async-signal-safe calls), after
/// `unshare(CLONE_NEWPID)`.
pub unsafe fn split(spawner: libc::pid_t) -> io::Result<()> {
    // SAFETY: system calls on local buffers; both sides of the fork make only
    // async-signal-safe calls.
    unsafe {
        // The relay holds the write end while it lives: the child, once it has asked for the
        // death signal, sees from the read end whether the relay died before that.
        let mut alive = [0; 2];
        if libc::pipe2(alive.as_mut_ptr(), libc::O_CLOEXEC) != 0 {
            return Err(io::Error::last_os_error());
        }
        match libc::fork() {
            -1 => Err(io::Error::last_os_error()),
            0 => {
                libc::close(alive[1]);
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
                let mut poll = libc::pollfd { fd: alive[0], events: libc::POLLIN, revents: 0 };
                if libc::poll(&mut poll, 1, 0) != 0 {
                    libc::_exit(1);
                }
                libc::close(alive[0]);
                Ok(())
            }
            child => relay(spawner, child, alive[1]),
        }
    }
}

/// The relay: holds nothing but `alive`, waits for `child` and ends as it did.
///
/// # Safety
/// Only in the process that forked `child`, which never execs.
unsafe fn relay(spawner: libc::pid_t, child: libc::pid_t, alive: libc::c_int) -> ! {
    // SAFETY: async-signal-safe calls only; `_exit` and `kill` end the process.
    unsafe {
        // The spawner's descriptors (close-on-exec, but this process never execs), among them
        // Rust's exec-status pipe, whose reader waits for every copy to close.
        if alive > 0 {
            libc::syscall(libc::SYS_close_range, 0, (alive - 1) as libc::c_uint, 0);
        }
        libc::syscall(libc::SYS_close_range, (alive + 1) as libc::c_uint, libc::c_uint::MAX, 0);
        // A change of user since the spawner asked for it (a jail's) cleared the death signal.
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
        if libc::getppid() != spawner {
            libc::kill(child, libc::SIGKILL);
            libc::_exit(1);
        }
        libc::prctl(libc::PR_SET_NAME, c"umbra-relay".as_ptr(), 0, 0, 0);
        let mut status = 0;
        loop {
            let r = libc::waitpid(child, &mut status, 0);
            if r == child {
                break;
            }
            if r < 0 && *libc::__errno_location() != libc::EINTR {
                libc::_exit(127);
            }
        }
        if libc::WIFSIGNALED(status) {
            let sig = libc::WTERMSIG(status);
            libc::signal(sig, libc::SIG_DFL);
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, sig);
            libc::sigprocmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
            libc::kill(libc::getpid(), sig);
        }
        libc::_exit(if libc::WIFEXITED(status) { libc::WEXITSTATUS(status) } else { 127 })
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    use std::process::{Command, Stdio};

    /// `sh -c script` set up to run as pid 1 of a new pid namespace; `None` unless root
    /// (unprivileged, the namespace needs a user namespace first).
    fn in_own_namespace(script: &str) -> Option<Command> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return None;
        }
        let mut cmd = Command::new("sh");
        cmd.args(["-c", script]).stdout(Stdio::piped());
        // SAFETY: getpid before the fork; unshare and `split` are made for this place.
        unsafe {
            let me = libc::getpid();
            cmd.pre_exec(move || {
                if libc::unshare(libc::CLONE_NEWPID) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                super::split(me)
            });
        }
        Some(cmd)
    }

    #[test]
    fn the_program_is_pid_one_and_its_exit_is_the_relays() {
        let Some(mut cmd) = in_own_namespace("echo $$; exit 5") else { return };
        let out = cmd.output().unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "1\n");
        assert_eq!(out.status.code(), Some(5));
    }

    #[test]
    fn killing_the_relay_kills_the_program() {
        let Some(mut cmd) = in_own_namespace("echo up; exec sleep 60") else { return };
        let mut relay = cmd.spawn().unwrap();
        let mut stdout = relay.stdout.take().unwrap();
        let mut line = [0u8; 3];
        stdout.read_exact(&mut line).unwrap();
        // SAFETY: a signal to our own unreaped child.
        unsafe { libc::kill(relay.id() as i32, libc::SIGTERM) };
        assert_eq!(relay.wait().unwrap().signal(), Some(libc::SIGTERM));
        // The pipe ends only when `sleep`, its last writer, is gone: well before its 60 s.
        let started = std::time::Instant::now();
        let mut rest = Vec::new();
        stdout.read_to_end(&mut rest).unwrap();
        assert!(started.elapsed() < std::time::Duration::from_secs(30), "sleep outlived its relay");
    }
}
