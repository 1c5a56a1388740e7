//! The daemon's settings: defaults for new sessions, and how bundles arrive.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::session::{SessionSettings, SettingsPatch};

/// umbrad's configuration (`config.get`), persisted in `$XDG_CONFIG_HOME/umbra/umbrad.json`.
/// The session fields (flattened: one flat object) are the defaults a `session.start` uses for
/// what it does not set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct DaemonConfig {
    #[serde(flatten)]
    pub session: SessionSettings,
    /// A session that fails more than this many times within `restart_window_secs` becomes
    /// `failed` instead of restarting again.
    pub max_restarts: u32,
    /// The window `max_restarts` counts failures in.
    pub restart_window_secs: u64,
    /// Boots at once; further starts queue. 0: twice the host's CPU count.
    pub max_concurrent_boots: u32,
    /// How long a boot may take once it has a slot.
    pub boot_timeout_secs: u64,
    /// Where `bundle.download` fetches from when it is not given a URL.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bundle_url: Option<String>,
    /// Download `bundle_url` into the warm slot in the background when umbrad starts and when
    /// this is switched on; the next session start promotes it.
    pub auto_download: bool,
    /// VMs kept booted ahead of session starts, with the session defaults (bundle, backend,
    /// memory, cpus, disk size): a start whose settings match takes one instead of booting, and
    /// a replacement boots in the background. 0: no pool.
    pub pool_size: u32,
    /// The most guest memory the pool's idle VMs may hold together; the pool keeps fewer VMs
    /// than `pool_size` when `pool_size × memory_mib` would exceed it.
    pub pool_memory_mib: u64,
    /// CA certificates (PEM files) the egress proxy trusts upstream besides the host's trust
    /// store, when it reads a request to give it a secret: a company's TLS-inspecting proxy.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub trust_ca: Vec<std::path::PathBuf>,
    /// The HTTP proxy every guest connection goes out through, as `CONNECT` tunnels:
    /// `http://[user:password@]host:port`. Unset: umbrad's `HTTPS_PROXY` (or `HTTP_PROXY`) when
    /// it has one, else none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_proxy: Option<String>,
    /// Names (with the names below them), addresses and CIDRs reached directly, not through
    /// `upstream_proxy`; `*` for all. Unset: umbrad's `NO_PROXY`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_proxy: Option<Vec<String>>,
    /// Whether `session.expose` may bind an address other than loopback (`0.0.0.0`, a LAN
    /// address), making a guest's port reachable from other machines.
    pub ports_beyond_loopback: bool,
    /// Whether `session.expose` may listen on a host port below 1024.
    pub ports_privileged: bool,
    /// Public keys (`umbra-ed25519 <base64>` lines) a downloaded bundle may be signed by,
    /// besides the `*.pub` files in `$XDG_CONFIG_HOME/umbra/trusted-keys/`. A system policy
    /// with `trusted_keys` replaces both. Not settable by `config.set`: whom to trust is the
    /// file's owner's decision, not any client's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub trusted_keys: Vec<String>,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        Self {
            session: SessionSettings::default(),
            max_restarts: 3,
            restart_window_secs: 300,
            max_concurrent_boots: 0,
            boot_timeout_secs: 30,
            bundle_url: None,
            auto_download: false,
            pool_size: 0,
            pool_memory_mib: 4096,
            trust_ca: Vec::new(),
            upstream_proxy: None,
            no_proxy: None,
            ports_beyond_loopback: false,
            ports_privileged: false,
            trusted_keys: Vec::new(),
        }
    }
}

impl DaemonConfig {
    /// This configuration with `patch` applied (only the fields it sets), checked whole; `self`
    /// is not changed, so a caller can persist the result before it takes effect.
    pub fn patched(&self, patch: &ConfigPatch) -> Result<DaemonConfig, crate::ApiError> {
        let mut next = self.clone();
        next.session = patch.session.applied_to(&self.session)?;
        macro_rules! set {
            ($($field:ident),*) => { $( if let Some(v) = &patch.$field { next.$field = v.clone(); } )* };
        }
        set!(
            max_restarts,
            restart_window_secs,
            max_concurrent_boots,
            boot_timeout_secs,
            auto_download,
            pool_size,
            pool_memory_mib,
            trust_ca,
            ports_beyond_loopback,
            ports_privileged
        );
        if let Some(url) = &patch.bundle_url {
            next.bundle_url = (!url.is_empty()).then(|| url.clone());
        }
        if let Some(url) = &patch.upstream_proxy {
            next.upstream_proxy = (!url.is_empty()).then(|| url.clone());
        }
        if let Some(list) = &patch.no_proxy {
            next.no_proxy = Some(list.clone());
        }
        next.validate()?;
        Ok(next)
    }

    /// Checks every value (a configuration file is checked so when it is loaded).
    pub fn validate(&self) -> Result<(), crate::ApiError> {
        self.session.validate()?;
        if self.boot_timeout_secs == 0 {
            return Err(crate::ApiError::invalid_params("boot_timeout_secs must be at least 1"));
        }
        if self.pool_size > MAX_POOL_SIZE {
            return Err(crate::ApiError::invalid_params(format!(
                "pool_size {} is above {MAX_POOL_SIZE}",
                self.pool_size
            )));
        }
        for (i, key) in self.trusted_keys.iter().enumerate() {
            umbra_bundle::PublicKey::parse(key)
                .map_err(|e| crate::ApiError::invalid_params(format!("trusted_keys[{i}]: {e}")))?;
        }
        Ok(())
    }

    /// How many VMs the warm pool keeps: `pool_size`, fewer when their guest memory would
    /// exceed `pool_memory_mib`.
    pub fn pool_target(&self) -> u32 {
        let fits = self.pool_memory_mib / u64::from(self.session.memory_mib.max(1));
        self.pool_size.min(u32::try_from(fits).unwrap_or(u32::MAX))
    }
}

/// A `config.set`: the fields to change.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ConfigPatch {
    /// Defaults for new sessions.
    #[serde(flatten)]
    pub session: SettingsPatch,
    /// Failures allowed within the restart window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_restarts: Option<u32>,
    /// The restart window, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_window_secs: Option<u64>,
    /// Boots at once (0: twice the CPU count); takes effect at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrent_boots: Option<u32>,
    /// Seconds a boot may take once admitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_timeout_secs: Option<u64>,
    /// The default download URL; an empty string clears it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bundle_url: Option<String>,
    /// Whether to download `bundle_url` into the warm slot in the background.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_download: Option<bool>,
    /// VMs kept booted ahead of session starts (0: none); takes effect at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_size: Option<u32>,
    /// The guest memory the pool's idle VMs may hold together, in MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_memory_mib: Option<u64>,
    /// Replaces the list of extra upstream CA files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trust_ca: Option<Vec<std::path::PathBuf>>,
    /// The upstream HTTP proxy; `""` goes back to umbrad's environment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_proxy: Option<String>,
    /// Replaces the list reached without the upstream proxy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_proxy: Option<Vec<String>>,
    /// Whether exposed ports may bind beyond loopback (ports exposed already keep their bind).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports_beyond_loopback: Option<bool>,
    /// Whether exposed ports may use host ports below 1024.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports_privileged: Option<bool>,
}

/// The most VMs a warm pool may keep.
pub const MAX_POOL_SIZE: u32 = 64;

/// Limits on session settings: a request outside them is `invalid_params`.
pub const MAX_MEMORY_MIB: u32 = 64 * 1024;
pub const MIN_MEMORY_MIB: u32 = 64;
pub const MAX_CPUS: u32 = 64;
pub const MAX_DISK_SIZE_MIB: u64 = 16 * 1024 * 1024;

impl SessionSettings {
    pub fn validate(&self) -> Result<(), crate::ApiError> {
        let bad = |m: String| Err(crate::ApiError::invalid_params(m));
        if !(MIN_MEMORY_MIB..=MAX_MEMORY_MIB).contains(&self.memory_mib) {
            return bad(format!("memory_mib {} is outside {MIN_MEMORY_MIB}..={MAX_MEMORY_MIB}", self.memory_mib));
        }
        if !(1..=MAX_CPUS).contains(&self.cpus) {
            return bad(format!("cpus {} is outside 1..={MAX_CPUS}", self.cpus));
        }
        if self.disk_size_mib != 0 && !(64..=MAX_DISK_SIZE_MIB).contains(&self.disk_size_mib) {
            return bad(format!(
                "disk_size_mib {} is neither 0 nor within 64..={MAX_DISK_SIZE_MIB}",
                self.disk_size_mib
            ));
        }
        if self.heartbeat_interval_secs == 0 || self.heartbeat_timeout_secs == 0 {
            return bad("heartbeat_interval_secs and heartbeat_timeout_secs must be at least 1".into());
        }
        if self.bundle.is_empty() {
            return bad("bundle must not be empty".into());
        }
        self.network.validate().map_err(crate::ApiError::invalid_params)?;
        self.policy.validate().map_err(|e| crate::ApiError::invalid_params(format!("policy: {e}")))?;
        match &self.approval {
            Some(approval) => {
                approval.validate().map_err(|e| crate::ApiError::invalid_params(format!("approval: {e}")))
            }
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_patch_changes_only_what_it_sets_and_is_checked_whole() {
        let c = DaemonConfig::default();
        let patch = |session: SettingsPatch| ConfigPatch { session, ..Default::default() };
        let c = c.patched(&patch(SettingsPatch { memory_mib: Some(256), ..Default::default() })).unwrap();
        assert_eq!((c.session.memory_mib, c.session.cpus), (256, 1));
        let err =
            c.patched(&patch(SettingsPatch { cpus: Some(2), memory_mib: Some(1), ..Default::default() })).unwrap_err();
        assert_eq!(err.code, crate::ErrorCode::InvalidParams);
        let c =
            c.patched(&ConfigPatch { bundle_url: Some("http://127.0.0.1:1/b".into()), ..Default::default() }).unwrap();
        assert!(c.bundle_url.is_some());
        let c = c.patched(&ConfigPatch { bundle_url: Some(String::new()), ..Default::default() }).unwrap();
        assert!(c.bundle_url.is_none());
        assert!(c.patched(&ConfigPatch { boot_timeout_secs: Some(0), ..Default::default() }).is_err());
        assert!(c.patched(&ConfigPatch { pool_size: Some(MAX_POOL_SIZE + 1), ..Default::default() }).is_err());
    }

    #[test]
    fn the_pool_keeps_what_its_memory_budget_allows() {
        let mut c = DaemonConfig { pool_size: 4, pool_memory_mib: 1024, ..Default::default() };
        c.session.memory_mib = 512;
        assert_eq!(c.pool_target(), 2, "two 512 MiB guests fill 1 GiB");
        c.session.memory_mib = 256;
        assert_eq!(c.pool_target(), 4);
        c.pool_size = 0;
        assert_eq!(c.pool_target(), 0);
    }

    #[test]
    fn the_file_is_one_flat_object_and_missing_fields_take_defaults() {
        let c: DaemonConfig = serde_json::from_str(r#"{"cpus": 2, "max_restarts": 7}"#).unwrap();
        assert_eq!((c.session.cpus, c.max_restarts), (2, 7));
        assert_eq!((c.session.idle_timeout_secs, c.session.heartbeat_timeout_secs), (900, 15));
        let json = serde_json::to_value(&c).unwrap();
        assert_eq!(json["memory_mib"], 512, "flat: {json}");
        let bad: DaemonConfig = serde_json::from_str(r#"{"memory_mib": 1}"#).unwrap();
        assert_eq!(bad.validate().unwrap_err().code, crate::ErrorCode::InvalidParams);
    }
}
