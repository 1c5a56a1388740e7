//! A session's network policy: what the guest may connect to. Egress (`umbra-runtime`)
//! enforces it; it lives here so a [`crate::SandboxPolicy`] can carry it and the IPC contract
//! (`umbra-api`) can re-export one type.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// How much network a session gets. Every connection the guest opens is decided on the host,
/// by the name it was opened for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum NetworkMode {
    /// No connection leaves the guest (DNS answers nothing).
    #[default]
    None,
    /// Only the names in `allow_domains` (exact, or `*.suffix` for names below a domain), and
    /// addresses in `allow_cidrs`.
    Allowlist,
    /// As `allowlist`, and a connection to any other name waits while the user is asked
    /// (`permission_request` with `kind: "network"`): allowed once, for the session, or denied;
    /// silence denies after `ask_timeout_secs`.
    Ask,
    /// Any public address; private, loopback and link-local ones still only through
    /// `allow_cidrs`.
    Any,
}

/// A session's network policy.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct NetworkPolicy {
    pub mode: NetworkMode,
    /// Names the guest may connect to in `allowlist` mode: `example.com` (that name only) or
    /// `*.example.com` (any name below it, not `example.com` itself).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub allow_domains: Vec<String>,
    /// Address ranges (`10.0.0.0/8`, `127.0.0.1/32`, `::1/128`) the guest may reach even though
    /// they are private, loopback or link-local, and that an address literal may name in
    /// `allowlist` mode.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub allow_cidrs: Vec<String>,
    /// Names the host resolves to a fixed address instead of asking DNS (like curl's
    /// `--resolve`): `{"allowed.test": "127.0.0.1"}`.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub resolve: std::collections::BTreeMap<String, std::net::IpAddr>,
    /// In `ask` mode, how long a connection waits for the user's answer (default 60 s, at
    /// most 3600); silence denies.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ask_timeout_secs: Option<u64>,
    /// Names whose TLS the host never opens (`pinned.example.com`, `*.example.com`), even when
    /// a secret is bound to them — say inside a `*.example.com` binding, for a client that
    /// pins its server's certificate. A secret's placeholder then reaches such a host unchanged.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tls_passthrough: Vec<String>,
}

impl NetworkMode {
    /// Whether the mode lists the names it allows (`allowlist`, `ask`).
    pub fn lists_names(self) -> bool {
        matches!(self, NetworkMode::Allowlist | NetworkMode::Ask)
    }

    pub fn name(self) -> &'static str {
        match self {
            NetworkMode::None => "none",
            NetworkMode::Allowlist => "allowlist",
            NetworkMode::Ask => "ask",
            NetworkMode::Any => "any",
        }
    }
}

impl NetworkPolicy {
    /// Checks the domains and CIDRs are well formed.
    pub fn validate(&self) -> Result<(), String> {
        for d in &self.allow_domains {
            let name = d.strip_prefix("*.").unwrap_or(d);
            if !is_host_name(name) {
                return Err(format!("allow_domains: {d:?} is not a host name or *.domain"));
            }
        }
        for c in &self.allow_cidrs {
            if !is_cidr(c) {
                return Err(format!("allow_cidrs: {c:?} is not an address range such as 10.0.0.0/8 or ::1/128"));
            }
        }
        for d in &self.tls_passthrough {
            if !is_host_name(d.strip_prefix("*.").unwrap_or(d)) {
                return Err(format!("tls_passthrough: {d:?} is not a host name or *.domain"));
            }
        }
        if self.ask_timeout_secs.is_some_and(|t| !(1..=3600).contains(&t)) {
            return Err("ask_timeout_secs must be within 1..=3600".into());
        }
        for name in self.resolve.keys() {
            if !is_host_name(name) {
                return Err(format!("resolve: {name:?} is not a host name"));
            }
        }
        Ok(())
    }
}

/// A host name in text form: dot-separated labels of letters, digits, `-` and `_` (1 to 63
/// bytes, not starting or ending with `-`), at most 253 bytes.
pub fn is_host_name(name: &str) -> bool {
    let name = name.strip_suffix('.').unwrap_or(name);
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

fn is_cidr(s: &str) -> bool {
    let Some((addr, len)) = s.split_once('/') else { return false };
    let Ok(addr) = addr.parse::<std::net::IpAddr>() else { return false };
    let max = if addr.is_ipv4() { 32 } else { 128 };
    len.parse::<u8>().is_ok_and(|l| l <= max)
}
