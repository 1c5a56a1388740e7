//! The socket: a private directory, one daemon per socket, who may connect, and how many.
//!
//! The socket lives in a directory only its owner can enter (0700) and is itself 0600; on top
//! of that every connection's peer credentials (SO_PEERCRED) are checked before a byte of it is
//! read: only the daemon's own uid is served, and root only with `--allow-root`. A refused
//! client gets one JSON-RPC error and the connection closes; the refusal is logged.

use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context};
use tokio::io::AsyncWriteExt;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;
use umbra_api::rpc::Response;
use umbra_api::{ApiError, ErrorCode};

use crate::state::Daemon;

/// Holds the daemon's lock for as long as it lives: a second umbrad on the same socket refuses
/// to start instead of stealing it.
pub struct Listening {
    pub listener: UnixListener,
    _lock: std::fs::File,
}

/// Creates the socket's private directory, takes the lock, removes a stale socket and listens.
///
/// The directory must be private to this user ([`umbra_api::paths::ensure_private_dir`]):
/// umbrad creates it 0700; an existing one is used only if it is a real directory (not a
/// symlink), ours and mode 0700 — anything else (another user's `/tmp/umbra-<uid>`, a
/// `--socket /tmp/x.sock`) is refused with the reason, never repaired.
pub fn bind(socket: &Path) -> anyhow::Result<Listening> {
    let dir = socket.parent().filter(|d| !d.as_os_str().is_empty()).context("the socket path has no directory")?;
    umbra_api::paths::ensure_private_dir(dir).context("refusing to put umbrad's socket there")?;
    let lock_path = socket.with_extension("lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .with_context(|| format!("cannot open {}", lock_path.display()))?;
    // SAFETY: flock on an fd we own; no memory is involved.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        bail!("another umbrad is serving {} (it holds {})", socket.display(), lock_path.display());
    }
    // We hold the lock, so a socket file left there is stale.
    match std::fs::remove_file(socket) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("cannot remove the stale {}", socket.display())),
    }
    let listener = UnixListener::bind(socket).with_context(|| format!("cannot listen on {}", socket.display()))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("cannot restrict {}", socket.display()))?;
    Ok(Listening { listener, _lock: lock })
}

/// Accepts clients until `shutdown` resolves.
pub async fn serve(daemon: Arc<Daemon>, listening: Listening, shutdown: impl std::future::Future<Output = ()>) {
    let clients = Arc::new(Semaphore::new(daemon.options.max_clients));
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listening.listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // EMFILE and friends: keep serving the clients we have.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = &mut shutdown => return,
        };
        let uid = match stream.peer_cred() {
            Ok(cred) => cred.uid(),
            Err(e) => {
                tracing::warn!("refused a client whose credentials could not be read: {e}");
                continue;
            }
        };
        if !daemon.allowed(uid) {
            tracing::warn!(uid, "refused a client of uid {uid}: only uid {} is served", daemon.uid);
            let why = format!(
                "uid {uid} may not use this umbrad (it serves uid {}{})",
                daemon.uid,
                if daemon.options.allow_root { " and root" } else { "" }
            );
            tokio::spawn(refuse(stream, ApiError::new(ErrorCode::Unauthorized, why)));
            continue;
        }
        let Ok(permit) = clients.clone().try_acquire_owned() else {
            tracing::warn!("refused a client: {} clients are connected", daemon.options.max_clients);
            let why = format!("too many clients (at most {})", daemon.options.max_clients);
            tokio::spawn(refuse(stream, ApiError::new(ErrorCode::Busy, why)));
            continue;
        };
        let id = daemon.next_connection_id();
        tokio::spawn(crate::connection::run(daemon.clone(), stream, id, permit));
    }
}

/// Tells a refused client why, then closes the connection.
async fn refuse(mut stream: UnixStream, error: ApiError) {
    let mut line = serde_json::to_vec(&Response::err(None, &error)).expect("responses serialize");
    line.push(b'\n');
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), stream.write_all(&line)).await;
    let _ = stream.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_socket_is_private_single_and_never_in_a_shared_directory() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("private/umbrad.sock");
        let first = bind(&socket).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!((mode(socket.parent().unwrap()), mode(&socket)), (0o700, 0o600));
        let e = bind(&socket).err().expect("a second daemon is refused").to_string();
        assert!(e.contains("another umbrad"), "{e}");
        drop(first);
        bind(&socket).expect("the lock holder replaces a stale socket");

        let shared = dir.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let e = format!("{:#}", bind(&shared.join("umbrad.sock")).err().expect("refused"));
        assert!(e.contains("mode 1777, not 0700"), "{e}");
        assert_eq!(mode(&shared), 0o777, "left as it was");

        // Umbra's own directory is no exception: 0755 is refused, not repaired.
        let loose = dir.path().join("loose");
        std::fs::create_dir(&loose).unwrap();
        std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o755)).unwrap();
        let e = format!("{:#}", bind(&loose.join("umbrad.sock")).err().expect("refused"));
        assert!(e.contains("mode 0755, not 0700"), "{e}");
        // Nor is a symlink to a good directory.
        std::os::unix::fs::symlink(socket.parent().unwrap(), dir.path().join("link")).unwrap();
        let e = format!("{:#}", bind(&dir.path().join("link/umbrad.sock")).err().expect("refused"));
        assert!(e.contains("is a symlink"), "{e}");
    }
}
