//! Network egress, guest side (`docs/network.md`, "Guest side").
//!
//! The guest has no interface but `lo`; it reaches the network only through the agent, which
//! turns every connection into an egress stream to the host (`umbra_proto::egress`, over
//! vsock). Two ways in:
//!
//! 1. Proxy-aware programs: an HTTP proxy ([`http`]) and a SOCKS5 proxy ([`socks`]) on
//!    loopback, named in every spawned process's environment ([`proxy_env`]).
//! 2. Everything else, transparently: a DNS server ([`dns`]) that answers allowed names with
//!    fake addresses ([`fakeip`]), a routing set-up that makes every IPv4 address local
//!    ([`iface`]), and an nftables rule ([`nft`], over [`netlink`]) that redirects every TCP
//!    connection to a non-loopback IPv4 address to the transparent listener
//!    ([`transparent`]).
//!
//! [`egress`] opens the host streams and holds the limits every listener shares.

mod accept;
pub mod dns;
pub mod egress;
pub mod fakeip;
pub mod http;
pub mod iface;
pub mod netlink;
pub mod nft;
pub mod socks;
pub mod ssh_agent;
pub mod transparent;
pub mod who;

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::{Arc, OnceLock};

use tokio::net::{TcpListener, UdpSocket};

pub use egress::{Egress, EgressTarget, Limits};

/// The guest's ports.
pub const GUEST_HTTP: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 3128);
pub const GUEST_SOCKS: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 1080);
pub const GUEST_DNS: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(127, 0, 0, 53), 53);
pub const GUEST_TRANSPARENT: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 3129);
pub const RESOLV_CONF: &str = "/etc/resolv.conf";

/// What to start. A listener set to None is not started.
#[derive(Debug, Clone)]
pub struct NetConfig {
    pub egress: EgressTarget,
    pub http: Option<SocketAddrV4>,
    pub socks: Option<SocketAddrV4>,
    pub dns: Option<SocketAddrV4>,
    pub transparent: Option<SocketAddrV4>,
    /// Program this network namespace: `lo`'s fake address, the local default route, the nat
    /// rule (needs CAP_NET_ADMIN). Always in a guest; on the host only when asked.
    pub kernel: bool,
    /// Write this resolv.conf naming the DNS server (in a guest: /etc/resolv.conf).
    pub resolv_conf: Option<std::path::PathBuf>,
}

impl NetConfig {
    /// The guest's set-up, as PID 1.
    pub fn guest() -> Self {
        Self {
            egress: EgressTarget::host(),
            http: Some(GUEST_HTTP),
            socks: Some(GUEST_SOCKS),
            dns: Some(GUEST_DNS),
            transparent: Some(GUEST_TRANSPARENT),
            kernel: true,
            resolv_conf: Some(RESOLV_CONF.into()),
        }
    }

    /// A host-side agent's: every listener on 127.0.0.1 at the given ports (0 = not started),
    /// the host's network and files left alone unless `kernel` is asked for.
    pub fn host(egress: EgressTarget, ports: NetPorts, kernel: bool) -> Self {
        let at = |port: u16| (port != 0).then(|| SocketAddrV4::new(Ipv4Addr::LOCALHOST, port));
        Self {
            egress,
            http: at(ports.http),
            socks: at(ports.socks),
            dns: at(ports.dns),
            transparent: at(ports.transparent),
            kernel,
            resolv_conf: None,
        }
    }
}

/// `--net-ports HTTP,SOCKS,DNS,TRANSPARENT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetPorts {
    pub http: u16,
    pub socks: u16,
    pub dns: u16,
    pub transparent: u16,
}

impl std::str::FromStr for NetPorts {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let ports: Vec<u16> = s
            .split(',')
            .map(|p| p.trim().parse::<u16>().map_err(|_| format!("bad port {p:?} in {s:?}")))
            .collect::<Result<_, _>>()?;
        let [http, socks, dns, transparent] = ports[..] else {
            return Err(format!("{s:?}: expected four ports HTTP,SOCKS,DNS,TRANSPARENT (0 = off)"));
        };
        Ok(Self { http, socks, dns, transparent })
    }
}

static PROXY_ENV: OnceLock<Vec<(String, String)>> = OnceLock::new();

/// Variables every spawned process gets (before the request's own `env`, which wins): the
/// proxies, in upper and lower case. Empty when the agent serves no proxy.
pub fn proxy_env() -> &'static [(String, String)] {
    PROXY_ENV.get().map(Vec::as_slice).unwrap_or(&[])
}

fn set_proxy_env(http: Option<SocketAddrV4>, socks: Option<SocketAddrV4>) {
    let mut vars = Vec::new();
    let mut both = |name: &str, value: String| {
        vars.push((name.to_ascii_uppercase(), value.clone()));
        vars.push((name.to_ascii_lowercase(), value));
    };
    if let Some(a) = http {
        both("http_proxy", format!("http://{a}"));
        both("https_proxy", format!("http://{a}"));
    }
    if let Some(a) = socks {
        both("all_proxy", format!("socks5h://{a}"));
    }
    if http.is_some() || socks.is_some() {
        both("no_proxy", "localhost,127.0.0.1,::1".into());
    }
    let _ = PROXY_ENV.set(vars);
}

/// Sets up egress: the kernel side first when asked (each step on its own: a failure is
/// logged as an error and the rest goes on), then the listeners. Returns an error only when
/// no listener could start at all; every failure is logged. Must run inside the runtime.
pub async fn start(config: NetConfig) -> anyhow::Result<()> {
    let mut failures = 0;
    if config.kernel {
        // Already up in a guest (PID 1's init); not yet in a fresh namespace.
        if let Err(e) = crate::pid1::loopback_up() {
            tracing::error!("network egress: cannot bring up lo: {e}");
            failures += 1;
        }
        if let Err(e) = iface::setup_loopback(fakeip::FAKE_LO, fakeip::FAKE_PREFIX) {
            tracing::error!("network egress: cannot route the fake range through lo: {e}");
            failures += 1;
        }
        match config.transparent {
            Some(t) => {
                if let Err(e) = nft::install_redirect(t.port()) {
                    tracing::error!(
                        "network egress: cannot install the nftables redirect (programs that ignore the proxy \
                         variables will get no connections): {e}"
                    );
                    failures += 1;
                }
            }
            None => tracing::warn!("network egress: no transparent listener, no redirect rule"),
        }
    }
    let egress = Arc::new(Egress::new(
        config.egress.clone(),
        Limits::default(),
        Arc::new(fakeip::FakeIps::new(fakeip::DEFAULT_CAPACITY)),
    ));
    let mut started = 0;
    let mut bind = |what: &str, addr: Option<SocketAddrV4>| -> Option<std::net::TcpListener> {
        let addr = addr?;
        match std::net::TcpListener::bind(addr).and_then(|l| l.set_nonblocking(true).map(|()| l)) {
            Ok(l) => {
                started += 1;
                Some(l)
            }
            Err(e) => {
                tracing::error!("network egress: cannot listen on {addr} for the {what}: {e}");
                failures += 1;
                None
            }
        }
    };
    let http = bind("HTTP proxy", config.http);
    let socks = bind("SOCKS5 proxy", config.socks);
    let transparent = bind("transparent listener", config.transparent);
    let dns_tcp = bind("DNS server (TCP)", config.dns);
    let dns_udp = config.dns.and_then(|addr| {
        match std::net::UdpSocket::bind(addr).and_then(|s| s.set_nonblocking(true).map(|()| s)) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::error!("network egress: cannot listen on {addr}/udp for the DNS server: {e}");
                failures += 1;
                None
            }
        }
    });
    set_proxy_env(http.as_ref().and(config.http), socks.as_ref().and(config.socks));
    if let Some(l) = http {
        tokio::spawn(http::serve(TcpListener::from_std(l)?, egress.clone()));
    }
    if let Some(l) = socks {
        tokio::spawn(socks::serve(TcpListener::from_std(l)?, egress.clone()));
    }
    if let Some(l) = transparent {
        tokio::spawn(transparent::serve(TcpListener::from_std(l)?, egress.clone()));
    }
    if let Some(l) = dns_tcp {
        tokio::spawn(dns::serve_tcp(TcpListener::from_std(l)?, egress.clone()));
    }
    // In a guest, the session's SSH agent (on the host) at a socket of ours.
    if config.kernel {
        match ssh_agent::listen() {
            Ok(l) => {
                tokio::spawn(ssh_agent::serve(l, egress.clone()));
            }
            Err(e) => {
                tracing::error!("network egress: cannot listen on {} for the SSH agent: {e}", ssh_agent::SOCKET);
                failures += 1;
            }
        }
    }
    let dns_up = dns_udp.is_some();
    if let Some(s) = dns_udp {
        tokio::spawn(dns::serve_udp(UdpSocket::from_std(s)?, egress.clone()));
    }
    if let (Some(path), Some(dns)) = (&config.resolv_conf, config.dns.filter(|_| dns_up)) {
        if let Err(e) = write_resolv_conf(path, dns) {
            tracing::error!("network egress: cannot write {}: {e}", path.display());
            failures += 1;
        }
    }
    if failures > 0 {
        tracing::error!("network egress: set up with {failures} failure(s) (see above); the agent carries on");
    } else {
        tracing::info!(?config, "network egress ready");
    }
    if started == 0 && !dns_up {
        anyhow::bail!("no egress listener could start");
    }
    Ok(())
}

/// Points the resolver at our DNS server. Only a server on port 53 can be named there.
fn write_resolv_conf(path: &std::path::Path, dns: SocketAddrV4) -> std::io::Result<()> {
    if dns.port() != 53 {
        return Err(std::io::Error::other(format!("the DNS server is on port {}, not 53", dns.port())));
    }
    let text = format!(
        "# Written by umbra-agent at boot: the guest's only DNS server is the agent, which asks the host.\n\
         nameserver {}\noptions timeout:5 attempts:2\n",
        dns.ip()
    );
    // Replace, never write through: the image may ship it as a symlink or read-only file.
    let tmp = path.with_extension("umbra-tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_parse() {
        let p: NetPorts = "3128,1080,0,3129".parse().unwrap();
        assert_eq!(p, NetPorts { http: 3128, socks: 1080, dns: 0, transparent: 3129 });
        assert!("1,2,3".parse::<NetPorts>().is_err());
        assert!("1,2,3,x".parse::<NetPorts>().is_err());
    }
}

/// The kernel side for real: in a private network namespace (a child process of the test
/// binary: unshare(CLONE_NEWNET) affects the whole calling process's view from then on), bring
/// up lo, route the fake range and install the nat rule exactly as a guest does, then check
/// that connections to a fake address and to an address literal reach a listener on
/// 127.0.0.1 with SO_ORIGINAL_DST naming where they were going. The namespace has no interface
/// but lo, so nothing can leave it. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN for unshare) and
/// a kernel with nf_tables, NAT and redirect; skipped with a note when not root.
#[cfg(test)]
mod netns_tests {
    use std::io::{Read, Write};
    use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
    use std::os::unix::process::CommandExt;
    use std::time::Duration;

    use nix::sys::socket::{getsockopt, sockopt};

    const CHILD_FLAG: &str = "UMBRA_AGENT_NETNS_CHILD";

    fn original_dst(s: &TcpStream) -> SocketAddrV4 {
        let sin = getsockopt(s, sockopt::OriginalDst).expect("SO_ORIGINAL_DST");
        SocketAddrV4::new(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)), u16::from_be(sin.sin_port))
    }

    #[test]
    fn redirect_in_a_private_netns() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: needs root for a private network namespace and nftables");
            return;
        }
        let exe = std::env::current_exe().unwrap();
        let mut cmd = std::process::Command::new(exe);
        cmd.args(["--exact", "net::netns_tests::netns_child", "--nocapture", "--test-threads=1"]).env(CHILD_FLAG, "1");
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
        let out = cmd.output().expect("run the test binary in a new network namespace");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "child failed:\n{text}");
        assert!(text.contains("netns child: all checks passed"), "the child did not run its checks:\n{text}");
    }

    /// Runs only inside the namespace made by [`redirect_in_a_private_netns`] (a no-op otherwise).
    #[test]
    fn netns_child() {
        if std::env::var_os(CHILD_FLAG).is_none() {
            return;
        }
        crate::pid1::loopback_up().expect("bring up lo");
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        super::iface::setup_loopback(super::fakeip::FAKE_LO, super::fakeip::FAKE_PREFIX).expect("route via lo");
        // Twice: the second batch replaces the first (idempotent), and so does the address.
        super::nft::install_redirect(port.wrapping_add(1)).expect("install the rule");
        super::iface::setup_loopback(super::fakeip::FAKE_LO, super::fakeip::FAKE_PREFIX).expect("again");
        super::nft::install_redirect(port).expect("replace the rule");

        for dest in
            [SocketAddrV4::new(Ipv4Addr::new(198, 18, 0, 5), 443), SocketAddrV4::new(Ipv4Addr::new(203, 0, 113, 7), 80)]
        {
            let mut client = TcpStream::connect_timeout(&dest.into(), Duration::from_secs(5))
                .unwrap_or_else(|e| panic!("connect to {dest}: {e}"));
            let (mut accepted, _) = listener.accept().unwrap();
            assert_eq!(original_dst(&accepted), dest);
            client.write_all(b"hi").unwrap();
            let mut got = [0u8; 2];
            accepted.read_exact(&mut got).unwrap();
            assert_eq!(&got, b"hi");
        }
        // Loopback is left alone: a connection to 127.0.0.1 reaches its own port.
        let direct = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        assert_eq!(original_dst(&accepted), SocketAddrV4::new(Ipv4Addr::LOCALHOST, port));
        drop(direct);
        // UDP to an outside address is answered by the local stack at once (port unreachable).
        let udp = UdpSocket::bind("0.0.0.0:0").unwrap();
        udp.connect("203.0.113.7:53").unwrap();
        udp.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        udp.send(b"x").unwrap();
        let e = udp.recv(&mut [0u8; 16]).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{e}");
        println!("netns child: all checks passed");
    }
}
