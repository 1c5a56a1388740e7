//! Reaching the agent: a plain Unix socket (host-side tests, or a backend that forwards one),
//! or the hybrid vsock Unix socket that Firecracker defined and vhost-device-vsock and the
//! Umbra VMM both serve: write `CONNECT <port>\n`, read `OK <host port>\n`, then the stream
//! is the guest connection.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::UnixStream;

use super::ClientError;

/// The hybrid vsock reply line is short; a longer one is not a vsock proxy talking.
const MAX_REPLY_LINE: usize = 64;
/// The backend answers CONNECT at once (OK, or a close when nothing listens); a backend that
/// stays silent must not hang the caller.
const REPLY_TIMEOUT: Duration = Duration::from_secs(5);

pub async fn unix(path: &std::path::Path) -> Result<UnixStream, ClientError> {
    UnixStream::connect(path)
        .await
        .map_err(|e| ClientError::Connect { path: path.display().to_string(), reason: e.to_string() })
}

pub async fn hybrid_vsock(path: &std::path::Path, port: u32) -> Result<UnixStream, ClientError> {
    let mut stream = unix(path).await?;
    hybrid_handshake(&mut stream, port)
        .await
        .map_err(|e| ClientError::HybridVsock { path: path.display().to_string(), reason: e.to_string() })?;
    Ok(stream)
}

/// Performs the CONNECT exchange, reading byte by byte so no guest byte after the reply line
/// is consumed. Fails if the exchange takes longer than 5 s.
pub async fn hybrid_handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    port: u32,
) -> Result<u32, HandshakeError> {
    hybrid_handshake_within(stream, port, REPLY_TIMEOUT).await
}

async fn hybrid_handshake_within<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    port: u32,
    timeout: Duration,
) -> Result<u32, HandshakeError> {
    tokio::time::timeout(timeout, exchange(stream, port))
        .await
        .unwrap_or(Err(HandshakeError::Timeout { port, timeout }))
}

/// Why a hybrid vsock CONNECT exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("no reply to CONNECT {port} within {timeout:?}")]
    Timeout { port: u32, timeout: Duration },
    #[error("write CONNECT: {0}")]
    Write(#[source] std::io::Error),
    #[error("read reply: {0}")]
    Read(#[source] std::io::Error),
    #[error("closed without a reply: nothing is listening on guest port {port} (agent not up yet?)")]
    NoListener { port: u32 },
    #[error("closed after a partial reply {0:?}")]
    Partial(String),
    #[error("reply longer than {MAX_REPLY_LINE} bytes")]
    TooLong,
    #[error("expected \"OK <port>\", got {0:?}")]
    Unexpected(String),
}

async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S, port: u32) -> Result<u32, HandshakeError> {
    stream.write_all(format!("CONNECT {port}\n").as_bytes()).await.map_err(HandshakeError::Write)?;
    let mut line = Vec::with_capacity(16);
    loop {
        let b = match stream.read_u8().await {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Err(if line.is_empty() {
                    HandshakeError::NoListener { port }
                } else {
                    HandshakeError::Partial(String::from_utf8_lossy(&line).into_owned())
                });
            }
            Err(e) => return Err(HandshakeError::Read(e)),
        };
        if b == b'\n' {
            break;
        }
        if line.len() == MAX_REPLY_LINE {
            return Err(HandshakeError::TooLong);
        }
        line.push(b);
    }
    let text = String::from_utf8_lossy(&line);
    match text.strip_prefix("OK ").map(|n| n.trim().parse::<u32>()) {
        Some(Ok(host_port)) => Ok(host_port),
        _ => Err(HandshakeError::Unexpected(text.into_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn reply(canned: &'static [u8]) -> (Result<u32, String>, Vec<u8>, Vec<u8>) {
        let (mut client, mut server) = tokio::io::duplex(256);
        let srv = tokio::spawn(async move {
            let mut req = vec![0u8; 13];
            server.read_exact(&mut req).await.unwrap();
            server.write_all(canned).await.unwrap();
            req
        });
        let r = hybrid_handshake(&mut client, 1024).await.map_err(|e| e.to_string());
        let req = srv.await.unwrap();
        // Whatever follows the reply line must still be readable by the protocol.
        let mut rest = Vec::new();
        let _ = client.read_to_end(&mut rest).await;
        (r, req, rest)
    }

    #[tokio::test]
    async fn ok_reply_leaves_following_bytes_unread() {
        let (r, req, rest) = reply(b"OK 1073741824\nUM").await;
        assert_eq!(req, b"CONNECT 1024\n");
        assert_eq!(r, Ok(1073741824));
        assert_eq!(rest, b"UM");
    }

    #[tokio::test]
    async fn a_silent_backend_times_out() {
        let (mut client, _server) = tokio::io::duplex(256);
        let e = hybrid_handshake_within(&mut client, 1024, Duration::from_millis(50)).await.unwrap_err().to_string();
        assert!(e.contains("no reply"), "{e}");
    }

    #[tokio::test]
    async fn refusals_and_garbage_are_errors() {
        assert!(reply(b"").await.0.unwrap_err().contains("nothing is listening"));
        assert!(reply(b"FAILURE\n").await.0.unwrap_err().contains("expected"));
        assert!(reply(&[b'x'; 100]).await.0.unwrap_err().contains("longer than"));
    }
}
