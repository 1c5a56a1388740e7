//! The decision: may the guest connect to this name, and to this address?
//!
//! Two checks, both pure functions so they are tested without sending a packet:
//! - [`Policy::decide_name`]: the mode and the allowlist, by the name the guest asked for;
//! - [`Policy::check_address`]: every address the host is about to connect to (after its own
//!   resolution, or an address literal) is refused when it is loopback, private, link-local,
//!   CGNAT, multicast, unspecified, reserved, or an IPv6 form of one of them — unless an
//!   allowed CIDR contains it — and when it is an address of the host itself (any local
//!   interface's, [`HostAddresses`]) unless an allowed CIDR is exactly that address. A name
//!   that resolves to a private address (DNS rebinding, `localtest.me`) is thus refused like
//!   the address itself, and a service the host binds to `0.0.0.0` or `::` cannot be reached
//!   through the host's public or LAN address either.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use umbra_api::session::{NetworkMode, NetworkPolicy};

/// A session's network policy, parsed once.
#[derive(Debug, Clone)]
pub struct Policy {
    mode: NetworkMode,
    /// Exact names, lowercase, no trailing dot.
    exact: Vec<String>,
    /// `*.suffix` entries as `.suffix`.
    suffixes: Vec<String>,
    cidrs: Vec<IpNet>,
    resolve: std::collections::BTreeMap<String, IpAddr>,
    ask_timeout: std::time::Duration,
    /// `tls_passthrough` patterns, normalised.
    passthrough: Vec<String>,
}

/// Why a name or address is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal(pub String);

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A requested name, normalised: lowercase, without a trailing dot.
pub fn normalise(name: &str) -> String {
    name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase()
}

/// `pattern` (`api.example.com`, or `*.example.com` for any name below it) against `host`,
/// both compared as [`normalise`] makes them.
pub fn host_matches(pattern: &str, host: &str) -> bool {
    let (pattern, host) = (normalise(pattern), normalise(host));
    match pattern.strip_prefix("*.") {
        Some(suffix) => host.len() > suffix.len() + 1 && host.ends_with(&format!(".{suffix}")),
        None => pattern == host,
    }
}

impl Policy {
    /// Parses `p` (validated by `NetworkPolicy::validate`; malformed entries are skipped).
    pub fn new(p: &NetworkPolicy) -> Self {
        let mut exact = Vec::new();
        let mut suffixes = Vec::new();
        for d in &p.allow_domains {
            let d = normalise(d);
            match d.strip_prefix("*.") {
                Some(rest) => suffixes.push(format!(".{rest}")),
                None => exact.push(d),
            }
        }
        Self {
            mode: p.mode,
            exact,
            suffixes,
            cidrs: p.allow_cidrs.iter().filter_map(|c| c.parse().ok()).collect(),
            resolve: p.resolve.iter().map(|(k, v)| (normalise(k), *v)).collect(),
            ask_timeout: std::time::Duration::from_secs(p.ask_timeout_secs.unwrap_or(60)),
            passthrough: p.tls_passthrough.iter().map(|d| normalise(d)).collect(),
        }
    }

    /// In mode `ask`, how long a connection to a name outside the allowlist waits for the
    /// user: `None` in the other modes (such a name is refused).
    pub fn ask_timeout(&self) -> Option<std::time::Duration> {
        (self.mode == NetworkMode::Ask).then_some(self.ask_timeout)
    }

    /// Whether the host must never open `name`'s TLS (`tls_passthrough`).
    pub fn tls_passthrough(&self, name: &str) -> bool {
        self.passthrough.iter().any(|p| host_matches(p, name))
    }

    pub fn mode(&self) -> NetworkMode {
        self.mode
    }

    /// The fixed address of `name`, if the policy overrides its resolution.
    pub fn override_for(&self, name: &str) -> Option<IpAddr> {
        self.resolve.get(&normalise(name)).copied()
    }

    fn cidr_allows(&self, addr: IpAddr) -> bool {
        let v4 = to_v4(addr);
        self.cidrs.iter().any(|c| c.contains(&addr) || v4.is_some_and(|v| c.contains(&IpAddr::V4(v))))
    }

    /// May the guest use `name` (a host name or an address literal) at all?
    pub fn decide_name(&self, name: &str) -> Result<(), Refusal> {
        let name = normalise(name);
        if self.mode == NetworkMode::None {
            return Err(Refusal("the session's network mode is none".into()));
        }
        if let Ok(addr) = name.parse::<IpAddr>() {
            // An address literal: in allowlist mode only an explicit CIDR admits it.
            if self.mode == NetworkMode::Allowlist && !self.cidr_allows(addr) {
                return Err(Refusal(format!("{name} is an address, and no allowed CIDR contains it")));
            }
            return Ok(());
        }
        if !umbra_api::session::is_host_name(&name) {
            return Err(Refusal(format!("{name:?} is not a host name")));
        }
        match self.mode {
            NetworkMode::Any => Ok(()),
            _ if self.exact.contains(&name) || self.suffixes.iter().any(|s| name.ends_with(s.as_str())) => Ok(()),
            _ => Err(Refusal(format!("{name} is not in the session's allowlist"))),
        }
    }

    /// Whether an allowed CIDR is exactly `addr` (a /32 or /128 of it, or of the IPv4 address
    /// an IPv6 form stands for).
    fn cidr_names(&self, addr: IpAddr) -> bool {
        let v4 = to_v4(addr).map(IpAddr::V4);
        self.cidrs.iter().any(|c| c.prefix_len() == c.max_prefix_len() && (c.addr() == addr || Some(c.addr()) == v4))
    }

    /// May the host connect to `addr`? Special-purpose addresses only through an explicit
    /// CIDR; the host's own non-loopback addresses (`host`: every local interface's, as
    /// enumerated just before) only through a CIDR that is exactly that address — allowing a
    /// LAN's range does not open the host's own services on it.
    pub fn check_address(&self, addr: IpAddr, host: &HostAddresses) -> Result<(), Refusal> {
        let loopback = addr.is_loopback() || to_v4(addr).is_some_and(|v| v.is_loopback());
        if let Some(interface) = host.interface_of(addr).filter(|_| !loopback) {
            if self.cidr_names(addr) {
                return Ok(());
            }
            return Err(Refusal(format!(
                "{addr} is an address of this host (interface {interface}): a service listening on \
                 0.0.0.0 or :: would answer there (allow it with the CIDR {addr}/{} to reach it)",
                if addr.is_ipv4() { 32 } else { 128 }
            )));
        }
        match special(addr) {
            Some(kind) if !self.cidr_allows(addr) => {
                Err(Refusal(format!("{addr} is a {kind} address (allow it with a CIDR to reach it)")))
            }
            _ => Ok(()),
        }
    }
}

/// The host's own addresses: every address of every local interface, with the interface's
/// name. Connecting to one reaches the host itself (the kernel delivers it locally), so it is
/// refused like loopback. Enumerated again for every decision ([`HostAddresses::current`]): an
/// interface that comes up while a session runs is covered from its next connection on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostAddresses {
    addrs: Vec<(IpAddr, String)>,
}

/// The host's interfaces could not be listed.
#[derive(Debug, thiserror::Error)]
#[error("cannot list the host's network interfaces: {0}")]
pub struct HostAddressesError(#[from] nix::Error);

impl HostAddresses {
    /// These addresses (for tests and callers that enumerated them themselves).
    pub fn new(addrs: impl IntoIterator<Item = (IpAddr, String)>) -> Self {
        Self { addrs: addrs.into_iter().collect() }
    }

    /// Every address of every local interface now (`getifaddrs`), up or not: an interface that
    /// is down can come up between this check and the connect.
    pub fn current() -> Result<Self, HostAddressesError> {
        let mut addrs = Vec::new();
        for ifa in nix::ifaddrs::getifaddrs()? {
            let Some(storage) = ifa.address else { continue };
            let ip = if let Some(v4) = storage.as_sockaddr_in() {
                IpAddr::V4(v4.ip())
            } else if let Some(v6) = storage.as_sockaddr_in6() {
                IpAddr::V6(v6.ip())
            } else {
                continue;
            };
            addrs.push((ip, ifa.interface_name));
        }
        Ok(Self { addrs })
    }

    /// The interface `addr` belongs to, if it is one of the host's (an IPv6 form of an IPv4
    /// address counts as that address).
    pub fn interface_of(&self, addr: IpAddr) -> Option<&str> {
        let v4 = to_v4(addr).map(IpAddr::V4);
        self.addrs.iter().find(|(a, _)| *a == addr || Some(*a) == v4).map(|(_, name)| name.as_str())
    }

    pub fn addresses(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.addrs.iter().map(|(a, _)| *a)
    }
}

/// The IPv4 address an IPv6 address stands for: IPv4-mapped (`::ffff:a.b.c.d`),
/// IPv4-compatible (`::a.b.c.d`) or NAT64 (`64:ff9b::a.b.c.d`).
fn to_v4(addr: IpAddr) -> Option<Ipv4Addr> {
    let IpAddr::V6(v6) = addr else { return None };
    if let Some(v4) = v6.to_ipv4_mapped() {
        return Some(v4);
    }
    let s = v6.segments();
    let tail = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    match s {
        [0, 0, 0, 0, 0, 0, _, _] if !tail.is_unspecified() && tail != Ipv4Addr::new(0, 0, 0, 1) => Some(tail),
        [0x64, 0xff9b, 0, 0, 0, 0, _, _] => Some(tail),
        _ => None,
    }
}

/// What kind of special-purpose address `addr` is, if it is one a guest must not reach by
/// default.
pub fn special(addr: IpAddr) -> Option<&'static str> {
    if let Some(v4) = to_v4(addr) {
        return special_v4(v4);
    }
    match addr {
        IpAddr::V4(v4) => special_v4(v4),
        IpAddr::V6(v6) => special_v6(v6),
    }
}

fn special_v4(a: Ipv4Addr) -> Option<&'static str> {
    let o = a.octets();
    Some(match o {
        [0, ..] => "unspecified (0.0.0.0/8)",
        [127, ..] => "loopback",
        [10, ..] => "private (RFC 1918)",
        [172, b, ..] if (16..32).contains(&b) => "private (RFC 1918)",
        [192, 168, ..] => "private (RFC 1918)",
        [169, 254, ..] => "link-local (and cloud metadata)",
        [100, b, ..] if (64..128).contains(&b) => "carrier-grade NAT (RFC 6598)",
        [192, 0, 0, _] => "IETF protocol assignment",
        [192, 0, 2, _] | [198, 51, 100, _] | [203, 0, 113, _] => "documentation",
        [198, b, ..] if b == 18 || b == 19 => "benchmarking",
        [a, ..] if (224..240).contains(&a) => "multicast",
        [a, ..] if a >= 240 => "reserved or broadcast",
        _ => return None,
    })
}

fn special_v6(a: Ipv6Addr) -> Option<&'static str> {
    let s = a.segments();
    Some(if a.is_unspecified() {
        "unspecified"
    } else if a.is_loopback() {
        "loopback"
    } else if s[0] & 0xfe00 == 0xfc00 {
        "unique local (IPv6 ULA)"
    } else if s[0] & 0xffc0 == 0xfe80 {
        "link-local"
    } else if s[0] & 0xffc0 == 0xfec0 {
        "site-local (deprecated)"
    } else if s[0] & 0xff00 == 0xff00 {
        "multicast"
    } else if s[0] == 0x2001 && s[1] == 0x0db8 {
        "documentation"
    } else if s[0] == 0x0100 && s[1] == 0 && s[2] == 0 && s[3] == 0 {
        "discard-only"
    } else {
        return None;
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(mode: NetworkMode, domains: &[&str], cidrs: &[&str]) -> Policy {
        Policy::new(&NetworkPolicy {
            mode,
            allow_domains: domains.iter().map(|s| s.to_string()).collect(),
            allow_cidrs: cidrs.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        })
    }

    #[test]
    fn names_are_decided_by_mode_and_allowlist() {
        let none = policy(NetworkMode::None, &["example.com"], &[]);
        assert!(none.decide_name("example.com").is_err());
        let list = policy(NetworkMode::Allowlist, &["pypi.org", "*.github.com", "Files.Example."], &[]);
        assert!(list.decide_name("pypi.org").is_ok());
        assert!(list.decide_name("PyPI.org.").is_ok(), "case and a trailing dot do not matter");
        assert!(list.decide_name("api.github.com").is_ok());
        assert!(list.decide_name("a.b.github.com").is_ok());
        assert!(list.decide_name("github.com").is_err(), "*.github.com is below it, not it");
        assert!(list.decide_name("evilgithub.com").is_err());
        assert!(list.decide_name("files.example").is_ok());
        assert!(list.decide_name("pypi.org.evil.net").is_err());
        assert!(list.decide_name("93.184.216.34").is_err(), "literals need a CIDR in allowlist mode");
        assert!(list.decide_name("bad name").is_err());
        let with_cidr = policy(NetworkMode::Allowlist, &[], &["93.184.216.0/24"]);
        assert!(with_cidr.decide_name("93.184.216.34").is_ok());
        let any = policy(NetworkMode::Any, &[], &[]);
        assert!(any.decide_name("anything.example").is_ok());
        assert!(any.decide_name("93.184.216.34").is_ok());
    }

    #[test]
    fn special_addresses_are_refused_unless_a_cidr_names_them() {
        let any = policy(NetworkMode::Any, &[], &[]);
        let none = HostAddresses::default();
        for refused in [
            "127.0.0.1",
            "127.1.2.3",
            "10.1.2.3",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "100.127.255.255",
            "0.0.0.0",
            "224.0.0.1",
            "239.255.255.250",
            "255.255.255.255",
            "198.18.0.5",
            "192.0.2.1",
            "::",
            "::1",
            "fc00::1",
            "fd12:3456::1",
            "fe80::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "::ffff:169.254.169.254",
            "::127.0.0.1",
            "64:ff9b::a00:1",
            "2001:db8::1",
        ] {
            let addr: IpAddr = refused.parse().unwrap();
            assert!(any.check_address(addr, &none).is_err(), "{refused} must be refused");
        }
        for allowed in ["93.184.216.34", "172.32.0.1", "100.128.0.1", "8.8.8.8", "2606:4700::1111", "::ffff:1.1.1.1"] {
            let addr: IpAddr = allowed.parse().unwrap();
            assert!(any.check_address(addr, &none).is_ok(), "{allowed} is public");
        }
        let local = policy(NetworkMode::Any, &[], &["127.0.0.1/32", "10.0.0.0/8"]);
        assert!(local.check_address("127.0.0.1".parse().unwrap(), &none).is_ok());
        assert!(
            local.check_address("::ffff:127.0.0.1".parse().unwrap(), &none).is_ok(),
            "mapped forms follow their v4"
        );
        assert!(local.check_address("127.0.0.2".parse().unwrap(), &none).is_err());
        assert!(local.check_address("10.9.9.9".parse().unwrap(), &none).is_ok());
        assert!(local.check_address("169.254.169.254".parse().unwrap(), &none).is_err());
        let msg = any.check_address("169.254.169.254".parse().unwrap(), &none).unwrap_err().to_string();
        assert!(msg.contains("link-local"), "{msg}");
    }

    #[test]
    fn the_hosts_own_addresses_are_refused_unless_a_cidr_names_them() {
        // A public and a LAN address on this "host": both reach its 0.0.0.0 services.
        let host = HostAddresses::new([
            ("203.0.114.7".parse().unwrap(), "eth0".to_string()),
            ("2606:4700:10::6814:1".parse().unwrap(), "eth0".to_string()),
            ("127.0.0.1".parse().unwrap(), "lo".to_string()),
        ]);
        let any = policy(NetworkMode::Any, &[], &[]);
        for own in ["203.0.114.7", "::ffff:203.0.114.7", "64:ff9b::cb00:7207", "2606:4700:10::6814:1"] {
            let r = any.check_address(own.parse().unwrap(), &host).unwrap_err().to_string();
            assert!(r.contains("address of this host") && r.contains("eth0"), "{own}: {r}");
        }
        // Loopback keeps its own, more specific reason.
        let r = any.check_address("127.0.0.1".parse().unwrap(), &host).unwrap_err().to_string();
        assert!(r.contains("loopback"), "{r}");
        // The neighbour of a host address is another machine: public, allowed.
        assert!(any.check_address("203.0.114.8".parse().unwrap(), &host).is_ok());
        // A range that covers the host's address (its LAN, say) does not open the host: only
        // a CIDR that is exactly the address does. In an allowlist as in `any`.
        for mode in [NetworkMode::Any, NetworkMode::Allowlist] {
            let lan = policy(mode, &["public.example"], &["203.0.114.0/24", "2606:4700:10::/48"]);
            assert!(lan.check_address("203.0.114.7".parse().unwrap(), &host).is_err(), "{mode:?}");
            assert!(lan.check_address("2606:4700:10::6814:1".parse().unwrap(), &host).is_err(), "{mode:?}");
            assert!(lan.check_address("203.0.114.9".parse().unwrap(), &host).is_ok(), "another machine of the LAN");
            let exact = policy(mode, &[], &["203.0.114.7/32", "2606:4700:10::6814:1/128"]);
            assert!(exact.check_address("203.0.114.7".parse().unwrap(), &host).is_ok());
            assert!(exact.check_address("::ffff:203.0.114.7".parse().unwrap(), &host).is_ok());
            assert!(exact.check_address("2606:4700:10::6814:1".parse().unwrap(), &host).is_ok());
        }
        // Loopback keeps range semantics (the host is what 127.0.0.0/8 means).
        let lo = policy(NetworkMode::Any, &[], &["127.0.0.0/8"]);
        assert!(lo.check_address("127.0.0.1".parse().unwrap(), &host).is_ok());
    }

    #[test]
    fn every_address_of_this_machine_is_refused() {
        // The real interfaces, read (never connected to): each of them is refused in `any`
        // mode, with the unspecified addresses a 0.0.0.0 listener also answers on.
        let host = HostAddresses::current().expect("getifaddrs");
        let addrs: Vec<IpAddr> = host.addresses().collect();
        assert!(addrs.iter().any(|a| a.is_loopback()), "lo is listed: {addrs:?}");
        let any = policy(NetworkMode::Any, &[], &[]);
        for a in addrs.iter().copied().chain(["0.0.0.0".parse().unwrap(), "::".parse().unwrap()]) {
            assert!(any.check_address(a, &host).is_err(), "{a} is this host's and must be refused");
        }
    }

    #[test]
    fn overrides_are_by_normalised_name() {
        let mut p = NetworkPolicy { mode: NetworkMode::Allowlist, ..Default::default() };
        p.resolve.insert("Allowed.Test".into(), "127.0.0.1".parse().unwrap());
        let p = Policy::new(&p);
        assert_eq!(p.override_for("allowed.test."), Some("127.0.0.1".parse().unwrap()));
        assert_eq!(p.override_for("other.test"), None);
    }
}
