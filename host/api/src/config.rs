//! The daemon's settings: defaults for new sessions, and how bundles arrive.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::session::{BackendChoice, SessionSettings};

/// umbrad's configuration (`config.get`), persisted in `$XDG_CONFIG_HOME/umbra/umbrad.json`.
/// Session fields are the defaults a `session.start` uses for what it does not set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct DaemonConfig {
    pub memory_mib: u32,
    pub cpus: u32,
    /// 0: sessions never stop for being idle.
    pub idle_timeout_secs: u64,
    /// 0: no session disk (guest writes live in RAM).
    pub disk_size_mib: u64,
    pub heartbeat_interval_secs: u64,
    pub heartbeat_timeout_secs: u64,
    /// A session that fails more than this many times within `restart_window_secs` becomes
    /// `failed` instead of restarting again.
    pub max_restarts: u32,
    pub restart_window_secs: u64,
    /// Boots at once; further starts queue. 0: twice the host's CPU count.
    pub max_concurrent_boots: u32,
    /// How long a boot may take once it has a slot.
    pub boot_timeout_secs: u64,
    /// Default bundle for sessions (see [`SessionSettings::bundle`]).
    pub bundle: String,
    pub backend: BackendChoice,
    /// Where `bundle.download` fetches from when it is not given a URL.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bundle_url: Option<String>,
    /// Download `bundle_url` into the warm slot in the background when umbrad starts and when
    /// this is switched on; the next session start promotes it.
    pub auto_download: bool,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        Self {
            memory_mib: 512,
            cpus: 1,
            idle_timeout_secs: 15 * 60,
            disk_size_mib: 8 * 1024,
            heartbeat_interval_secs: 5,
            heartbeat_timeout_secs: 15,
            max_restarts: 3,
            restart_window_secs: 300,
            max_concurrent_boots: 0,
            boot_timeout_secs: 30,
            bundle: "current".into(),
            backend: BackendChoice::Auto,
            bundle_url: None,
            auto_download: false,
        }
    }
}

impl DaemonConfig {
    /// The settings of a session that sets nothing itself.
    pub fn session_defaults(&self) -> SessionSettings {
        SessionSettings {
            memory_mib: self.memory_mib,
            cpus: self.cpus,
            idle_timeout_secs: self.idle_timeout_secs,
            disk_size_mib: self.disk_size_mib,
            heartbeat_interval_secs: self.heartbeat_interval_secs,
            heartbeat_timeout_secs: self.heartbeat_timeout_secs,
            bundle: self.bundle.clone(),
            backend: self.backend,
        }
    }

    /// Applies `patch` (only the fields it sets) after checking every value.
    pub fn apply(&mut self, patch: &ConfigPatch) -> Result<(), crate::ApiError> {
        let mut next = self.clone();
        macro_rules! set {
            ($($field:ident),*) => { $( if let Some(v) = &patch.$field { next.$field = v.clone(); } )* };
        }
        set!(
            memory_mib,
            cpus,
            idle_timeout_secs,
            disk_size_mib,
            heartbeat_interval_secs,
            heartbeat_timeout_secs,
            max_restarts,
            restart_window_secs,
            max_concurrent_boots,
            boot_timeout_secs,
            bundle,
            backend,
            auto_download
        );
        if let Some(url) = &patch.bundle_url {
            next.bundle_url = (!url.is_empty()).then(|| url.clone());
        }
        next.session_defaults().validate()?;
        if next.boot_timeout_secs == 0 {
            return Err(crate::ApiError::invalid_params("boot_timeout_secs must be at least 1"));
        }
        *self = next;
        Ok(())
    }
}

/// A `config.set`: the fields to change.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ConfigPatch {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_secs: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_size_mib: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_interval_secs: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_timeout_secs: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_restarts: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_window_secs: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrent_boots: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_timeout_secs: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bundle: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<BackendChoice>,
    /// An empty string clears it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bundle_url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_download: Option<bool>,
}

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
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_patch_changes_only_what_it_sets_and_is_checked_whole() {
        let mut c = DaemonConfig::default();
        c.apply(&ConfigPatch { memory_mib: Some(256), ..Default::default() }).unwrap();
        assert_eq!((c.memory_mib, c.cpus), (256, 1));
        let err = c.apply(&ConfigPatch { cpus: Some(2), memory_mib: Some(1), ..Default::default() }).unwrap_err();
        assert_eq!(err.code, crate::ErrorCode::InvalidParams);
        assert_eq!((c.memory_mib, c.cpus), (256, 1), "a rejected patch changes nothing");
        c.apply(&ConfigPatch { bundle_url: Some("http://127.0.0.1:1/b".into()), ..Default::default() }).unwrap();
        assert!(c.bundle_url.is_some());
        c.apply(&ConfigPatch { bundle_url: Some(String::new()), ..Default::default() }).unwrap();
        assert!(c.bundle_url.is_none());
    }

    #[test]
    fn a_partial_config_file_takes_defaults_for_the_rest() {
        let c: DaemonConfig = serde_json::from_str(r#"{"cpus": 2}"#).unwrap();
        assert_eq!(c.cpus, 2);
        assert_eq!((c.idle_timeout_secs, c.heartbeat_timeout_secs), (900, 15));
    }
}
