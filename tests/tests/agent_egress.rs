//! Network egress, guest side, with the real agent binary on the host and the real host end:
//! `--egress unix:PATH` sends the agent's egress streams to umbra-runtime's `EgressProxy`
//! listening there (as it listens on a VM's `<vsock socket>_1026`), and `--net-ports` puts the
//! HTTP proxy, SOCKS5 proxy, DNS server and transparent listener on free loopback ports.
//!
//! The proxy's policy is an allowlist whose names are all overridden to 127.0.0.1 (allowed by
//! an explicit CIDR): `allowed.test` and `other.test` reach servers the test runs there,
//! `closed.test` a port nothing listens on; `denied.test` is not in the list. Network safety:
//! traffic goes only to servers these tests start on 127.0.0.1; no name is resolved by DNS
//! (every name is refused or overridden), and in the netns test every address is local to a
//! private network namespace that has no interface but lo.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{Name, RData, RecordType};
use hickory_proto::serialize::binary::BinEncodable;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use umbra_api::session::{NetworkMode, NetworkPolicy};
use umbra_api::EventKind;
use umbra_proto::egress::{EgressRequest, EgressVia};
use umbra_proto::SpawnRequest;
use umbra_runtime::egress::{EgressLimits, EgressProxy, Policy};
use umbra_tests::{HostAgent, TempDir};

/// What the host was asked, in order (each decision, as the request it answered).
type Log = Arc<Mutex<Vec<EgressRequest>>>;

/// The host end: umbra-runtime's egress proxy on `path`, its decisions logged.
fn real_host(path: &Path) -> (EgressProxy, Log) {
    let local: std::net::IpAddr = Ipv4Addr::LOCALHOST.into();
    let names = ["allowed.test", "other.test", "closed.test"];
    let policy = NetworkPolicy {
        mode: NetworkMode::Allowlist,
        allow_domains: names.iter().map(|n| n.to_string()).collect(),
        allow_cidrs: vec!["127.0.0.1/32".into()],
        resolve: names.iter().map(|n| (n.to_string(), local)).collect(),
        ..Default::default()
    };
    let log: Log = Arc::default();
    let seen = log.clone();
    let report = Arc::new(move |kind: EventKind| {
        if let EventKind::Egress { name, port, via, .. } = kind {
            seen.lock().unwrap().push(match via {
                EgressVia::Dns => EgressRequest::Resolve { name },
                via => EgressRequest::Connect { name, port, via, who: false },
            });
        }
    });
    let proxy =
        EgressProxy::start(path, Arc::new(RwLock::new(Policy::new(&policy))), None, report, EgressLimits::default())
            .expect("start the host's egress proxy");
    (proxy, log)
}

/// A server on 127.0.0.1 running `handle` for each connection; returns its port.
async fn serve<F, Fut>(handle: F) -> u16
where
    F: Fn(TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            tokio::spawn(handle(s));
        }
    });
    port
}

/// An echo server: sends back "echo:" and everything it received, once the client has
/// half-closed.
async fn echo_server() -> u16 {
    serve(|mut s| async move {
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got).await;
        let _ = s.write_all(b"echo:").await;
        let _ = s.write_all(&got).await;
    })
    .await
}

/// An HTTP server that answers every request with the request head it received.
async fn http_server() -> u16 {
    serve(|mut s| async move {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") && s.read(&mut byte).await.unwrap_or(0) == 1 {
            head.push(byte[0]);
        }
        let response = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", head.len());
        let _ = s.write_all(response.as_bytes()).await;
        let _ = s.write_all(&head).await;
    })
    .await
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

struct Ports {
    http: u16,
    socks: u16,
    dns: u16,
    transparent: u16,
}

struct Setup {
    agent: HostAgent,
    ports: Ports,
    log: Log,
    _host: Option<EgressProxy>,
    _dir: TempDir,
}

/// The agent with egress to the host's proxy at `egress` (started unless `no_host`).
async fn start(no_host: bool, extra: impl FnOnce(&mut std::process::Command)) -> Setup {
    let dir = TempDir::new("egress");
    let egress = dir.0.join("egress.sock");
    let (host, log) = if no_host {
        (None, Log::default())
    } else {
        let (proxy, log) = real_host(&egress);
        (Some(proxy), log)
    };
    let ports = Ports { http: free_port(), socks: free_port(), dns: free_port(), transparent: free_port() };
    let flag = format!("{},{},{},{}", ports.http, ports.socks, ports.dns, ports.transparent);
    let egress_arg = format!("unix:{}", egress.display());
    let agent = HostAgent::start_with(|cmd| {
        cmd.args(["--egress", &egress_arg, "--net-ports", &flag]);
        extra(cmd);
    })
    .await;
    Setup { agent, ports, log, _host: host, _dir: dir }
}

async fn connect_http_proxy(s: &Setup, target: &str) -> (TcpStream, String) {
    let mut c = TcpStream::connect(("127.0.0.1", s.ports.http)).await.unwrap();
    c.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes()).await.unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && c.read(&mut byte).await.unwrap() == 1 {
        head.push(byte[0]);
    }
    (c, String::from_utf8(head).unwrap())
}

async fn read_all(mut c: TcpStream) -> String {
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), c.read_to_end(&mut out)).await.unwrap().unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn http_connect_and_plain_http_reach_the_server_by_name() {
    let s = start(false, |_| {}).await;
    let echo = echo_server().await;
    let (mut c, head) = connect_http_proxy(&s, &format!("allowed.test:{echo}")).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    c.write_all(b"hello through CONNECT").await.unwrap();
    c.shutdown().await.unwrap();
    assert_eq!(read_all(c).await, "echo:hello through CONNECT", "half-close travels both ways");
    assert_eq!(
        s.log.lock().unwrap()[0],
        EgressRequest::Connect { name: "allowed.test".into(), port: echo, via: EgressVia::Http, who: false }
    );

    // A plain http:// request, rewritten to origin form.
    let web = http_server().await;
    let mut c = TcpStream::connect(("127.0.0.1", s.ports.http)).await.unwrap();
    let request = format!(
        "GET http://allowed.test:{web}/path?q=1 HTTP/1.1\r\nHost: allowed.test:{web}\r\nProxy-Connection: keep-alive\r\n\
         Proxy-Authorization: Basic eA==\r\nUser-Agent: test\r\n\r\n"
    );
    c.write_all(request.as_bytes()).await.unwrap();
    let response = read_all(c).await;
    assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
    let (_, echoed) = response.split_once("\r\n\r\n").unwrap();
    assert!(echoed.starts_with("GET /path?q=1 HTTP/1.1\r\nHost: allowed.test:"), "{echoed}");
    assert!(echoed.contains("User-Agent: test\r\n") && echoed.contains("Connection: close\r\n"), "{echoed}");
    assert!(!echoed.to_ascii_lowercase().contains("proxy-"), "{echoed}");
    assert!(s.log.lock().unwrap().contains(&EgressRequest::Connect {
        name: "allowed.test".into(),
        port: web,
        via: EgressVia::Http,
        who: false,
    }));
}

#[tokio::test]
async fn http_refusals_name_the_reason() {
    let s = start(false, |_| {}).await;
    let (c, head) = connect_http_proxy(&s, "denied.test:443").await;
    assert!(head.starts_with("HTTP/1.1 403 "), "{head}");
    let body = read_all(c).await;
    assert!(body.contains("denied.test is not in the session's allowlist"), "{body}");
    let (c, head) = connect_http_proxy(&s, &format!("closed.test:{}", free_port())).await;
    assert!(head.starts_with("HTTP/1.1 502 "), "{head}");
    drop(c);
    // Not a proxy request.
    let mut c = TcpStream::connect(("127.0.0.1", s.ports.http)).await.unwrap();
    c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    assert!(read_all(c).await.starts_with("HTTP/1.1 400 "));
    // A head that never ends is cut off at the size limit.
    let mut c = TcpStream::connect(("127.0.0.1", s.ports.http)).await.unwrap();
    let big = format!("GET http://x/ HTTP/1.1\r\nX: {}\r\n", "a".repeat(40_000));
    let _ = c.write_all(big.as_bytes()).await;
    assert!(read_all(c).await.starts_with("HTTP/1.1 431 "));
}

async fn socks_connect(s: &Setup, atyp_and_addr: &[u8], port: u16) -> (TcpStream, u8) {
    let mut c = TcpStream::connect(("127.0.0.1", s.ports.socks)).await.unwrap();
    c.write_all(&[5, 1, 0]).await.unwrap();
    let mut choice = [0u8; 2];
    c.read_exact(&mut choice).await.unwrap();
    assert_eq!(choice, [5, 0]);
    let mut req = vec![5, 1, 0];
    req.extend_from_slice(atyp_and_addr);
    req.extend_from_slice(&port.to_be_bytes());
    c.write_all(&req).await.unwrap();
    let mut reply = [0u8; 10];
    c.read_exact(&mut reply).await.unwrap();
    assert_eq!((reply[0], reply[2]), (5, 0));
    (c, reply[1])
}

fn domain(name: &str) -> Vec<u8> {
    let mut v = vec![3, name.len() as u8];
    v.extend_from_slice(name.as_bytes());
    v
}

#[tokio::test]
async fn socks5_domain_connect_and_refusals() {
    let s = start(false, |_| {}).await;
    let echo = echo_server().await;
    let (mut c, code) = socks_connect(&s, &domain("Allowed.Test"), echo).await;
    assert_eq!(code, 0);
    c.write_all(b"via socks").await.unwrap();
    c.shutdown().await.unwrap();
    assert_eq!(read_all(c).await, "echo:via socks");
    assert_eq!(
        s.log.lock().unwrap()[0],
        EgressRequest::Connect { name: "allowed.test".into(), port: echo, via: EgressVia::Socks, who: false }
    );
    assert_eq!(socks_connect(&s, &domain("denied.test"), 443).await.1, 2, "not allowed");
    assert_eq!(socks_connect(&s, &domain("closed.test"), free_port()).await.1, 4, "host unreachable");
    // A fake address nobody was given is unreachable, without asking the host.
    let before = s.log.lock().unwrap().len();
    assert_eq!(socks_connect(&s, &[1, 198, 19, 1, 1], 443).await.1, 4);
    assert_eq!(s.log.lock().unwrap().len(), before);
    // Only "no authentication" is offered.
    let mut c = TcpStream::connect(("127.0.0.1", s.ports.socks)).await.unwrap();
    c.write_all(&[5, 1, 2]).await.unwrap();
    let mut choice = [0u8; 2];
    c.read_exact(&mut choice).await.unwrap();
    assert_eq!(choice, [5, 0xff]);
}

fn dns_query(id: u16, name: &str, ty: RecordType) -> Vec<u8> {
    let mut m = Message::new();
    m.set_id(id).set_message_type(MessageType::Query).set_op_code(OpCode::Query).set_recursion_desired(true);
    m.add_query(Query::query(Name::from_ascii(name).unwrap(), ty));
    m.to_bytes().unwrap()
}

async fn ask_udp(port: u16, query: &[u8]) -> Message {
    let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    sock.send_to(query, ("127.0.0.1", port)).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(20), sock.recv(&mut buf)).await.expect("a DNS answer").unwrap();
    Message::from_vec(&buf[..n]).unwrap()
}

fn single_a(m: &Message) -> Ipv4Addr {
    assert_eq!(m.response_code(), ResponseCode::NoError, "{m:?}");
    assert_eq!(m.answers().len(), 1, "{m:?}");
    match m.answers()[0].data() {
        RData::A(a) => a.0,
        other => panic!("not an A record: {other:?}"),
    }
}

#[tokio::test]
async fn dns_answers_fake_addresses_that_lead_back_to_the_name() {
    let s = start(false, |_| {}).await;
    let a = ask_udp(s.ports.dns, &dns_query(0x1234, "allowed.test.", RecordType::A)).await;
    assert_eq!(a.id(), 0x1234);
    let ip = single_a(&a);
    assert_eq!(u32::from(ip) >> 17, u32::from(Ipv4Addr::new(198, 18, 0, 0)) >> 17, "{ip} in 198.18.0.0/15");
    assert_eq!(a.answers()[0].ttl(), 5);
    let again = single_a(&ask_udp(s.ports.dns, &dns_query(2, "ALLOWED.test.", RecordType::A)).await);
    assert_eq!(again, ip, "the same address for the same name");
    let other = single_a(&ask_udp(s.ports.dns, &dns_query(3, "other.test.", RecordType::A)).await);
    assert_ne!(other, ip);
    assert_eq!(
        s.log.lock().unwrap()[0],
        EgressRequest::Resolve { name: "allowed.test".into() },
        "a lookup is a resolve request"
    );

    let r = ask_udp(s.ports.dns, &dns_query(4, "denied.test.", RecordType::A)).await;
    assert_eq!((r.response_code(), r.answers().len()), (ResponseCode::Refused, 0));
    let r = ask_udp(s.ports.dns, &dns_query(6, "allowed.test.", RecordType::AAAA)).await;
    assert_eq!((r.response_code(), r.answers().len()), (ResponseCode::NoError, 0), "no IPv6");

    // Over TCP too.
    let mut c = TcpStream::connect(("127.0.0.1", s.ports.dns)).await.unwrap();
    let q = dns_query(7, "allowed.test.", RecordType::A);
    c.write_all(&(q.len() as u16).to_be_bytes()).await.unwrap();
    c.write_all(&q).await.unwrap();
    let mut len = [0u8; 2];
    c.read_exact(&mut len).await.unwrap();
    let mut answer = vec![0u8; u16::from_be_bytes(len) as usize];
    c.read_exact(&mut answer).await.unwrap();
    assert_eq!(single_a(&Message::from_vec(&answer).unwrap()), ip);

    // The fake address leads back to the name: CONNECT to it is asked for by name.
    let echo = echo_server().await;
    let (mut c, head) = connect_http_proxy(&s, &format!("{ip}:{echo}")).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    c.shutdown().await.unwrap();
    assert_eq!(read_all(c).await, "echo:");
    assert!(s.log.lock().unwrap().contains(&EgressRequest::Connect {
        name: "allowed.test".into(),
        port: echo,
        via: EgressVia::Http,
        who: false,
    }));
}

#[tokio::test]
async fn spawned_processes_get_the_proxy_variables_unless_they_set_their_own() {
    let s = start(false, |_| {}).await;
    let client = s.agent.connect().await;
    let out = client.spawn(SpawnRequest { argv: vec!["env".into()], ..Default::default() }).unwrap();
    let out = out.output().await.unwrap();
    let env: HashMap<String, String> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| l.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
        .collect();
    let http = format!("http://127.0.0.1:{}", s.ports.http);
    let socks = format!("socks5h://127.0.0.1:{}", s.ports.socks);
    for (k, v) in [("http_proxy", &http), ("https_proxy", &http), ("all_proxy", &socks)] {
        assert_eq!(env.get(k), Some(v), "{k}");
        assert_eq!(env.get(&k.to_uppercase()), Some(v), "{k}");
    }
    assert_eq!(env.get("NO_PROXY").map(String::as_str), Some("localhost,127.0.0.1,::1"));
    assert_eq!(env.get("no_proxy").map(String::as_str), Some("localhost,127.0.0.1,::1"));

    let mut req =
        SpawnRequest { argv: vec!["sh".into(), "-c".into(), "echo $HTTP_PROXY".into()], ..Default::default() };
    req.env.insert("HTTP_PROXY".into(), "http://mine:1".into());
    let out = client.spawn(req).unwrap().output().await.unwrap();
    assert_eq!(out.stdout, b"http://mine:1\n", "the caller's env wins");
}

#[tokio::test]
async fn without_a_host_proxy_everything_fails_cleanly() {
    let s = start(true, |_| {}).await;
    let (c, head) = connect_http_proxy(&s, "example.com:443").await;
    assert!(head.starts_with("HTTP/1.1 502 "), "{head}");
    assert!(read_all(c).await.contains("no egress proxy on the host"));
    let r = ask_udp(s.ports.dns, &dns_query(1, "example.com.", RecordType::A)).await;
    assert_eq!(r.response_code(), ResponseCode::ServFail);
    assert_eq!(socks_connect(&s, &domain("example.com"), 443).await.1, 4);
}

/// The whole transparent path: the agent in a private network namespace (only lo) programs
/// it as in a guest (`--net-kernel`: lo's fake range, the local default route, the nftables
/// redirect); a process it spawns there looks a name up, connects to the fake address it got
/// and to an address literal, knowing nothing of proxies; both arrive at the host's proxy, by
/// name (which reaches the test's echo server on 127.0.0.1 in the test's own namespace) and by
/// literal (which the allowlist refuses: no CIDR names it, and no packet is sent to it).
#[tokio::test]
async fn transparent_redirect_in_a_private_netns() {
    if !nix_is_root() {
        eprintln!("skipped: needs root for a private network namespace and nftables");
        return;
    }
    let s = start(false, |cmd| {
        cmd.arg("--net-kernel");
        // SAFETY: between fork and exec the closure only calls unshare(2), which is
        // async-signal-safe, and reads errno.
        unsafe {
            cmd.pre_exec(|| {
                if libc::unshare(libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    })
    .await;
    let echo = echo_server().await;
    let query: String = dns_query(9, "allowed.test.", RecordType::A).iter().map(|b| format!("{b:02x}")).collect();
    // Inside the namespace: ask the agent's DNS server, connect to the answer, then to a
    // literal (203.0.113.9, TEST-NET-3: local there, like every address, and refused by the host).
    let script = r#"
import socket, sys
q = bytes.fromhex(sys.argv[1]); dns = int(sys.argv[2]); port = int(sys.argv[3])
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(10)
u.sendto(q, ("127.0.0.1", dns)); a, _ = u.recvfrom(4096)
ip = socket.inet_ntoa(a[-4:])
for host in (ip, "203.0.113.9"):
    data = b""
    try:
        s = socket.create_connection((host, port), timeout=10)
        s.sendall(b"ping " + host.encode()); s.shutdown(socket.SHUT_WR)
        while True:
            chunk = s.recv(4096)
            if not chunk: break
            data += chunk
    except OSError as e:
        data = b"closed"
    print(host, data.decode() or "closed")
"#;
    let client = s.agent.connect().await;
    let req = SpawnRequest {
        argv: vec!["python3".into(), "-c".into(), script.into(), query, s.ports.dns.to_string(), echo.to_string()],
        ..Default::default()
    };
    let out = client.spawn(req).unwrap().output().await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code, Some(0), "stdout: {stdout}\nstderr: {}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    let fake: Ipv4Addr = lines[0].split(' ').next().unwrap().parse().unwrap();
    assert_eq!(u32::from(fake) >> 17, u32::from(Ipv4Addr::new(198, 18, 0, 0)) >> 17, "{stdout}");
    assert_eq!(lines[0], format!("{fake} echo:ping {fake}"));
    assert_eq!(lines[1], "203.0.113.9 closed", "the host refused the literal");
    let log = s.log.lock().unwrap().clone();
    assert!(
        log.contains(&EgressRequest::Connect {
            name: "allowed.test".into(),
            port: echo,
            via: EgressVia::Transparent,
            who: false
        }),
        "{log:?}"
    );
    assert!(
        log.contains(&EgressRequest::Connect {
            name: "203.0.113.9".into(),
            port: echo,
            via: EgressVia::Transparent,
            who: false
        }),
        "{log:?}"
    );
}

fn nix_is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

// --- Exposed ports: the other direction ---------------------------------------------------------
// The host's listener (umbra-runtime's `Ports`) carries connections to the real agent's
// forward listener (`--forward unix:PATH`, as a guest's vsock port 1027), which connects to
// the port on its loopback — the host's own here, where the test's servers listen.

/// The exposed port's host side, dialing the host-side agent's forward socket.
async fn expose_through(agent_socket: &Path, guest_port: u16) -> (umbra_runtime::session::ports::Ports, u16) {
    use umbra_runtime::backend::Dialer;
    let path = agent_socket.to_path_buf();
    let dialer = Dialer::new(move |_| {
        let path = path.clone();
        Box::pin(async move { tokio::net::UnixStream::connect(&path).await.map_err(|e| e.to_string()) })
    });
    let ports = umbra_runtime::session::ports::Ports::default();
    let spec = umbra_api::ports::PortSpec { guest_port, host_port: None, bind: None };
    let target: umbra_runtime::session::ports::Target = Arc::new(move || {
        let dialer = dialer.clone();
        Box::pin(async move { Some(dialer) })
    });
    let info = ports.expose(&spec, target, Arc::new(|| {})).await.unwrap();
    assert_eq!(info.bind, std::net::IpAddr::V4(Ipv4Addr::LOCALHOST));
    (ports, info.host_port)
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exposed_port_carries_200_connections_and_leaves_nothing_open() {
    let dir = TempDir::new("ports");
    let forward = dir.0.join("forward.sock");
    let arg = format!("unix:{}", forward.display());
    let agent = HostAgent::start_with(|cmd| {
        cmd.args(["--forward", &arg]);
    })
    .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::os::unix::net::UnixStream::connect(&forward).is_err() {
        assert!(std::time::Instant::now() < deadline, "the agent's forward socket");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A long-lived echo: every read written back at once, until the client closes.
    let echo = serve(|mut s| async move {
        let mut buf = [0u8; 4096];
        while let Ok(n) = s.read(&mut buf).await {
            if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    })
    .await;
    let (ports, host_port) = expose_through(&forward, echo).await;
    let agent_fds = open_fds(agent.pid());

    // Several round trips on one connection (as a WebSocket carries), then 200 at once.
    let mut c = TcpStream::connect(("127.0.0.1", host_port)).await.unwrap();
    for i in 0..5 {
        let msg = format!("round {i}");
        c.write_all(msg.as_bytes()).await.unwrap();
        let mut got = vec![0u8; msg.len()];
        c.read_exact(&mut got).await.unwrap();
        assert_eq!(got, msg.as_bytes());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(c);
    let clients = (0..200).map(|i| async move {
        let mut c = TcpStream::connect(("127.0.0.1", host_port)).await.unwrap();
        let msg = format!("connection {i} ").repeat(500);
        c.write_all(msg.as_bytes()).await.unwrap();
        let mut got = vec![0u8; msg.len()];
        c.read_exact(&mut got).await.unwrap();
        assert_eq!(got, msg.as_bytes(), "connection {i}");
    });
    tokio::time::timeout(Duration::from_secs(60), futures_util::future::join_all(clients)).await.unwrap();
    // Closed clients: within the linger, nothing is left on either side.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let carried = ports.list()[0].connections;
        let fds = open_fds(agent.pid());
        if carried == 0 && fds <= agent_fds {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{carried} connections carried, agent fds {fds} > {agent_fds}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A port nothing listens on: the client's connection is reset (the reset may already meet
    // the connect), and the port stays usable.
    let (_nothing, closed_port) = expose_through(&forward, free_port()).await;
    if let Ok(mut c) = TcpStream::connect(("127.0.0.1", closed_port)).await {
        let mut buf = [0u8; 1];
        let r = tokio::time::timeout(Duration::from_secs(20), c.read(&mut buf)).await.unwrap();
        assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
    }
    // Unexposed: the host port is closed.
    assert!(ports.unexpose(echo).await);
    assert!(TcpStream::connect(("127.0.0.1", host_port)).await.is_err());
}
