//! The guest's `SSH_AUTH_SOCK`: a Unix socket whose every connection is carried to the
//! session's SSH agent on the host (an egress stream asking for `ssh_agent`), which holds the
//! keys and signs only for the servers each is meant for. Nothing about keys lives here.

use std::sync::Arc;

use tokio::net::UnixListener;
use umbra_proto::egress::EgressRequest;

use super::egress::{relay, Egress};

pub use umbra_proto::egress::SSH_AGENT_SOCKET as SOCKET;

/// Listens on [`SOCKET`] (any user of the guest may use it, as any may use the network).
pub fn listen() -> std::io::Result<UnixListener> {
    std::fs::create_dir_all("/run/umbra")?;
    let _ = std::fs::remove_file(SOCKET);
    let listener = UnixListener::bind(SOCKET)?;
    std::fs::set_permissions(SOCKET, std::os::unix::fs::PermissionsExt::from_mode(0o666))?;
    Ok(listener)
}

pub async fn serve(listener: UnixListener, egress: Arc<Egress>) {
    loop {
        let mut client = match listener.accept().await {
            Ok((c, _)) => c,
            Err(e) => {
                tracing::warn!("ssh agent: accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(mut admission) = egress.admit() else { continue };
        let egress = egress.clone();
        tokio::spawn(async move {
            let mut connected = match egress.connect(&EgressRequest::SshAgent, None).await {
                Ok(c) => c,
                Err(f) => return tracing::debug!("ssh agent: {f}"),
            };
            admission.handshake_done();
            if let Err(e) = relay(&mut client, &mut connected.stream, &[], &connected.pending).await {
                tracing::debug!("ssh agent: {e}");
            }
        });
    }
}
