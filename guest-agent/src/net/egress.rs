//! The agent's end of an egress stream (`umbra_proto::egress`): one new stream to the host per
//! guest connection or DNS lookup, a request line, a reply line, then the connection's bytes.
//! Also the limits every listener shares, and the byte relay.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use umbra_proto::egress::{EgressProcess, EgressQuery, EgressRefusal, EgressReply, EgressRequest, MAX_EGRESS_LINE};

use super::fakeip::FakeIps;

/// Where egress streams go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EgressTarget {
    /// The host over vsock (CID 2, [`umbra_proto::egress::EGRESS_VSOCK_PORT`]).
    Vsock { cid: u32, port: u32 },
    /// A Unix socket: host-side tests stand in for the host with it.
    Unix(PathBuf),
}

impl std::str::FromStr for EgressTarget {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "vsock" {
            return Ok(Self::host());
        }
        if let Some(port) = s.strip_prefix("vsock:") {
            let port = port.parse().map_err(|_| format!("bad vsock port in {s:?}"))?;
            return Ok(Self::Vsock { cid: tokio_vsock::VMADDR_CID_HOST, port });
        }
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("unix: needs a path".into());
            }
            return Ok(Self::Unix(path.into()));
        }
        Err(format!("egress target {s:?} must be vsock, vsock:PORT or unix:PATH"))
    }
}

impl EgressTarget {
    pub fn host() -> Self {
        Self::Vsock { cid: tokio_vsock::VMADDR_CID_HOST, port: umbra_proto::egress::EGRESS_VSOCK_PORT }
    }
}

/// Bounds on what guest processes can make the agent hold.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Guest connections open at once (from accept to close), all listeners together.
    pub connections: usize,
    /// Of those, connections still in their handshake: the client has not sent its request
    /// yet, or the host has not answered.
    pub handshakes: usize,
    /// DNS lookups waiting for the host at once.
    pub lookups: usize,
    /// DNS-over-TCP connections at once.
    pub dns_tcp: usize,
    /// How long a client has for its request (HTTP head, SOCKS greeting and request).
    pub request_timeout: Duration,
    /// How long the host has to accept the stream and answer its request line.
    pub host_timeout: Duration,
    /// The same for a connection, which the host may hold while its user is asked (network
    /// mode `ask`, at most an hour).
    pub connect_timeout: Duration,
    /// Longest HTTP request head.
    pub max_http_head: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            connections: 2048,
            handshakes: 256,
            lookups: 128,
            dns_tcp: 32,
            request_timeout: Duration::from_secs(10),
            host_timeout: Duration::from_secs(15),
            connect_timeout: Duration::from_secs(3600 + 30),
            max_http_head: 32 * 1024,
        }
    }
}

/// Why a connection or lookup was not made, in the host's terms (plus our own failures, which
/// map onto them).
#[derive(Debug, Clone)]
pub struct Failure {
    pub refusal: EgressRefusal,
    pub reason: String,
}

impl Failure {
    fn new(refusal: EgressRefusal, reason: impl Into<String>) -> Self {
        Self { refusal, reason: reason.into() }
    }

    /// The agent's own limit was reached.
    pub fn busy(what: &str) -> Self {
        Self::new(EgressRefusal::Busy, format!("too many {what} in the guest agent"))
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.refusal {
            EgressRefusal::Denied => "denied",
            EgressRefusal::NotFound => "not found",
            EgressRefusal::Unreachable => "unreachable",
            EgressRefusal::Busy => "busy",
            EgressRefusal::BadRequest => "bad request",
        };
        write!(f, "{kind}: {}", self.reason)
    }
}

/// A stream to the host.
pub enum HostStream {
    Vsock(tokio_vsock::VsockStream),
    Unix(tokio::net::UnixStream),
}

impl AsyncRead for HostStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Vsock(s) => Pin::new(s).poll_read(cx, buf),
            Self::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for HostStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Vsock(s) => Pin::new(s).poll_write(cx, buf),
            Self::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Vsock(s) => Pin::new(s).poll_flush(cx),
            Self::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }
    /// A half-close: shutdown(SHUT_WR) on either kind.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Vsock(s) => Pin::new(s).poll_shutdown(cx),
            Self::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// An accepted guest connection's claim on the limits: released when dropped.
pub struct Admission {
    _connection: OwnedSemaphorePermit,
    handshake: Option<OwnedSemaphorePermit>,
}

impl Admission {
    /// The handshake is over (the relay starts, or the connection is being closed).
    pub fn handshake_done(&mut self) {
        self.handshake = None;
    }
}

/// A host connection that said yes, with the bytes the host sent after its reply line.
pub struct Connected {
    pub stream: HostStream,
    pub pending: Vec<u8>,
}

/// Shared by every listener: where to go, the limits, the fake address table.
pub struct Egress {
    target: EgressTarget,
    pub limits: Limits,
    pub fake_ips: Arc<FakeIps>,
    connections: Arc<Semaphore>,
    handshakes: Arc<Semaphore>,
    lookups: Arc<Semaphore>,
}

impl Egress {
    pub fn new(target: EgressTarget, limits: Limits, fake_ips: Arc<FakeIps>) -> Self {
        Self {
            target,
            connections: Arc::new(Semaphore::new(limits.connections)),
            handshakes: Arc::new(Semaphore::new(limits.handshakes)),
            lookups: Arc::new(Semaphore::new(limits.lookups)),
            limits,
            fake_ips,
        }
    }

    /// Admits a newly accepted connection, or says which limit is reached.
    pub fn admit(&self) -> Result<Admission, Failure> {
        let connection =
            self.connections.clone().try_acquire_owned().map_err(|_| Failure::busy("open egress connections"))?;
        let handshake =
            self.handshakes.clone().try_acquire_owned().map_err(|_| Failure::busy("pending egress handshakes"))?;
        Ok(Admission { _connection: connection, handshake: Some(handshake) })
    }

    /// The name to ask the host for when a client gave an IPv4 address: the name behind a fake
    /// address, the literal otherwise. A fake address that stands for nothing (evicted, or
    /// never handed out) is unreachable.
    pub fn name_for_v4(&self, ip: std::net::Ipv4Addr) -> Result<String, Failure> {
        if super::fakeip::is_fake(ip) {
            return self.fake_ips.name_for(ip).ok_or_else(|| {
                Failure::new(EgressRefusal::Unreachable, format!("{ip} stands for no name (an old DNS answer?)"))
            });
        }
        Ok(ip.to_string())
    }

    /// Asks the host whether `name` may be used (a DNS lookup).
    pub async fn resolve(&self, name: &str) -> Result<(), Failure> {
        let _permit = self.lookups.try_acquire().map_err(|_| Failure::busy("pending DNS lookups"))?;
        let request = EgressRequest::Resolve { name: name.to_string() };
        self.ask(&request, self.limits.host_timeout, None).await.map(drop)
    }

    /// Asks the host for a connection; on success the stream carries it. `client` is the
    /// guest program's address, when the connection has one: if the host asks which process
    /// opened it (a `connect` with `who`), the agent looks it up.
    pub async fn connect(&self, request: &EgressRequest, client: Option<SocketAddr>) -> Result<Connected, Failure> {
        self.ask(request, self.limits.connect_timeout, client).await
    }

    async fn ask(
        &self,
        request: &EgressRequest,
        timeout: Duration,
        client: Option<SocketAddr>,
    ) -> Result<Connected, Failure> {
        match tokio::time::timeout(timeout, self.ask_inner(request, client)).await {
            Ok(r) => r,
            Err(_) => {
                Err(Failure::new(EgressRefusal::Unreachable, format!("the host did not answer within {timeout:?}")))
            }
        }
    }

    async fn ask_inner(&self, request: &EgressRequest, client: Option<SocketAddr>) -> Result<Connected, Failure> {
        let line = request.to_line();
        if line.len() > MAX_EGRESS_LINE {
            return Err(Failure::new(EgressRefusal::BadRequest, "the request is too long"));
        }
        let unreachable = |what: &str, e: io::Error| {
            Failure::new(EgressRefusal::Unreachable, format!("no egress proxy on the host ({what}: {e})"))
        };
        let mut stream = match &self.target {
            EgressTarget::Vsock { cid, port } => {
                let addr = tokio_vsock::VsockAddr::new(*cid, *port);
                HostStream::Vsock(
                    tokio_vsock::VsockStream::connect(addr)
                        .await
                        .map_err(|e| unreachable(&format!("vsock {cid}:{port}"), e))?,
                )
            }
            EgressTarget::Unix(path) => HostStream::Unix(
                tokio::net::UnixStream::connect(path).await.map_err(|e| unreachable(&path.display().to_string(), e))?,
            ),
        };
        stream.write_all(&line).await.map_err(|e| unreachable("sending the request", e))?;
        let who = matches!(request, EgressRequest::Connect { who: true, .. });
        let mut buf = Vec::new();
        let mut line = read_line(&mut stream, &mut buf).await?;
        // At most one question, and only when the request offered to answer it.
        if let (true, Ok(EgressQuery::Process)) = (who, serde_json::from_slice::<EgressQuery>(&line)) {
            let process = match client {
                Some(peer) => tokio::task::spawn_blocking(move || super::who::process_of(Path::new("/proc"), peer))
                    .await
                    .unwrap_or_default(),
                None => EgressProcess::default(),
            };
            stream.write_all(&process.to_line()).await.map_err(|e| unreachable("answering the host", e))?;
            line = read_line(&mut stream, &mut buf).await?;
        }
        let reply: EgressReply = serde_json::from_slice(&line).map_err(|e| {
            Failure::new(EgressRefusal::Unreachable, format!("the host's reply is not understood: {e}"))
        })?;
        let pending = buf;
        if reply.ok {
            return Ok(Connected { stream, pending });
        }
        let refusal = reply.refusal.unwrap_or(EgressRefusal::Denied);
        Err(Failure::new(refusal, reply.reason.unwrap_or_else(|| "refused by the host".into())))
    }
}

/// Reads one line from the host (at most [`MAX_EGRESS_LINE`] bytes with its newline) and
/// returns it without the newline; `buf` holds what followed it in the same reads.
async fn read_line(stream: &mut HostStream, buf: &mut Vec<u8>) -> Result<Vec<u8>, Failure> {
    let bad = |why: String| Failure::new(EgressRefusal::Unreachable, why);
    let mut chunk = [0u8; 4096];
    let mut searched = 0;
    loop {
        if let Some(pos) = buf[searched..].iter().position(|&b| b == b'\n').map(|p| p + searched) {
            if pos + 1 > MAX_EGRESS_LINE {
                return Err(bad(format!("the host's reply is longer than {MAX_EGRESS_LINE} bytes")));
            }
            let rest = buf.split_off(pos + 1);
            let mut line = std::mem::replace(buf, rest);
            line.pop();
            return Ok(line);
        }
        if buf.len() >= MAX_EGRESS_LINE {
            return Err(bad(format!("the host's reply is longer than {MAX_EGRESS_LINE} bytes")));
        }
        searched = buf.len();
        let n = stream.read(&mut chunk).await.map_err(|e| bad(format!("reading the host's reply: {e}")))?;
        if n == 0 {
            return Err(bad("the host closed the stream without a reply".into()));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// How long a connection whose guest end has closed its sending side still waits for the
/// host's bytes. The backends' vsock (vhost-device-vsock, like virtio-vsock's host ends in
/// general) does not pass a half-close on: the host end would never hear that the guest is
/// done, and a connection the guest program closed would stay open until the host's idle
/// timeout. So after the guest's end of stream the relay keeps delivering what the host sends
/// — a response to a request that was half-closed still arrives — and closes both ends once the
/// host has been silent this long.
pub const HALF_CLOSED_LINGER: Duration = Duration::from_secs(5);

/// Carries bytes both ways between a guest connection and its host stream until both
/// directions are done. `to_host` and `to_client` are bytes already read from the other side
/// (a request's body, what followed the host's reply). The guest's end of stream is passed on
/// as a write shutdown and ends the connection after [`HALF_CLOSED_LINGER`] of host silence;
/// the host's end of stream ends it at once (the host's half-close arrives as a full shutdown).
/// An error on either side ends both.
pub async fn relay<C>(client: &mut C, host: &mut HostStream, to_host: &[u8], to_client: &[u8]) -> io::Result<()>
where
    C: AsyncRead + AsyncWrite + Unpin,
{
    if !to_host.is_empty() {
        host.write_all(to_host).await?;
    }
    if !to_client.is_empty() {
        client.write_all(to_client).await?;
    }
    let (mut cr, mut cw) = tokio::io::split(client);
    let (mut hr, mut hw) = tokio::io::split(host);
    let mut up = vec![0u8; 64 * 1024];
    let mut down = vec![0u8; 64 * 1024];
    let mut client_open = true;
    loop {
        tokio::select! {
            r = cr.read(&mut up), if client_open => match r? {
                0 => {
                    client_open = false;
                    let _ = hw.shutdown().await;
                }
                n => hw.write_all(&up[..n]).await?,
            },
            r = hr.read(&mut down) => match r? {
                0 => {
                    let _ = cw.shutdown().await;
                    return Ok(());
                }
                n => cw.write_all(&down[..n]).await?,
            },
            () = tokio::time::sleep(HALF_CLOSED_LINGER), if !client_open => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse() {
        assert_eq!("vsock".parse::<EgressTarget>().unwrap(), EgressTarget::host());
        assert_eq!("vsock:77".parse::<EgressTarget>().unwrap(), EgressTarget::Vsock { cid: 2, port: 77 });
        assert_eq!("unix:/x".parse::<EgressTarget>().unwrap(), EgressTarget::Unix("/x".into()));
        assert!("unix:".parse::<EgressTarget>().is_err());
        assert!("tcp:1".parse::<EgressTarget>().is_err());
    }

    async fn reply_from(bytes: &[u8]) -> Result<(EgressReply, Vec<u8>), Failure> {
        let (a, mut b) = tokio::net::UnixStream::pair().unwrap();
        b.write_all(bytes).await.unwrap();
        drop(b);
        let mut buf = Vec::new();
        let line = read_line(&mut HostStream::Unix(a), &mut buf).await?;
        let reply =
            serde_json::from_slice(&line).map_err(|e| Failure::new(EgressRefusal::Unreachable, e.to_string()))?;
        Ok((reply, buf))
    }

    #[tokio::test]
    async fn replies_are_bounded_and_keep_what_follows() {
        let (r, rest) = reply_from(b"{\"ok\":true}\nHTTP/1.1 200").await.unwrap();
        assert!(r.ok);
        assert_eq!(rest, b"HTTP/1.1 200");
        let (r, _) = reply_from(b"{\"ok\":false,\"refusal\":\"denied\",\"reason\":\"no\"}\n").await.unwrap();
        assert_eq!(r.refusal, Some(EgressRefusal::Denied));
        assert!(reply_from(b"{\"ok\":true}").await.is_err(), "no newline before the close");
        assert!(reply_from(&vec![b' '; MAX_EGRESS_LINE + 10]).await.is_err(), "too long");
        assert!(reply_from(b"nonsense\n").await.is_err());
    }
}
