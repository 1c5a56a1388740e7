//! Umbra's sandbox policy and command approval: pure logic, no VM.
//!
//! - [`SandboxPolicy`] (`policy.rs`): what a command may touch — the workspace's mode, the
//!   network, extra paths, git and /tmp writes, ignored files — as one source writes it;
//!   [`merge_sources`] (`merge.rs`) combines the admin's, the user's, the session's and a
//!   command's, most restrictive wins field by field, and says who decided each field;
//!   `lattice.rs` holds the restriction order of the set-valued fields.
//! - [`IgnoreSet`] (`ignore_set.rs`): gitignore-syntax patterns, compiled.
//! - [`approval`]: whether a command line runs, is refused or needs a person's approval —
//!   parsed with a real shell parser, every part checked, hooks consulted — with the rule that
//!   decided it.
//!
//! Enforcement (folder modes, `.git` and `/tmp` read-only, hidden files, egress) and the
//! daemon's approval flow are built on top of this crate; `docs/policy.md` says what is done.

pub mod approval;
mod cursor;
mod ignore_set;
pub(crate) mod lattice;
mod merge;
pub mod network;
mod policy;

pub use ignore_set::{IgnoreError, IgnoreSet};
pub use lattice::{describe_network, network_excess, network_within};
pub use merge::{at_least_as_restrictive, merge, merge_all, merge_sources, DecidedBy, MergedPolicy, PolicySource};
pub use network::{NetworkMode, NetworkPolicy};
pub use policy::{
    normalize_path, EffectivePolicy, PolicyError, PolicyType, SandboxPolicy, MAX_ENTRY_LEN, MAX_LIST_LEN,
};
