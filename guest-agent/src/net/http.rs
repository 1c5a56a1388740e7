//! The HTTP proxy (`HTTP_PROXY`/`HTTPS_PROXY`): `CONNECT host:port` tunnels, and plain
//! `http://` requests in absolute form, one request per connection.
//!
//! A plain request is rewritten to origin form (`GET /path HTTP/1.1`) with `Host` set from the
//! URL, the `Proxy-*`, `Connection` and `Keep-Alive` headers dropped and `Connection: close`
//! added; the body and anything after it are passed on unchanged. The head is parsed with
//! `httparse`, bounded in size ([`Limits::max_http_head`]) and in time
//! ([`Limits::request_timeout`]).
//!
//! Refusals: 403 (denied), 502 (unreachable, not found, a malformed host answer), 503 (busy),
//! 400 for what is not a proxy request, each with a short plain-text body naming the reason.

use std::net::{IpAddr, Ipv6Addr};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use umbra_proto::egress::{EgressRefusal, EgressRequest, EgressVia};

use super::egress::{relay, Admission, Egress, Failure};

const MAX_HEADERS: usize = 128;

pub async fn serve(listener: TcpListener, egress: Arc<Egress>) {
    super::accept::accept_loop("HTTP proxy", listener, move |stream| {
        let egress = egress.clone();
        async move {
            match egress.admit() {
                Ok(admission) => handle(stream, &egress, admission).await,
                Err(f) => refuse(stream, &f, "").await,
            }
        }
    })
    .await
}

/// What the client asked for.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Target {
    /// CONNECT host:port.
    Tunnel { host: String, port: u16 },
    /// An absolute-form request for http://host:port; `head` is the rewritten request head.
    Forward { host: String, port: u16, head: Vec<u8> },
}

async fn handle(mut client: TcpStream, egress: &Egress, mut admission: Admission) {
    let limits = &egress.limits;
    let read = tokio::time::timeout(limits.request_timeout, read_head(&mut client, limits.max_http_head)).await;
    let (buf, head_len) = match read {
        Ok(Ok(Head::Complete(buf, len))) => (buf, len),
        Ok(Ok(Head::TooLarge)) => {
            let why = format!("the request head is larger than {} bytes", limits.max_http_head);
            return respond(&mut client, 431, "Request Header Fields Too Large", &why).await;
        }
        // The client went away before sending a request.
        Ok(Ok(Head::Closed)) | Ok(Err(_)) => return,
        Err(_) => return respond(&mut client, 408, "Request Timeout", "no complete request head in time").await,
    };
    let target = match parse_request(&buf[..head_len]) {
        Ok(t) => t,
        Err(why) => return respond(&mut client, 400, "Bad Request", &why).await,
    };
    let (host, port, head) = match target {
        Target::Tunnel { host, port } => (host, port, None),
        Target::Forward { host, port, head } => (host, port, Some(head)),
    };
    let name = match host_name(egress, &host) {
        Ok(n) => n,
        Err(f) => return refuse(client, &f, &format!("{host}:{port}")).await,
    };
    let peer = client.peer_addr().ok();
    let request = EgressRequest::Connect { name: name.clone(), port, via: EgressVia::Http, who: peer.is_some() };
    let mut connected = match egress.connect(&request, peer).await {
        Ok(c) => c,
        Err(f) => return refuse(client, &f, &format!("{name}:{port}")).await,
    };
    admission.handshake_done();
    let body = &buf[head_len..];
    let result = match head {
        None => {
            if client.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n").await.is_err() {
                return;
            }
            relay(&mut client, &mut connected.stream, body, &connected.pending).await
        }
        Some(mut head) => {
            head.extend_from_slice(body);
            relay(&mut client, &mut connected.stream, &head, &connected.pending).await
        }
    };
    if let Err(e) = result {
        tracing::debug!("http proxy: {name}:{port}: {e}");
    }
}

/// The name to send the host: a fake address becomes its name, other literals stay literals.
fn host_name(egress: &Egress, host: &str) -> Result<String, Failure> {
    match host.parse::<IpAddr>() {
        Ok(IpAddr::V4(v4)) => egress.name_for_v4(v4),
        Ok(IpAddr::V6(v6)) => Ok(v6.to_string()),
        Err(_) => Ok(host.to_ascii_lowercase()),
    }
}

enum Head {
    /// The buffer and the head's length (bytes after it are the start of the body).
    Complete(Vec<u8>, usize),
    TooLarge,
    /// The client closed before the end of a head.
    Closed,
}

/// Reads until the end of the head (`\r\n\r\n`) is in the buffer, at most `max` bytes.
async fn read_head(client: &mut TcpStream, max: usize) -> std::io::Result<Head> {
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = vec![0u8; 8192];
    loop {
        let n = client.read(&mut chunk).await?;
        if n == 0 {
            return Ok(Head::Closed);
        }
        let searched = buf.len().saturating_sub(3);
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf[searched..].windows(4).position(|w| w == b"\r\n\r\n") {
            let head_len = searched + end + 4;
            if head_len > max {
                return Ok(Head::TooLarge);
            }
            return Ok(Head::Complete(buf, head_len));
        }
        if buf.len() > max {
            return Ok(Head::TooLarge);
        }
    }
}

/// Parses a complete request head; the error says why it is not a proxy request.
pub(crate) fn parse_request(head: &[u8]) -> Result<Target, String> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err("incomplete request head".into()),
        Err(e) => return Err(format!("malformed request: {e}")),
    }
    let method = req.method.unwrap_or_default();
    let target = req.path.unwrap_or_default();
    let version = req.version.unwrap_or(1);
    if method.eq_ignore_ascii_case("CONNECT") {
        let (host, port) = split_authority(target, None).ok_or_else(|| format!("bad CONNECT target {target:?}"))?;
        return Ok(Target::Tunnel { host, port });
    }
    let Some(rest) = strip_prefix_ignore_case(target, "http://") else {
        let why = if strip_prefix_ignore_case(target, "https://").is_some() {
            "https:// URLs go through CONNECT"
        } else {
            "this is a proxy: the request target must be an absolute http:// URL"
        };
        return Err(why.into());
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..end];
    // userinfo@host is not forwarded.
    let authority = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let (host, port) = split_authority(authority, Some(80)).ok_or_else(|| format!("bad URL {target:?}"))?;
    let path = match &rest[end..] {
        "" => "/".to_string(),
        p if p.starts_with('/') => p.to_string(),
        p => format!("/{p}"),
    };
    let path = path.split('#').next().unwrap_or("/");
    let mut out = Vec::with_capacity(head.len());
    out.extend_from_slice(format!("{method} {path} HTTP/1.{version}\r\n").as_bytes());
    out.extend_from_slice(b"Host: ");
    out.extend_from_slice(authority.as_bytes());
    out.extend_from_slice(b"\r\n");
    for h in req.headers.iter() {
        let n = h.name;
        let hop_by_hop = n.len() >= 6 && n[..6].eq_ignore_ascii_case("proxy-")
            || n.eq_ignore_ascii_case("connection")
            || n.eq_ignore_ascii_case("keep-alive")
            || n.eq_ignore_ascii_case("host");
        if hop_by_hop {
            continue;
        }
        out.extend_from_slice(n.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(h.value);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"Connection: close\r\n\r\n");
    Ok(Target::Forward { host, port, head: out })
}

fn strip_prefix_ignore_case<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let head = s.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix).then(|| &s[prefix.len()..])
}

/// `host:port`, `[v6]:port`, or (with a default port) `host` / `[v6]`. The host comes back
/// without brackets.
pub(crate) fn split_authority(s: &str, default_port: Option<u16>) -> Option<(String, u16)> {
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (v6, after) = rest.split_once(']')?;
        v6.parse::<Ipv6Addr>().ok()?;
        match after.strip_prefix(':') {
            Some(p) => (v6, Some(p)),
            None if after.is_empty() => (v6, None),
            None => return None,
        }
    } else {
        match s.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (s, None),
        }
    };
    let port = match port {
        Some(p) => p.parse::<u16>().ok().filter(|&p| p != 0)?,
        None => default_port?,
    };
    let valid = !host.is_empty()
        && host.len() <= umbra_proto::egress::MAX_EGRESS_NAME
        && host.bytes().all(|b| b.is_ascii_alphanumeric() || b"-._:".contains(&b));
    valid.then(|| (host.to_string(), port))
}

/// Answers a refusal in HTTP terms and closes.
async fn refuse(mut client: TcpStream, f: &Failure, target: &str) {
    let (code, text) = match f.refusal {
        EgressRefusal::Denied => (403, "Forbidden"),
        EgressRefusal::Busy => (503, "Service Unavailable"),
        EgressRefusal::NotFound | EgressRefusal::Unreachable | EgressRefusal::BadRequest => (502, "Bad Gateway"),
    };
    let what = if target.is_empty() { String::new() } else { format!("{target}: ") };
    respond(&mut client, code, text, &format!("{what}{f}")).await;
}

async fn respond(client: &mut TcpStream, code: u16, text: &str, why: &str) {
    let body = format!("umbra egress: {why}\n");
    let response = format!(
        "HTTP/1.1 {code} {text}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    super::accept::write_and_close(client, response.as_bytes()).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn forward(head: &str) -> (String, u16, String) {
        match parse_request(head.as_bytes()).unwrap() {
            Target::Forward { host, port, head } => (host, port, String::from_utf8(head).unwrap()),
            t => panic!("{t:?}"),
        }
    }

    #[test]
    fn connect_targets() {
        let t = parse_request(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n").unwrap();
        assert_eq!(t, Target::Tunnel { host: "example.com".into(), port: 443 });
        let t = parse_request(b"CONNECT [2001:db8::1]:8443 HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!(t, Target::Tunnel { host: "2001:db8::1".into(), port: 8443 });
        for bad in
            ["CONNECT example.com HTTP/1.1\r\n\r\n", "CONNECT a:0 HTTP/1.1\r\n\r\n", "CONNECT a b:1 HTTP/1.1\r\n\r\n"]
        {
            assert!(parse_request(bad.as_bytes()).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn plain_requests_are_rewritten_to_origin_form() {
        let (host, port, head) = forward(
            "GET http://Example.com:8080/a/b?c=d HTTP/1.1\r\nHost: example.com:8080\r\nProxy-Connection: keep-alive\r\n\
             Proxy-Authorization: x\r\nAccept: */*\r\nConnection: keep-alive\r\nKeep-Alive: 5\r\n\r\n",
        );
        assert_eq!((host.as_str(), port), ("Example.com", 8080));
        assert_eq!(head, "GET /a/b?c=d HTTP/1.1\r\nHost: Example.com:8080\r\nAccept: */*\r\nConnection: close\r\n\r\n");
        let (host, port, head) = forward("POST http://u:p@h.test HTTP/1.0\r\nContent-Length: 3\r\n\r\n");
        assert_eq!((host.as_str(), port), ("h.test", 80));
        assert_eq!(head, "POST / HTTP/1.0\r\nHost: h.test\r\nContent-Length: 3\r\nConnection: close\r\n\r\n");
        let (_, _, head) = forward("GET http://h.test?q HTTP/1.1\r\n\r\n");
        assert!(head.starts_with("GET /?q HTTP/1.1\r\n"), "{head}");
    }

    #[test]
    fn non_proxy_requests_are_refused() {
        assert!(parse_request(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").is_err());
        assert!(parse_request(b"GET https://x/ HTTP/1.1\r\n\r\n").is_err());
        assert!(parse_request(b"\x16\x03\x01garbage\r\n\r\n").is_err());
        assert!(parse_request(b"GET http://bad host/ HTTP/1.1\r\n\r\n").is_err());
    }
}
