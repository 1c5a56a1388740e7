//! Async reads and writes on raw pipe and pseudo-terminal fds.
//!
//! Child stdio is either a pipe or a PTY master; `tokio::fs::File` would use blocking threads
//! and `tokio::net::unix::pipe` refuses PTYs, so both go through one `AsyncFd` wrapper.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use bytes::BytesMut;
use nix::fcntl::{fcntl, FcntlArg, OFlag};
use tokio::io::unix::AsyncFd;

pub struct FdIo {
    fd: AsyncFd<OwnedFd>,
    /// PTY masters report EIO once the last slave fd closes; that is end of stream.
    pty: bool,
}

impl FdIo {
    pub fn new(fd: OwnedFd, pty: bool) -> io::Result<Self> {
        let flags = OFlag::from_bits_truncate(fcntl(&fd, FcntlArg::F_GETFL)?);
        fcntl(&fd, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK))?;
        // SAFETY: `fd` is an open OwnedFd that the AsyncFd takes ownership of, so it stays open
        // and keeps referring to the same file description until the AsyncFd is dropped.
        let fd = unsafe { AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)?;
        Ok(Self { fd, pty })
    }

    /// Reads at most `max` bytes into the spare capacity of `dst` (reserving it first), without
    /// zeroing it beforehand: the output pump's read straight into the frame it will send.
    /// `Ok(0)` is end of stream.
    pub async fn read_buf(&self, dst: &mut BytesMut, max: usize) -> io::Result<usize> {
        dst.reserve(max);
        loop {
            let mut guard = self.fd.readable().await?;
            let spare = dst.spare_capacity_mut();
            let len = spare.len().min(max);
            let ptr = spare.as_mut_ptr().cast::<libc::c_void>();
            let read = guard.try_io(|fd| {
                // SAFETY: `ptr` points to `len` bytes of `dst`'s spare capacity, which `dst` owns
                // and nothing else references during the call; read(2) writes at most `len`.
                let n = unsafe { libc::read(fd.get_ref().as_raw_fd(), ptr, len) };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match read {
                Ok(Ok(n)) => {
                    // SAFETY: read(2) initialised the first `n` (≤ len) spare bytes.
                    unsafe { dst.set_len(dst.len() + n) };
                    return Ok(n);
                }
                Ok(Err(e)) if self.pty && e.raw_os_error() == Some(libc::EIO) => return Ok(0),
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }

    /// Writes all of `buf`.
    pub async fn write_all(&self, mut buf: &[u8]) -> io::Result<()> {
        while !buf.is_empty() {
            let mut guard = self.fd.writable().await?;
            match guard.try_io(|fd| nix::unistd::write(fd.get_ref(), buf).map_err(io::Error::from)) {
                Ok(Ok(n)) => buf = &buf[n..],
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
        Ok(())
    }

    pub fn raw_fd(&self) -> i32 {
        self.fd.get_ref().as_raw_fd()
    }
}
