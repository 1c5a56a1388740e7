//! Advisory file locks (flock). flock, not fcntl locks: it belongs to the open file description,
//! so two threads of one process that each open the lock file exclude each other just as two
//! processes do, and the kernel drops it when the holder dies — a killed pull never wedges the
//! next one.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::Path;

use crate::{io_err, BundleError};

/// Held until dropped (the file is closed).
#[derive(Debug)]
pub struct Lock(#[allow(dead_code)] File);

fn open(path: &Path) -> Result<File, BundleError> {
    OpenOptions::new().create(true).truncate(false).write(true).open(path).map_err(io_err("cannot create lock", path))
}

/// Blocks until the exclusive lock is ours.
pub fn exclusive(path: &Path) -> Result<Lock, BundleError> {
    let f = open(path)?;
    loop {
        // SAFETY: flock on an fd we own; no memory is passed.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0 {
            return Ok(Lock(f));
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(io_err("cannot lock", path)(e));
        }
    }
}

/// The exclusive lock if nobody holds it, else None.
pub fn try_exclusive(path: &Path) -> Result<Option<Lock>, BundleError> {
    let f = open(path)?;
    // SAFETY: flock on an fd we own; no memory is passed.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(Some(Lock(f)));
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EWOULDBLOCK) | Some(libc::EINTR) => Ok(None),
        _ => Err(io_err("cannot lock", path)(e)),
    }
}
