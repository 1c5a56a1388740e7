//! The system policy: ceilings a machine's administrator sets for every session of every user
//! (`/etc/umbra/policy.json`, root-owned), which no client can loosen — not `session.start`,
//! not `config.set`. Each field given is a ceiling every session's settings merge with, most
//! restrictive first; a field left out leaves the user's choice alone.

use std::path::{Path, PathBuf};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::session::{NetworkPolicy, SessionSettings};

/// Where the system policy lives (Linux).
#[cfg(not(target_os = "macos"))]
pub const SYSTEM_POLICY_PATH: &str = "/etc/umbra/policy.json";
/// Where the system policy lives (macOS).
#[cfg(target_os = "macos")]
pub const SYSTEM_POLICY_PATH: &str = "/Library/Application Support/Umbra/policy.json";

/// An administrator's ceilings. Unknown fields are refused: a misspelt ceiling must not be a
/// silently absent one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct SystemPolicy {
    /// False: every `session.start` (and resume, and fork) is refused with `disabled_by_admin`.
    pub enabled: bool,
    /// Only folders beneath one of these absolute directories may be shared (after symlinks
    /// are resolved). Unset: every folder.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trusted_roots: Option<Vec<PathBuf>>,
    /// Where bundles may come from: URL prefixes (`https://bundles.example.com/`) that
    /// `bundle.download` and `vmctl bundle pull` may fetch from, and directories beneath which a
    /// session's `bundle` may name a bundle directory. Every redirect a download meets is held
    /// to them too, before it is followed. Installed versions, `current` and the flavors this
    /// machine built are always allowed. Unset: every source.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bundle_sources: Option<Vec<String>>,
    /// The most guest memory a session may have, in MiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_memory_mib: Option<u32>,
    /// The most vCPUs a session may have.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_cpus: Option<u32>,
    /// The largest session disk, in MiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_disk_mib: Option<u64>,
    /// The network ceiling: what sessions may connect to, at most.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkPolicy>,
    /// Command approval every session has, at least this strict (its own allow and deny lists
    /// and hooks still apply).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub approval_mode: Option<umbra_policy::approval::ApprovalMode>,
    /// Git metadata (`.git`) read-only in every shared folder.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_git_writes: Option<bool>,
    /// The only public keys (`umbra-ed25519 <base64>` lines) downloaded bundles may be signed
    /// by: the user's own trusted keys (umbrad's `trusted_keys`, the trusted-keys directory,
    /// `vmctl --trusted-key`) are not consulted. Unset: the user's keys.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trusted_keys: Option<Vec<String>>,
}

impl Default for SystemPolicy {
    fn default() -> Self {
        Self {
            enabled: true,
            trusted_roots: None,
            bundle_sources: None,
            max_memory_mib: None,
            max_cpus: None,
            max_disk_mib: None,
            network: None,
            approval_mode: None,
            block_git_writes: None,
            trusted_keys: None,
        }
    }
}

/// What `daemon.info` says of the system policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SystemPolicyInfo {
    /// The file it was read from.
    pub path: PathBuf,
    pub policy: SystemPolicy,
}

impl SystemPolicy {
    /// Checks the values themselves (absolute roots, a valid network ceiling).
    pub fn validate(&self) -> Result<(), String> {
        for root in self.trusted_roots.iter().flatten() {
            if !root.is_absolute() {
                return Err(format!("trusted_roots: {} is not an absolute path", root.display()));
            }
        }
        if let Some(network) = &self.network {
            network.validate().map_err(|e| format!("network: {e}"))?;
        }
        for (i, key) in self.trusted_keys.iter().flatten().enumerate() {
            umbra_bundle::PublicKey::parse(key).map_err(|e| format!("trusted_keys[{i}]: {e}"))?;
        }
        if self.max_memory_mib == Some(0) || self.max_cpus == Some(0) {
            return Err("max_memory_mib and max_cpus must be at least 1".into());
        }
        Ok(())
    }

    /// The sandbox policy this contributes to every session (its `system` source): the network
    /// ceiling and `block_git_writes`.
    pub fn sandbox(&self) -> umbra_policy::SandboxPolicy {
        umbra_policy::SandboxPolicy {
            network: self.network.clone(),
            block_git_writes: self.block_git_writes.filter(|b| *b),
            ..Default::default()
        }
    }

    /// `settings` held to the ceilings: memory, cpus and disk at most the maxima, the sandbox
    /// policy merged with [`Self::sandbox`] (and the network with it), approval at least as
    /// strict as the forced mode. Returns what was lowered, one line each.
    pub fn cap(&self, settings: &mut SessionSettings) -> Vec<String> {
        let mut lowered = Vec::new();
        let mut cap = |name: &str, value: &mut u64, max: Option<u64>| {
            if let Some(max) = max.filter(|m| *value > *m) {
                lowered.push(format!("{name} {value} lowered to the system policy's {max}"));
                *value = max;
            }
        };
        let mut memory = u64::from(settings.memory_mib);
        cap("memory_mib", &mut memory, self.max_memory_mib.map(u64::from));
        settings.memory_mib = memory as u32;
        let mut cpus = u64::from(settings.cpus);
        cap("cpus", &mut cpus, self.max_cpus.map(u64::from));
        settings.cpus = cpus as u32;
        cap("disk_size_mib", &mut settings.disk_size_mib, self.max_disk_mib);
        let sandbox = self.sandbox();
        if !sandbox.is_empty() {
            settings.policy = umbra_policy::merge(&settings.policy, &sandbox);
            if settings.policy.network.is_some() {
                let effective = settings.policy.effective().network;
                if effective != settings.network {
                    lowered.push("network held to the system policy's ceiling".into());
                }
                settings.network = effective;
            }
        }
        if let Some(forced) = self.approval_mode {
            let held = format!("approval held to the system policy's mode {forced:?}");
            match &mut settings.approval {
                Some(a) if a.mode.laxity() <= forced.laxity() => {}
                Some(a) => {
                    lowered.push(held);
                    a.mode = forced;
                }
                None => {
                    lowered.push(held);
                    settings.approval =
                        Some(umbra_policy::approval::ApprovalSettings { mode: forced, ..Default::default() });
                }
            }
        }
        lowered
    }

    /// Whether `folder` (canonical) may be shared: beneath a trusted root, when there are any.
    pub fn check_folder(&self, folder: &Path) -> Result<(), String> {
        let Some(roots) = &self.trusted_roots else { return Ok(()) };
        if roots.iter().any(|r| folder.starts_with(r)) {
            return Ok(());
        }
        let listed: Vec<String> = roots.iter().map(|r| r.display().to_string()).collect();
        Err(format!(
            "{} is not beneath a folder the system policy trusts ({}): it cannot be shared",
            folder.display(),
            listed.join(", ")
        ))
    }

    /// Whether a bundle may come from `source` (a URL, or a bundle directory's canonical path).
    pub fn check_bundle_source(&self, source: &str) -> Result<(), String> {
        let Some(allowed) = &self.bundle_sources else { return Ok(()) };
        let is_url = source.contains("://");
        let ok = allowed.iter().any(|a| match is_url {
            // At a boundary: `https://host` does not allow `https://host.evil.test/`.
            true => {
                a.contains("://")
                    && source.strip_prefix(a.as_str()).is_some_and(|rest| {
                        a.ends_with('/') || rest.is_empty() || rest.starts_with('/') || rest.starts_with('?')
                    })
            }
            false => !a.contains("://") && Path::new(source).starts_with(a),
        });
        if ok {
            return Ok(());
        }
        Err(format!("the system policy allows bundles only from {}; not from {source}", allowed.join(", ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use umbra_policy::approval::{ApprovalMode, ApprovalSettings};
    use umbra_policy::network::NetworkMode;

    #[test]
    fn settings_beyond_a_ceiling_get_the_ceiling_and_the_rest_is_left_alone() {
        let system = SystemPolicy {
            max_memory_mib: Some(1024),
            max_cpus: Some(2),
            max_disk_mib: Some(4096),
            network: Some(NetworkPolicy { mode: NetworkMode::None, ..Default::default() }),
            approval_mode: Some(ApprovalMode::Allowlist),
            block_git_writes: Some(true),
            ..Default::default()
        };
        let mut s = SessionSettings { memory_mib: 8192, cpus: 1, disk_size_mib: 100, ..Default::default() };
        s.network = NetworkPolicy { mode: NetworkMode::Any, ..Default::default() };
        let lowered = system.cap(&mut s);
        assert_eq!((s.memory_mib, s.cpus, s.disk_size_mib), (1024, 1, 100), "only what passed a ceiling");
        assert_eq!(s.network.mode, NetworkMode::None);
        assert_eq!(s.policy.network.as_ref().map(|n| n.mode), Some(NetworkMode::None), "the ceiling of set_network");
        assert_eq!(s.policy.block_git_writes, Some(true));
        assert_eq!(s.approval.as_ref().map(|a| a.mode), Some(ApprovalMode::Allowlist), "approval forced on");
        assert_eq!(lowered.len(), 3, "{lowered:?}");
        assert!(lowered[0].contains("memory_mib 8192 lowered to the system policy's 1024"), "{lowered:?}");

        // Stricter than the ceiling stays stricter; applying twice changes nothing more.
        let mut strict = s.clone();
        strict.approval = Some(ApprovalSettings { mode: ApprovalMode::AskEveryTime, ..Default::default() });
        let before = strict.clone();
        assert!(system.cap(&mut strict).is_empty(), "nothing to lower");
        assert_eq!(strict, before);

        // No policy, no change.
        let mut free = SessionSettings::default();
        assert!(SystemPolicy::default().cap(&mut free).is_empty());
        assert_eq!(free, SessionSettings::default());
    }

    #[test]
    fn folders_and_bundle_sources_within_the_lists() {
        let system = SystemPolicy {
            trusted_roots: Some(vec!["/home/me/work".into()]),
            bundle_sources: Some(vec!["https://bundles.example.com/".into(), "/opt/bundles".into()]),
            ..Default::default()
        };
        assert!(system.check_folder(Path::new("/home/me/work/project")).is_ok());
        assert!(system.check_folder(Path::new("/home/me/work")).is_ok());
        let e = system.check_folder(Path::new("/home/me/workshop")).unwrap_err();
        assert!(e.contains("not beneath a folder the system policy trusts (/home/me/work)"), "{e}");
        assert!(system.check_bundle_source("https://bundles.example.com/umbra/latest.json").is_ok());
        assert!(system.check_bundle_source("https://bundles.example.com.evil.test/x").is_err());
        let bare = SystemPolicy { bundle_sources: Some(vec!["https://b.example.com".into()]), ..Default::default() };
        assert!(bare.check_bundle_source("https://b.example.com/latest.json").is_ok());
        assert!(bare.check_bundle_source("https://b.example.com.evil.test/latest.json").is_err());
        assert!(system.check_bundle_source("http://127.0.0.1:8000/x").is_err());
        assert!(system.check_bundle_source("/opt/bundles/minimal").is_ok());
        assert!(system.check_bundle_source("/opt/bundles-other/minimal").is_err(), "components, not a prefix");
        assert!(SystemPolicy::default().check_folder(Path::new("/anywhere")).is_ok());
        assert!(SystemPolicy { trusted_roots: Some(vec!["relative".into()]), ..Default::default() }
            .validate()
            .is_err());
        let bad_key = SystemPolicy { trusted_keys: Some(vec!["umbra-ed25519 AAAA".into()]), ..Default::default() };
        assert!(bad_key.validate().unwrap_err().contains("trusted_keys[0]"));
        let key = umbra_bundle::SecretKey::from_seed([7; 32]).public().to_line("admin");
        assert!(SystemPolicy { trusted_keys: Some(vec![key]), ..Default::default() }.validate().is_ok());
    }
}
