//! The host end of a VM's egress: a listener on the VM's `vsock.sock_1026` (where the backend
//! delivers guest connections to host port 1026), one task per guest stream.
//!
//! Per stream: read the request line (bounded, with a deadline), decide by name, resolve on
//! the host (or take the policy's override), check every address, connect to the one checked
//! (never resolving again), answer, then carry bytes both ways until either side is done or the
//! connection has been idle too long. Every decision is reported as an event; closed
//! connections report their byte counts. At most [`EgressLimits::max_connections`] streams are
//! handled at once: beyond that a stream is answered `busy` and closed, so a guest opening
//! thousands of connections holds a bounded number of host file descriptors.
//!
//! Name resolution (`getaddrinfo`, which blocks) runs on the runtime's blocking pool, which
//! every session shares: at most [`EgressLimits::max_lookups`] lookups of one VM run at once
//! (a lookup holds its slot until `getaddrinfo` really returns, even after the guest was told
//! it timed out), so a guest asking for names whose DNS never answers occupies a few blocking
//! threads of its own and never stalls the other sessions.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpStream, UnixListener, UnixStream};
use tokio::sync::Semaphore;
use umbra_api::EventKind;
use umbra_proto::egress::{EgressProcess, EgressQuery, EgressReply, EgressRequest, EgressVia, MAX_EGRESS_LINE};

use super::intercept::Broker;
use super::policy::{normalise, HostAddresses, Policy, Refusal};
use super::secrets::Scanner;

/// A policy the session can replace while the VM runs: new connections follow it.
pub type SharedPolicy = Arc<RwLock<Policy>>;

use super::report::Report;

/// How the host resolves a name: a blocking call, run on the blocking pool within the VM's
/// lookup slots. [`system_resolver`] (`getaddrinfo`) unless a test needs a resolver that
/// stalls on purpose (no DNS server can be pointed at without changing the machine's).
pub type Resolver = Arc<dyn Fn(&str, u16) -> std::io::Result<Vec<IpAddr>> + Send + Sync>;

/// The system's resolver (`getaddrinfo`: /etc/hosts, DNS, whatever nsswitch says).
pub fn system_resolver() -> Resolver {
    Arc::new(|name, port| {
        use std::net::ToSocketAddrs;
        Ok((name, port).to_socket_addrs()?.map(|a| a.ip()).collect())
    })
}

#[derive(Clone)]
pub struct EgressLimits {
    /// Streams handled at once per VM (each costs two host sockets; see
    /// `umbra_sys::raise_nofile_limit`).
    pub max_connections: usize,
    /// Name lookups running at once per VM (each holds a thread of the shared blocking pool
    /// until it returns); more wait for a slot, within `resolve_timeout`.
    pub max_lookups: usize,
    /// How long the guest has to send its request line.
    pub request_timeout: Duration,
    /// How long the guest waits for a name to resolve, its wait for a lookup slot included.
    pub resolve_timeout: Duration,
    pub connect_timeout: Duration,
    /// A connection with no bytes either way for this long is closed.
    pub idle_timeout: Duration,
    pub resolver: Resolver,
}

impl std::fmt::Debug for EgressLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EgressLimits")
            .field("max_connections", &self.max_connections)
            .field("max_lookups", &self.max_lookups)
            .field("request_timeout", &self.request_timeout)
            .field("resolve_timeout", &self.resolve_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .finish_non_exhaustive()
    }
}

impl Default for EgressLimits {
    fn default() -> Self {
        Self {
            max_connections: 2048,
            max_lookups: 8,
            request_timeout: Duration::from_secs(10),
            resolve_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(300),
            resolver: system_resolver(),
        }
    }
}

/// A running egress proxy; stops (and drops every connection) when dropped.
pub struct EgressProxy {
    task: tokio::task::JoinHandle<()>,
    socket: PathBuf,
}

impl EgressProxy {
    /// Listens on `socket` (the backend's `<vsock socket>_1026`). With a `broker`, requests to
    /// the hosts its secrets are bound to are read and given their values.
    pub fn start(
        socket: &Path,
        policy: SharedPolicy,
        broker: Option<Broker>,
        report: Report,
        limits: EgressLimits,
    ) -> std::io::Result<Self> {
        let _ = std::fs::remove_file(socket);
        let listener = UnixListener::bind(socket)?;
        crate::backend::open_to_vmm(socket)?;
        let task = tokio::spawn(serve(listener, policy, broker.map(Arc::new), report, Arc::new(limits)));
        Ok(Self { task, socket: socket.to_path_buf() })
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }
}

impl Drop for EgressProxy {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.socket);
    }
}

async fn serve(
    listener: UnixListener,
    policy: SharedPolicy,
    broker: Option<Arc<Broker>>,
    report: Report,
    limits: Arc<EgressLimits>,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let lookups = Arc::new(Semaphore::new(limits.max_lookups.max(1)));
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!("egress: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            // Reap finished connection tasks as they end.
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        match slots.clone().try_acquire_owned() {
            Ok(slot) => {
                let (policy, broker, report, limits, lookups) =
                    (policy.clone(), broker.clone(), report.clone(), limits.clone(), lookups.clone());
                connections.spawn(async move {
                    handle(stream, &policy, broker.as_deref(), &report, &limits, &lookups).await;
                    drop(slot);
                });
            }
            Err(_) => {
                let max = limits.max_connections;
                // Answered without reading: the guest hears "busy" and the stream closes.
                connections.spawn(async move {
                    let mut stream = stream;
                    let no = EgressReply::refused(
                        umbra_proto::egress::EgressRefusal::Busy,
                        format!("{max} connections are open for this VM"),
                    );
                    let _ = tokio::time::timeout(Duration::from_secs(1), stream.write_all(&no.to_line())).await;
                });
            }
        }
    }
}

/// Reads the request line: at most [`MAX_EGRESS_LINE`] bytes, before the deadline.
async fn read_request(reader: &mut BufReader<UnixStream>, timeout: Duration) -> Result<EgressRequest, String> {
    EgressRequest::parse(&read_line(reader, timeout, "request").await?)
}

/// Reads one line from the guest (at most [`MAX_EGRESS_LINE`] bytes) before the deadline, and
/// returns it without its newline.
async fn read_line(reader: &mut BufReader<UnixStream>, timeout: Duration, what: &str) -> Result<Vec<u8>, String> {
    let mut line = Vec::new();
    let mut limited = (&mut *reader).take(MAX_EGRESS_LINE as u64);
    match tokio::time::timeout(timeout, limited.read_until(b'\n', &mut line)).await {
        Err(_) => return Err(format!("no {what} within {timeout:?}")),
        Ok(Err(e)) => return Err(format!("cannot read the {what}: {e}")),
        Ok(Ok(_)) => {}
    }
    if line.last() != Some(&b'\n') {
        return Err(format!("the {what} line is unterminated or longer than {MAX_EGRESS_LINE} bytes"));
    }
    line.pop();
    Ok(line)
}

/// How long the agent has to say which process opened a connection (a scan of its `/proc`).
const WHO_TIMEOUT: Duration = Duration::from_secs(10);

/// Asks the agent which guest process opened the connection (it offered to say: `who`), and
/// returns its answer made safe to show. A stream that does not answer in kind is refused:
/// whatever it sends later would otherwise be taken for the connection's bytes.
async fn which_process(reader: &mut BufReader<UnixStream>) -> Result<EgressProcess, String> {
    reader
        .get_mut()
        .write_all(&EgressQuery::Process.to_line())
        .await
        .map_err(|e| format!("asking which process: {e}"))?;
    let line = read_line(reader, WHO_TIMEOUT, "answer naming the process").await?;
    let process: EgressProcess =
        serde_json::from_slice(&line).map_err(|e| format!("the answer naming the process is not understood: {e}"))?;
    Ok(process.tidy())
}

/// The addresses the host will consider for `name`: the policy's override, the literal itself,
/// or the host's own resolution — in one of the VM's `lookups` slots, which the lookup keeps
/// until it returns (the guest's wait ends at `limits.resolve_timeout` either way).
async fn addresses(
    name: &str,
    port: u16,
    policy: &Policy,
    limits: &EgressLimits,
    lookups: &Arc<Semaphore>,
) -> Result<Vec<IpAddr>, String> {
    if let Some(addr) = policy.override_for(name) {
        return Ok(vec![addr]);
    }
    if let Ok(addr) = name.parse::<IpAddr>() {
        return Ok(vec![addr]);
    }
    let timeout = limits.resolve_timeout;
    let lookup = async {
        let slot = lookups.clone().acquire_owned().await.expect("never closed");
        let (resolver, owned) = (limits.resolver.clone(), name.to_string());
        tokio::task::spawn_blocking(move || {
            let _slot = slot;
            resolver(&owned, port)
        })
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(format!("the lookup failed: {e}"))))
    };
    match tokio::time::timeout(timeout, lookup).await {
        Err(_) => Err(format!("resolving {name} took longer than {timeout:?}")),
        Ok(Err(e)) => Err(format!("{name} does not resolve: {e}")),
        Ok(Ok(found)) => {
            let mut addrs: Vec<IpAddr> = Vec::new();
            for a in found {
                if !addrs.contains(&a) {
                    addrs.push(a);
                }
            }
            Ok(addrs)
        }
    }
}

/// The resolved addresses the policy lets the host connect to; the refusal of the first one
/// when there are none. The host's own addresses are listed now, so an interface that came up
/// since the last connection is covered; when they cannot be listed nothing is permitted.
fn permitted(addrs: Vec<IpAddr>, policy: &Policy) -> Result<Vec<IpAddr>, Refusal> {
    let host = HostAddresses::current().map_err(|e| Refusal(e.to_string()))?;
    permitted_with(addrs, policy, &host)
}

fn permitted_with(addrs: Vec<IpAddr>, policy: &Policy, host: &HostAddresses) -> Result<Vec<IpAddr>, Refusal> {
    let mut first_refusal = None;
    let ok: Vec<IpAddr> = addrs
        .into_iter()
        .filter(|a| match policy.check_address(*a, host) {
            Ok(()) => true,
            Err(r) => {
                first_refusal.get_or_insert(r);
                false
            }
        })
        .collect();
    match (ok.is_empty(), first_refusal) {
        (true, Some(r)) => Err(r),
        _ => Ok(ok),
    }
}

async fn handle(
    stream: UnixStream,
    policy: &SharedPolicy,
    broker: Option<&Broker>,
    report: &Report,
    limits: &EgressLimits,
    lookups: &Arc<Semaphore>,
) {
    use umbra_proto::egress::EgressRefusal as R;
    let mut reader = BufReader::new(stream);
    let request = match read_request(&mut reader, limits.request_timeout).await {
        Ok(r) => r,
        Err(why) => {
            tracing::debug!("egress: {why}");
            let _ = reader.get_mut().write_all(&EgressReply::refused(R::BadRequest, why).to_line()).await;
            return;
        }
    };
    // The session's SSH agent: not a connection out, so not the network policy's to decide.
    if matches!(request, EgressRequest::SshAgent) {
        let keys = broker.map(|b| b.ssh_keys.clone()).filter(|k| !k.read().unwrap().is_empty());
        let Some(keys) = keys else {
            let no = EgressReply::refused(R::Denied, "the session holds no SSH key");
            let _ = reader.get_mut().write_all(&no.to_line()).await;
            return;
        };
        if reader.get_mut().write_all(&EgressReply::ok().to_line()).await.is_ok() {
            super::ssh_agent::serve(reader, keys, report.clone()).await;
        }
        return;
    }
    // The policy as it is now: a change applies to the next connection.
    let policy = policy.read().unwrap().clone();
    let (name, port, via) = match &request {
        EgressRequest::Connect { name, port, via, .. } => (normalise(name), *port, *via),
        EgressRequest::Resolve { name } => (normalise(name), 0, EgressVia::Dns),
        EgressRequest::SshAgent => unreachable!("served above"),
    };
    let decision = |allowed: bool, reason: Option<String>, address: Option<String>| EventKind::Egress {
        name: name.clone(),
        port,
        via,
        allowed,
        reason,
        address,
    };
    macro_rules! refuse {
        ($refusal:expr, $why:expr) => {{
            let why: String = $why;
            report(decision(false, Some(why.clone()), None));
            let _ = reader.into_inner().write_all(&EgressReply::refused($refusal, why).to_line()).await;
            return;
        }};
    }
    if let Err(r) = policy.decide_name(&name) {
        // Mode `ask`: a well-formed name (or address) outside the allowlist is asked about.
        let askable = umbra_api::session::is_host_name(&name) || name.parse::<IpAddr>().is_ok();
        let gate = broker.and_then(|b| b.ask.as_deref()).filter(|_| askable);
        match (gate, policy.ask_timeout()) {
            // A lookup is answered at once (the guest gets a fake address): the question
            // comes with the connection, which names a port.
            (Some(_), Some(_)) if matches!(request, EgressRequest::Resolve { .. }) => {
                report(decision(true, Some("to be asked about when connected to".into()), None));
                let _ = reader.into_inner().write_all(&EgressReply::ok().to_line()).await;
                return;
            }
            (Some(gate), Some(timeout)) => {
                // Whom the question is about, when the agent can say (and it will be asked).
                let mut process = None;
                if matches!(request, EgressRequest::Connect { who: true, .. }) && !gate.approved(&name) {
                    match which_process(&mut reader).await {
                        Ok(p) => process = Some(p).filter(|p| p.pid.is_some() || !p.command.is_empty()),
                        Err(why) => refuse!(R::BadRequest, format!("{name}: {why}")),
                    }
                }
                let question = super::ask::Question { host: name.clone(), port, via, process };
                if let Err(why) = gate.check(question, timeout).await {
                    refuse!(R::Denied, format!("{name}: {why}"));
                }
            }
            _ => refuse!(R::Denied, r.0),
        }
    }
    let via_proxy = broker.and_then(|b| b.upstream_proxy.as_ref()).filter(|p| p.applies_to(&name));
    let (upstream, target) = match via_proxy {
        // The proxy resolves the name: only an address the host itself picked is checked
        // here (a literal, a `resolve` pin).
        Some(proxy) => {
            let pinned = policy.override_for(&name).or_else(|| name.parse::<IpAddr>().ok());
            if let Some(addr) = pinned {
                if let Err(r) = permitted(vec![addr], &policy) {
                    refuse!(R::Denied, format!("{name}: {r}"));
                }
            }
            if matches!(request, EgressRequest::Resolve { .. }) {
                report(decision(true, None, Some(format!("through the upstream proxy {}", proxy.address()))));
                let _ = reader.into_inner().write_all(&EgressReply::ok().to_line()).await;
                return;
            }
            let to = pinned.map_or_else(|| name.clone(), |a| a.to_string());
            match proxy.connect(&to, port, limits.connect_timeout).await {
                Ok(s) => (s, format!("{to}:{port} through the upstream proxy {}", proxy.address())),
                Err(why) => refuse!(R::Unreachable, format!("cannot connect to {name}:{port}: {why}")),
            }
        }
        None => {
            let addrs = match addresses(&name, port.max(1), &policy, limits, lookups).await {
                Ok(a) if a.is_empty() => refuse!(R::NotFound, format!("{name} has no address")),
                Ok(a) => a,
                Err(why) => refuse!(R::NotFound, why),
            };
            let addrs = match permitted(addrs, &policy) {
                Ok(a) => a,
                Err(r) => refuse!(R::Denied, format!("{name}: {r}")),
            };
            if matches!(request, EgressRequest::Resolve { .. }) {
                report(decision(true, None, Some(addrs[0].to_string())));
                let _ = reader.into_inner().write_all(&EgressReply::ok().to_line()).await;
                return;
            }
            // Connect to an address that was checked, in the order the resolver gave them.
            let mut last_error = String::new();
            let mut upstream = None;
            for addr in &addrs {
                let target = SocketAddr::new(*addr, port);
                match tokio::time::timeout(limits.connect_timeout, TcpStream::connect(target)).await {
                    Ok(Ok(s)) => {
                        // What the guest sends is already in whole writes; a TLS handshake the
                        // proxy makes itself must not wait out a delayed ACK.
                        let _ = s.set_nodelay(true);
                        upstream = Some((s, target.to_string()));
                        break;
                    }
                    Ok(Err(e)) => last_error = format!("{target}: {e}"),
                    Err(_) => last_error = format!("{target}: no answer within {:?}", limits.connect_timeout),
                }
            }
            match upstream {
                Some(u) => u,
                None => refuse!(R::Unreachable, format!("cannot connect to {name}:{port} ({last_error})")),
            }
        }
    };
    report(decision(true, None, Some(target)));
    let started = Instant::now();
    // Bytes the guest sent after its request line are already in the reader's buffer.
    let buffered = reader.buffer().to_vec();
    let mut guest = reader.into_inner();
    if guest.write_all(&EgressReply::ok().to_line()).await.is_err() {
        return;
    }
    let idle = limits.idle_timeout;
    let (secrets_bound, placeholders) = match broker {
        Some(b) => {
            let secrets = b.secrets.read().unwrap();
            // A passthrough name keeps its TLS end to end, a secret bound to it or not.
            (secrets.bound_to(&name) && !policy.tls_passthrough(&name), secrets.placeholders())
        }
        None => (false, Vec::new()),
    };
    let (sent, received) = match broker {
        // A host a secret is bound to: its requests are read if the guest speaks TLS to it.
        Some(broker) if secrets_bound => {
            let (tls, pending) = super::intercept::guest_opens_tls(&mut guest, &upstream, buffered, idle).await;
            if tls {
                super::intercept::carry(guest, pending, upstream, (&name, port), broker, report, idle).await
            } else {
                pump(guest, upstream, pending, idle, Scanner::new(placeholders), |n| withheld(report, n, &name)).await
            }
        }
        _ => pump(guest, upstream, buffered, idle, Scanner::new(placeholders), |n| withheld(report, n, &name)).await,
    };
    report(EventKind::EgressClosed {
        name,
        port,
        bytes_sent: sent,
        bytes_received: received,
        duration_ms: started.elapsed().as_millis() as u64,
    });
}

fn withheld(report: &Report, secret: String, host: &str) {
    report(EventKind::SecretWithheld { name: secret, host: host.to_string() });
}

/// Carries bytes both ways until both directions are done (each end's EOF is passed on as a
/// write shutdown) or nothing moved for `idle`. Returns (guest → destination, destination →
/// guest) byte counts. What the guest sends is scanned for secrets' placeholders, each found
/// passed to `found` (the bytes go on unchanged).
async fn pump<G, D>(
    guest: G,
    dest: D,
    pending: Vec<u8>,
    idle: Duration,
    mut scanner: Scanner,
    found: impl Fn(String),
) -> (u64, u64)
where
    G: AsyncRead + AsyncWrite + Unpin,
    D: AsyncRead + AsyncWrite + Unpin,
{
    let (mut gr, mut gw) = tokio::io::split(guest);
    let (mut dr, mut dw) = tokio::io::split(dest);
    let (mut sent, mut received) = (0u64, 0u64);
    if !pending.is_empty() {
        scanner.feed(&pending).into_iter().for_each(&found);
        if dw.write_all(&pending).await.is_err() {
            return (0, 0);
        }
        sent += pending.len() as u64;
    }
    let mut up = vec![0u8; 64 * 1024];
    let mut down = vec![0u8; 64 * 1024];
    let (mut up_open, mut down_open) = (true, true);
    while up_open || down_open {
        let moved = tokio::time::timeout(idle, async {
            tokio::select! {
                r = gr.read(&mut up), if up_open => match r {
                    Ok(0) | Err(_) => { up_open = false; let _ = dw.shutdown().await; Ok(()) }
                    Ok(n) => {
                        scanner.feed(&up[..n]).into_iter().for_each(&found);
                        dw.write_all(&up[..n]).await.map(|()| sent += n as u64)
                    }
                },
                r = dr.read(&mut down), if down_open => match r {
                    Ok(0) | Err(_) => { down_open = false; let _ = gw.shutdown().await; Ok(()) }
                    Ok(n) => gw.write_all(&down[..n]).await.map(|()| received += n as u64),
                },
            }
        })
        .await;
        match moved {
            Ok(Ok(())) => {}
            // A write failed (the other side is gone) or nothing moved for too long.
            Ok(Err(_)) | Err(_) => break,
        }
    }
    (sent, received)
}

#[cfg(test)]
mod tests {
    use super::*;
    use umbra_api::session::{NetworkMode, NetworkPolicy};
    use umbra_proto::egress::EgressRefusal;

    struct Harness {
        _dir: tempfile::TempDir,
        socket: PathBuf,
        events: Arc<std::sync::Mutex<Vec<EventKind>>>,
        policy: SharedPolicy,
        _proxy: EgressProxy,
    }

    fn harness(p: NetworkPolicy, limits: EgressLimits) -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("vsock.sock_1026");
        let events = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = events.clone();
        let policy: SharedPolicy = Arc::new(RwLock::new(Policy::new(&p)));
        let report: Report = Arc::new(move |e| sink.lock().unwrap().push(e));
        let proxy = EgressProxy::start(&socket, policy.clone(), None, report, limits).unwrap();
        Harness { _dir: dir, socket, events, policy, _proxy: proxy }
    }

    async fn ask(socket: &Path, request: &EgressRequest) -> (EgressReply, BufReader<UnixStream>) {
        let mut s = UnixStream::connect(socket).await.unwrap();
        s.write_all(&request.to_line()).await.unwrap();
        let mut r = BufReader::new(s);
        let mut line = String::new();
        r.read_line(&mut line).await.unwrap();
        (serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}")), r)
    }

    fn connect(name: &str, port: u16) -> EgressRequest {
        EgressRequest::Connect { name: name.into(), port, via: EgressVia::Transparent, who: false }
    }

    fn local_policy(mode: NetworkMode, domains: &[&str]) -> NetworkPolicy {
        let mut p = NetworkPolicy {
            mode,
            allow_domains: domains.iter().map(|d| d.to_string()).collect(),
            allow_cidrs: vec!["127.0.0.1/32".into()],
            ..Default::default()
        };
        p.resolve.insert("allowed.test".into(), "127.0.0.1".parse().unwrap());
        p.resolve.insert("denied.test".into(), "127.0.0.1".parse().unwrap());
        p
    }

    /// An echo server on 127.0.0.1 that reports what it got once the client is done.
    async fn echo_server() -> (u16, tokio::task::JoinHandle<Vec<u8>>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut got = Vec::new();
            s.read_to_end(&mut got).await.unwrap();
            s.write_all(b"echo:").await.unwrap();
            s.write_all(&got).await.unwrap();
            got
        });
        (port, task)
    }

    #[tokio::test]
    async fn an_allowed_name_is_connected_and_its_bytes_counted() {
        let h = harness(local_policy(NetworkMode::Allowlist, &["allowed.test"]), EgressLimits::default());
        let (port, server) = echo_server().await;
        let (reply, mut stream) = ask(&h.socket, &connect("Allowed.Test", port)).await;
        assert!(reply.ok, "{reply:?}");
        stream.get_mut().write_all(b"hello").await.unwrap();
        stream.get_mut().shutdown().await.unwrap();
        let mut back = Vec::new();
        stream.read_to_end(&mut back).await.unwrap();
        assert_eq!(back, b"echo:hello");
        assert_eq!(server.await.unwrap(), b"hello");
        tokio::time::sleep(Duration::from_millis(50)).await;
        let events = h.events.lock().unwrap().clone();
        assert!(
            matches!(&events[0], EventKind::Egress { name, allowed: true, address: Some(a), .. }
                if name == "allowed.test" && a == &format!("127.0.0.1:{port}")),
            "{events:?}"
        );
        assert!(matches!(&events[1], EventKind::EgressClosed { bytes_sent: 5, bytes_received: 10, .. }), "{events:?}");
    }

    #[tokio::test]
    async fn refusals_are_answered_and_reported_without_connecting() {
        let h = harness(local_policy(NetworkMode::Allowlist, &["allowed.test"]), EgressLimits::default());
        let (reply, _) = ask(&h.socket, &connect("denied.test", 80)).await;
        assert_eq!(reply.refusal, Some(EgressRefusal::Denied));
        assert!(reply.reason.unwrap().contains("allowlist"));
        // Resolve requests get the same answer (the guest's DNS answers only allowed names).
        let (reply, _) = ask(&h.socket, &EgressRequest::Resolve { name: "denied.test".into() }).await;
        assert_eq!(reply.refusal, Some(EgressRefusal::Denied));
        let (reply, _) = ask(&h.socket, &EgressRequest::Resolve { name: "allowed.test".into() }).await;
        assert!(reply.ok);
        // A private address named by an override is refused without the CIDR, and nothing is
        // sent to it (the connect never happens: decision first).
        *h.policy.write().unwrap() = Policy::new(&NetworkPolicy {
            allow_cidrs: vec![],
            ..local_policy(NetworkMode::Allowlist, &["allowed.test"])
        });
        let (reply, _) = ask(&h.socket, &connect("allowed.test", 9)).await;
        assert_eq!(reply.refusal, Some(EgressRefusal::Denied), "{reply:?}");
        assert!(reply.reason.unwrap().contains("loopback"));
        // Mode none refuses everything.
        *h.policy.write().unwrap() = Policy::new(&NetworkPolicy::default());
        let (reply, _) = ask(&h.socket, &connect("allowed.test", 9)).await;
        assert_eq!(reply.refusal, Some(EgressRefusal::Denied));
        let denied =
            h.events.lock().unwrap().iter().filter(|e| matches!(e, EventKind::Egress { allowed: false, .. })).count();
        assert_eq!(denied, 4);
    }

    #[tokio::test]
    async fn malformed_slow_and_excess_streams_are_bounded() {
        let limits =
            EgressLimits { max_connections: 2, request_timeout: Duration::from_millis(300), ..Default::default() };
        let h = harness(local_policy(NetworkMode::Any, &[]), limits);
        let mut s = UnixStream::connect(&h.socket).await.unwrap();
        s.write_all(b"not json\n").await.unwrap();
        let mut line = String::new();
        BufReader::new(&mut s).read_line(&mut line).await.unwrap();
        assert!(line.contains("bad_request"), "{line}");
        let mut s = UnixStream::connect(&h.socket).await.unwrap();
        s.write_all(&vec![b'x'; 4096]).await.unwrap();
        let mut line = String::new();
        BufReader::new(&mut s).read_line(&mut line).await.unwrap();
        assert!(line.contains("longer than"), "{line}");
        // Two silent streams take both slots; a third is told the VM is busy.
        let _a = UnixStream::connect(&h.socket).await.unwrap();
        let _b = UnixStream::connect(&h.socket).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut c = UnixStream::connect(&h.socket).await.unwrap();
        let mut line = String::new();
        BufReader::new(&mut c).read_line(&mut line).await.unwrap();
        assert!(line.contains("busy"), "{line}");
        // The silent ones time out and free their slots.
        tokio::time::sleep(Duration::from_millis(400)).await;
        let (port, _server) = echo_server().await;
        let (reply, _) = ask(&h.socket, &connect("allowed.test", port)).await;
        assert!(reply.ok, "{reply:?}");
    }

    /// A resolver whose `slow*` names hang until the gate opens (a DNS server that never
    /// answers), counting how many lookups run at once; other names are 127.0.0.1 at once.
    struct StallingResolver {
        gate: Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
        running: Arc<std::sync::atomic::AtomicUsize>,
        most: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl StallingResolver {
        fn new() -> Self {
            Self { gate: Default::default(), running: Default::default(), most: Default::default() }
        }

        fn resolver(&self) -> Resolver {
            use std::sync::atomic::Ordering::SeqCst;
            let (gate, running, most) = (self.gate.clone(), self.running.clone(), self.most.clone());
            Arc::new(move |name, _| {
                if name.starts_with("slow") {
                    let now = running.fetch_add(1, SeqCst) + 1;
                    most.fetch_max(now, SeqCst);
                    let (lock, cv) = &*gate;
                    let _open = cv.wait_while(lock.lock().unwrap(), |open| !*open).unwrap();
                    running.fetch_sub(1, SeqCst);
                }
                Ok(vec!["127.0.0.1".parse().unwrap()])
            })
        }

        fn open(&self) {
            *self.gate.0.lock().unwrap() = true;
            self.gate.1.notify_all();
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lookups_are_bounded_per_vm_and_time_out() {
        use std::sync::atomic::Ordering::SeqCst;
        let stalling = StallingResolver::new();
        let limits = EgressLimits {
            max_lookups: 2,
            resolve_timeout: Duration::from_millis(400),
            resolver: stalling.resolver(),
            ..Default::default()
        };
        let h = harness(local_policy(NetworkMode::Any, &[]), limits.clone());
        // Another VM (another session) with the same resolver and its own slots.
        let other = harness(local_policy(NetworkMode::Any, &[]), limits);
        let started = Instant::now();
        let asks = (0..6).map(|i| {
            let socket = h.socket.clone();
            tokio::spawn(async move { ask(&socket, &EgressRequest::Resolve { name: format!("slow{i}.test") }).await.0 })
        });
        let replies: Vec<EgressReply> =
            futures_util::future::join_all(asks).await.into_iter().map(|r| r.unwrap()).collect();
        // Every guest lookup is answered within the timeout (plus scheduling), none hangs.
        assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
        for r in &replies {
            assert_eq!(r.refusal, Some(EgressRefusal::NotFound), "{r:?}");
            assert!(r.reason.as_deref().unwrap_or_default().contains("took longer than"), "{r:?}");
        }
        // The timed-out lookups still hang on the blocking pool, but only as many as the slots.
        assert_eq!(stalling.running.load(SeqCst), 2, "the stalled lookups keep their slots");
        assert_eq!(stalling.most.load(SeqCst), 2, "never more lookups at once than max_lookups");
        // The other VM resolves while this one's lookups are stuck; so do overrides here.
        let (reply, _) = ask(&other.socket, &EgressRequest::Resolve { name: "fast.test".into() }).await;
        assert!(reply.ok, "{reply:?}");
        let (reply, _) = ask(&h.socket, &EgressRequest::Resolve { name: "allowed.test".into() }).await;
        assert!(reply.ok, "{reply:?}");
        // This VM's own new lookups wait for a slot, and fail in time rather than pile up.
        let (reply, _) = ask(&h.socket, &EgressRequest::Resolve { name: "fast.test".into() }).await;
        assert_eq!(reply.refusal, Some(EgressRefusal::NotFound), "{reply:?}");
        // Once DNS answers, the slots free and names resolve again.
        stalling.open();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(stalling.running.load(SeqCst), 0);
        let (reply, _) = ask(&h.socket, &EgressRequest::Resolve { name: "fast.test".into() }).await;
        assert!(reply.ok, "{reply:?}");
    }

    #[tokio::test]
    async fn a_name_resolving_to_the_hosts_own_address_is_refused_before_any_connect() {
        // The resolver answers with an address of one of this machine's interfaces (read,
        // never connected to); the refusal comes from the decision, so no packet is sent.
        let own = HostAddresses::current()
            .unwrap()
            .addresses()
            .find(|a| !a.is_loopback())
            .unwrap_or_else(|| "127.0.0.1".parse().unwrap());
        let limits = EgressLimits { resolver: Arc::new(move |_, _| Ok(vec![own])), ..Default::default() };
        let h = harness(NetworkPolicy { mode: NetworkMode::Any, ..Default::default() }, limits);
        let (reply, _) = ask(&h.socket, &connect("rebind.example", 8080)).await;
        assert_eq!(reply.refusal, Some(EgressRefusal::Denied), "{reply:?}");
        let reason = reply.reason.unwrap();
        assert!(reason.contains(&own.to_string()), "{reason}");
        let (reply, _) = ask(&h.socket, &connect(&own.to_string(), 8080)).await;
        assert_eq!(reply.refusal, Some(EgressRefusal::Denied), "an address literal too: {reply:?}");
        let events = h.events.lock().unwrap().clone();
        assert!(
            events.iter().all(|e| matches!(e, EventKind::Egress { allowed: false, address: None, .. })),
            "{events:?}"
        );
    }

    #[tokio::test]
    async fn an_unreachable_port_is_unreachable() {
        let h = harness(local_policy(NetworkMode::Any, &[]), EgressLimits::default());
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let (reply, _) = ask(&h.socket, &connect("allowed.test", port)).await;
        assert_eq!(reply.refusal, Some(EgressRefusal::Unreachable), "{reply:?}");
    }
}
