//! The transparent listener: TCP connections redirected by the guest's nat rule
//! ([`super::nft`]) arrive here; `getsockopt(SOL_IP, SO_ORIGINAL_DST)` says where each was
//! going. A fake address is sent to the host as its name, any other address as its literal.
//! Refusals close the connection with a reset (the program sees ECONNRESET at once).

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;

use nix::sys::socket::{getsockopt, sockopt};
use tokio::net::{TcpListener, TcpStream};
use umbra_proto::egress::{EgressRequest, EgressVia};

use super::egress::{relay, Admission, Egress};

pub async fn serve(listener: TcpListener, egress: Arc<Egress>) {
    let own = listener.local_addr().ok();
    super::accept::accept_loop("transparent listener", listener, move |stream| {
        let egress = egress.clone();
        async move {
            match egress.admit() {
                Ok(admission) => handle(stream, &egress, admission, own).await,
                Err(f) => {
                    tracing::debug!("transparent: {f}");
                    reset(stream);
                }
            }
        }
    })
    .await
}

/// Where a redirected connection was going (SO_ORIGINAL_DST, from conntrack). A connection
/// that was not redirected reports the address it reached, i.e. this listener's own.
pub fn original_destination(stream: &TcpStream) -> std::io::Result<SocketAddrV4> {
    let sin = getsockopt(stream, sockopt::OriginalDst)?;
    let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
    Ok(SocketAddrV4::new(ip, u16::from_be(sin.sin_port)))
}

async fn handle(client: TcpStream, egress: &Egress, mut admission: Admission, own: Option<std::net::SocketAddr>) {
    let dest = match original_destination(&client) {
        Ok(d) => d,
        Err(e) => {
            tracing::debug!("transparent: no original destination: {e}");
            return reset(client);
        }
    };
    // Not redirected (someone connected to the listener itself, or to a loopback address the
    // rule leaves alone): there is nowhere to forward it.
    if dest.ip().is_loopback() || own == Some(std::net::SocketAddr::V4(dest)) {
        tracing::debug!("transparent: {dest} was not redirected; closing");
        return reset(client);
    }
    let name = match egress.name_for_v4(*dest.ip()) {
        Ok(n) => n,
        Err(f) => {
            tracing::debug!("transparent: {dest}: {f}");
            return reset(client);
        }
    };
    let port = dest.port();
    let peer = client.peer_addr().ok();
    let request = EgressRequest::Connect { name: name.clone(), port, via: EgressVia::Transparent, who: peer.is_some() };
    let mut connected = match egress.connect(&request, peer).await {
        Ok(c) => c,
        Err(f) => {
            tracing::debug!("transparent: {name}:{port}: {f}");
            return reset(client);
        }
    };
    admission.handshake_done();
    let mut client = client;
    if let Err(e) = relay(&mut client, &mut connected.stream, &[], &connected.pending).await {
        tracing::debug!("transparent: {name}:{port}: {e}");
    }
}

/// Closes with RST: the program learns at once that the connection is refused.
fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}
