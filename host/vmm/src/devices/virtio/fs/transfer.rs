//! Moving a backend's device state through a pipe (VHOST_USER_SET_DEVICE_STATE_FD), bounded in
//! size and time: the backend holds the pipe's other end, and one that stalls, or writes without
//! end, must fail the snapshot or the restore rather than hang the thread or fill memory.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Instant;

/// A pipe, both ends close-on-exec: (read end, write end).
pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [-1; 2];
    // SAFETY: pipe2 writes two descriptors into the two-element array, or fails.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both are new descriptors that nothing else owns.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Waits until `fd` is ready for `events` or `deadline` passes.
fn wait(fd: RawFd, events: libc::c_short, deadline: Instant, what: &str) -> Result<(), String> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("the backend did not finish {what} in time"));
        }
        let mut poll = libc::pollfd { fd, events, revents: 0 };
        let timeout = libc::c_int::try_from(left.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid pollfd, for the duration of the call.
        let n = unsafe { libc::poll(&mut poll, 1, timeout) };
        match n {
            -1 if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted => continue,
            -1 => return Err(format!("waiting for the backend {what}: {}", io::Error::last_os_error())),
            0 => continue,
            // Readable, writable, or hung up / in error: the next read or write says which.
            _ => return Ok(()),
        }
    }
}

/// Reads `fd` to end-of-file: at most `max` bytes, finished by `deadline`.
pub fn read_all(fd: OwnedFd, max: usize, deadline: Instant) -> Result<Vec<u8>, String> {
    let mut file = File::from(fd);
    let mut out = Vec::new();
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        // Once readable, a read returns what is there without blocking.
        wait(file.as_raw_fd(), libc::POLLIN, deadline, "writing its state")?;
        let n = match file.read(&mut chunk) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("reading the backend's state: {e}")),
        };
        if n == 0 {
            return Ok(out);
        }
        if out.len() + n > max {
            return Err(format!("the backend's state exceeds {max} bytes"));
        }
        out.extend_from_slice(&chunk[..n]);
    }
}

/// Writes all of `data` to `fd`, finished by `deadline`, then closes it (the backend reads to
/// end-of-file).
pub fn write_all(fd: OwnedFd, mut data: &[u8], deadline: Instant) -> Result<(), String> {
    let mut file = File::from(fd);
    while !data.is_empty() {
        // Once writable, a pipe has room for at least PIPE_BUF bytes: a write that size
        // does not block.
        wait(file.as_raw_fd(), libc::POLLOUT, deadline, "reading its state")?;
        let n = data.len().min(libc::PIPE_BUF);
        match file.write(&data[..n]) {
            Ok(0) => return Err("the backend stopped reading its state".into()),
            Ok(n) => data = &data[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("sending the backend its state: {e}")),
        }
    }
    Ok(())
}
