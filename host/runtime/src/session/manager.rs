//! [`SessionManager`]: the named sessions of one owner (umbrad, or one `vmctl run`), and the
//! shared machinery they use.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use tokio::sync::broadcast;
use umbra_api::methods::StartParams;
use umbra_api::{ApiError, ConfigPatch, DaemonConfig, FolderSpec, SessionEvent, SessionInfo, SessionStatus};

use super::admission::Admission;
use super::context::Context;
use super::error::SessionError;
use super::events::EventBus;
use super::instance::{check_name, Session, StopReason};
use super::store::{RecordStore, SessionRecord};
use crate::share::paths::{default_folder_name, validate_folder_name, OUTPUTS, UPLOADS};

/// Where a manager keeps things, and its defaults.
pub struct ManagerOptions {
    pub config: DaemonConfig,
    /// Session records and event logs; `None` keeps nothing across runs.
    pub state_dir: Option<PathBuf>,
    /// Each session's storage (outputs, uploads, disk) under `<root>/<name>`; `None` gives
    /// sessions none (no outputs or uploads folders, no disk).
    pub storage_root: Option<PathBuf>,
    pub bundles: umbra_bundle::Store,
}

impl ManagerOptions {
    /// What a daemon uses: the XDG state and data directories.
    pub fn persistent(config: DaemonConfig) -> Self {
        Self {
            config,
            state_dir: Some(crate::paths::state_dir().join("sessions")),
            storage_root: Some(crate::paths::data_dir().join("sessions")),
            bundles: umbra_bundle::Store::new(umbra_bundle::Store::default_root()),
        }
    }

    /// One-off sessions (`vmctl run`): nothing persisted, no storage, no restarts.
    pub fn ephemeral(mut config: DaemonConfig) -> Self {
        config.max_restarts = 0;
        config.session.disk_size_mib = 0;
        config.session.idle_timeout_secs = 0;
        Self {
            config,
            state_dir: None,
            storage_root: None,
            bundles: umbra_bundle::Store::new(umbra_bundle::Store::default_root()),
        }
    }
}

pub struct SessionManager {
    ctx: Arc<Context>,
    sessions: Mutex<BTreeMap<String, Arc<Session>>>,
}

impl SessionManager {
    /// A manager with the sessions recorded in its state directory, all `stopped` (their VMs
    /// ended with the process that ran them).
    pub fn new(opts: ManagerOptions) -> Self {
        let bus = Arc::new(EventBus::new(opts.state_dir.clone()));
        let admission = Admission::new(opts.config.max_concurrent_boots as usize);
        let records = RecordStore::new(opts.state_dir);
        let ctx = Arc::new(Context::new(bus, admission, records, opts.config, opts.storage_root, opts.bundles));
        let mut sessions = BTreeMap::new();
        for mut record in ctx.records.load_all() {
            if !matches!(record.status, SessionStatus::Stopped | SessionStatus::Failed) {
                record.status = SessionStatus::Stopped;
                record.last_error = Some("its VM ended when the daemon that ran it stopped".into());
                ctx.records.save(&record);
            }
            sessions.insert(record.name.clone(), Session::new(ctx.clone(), record, None, None));
        }
        super::pool::refill::start(&ctx);
        Self { ctx, sessions: Mutex::new(sessions) }
    }

    /// The warm pool's target (from the configuration now, though the pool follows it in the
    /// background) and contents.
    pub fn pool_status(&self) -> umbra_api::methods::PoolStatus {
        umbra_api::methods::PoolStatus { target: self.config().pool_target(), ..self.ctx.pool.status() }
    }

    /// Lifecycle events of every session (and the host's): see [`EventBus`].
    pub fn subscribe(&self) -> broadcast::Receiver<SessionEvent> {
        self.ctx.bus.subscribe()
    }

    /// [`Self::subscribe`], with how many events were sent before (see
    /// [`EventBus::subscribe_counted`]): a front end uses it to send a response only after
    /// the events that preceded it.
    pub fn subscribe_counted(&self) -> (broadcast::Receiver<SessionEvent>, u64) {
        self.ctx.bus.subscribe_counted()
    }

    /// How many lifecycle events were sent so far.
    pub fn events_sent(&self) -> u64 {
        self.ctx.bus.sent()
    }

    /// Publishes an event that is not about a session's VM (a bundle download).
    pub fn emit(&self, event: SessionEvent) {
        self.ctx.bus.emit(event);
    }

    pub fn config(&self) -> DaemonConfig {
        self.ctx.config()
    }

    /// Changes the defaults for new sessions (and the restart policy, boot limits). `persist`
    /// sees the new configuration first: when it fails, nothing changes.
    pub fn set_config(
        &self,
        patch: &ConfigPatch,
        persist: impl FnOnce(&DaemonConfig) -> Result<(), ApiError>,
    ) -> Result<DaemonConfig, ApiError> {
        let mut config = self.ctx.config.write().unwrap();
        let mut next = config.patched(patch)?;
        // What a patch asks beyond the system policy is held to it (and stored so).
        self.ctx.cap(&mut next.session);
        persist(&next)?;
        if next.max_concurrent_boots != config.max_concurrent_boots {
            self.ctx.admission.resize(next.max_concurrent_boots as usize);
        }
        *config = next.clone();
        self.ctx.pool.wake();
        Ok(next)
    }

    /// Replaces the whole configuration (its file changed on disk): checked, held to the
    /// system policy, and in force as `config.set`'s changes are. False when it is the same.
    pub fn replace_config(&self, mut next: DaemonConfig) -> Result<bool, ApiError> {
        next.validate()?;
        self.ctx.cap(&mut next.session);
        let mut config = self.ctx.config.write().unwrap();
        if *config == next {
            return Ok(false);
        }
        if next.max_concurrent_boots != config.max_concurrent_boots {
            self.ctx.admission.resize(next.max_concurrent_boots as usize);
        }
        *config = next;
        drop(config);
        self.ctx.pool.wake();
        Ok(true)
    }

    /// The machine's system policy, when it has one: its ceilings hold for every session this
    /// manager starts, resumes or forks, and for its configuration (`docs/policy.md`).
    pub fn set_system_policy(&self, system: Option<umbra_api::system::SystemPolicyInfo>) {
        *self.ctx.system.write().unwrap() = system;
        self.ctx.cap(&mut self.ctx.config.write().unwrap().session);
        // Sessions recorded before it (or under a looser one) are held to it too.
        let sessions: Vec<Arc<Session>> = self.sessions.lock().unwrap().values().cloned().collect();
        for s in sessions {
            s.hold_to_system_policy();
        }
    }

    pub fn system_policy(&self) -> Option<umbra_api::system::SystemPolicyInfo> {
        self.ctx.system.read().unwrap().clone()
    }

    pub fn bundles(&self) -> &umbra_bundle::Store {
        &self.ctx.bundles
    }

    /// A session by name.
    pub fn get(&self, name: &str) -> Result<Arc<Session>, SessionError> {
        self.sessions.lock().unwrap().get(name).cloned().ok_or_else(|| SessionError::NotFound(name.into()))
    }

    pub fn list(&self) -> Vec<SessionInfo> {
        let sessions: Vec<Arc<Session>> = self.sessions.lock().unwrap().values().cloned().collect();
        sessions.iter().map(|s| s.info()).collect()
    }

    /// The last `n` lifecycle events of session `name`.
    pub fn recent_events(&self, name: &str, n: usize) -> Vec<SessionEvent> {
        self.ctx.bus.recent(name, n)
    }

    /// Answers a `permission_request` event: the spawn waiting on it runs, or is refused.
    /// Returns the allow patterns of a command's request (what `allow_always` adds).
    pub fn respond_permission(
        &self,
        request_id: &str,
        approved: bool,
        scope: umbra_api::event::PermissionScope,
    ) -> Result<Vec<String>, SessionError> {
        self.ctx.approvals.respond(request_id, approved, scope)
    }

    /// Creates session `params.name` and boots it; returns once it is ready. A session of that
    /// name that is starting (or running) is waited for instead — never booted twice; one that
    /// is stopped or failed is an error (resume or delete it).
    pub async fn start(&self, params: StartParams) -> Result<Arc<Session>, SessionError> {
        check_name(&params.name)?;
        self.ctx.check_enabled()?;
        let base = self.config().session;
        let mut settings = start_settings(&base, &params.settings)?;
        self.ctx.check_bundle(&settings.bundle)?;
        self.ctx.cap(&mut settings);
        let decided_by = umbra_policy::merge_sources(&[
            (umbra_policy::PolicySource::System, self.ctx.system().map(|s| s.sandbox()).unwrap_or_default()),
            (umbra_policy::PolicySource::Admin, base.policy.clone()),
            (umbra_policy::PolicySource::Session, params.settings.policy.clone().unwrap_or_default()),
        ])
        .decided_by;
        let folders = check_folders(&params.folders)?;
        for f in &folders {
            self.ctx.check_folder(&f.path)?;
        }
        let mut secrets = crate::egress::Secrets::default();
        for spec in &params.secrets {
            secrets.set(spec, |k| std::env::var(k).ok()).map_err(SessionError::InvalidArgument)?;
        }
        let mut ssh_keys = crate::egress::SshKeys::default();
        if !params.ssh_keys.is_empty() {
            // Host keys not given come from the user's known_hosts, as `ssh-add -h` finds them.
            let known = std::env::var_os("HOME")
                .and_then(|h| std::fs::read_to_string(std::path::Path::new(&h).join(".ssh/known_hosts")).ok());
            for spec in &params.ssh_keys {
                ssh_keys.add(spec, known.as_deref()).map_err(SessionError::InvalidArgument)?;
            }
        }
        let config = self.config();
        for p in &params.ports {
            p.check(config.ports_beyond_loopback, config.ports_privileged).map_err(SessionError::InvalidArgument)?;
        }
        let (session, created) = {
            let mut sessions = self.sessions.lock().unwrap();
            match sessions.get(&params.name) {
                Some(existing) => (existing.clone(), false),
                None => {
                    let mut record = SessionRecord::new(&params.name, settings, folders);
                    record.secrets = secrets.bindings();
                    record.ssh_keys = ssh_keys.bindings();
                    record.ports = params.ports.clone();
                    record.policy_decided_by = Some(decided_by);
                    let session = Session::new(self.ctx.clone(), record, Some(secrets), Some(ssh_keys));
                    sessions.insert(params.name.clone(), session.clone());
                    (session, true)
                }
            }
        };
        if !created {
            let status = session.status();
            if !status.is_active() {
                return Err(SessionError::Exists { name: params.name, status });
            }
            session.wait_ready().await?;
            return Ok(session);
        }
        // Its ports listen from the start (a connection before the VM runs is closed); one that
        // cannot be had fails the start before any boot, and nothing of the session is kept.
        if let Err(e) = session.open_recorded_ports().await {
            session.close_ports().await;
            session.abandon(&e.to_string());
            self.sessions.lock().unwrap().remove(&params.name);
            self.ctx.records.remove(&params.name);
            return Err(e);
        }
        session.boot().await?;
        Ok(session)
    }

    /// Boots a stopped or failed session again with its folders, outputs and disk; waits for
    /// one that is already starting or running.
    pub async fn resume(&self, name: &str) -> Result<Arc<Session>, SessionError> {
        self.resume_with(name, false).await
    }

    /// [`Self::resume`]; with `discard_snapshot`, a stopped or failed session's snapshot is
    /// deleted first, so it boots from its disk (a snapshot this host cannot restore).
    pub async fn resume_with(&self, name: &str, discard_snapshot: bool) -> Result<Arc<Session>, SessionError> {
        let session = self.get(name)?;
        self.ctx.check_enabled()?;
        if discard_snapshot {
            session.discard_snapshot().await?;
        }
        if session.begin_resume()? {
            session.boot().await?;
        } else {
            session.wait_ready().await?;
        }
        Ok(session)
    }

    /// Pauses running session `name` into a snapshot and stops it (see [`Session::snapshot`]).
    pub async fn snapshot(&self, name: &str) -> Result<Arc<Session>, SessionError> {
        let session = self.get(name)?;
        session.snapshot().await?;
        Ok(session)
    }

    /// Creates session `name` from the snapshot of `source` and starts it: the same settings
    /// and folders, its own disk (a copy of the snapshot's), outputs and uploads (copies of the
    /// source's), entropy and hostname (its name). A running source on the kvm backend runs on:
    /// its guest pauses only while the fork's state is captured and its disk copied (a live
    /// fork, [`crate::backend::Vm::fork`]); on another backend it is snapshotted and resumed
    /// first, so it pauses for the time of a snapshot and a restore.
    pub async fn fork(&self, source: &str, name: &str) -> Result<Arc<Session>, SessionError> {
        check_name(name)?;
        self.ctx.check_enabled()?;
        let src = self.get(source)?;
        let dest = self
            .ctx
            .storage_dir(name)
            .ok_or_else(|| SessionError::Unsupported("sessions here have no storage to fork into".into()))?;
        if let Ok(existing) = self.get(name) {
            return Err(SessionError::Exists { name: name.into(), status: existing.status() });
        }
        let running = src.status().is_active();
        if running {
            src.wait_ready().await?;
        }
        // A running session on a backend that forks live runs on (paused for the fork's
        // capture); on any other, it is snapshotted and resumed first.
        let live = running && src.can_fork_live().await;
        let just_taken = running && !live;
        if just_taken {
            src.snapshot().await?;
            self.resume(source).await?;
        }
        let session = {
            let mut sessions = self.sessions.lock().unwrap();
            if let Some(existing) = sessions.get(name) {
                return Err(SessionError::Exists { name: name.into(), status: existing.status() });
            }
            // Its storage is new: a directory there is some session's data this manager could
            // not load, never to be merged into or removed by a failed fork.
            if let Some(parent) = dest.parent() {
                std::fs::create_dir_all(parent).map_err(SessionError::io(format!("create {}", parent.display())))?;
            }
            std::fs::create_dir(&dest).map_err(|e| match e.kind() {
                std::io::ErrorKind::AlreadyExists => SessionError::InvalidArgument(format!(
                    "{} exists already, holding data of no session this daemon knows: move it away or fork under \
                     another name",
                    dest.display()
                )),
                _ => SessionError::io(format!("create {}", dest.display()))(e),
            })?;
            let session =
                Session::new(self.ctx.clone(), src.fork_record(name), Some(src.secrets()), Some(src.ssh_keys()));
            sessions.insert(name.into(), session.clone());
            session
        };
        let snapshot = match live {
            true => src.fork_live_into(&dest).await,
            false => src.fork_into(&dest, just_taken).await,
        };
        match snapshot {
            Ok(snapshot) => session.set_snapshot(snapshot),
            Err(e) => {
                self.sessions.lock().unwrap().remove(name);
                self.ctx.records.remove(name);
                let _ = std::fs::remove_dir_all(&dest);
                return Err(e);
            }
        }
        session.boot().await?;
        Ok(session)
    }

    pub async fn stop(&self, name: &str) -> Result<Arc<Session>, SessionError> {
        let session = self.get(name)?;
        session.stop(StopReason::Requested).await?;
        Ok(session)
    }

    /// Stops session `name` and removes it with its outputs, uploads, disk and logs.
    pub async fn delete(&self, name: &str) -> Result<(), SessionError> {
        let session = self.get(name)?;
        session.stop(StopReason::Requested).await?;
        session.close_ports().await;
        self.sessions.lock().unwrap().remove(name);
        self.ctx.records.remove(name);
        self.ctx.bus.forget(name);
        if let Some(dir) = session.storage_dir() {
            if dir.exists() {
                std::fs::remove_dir_all(&dir).map_err(SessionError::io(format!("remove {}", dir.display())))?;
            }
        }
        Ok(())
    }

    /// Stops every session (the owner is going away).
    pub async fn shutdown(&self) {
        self.ctx.pool.shutdown();
        let sessions: Vec<Arc<Session>> = self.sessions.lock().unwrap().values().cloned().collect();
        let stops = sessions.iter().map(|s| s.stop(StopReason::Shutdown));
        futures_util::future::join_all(stops).await;
        // Records and event logs are written in the background: finish before the owner exits.
        let ctx = self.ctx.clone();
        let _ = tokio::task::spawn_blocking(move || {
            ctx.records.flush();
            ctx.bus.flush();
        })
        .await;
    }
}

/// Checks the folders of a start request before anything boots: each an existing directory,
/// names valid and distinct (defaults included), none named like the session's own folders.
/// The settings a start boots with: the daemon's defaults with the start's fields — except the
/// policy and the approval settings, which are merged (most restrictive wins) rather than
/// replaced, so no start can loosen what the daemon's configuration requires. A policy that
/// says something about the network decides the session's network.
fn start_settings(
    base: &umbra_api::SessionSettings,
    patch: &umbra_api::session::SettingsPatch,
) -> Result<umbra_api::SessionSettings, SessionError> {
    let mut settings = super::instance::patched(base, base, patch)?;
    if settings.policy.network.is_some() {
        settings.network = settings.policy.effective().network;
    }
    Ok(settings)
}

fn check_folders(folders: &[FolderSpec]) -> Result<Vec<FolderSpec>, SessionError> {
    let mut names = Vec::new();
    let mut out = Vec::new();
    for f in folders {
        let path = f.path.canonicalize().map_err(SessionError::io(format!("share {}", f.path.display())))?;
        if !path.is_dir() {
            return Err(SessionError::InvalidArgument(format!("{} is not a directory", path.display())));
        }
        let name = match &f.name {
            Some(n) => n.clone(),
            None => default_folder_name(&path)?,
        };
        validate_folder_name(&name)?;
        if name == OUTPUTS || name == UPLOADS || names.contains(&name) {
            return Err(SessionError::InvalidArgument(format!(
                "two folders would be named {name:?}; give one another name"
            )));
        }
        names.push(name.clone());
        out.push(FolderSpec { path, name: Some(name), mode: f.mode });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use umbra_api::session::{NetworkMode, NetworkPolicy, SettingsPatch};
    use umbra_api::SessionSettings;
    use umbra_policy::{PolicyType, SandboxPolicy};

    use super::start_settings;

    #[test]
    fn a_start_merges_its_policy_with_the_daemons_and_never_loosens_it() {
        let base = SessionSettings {
            policy: SandboxPolicy {
                kind: Some(PolicyType::WorkspaceReadonly),
                ignore: Some(vec![".env".into()]),
                ..Default::default()
            },
            ..Default::default()
        };
        let start = SettingsPatch {
            policy: Some(SandboxPolicy {
                kind: Some(PolicyType::InsecureNone),
                block_git_writes: Some(true),
                ignore: Some(vec!["*.pem".into()]),
                network: Some(NetworkPolicy { mode: NetworkMode::Any, ..Default::default() }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let s = start_settings(&base, &start).unwrap();
        let e = s.policy.effective();
        assert_eq!(e.kind, PolicyType::WorkspaceReadonly, "the daemon's read-only wins");
        assert!(e.block_git_writes);
        assert_eq!(e.ignore, ["*.pem", ".env"], "both sources' patterns");
        assert_eq!(s.network.mode, NetworkMode::Any, "a policy's network decides the session's");

        // Without a policy in the start, the daemon's stays whole.
        let s = start_settings(&base, &SettingsPatch::default()).unwrap();
        assert_eq!(s.policy, base.policy);
        // A malformed policy is refused with the field.
        let bad = SettingsPatch {
            policy: Some(SandboxPolicy { additional_readonly_paths: Some(vec!["rel".into()]), ..Default::default() }),
            ..Default::default()
        };
        let e = start_settings(&base, &bad).unwrap_err().to_string();
        assert!(e.contains("additional_readonly_paths"), "{e}");
    }
}
