//! An async client over umbrad's socket: typed calls, and the notifications the daemon sends.
//!
//! One reader task routes responses to their callers and notifications into a queue. A response
//! never waits behind notifications nobody has read yet: a caller that runs `terminal.run` on a
//! terminal whose output it is not reading gets its answer (a bounded queue that stopped the
//! reader deadlocked exactly so, once a chatty terminal filled it). What bounds the queue is
//! the daemon: a process's output stops at its unacknowledged window (`process.ack` as you
//! consume), and a subscription that falls behind loses events (`events.lost`). Past
//! [`NOTIFICATION_BYTES`] unread, the reader stops reading the socket after all, and the daemon's
//! own limits take over.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot};

use crate::error::{ApiError, ErrorCode};
use crate::methods::Method;
use crate::rpc::{Id, Notification, Request, Response, ServerMessage, VERSION};

/// Notifications handed to the reader's channel; more wait in the reader task's own queue.
const NOTIFICATION_QUEUE: usize = 1024;
/// Bytes of notifications held for a reader that is not reading before the socket is left
/// unread: beyond the daemon's output windows (16 MiB outstanding per connection), so only a
/// flood of another kind stops responses.
const NOTIFICATION_BYTES: usize = 64 << 20;
/// Longest line accepted from the daemon (a 1 MiB file read is about 1.4 MiB of base64).
const MAX_LINE: usize = 8 << 20;

type Pending = Arc<Mutex<Option<HashMap<i64, oneshot::Sender<Result<Value, ApiError>>>>>>;

/// A connection to umbrad. Calls may run concurrently from clones.
#[derive(Clone)]
pub struct Client {
    writer: Arc<tokio::sync::Mutex<OwnedWriteHalf>>,
    pending: Pending,
    next_id: Arc<AtomicI64>,
    socket: PathBuf,
}

/// The notifications of one connection.
pub struct Notifications {
    rx: mpsc::Receiver<Notification>,
}

impl Notifications {
    /// The next notification; `None` once the connection is gone.
    pub async fn recv(&mut self) -> Option<Notification> {
        self.rx.recv().await
    }
}

fn unavailable(socket: &Path, e: impl std::fmt::Display) -> ApiError {
    ApiError::new(
        ErrorCode::Unavailable,
        format!(
            "umbrad is not reachable at {} ({e}); start it with `umbrad` (or `systemctl --user start umbrad`)",
            socket.display()
        ),
    )
}

/// Refuses a server that is not the user we expect, before a byte is sent to it: the socket's
/// peer credentials (`SO_PEERCRED`; `getpeereid` on macOS) name the uid that created the
/// listening socket, which no one can fake.
fn check_server(stream: &UnixStream, socket: &Path, expected: u32) -> Result<(), ApiError> {
    let cred = stream.peer_cred().map_err(|e| {
        ApiError::new(
            ErrorCode::Unauthorized,
            format!("cannot tell who serves {} ({e}); refusing to talk to it", socket.display()),
        )
    })?;
    if cred.uid() != expected {
        return Err(ApiError::new(
            ErrorCode::Unauthorized,
            format!(
                "{} is served by uid {}, not by uid {expected}: refusing to talk to it (another user's process \
                 may be posing as umbrad)",
                socket.display(),
                cred.uid()
            ),
        ));
    }
    Ok(())
}

impl Client {
    /// Connects to umbrad at `socket` (default: [`crate::paths::default_socket`]). The server
    /// must run as this process's effective uid ([`Client::connect_to_uid`] names another).
    pub async fn connect(socket: Option<&Path>) -> Result<(Self, Notifications), ApiError> {
        Self::connect_to_uid(socket, crate::paths::euid()).await
    }

    /// Connects to umbrad at `socket`, which must be served by `server_uid`: for a root client
    /// talking to a user's `umbrad --allow-root`. No uid is trusted implicitly, root included:
    /// umbrad serves only its own uid (and root, when allowed), so a root umbrad never serves
    /// another user and a root-owned socket answering one is not their daemon.
    pub async fn connect_to_uid(socket: Option<&Path>, server_uid: u32) -> Result<(Self, Notifications), ApiError> {
        let socket = socket.map(Path::to_path_buf).unwrap_or_else(crate::paths::default_socket);
        let stream = UnixStream::connect(&socket).await.map_err(|e| unavailable(&socket, e))?;
        check_server(&stream, &socket, server_uid)?;
        let (read, write) = stream.into_split();
        let pending: Pending = Arc::new(Mutex::new(Some(HashMap::new())));
        let (tx, rx) = mpsc::channel(NOTIFICATION_QUEUE);
        tokio::spawn(read_loop(BufReader::new(read), pending.clone(), tx, socket.clone()));
        let client = Self {
            writer: Arc::new(tokio::sync::Mutex::new(write)),
            pending,
            next_id: Arc::new(AtomicI64::new(1)),
            socket,
        };
        Ok((client, Notifications { rx }))
    }

    /// Whether the connection is gone (its calls fail with `unavailable`).
    pub fn is_closed(&self) -> bool {
        self.pending.lock().unwrap().is_none()
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Calls method `M` and waits for its result.
    pub async fn call<M: Method>(&self, params: M::Params) -> Result<M::Result, ApiError> {
        let value = self.call_raw(M::NAME, serde_json::to_value(params).expect("params serialize")).await?;
        serde_json::from_value(value)
            .map_err(|e| ApiError::internal(format!("umbrad answered {} with an unexpected result: {e}", M::NAME)))
    }

    /// Calls `method` with raw params.
    pub async fn call_raw(&self, method: &str, params: Value) -> Result<Value, ApiError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        match self.pending.lock().unwrap().as_mut() {
            Some(p) => p.insert(id, tx),
            None => return Err(unavailable(&self.socket, "the connection was closed")),
        };
        let request =
            Request { jsonrpc: VERSION.into(), id: Some(Id::Number(id)), method: method.into(), params: Some(params) };
        if let Err(e) = self.send_line(&request).await {
            if let Some(p) = self.pending.lock().unwrap().as_mut() {
                p.remove(&id);
            }
            return Err(e);
        }
        rx.await.unwrap_or_else(|_| Err(unavailable(&self.socket, "the connection was closed")))
    }

    /// Sends method `M` as a notification: no response comes.
    pub async fn notify<M: Method>(&self, params: M::Params) -> Result<(), ApiError> {
        let request = Request {
            jsonrpc: VERSION.into(),
            id: None,
            method: M::NAME.into(),
            params: Some(serde_json::to_value(params).expect("params serialize")),
        };
        self.send_line(&request).await
    }

    async fn send_line(&self, request: &Request) -> Result<(), ApiError> {
        let mut line = serde_json::to_vec(request).expect("requests serialize");
        line.push(b'\n');
        let mut w = self.writer.lock().await;
        w.write_all(&line).await.map_err(|e| unavailable(&self.socket, e))
    }
}

async fn read_loop(
    mut read: BufReader<tokio::net::unix::OwnedReadHalf>,
    pending: Pending,
    notifications: mpsc::Sender<Notification>,
    socket: PathBuf,
) {
    let mut line = Vec::new();
    // Notifications the channel had no room for, oldest first, with their size in bytes.
    let mut held: std::collections::VecDeque<(Notification, usize)> = Default::default();
    let mut held_bytes = 0usize;
    let why = loop {
        tokio::select! {
            // Whatever is held goes first, in order, as the reader makes room.
            permit = notifications.reserve(), if !held.is_empty() => {
                match permit {
                    Ok(permit) => {
                        let (n, size) = held.pop_front().expect("held is not empty");
                        held_bytes -= size;
                        permit.send(n);
                    }
                    // Nobody listens: drop notifications, keep serving responses.
                    Err(_) => {
                        held.clear();
                        held_bytes = 0;
                    }
                }
                continue;
            }
            // `read_until` appends what it has read to `line`, so a read interrupted by the
            // branch above resumes where it stopped; the limit counts what is already there.
            read = async {
                let room = (MAX_LINE + 1).saturating_sub(line.len()) as u64;
                tokio::io::AsyncReadExt::take(&mut read, room).read_until(b'\n', &mut line).await
            }, if held_bytes < NOTIFICATION_BYTES => match read {
                Err(e) => break e.to_string(),
                Ok(_) if line.len() > MAX_LINE => break format!("umbrad sent a line over {MAX_LINE} bytes"),
                // End of file, between lines or within one.
                Ok(_) if line.last() != Some(&b'\n') => break "umbrad closed the connection".to_string(),
                Ok(_) => {}
            },
        }
        let parsed = crate::rpc::parse_server_line(&line);
        let size = line.len();
        line.clear();
        let responses = match parsed {
            Ok(ServerMessage::Response(r)) => vec![r],
            Ok(ServerMessage::Batch(rs)) => rs,
            Ok(ServerMessage::Notification(n)) => {
                // Nobody listens: drop notifications, keep serving responses.
                if notifications.is_closed() {
                    continue;
                }
                let n = if held.is_empty() {
                    match notifications.try_send(n) {
                        Ok(()) | Err(mpsc::error::TrySendError::Closed(_)) => continue,
                        Err(mpsc::error::TrySendError::Full(n)) => n,
                    }
                } else {
                    n
                };
                held.push_back((n, size));
                held_bytes += size;
                continue;
            }
            Err(e) => break e.message,
        };
        for r in responses {
            deliver(&pending, r);
        }
    };
    let waiting = pending.lock().unwrap().take().unwrap_or_default();
    for (_, tx) in waiting {
        let _ = tx.send(Err(unavailable(&socket, &why)));
    }
    // What was read before the end is still delivered, in order.
    for (n, _) in held {
        if notifications.send(n).await.is_err() {
            break;
        }
    }
}

fn deliver(pending: &Pending, r: Response) {
    let Some(Id::Number(id)) = r.id else { return };
    let Some(tx) = pending.lock().unwrap().as_mut().and_then(|p| p.remove(&id)) else { return };
    let result = match (r.result, r.error) {
        (_, Some(e)) => Err(ApiError::from(e)),
        (Some(v), None) => Ok(v),
        (None, None) => Ok(Value::Null),
    };
    let _ = tx.send(result);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::methods::{EventsUnsubscribe, UnsubscribeParams};
    use std::io::Read;
    use std::os::fd::FromRawFd;

    #[tokio::test]
    async fn a_server_of_our_uid_is_accepted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let (client, _notes) = Client::connect(Some(&path)).await.expect("our own uid serves");
        let (mut server, _) = listener.accept().unwrap();
        client.notify::<EventsUnsubscribe>(UnsubscribeParams { subscription: 1 }).await.unwrap();
        let mut first = [0u8; 1];
        server.read_exact(&mut first).unwrap();
        assert_eq!(&first, b"{");
    }

    /// A response never waits behind notifications nobody reads: 5000 of them (the queue holds
    /// 1024) come before the answer, which arrives; then all of them, in order.
    #[tokio::test]
    async fn a_response_is_not_held_behind_unread_notifications() {
        use std::io::{BufRead, Write};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let (client, mut notes) = Client::connect(Some(&path)).await.unwrap();
        let server = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut request = String::new();
            std::io::BufReader::new(&stream).read_line(&mut request).unwrap();
            let id = serde_json::from_str::<Value>(&request).unwrap()["id"].clone();
            let mut out = std::io::BufWriter::new(&stream);
            for i in 0..5000 {
                writeln!(out, r#"{{"jsonrpc":"2.0","method":"process","params":{{"n":{i}}}}}"#).unwrap();
            }
            writeln!(out, r#"{{"jsonrpc":"2.0","id":{id},"result":{{"answered":true}}}}"#).unwrap();
            out.flush().unwrap();
            drop(out);
            stream
        });
        let answer = tokio::time::timeout(std::time::Duration::from_secs(20), client.call_raw("x", Value::Null))
            .await
            .expect("the answer came although no notification was read")
            .unwrap();
        assert_eq!(answer["answered"], true);
        drop(server.join().unwrap()); // the daemon goes: what was read is still delivered
        for i in 0..5000 {
            let n = notes.recv().await.expect("every notification, in order");
            assert_eq!(n.params["n"], i);
        }
        assert!(notes.recv().await.is_none(), "then the end");
    }

    /// A listener forked off as uid 65534 (we are root): the client must refuse it, and the
    /// listener must read end-of-file without a single byte.
    #[tokio::test]
    async fn a_server_of_another_uid_is_refused_before_a_byte_is_sent() {
        if crate::paths::euid() != 0 {
            eprintln!("skipped: listening as another uid needs root");
            return;
        }
        const NOBODY: libc::uid_t = 65534;
        let dir = tempfile::tempdir().unwrap();
        // The other user must be able to create its socket here.
        std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
        let path = dir.path().join("s.sock");
        // Everything the child needs is prepared before the fork: after it, the child makes
        // only raw system calls (async-signal-safe) and exits.
        // SAFETY: sockaddr_un is plain data; all-zero is a valid value.
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        let bytes = std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str());
        for (dst, src) in addr.sun_path.iter_mut().zip(bytes) {
            *dst = *src as libc::c_char;
        }
        let mut fds = [0; 2];
        // SAFETY: `fds` has room for the two descriptors pipe writes.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let (report_r, report_w) = (fds[0], fds[1]);
        // SAFETY: the child runs only async-signal-safe system calls below, then _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            // SAFETY: the forked child is single-threaded; each call is a plain system call on
            // memory prepared before the fork, and the child leaves by _exit.
            unsafe {
                libc::alarm(20); // never outlives a stuck test
                if libc::syscall(libc::SYS_setgid, NOBODY) != 0 || libc::syscall(libc::SYS_setuid, NOBODY) != 0 {
                    libc::_exit(2);
                }
                let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
                if fd < 0
                    || libc::bind(fd, &addr as *const _ as *const libc::sockaddr, len) != 0
                    || libc::listen(fd, 1) != 0
                {
                    libc::_exit(3);
                }
                libc::write(report_w, b"r".as_ptr().cast(), 1);
                // Two clients: the refusing one, then one that names our uid. Each one's byte
                // count is reported once it closes.
                for _ in 0..2 {
                    let conn = libc::accept(fd, std::ptr::null_mut(), std::ptr::null_mut());
                    let mut total: u64 = 0;
                    let mut buf = [0u8; 256];
                    loop {
                        let n = libc::read(conn, buf.as_mut_ptr().cast(), buf.len());
                        if n <= 0 {
                            break;
                        }
                        total += n as u64;
                    }
                    libc::write(report_w, (&total as *const u64).cast(), 8);
                    libc::close(conn);
                }
                libc::_exit(0);
            }
        }
        // SAFETY: the parent owns its ends of the pipe; the write end is closed so the read
        // end sees end-of-file if the child dies early.
        let mut report = unsafe {
            libc::close(report_w);
            std::fs::File::from_raw_fd(report_r)
        };
        let mut ready = [0u8; 1];
        report.read_exact(&mut ready).expect("the listener is up");
        let owner = std::os::unix::fs::MetadataExt::uid(&std::fs::symlink_metadata(&path).unwrap());
        assert_eq!(owner, NOBODY, "the socket is the other user's");

        let err = Client::connect(Some(&path)).await.err().expect("refused");
        assert_eq!(err.code, ErrorCode::Unauthorized, "{err:?}");
        assert!(err.message.contains("served by uid 65534, not by uid 0"), "{}", err.message);
        // The refused stream is closed: the listener saw end-of-file and counted its bytes.
        let mut total = [0u8; 8];
        report.read_exact(&mut total).expect("the listener reports");
        assert_eq!(u64::from_ne_bytes(total), 0, "bytes sent to a refused server");

        // Naming that uid explicitly (root talking to a user's umbrad) is accepted, and the
        // same listener then does receive bytes: the zero above was the refusal.
        let (client, _notes) = Client::connect_to_uid(Some(&path), NOBODY).await.expect("the named uid serves");
        client.notify::<EventsUnsubscribe>(UnsubscribeParams { subscription: 1 }).await.unwrap();
        drop(client); // shuts the write half: the listener sees end-of-file
        report.read_exact(&mut total).expect("the listener reports");
        assert!(u64::from_ne_bytes(total) > 0, "the accepted client's request arrived");
        let mut status = 0;
        // SAFETY: waits for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child status {status}");
    }
}
