//! The proxy with secrets, against TLS servers on 127.0.0.1 with a test CA: what each server
//! receives, what the guest side gets back, and the events.

use std::sync::{Arc, Mutex, RwLock};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, UnixStream};
use umbra_api::session::{NetworkMode, NetworkPolicy};
use umbra_api::EventKind;
use umbra_proto::egress::{EgressReply, EgressRequest, EgressVia};

use super::*;

/// A CA of the "public" side and the certificate of one server it signed.
struct TestPki {
    ca_pem: String,
    server: Arc<rustls::ServerConfig>,
}

fn test_pki(host: &str) -> TestPki {
    let ca = SessionCa::generate("public side").unwrap();
    let server = ca.server_config(host).unwrap();
    TestPki { ca_pem: ca.pem().to_string(), server }
}

/// An HTTP request head, up to its blank line (what there is, if the peer stops first).
async fn read_head<R: tokio::io::AsyncBufRead + Unpin>(r: &mut R) -> String {
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).await.unwrap_or(0) == 0 || line == "\r\n" {
            return head;
        }
        head.push_str(&line);
    }
}

/// A TLS server on 127.0.0.1 that records each request head and answers `ok`.
async fn recording_server(config: Arc<rustls::ServerConfig>) -> (u16, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let heads = Arc::new(Mutex::new(Vec::new()));
    let seen = heads.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, seen) = (tokio_rustls::TlsAcceptor::from(config.clone()), seen.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else { return };
                let mut r = BufReader::new(tls);
                let head = read_head(&mut r).await;
                seen.lock().unwrap().push(head);
                let _ =
                    r.get_mut().write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok").await;
                let _ = r.get_mut().shutdown().await;
            });
        }
    });
    (port, heads)
}

struct Setup {
    _dir: tempfile::TempDir,
    socket: std::path::PathBuf,
    ca: Arc<SessionCa>,
    events: Arc<Mutex<Vec<EventKind>>>,
    placeholder: String,
    _proxy: EgressProxy,
}

fn setup(names: &[&str], upstream: Result<Upstream, String>) -> Setup {
    setup_via(names, upstream, None)
}

fn setup_via(names: &[&str], upstream: Result<Upstream, String>, upstream_proxy: Option<UpstreamProxy>) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("vsock.sock_1026");
    let mut p = NetworkPolicy {
        mode: NetworkMode::Allowlist,
        allow_domains: names.iter().map(|n| n.to_string()).collect(),
        allow_cidrs: vec!["127.0.0.1/32".into()],
        ..Default::default()
    };
    for n in names {
        p.resolve.insert(n.to_string(), "127.0.0.1".parse().unwrap());
    }
    let mut secrets = Secrets::default();
    let spec = serde_json::json!({"name": "TOKEN", "value": "the-real-value", "hosts": ["api.test"]});
    secrets.set(&serde_json::from_value(spec).unwrap(), |_| None).unwrap();
    let placeholder = secrets.placeholders()[0].1.clone();
    let ca = Arc::new(SessionCa::generate("s").unwrap());
    let broker = Broker {
        secrets: Arc::new(RwLock::new(secrets)),
        ca: ca.clone(),
        upstream,
        upstream_proxy,
        ask: None,
        ssh_keys: Default::default(),
    };
    let events = Arc::new(Mutex::new(Vec::new()));
    let sink = events.clone();
    let report: Report = Arc::new(move |e| sink.lock().unwrap().push(e));
    let policy = Arc::new(RwLock::new(Policy::new(&p)));
    let proxy = EgressProxy::start(&socket, policy, Some(broker), report, EgressLimits::default()).unwrap();
    Setup { _dir: dir, socket, ca, events, placeholder, _proxy: proxy }
}

/// A guest program: through the proxy to `name:port`, TLS trusting the session CA, one request
/// with `header`; returns the response.
async fn guest_request(s: &Setup, name: &str, port: u16, header: &str) -> String {
    let mut stream = UnixStream::connect(&s.socket).await.unwrap();
    let ask = EgressRequest::Connect { name: name.into(), port, via: EgressVia::Transparent, who: false };
    stream.write_all(&ask.to_line()).await.unwrap();
    let mut r = BufReader::new(stream);
    let mut line = String::new();
    r.read_line(&mut line).await.unwrap();
    let reply: EgressReply = serde_json::from_str(&line).unwrap();
    assert!(reply.ok, "{reply:?}");
    let guest_trust = Upstream::new(&[("session CA".into(), s.ca.pem().to_string())]).unwrap();
    let mut tls = guest_trust.connect(name, r.into_inner()).await.unwrap();
    let request = format!("GET /v1 HTTP/1.1\r\nHost: {name}\r\n{header}\r\nConnection: close\r\n\r\n");
    tls.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    let _ = tls.read_to_string(&mut response).await;
    response
}

#[tokio::test]
async fn a_bound_host_gets_the_value_and_another_the_placeholder() {
    let api = test_pki("api.test");
    let other = test_pki("other.test");
    let (api_port, api_heads) = recording_server(api.server.clone()).await;
    let (other_port, other_heads) = recording_server(other.server.clone()).await;
    let upstream =
        Upstream::new(&[("api".into(), api.ca_pem.clone()), ("other".into(), other.ca_pem.clone())]).unwrap();
    let s = setup(&["api.test", "other.test"], Ok(upstream));
    let header = format!("Authorization: Bearer {}", s.placeholder);

    let response = guest_request(&s, "api.test", api_port, &header).await;
    assert!(response.starts_with("HTTP/1.1 200") && response.ends_with("ok"), "{response}");
    let got = api_heads.lock().unwrap().join("\n").to_lowercase();
    assert!(got.contains("authorization: bearer the-real-value"), "{got}");
    assert!(!got.contains(&s.placeholder), "{got}");

    // Another allowed host is carried unread (TLS end to end: the guest trusts its CA here
    // only because the test's client does) and gets the placeholder.
    let guest_to_other = format!("X-Token: {}", s.placeholder);
    let mut stream = UnixStream::connect(&s.socket).await.unwrap();
    let ask =
        EgressRequest::Connect { name: "other.test".into(), port: other_port, via: EgressVia::Transparent, who: false };
    stream.write_all(&ask.to_line()).await.unwrap();
    let mut r = BufReader::new(stream);
    let mut line = String::new();
    r.read_line(&mut line).await.unwrap();
    let end_to_end = Upstream::new(&[("other".into(), other.ca_pem.clone())]).unwrap();
    let mut tls = end_to_end.connect("other.test", r.into_inner()).await.unwrap();
    let request = format!("GET / HTTP/1.1\r\nHost: other.test\r\n{guest_to_other}\r\nConnection: close\r\n\r\n");
    tls.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    let _ = tls.read_to_string(&mut response).await;
    assert!(response.ends_with("ok"), "{response}");
    assert!(other_heads.lock().unwrap()[0].contains(&s.placeholder));

    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let events = s.events.lock().unwrap().clone();
    assert!(events.contains(&EventKind::SecretUsed { name: "TOKEN".into(), host: "api.test".into() }), "{events:?}");
    assert!(
        events.contains(&EventKind::TlsIntercepted { host: "api.test".into(), port: api_port, error: None }),
        "{events:?}"
    );
    assert!(!events.iter().any(|e| matches!(e, EventKind::TlsIntercepted { host, .. } if host == "other.test")));
    // No event holds the value.
    assert!(!format!("{events:?}").contains("the-real-value"));
}

#[tokio::test]
async fn an_untrusted_upstream_certificate_is_refused_with_a_clear_error() {
    let api = test_pki("api.test");
    let (port, heads) = recording_server(api.server.clone()).await;
    // The proxy trusts the host's store and an unrelated CA: not the server's.
    let unrelated = test_pki("unrelated.test").ca_pem;
    let s = setup(&["api.test"], Ok(Upstream::new(&[("unrelated".into(), unrelated)]).unwrap()));
    let response = guest_request(&s, "api.test", port, &format!("X-Token: {}", s.placeholder)).await;
    assert!(response.starts_with("HTTP/1.1 502"), "{response}");
    assert!(response.contains("its certificate is not trusted"), "{response}");
    assert!(heads.lock().unwrap().is_empty(), "the server got a request");
    let events = s.events.lock().unwrap().clone();
    assert!(events.iter().any(|e| matches!(e, EventKind::TlsIntercepted { error: Some(_), .. })), "{events:?}");
    assert!(!events.iter().any(|e| matches!(e, EventKind::SecretUsed { .. })), "{events:?}");
}

/// A CONNECT proxy on 127.0.0.1 that wants `user:pass` (407 otherwise) and tunnels to the
/// address asked for; returns its port and the CONNECT lines it got.
async fn tunneling_proxy() -> (u16, Arc<Mutex<Vec<String>>>) {
    use base64::Engine as _;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let asked = Arc::new(Mutex::new(Vec::new()));
    let seen = asked.clone();
    let want = format!("Basic {}", base64::engine::general_purpose::STANDARD.encode("user:pass"));
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            let (seen, want) = (seen.clone(), want.clone());
            tokio::spawn(async move {
                let mut r = BufReader::new(s);
                let head = read_head(&mut r).await;
                let first = head.lines().next().unwrap_or_default().to_string();
                seen.lock().unwrap().push(first.clone());
                let authorized = head.lines().any(|l| {
                    l.split_once(':')
                        .is_some_and(|(k, v)| k.eq_ignore_ascii_case("proxy-authorization") && v.trim() == want)
                });
                if !authorized {
                    let _ = r.get_mut().write_all(b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n").await;
                    return;
                }
                let target = first.split_whitespace().nth(1).unwrap_or_default().to_string();
                let Ok(mut upstream) = tokio::net::TcpStream::connect(target.as_str()).await else { return };
                let mut client = r.into_inner();
                let _ = client.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n").await;
                let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
            });
        }
    });
    (port, asked)
}

#[tokio::test]
async fn connections_go_through_an_authenticating_upstream_proxy() {
    let api = test_pki("api.test");
    let (api_port, api_heads) = recording_server(api.server.clone()).await;
    let (proxy_port, asked) = tunneling_proxy().await;
    let upstream = Upstream::new(&[("api".into(), api.ca_pem.clone())]).unwrap();
    let via = UpstreamProxy::parse(&format!("http://user:pass@127.0.0.1:{proxy_port}"), "").unwrap();
    let s = setup_via(&["api.test"], Ok(upstream.clone()), Some(via));
    let response = guest_request(&s, "api.test", api_port, &format!("Authorization: Bearer {}", s.placeholder)).await;
    assert!(response.ends_with("ok"), "{response}");
    // The pinned address went to the proxy; the secret reached the server through it.
    assert_eq!(asked.lock().unwrap().clone(), vec![format!("CONNECT 127.0.0.1:{api_port} HTTP/1.1")]);
    assert!(api_heads.lock().unwrap()[0].contains("Bearer the-real-value"));
    let events = s.events.lock().unwrap().clone();
    let through = format!("127.0.0.1:{api_port} through the upstream proxy 127.0.0.1:{proxy_port}");
    assert!(
        events.iter().any(|e| matches!(e, EventKind::Egress { allowed: true, address: Some(a), .. } if *a == through)),
        "{events:?}"
    );

    // Wrong credentials: the guest is refused, saying why.
    let wrong = UpstreamProxy::parse(&format!("http://user:nope@127.0.0.1:{proxy_port}"), "").unwrap();
    let s = setup_via(&["api.test"], Ok(upstream), Some(wrong));
    let mut stream = UnixStream::connect(&s.socket).await.unwrap();
    let ask =
        EgressRequest::Connect { name: "api.test".into(), port: api_port, via: EgressVia::Transparent, who: false };
    stream.write_all(&ask.to_line()).await.unwrap();
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).await.unwrap();
    let reply: EgressReply = serde_json::from_str(&line).unwrap();
    assert!(!reply.ok, "{reply:?}");
    assert!(line.contains("refused our credentials"), "{line}");
}

#[tokio::test]
async fn a_server_that_speaks_first_and_clear_text_are_carried_unread() {
    // An SSH-like server on a bound host: its banner comes first, and the connection is not
    // intercepted (nothing waits for a TLS hello that never comes).
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let got = Arc::new(Mutex::new(Vec::new()));
    let seen = got.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                s.write_all(b"SSH-2.0-test\r\n").await.unwrap();
                let mut buf = Vec::new();
                let _ = s.read_to_end(&mut buf).await;
                seen.lock().unwrap().push(buf);
            });
        }
    });
    let s = setup(&["api.test", "other.test"], Err("unused".into()));
    for name in ["api.test", "other.test"] {
        let mut stream = UnixStream::connect(&s.socket).await.unwrap();
        let ask = EgressRequest::Connect { name: name.into(), port, via: EgressVia::Transparent, who: false };
        stream.write_all(&ask.to_line()).await.unwrap();
        let mut r = BufReader::new(stream);
        let mut line = String::new();
        r.read_line(&mut line).await.unwrap();
        let mut banner = String::new();
        r.read_line(&mut banner).await.unwrap();
        assert_eq!(banner, "SSH-2.0-test\r\n", "{name}");
        // A placeholder in clear text goes on unchanged, and is reported for the other host.
        let sent = format!("GET / HTTP/1.1\r\nX-Token: {}\r\n\r\n", s.placeholder);
        r.get_mut().write_all(sent.as_bytes()).await.unwrap();
        r.get_mut().shutdown().await.unwrap();
        let mut rest = Vec::new();
        let _ = r.read_to_end(&mut rest).await;
    }
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    for body in got.lock().unwrap().iter() {
        assert!(String::from_utf8_lossy(body).contains(&s.placeholder), "the value was sent in clear text");
    }
    let events = s.events.lock().unwrap().clone();
    assert!(!events.iter().any(|e| matches!(e, EventKind::TlsIntercepted { .. } | EventKind::SecretUsed { .. })));
    for host in ["api.test", "other.test"] {
        let withheld = EventKind::SecretWithheld { name: "TOKEN".into(), host: host.into() };
        assert!(events.contains(&withheld), "{host}: {events:?}");
    }
}

/// Mode `ask`: a connection whose agent offered (`who`) is asked which process opened it
/// before the question goes out, and the question carries the answer, tidied; an agent that
/// answers out of kind is refused; one that did not offer is not asked.
#[tokio::test]
async fn a_question_names_the_guest_process_the_agent_reports() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("vsock.sock_1026");
    let policy = NetworkPolicy {
        mode: NetworkMode::Ask,
        allow_cidrs: vec!["127.0.0.1/32".into()],
        resolve: [("asked.test".to_string(), "127.0.0.1".parse().unwrap())].into(),
        ask_timeout_secs: Some(5),
        ..Default::default()
    };
    let questions = Arc::new(Mutex::new(Vec::new()));
    let seen = questions.clone();
    let asker: super::ask::Asker = Arc::new(move |q, _| {
        seen.lock().unwrap().push(q);
        Box::pin(async { Ok(umbra_api::event::PermissionScope::Once) })
    });
    let broker = Broker {
        secrets: Default::default(),
        ca: Arc::new(SessionCa::generate("s").unwrap()),
        upstream: Err("none".into()),
        upstream_proxy: None,
        ask: Some(Arc::new(AskGate::new(asker, Default::default()))),
        ssh_keys: Default::default(),
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { while listener.accept().await.is_ok() {} });
    let report: Report = Arc::new(|_| {});
    let policy = Arc::new(RwLock::new(Policy::new(&policy)));
    let _proxy = EgressProxy::start(&socket, policy, Some(broker), report, EgressLimits::default()).unwrap();

    // Sends the request; answers a process query with `answer`; returns the reply.
    let connect = |who: bool, answer: &'static str| {
        let socket = socket.clone();
        async move {
            let mut stream = UnixStream::connect(&socket).await.unwrap();
            let request = EgressRequest::Connect { name: "asked.test".into(), port, via: EgressVia::Http, who };
            stream.write_all(&request.to_line()).await.unwrap();
            let mut r = BufReader::new(stream);
            let mut line = String::new();
            r.read_line(&mut line).await.unwrap();
            if who {
                assert_eq!(line, "{\"query\":\"process\"}\n");
                r.get_mut().write_all(answer.as_bytes()).await.unwrap();
                line.clear();
                r.read_line(&mut line).await.unwrap();
            }
            serde_json::from_str::<EgressReply>(&line).unwrap()
        }
    };
    let reply = connect(true, "{\"pid\":42,\"command\":\"curl \\u001b]0;allowed\\u0007 https://asked.test\"}\n").await;
    assert!(reply.ok, "{reply:?}");
    let reply = connect(true, "not an answer\n").await;
    assert_eq!(reply.refusal, Some(umbra_proto::egress::EgressRefusal::BadRequest), "{reply:?}");
    assert!(reply.reason.unwrap().contains("naming the process is not understood"));
    assert!(connect(false, "").await.ok);
    let asked: Vec<_> = questions.lock().unwrap().iter().map(|q| q.process.clone()).collect();
    let claimed =
        umbra_proto::egress::EgressProcess { pid: Some(42), command: "curl ?]0;allowed? https://asked.test".into() };
    assert_eq!(asked, vec![Some(claimed), None], "the refused one was never asked about");
}
