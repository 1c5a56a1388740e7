//! A session with no VM, on a manager context in a temporary directory: what the parts' unit
//! tests check state rules and validation against (the end-to-end tests boot real VMs).

use std::sync::Arc;

use umbra_api::{DaemonConfig, FolderSpec, SessionSettings, SessionStatus};

use super::Session;
use crate::session::admission::Admission;
use crate::session::context::Context;
use crate::session::events::EventBus;
use crate::session::store::{RecordStore, SessionRecord};

/// A `stopped` session named `name` with `settings` and `folders`, its storage and records in
/// `dir`.
pub fn stopped_session(
    dir: &std::path::Path,
    name: &str,
    settings: SessionSettings,
    folders: Vec<FolderSpec>,
) -> Arc<Session> {
    let ctx = Arc::new(Context::new(
        Arc::new(EventBus::new(None)),
        Admission::new(1),
        RecordStore::new(Some(dir.join("state"))),
        DaemonConfig::default(),
        Some(dir.join("sessions")),
        umbra_bundle::Store::new(dir.join("bundles")),
    ));
    let mut record = SessionRecord::new(name, settings, folders);
    record.status = SessionStatus::Stopped;
    Session::new(ctx, record, None, None)
}

/// Settings whose policy's network ceiling is an allowlist of `example.com`, and that ceiling.
pub fn example_com_ceiling() -> (SessionSettings, umbra_api::session::NetworkPolicy) {
    let ceiling = umbra_api::session::NetworkPolicy {
        mode: umbra_api::session::NetworkMode::Allowlist,
        allow_domains: vec!["example.com".into()],
        ..Default::default()
    };
    let mut settings = SessionSettings::default();
    settings.policy.network = Some(ceiling.clone());
    (settings, ceiling)
}
