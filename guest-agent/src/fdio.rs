//! Async reads and writes on raw pipe and pseudo-terminal fds.
//!
//! Child stdio is either a pipe or a PTY master; `tokio::fs::File` would use blocking threads
//! and `tokio::net::unix::pipe` refuses PTYs, so both go through one `AsyncFd` wrapper.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

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

    /// Reads into `buf`; `Ok(0)` is end of stream.
    pub async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let mut guard = self.fd.readable().await?;
            match guard.try_io(|fd| nix::unistd::read(fd.get_ref().as_fd(), buf).map_err(io::Error::from)) {
                Ok(Err(e)) if self.pty && e.raw_os_error() == Some(libc::EIO) => return Ok(0),
                Ok(result) => return result,
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
