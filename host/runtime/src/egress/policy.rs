//! The decision: may the guest connect to this name, and to this address?
//!
//! Two checks, both pure functions so they are tested without sending a packet:
//! - [`Policy::decide_name`]: the mode and the allowlist, by the name the guest asked for;
//! - [`Policy::check_address`]: every address the host is about to connect to (after its own
//!   resolution, or an address literal) is refused when it is loopback, private, link-local,
//!   CGNAT, multicast, unspecified, reserved, or an IPv6 form of one of them — unless an
//!   explicit CIDR allow names it. A name that resolves to a private address (DNS rebinding,
//!   `localtest.me`) is thus refused like the address itself.

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
        }
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

    /// May the host connect to `addr`? Special-purpose addresses only through an explicit CIDR.
    pub fn check_address(&self, addr: IpAddr) -> Result<(), Refusal> {
        match special(addr) {
            Some(kind) if !self.cidr_allows(addr) => {
                Err(Refusal(format!("{addr} is a {kind} address (allow it with a CIDR to reach it)")))
            }
            _ => Ok(()),
        }
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
            resolve: Default::default(),
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
            assert!(any.check_address(addr).is_err(), "{refused} must be refused");
        }
        for allowed in ["93.184.216.34", "172.32.0.1", "100.128.0.1", "8.8.8.8", "2606:4700::1111", "::ffff:1.1.1.1"] {
            let addr: IpAddr = allowed.parse().unwrap();
            assert!(any.check_address(addr).is_ok(), "{allowed} is public");
        }
        let local = policy(NetworkMode::Any, &[], &["127.0.0.1/32", "10.0.0.0/8"]);
        assert!(local.check_address("127.0.0.1".parse().unwrap()).is_ok());
        assert!(local.check_address("::ffff:127.0.0.1".parse().unwrap()).is_ok(), "mapped forms follow their v4");
        assert!(local.check_address("127.0.0.2".parse().unwrap()).is_err());
        assert!(local.check_address("10.9.9.9".parse().unwrap()).is_ok());
        assert!(local.check_address("169.254.169.254".parse().unwrap()).is_err());
        let msg = any.check_address("169.254.169.254".parse().unwrap()).unwrap_err().to_string();
        assert!(msg.contains("link-local"), "{msg}");
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
