//! The restriction order of the set-valued fields, and their meets (the most restrictive value
//! two sources both allow).
//!
//! Each set is kept in a canonical form — sorted, with no entry that another entry already
//! implies — so that two merges that allow the same things are *equal*, which is what makes
//! merging commutative and associative as values, not only in meaning.
//!
//! - Extra paths: an access function (none < read-only < read-write) over paths where the most
//!   specific listed entry decides. The meet is the pointwise minimum; it only ever needs the
//!   paths some source listed (the longest listed prefix of any path decides its access in every
//!   source at once), and a path with no access never sits below one with access.
//! - Domains: `name` (that name) or `*.suffix` (names strictly below it); the meet keeps each
//!   pattern the other side covers.
//! - CIDRs: ranges nest or are disjoint, so the meet keeps each range the other side contains.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use crate::network::{NetworkMode, NetworkPolicy};
use ipnet::IpNet;

use crate::policy::{normalize_path, EffectivePolicy, PolicyType, SandboxPolicy};

// In this module, not beside the type: the canonical forms are this module's, and the policy
// module stays below it (no import goes both ways).
impl SandboxPolicy {
    /// The policy with defaults for what no source set: `workspace_readwrite`, network `none`,
    /// no extra paths, git and /tmp writable, nothing ignored; every set in canonical form.
    pub fn effective(&self) -> EffectivePolicy {
        let (rw, ro) = PathAccess::from_policy(self).map(|a| a.into_lists()).unwrap_or_default();
        let mut ignore = self.ignore.clone().unwrap_or_default();
        ignore.sort();
        ignore.dedup();
        EffectivePolicy {
            kind: self.kind.unwrap_or(PolicyType::WorkspaceReadwrite),
            network: self.network.as_ref().map(canonical_network).unwrap_or_default(),
            additional_readwrite_paths: rw,
            additional_readonly_paths: ro,
            block_git_writes: self.block_git_writes.unwrap_or(false),
            disable_tmp_write: self.disable_tmp_write.unwrap_or(false),
            ignore,
        }
    }
}

/// Access to a path; `Ord` is the restriction order (`None` most restrictive).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Access {
    None,
    ReadOnly,
    ReadWrite,
}

/// The extra-paths part of a policy, canonical: only the paths whose access differs from their
/// nearest listed ancestor's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PathAccess {
    grants: BTreeMap<PathBuf, Access>,
}

impl PathAccess {
    /// `None` when the policy says nothing about paths (neither list set); a policy that sets
    /// one list has the other empty. Paths that do not normalize are left out (validation
    /// refuses them).
    pub fn from_policy(policy: &SandboxPolicy) -> Option<Self> {
        if policy.additional_readwrite_paths.is_none() && policy.additional_readonly_paths.is_none() {
            return None;
        }
        let mut grants = BTreeMap::new();
        for path in policy.additional_readwrite_paths.iter().flatten() {
            if let Some(path) = normalize_path(path) {
                grants.insert(path, Access::ReadWrite);
            }
        }
        // A path in both lists is read-only: the more restrictive reading of a contradiction.
        for path in policy.additional_readonly_paths.iter().flatten() {
            if let Some(path) = normalize_path(path) {
                grants.insert(path, Access::ReadOnly);
            }
        }
        Some(Self { grants }.canonical())
    }

    /// The access the most specific listed entry gives `path`.
    pub fn access(&self, path: &Path) -> Access {
        path.ancestors().find_map(|p| self.grants.get(p).copied()).unwrap_or(Access::None)
    }

    /// Access of the nearest listed strict ancestor.
    fn inherited(&self, path: &Path) -> Access {
        path.ancestors().skip(1).find_map(|p| self.grants.get(p).copied()).unwrap_or(Access::None)
    }

    fn canonical(self) -> Self {
        let grants =
            self.grants.iter().filter(|(p, a)| self.inherited(p) != **a).map(|(p, a)| (p.clone(), *a)).collect();
        Self { grants }
    }

    /// Pointwise minimum of the two access functions.
    pub fn meet(&self, other: &Self) -> Self {
        let grants = self
            .grants
            .keys()
            .chain(other.grants.keys())
            .map(|p| (p.clone(), self.access(p).min(other.access(p))))
            .filter(|(_, a)| *a != Access::None)
            .collect();
        Self { grants }.canonical()
    }

    /// Whether every path has at most the access `other` gives it.
    pub fn within(&self, other: &Self) -> bool {
        self.grants.keys().chain(other.grants.keys()).all(|p| self.access(p) <= other.access(p))
    }

    /// Back to the policy's two lists, sorted.
    pub fn into_lists(self) -> (Vec<PathBuf>, Vec<PathBuf>) {
        let mut rw = Vec::new();
        let mut ro = Vec::new();
        for (path, access) in self.grants {
            match access {
                Access::ReadWrite => rw.push(path),
                Access::ReadOnly => ro.push(path),
                Access::None => {}
            }
        }
        (rw, ro)
    }
}

/// A domain pattern, lower-case and without a trailing dot.
fn domain_key(pattern: &str) -> String {
    pattern.trim_end_matches('.').to_ascii_lowercase()
}

/// Whether every name `pattern` matches is matched by `by`.
fn domain_covered(pattern: &str, by: &str) -> bool {
    let Some(suffix) = by.strip_prefix("*.") else { return pattern == by };
    let below = |name: &str| name.ends_with(&format!(".{suffix}"));
    match pattern.strip_prefix("*.") {
        // `*.sub` is covered by `*.suffix` when sub is suffix or below it.
        Some(sub) => sub == suffix || below(sub),
        // A name is covered when it is strictly below the suffix.
        None => below(pattern),
    }
}

fn canonical_domains(domains: &[String]) -> Vec<String> {
    let mut keys: Vec<String> = domains.iter().map(|d| domain_key(d)).collect();
    keys.sort();
    keys.dedup();
    keys.iter().filter(|d| !keys.iter().any(|other| other != *d && domain_covered(d, other))).cloned().collect()
}

fn domains_meet(a: &[String], b: &[String]) -> Vec<String> {
    let kept: Vec<String> = a
        .iter()
        .filter(|d| b.iter().any(|o| domain_covered(d, o)))
        .chain(b.iter().filter(|d| a.iter().any(|o| domain_covered(d, o))))
        .cloned()
        .collect();
    canonical_domains(&kept)
}

fn domains_within(a: &[String], b: &[String]) -> bool {
    a.iter().all(|d| b.iter().any(|o| domain_covered(&domain_key(d), &domain_key(o))))
}

/// A CIDR as written, or its network if it parses (an unparsable one only matches itself;
/// validation refuses it anyway).
fn cidr_key(cidr: &str) -> Result<IpNet, String> {
    cidr.parse::<IpNet>().map(|n| n.trunc()).map_err(|_| cidr.to_string())
}

fn cidr_covered(a: &Result<IpNet, String>, b: &Result<IpNet, String>) -> bool {
    match (a, b) {
        (Ok(a), Ok(b)) => b.contains(a),
        (Err(a), Err(b)) => a == b,
        _ => false,
    }
}

fn cidr_text(key: &Result<IpNet, String>) -> String {
    match key {
        Ok(net) => net.to_string(),
        Err(raw) => raw.clone(),
    }
}

fn canonical_cidrs(cidrs: &[String]) -> Vec<String> {
    let keys: Vec<_> = cidrs.iter().map(|c| cidr_key(c)).collect();
    let mut out: Vec<String> = keys
        .iter()
        .filter(|k| !keys.iter().any(|o| cidr_text(o) != cidr_text(k) && cidr_covered(k, o)))
        .map(cidr_text)
        .collect();
    out.sort();
    out.dedup();
    out
}

fn cidrs_meet(a: &[String], b: &[String]) -> Vec<String> {
    let (ka, kb): (Vec<_>, Vec<_>) = (a.iter().map(|c| cidr_key(c)).collect(), b.iter().map(|c| cidr_key(c)).collect());
    let kept: Vec<String> = ka
        .iter()
        .filter(|k| kb.iter().any(|o| cidr_covered(k, o)))
        .chain(kb.iter().filter(|k| ka.iter().any(|o| cidr_covered(k, o))))
        .map(cidr_text)
        .collect();
    canonical_cidrs(&kept)
}

fn cidrs_within(a: &[String], b: &[String]) -> bool {
    a.iter().all(|c| b.iter().any(|o| cidr_covered(&cidr_key(c), &cidr_key(o))))
}

fn mode_rank(mode: NetworkMode) -> u8 {
    match mode {
        NetworkMode::None => 0,
        NetworkMode::Allowlist => 1,
        NetworkMode::Ask => 2,
        NetworkMode::Any => 3,
    }
}

/// The canonical form of a network policy: `none` allows nothing (no domains, no CIDRs), `any`
/// needs no domains; domains and CIDRs without redundant entries, sorted.
pub fn canonical_network(n: &NetworkPolicy) -> NetworkPolicy {
    let mut out = NetworkPolicy { mode: n.mode, resolve: n.resolve.clone(), ..Default::default() };
    if n.mode != NetworkMode::None {
        out.allow_cidrs = canonical_cidrs(&n.allow_cidrs);
    }
    if n.mode.lists_names() {
        out.allow_domains = canonical_domains(&n.allow_domains);
    }
    if n.mode == NetworkMode::Ask {
        out.ask_timeout_secs = n.ask_timeout_secs;
    }
    if n.mode != NetworkMode::None {
        out.tls_passthrough = canonical_domains(&n.tls_passthrough);
    }
    out
}

/// The most restrictive network both allow: the stricter mode, the domains both allow, the
/// ranges both allow. `resolve` pins are a testing aid, not a permission: they are united, and
/// where two sources pin one name differently the lower address wins (so the result does not
/// depend on the order).
pub fn network_meet(a: &NetworkPolicy, b: &NetworkPolicy) -> NetworkPolicy {
    let (a, b) = (canonical_network(a), canonical_network(b));
    let mode = if mode_rank(a.mode) <= mode_rank(b.mode) { a.mode } else { b.mode };
    let mut resolve: BTreeMap<String, IpAddr> = a.resolve.clone();
    for (name, addr) in &b.resolve {
        resolve.entry(name.clone()).and_modify(|e| *e = (*e).min(*addr)).or_insert(*addr);
    }
    let mut out = NetworkPolicy { mode, resolve, ..Default::default() };
    if mode != NetworkMode::None {
        out.allow_cidrs = cidrs_meet(&a.allow_cidrs, &b.allow_cidrs);
    }
    if mode.lists_names() {
        out.allow_domains = match (a.mode.lists_names(), b.mode.lists_names()) {
            (true, true) => domains_meet(&a.allow_domains, &b.allow_domains),
            (true, false) => a.allow_domains,
            _ => b.allow_domains,
        };
    }
    if mode == NetworkMode::Ask {
        // The shorter wait: silence denies sooner.
        out.ask_timeout_secs = match (a.ask_timeout_secs, b.ask_timeout_secs) {
            (Some(x), Some(y)) => Some(x.min(y)),
            (x, y) => x.or(y),
        };
    }
    if mode != NetworkMode::None {
        // Not a permission (which names' TLS stays closed): each side's are kept.
        out.tls_passthrough = canonical_domains(&[a.tls_passthrough, b.tls_passthrough].concat());
    }
    out
}

/// Whether `a` allows no connection `b` does not (`resolve` aside).
pub fn network_within(a: &NetworkPolicy, b: &NetworkPolicy) -> bool {
    network_excess(a, b).is_none()
}

/// What `a` allows that `b` does not, in words (the first such thing), or `None` when `a` is
/// within `b` (`resolve` pins aside: they are not permissions).
pub fn network_excess(a: &NetworkPolicy, b: &NetworkPolicy) -> Option<String> {
    let (a, b) = (canonical_network(a), canonical_network(b));
    if mode_rank(a.mode) > mode_rank(b.mode) {
        return Some(format!("mode {} is wider than mode {}", a.mode.name(), b.mode.name()));
    }
    if a.mode == NetworkMode::None {
        return None;
    }
    if a.mode.lists_names() && b.mode.lists_names() {
        if let Some(d) = a.allow_domains.iter().find(|d| !domains_within(std::slice::from_ref(*d), &b.allow_domains)) {
            return Some(format!("the domain {d} is not in the allowlist"));
        }
    }
    a.allow_cidrs
        .iter()
        .find(|c| !cidrs_within(std::slice::from_ref(*c), &b.allow_cidrs))
        .map(|c| format!("the range {c} is not in allow_cidrs"))
}

/// A network policy in a line: `mode none`, `mode allowlist (domains a, *.b; cidrs 10.0.0.0/8)`.
pub fn describe_network(n: &NetworkPolicy) -> String {
    let n = canonical_network(n);
    let mut out = format!("mode {}", n.mode.name());
    let mut lists = Vec::new();
    if !n.allow_domains.is_empty() {
        lists.push(format!("domains {}", n.allow_domains.join(", ")));
    }
    if !n.allow_cidrs.is_empty() {
        lists.push(format!("cidrs {}", n.allow_cidrs.join(", ")));
    }
    if !lists.is_empty() {
        out += &format!(" ({})", lists.join("; "));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn network_excess_names_what_goes_beyond_the_ceiling() {
        let net = |mode, d: &[&str], c: &[&str]| NetworkPolicy {
            mode,
            allow_domains: s(d),
            allow_cidrs: s(c),
            ..Default::default()
        };
        let none = NetworkPolicy::default();
        let list = net(NetworkMode::Allowlist, &["*.example.com", "pypi.org"], &["10.0.0.0/8"]);
        assert_eq!(network_excess(&list, &none).unwrap(), "mode allowlist is wider than mode none");
        assert_eq!(
            network_excess(&net(NetworkMode::Any, &[], &[]), &list).unwrap(),
            "mode any is wider than mode allowlist"
        );
        let wider = net(NetworkMode::Allowlist, &["a.example.com", "evil.net"], &[]);
        assert_eq!(network_excess(&wider, &list).unwrap(), "the domain evil.net is not in the allowlist");
        let cidr = net(NetworkMode::Allowlist, &["pypi.org"], &["0.0.0.0/0"]);
        assert_eq!(network_excess(&cidr, &list).unwrap(), "the range 0.0.0.0/0 is not in allow_cidrs");
        // Within: narrower lists, none, the ceiling itself; resolve pins are not compared.
        for within in [none.clone(), list.clone(), net(NetworkMode::Allowlist, &["x.example.com"], &["10.1.0.0/16"])] {
            assert_eq!(network_excess(&within, &list), None, "{within:?}");
        }
        let mut pinned = list.clone();
        pinned.resolve.insert("pypi.org".into(), "127.0.0.1".parse().unwrap());
        assert_eq!(network_excess(&pinned, &list), None);
        assert_eq!(describe_network(&list), "mode allowlist (domains *.example.com, pypi.org; cidrs 10.0.0.0/8)");

        // `ask` ranks between allowlist and any; its list is compared like an allowlist's.
        let ask = net(NetworkMode::Ask, &["*.example.com", "pypi.org"], &["10.0.0.0/8"]);
        assert_eq!(network_excess(&ask, &list).unwrap(), "mode ask is wider than mode allowlist");
        assert_eq!(network_excess(&list, &ask), None);
        assert_eq!(network_excess(&ask, &net(NetworkMode::Any, &[], &["10.0.0.0/8"])), None);
        let asks_more = net(NetworkMode::Allowlist, &["evil.net"], &[]);
        assert_eq!(network_excess(&asks_more, &ask).unwrap(), "the domain evil.net is not in the allowlist");
        let met = network_meet(
            &ask,
            &NetworkPolicy { ask_timeout_secs: Some(5), ..net(NetworkMode::Ask, &["pypi.org"], &[]) },
        );
        assert_eq!((met.mode, met.allow_domains, met.ask_timeout_secs), (NetworkMode::Ask, s(&["pypi.org"]), Some(5)));
        assert_eq!(network_meet(&ask, &list).mode, NetworkMode::Allowlist);
    }

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn domain_coverage() {
        assert!(domain_covered("api.example.com", "*.example.com"));
        assert!(!domain_covered("example.com", "*.example.com"), "a wildcard does not match its apex");
        assert!(domain_covered("*.a.example.com", "*.example.com"));
        assert!(!domain_covered("*.example.com", "example.com"));
        assert!(!domain_covered("badexample.com", "*.example.com"));
        assert_eq!(
            domains_meet(&s(&["*.example.com", "pypi.org"]), &s(&["api.example.com", "*.org"])),
            s(&["api.example.com", "pypi.org"])
        );
        assert_eq!(canonical_domains(&s(&["A.example.com.", "*.example.com"])), s(&["*.example.com"]));
    }

    #[test]
    fn cidr_meet_keeps_the_narrower_range() {
        assert_eq!(cidrs_meet(&s(&["10.0.0.0/8"]), &s(&["10.1.2.0/24", "192.168.0.0/16"])), s(&["10.1.2.0/24"]));
        assert_eq!(canonical_cidrs(&s(&["10.1.2.3/8", "10.0.0.0/16"])), s(&["10.0.0.0/8"]));
    }

    #[test]
    fn most_specific_path_decides_and_meet_is_pointwise() {
        let p = |rw: &[&str], ro: &[&str]| {
            PathAccess::from_policy(&SandboxPolicy {
                additional_readwrite_paths: Some(rw.iter().map(PathBuf::from).collect()),
                additional_readonly_paths: Some(ro.iter().map(PathBuf::from).collect()),
                ..Default::default()
            })
            .unwrap()
        };
        let a = p(&["/data"], &["/data/vendor"]);
        assert_eq!(a.access(Path::new("/data/src/x")), Access::ReadWrite);
        assert_eq!(a.access(Path::new("/data/vendor/x")), Access::ReadOnly);
        assert_eq!(a.access(Path::new("/etc")), Access::None);
        let b = p(&[], &["/data/src"]);
        let m = a.meet(&b);
        assert_eq!(m.clone().into_lists(), (vec![], vec![PathBuf::from("/data/src")]));
        assert!(m.within(&a) && m.within(&b));
        // A redundant entry (read-write inside read-write) disappears.
        assert_eq!(p(&["/a", "/a/b"], &[]).into_lists().0, vec![PathBuf::from("/a")]);
    }
}
