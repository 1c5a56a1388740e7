//! Accepting connections: vsock in a guest, a Unix socket for host-side tests. Every connection
//! is served independently; a misbehaving one is closed without affecting the others.

mod connection;
mod handlers;

use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use std::os::fd::{AsFd, AsRawFd};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest};
use tokio::sync::Notify;

use crate::reaper::Reaper;
use crate::shares::Shares;

pub use connection::serve_connection;

/// Where the agent listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    Vsock(u32),
    Unix(std::path::PathBuf),
}

impl std::str::FromStr for ListenAddr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(port) = s.strip_prefix("vsock:") {
            return port.parse().map(ListenAddr::Vsock).map_err(|_| format!("bad vsock port in {s:?}"));
        }
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("unix: needs a path".into());
            }
            return Ok(ListenAddr::Unix(path.into()));
        }
        Err(format!("listen address {s:?} must be vsock:PORT or unix:PATH"))
    }
}

/// State shared by every connection.
pub struct Agent {
    pub reaper: Arc<Reaper>,
    pub started: Instant,
    pub pid1: bool,
    /// Processes alive across all connections.
    pub live_processes: AtomicU32,
    /// Signalled by a shutdown request; `main` performs it.
    pub shutdown: Notify,
    /// Shared folders, guest-wide (not per connection).
    pub shares: Shares,
    /// Processes parked by a connection (`park`), waiting for another to adopt them.
    pub parked: Parked,
    /// Exec-gate checks waiting for the host's answer (`process/gate.rs`).
    pub exec_checks: Arc<crate::process::gate::ExecChecks>,
}

/// Parked processes by token.
#[derive(Default)]
pub struct Parked {
    processes: std::sync::Mutex<std::collections::HashMap<u64, crate::process::ProcessHandle>>,
    next_token: std::sync::atomic::AtomicU64,
}

impl Parked {
    /// Keeps `process` (already parked); its token.
    pub fn insert(&self, process: crate::process::ProcessHandle) -> u64 {
        // Unpredictable tokens are not needed: only the host speaks on the agent's port.
        let token = self.next_token.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        self.processes.lock().unwrap().insert(token, process);
        token
    }

    /// Puts back a process taken for an adoption that could not happen.
    pub fn insert_back(&self, token: u64, process: crate::process::ProcessHandle) {
        self.processes.lock().unwrap().insert(token, process);
    }

    pub fn take(&self, token: u64) -> Option<crate::process::ProcessHandle> {
        self.processes.lock().unwrap().remove(&token)
    }

    pub fn take_all(&self) -> Vec<crate::process::ProcessHandle> {
        self.processes.lock().unwrap().drain().map(|(_, p)| p).collect()
    }
}

pub async fn serve(agent: Arc<Agent>, addr: &ListenAddr) -> anyhow::Result<()> {
    match addr {
        ListenAddr::Unix(path) => {
            let _ = std::fs::remove_file(path);
            let listener =
                tokio::net::UnixListener::bind(path).with_context(|| format!("cannot listen on {path:?}"))?;
            tracing::info!(?path, "listening");
            let listener = &listener;
            accept_forever(&agent, false, || async move { listener.accept().await.map(|(s, _)| s) }).await
        }
        ListenAddr::Vsock(port) => {
            let addr = tokio_vsock::VsockAddr::new(tokio_vsock::VMADDR_CID_ANY, *port);
            let listener = tokio_vsock::VsockListener::bind(addr)
                .with_context(|| format!("cannot listen on vsock port {port}"))?;
            tracing::info!(port, "listening on vsock");
            tokio::spawn(announce_ready());
            let listener = &listener;
            accept_forever(&agent, true, || async move { listener.accept().await.map(|(s, _)| s) }).await
        }
    }
}

/// Tells the host the agent listens: a connection to the host's readiness port, closed at once.
/// A host that does not listen there (an older runtime, another VMM) refuses it; that is fine.
async fn announce_ready() {
    let host = tokio_vsock::VsockAddr::new(tokio_vsock::VMADDR_CID_HOST, umbra_proto::AGENT_READY_VSOCK_PORT);
    match tokio::time::timeout(std::time::Duration::from_secs(10), tokio_vsock::VsockStream::connect(host)).await {
        Ok(Ok(_)) => tracing::info!("announced readiness to the host"),
        Ok(Err(e)) => tracing::debug!("readiness announcement refused: {e}"),
        Err(_) => tracing::debug!("readiness announcement timed out"),
    }
}

/// Serves every accepted connection; accept errors (fd exhaustion, aborted connections) back
/// off and retry — they must never end PID 1.
async fn accept_forever<S, F, Fut>(agent: &Arc<Agent>, vsock: bool, mut accept: F) -> anyhow::Result<()>
where
    S: AsyncRead + AsyncWrite + AsFd + Send + 'static,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = std::io::Result<S>>,
{
    let mut backoff = Backoff::default();
    loop {
        match accept().await {
            Ok(stream) => {
                backoff.reset();
                spawn_connection(agent, stream, vsock);
            }
            Err(e) => backoff.wait(e).await,
        }
    }
}

/// A failed accept (EMFILE when out of fds, ECONNABORTED when a peer gave up) concerns that one
/// attempt. Propagating it would end the agent — PID 1, so the VM with it. Instead wait (fd
/// exhaustion would otherwise spin: the pending connection stays queued) and keep accepting.
#[derive(Default)]
struct Backoff {
    delay: Option<Duration>,
}

impl Backoff {
    const MIN: Duration = Duration::from_millis(10);
    const MAX: Duration = Duration::from_millis(100);

    async fn wait(&mut self, e: std::io::Error) {
        let delay = match self.delay {
            // Once per streak at warn: the console is slow, and the cause is the same.
            None => {
                tracing::warn!("accept failed: {e}; retrying");
                Self::MIN
            }
            Some(d) => {
                tracing::debug!("accept failed again: {e}");
                (d * 2).min(Self::MAX)
            }
        };
        self.delay = Some(delay);
        tokio::time::sleep(delay).await;
    }

    fn reset(&mut self) {
        self.delay = None;
    }
}

/// On vsock, whenever a host connection ends the agent announces itself again, as at boot. After
/// a restore from a snapshot that is how the host learns at once that the guest answers: the
/// restored device tells the driver the transport was reset, and Linux closes every connected
/// socket. After an ordinary close nobody listens on the readiness port any more, and the
/// announcement is refused at once; it costs one connection attempt.
fn spawn_connection<S: AsyncRead + AsyncWrite + AsFd + Send + 'static>(agent: &Arc<Agent>, stream: S, vsock: bool) {
    let agent = agent.clone();
    let watch = if vsock { watch_for_reset(&stream) } else { None };
    tokio::spawn(async move {
        match serve_connection(agent, stream).await {
            Err(e) if e.is_transport_reset() => tracing::info!("the host connection was reset: {e}"),
            Err(e) => tracing::warn!("connection ended: {e}"),
            Ok(()) => tracing::debug!("the host closed the connection"),
        }
        if let Some(watch) = watch {
            watch.abort();
        }
        if vsock {
            announce_ready().await;
        }
    });
}

/// Linux's vsock reports a transport reset on a connected socket as `EPOLLERR` alone: the
/// socket is closed with `sk_err = ECONNRESET` but not shut down, so it is neither readable nor
/// hung up, and a reader waiting for readability is never woken. This watches a duplicate of
/// the socket for errors only and, on one, shuts the socket down, which wakes the reader (its
/// read then fails with ENOTCONN) and ends the connection as any failure does.
fn watch_for_reset(stream: &impl AsFd) -> Option<tokio::task::JoinHandle<()>> {
    let watched = match stream.as_fd().try_clone_to_owned() {
        Ok(fd) => fd,
        Err(e) => {
            tracing::warn!("cannot watch the connection for a transport reset: {e}");
            return None;
        }
    };
    // SAFETY: `watched` is an OwnedFd the AsyncFd takes ownership of: it stays open, and
    // `as_raw_fd` returns that same descriptor, until the AsyncFd is dropped.
    let watched = match unsafe { AsyncFd::register_with_interest(watched, Interest::ERROR) } {
        Ok(fd) => fd,
        Err(e) => {
            let e = e.into_parts().1;
            tracing::warn!("cannot watch the connection for a transport reset: {e}");
            return None;
        }
    };
    Some(tokio::spawn(async move {
        if let Ok(guard) = watched.ready(Interest::ERROR).await {
            let error = nix::sys::socket::getsockopt(guard.get_inner(), nix::sys::socket::sockopt::SocketError);
            tracing::info!("the host connection failed ({error:?}): shutting it down");
            let _ = nix::sys::socket::shutdown(guard.get_inner().as_raw_fd(), nix::sys::socket::Shutdown::Both);
        }
    }))
}
