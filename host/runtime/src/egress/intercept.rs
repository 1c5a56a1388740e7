//! The connections whose requests the proxy reads: TLS from the guest to a host a secret is
//! bound to. The proxy ends the guest's TLS with a certificate of the session's CA, opens its
//! own verified TLS to the host, and carries HTTP/1.1 between them (hyper on both sides),
//! putting secrets' values in place of their placeholders in each request's head.
//!
//! A connection that turns out not to be TLS from the guest (a protocol whose server speaks
//! first, such as SSH; plain text) is carried unread, as every other connection is.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixStream};
use umbra_api::EventKind;

use super::report::Report;
use super::secrets::SharedSecrets;
use super::tls::{SessionCa, Upstream};
use super::upstream_proxy::UpstreamProxy;

/// What a session's proxy needs to read the requests of the hosts its secrets are bound to.
#[derive(Clone, Debug)]
pub struct Broker {
    pub secrets: SharedSecrets,
    pub ca: Arc<SessionCa>,
    /// How the hosts are verified, or why they cannot be (no trust store, a bad `trust_ca`).
    pub upstream: Result<Upstream, String>,
    /// The company proxy every connection goes through, when there is one.
    pub upstream_proxy: Option<UpstreamProxy>,
    /// Whom to ask about a name outside the allowlist (network mode `ask`).
    pub ask: Option<Arc<super::ask::AskGate>>,
    /// The keys the session's SSH agent holds.
    pub ssh_keys: super::ssh_agent::SharedSshKeys,
}

/// How long each side has for its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// TLS's first byte: a handshake record.
const TLS_HANDSHAKE: u8 = 0x16;

/// Whether the guest opened with TLS: its first bytes (`pending`, else read now), unless the
/// destination speaks first. Returns the bytes read, which the caller passes on either way.
pub(super) async fn guest_opens_tls(
    guest: &mut UnixStream,
    upstream: &TcpStream,
    mut pending: Vec<u8>,
    idle: Duration,
) -> (bool, Vec<u8>) {
    if pending.is_empty() {
        let mut buf = vec![0u8; 16 * 1024];
        let mut peeked = [0u8; 1];
        tokio::select! {
            read = guest.read(&mut buf) => if let Ok(n) = read {
                pending.extend_from_slice(&buf[..n]);
            },
            // The server speaks first (SSH, SMTP): not a TLS client hello from the guest. (A
            // peek, not `readable()`: readiness left over from reading a proxy's answer would
            // fire at once.)
            _ = upstream.peek(&mut peeked) => {}
            _ = tokio::time::sleep(idle) => {}
        }
    }
    (pending.first() == Some(&TLS_HANDSHAKE), pending)
}

/// Carries a connection whose guest opened with TLS: returns the bytes sent to and received
/// from the destination (on its socket, so TLS included).
pub(super) async fn carry(
    guest: UnixStream,
    pending: Vec<u8>,
    upstream: TcpStream,
    (host, port): (&str, u16),
    broker: &Broker,
    report: &Report,
    idle: Duration,
) -> (u64, u64) {
    let activity = Arc::new(Activity::new());
    let intercepted = |error: Option<String>| EventKind::TlsIntercepted { host: host.to_string(), port, error };
    let accepted = async {
        let config = broker.ca.server_config(host).map_err(|e| e.to_string())?;
        let guest = Watched { inner: Rewind { pending, inner: guest }, activity: activity.clone(), count: false };
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, tokio_rustls::TlsAcceptor::from(config).accept(guest)).await {
            Ok(Ok(tls)) => Ok(tls),
            Ok(Err(e)) => Err(format!("the guest's TLS handshake failed: {e}")),
            Err(_) => Err("the guest's TLS handshake took too long".to_string()),
        }
    };
    let guest = match accepted.await {
        Ok(g) => g,
        Err(why) => {
            report(intercepted(Some(why)));
            return activity.counts();
        }
    };
    let upstream = Watched { inner: upstream, activity: activity.clone(), count: true };
    let connected = async {
        let verify = broker.upstream.as_ref().map_err(|why| format!("cannot verify {host}: {why}"))?;
        let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, verify.connect(host, upstream)).await {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => return Err(format!("{host}:{port}: its certificate is not trusted or TLS failed: {e}")),
            Err(_) => return Err(format!("{host}:{port}: no TLS handshake within {HANDSHAKE_TIMEOUT:?}")),
        };
        report(intercepted(None));
        let (sender, conn) = hyper::client::conn::http1::Builder::new()
            .handshake(TokioIo::new(tls))
            .await
            .map_err(|e| format!("{host}:{port}: {e}"))?;
        Ok((tokio::sync::Mutex::new(sender), tokio::spawn(conn.with_upgrades())))
    };
    // Without a connection upstream every request is answered 502, saying why.
    let (sender, conn) = match connected.await {
        Ok((sender, conn)) => (Ok(sender), Some(conn)),
        Err(why) => {
            report(intercepted(Some(why.clone())));
            (Err(why), None)
        }
    };
    let ctx = Arc::new(Forward {
        host: host.to_string(),
        secrets: broker.secrets.clone(),
        report: report.clone(),
        sender,
        upgraded: Mutex::new(None),
    });
    let service = {
        let ctx = ctx.clone();
        hyper::service::service_fn(move |req| forward(req, ctx.clone()))
    };
    let served = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .serve_connection(TokioIo::new(guest), service)
        .with_upgrades();
    tokio::select! {
        _ = served => {}
        _ = activity.idle_for(idle) => {}
    }
    // A protocol switch (a WebSocket) goes on unread until either end closes it.
    let upgraded = ctx.upgraded.lock().unwrap().take();
    if let Some(task) = upgraded {
        tokio::select! {
            _ = task => {}
            _ = activity.idle_for(idle) => {}
        }
    }
    if let Some(conn) = conn {
        conn.abort();
    }
    activity.counts()
}

type Body = BoxBody<Bytes, hyper::Error>;

struct Forward {
    host: String,
    secrets: SharedSecrets,
    report: Report,
    /// The connection upstream, or why there is none (every request is answered 502).
    sender: Result<tokio::sync::Mutex<hyper::client::conn::http1::SendRequest<Incoming>>, String>,
    upgraded: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// One request of the guest: its head rewritten, sent upstream, the response passed back.
async fn forward(req: Request<Incoming>, ctx: Arc<Forward>) -> Result<Response<Body>, Infallible> {
    let sender = match &ctx.sender {
        Ok(s) => s,
        Err(why) => return Ok(bad_gateway(why)),
    };
    let (mut parts, body) = req.into_parts();
    let rewrite = ctx.secrets.read().unwrap().rewrite(&ctx.host, &mut parts.uri, &mut parts.headers);
    for name in rewrite.used {
        (ctx.report)(EventKind::SecretUsed { name, host: ctx.host.clone() });
    }
    for name in rewrite.withheld {
        (ctx.report)(EventKind::SecretWithheld { name, host: ctx.host.clone() });
    }
    let mut req = Request::from_parts(parts, body);
    let guest_upgrade = req.headers().contains_key(hyper::header::UPGRADE).then(|| hyper::upgrade::on(&mut req));
    let sent = {
        let mut sender = sender.lock().await;
        match sender.ready().await {
            Ok(()) => sender.send_request(req).await,
            Err(e) => Err(e),
        }
    };
    let mut response = match sent {
        Ok(r) => r,
        Err(e) => return Ok(bad_gateway(&format!("{}: {e}", ctx.host))),
    };
    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
        if let Some(guest_side) = guest_upgrade {
            let host_side = hyper::upgrade::on(&mut response);
            let task = tokio::spawn(async move {
                if let (Ok(g), Ok(h)) = (guest_side.await, host_side.await) {
                    let _ = tokio::io::copy_bidirectional(&mut TokioIo::new(g), &mut TokioIo::new(h)).await;
                }
            });
            *ctx.upgraded.lock().unwrap() = Some(task);
        }
    }
    Ok(response.map(BodyExt::boxed))
}

/// The guest's answer when the proxy cannot carry its request: says why, in the body.
fn bad_gateway(why: &str) -> Response<Body> {
    let body = Full::new(Bytes::from(format!("umbra egress: {why}\n"))).map_err(|never| match never {}).boxed();
    let mut r = Response::new(body);
    *r.status_mut() = StatusCode::BAD_GATEWAY;
    r.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("text/plain"));
    r.headers_mut().insert(hyper::header::CONNECTION, hyper::header::HeaderValue::from_static("close"));
    r
}

/// Bytes each way and when anything last moved, for the `egress_closed` event and the idle
/// timeout.
struct Activity {
    start: Instant,
    sent: AtomicU64,
    received: AtomicU64,
    last_ms: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Self { start: Instant::now(), sent: AtomicU64::new(0), received: AtomicU64::new(0), last_ms: AtomicU64::new(0) }
    }

    fn touch(&self) {
        self.last_ms.store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    fn counts(&self) -> (u64, u64) {
        (self.sent.load(Ordering::Relaxed), self.received.load(Ordering::Relaxed))
    }

    /// Returns once nothing has moved either way for `idle`.
    async fn idle_for(&self, idle: Duration) {
        loop {
            let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
            let quiet = self.start.elapsed().saturating_sub(last);
            if quiet >= idle {
                return;
            }
            tokio::time::sleep((idle - quiet).max(Duration::from_millis(100))).await;
        }
    }
}

/// A stream that notes its traffic in an [`Activity`] (and counts it, on the destination's
/// side).
struct Watched<S> {
    inner: S,
    activity: Arc<Activity>,
    count: bool,
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = (buf.filled().len() - before) as u64;
        if n > 0 {
            self.activity.touch();
            if self.count {
                self.activity.received.fetch_add(n, Ordering::Relaxed);
            }
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = polled {
            self.activity.touch();
            if self.count {
                self.activity.sent.fetch_add(n as u64, Ordering::Relaxed);
            }
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A stream whose first bytes, already read, are given back before the rest.
struct Rewind<S> {
    pending: Vec<u8>,
    inner: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Rewind<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        if !self.pending.is_empty() {
            let n = self.pending.len().min(buf.remaining());
            buf.put_slice(&self.pending[..n]);
            self.pending.drain(..n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Rewind<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
