//! The SOCKS5 proxy (`ALL_PROXY=socks5h://…`, RFC 1928): no authentication, CONNECT only,
//! addresses as a domain name (ATYP 3), IPv4 (1) or IPv6 (4). The greeting and the request
//! must arrive within [`Limits::request_timeout`](super::egress::Limits).
//!
//! Reply codes: 0x00 connected, 0x02 not allowed (denied), 0x04 host unreachable (unreachable,
//! not found), 0x05 refused (busy, a malformed host answer), 0x07 command not supported,
//! 0x08 address type not supported. A client that offers no "no authentication" method gets
//! 0xFF and is closed.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use umbra_proto::egress::{EgressRefusal, EgressRequest, EgressVia};

use super::egress::{relay, Admission, Egress, Failure};

const VERSION: u8 = 5;
const NO_AUTH: u8 = 0;
const NO_ACCEPTABLE_METHOD: u8 = 0xff;
const CMD_CONNECT: u8 = 1;
const ATYP_V4: u8 = 1;
const ATYP_DOMAIN: u8 = 3;
const ATYP_V6: u8 = 4;

pub const REP_OK: u8 = 0;
pub const REP_NOT_ALLOWED: u8 = 2;
pub const REP_HOST_UNREACHABLE: u8 = 4;
pub const REP_REFUSED: u8 = 5;
pub const REP_COMMAND_NOT_SUPPORTED: u8 = 7;
pub const REP_ADDRESS_NOT_SUPPORTED: u8 = 8;

pub async fn serve(listener: TcpListener, egress: Arc<Egress>) {
    super::accept::accept_loop("SOCKS5 proxy", listener, move |stream| {
        let egress = egress.clone();
        async move {
            match egress.admit() {
                Ok(admission) => handle(stream, &egress, admission).await,
                // Nothing read yet: without the greeting a reply would not be understood.
                Err(_) => drop(stream),
            }
        }
    })
    .await
}

/// The destination of a CONNECT request.
#[derive(Debug, PartialEq, Eq)]
enum Dest {
    Name(String),
    V4(Ipv4Addr),
    V6(Ipv6Addr),
}

enum Handshake {
    Connect(Dest, u16),
    /// Answer this reply code and close.
    Reply(u8),
    /// Close without a word (no acceptable method was already answered, or the client left).
    Close,
}

async fn handle(mut client: TcpStream, egress: &Egress, mut admission: Admission) {
    let handshake = tokio::time::timeout(egress.limits.request_timeout, handshake(&mut client)).await;
    let (dest, port) = match handshake {
        Ok(Ok(Handshake::Connect(dest, port))) => (dest, port),
        Ok(Ok(Handshake::Reply(code))) => return reply_and_close(&mut client, code).await,
        Ok(Ok(Handshake::Close)) | Ok(Err(_)) | Err(_) => return,
    };
    let name = match dest {
        Dest::Name(n) => Ok(n.to_ascii_lowercase()),
        Dest::V4(ip) => egress.name_for_v4(ip),
        Dest::V6(ip) => Ok(ip.to_string()),
    };
    let name = match name {
        Ok(n) => n,
        Err(f) => return reply_and_close(&mut client, code_for(&f)).await,
    };
    let peer = client.peer_addr().ok();
    let request = EgressRequest::Connect { name: name.clone(), port, via: EgressVia::Socks, who: peer.is_some() };
    let mut connected = match egress.connect(&request, peer).await {
        Ok(c) => c,
        Err(f) => {
            tracing::debug!("socks: {name}:{port}: {f}");
            return reply_and_close(&mut client, code_for(&f)).await;
        }
    };
    admission.handshake_done();
    if client.write_all(&reply(REP_OK)).await.is_err() {
        return;
    }
    if let Err(e) = relay(&mut client, &mut connected.stream, &[], &connected.pending).await {
        tracing::debug!("socks: {name}:{port}: {e}");
    }
}

pub fn code_for(f: &Failure) -> u8 {
    match f.refusal {
        EgressRefusal::Denied => REP_NOT_ALLOWED,
        EgressRefusal::NotFound | EgressRefusal::Unreachable => REP_HOST_UNREACHABLE,
        EgressRefusal::Busy | EgressRefusal::BadRequest => REP_REFUSED,
    }
}

async fn handshake(client: &mut TcpStream) -> std::io::Result<Handshake> {
    // Greeting: VER NMETHODS METHODS...
    let mut head = [0u8; 2];
    client.read_exact(&mut head).await?;
    if head[0] != VERSION {
        return Ok(Handshake::Close);
    }
    let mut methods = vec![0u8; head[1] as usize];
    client.read_exact(&mut methods).await?;
    if !methods.contains(&NO_AUTH) {
        client.write_all(&[VERSION, NO_ACCEPTABLE_METHOD]).await?;
        return Ok(Handshake::Close);
    }
    client.write_all(&[VERSION, NO_AUTH]).await?;
    // Request: VER CMD RSV ATYP DST.ADDR DST.PORT
    let mut req = [0u8; 4];
    client.read_exact(&mut req).await?;
    if req[0] != VERSION {
        return Ok(Handshake::Close);
    }
    let dest = match req[3] {
        ATYP_V4 => {
            let mut a = [0u8; 4];
            client.read_exact(&mut a).await?;
            Dest::V4(Ipv4Addr::from(a))
        }
        ATYP_V6 => {
            let mut a = [0u8; 16];
            client.read_exact(&mut a).await?;
            Dest::V6(Ipv6Addr::from(a))
        }
        ATYP_DOMAIN => {
            let mut len = [0u8; 1];
            client.read_exact(&mut len).await?;
            let mut name = vec![0u8; len[0] as usize];
            client.read_exact(&mut name).await?;
            match String::from_utf8(name) {
                Ok(n) if valid_name(&n) => Dest::Name(n),
                _ => return Ok(Handshake::Reply(REP_HOST_UNREACHABLE)),
            }
        }
        _ => return Ok(Handshake::Reply(REP_ADDRESS_NOT_SUPPORTED)),
    };
    let mut port = [0u8; 2];
    client.read_exact(&mut port).await?;
    if req[1] != CMD_CONNECT {
        return Ok(Handshake::Reply(REP_COMMAND_NOT_SUPPORTED));
    }
    Ok(Handshake::Connect(dest, u16::from_be_bytes(port)))
}

/// A host name as the host will accept it: letters, digits, `-`, `_`, `.`.
fn valid_name(n: &str) -> bool {
    !n.is_empty() && n.bytes().all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b))
}

/// VER REP RSV ATYP=IPv4 BND.ADDR=0.0.0.0 BND.PORT=0
fn reply(code: u8) -> [u8; 10] {
    [VERSION, code, 0, ATYP_V4, 0, 0, 0, 0, 0, 0]
}

async fn reply_and_close(client: &mut TcpStream, code: u8) {
    super::accept::write_and_close(client, &reply(code)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_replies() {
        assert!(valid_name("example.com"));
        assert!(valid_name("_srv.x-y.test"));
        assert!(!valid_name(""));
        assert!(!valid_name("a b"));
        assert!(!valid_name("a\0b"));
        assert_eq!(reply(REP_NOT_ALLOWED), [5, 2, 0, 1, 0, 0, 0, 0, 0, 0]);
        let f = Failure { refusal: EgressRefusal::Busy, reason: String::new() };
        assert_eq!(code_for(&f), REP_REFUSED);
    }
}
