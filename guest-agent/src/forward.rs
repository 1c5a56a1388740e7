//! Exposed ports, guest side: the host opens a stream to [`FORWARD_VSOCK_PORT`] for each TCP
//! connection to an exposed port and names the guest port in one line; the agent connects to
//! it on the guest's loopback (127.0.0.1, then ::1) and carries the bytes both ways
//! (`docs/sessions.md`, "Ports").

use std::io;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use umbra_proto::forward::{ForwardReply, ForwardRequest, MAX_FORWARD_LINE};

use crate::net::egress::HostStream;
use crate::server::ListenAddr;

/// Forwarded connections open at once; further ones are refused until one ends.
const MAX_CONNECTIONS: usize = 1024;

/// How long the host has to name the port, and the guest's server to accept.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Accepts forwarded connections on `addr` until the agent ends; each is served on its own task.
pub async fn serve(addr: ListenAddr) -> anyhow::Result<()> {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    match addr {
        ListenAddr::Vsock(port) => {
            let listener =
                tokio_vsock::VsockListener::bind(tokio_vsock::VsockAddr::new(tokio_vsock::VMADDR_CID_ANY, port))
                    .with_context(|| format!("cannot listen on vsock port {port}"))?;
            loop {
                match listener.accept().await {
                    Ok((s, _)) => admit(HostStream::Vsock(s), &slots),
                    Err(e) => back_off(e).await,
                }
            }
        }
        ListenAddr::Unix(path) => {
            let _ = std::fs::remove_file(&path);
            let listener =
                tokio::net::UnixListener::bind(&path).with_context(|| format!("cannot listen on {path:?}"))?;
            loop {
                match listener.accept().await {
                    Ok((s, _)) => admit(HostStream::Unix(s), &slots),
                    Err(e) => back_off(e).await,
                }
            }
        }
    }
}

/// An accept error (descriptors exhausted) must not end the loop: wait a little, go on.
async fn back_off(e: io::Error) {
    tracing::debug!("forward: accept: {e}");
    tokio::time::sleep(Duration::from_millis(100)).await;
}

fn admit(mut host: HostStream, slots: &Arc<Semaphore>) {
    let Ok(slot) = slots.clone().try_acquire_owned() else {
        tokio::spawn(async move {
            let reply = ForwardReply::refused(format!("{MAX_CONNECTIONS} forwarded connections are open"));
            let _ = host.write_all(&reply.to_line()).await;
        });
        return;
    };
    tokio::spawn(async move {
        let _slot = slot;
        if let Err(e) = handle(host).await {
            tracing::debug!("forward: {e}");
        }
    });
}

async fn handle(mut host: HostStream) -> io::Result<()> {
    let request = match tokio::time::timeout(HANDSHAKE_TIMEOUT, read_request(&mut host)).await {
        Ok(Ok(r)) => r,
        Ok(Err(why)) => return host.write_all(&ForwardReply::refused(why).to_line()).await,
        Err(_) => return Ok(()),
    };
    let guest = match tokio::time::timeout(HANDSHAKE_TIMEOUT, connect(request.port)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            let why = format!("cannot connect to port {} in the guest: {e}", request.port);
            return host.write_all(&ForwardReply::refused(why).to_line()).await;
        }
        Err(_) => {
            let why = format!("port {} in the guest did not accept within {HANDSHAKE_TIMEOUT:?}", request.port);
            return host.write_all(&ForwardReply::refused(why).to_line()).await;
        }
    };
    let _ = guest.set_nodelay(true);
    host.write_all(&ForwardReply::ok().to_line()).await?;
    relay(guest, host).await
}

/// Carries bytes both ways until either side ends, then closes both. A half-close is not
/// passed on: the backends' vsock does not carry one to the host end (the host side holds a
/// client's half-close itself, `session::ports` in umbra-runtime), and a server that closes
/// its sending side is, in practice, closing: the host client hears it at once.
async fn relay(guest: TcpStream, host: HostStream) -> io::Result<()> {
    let (mut gr, mut gw) = guest.into_split();
    let (mut hr, mut hw) = tokio::io::split(host);
    let mut up = vec![0u8; 64 * 1024];
    let mut down = vec![0u8; 64 * 1024];
    loop {
        tokio::select! {
            r = hr.read(&mut up) => match r? {
                0 => return Ok(()),
                n => gw.write_all(&up[..n]).await?,
            },
            r = gr.read(&mut down) => match r? {
                0 => {
                    let _ = hw.flush().await;
                    return Ok(());
                }
                n => hw.write_all(&down[..n]).await?,
            },
        }
    }
}

/// The port on the guest's loopback: IPv4 first, then IPv6 (a server bound to `::1` only).
async fn connect(port: u16) -> io::Result<TcpStream> {
    match TcpStream::connect((std::net::Ipv4Addr::LOCALHOST, port)).await {
        Ok(s) => Ok(s),
        Err(v4) => TcpStream::connect((std::net::Ipv6Addr::LOCALHOST, port)).await.map_err(|_| v4),
    }
}

/// Reads the request line byte by byte (it is short), so nothing after it is consumed: the
/// host sends the connection's bytes only after the reply anyway.
async fn read_request(host: &mut HostStream) -> Result<ForwardRequest, String> {
    let mut line = Vec::with_capacity(32);
    loop {
        let mut byte = [0u8; 1];
        match host.read(&mut byte).await {
            Ok(0) => return Err("the host closed the stream before naming a port".into()),
            Ok(_) if byte[0] == b'\n' => break,
            Ok(_) if line.len() + 1 >= MAX_FORWARD_LINE => {
                return Err(format!("the request is longer than {MAX_FORWARD_LINE} bytes"))
            }
            Ok(_) => line.push(byte[0]),
            Err(e) => return Err(format!("reading the request: {e}")),
        }
    }
    serde_json::from_slice(&line).map_err(|e| format!("the request is not understood: {e}"))
}
