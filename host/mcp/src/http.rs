//! The MCP server on streamable HTTP (rmcp's `StreamableHttpService`), as umbrad serves it with
//! `--mcp-listen`: on a loopback address only, each request carrying `Authorization: Bearer
//! <token>`; anything else is answered 401 before it reaches the MCP layer, which also refuses
//! a `Host` that is not a loopback name (DNS rebinding).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};

use crate::server::UmbraMcp;

/// Connections served at once; more wait to be accepted.
const MAX_CONNECTIONS: usize = 64;
/// How long a connection may take to send a request's headers.
const HEADER_PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);

/// Why the endpoint cannot listen: only 127.0.0.1 and ::1, the addresses whose names the MCP
/// layer's `Host` check accepts.
pub fn check_address(addr: &SocketAddr) -> Result<(), String> {
    let ip = addr.ip();
    match ip == std::net::Ipv4Addr::LOCALHOST || ip == std::net::Ipv6Addr::LOCALHOST {
        true => Ok(()),
        false => Err(format!("the MCP endpoint listens on 127.0.0.1 or ::1 only, not {ip}")),
    }
}

/// Serves MCP on `listener` until it fails; every request must carry `token` as a bearer
/// token. `make` builds the server for each MCP session.
pub async fn serve(
    listener: tokio::net::TcpListener,
    token: String,
    make: impl Fn() -> UmbraMcp + Send + Sync + 'static,
) -> std::io::Result<()> {
    let service = StreamableHttpService::new(
        move || Ok(make()),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default(),
    );
    // Compared as digests: the time taken says nothing of how much of a guess was right.
    let expected: Arc<[u8; 32]> = Arc::new(digest(token.as_bytes()));
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let slot = slots.clone().acquire_owned().await.expect("the semaphore is never closed");
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors, a connection reset before it was accepted: the endpoint
                // stays up.
                tracing::warn!("MCP endpoint: accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let (service, expected) = (service.clone(), expected.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let handler = hyper::service::service_fn(move |req: Request<Incoming>| {
                let (service, expected) = (service.clone(), expected.clone());
                async move {
                    if !authorized(&req, &expected) {
                        return Ok::<_, Infallible>(unauthorized());
                    }
                    Ok(service.handle(req).await)
                }
            });
            // HTTP/1.1 only: the automatic version sniffing waits for a first byte with no
            // timeout, so idle sockets could hold every slot.
            let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new()).http1_only();
            builder.http1().timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(HEADER_PATIENCE);
            let served = builder.serve_connection(TokioIo::new(stream), handler).await;
            if let Err(e) = served {
                tracing::debug!(%peer, "MCP connection ended: {e}");
            }
        });
    }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).into()
}

/// Whether `req` carries the bearer token whose digest is `expected`.
fn authorized<B>(req: &Request<B>, expected: &[u8; 32]) -> bool {
    let Some(value) = req.headers().get(http::header::AUTHORIZATION).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let Some(token) = value.strip_prefix("Bearer ") else { return false };
    digest(token.trim().as_bytes()) == *expected
}

fn unauthorized() -> Response<BoxBody<Bytes, Infallible>> {
    let body =
        Full::new(Bytes::from_static(b"umbrad's MCP endpoint needs Authorization: Bearer <token> (see docs/mcp.md)\n"));
    let mut response = Response::new(body.boxed());
    *response.status_mut() = StatusCode::UNAUTHORIZED;
    response.headers_mut().insert(http::header::WWW_AUTHENTICATE, http::HeaderValue::from_static("Bearer"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_bearer_token_is_let_in() {
        let expected = digest(b"s3cret");
        let req = |value: Option<&str>| {
            let mut b = Request::builder().uri("/mcp");
            if let Some(v) = value {
                b = b.header("authorization", v);
            }
            b.body(()).unwrap()
        };
        assert!(authorized(&req(Some("Bearer s3cret")), &expected));
        for refused in [None, Some("Bearer s3cre"), Some("Bearer s3cret2"), Some("Basic s3cret"), Some("s3cret")] {
            assert!(!authorized(&req(refused), &expected), "{refused:?}");
        }
        assert_eq!(unauthorized().status(), StatusCode::UNAUTHORIZED);
    }

    #[test]
    fn the_endpoint_listens_on_loopback_only() {
        assert!(check_address(&"127.0.0.1:7000".parse().unwrap()).is_ok());
        assert!(check_address(&"[::1]:7000".parse().unwrap()).is_ok());
        let e = check_address(&"0.0.0.0:7000".parse().unwrap()).unwrap_err();
        assert!(e.contains("127.0.0.1 or ::1"), "{e}");
        assert!(check_address(&"192.168.1.2:7000".parse().unwrap()).is_err());
        assert!(check_address(&"127.0.0.2:7000".parse().unwrap()).is_err(), "a name the Host check refuses");
    }
}
