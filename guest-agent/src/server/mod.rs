//! Accepting connections: vsock in a guest, a Unix socket for host-side tests. Every connection
//! is served independently; a misbehaving one is closed without affecting the others.

mod connection;
mod handlers;

use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::Notify;

use crate::reaper::Reaper;

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
    pub hostname: String,
    /// Processes alive across all connections.
    pub live_processes: AtomicU32,
    /// Signalled by a shutdown request; `main` performs it.
    pub shutdown: Notify,
}

pub async fn serve(agent: Arc<Agent>, addr: &ListenAddr) -> anyhow::Result<()> {
    match addr {
        ListenAddr::Unix(path) => {
            let _ = std::fs::remove_file(path);
            let listener =
                tokio::net::UnixListener::bind(path).with_context(|| format!("cannot listen on {path:?}"))?;
            tracing::info!(?path, "listening");
            loop {
                let (stream, _) = listener.accept().await.context("accept on unix socket")?;
                spawn_connection(&agent, stream);
            }
        }
        ListenAddr::Vsock(port) => {
            let addr = tokio_vsock::VsockAddr::new(tokio_vsock::VMADDR_CID_ANY, *port);
            let listener = tokio_vsock::VsockListener::bind(addr)
                .with_context(|| format!("cannot listen on vsock port {port}"))?;
            tracing::info!(port, "listening on vsock");
            loop {
                let (stream, _) = listener.accept().await.context("accept on vsock")?;
                spawn_connection(&agent, stream);
            }
        }
    }
}

fn spawn_connection<S: AsyncRead + AsyncWrite + Send + 'static>(agent: &Arc<Agent>, stream: S) {
    let agent = agent.clone();
    tokio::spawn(async move {
        if let Err(e) = serve_connection(agent, stream).await {
            tracing::warn!("connection ended: {e}");
        }
    });
}
