//! A session: one VM at a time (an [`Incarnation`]), its folders, its processes, its settings,
//! and the state machine that starts, watches, restarts, idles out and stops it.
//!
//! `starting → ready → (restarting → ready)* → stopping → stopped | failed`. Transitions are
//! serialised by the lifecycle lock; a stop first cancels whatever boot or back-off is in
//! progress, so it never waits out a restart. A supervisor task per running VM sends
//! heartbeats, checks that the VM's processes live, and stops the session once it has been
//! idle (no running process, no client activity) for its idle timeout.
//!
//! The type and its state are here; what it does is split by concern, each with its own
//! tests: [`lifecycle`] (boot, supervision, restart, stop), [`processes`] (spawn through the
//! approval gate, signals, the network policy), [`kept`] (processes kept when their client
//! goes, terminals), [`files`] (folders, files, shadow folders), [`lsp`] (language servers) and
//! [`snapshots`] (snapshot, fork).

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use umbra_api::{EventKind, FolderInfo, SessionEvent, SessionInfo, SessionSettings, SessionStatus, VmInfo};

use super::context::Context;
use super::error::SessionError;
use super::exec::ExecControl;
use super::incarnation::{Incarnation, Report};
use super::store::SessionRecord;
use crate::backend::console::ERROR_CONTEXT_LINES;
use crate::share::paths::validate_session_name;

mod files;
mod kept;
mod lifecycle;
mod lsp;
mod ports;
mod processes;
mod settings;
mod snapshots;

pub(super) use settings::patched;
pub use settings::SettingsChange;
#[cfg(test)]
mod test_support;

/// A running process of the session, as its session lists it.
struct Running {
    control: ExecControl,
    pid: u32,
    argv: Vec<String>,
    /// A kept process's way to its pump after an adoption (`kept.rs`).
    rebind: Option<super::exec::Rebind>,
    /// The token it is parked under in the guest, while its session is suspended.
    parked: Option<u64>,
    /// Stdin written before the park and not yet sent, for the adopted process.
    pending_stdin: Option<crate::agent::PendingStdin>,
}

/// Why a session stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// A client asked.
    Requested,
    /// No process ran and no client did anything for the idle timeout.
    Idle,
    /// The owner (daemon, vmctl) is shutting down.
    Shutdown,
}

pub struct Session {
    /// Itself, for what an `&self` method starts (the resume of a suspended session).
    me: std::sync::Weak<Session>,
    name: String,
    ctx: Arc<Context>,
    state: Mutex<State>,
    status: watch::Sender<SessionStatus>,
    /// The network policy every VM of this session applies to new connections.
    network: crate::egress::SharedPolicy,
    /// Its secrets, which every VM's egress proxy gives to their hosts.
    secrets: crate::egress::SharedSecrets,
    /// The CA the guest trusts for the hosts the proxy reads requests of: made once per
    /// session in this process (its key never leaves it).
    ca: std::sync::OnceLock<Arc<crate::egress::SessionCa>>,
    /// The keys of its SSH agent (served on the host).
    ssh_keys: crate::egress::SharedSshKeys,
    /// Names the user allowed for the session when asked (network mode `ask`).
    network_approved: Arc<Mutex<std::collections::HashSet<String>>>,
    /// Its exposed ports' host listeners.
    ports: super::ports::Ports,
    /// The guest ports `auto_expose` exposed (not recorded; they end with their listener).
    auto_exposed: Mutex<std::collections::BTreeSet<u16>>,
    /// Held by every change to the ports, their record and `auto_exposed` (`ports.rs`).
    port_changes: tokio::sync::Mutex<()>,
    /// Serialises start, stop, resume and restart.
    lifecycle: tokio::sync::Mutex<()>,
    last_activity: Mutex<Instant>,
    /// Its language servers (`lsp.rs`).
    lsp: crate::session::lsp::Registry,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").field("name", &self.name).field("status", &self.status()).finish_non_exhaustive()
    }
}

struct State {
    record: SessionRecord,
    current: Option<Arc<Incarnation>>,
    /// Cancelled by a stop: ends boots, back-offs and the supervisor of this run.
    cancel: CancellationToken,
    restarts: u32,
    failures: VecDeque<Instant>,
    processes: HashMap<u64, Running>,
    /// Processes the session keeps when their client goes, and terminals; finished ones stay
    /// for `KEEP_FINISHED_SECS` (`kept.rs`).
    kept: std::collections::BTreeMap<u64, Arc<super::kept::Kept>>,
    /// Kept processes being started: places reserved against `MAX_KEPT`.
    kept_starting: usize,
    /// The console of the last VM, kept after it is gone (for logs and errors).
    last_console: String,
}

impl Session {
    /// A session of `record`, with `secrets` (values included), or the secrets the record
    /// kept (their `from_env` values read again; a value given inline is gone).
    pub(super) fn new(
        ctx: Arc<Context>,
        record: SessionRecord,
        secrets: Option<crate::egress::Secrets>,
        ssh_keys: Option<crate::egress::SshKeys>,
    ) -> Arc<Self> {
        let (status, _) = watch::channel(record.status);
        let network = Arc::new(std::sync::RwLock::new(crate::egress::Policy::new(&record.settings.network)));
        let secrets =
            secrets.unwrap_or_else(|| crate::egress::Secrets::restore(&record.secrets, |k| std::env::var(k).ok()));
        Arc::new_cyclic(|me| Self {
            me: me.clone(),
            name: record.name.clone(),
            network,
            secrets: Arc::new(std::sync::RwLock::new(secrets)),
            ssh_keys: Arc::new(std::sync::RwLock::new(
                ssh_keys.unwrap_or_else(|| crate::egress::SshKeys::restore(&record.ssh_keys)),
            )),
            ca: std::sync::OnceLock::new(),
            network_approved: Default::default(),
            ctx,
            state: Mutex::new(State {
                record,
                current: None,
                cancel: CancellationToken::new(),
                restarts: 0,
                failures: VecDeque::new(),
                processes: HashMap::new(),
                kept: Default::default(),
                kept_starting: 0,
                last_console: String::new(),
            }),
            status,
            ports: Default::default(),
            auto_exposed: Default::default(),
            port_changes: tokio::sync::Mutex::new(()),
            lifecycle: tokio::sync::Mutex::new(()),
            last_activity: Mutex::new(Instant::now()),
            lsp: Default::default(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn status(&self) -> SessionStatus {
        *self.status.borrow()
    }

    pub fn settings(&self) -> SessionSettings {
        self.state.lock().unwrap().record.settings.clone()
    }

    pub fn storage_dir(&self) -> Option<PathBuf> {
        self.ctx.storage_dir(&self.name)
    }

    /// Records client activity: an idle session is one nobody used for its idle timeout.
    pub fn touch(&self) {
        *self.last_activity.lock().unwrap() = Instant::now();
    }

    fn emit(&self, kind: EventKind) {
        self.ctx.bus.emit(SessionEvent::new(Some(&self.name), kind));
    }

    fn report(self: &Arc<Self>) -> Report {
        let me = Arc::downgrade(self);
        Arc::new(move |kind| {
            if let Some(me) = me.upgrade() {
                me.emit(kind);
            }
        })
    }

    /// A start given up before its boot: `failed` with `why`, for whoever waits on it.
    pub(crate) fn abandon(&self, why: &str) {
        self.set_status(SessionStatus::Failed, Some(why.to_string()));
    }

    fn set_status(&self, status: SessionStatus, reason: Option<String>) {
        tracing::info!(session = %self.name, %status, reason = reason.as_deref().unwrap_or(""), "status");
        {
            let mut state = self.state.lock().unwrap();
            state.record.status = status;
            if matches!(status, SessionStatus::Failed | SessionStatus::Stopped) {
                state.record.last_error = reason.clone();
            }
        }
        self.status.send_replace(status);
        self.persist();
        self.emit(EventKind::Status { status, reason });
    }

    fn persist(&self) {
        let record = self.state.lock().unwrap().record.clone();
        self.ctx.records.save(&record);
    }

    /// The session as clients see it.
    pub fn info(&self) -> SessionInfo {
        let state = self.state.lock().unwrap();
        let folders = match &state.current {
            Some(inc) => inc.folder_infos.lock().unwrap().clone(),
            // Not running: the folders it will get when it is resumed.
            None => {
                let mount = |name: &str| format!("/sessions/{}/mnt/{name}", self.name);
                let policy = crate::share::FolderPolicy::from_policy(&state.record.settings.policy.effective());
                let mut folders: Vec<FolderInfo> = state
                    .record
                    .folders
                    .iter()
                    .map(|f| {
                        let name = f.name.clone().unwrap_or_default();
                        let mode = policy.workspace_mode(f.mode);
                        FolderInfo { guest_path: mount(&name), name, host_path: f.path.clone(), mode }
                    })
                    .collect();
                if let Some(dir) = self.storage_dir() {
                    for (name, mode) in [
                        (crate::share::paths::OUTPUTS, umbra_proto::ShareMode::Rwd),
                        (crate::share::paths::UPLOADS, umbra_proto::ShareMode::Ro),
                    ] {
                        folders.push(FolderInfo {
                            name: name.into(),
                            host_path: dir.join(name),
                            mode,
                            guest_path: mount(name),
                        });
                    }
                }
                folders
            }
        };
        SessionInfo {
            name: self.name.clone(),
            status: self.status(),
            settings: state.record.settings.clone(),
            folders,
            storage_dir: self.storage_dir().unwrap_or_default(),
            vm: state.current.as_ref().map(|inc| VmInfo {
                host_memory_kib: crate::backend::host_memory_kib(&inc.info.pids),
                ..inc.info.clone()
            }),
            processes: state.processes.len() as u32,
            restarts: state.restarts,
            created_ms: state.record.created_ms,
            last_error: state.record.last_error.clone(),
            snapshot: state.record.snapshot.clone(),
            suspended: state.record.suspended,
            policy_decided_by: state.record.policy_decided_by.clone(),
            secrets: self.secrets.read().unwrap().infos(),
            ssh_keys: self.ssh_keys.read().unwrap().infos(),
            ports: self.ports_info(&state.record.ports),
        }
    }

    /// What the egress proxy of this session's VMs needs for its secrets.
    pub(super) fn broker(self: &Arc<Self>) -> Result<crate::egress::Broker, SessionError> {
        let ca = match self.ca.get() {
            Some(ca) => ca.clone(),
            None => {
                let ca = crate::egress::SessionCa::generate(&self.name)
                    .map_err(|e| SessionError::Internal(format!("session {}: its CA: {e}", self.name)))?;
                self.ca.get_or_init(|| Arc::new(ca)).clone()
            }
        };
        // Without a trust store upstream, requests that need one are answered 502 saying why.
        let upstream = self.ctx.upstream();
        // A proxy setting that does not parse stops the boot, saying why: connecting around
        // the company's proxy instead would be wrong.
        let upstream_proxy = self.ctx.upstream_proxy().map_err(SessionError::InvalidArgument)?;
        // Mode `ask` asks through the session's approvals, on its event stream.
        let me = Arc::downgrade(self);
        let asker: crate::egress::Asker = Arc::new(move |question, timeout| {
            let me = me.clone();
            Box::pin(async move {
                let me = me.upgrade().ok_or("the session is gone")?;
                me.ctx.approvals.ask_network(question, timeout, |kind| me.emit(kind)).await
            })
        });
        let ask = Some(Arc::new(crate::egress::AskGate::new(asker, self.network_approved.clone())));
        Ok(crate::egress::Broker {
            secrets: self.secrets.clone(),
            ca,
            upstream,
            upstream_proxy,
            ask,
            ssh_keys: self.ssh_keys.clone(),
        })
    }

    /// A copy of the SSH keys (for a fork in this process).
    pub(super) fn ssh_keys(&self) -> crate::egress::SshKeys {
        self.ssh_keys.read().unwrap().clone()
    }

    /// A copy of the secrets, values included (for a fork in this process).
    pub(super) fn secrets(&self) -> crate::egress::Secrets {
        self.secrets.read().unwrap().clone()
    }

    /// Adds or replaces a secret (see `session.set_secret`); the next request uses it.
    pub fn set_secret(&self, spec: &umbra_api::secrets::SecretSpec) -> Result<(), SessionError> {
        let bindings = {
            let mut secrets = self.secrets.write().unwrap();
            secrets.set(spec, |k| std::env::var(k).ok()).map_err(SessionError::InvalidArgument)?;
            secrets.bindings()
        };
        self.state.lock().unwrap().record.secrets = bindings;
        self.persist();
        Ok(())
    }

    /// The last console lines of the running (or last) VM.
    pub async fn console_tail(&self, lines: usize) -> String {
        let current = self.state.lock().unwrap().current.clone();
        match current {
            Some(inc) => inc.machine.lock().await.vm.console_tail(lines),
            None => {
                let last = self.state.lock().unwrap().last_console.clone();
                let all: Vec<&str> = last.lines().collect();
                all[all.len().saturating_sub(lines)..].join("\n")
            }
        }
    }

    fn invalid_state(&self, what: &'static str) -> SessionError {
        SessionError::InvalidState { name: self.name.clone(), status: self.status(), what }
    }

    /// The running VM; waits while the session starts or restarts, and resumes a suspended one.
    async fn running(&self, what: &'static str) -> Result<Arc<Incarnation>, SessionError> {
        if let Some(me) = self.me.upgrade() {
            me.wake().await?;
        }
        match self.status() {
            SessionStatus::Ready | SessionStatus::Starting | SessionStatus::Restarting => {}
            _ => return Err(self.invalid_state(what)),
        }
        self.wait_ready().await?;
        self.state.lock().unwrap().current.clone().ok_or_else(|| self.invalid_state(what))
    }

    /// The lines of the console the error context uses.
    pub const CONSOLE_LINES: usize = ERROR_CONTEXT_LINES;
}

/// Checks a session name before anything is created for it.
pub(super) fn check_name(name: &str) -> Result<(), SessionError> {
    validate_session_name(name).map_err(|e| SessionError::InvalidArgument(e.to_string()))
}
