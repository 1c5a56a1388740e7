//! Host-initiated streams to a running guest's vsock ports: what an exposed port's host end
//! opens for each connection (to the agent's [`umbra_proto::forward::FORWARD_VSOCK_PORT`]).

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

use tokio::net::UnixStream;

type Dial = dyn Fn(u32) -> Pin<Box<dyn Future<Output = Result<UnixStream, String>> + Send>> + Send + Sync;

/// Opens a stream to a port of one VM's guest; cloned freely, usable while the VM runs.
#[derive(Clone)]
pub struct Dialer(Arc<Dial>);

impl std::fmt::Debug for Dialer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Dialer")
    }
}

impl Dialer {
    /// Through a hybrid vsock socket (`CONNECT <port>`): vhost-device-vsock, umbra-vmm.
    pub fn hybrid(path: PathBuf) -> Self {
        Self(Arc::new(move |port| {
            let path = path.clone();
            Box::pin(async move { crate::agent::dial_hybrid_vsock(&path, port).await.map_err(|e| e.to_string()) })
        }))
    }

    /// Any other way to reach the guest (the vz backend's socket device).
    pub fn new(
        dial: impl Fn(u32) -> Pin<Box<dyn Future<Output = Result<UnixStream, String>> + Send>> + Send + Sync + 'static,
    ) -> Self {
        Self(Arc::new(dial))
    }

    pub async fn dial(&self, port: u32) -> Result<UnixStream, String> {
        (self.0)(port).await
    }
}
