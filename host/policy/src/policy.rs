//! `SandboxPolicy`: what a command may touch, as one source (admin, user, session, a single
//! command) writes it.
//!
//! Every field is optional: a source that leaves a field out has no opinion on it, so merging
//! (`merge.rs`) only ever combines what sources said, and a policy nobody wrote anything into is
//! the identity of the merge. `SandboxPolicy::effective` (in `lattice.rs`, with the canonical
//! forms) fills the gaps with the defaults the enforcement uses. Field names follow Cursor's `SandboxPolicy` (seeds 002/003) in snake case;
//! the network field is the session's own [`NetworkPolicy`], so the policy drives egress with the
//! type egress already takes.

use std::path::{Component, Path, PathBuf};

use crate::network::NetworkPolicy;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// How much of the workspace a command may change. Ordered from the most restrictive
/// (`WorkspaceReadonly`) to the least (`InsecureNone`): `Ord` is the restriction order, which
/// merging relies on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PolicyType {
    /// The workspace folders are read-only: commands can read and build elsewhere, never change
    /// the user's files. The most restrictive type (Cursor's level function forgets it and
    /// ranks it as unsandboxed; here it ranks first).
    WorkspaceReadonly,
    /// The workspace folders are read-write; the rest of the policy still holds.
    WorkspaceReadwrite,
    /// No workspace restriction (the folders keep the modes the session gave them). The VM
    /// remains the boundary; the other fields still hold.
    InsecureNone,
}

impl PolicyType {
    pub fn name(self) -> &'static str {
        match self {
            PolicyType::WorkspaceReadonly => "workspace_readonly",
            PolicyType::WorkspaceReadwrite => "workspace_readwrite",
            PolicyType::InsecureNone => "insecure_none",
        }
    }
}

/// A sandbox policy as one source writes it. JSON example:
/// `{"type": "workspace_readwrite", "block_git_writes": true, "ignore": [".env"]}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SandboxPolicy {
    /// How much of the workspace a command may change.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<PolicyType>,
    /// What the guest may connect to (`mode`: `none`, `allowlist` with `allow_domains`, `any`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkPolicy>,
    /// Absolute host paths shared read-write beyond the workspace. Where paths nest, the most
    /// specific entry decides (read-only `/a/b` inside read-write `/a` is read-only); a path in
    /// both lists is read-only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub additional_readwrite_paths: Option<Vec<PathBuf>>,
    /// Absolute host paths shared read-only beyond the workspace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub additional_readonly_paths: Option<Vec<PathBuf>>,
    /// Every `.git` in a writable folder is read-only: `git status`/`log` work, commits fail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_git_writes: Option<bool>,
    /// `/tmp` is read-only for the command.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disable_tmp_write: Option<bool>,
    /// gitignore-syntax patterns (relative to each workspace folder) whose files never reach the
    /// guest: `.env`, `*.pem`, `secrets/**`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore: Option<Vec<String>>,
}

/// A policy with every gap filled: what enforcement applies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct EffectivePolicy {
    #[serde(rename = "type")]
    pub kind: PolicyType,
    pub network: NetworkPolicy,
    pub additional_readwrite_paths: Vec<PathBuf>,
    pub additional_readonly_paths: Vec<PathBuf>,
    pub block_git_writes: bool,
    pub disable_tmp_write: bool,
    pub ignore: Vec<String>,
}

/// Bounds on what a policy may hold (it arrives over IPC and from files).
pub const MAX_LIST_LEN: usize = 1024;
pub const MAX_ENTRY_LEN: usize = 4096;

/// Why a policy was refused. Each names the field and the offending value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("{field}: {path:?} is not an absolute path without `..` (write /home/me/cache, not cache or ../cache)")]
    BadPath { field: &'static str, path: PathBuf },
    #[error("ignore: {pattern:?} is not a gitignore pattern: {error}")]
    BadIgnorePattern { pattern: String, error: String },
    #[error("network: {0}")]
    BadNetwork(String),
    #[error("{field}: {len} entries or an entry of more than {MAX_ENTRY_LEN} bytes (at most {MAX_LIST_LEN} entries)")]
    TooLarge { field: &'static str, len: usize },
}

impl SandboxPolicy {
    /// Whether no field is set (the identity of the merge).
    pub fn is_empty(&self) -> bool {
        *self == SandboxPolicy::default()
    }

    /// Checks every field is well formed: absolute paths without `..`, gitignore patterns that
    /// compile, well-formed domains and CIDRs, bounded lists.
    pub fn validate(&self) -> Result<(), PolicyError> {
        if let Some(network) = &self.network {
            network.validate().map_err(PolicyError::BadNetwork)?;
            check_len("network.allow_domains", &network.allow_domains, |s| s.len())?;
            check_len("network.allow_cidrs", &network.allow_cidrs, |s| s.len())?;
        }
        for (field, paths) in [
            ("additional_readwrite_paths", &self.additional_readwrite_paths),
            ("additional_readonly_paths", &self.additional_readonly_paths),
        ] {
            let Some(paths) = paths else { continue };
            check_len(field, paths, |p| p.as_os_str().len())?;
            for path in paths {
                if normalize_path(path).is_none() {
                    return Err(PolicyError::BadPath { field, path: path.clone() });
                }
            }
        }
        if let Some(patterns) = &self.ignore {
            check_len("ignore", patterns, |s| s.len())?;
            crate::IgnoreSet::new("/", patterns)
                .map_err(|e| PolicyError::BadIgnorePattern { pattern: e.pattern, error: e.error })?;
        }
        Ok(())
    }
}

fn check_len<T>(field: &'static str, list: &[T], len: impl Fn(&T) -> usize) -> Result<(), PolicyError> {
    if list.len() > MAX_LIST_LEN || list.iter().any(|e| len(e) > MAX_ENTRY_LEN) {
        return Err(PolicyError::TooLarge { field, len: list.len() });
    }
    Ok(())
}

/// An absolute path without `.`, `..` or repeated separators; `None` for a relative path or one
/// with `..` (which would make "the most specific entry" depend on symlinks).
pub fn normalize_path(path: &Path) -> Option<PathBuf> {
    if !path.is_absolute() {
        return None;
    }
    let mut out = PathBuf::from("/");
    for component in path.components() {
        match component {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(part) => out.push(part),
            Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}
