//! Merging policies from several sources, most restrictive wins, field by field.
//!
//! Each field takes the most restrictive value any source gave it: the stricter type
//! (`workspace_readonly` < `workspace_readwrite` < `insecure_none`), the stricter network (mode
//! `none` < `allowlist` < `any`, and only the domains and ranges every allowlist allows), for
//! extra paths the lower access path by path, `true` for the two blocks, and every ignore
//! pattern of every source. A field no source set stays unset (the default applies), so the
//! empty policy is the identity; the result is canonical, so merging is commutative and
//! associative as values (property-tested below), and never less restrictive than an input.
//!
//! Unlike Cursor's merge, which keeps one whole policy by a single level (seed 003's `H4c`), a
//! field is decided on its own: an admin's `block_git_writes` survives a user's stricter type.
//! [`merge_sources`] also says which source decided each field.

use crate::network::NetworkPolicy;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::lattice::{canonical_network, network_meet, network_within, PathAccess};
use crate::policy::SandboxPolicy;

/// Where a policy came from, from the widest authority to the narrowest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PolicySource {
    /// The machine's system policy (`/etc/umbra/policy.json`), which no user can loosen.
    System,
    /// The machine's administrator (umbrad's configuration).
    Admin,
    /// The user's own defaults.
    User,
    /// The session's policy (`session.start`).
    Session,
    /// One command's policy (a spawn).
    Command,
}

/// Which sources decided each field of a merged policy: those whose value is the result (for
/// the type, the network mode and the flags), or that narrowed it (extra paths: each source
/// that set them; ignore: each source that added patterns). Empty: no source set the field and
/// the default applies.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct DecidedBy {
    #[serde(rename = "type")]
    pub kind: Vec<PolicySource>,
    pub network: Vec<PolicySource>,
    /// Both `additional_readwrite_paths` and `additional_readonly_paths`.
    pub paths: Vec<PolicySource>,
    pub block_git_writes: Vec<PolicySource>,
    pub disable_tmp_write: Vec<PolicySource>,
    pub ignore: Vec<PolicySource>,
}

/// The merge of several sources' policies, with who decided what.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct MergedPolicy {
    pub policy: SandboxPolicy,
    pub decided_by: DecidedBy,
}

fn meet_opt<T: Clone>(a: &Option<T>, b: &Option<T>, meet: impl Fn(&T, &T) -> T, one: impl Fn(&T) -> T) -> Option<T> {
    match (a, b) {
        (Some(a), Some(b)) => Some(meet(a, b)),
        (Some(x), None) | (None, Some(x)) => Some(one(x)),
        (None, None) => None,
    }
}

/// The most restrictive policy that `a` and `b` both allow, in canonical form.
pub fn merge(a: &SandboxPolicy, b: &SandboxPolicy) -> SandboxPolicy {
    let paths = meet_opt(&PathAccess::from_policy(a), &PathAccess::from_policy(b), PathAccess::meet, Clone::clone);
    let (rw, ro) = match paths {
        Some(p) => {
            let (rw, ro) = p.into_lists();
            (Some(rw), Some(ro))
        }
        None => (None, None),
    };
    SandboxPolicy {
        kind: meet_opt(&a.kind, &b.kind, |x, y| *x.min(y), |x| *x),
        network: meet_opt(&a.network, &b.network, network_meet, canonical_network),
        additional_readwrite_paths: rw,
        additional_readonly_paths: ro,
        block_git_writes: meet_opt(&a.block_git_writes, &b.block_git_writes, |x, y| *x || *y, |x| *x),
        disable_tmp_write: meet_opt(&a.disable_tmp_write, &b.disable_tmp_write, |x, y| *x || *y, |x| *x),
        ignore: meet_opt(&a.ignore, &b.ignore, |x, y| sorted_union(x.iter().chain(y)), |x| sorted_union(x.iter())),
    }
}

fn sorted_union<'a>(items: impl Iterator<Item = &'a String>) -> Vec<String> {
    let mut out: Vec<String> = items.cloned().collect();
    out.sort();
    out.dedup();
    out
}

/// The merge of any number of policies (the empty policy for none).
pub fn merge_all<'a>(policies: impl IntoIterator<Item = &'a SandboxPolicy>) -> SandboxPolicy {
    policies.into_iter().fold(SandboxPolicy::default(), |acc, p| merge(&acc, p))
}

/// Merges the sources' policies and records which source decided each field.
pub fn merge_sources(sources: &[(PolicySource, SandboxPolicy)]) -> MergedPolicy {
    let policy = merge_all(sources.iter().map(|(_, p)| p));
    let mut ordered: Vec<&(PolicySource, SandboxPolicy)> = sources.iter().collect();
    ordered.sort_by_key(|(s, _)| *s);
    let pick = |keep: &dyn Fn(&SandboxPolicy) -> bool| {
        let mut out: Vec<PolicySource> = ordered.iter().filter(|(_, p)| keep(p)).map(|(s, _)| *s).collect();
        out.dedup();
        out
    };
    let network_mode = policy.network.as_ref().map(|n| n.mode);
    let decided_by = DecidedBy {
        kind: pick(&|p| p.kind.is_some() && p.kind == policy.kind),
        network: pick(&|p| p.network.is_some() && p.network.as_ref().map(|n| n.mode) == network_mode),
        paths: pick(&|p| p.additional_readwrite_paths.is_some() || p.additional_readonly_paths.is_some()),
        block_git_writes: pick(&|p| p.block_git_writes.is_some() && p.block_git_writes == policy.block_git_writes),
        disable_tmp_write: pick(&|p| p.disable_tmp_write.is_some() && p.disable_tmp_write == policy.disable_tmp_write),
        ignore: pick(&|p| p.ignore.as_ref().is_some_and(|i| !i.is_empty())),
    };
    MergedPolicy { policy, decided_by }
}

/// Whether `a` allows nothing that `b` forbids, field by field. A field `b` leaves unset
/// forbids nothing; a field `a` leaves unset forbids nothing either, so `a` must set every field
/// `b` sets. (`network.resolve` pins are not permissions and are not compared.)
pub fn at_least_as_restrictive(a: &SandboxPolicy, b: &SandboxPolicy) -> bool {
    fn field<T>(a: &Option<T>, b: &Option<T>, within: impl Fn(&T, &T) -> bool) -> bool {
        match (a, b) {
            (_, None) => true,
            (None, Some(_)) => false,
            (Some(a), Some(b)) => within(a, b),
        }
    }
    let paths_ok = match (PathAccess::from_policy(a), PathAccess::from_policy(b)) {
        (_, None) => true,
        (None, Some(_)) => false,
        (Some(a), Some(b)) => a.within(&b),
    };
    field(&a.kind, &b.kind, |a, b| a <= b)
        && field(&a.network, &b.network, |a: &NetworkPolicy, b| network_within(a, b))
        && paths_ok
        && field(&a.block_git_writes, &b.block_git_writes, |a, b| *a || !*b)
        && field(&a.disable_tmp_write, &b.disable_tmp_write, |a, b| *a || !*b)
        && field(&a.ignore, &b.ignore, |a, b| b.iter().all(|p| a.contains(p)))
}

#[cfg(test)]
mod tests;
