//! Watching umbrad's configuration file and the machine's system policy: an edit on disk takes
//! effect without a restart, and clients hear of every change (`config_changed`).
//!
//! Polled (every [`EVERY`]): both files are small, rarely change, and may be replaced by an
//! editor's rename or by a configuration manager; a file's length, modification time and inode
//! together say it changed. A configuration that no longer loads is ignored with a warning (the
//! one in force stays); a system policy that no longer loads keeps the one in force too, so a
//! broken or user-writable edit never lifts a ceiling.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use umbra_api::{EventKind, SessionEvent};

use crate::state::Daemon;

const EVERY: Duration = Duration::from_secs(2);

/// What identifies one version of a file; `None` when there is none.
fn stamp(path: &Path) -> Option<(u64, i64, i64, u64)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.len(), m.mtime(), m.mtime_nsec(), m.ino()))
}

/// Announces a change of `what` (`configuration`, `system_policy`) at `path`.
pub fn changed(daemon: &Daemon, what: &str, path: &Path) {
    let kind = EventKind::ConfigChanged { what: what.into(), path: path.to_path_buf() };
    daemon.manager.emit(SessionEvent::new(None, kind));
}

/// Starts watching both files for the daemon's lifetime.
pub fn start(daemon: Arc<Daemon>, system_policy: PathBuf) {
    let config = daemon.options.config_path.clone();
    tokio::spawn(async move {
        let (mut config_seen, mut policy_seen) = (stamp(&config), stamp(&system_policy));
        let mut tick = tokio::time::interval(EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let now = stamp(&config);
            if now != config_seen {
                config_seen = now;
                reload_config(&daemon, &config);
            }
            let now = stamp(&system_policy);
            if now != policy_seen {
                policy_seen = now;
                reload_system_policy(&daemon, &system_policy);
            }
        }
    });
}

fn reload_config(daemon: &Daemon, path: &Path) {
    let loaded = crate::settings::load(path).map_err(|e| e.to_string());
    match loaded.and_then(|c| daemon.manager.replace_config(c).map_err(|e| e.message)) {
        Ok(true) => {
            tracing::info!(path = %path.display(), "configuration reloaded");
            changed(daemon, "configuration", path);
        }
        // Our own `config.set` wrote it: already in force and announced.
        Ok(false) => {}
        Err(e) => tracing::warn!("the configuration file changed but is not used: {e}"),
    }
}

fn reload_system_policy(daemon: &Daemon, path: &Path) {
    match umbra_runtime::system_policy::load(path) {
        Ok(policy) => {
            let info = policy.map(|policy| umbra_api::system::SystemPolicyInfo { path: path.to_path_buf(), policy });
            if info == daemon.manager.system_policy() {
                return;
            }
            tracing::info!(path = %path.display(), present = info.is_some(), "system policy reloaded");
            daemon.manager.set_system_policy(info);
            changed(daemon, "system_policy", path);
        }
        Err(e) => tracing::error!("the system policy changed and is refused; the one in force stays: {e}"),
    }
}
