//! The user's own way out: a company's HTTP proxy between this host and the internet. When one
//! is configured (umbrad's `upstream_proxy`, else the host's `HTTPS_PROXY`/`HTTP_PROXY`), every
//! connection the guest is allowed goes through it as an HTTP `CONNECT` tunnel (with
//! `Proxy-Authorization: Basic` when the URL carries a user), except to the names and
//! addresses `NO_PROXY` lists.

use std::net::IpAddr;
use std::time::Duration;

use base64::Engine as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::policy::normalise;

/// The longest response head a proxy may answer `CONNECT` with.
const MAX_RESPONSE_HEAD: usize = 8 * 1024;

#[derive(Clone, PartialEq, Eq)]
pub struct UpstreamProxy {
    host: String,
    port: u16,
    /// `user:password`, for `Proxy-Authorization: Basic`.
    credentials: Option<String>,
    no_proxy: Vec<NoProxy>,
}

impl std::fmt::Debug for UpstreamProxy {
    // Never the password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UpstreamProxy({})", self.address())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum NoProxy {
    All,
    /// A name and every name below it (`example.com`, `.example.com`).
    Domain(String),
    Net(ipnet::IpNet),
}

/// Percent-decoding of a URL's user or password.
fn decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3).ok_or("a % without two hex digits")?;
            out.push(u8::from_str_radix(hex, 16).map_err(|_| format!("%{hex} is not a hex escape"))?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "not UTF-8".to_string())
}

impl UpstreamProxy {
    /// `http://[user[:password]@]host[:port][/]` (the port defaults to 1080, as curl's), and a
    /// `NO_PROXY` list: `*`, names (each with the names below it, a leading `.` ignored),
    /// addresses and CIDRs, separated by commas or spaces.
    pub fn parse(url: &str, no_proxy: &str) -> Result<Self, String> {
        let bad = |why: &str| format!("upstream proxy {:?}: {why}", redact(url));
        let rest = url.strip_prefix("http://").ok_or_else(|| bad("only http:// proxies are supported"))?;
        let rest = rest.trim_end_matches('/');
        if rest.contains('/') || rest.contains('?') {
            return Err(bad("give only the scheme, host and port"));
        }
        let (userinfo, hostport) = match rest.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, rest),
        };
        let credentials = userinfo
            .map(|u| {
                let (user, pass) = u.split_once(':').unwrap_or((u, ""));
                Ok::<_, String>(format!("{}:{}", decode(user)?, decode(pass)?))
            })
            .transpose()
            .map_err(|e| bad(&e))?;
        // `[v6]:port`, `[v6]`, `host:port`, `host`.
        let (host, port) = match hostport.strip_prefix('[') {
            Some(v6) => {
                let (h, after) = v6.split_once(']').ok_or_else(|| bad("an unclosed ["))?;
                (h, after.strip_prefix(':'))
            }
            None => match hostport.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (hostport, None),
            },
        };
        let port = match port {
            Some(p) => p.parse::<u16>().map_err(|_| bad(&format!("{p:?} is not a port")))?,
            None => 1080,
        };
        let host = host.to_string();
        if host.is_empty() || !(host.parse::<IpAddr>().is_ok() || umbra_api::session::is_host_name(&host)) {
            return Err(bad("no host name or address"));
        }
        let no_proxy = no_proxy
            .split([',', ' '])
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|e| match e {
                "*" => NoProxy::All,
                _ => match e.parse::<ipnet::IpNet>().or_else(|_| e.parse::<IpAddr>().map(ipnet::IpNet::from)) {
                    Ok(net) => NoProxy::Net(net),
                    Err(_) => NoProxy::Domain(normalise(e.trim_start_matches("*.").trim_start_matches('.'))),
                },
            })
            .collect();
        Ok(Self { host, port, credentials, no_proxy })
    }

    /// From the environment of this process (umbrad's, vmctl's): `HTTPS_PROXY`, else
    /// `HTTP_PROXY` (either case), and `NO_PROXY`. `None` when neither is set.
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Option<Result<Self, String>> {
        let get = |name: &str| var(name).or_else(|| var(&name.to_ascii_lowercase())).filter(|v| !v.is_empty());
        let url = get("HTTPS_PROXY").or_else(|| get("HTTP_PROXY"))?;
        Some(Self::parse(&url, &get("NO_PROXY").unwrap_or_default()))
    }

    /// `host:port`, for messages and events.
    pub fn address(&self) -> String {
        match self.host.contains(':') {
            true => format!("[{}]:{}", self.host, self.port),
            false => format!("{}:{}", self.host, self.port),
        }
    }

    /// Whether a connection to `name` (a host name or an address literal) goes through it.
    pub fn applies_to(&self, name: &str) -> bool {
        let name = normalise(name);
        let addr = name.parse::<IpAddr>().ok();
        !self.no_proxy.iter().any(|e| match (e, addr) {
            (NoProxy::All, _) => true,
            (NoProxy::Net(net), Some(a)) => net.contains(&a),
            (NoProxy::Domain(d), None) => name == *d || name.ends_with(&format!(".{d}")),
            _ => false,
        })
    }

    /// A tunnel through the proxy to `target:port` (`target` a name or an address), or why
    /// not. Reads the proxy's answer byte by byte so nothing after it is taken from the tunnel.
    pub async fn connect(&self, target: &str, port: u16, timeout: Duration) -> Result<TcpStream, String> {
        let proxy = self.address();
        let work = async {
            let mut s = TcpStream::connect((self.host.as_str(), self.port))
                .await
                .map_err(|e| format!("cannot connect to the upstream proxy {proxy}: {e}"))?;
            let _ = s.set_nodelay(true);
            let authority = match target.contains(':') {
                true => format!("[{target}]:{port}"),
                false => format!("{target}:{port}"),
            };
            let mut request = format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n");
            if let Some(c) = &self.credentials {
                let basic = base64::engine::general_purpose::STANDARD.encode(c);
                request.push_str(&format!("Proxy-Authorization: Basic {basic}\r\n"));
            }
            request.push_str("\r\n");
            s.write_all(request.as_bytes()).await.map_err(|e| format!("the upstream proxy {proxy}: {e}"))?;
            let mut head = Vec::new();
            while !head.ends_with(b"\r\n\r\n") {
                if head.len() >= MAX_RESPONSE_HEAD {
                    return Err(format!(
                        "the upstream proxy {proxy} answered with more than {MAX_RESPONSE_HEAD} bytes of head"
                    ));
                }
                let mut byte = [0u8];
                match s.read(&mut byte).await {
                    Ok(0) => return Err(format!("the upstream proxy {proxy} closed the connection")),
                    Ok(_) => head.push(byte[0]),
                    Err(e) => return Err(format!("the upstream proxy {proxy}: {e}")),
                }
            }
            let status = String::from_utf8_lossy(&head).lines().next().unwrap_or_default().to_string();
            let code = status.split_whitespace().nth(1).unwrap_or_default();
            match code {
                "200" => Ok(s),
                "407" => Err(format!("the upstream proxy {proxy} refused our credentials ({status})")),
                _ => Err(format!("the upstream proxy {proxy} refused CONNECT {authority}: {status}")),
            }
        };
        tokio::time::timeout(timeout, work)
            .await
            .unwrap_or_else(|_| Err(format!("the upstream proxy {proxy} did not answer within {timeout:?}")))
    }
}

/// `url` without its password, for error messages.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}://…@{}", &url[..s], &url[at + 1..]),
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncBufReadExt, BufReader};

    #[test]
    fn urls_and_no_proxy_lists_are_parsed() {
        let p =
            UpstreamProxy::parse("http://us%40er:p%3Ass@proxy.corp:8080/", "localhost, .internal.corp,10.0.0.0/8 ::1")
                .unwrap();
        assert_eq!(p.address(), "proxy.corp:8080");
        assert_eq!(p.credentials.as_deref(), Some("us@er:p:ss"));
        assert!(!format!("{p:?}").contains("p:ss"));
        assert!(p.applies_to("api.example.com"));
        assert!(!p.applies_to("LOCALHOST"));
        assert!(!p.applies_to("git.internal.corp") && !p.applies_to("internal.corp"));
        assert!(!p.applies_to("10.1.2.3") && !p.applies_to("::1") && p.applies_to("11.0.0.1"));
        assert_eq!(UpstreamProxy::parse("http://10.0.0.1", "").unwrap().address(), "10.0.0.1:1080");
        assert_eq!(UpstreamProxy::parse("http://[::1]:3128", "").unwrap().address(), "[::1]:3128");
        assert!(!UpstreamProxy::parse("http://p:1", "*").unwrap().applies_to("anything.example"));
        for bad in ["https://p:1", "socks5://p:1", "http://p:99999", "http://", "http://p:1/path"] {
            assert!(UpstreamProxy::parse(bad, "").is_err(), "{bad}");
        }
        let e = UpstreamProxy::parse("ftp://u:secret@p", "").unwrap_err();
        assert!(!e.contains("secret"), "{e}");
        let env = |k: &str| (k == "https_proxy").then(|| "http://p:3128".to_string());
        assert_eq!(UpstreamProxy::from_env(env).unwrap().unwrap().address(), "p:3128");
        assert!(UpstreamProxy::from_env(|_| None).is_none());
    }

    /// A CONNECT proxy on 127.0.0.1 wanting `u:pw`: answers 407 otherwise, else tunnels to
    /// an echo of what follows. Returns its port and the requests' heads.
    async fn authenticating_proxy() -> (u16, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let heads = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = heads.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                let seen = seen.clone();
                tokio::spawn(async move {
                    let mut r = BufReader::new(s);
                    let mut head = String::new();
                    loop {
                        let mut line = String::new();
                        if r.read_line(&mut line).await.unwrap_or(0) == 0 || line == "\r\n" {
                            break;
                        }
                        head.push_str(&line);
                    }
                    let ok = head.contains(&format!(
                        "Proxy-Authorization: Basic {}",
                        base64::engine::general_purpose::STANDARD.encode("u:pw")
                    ));
                    seen.lock().unwrap().push(head);
                    let s = r.get_mut();
                    if !ok {
                        let _ = s.write_all(b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n").await;
                        return;
                    }
                    let _ = s.write_all(b"HTTP/1.1 200 Connection established\r\n\r\nbanner").await;
                    let mut buf = [0u8; 64];
                    if let Ok(n) = s.read(&mut buf).await {
                        let _ = s.write_all(&buf[..n]).await;
                    }
                });
            }
        });
        (port, heads)
    }

    #[tokio::test]
    async fn a_tunnel_is_made_with_credentials_and_refused_without() {
        let (port, heads) = authenticating_proxy().await;
        let with = UpstreamProxy::parse(&format!("http://u:pw@127.0.0.1:{port}"), "").unwrap();
        let mut tunnel = with.connect("api.example.com", 443, Duration::from_secs(5)).await.unwrap();
        // Nothing after the proxy's head was consumed: the server's first bytes are ours.
        let mut banner = [0u8; 6];
        tunnel.read_exact(&mut banner).await.unwrap();
        assert_eq!(&banner, b"banner");
        tunnel.write_all(b"ping").await.unwrap();
        let mut back = [0u8; 4];
        tunnel.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"ping");
        assert!(heads.lock().unwrap()[0].starts_with("CONNECT api.example.com:443 HTTP/1.1\r\n"));

        let without = UpstreamProxy::parse(&format!("http://127.0.0.1:{port}"), "").unwrap();
        let e = without.connect("api.example.com", 443, Duration::from_secs(5)).await.unwrap_err();
        assert!(e.contains("refused our credentials") && e.contains("407"), "{e}");
        let closed = UpstreamProxy::parse("http://127.0.0.1:1", "").unwrap();
        assert!(closed.connect("a.example", 1, Duration::from_secs(5)).await.unwrap_err().contains("cannot connect"));
    }
}
