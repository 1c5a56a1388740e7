//! The open check on a real child process: it runs under the filter, this process answers.

use std::os::fd::AsRawFd;
use std::path::Path;

use super::{filter, install_and_send, receive, start};
use crate::hide::Hider;

/// Forks a child that installs the filter, sends the listener, then runs `f`; returns the
/// child's exit code. `answer` is called with the listener in this process.
fn in_checked_child(f: impl FnOnce() -> i32, answer: impl FnOnce(std::os::fd::OwnedFd)) -> i32 {
    let program = filter();
    let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    // SAFETY: the child makes system calls and exits; the parent waits for it.
    match unsafe { libc::fork() } {
        0 => {
            // SAFETY: prctl with constant arguments; the filter outlives the call.
            unsafe {
                if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
                    || install_and_send(&program, theirs.as_raw_fd()).is_err()
                {
                    libc::_exit(99);
                }
            }
            let code = f();
            // SAFETY: _exit in the forked child.
            unsafe { libc::_exit(code) }
        }
        pid => {
            drop(theirs);
            answer(receive(&ours, 10_000).unwrap());
            let mut status = 0;
            // SAFETY: waits for our own child.
            unsafe { libc::waitpid(pid, &mut status, 0) };
            libc::WEXITSTATUS(status)
        }
    }
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn c(p: &Path) -> std::ffi::CString {
    std::ffi::CString::new(p.to_str().unwrap()).unwrap()
}

#[test]
fn opens_of_ignored_paths_are_refused_and_others_go_on() {
    let dir = std::env::temp_dir().join(format!("umbra-fsd-notify-{}", std::process::id()));
    let share = dir.join("share");
    std::fs::create_dir_all(share.join("sub")).unwrap();
    std::fs::write(share.join(".env"), "SECRET\n").unwrap();
    std::fs::write(share.join("sub/key.pem"), "SECRET\n").unwrap();
    std::fs::write(share.join("plain.txt"), "plain\n").unwrap();
    std::fs::write(dir.join("outside.env"), "outside\n").unwrap();
    let (env, pem, plain, outside) = (
        c(&share.join(".env")),
        c(&share.join("sub/key.pem")),
        c(&share.join("plain.txt")),
        c(&dir.join("outside.env")),
    );
    let (new_env, new_txt, sub) = (c(&share.join("sub/.env")), c(&share.join("sub/new.txt")), c(&share.join("sub")));
    let dotdot = c(&share.join("sub/../.env"));
    let code = in_checked_child(
        || {
            // SAFETY: plain system calls on NUL-terminated paths and our own descriptors.
            unsafe {
                let refused = |fd: i32| fd < 0 && errno() == libc::EACCES;
                if !refused(libc::open(env.as_ptr(), libc::O_RDONLY)) {
                    return 1;
                }
                if !refused(libc::openat(libc::AT_FDCWD, pem.as_ptr(), libc::O_RDWR)) {
                    return 2;
                }
                // Through a directory descriptor, as virtiofsd creates a name.
                let dirfd = libc::open(sub.as_ptr(), libc::O_PATH | libc::O_DIRECTORY);
                if dirfd < 0 || !refused(libc::openat(dirfd, c".env".as_ptr(), libc::O_CREAT | libc::O_WRONLY, 0o644)) {
                    return 3;
                }
                if libc::access(new_env.as_ptr(), libc::F_OK) == 0 {
                    return 4;
                }
                let made = libc::openat(dirfd, c"new.txt".as_ptr(), libc::O_CREAT | libc::O_WRONLY, 0o644);
                if made < 0 || libc::access(new_txt.as_ptr(), libc::F_OK) != 0 {
                    return 5;
                }
                // Reopening an O_PATH descriptor through /proc/self/fd, as virtiofsd opens files.
                let path_fd = libc::open(env.as_ptr(), libc::O_PATH);
                let procfd = libc::open(c"/proc/self/fd".as_ptr(), libc::O_PATH | libc::O_DIRECTORY);
                if path_fd < 0 || procfd < 0 {
                    return 6;
                }
                // At fixed numbers, named before the fork: the child of a threaded test
                // harness must not allocate.
                if libc::dup2(path_fd, 200) != 200 || !refused(libc::openat(procfd, c"200".as_ptr(), libc::O_RDONLY)) {
                    return 7;
                }
                let plain_path = libc::open(plain.as_ptr(), libc::O_PATH);
                if libc::dup2(plain_path, 201) != 201 || libc::openat(procfd, c"201".as_ptr(), libc::O_RDONLY) < 0 {
                    return 8;
                }
                if libc::open(plain.as_ptr(), libc::O_RDONLY) < 0 || libc::open(outside.as_ptr(), libc::O_RDONLY) < 0 {
                    return 9;
                }
                if !refused(libc::open(dotdot.as_ptr(), libc::O_RDONLY)) {
                    return 10;
                }
                let how = [libc::O_RDONLY as u64, 0u64, 0u64];
                if libc::syscall(libc::SYS_openat2, libc::AT_FDCWD, plain.as_ptr(), how.as_ptr(), 24) >= 0
                    || errno() != libc::EPERM
                {
                    return 11;
                }
            }
            0
        },
        |listener| {
            let (hider, rules) = Hider::notified();
            let set = umbra_policy::IgnoreSet::new(&share, &[".env".to_string(), "*.pem".to_string()]).unwrap();
            hider.hide(&share, set, &[]).unwrap();
            start(listener, rules).unwrap();
            // The thread and the hider live on: the thread answers until the child is done.
            std::mem::forget(hider);
        },
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(code, 0, "step {code} of the child failed");
}
