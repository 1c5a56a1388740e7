//! Changing a session's settings while it lives (`session.update`): what a running VM can take
//! at once, and what waits for its next boot.

use umbra_api::session::SettingsPatch;
use umbra_api::SessionSettings;

use super::Session;
use crate::session::error::SessionError;

/// What an update changed: in force now, and recorded for the next boot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SettingsChange {
    pub applied: Vec<String>,
    pub next_boot: Vec<String>,
}

impl Session {
    /// Changes the session's settings: `patch` over its own, its policy and approval merged
    /// with the daemon's defaults (`base`) as a start's are, then held to the system policy.
    /// The network must stay within the session's policy ceiling (as `set_network`); the disk's
    /// size cannot change once it exists. Approval, network, the idle timeout and action and
    /// `auto_expose` take effect at once (the supervisor and every spawn read them); the rest
    /// at the next boot.
    pub fn update(&self, patch: &SettingsPatch, base: &SessionSettings) -> Result<SettingsChange, SessionError> {
        self.touch();
        let mut state = self.state.lock().unwrap();
        let current = state.record.settings.clone();
        let mut next = patched(&current, base, patch)?;
        if patch.network.is_none() && patch.policy.is_some() && next.policy.network.is_some() {
            next.network = next.policy.effective().network;
        }
        if let Some(ceiling) = &next.policy.network {
            if let Some(excess) = umbra_policy::network_excess(&next.network, ceiling) {
                return Err(SessionError::BeyondPolicy {
                    name: self.name.clone(),
                    wanted: format!("network {}", umbra_policy::describe_network(&next.network)),
                    ceiling: format!("network {}", umbra_policy::describe_network(ceiling)),
                    excess,
                });
            }
        }
        self.ctx.cap(&mut next);
        let has_disk = self.storage_dir().is_some_and(|d| d.join(crate::session::DISK_FILE).exists());
        if has_disk && next.disk_size_mib != current.disk_size_mib {
            return Err(SessionError::Unsupported(format!(
                "session {:?} has its disk already ({} MiB): its size cannot change",
                self.name, current.disk_size_mib
            )));
        }
        let change = classify(&current, &next);
        if next.network != current.network {
            // New connections of the running VM follow it at once, as with `set_network`.
            *self.network.write().unwrap() = crate::egress::Policy::new(&next.network);
        }
        state.record.settings = next;
        drop(state);
        self.persist();
        Ok(change)
    }
}

/// `patch` over `onto`, its policy and approval merged with the daemon's defaults (`base`), as
/// a start's and an update's are (each then says what the network becomes).
pub(in crate::session) fn patched(
    onto: &SessionSettings,
    base: &SessionSettings,
    patch: &SettingsPatch,
) -> Result<SessionSettings, SessionError> {
    let mut next = patch.applied_to(onto).map_err(|e| SessionError::InvalidArgument(e.message))?;
    if let Some(policy) = &patch.policy {
        next.policy = umbra_policy::merge(&base.policy, policy);
    }
    if let (Some(own), Some(base)) = (&patch.approval, &base.approval) {
        next.approval = Some(own.merged_onto(base));
    }
    Ok(next)
}

/// Which fields differ, by when they take effect.
fn classify(current: &SessionSettings, next: &SessionSettings) -> SettingsChange {
    let mut change = SettingsChange::default();
    macro_rules! compare {
        ($list:ident: $($field:ident),*) => {
            $( if current.$field != next.$field { change.$list.push(stringify!($field).to_string()); } )*
        };
    }
    compare!(applied: approval, network, idle_timeout_secs, idle_action, auto_expose);
    compare!(next_boot: memory_mib, cpus, disk_size_mib, heartbeat_interval_secs, heartbeat_timeout_secs, bundle, backend, policy);
    change
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::instance::test_support::stopped_session;
    use umbra_api::session::{NetworkMode, NetworkPolicy};

    #[test]
    fn an_update_says_what_takes_effect_now_and_what_at_the_next_boot() {
        let dir = tempfile::tempdir().unwrap();
        let (mut settings, ceiling) = crate::session::instance::test_support::example_com_ceiling();
        settings.network = ceiling;
        let session = stopped_session(dir.path(), "s", settings, Vec::new());
        let base = SessionSettings::default();

        let patch = SettingsPatch {
            idle_timeout_secs: Some(60),
            idle_action: Some(umbra_api::IdleAction::Suspend),
            memory_mib: Some(1024),
            approval: Some(Default::default()),
            ..Default::default()
        };
        let change = session.update(&patch, &base).unwrap();
        assert_eq!(change.applied, ["approval", "idle_timeout_secs", "idle_action"]);
        assert_eq!(change.next_boot, ["memory_mib"]);
        let now = session.settings();
        assert_eq!((now.idle_timeout_secs, now.memory_mib), (60, 1024));

        // Beyond the session's ceiling: refused, nothing changes.
        let wider = SettingsPatch {
            network: Some(NetworkPolicy { mode: NetworkMode::Any, ..Default::default() }),
            ..Default::default()
        };
        let e = session.update(&wider, &base).unwrap_err();
        assert!(matches!(e, SessionError::BeyondPolicy { .. }), "{e}");
        assert_eq!(session.settings(), now);
        let narrower = SettingsPatch {
            network: Some(NetworkPolicy { mode: NetworkMode::None, ..Default::default() }),
            ..Default::default()
        };
        assert_eq!(session.update(&narrower, &base).unwrap().applied, ["network"]);
        assert!(session.network.read().unwrap().decide_name("example.com").is_err(), "the proxy follows at once");
        let bad = SettingsPatch { cpus: Some(0), ..Default::default() };
        assert!(matches!(session.update(&bad, &base).unwrap_err(), SessionError::InvalidArgument(_)));
    }
}
