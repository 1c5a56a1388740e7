//! The host side of the hybrid vsock (Firecracker's protocol, also spoken by vhost-device-vsock):
//! one listening Unix socket at `uds_path` for host-initiated connections, which announce their
//! guest port with a `CONNECT <port>\n` line, and `<uds_path>_<port>` sockets that host services
//! listen on for guest-initiated connections.
//!
//! Everything here is non-blocking, because one device thread serves every connection: the
//! CONNECT line is collected across readiness events (bounded in size and time), a guest-initiated
//! connect to a listener with a full backlog is refused rather than waited for, and writes never
//! raise SIGPIPE.

use std::ffi::OsString;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Longest CONNECT line accepted, newline included (`CONNECT 4294967295\n` is 19 bytes).
pub const MAX_CONNECT_LINE: usize = 32;

/// The listening socket at `uds_path`; the socket file is removed when it is dropped.
#[derive(Debug)]
pub struct HostListener {
    listener: UnixListener,
    path: PathBuf,
}

impl HostListener {
    /// Binds `path` (which must not exist) and makes the listener non-blocking.
    pub fn bind(path: &Path) -> io::Result<Self> {
        let listener = UnixListener::bind(path)
            .map_err(|e| io::Error::new(e.kind(), format!("cannot bind the vsock socket {}: {e}", path.display())))?;
        HostListener::from_std(listener, path.to_owned())
    }

    /// A listener bound earlier, known from now on by `path` (where a jailed VMM sees it): the
    /// `<path>_<port>` sockets are looked up, and the file removed, there.
    pub fn from_std(listener: UnixListener, path: PathBuf) -> io::Result<Self> {
        listener.set_nonblocking(true)?;
        Ok(HostListener { listener, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Accepts one pending connection as a non-blocking stream; `Ok(None)` when there is none.
    pub fn accept(&self) -> io::Result<Option<UnixStream>> {
        match self.listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(true)?;
                Ok(Some(stream))
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The socket a host service listens on for guest connections to `port`: `<uds_path>_<port>`.
    pub fn port_path(&self, port: u32) -> PathBuf {
        let mut p = OsString::from(self.path.as_os_str());
        p.push(format!("_{port}"));
        PathBuf::from(p)
    }
}

impl AsRawFd for HostListener {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.listener.as_raw_fd()
    }
}

impl Drop for HostListener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Connects to a Unix stream socket without ever blocking: a listener whose backlog is full
/// answers EAGAIN, which the caller treats as a refusal (std's `connect` would wait).
pub fn connect_nonblocking(path: &Path) -> io::Result<UnixStream> {
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: `sockaddr_un` is a plain C struct of integers and a byte array; all-zero is valid.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    // Leave room for the terminating NUL that the zeroed array already provides.
    if bytes.is_empty() || bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("bad socket path {}", path.display())));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (dst, src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    // SAFETY: socket() takes no pointers; it returns a new fd or -1.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket() and nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    // SAFETY: `addr` is a valid, initialised sockaddr_un that outlives the call and `len` does not
    // exceed its size (checked above); connect() only reads it.
    let rc = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast::<libc::sockaddr>(),
            len as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(UnixStream::from(fd))
}

/// `send(2)` with MSG_NOSIGNAL: a host peer that went away yields EPIPE, never SIGPIPE.
pub fn send_nosignal(stream: &UnixStream, data: &[u8]) -> io::Result<usize> {
    // SAFETY: `data` is a live slice of `data.len()` readable bytes and the fd is owned by
    // `stream` for the duration of the call.
    let n = unsafe {
        libc::send(
            stream.as_raw_fd(),
            data.as_ptr().cast::<libc::c_void>(),
            data.len(),
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Whether the peer of `stream` closed both directions (POLLHUP) rather than only shutting down
/// its sending side (POLLRDHUP alone): after EOF this decides between telling the guest
/// SHUTDOWN(SEND) and SHUTDOWN(SEND|RCV).
pub fn peer_closed_fully(stream: &UnixStream) -> bool {
    let mut pfd = libc::pollfd { fd: stream.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 };
    // SAFETY: `pfd` is one valid pollfd for the duration of the call; the zero timeout means
    // poll() only samples the socket's state.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    n > 0 && pfd.revents & libc::POLLHUP != 0
}

/// A host connection accepted on `uds_path` that has not finished its CONNECT line.
#[derive(Debug)]
pub struct PendingConnect {
    pub stream: UnixStream,
    line: Vec<u8>,
    pub deadline: Instant,
}

/// What reading a CONNECT line produced so far.
#[derive(Debug, PartialEq, Eq)]
pub enum ConnectLine {
    /// More bytes are needed.
    Incomplete,
    /// A well-formed request for this guest port.
    Port(u32),
    /// Malformed, too long, or the host closed: drop the stream.
    Invalid,
}

impl PendingConnect {
    pub fn new(stream: UnixStream, deadline: Instant) -> Self {
        PendingConnect { stream, line: Vec::with_capacity(MAX_CONNECT_LINE), deadline }
    }

    /// Reads what is available, one byte at a time so that nothing after the newline is taken
    /// from the stream (it belongs to the guest connection).
    pub fn read_line(&mut self) -> ConnectLine {
        loop {
            if self.line.len() == MAX_CONNECT_LINE {
                return ConnectLine::Invalid;
            }
            let mut byte = [0u8];
            match self.stream.read(&mut byte) {
                Ok(0) => return ConnectLine::Invalid,
                Ok(_) if byte[0] == b'\n' => {
                    return parse_connect_line(&self.line).map_or(ConnectLine::Invalid, ConnectLine::Port);
                }
                Ok(_) => self.line.push(byte[0]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return ConnectLine::Incomplete,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return ConnectLine::Invalid,
            }
        }
    }
}

/// Parses `CONNECT <port>` (newline already stripped). Like Firecracker, the keyword is matched
/// case-insensitively and surrounding whitespace (a trailing `\r` included) is ignored; unlike it,
/// trailing words are refused.
pub fn parse_connect_line(line: &[u8]) -> Option<u32> {
    let text = std::str::from_utf8(line).ok()?;
    let mut words = text.split_ascii_whitespace();
    let keyword = words.next()?;
    let port = words.next()?;
    if !keyword.eq_ignore_ascii_case("connect") || words.next().is_some() {
        return None;
    }
    // u32::from_str accepts a leading '+'; a port is digits only.
    if !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    port.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_lines() {
        assert_eq!(parse_connect_line(b"CONNECT 1024"), Some(1024));
        assert_eq!(parse_connect_line(b"connect 52\r"), Some(52));
        assert_eq!(parse_connect_line(b"CONNECT 4294967295"), Some(u32::MAX));
        for bad in [
            &b""[..],
            b"CONNECT",
            b"CONNECT ",
            b"CONNECT x",
            b"CONNECT -1",
            b"CONNECT +1",
            b"CONNECT 4294967296",
            b"CONNECT 1 2",
            b"LISTEN 1",
            b"CONNECT\xff 1",
        ] {
            assert_eq!(parse_connect_line(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }
}
