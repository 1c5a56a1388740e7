//! A session: one VM at a time (an [`Incarnation`]), its folders, its processes, its settings,
//! and the state machine that starts, watches, restarts, idles out and stops it.
//!
//! `starting → ready → (restarting → ready)* → stopping → stopped | failed`. Transitions are
//! serialised by the lifecycle lock; a stop first cancels whatever boot or back-off is in
//! progress, so it never waits out a restart. A supervisor task per running VM sends
//! heartbeats, checks that the VM's processes live, and stops the session once it has been
//! idle (no running process, no client activity) for its idle timeout.

use std::collections::{HashMap, VecDeque};
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use umbra_api::event::ShadowApplyReport;
use umbra_api::methods::ShadowDiffResult;
use umbra_api::{
    ApiError, EventKind, FolderInfo, FolderSpec, SessionEvent, SessionInfo, SessionSettings, SessionStatus,
};
use umbra_proto::{DirEntry, FileStat, WriteFileRequest, WriteMode};

use super::context::Context;
use super::error::SessionError;
use super::exec::{self, Exec, ExecControl, ExecRequest, PumpContext};
use super::incarnation::{folder_mounted, BootPlan, Failure, Incarnation, Report};
use super::snapshot::{PendingSnapshot, SessionSnapshot, SnapshotMeta};
use super::store::SessionRecord;
use crate::backend::console::ERROR_CONTEXT_LINES;
use crate::share::paths::validate_session_name;
use crate::share::tree;

/// How often the supervisor checks that the VM's processes are alive.
const ALIVE_EVERY: Duration = Duration::from_millis(500);
/// Back-off before restart attempt n is `RESTART_BASE * 2^(n-1)`, at most `RESTART_MAX`.
const RESTART_BASE: Duration = Duration::from_secs(1);
const RESTART_MAX: Duration = Duration::from_secs(30);

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
    name: String,
    ctx: Arc<Context>,
    state: Mutex<State>,
    status: watch::Sender<SessionStatus>,
    /// The network policy every VM of this session applies to new connections.
    network: crate::egress::SharedPolicy,
    /// Serialises start, stop, resume and restart.
    lifecycle: tokio::sync::Mutex<()>,
    last_activity: Mutex<Instant>,
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
    processes: HashMap<u64, ExecControl>,
    /// The console of the last VM, kept after it is gone (for logs and errors).
    last_console: String,
}

impl Session {
    pub(super) fn new(ctx: Arc<Context>, record: SessionRecord) -> Arc<Self> {
        let (status, _) = watch::channel(record.status);
        let network = Arc::new(std::sync::RwLock::new(crate::egress::Policy::new(&record.settings.network)));
        Arc::new(Self {
            name: record.name.clone(),
            network,
            ctx,
            state: Mutex::new(State {
                record,
                current: None,
                cancel: CancellationToken::new(),
                restarts: 0,
                failures: VecDeque::new(),
                processes: HashMap::new(),
                last_console: String::new(),
            }),
            status,
            lifecycle: tokio::sync::Mutex::new(()),
            last_activity: Mutex::new(Instant::now()),
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
            vm: state.current.as_ref().map(|inc| inc.info.clone()),
            processes: state.processes.len() as u32,
            restarts: state.restarts,
            created_ms: state.record.created_ms,
            last_error: state.record.last_error.clone(),
            snapshot: state.record.snapshot.clone(),
        }
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

    // ---- lifecycle ------------------------------------------------------------------------

    /// Boots the session (it must be `starting`: the caller set it so, holding the registry)
    /// and supervises it. A failure leaves it `failed` with the reason.
    pub(super) async fn boot(self: &Arc<Self>) -> Result<(), SessionError> {
        let _lifecycle = self.lifecycle.lock().await;
        if self.status() != SessionStatus::Starting {
            return Err(self.invalid_state("start"));
        }
        let cancel = {
            let mut state = self.state.lock().unwrap();
            state.cancel = CancellationToken::new();
            state.restarts = 0;
            state.failures.clear();
            state.cancel.clone()
        };
        self.emit(EventKind::Status { status: SessionStatus::Starting, reason: None });
        let booted = tokio::select! {
            r = self.boot_incarnation() => r,
            _ = cancel.cancelled() => Err(SessionError::Failed { name: self.name.clone(), reason: "stopped while starting".into() }),
        };
        match booted {
            Ok(inc) => {
                self.install(inc, cancel);
                Ok(())
            }
            Err(e) => {
                if !cancel.is_cancelled() {
                    self.emit(EventKind::StartupError { error: ApiError::new(e.code(), e.to_string()) });
                    self.set_status(SessionStatus::Failed, Some(e.to_string()));
                }
                Err(e)
            }
        }
    }

    /// Makes a stopped or failed session `starting` again; false if it already is active.
    pub(super) fn begin_resume(&self) -> Result<bool, SessionError> {
        // Checked and set in one step: of two concurrent resumes, one boots and one waits.
        let mut seen = self.status();
        let resumed = self.status.send_if_modified(|status| {
            seen = *status;
            if matches!(*status, SessionStatus::Stopped | SessionStatus::Failed) {
                *status = SessionStatus::Starting;
                true
            } else {
                false
            }
        });
        if resumed {
            self.state.lock().unwrap().record.status = SessionStatus::Starting;
            return Ok(true);
        }
        match seen {
            SessionStatus::Stopping => Err(self.invalid_state("resume while it is stopping")),
            _ => Ok(false),
        }
    }

    /// Boots the session's next VM, or restores its snapshot if it was paused by one (or is a
    /// fork not yet started): the restore is used once, and later VMs of the session boot.
    async fn boot_incarnation(self: &Arc<Self>) -> Result<Arc<Incarnation>, SessionError> {
        let (settings, folders, resumes, pins) = {
            let state = self.state.lock().unwrap();
            let resumes = state.record.snapshot.as_ref().is_some_and(|s| s.resumes);
            (state.record.settings.clone(), state.record.folders.clone(), resumes, state.record.pinned.clone())
        };
        let plan = BootPlan {
            session: self.name.clone(),
            settings,
            folders,
            storage_dir: self.storage_dir(),
            boot_timeout: Duration::from_secs(self.ctx.config().boot_timeout_secs),
            network: self.network.clone(),
            pins,
        };
        if !resumes {
            let inc = Arc::new(Incarnation::boot(&plan, &self.ctx, self.report()).await?);
            self.keep_pins(&inc).await;
            return Ok(inc);
        }
        let storage = self.storage_dir().ok_or_else(|| SessionError::Unsupported("no storage".into()))?;
        let snapshot = tokio::task::spawn_blocking(move || SessionSnapshot::load(&storage))
            .await
            .map_err(SessionError::task("reading the snapshot"))??;
        // A resume keeps the guest's name; a fork's first start gives it the fork's.
        let hostname = match snapshot.meta.session == self.name {
            true => snapshot.meta.hostname.clone(),
            false => self.name.clone(),
        };
        let inc = Incarnation::restore(&plan, &self.ctx, self.report(), &snapshot, &hostname).await?;
        self.keep_pins(&inc).await;
        {
            // From now on the disk moves on from the snapshot's: a later VM boots.
            let mut state = self.state.lock().unwrap();
            if let Some(s) = &mut state.record.snapshot {
                s.resumes = false;
            }
        }
        self.persist();
        Ok(Arc::new(inc))
    }

    /// Pauses the running session into a snapshot in its storage and stops it (see
    /// [`super::snapshot`]); [`super::SessionManager::resume`] restores it. Processes get their
    /// exit event now, saying so; in the guest the agent ends them at the restore, when their
    /// connections reset (detached ones run on). If the snapshot fails while the VM
    /// still answers, the session goes on running and the error says why; if the VM is lost,
    /// the session stops (shadow changes saved as on any stop, when the agent answers).
    pub async fn snapshot(self: &Arc<Self>) -> Result<(), SessionError> {
        self.touch();
        let _lifecycle = self.lifecycle.lock().await;
        if self.status() != SessionStatus::Ready {
            return Err(self.invalid_state("snapshot it"));
        }
        let Some(storage) = self.storage_dir() else {
            return Err(SessionError::Unsupported(format!(
                "session {:?} has no storage directory to keep a snapshot in",
                self.name
            )));
        };
        let inc = self.state.lock().unwrap().current.clone().ok_or_else(|| self.invalid_state("snapshot it"))?;
        let backend = inc.machine.lock().await.vm.backend;
        if !backend.can_snapshot() {
            return Err(SessionError::Unsupported(format!(
                "session {:?} runs on the {} backend, which cannot snapshot a VM: snapshots need the kvm \
                 backend (umbra-vmm)",
                self.name,
                backend.name()
            )));
        }
        // The supervisor stops first: the guest is paused while its memory is written.
        self.state.lock().unwrap().cancel.cancel();
        let text = "the session was paused into a snapshot; resume restores it".to_string();
        self.set_status(SessionStatus::Stopping, Some(text.clone()));
        inc.set_ending(Some(text.clone()));
        let settings = self.settings();
        match self.write_snapshot(&inc, &storage, &settings).await {
            Ok(info) => {
                let console = inc.end(&text, false).await;
                {
                    let mut state = self.state.lock().unwrap();
                    state.current = None;
                    state.last_console = console;
                    state.record.snapshot = Some(info);
                }
                self.set_status(SessionStatus::Stopped, Some(text));
                Ok(())
            }
            Err(e) => {
                tracing::warn!(session = %self.name, "snapshot failed: {e}");
                let alive = inc.check_alive().is_ok() && inc.heartbeat(Duration::from_secs(5)).await.is_ok();
                if alive {
                    inc.set_ending(None);
                    let cancel = CancellationToken::new();
                    self.state.lock().unwrap().cancel = cancel.clone();
                    self.set_status(SessionStatus::Ready, None);
                    tokio::spawn(self.clone().supervise(inc, cancel));
                } else {
                    let why = format!("the snapshot failed and the VM ended: {e}");
                    inc.export_shadows(&storage, &self.report(), None).await;
                    let console = inc.end(&why, false).await;
                    {
                        let mut state = self.state.lock().unwrap();
                        state.current = None;
                        state.last_console = console;
                    }
                    self.set_status(SessionStatus::Stopped, Some(why));
                }
                Err(e)
            }
        }
    }

    /// The VM's state, memory, disk and folder table into `<storage>/snapshot`.
    async fn write_snapshot(
        &self,
        inc: &Incarnation,
        storage: &Path,
        settings: &SessionSettings,
    ) -> Result<umbra_api::session::SnapshotInfo, SessionError> {
        let pending = PendingSnapshot::begin(storage)?;
        let mut machine = inc.machine.lock().await;
        let folders = machine.folders.saved();
        let folder_sharing = machine.vm.shares_folders();
        let taken = machine
            .vm
            .snapshot(&pending.vm_dir())
            .await
            .map_err(|source| SessionError::Snapshot { name: self.name.clone(), source })?;
        drop(machine);
        let disk = storage.join(super::DISK_FILE);
        let has_disk = settings.disk_size_mib > 0 && disk.is_file();
        if has_disk {
            let to = pending.disk();
            tokio::task::spawn_blocking(move || crate::backend::disk::copy_sparse(&disk, &to))
                .await
                .map_err(SessionError::task("the disk copy"))?
                .map_err(|source| SessionError::Snapshot { name: self.name.clone(), source })?;
        }
        let meta = SnapshotMeta {
            version: super::snapshot::META_VERSION,
            session: self.name.clone(),
            hostname: inc.hostname.clone(),
            taken_ms: umbra_api::event::now_ms(),
            bundle: inc.bundle.clone(),
            bundle_version: inc.info.bundle_version.clone(),
            cpus: settings.cpus,
            memory_mib: settings.memory_mib,
            folder_sharing,
            disk: has_disk,
            memory_bytes: taken.memory_bytes,
            pause_ms: taken.took.as_millis() as u64,
            pause_phases: taken.phases.clone(),
            folders,
        };
        let meta = tokio::task::spawn_blocking(move || pending.commit(&meta).map(|_| meta))
            .await
            .map_err(SessionError::task("writing the snapshot"))??;
        tracing::info!(session = %self.name, took_ms = taken.took.as_millis() as u64, "snapshot taken");
        Ok(meta.info(true))
    }

    /// Gives `dest` (a new fork's storage) this session's snapshot, by hard links, while no
    /// snapshot of this session can replace it; with its outputs and uploads copied.
    /// `just_taken`: the caller snapshotted this session for the fork; otherwise its snapshot
    /// must still be the one it resumes from, as a session that ran on after its restore has
    /// outputs and a disk newer than the snapshot's memory.
    pub(super) async fn fork_into(
        &self,
        dest: &Path,
        just_taken: bool,
    ) -> Result<umbra_api::session::SnapshotInfo, SessionError> {
        let _lifecycle = self.lifecycle.lock().await;
        let Some(storage) = self.storage_dir() else {
            return Err(SessionError::Unsupported(format!("session {:?} has no storage", self.name)));
        };
        match self.state.lock().unwrap().record.snapshot.as_ref().map(|s| s.resumes) {
            None => return Err(self.invalid_state("fork it: it has no snapshot (fork it while it runs, or take one)")),
            Some(false) if !just_taken => {
                return Err(self.invalid_state(
                    "fork it from its snapshot: it ran on after the snapshot was restored, so the snapshot is \
                     older than its disk and outputs; a fork of the running session takes a new one",
                ))
            }
            Some(_) => {}
        }
        let dest = dest.to_path_buf();
        tokio::task::spawn_blocking(move || {
            let meta = super::snapshot::link(&storage, &dest)?;
            // The guest writes these trees (and may still, if the source runs): they are
            // copied beneath-only, following no symlink, within the guest-tree bounds.
            for dir in [crate::share::paths::OUTPUTS, crate::share::paths::UPLOADS] {
                let src = storage.join(dir);
                if src.is_dir() {
                    let what = || format!("copy {} into the fork", src.display());
                    let root = tree::open_root(&src).map_err(|source| SessionError::Tree { what: what(), source })?;
                    tree::copy(&root, &src, &dest.join(dir), tree::TreeLimits::GUEST_TREE)
                        .map_err(|source| SessionError::Tree { what: what(), source })?;
                }
            }
            Ok(meta.info(true))
        })
        .await
        .map_err(SessionError::task("the fork's copy"))?
    }

    /// Deletes a stopped or failed session's snapshot, so its next start boots from its disk.
    pub(super) async fn discard_snapshot(&self) -> Result<(), SessionError> {
        let _lifecycle = self.lifecycle.lock().await;
        if self.status().is_active() {
            return Err(self.invalid_state("discard its snapshot (stop it first)"));
        }
        if self.state.lock().unwrap().record.snapshot.take().is_none() {
            return Ok(());
        }
        self.persist();
        if let Some(storage) = self.storage_dir() {
            let dir = storage.join(super::snapshot::SNAPSHOT_DIR);
            if dir.exists() {
                std::fs::remove_dir_all(&dir).map_err(SessionError::io(format!("remove {}", dir.display())))?;
            }
        }
        tracing::info!(session = %self.name, "snapshot discarded");
        Ok(())
    }

    /// The record a fork of this session starts with: its settings and folders (which must
    /// be what they were when this session first shared them).
    pub(super) fn fork_record(&self, name: &str) -> SessionRecord {
        let state = self.state.lock().unwrap();
        let mut record = SessionRecord::new(name, state.record.settings.clone(), state.record.folders.clone());
        record.pinned = state.record.pinned.clone();
        record
    }

    /// Records what the folders the VM shares are, for the session's next VM.
    async fn keep_pins(&self, inc: &Incarnation) {
        let pins = inc.machine.lock().await.folders.pins().clone();
        let changed = {
            let mut state = self.state.lock().unwrap();
            let changed = state.record.pinned != pins;
            state.record.pinned = pins;
            changed
        };
        if changed {
            self.persist();
        }
    }

    /// A fork's snapshot, once linked into its storage: its first start restores it.
    pub(super) fn set_snapshot(&self, snapshot: umbra_api::session::SnapshotInfo) {
        self.state.lock().unwrap().record.snapshot = Some(snapshot);
        self.persist();
    }

    /// Makes `inc` the running VM, announces it, and starts its supervisor.
    fn install(self: &Arc<Self>, inc: Arc<Incarnation>, cancel: CancellationToken) {
        self.state.lock().unwrap().current = Some(inc.clone());
        self.touch();
        self.emit(EventKind::Ready {
            backend: inc.info.backend.clone(),
            why: inc.info.backend_reason.clone(),
            boot_ms: inc.info.boot_ms,
            bundle: inc.info.bundle_version.clone(),
        });
        self.set_status(SessionStatus::Ready, None);
        tokio::spawn(self.clone().supervise(inc, cancel));
    }

    /// Watches one VM until it fails, the session idles out, or a stop cancels it.
    async fn supervise(self: Arc<Self>, inc: Arc<Incarnation>, cancel: CancellationToken) {
        let settings = self.settings();
        let heartbeat_timeout = Duration::from_secs(settings.heartbeat_timeout_secs);
        let idle_timeout = Duration::from_secs(settings.idle_timeout_secs);
        let mut alive = tokio::time::interval(ALIVE_EVERY);
        let mut heartbeat = tokio::time::interval(Duration::from_secs(settings.heartbeat_interval_secs));
        heartbeat.tick().await; // the first tick is immediate; the boot just proved the agent
        let failure = loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = alive.tick() => {
                    if let Err(f) = inc.check_alive() {
                        break f;
                    }
                    if !idle_timeout.is_zero() && self.idle_for() >= idle_timeout {
                        let idle_secs = idle_timeout.as_secs();
                        let me = self.clone();
                        // A separate task: the stop cancels this one.
                        tokio::spawn(async move {
                            me.emit(EventKind::IdleStop { idle_secs });
                            let _ = me.stop(StopReason::Idle).await;
                        });
                        return;
                    }
                }
                _ = heartbeat.tick() => {
                    if let Err(f) = inc.heartbeat(heartbeat_timeout).await {
                        break f;
                    }
                }
            }
        };
        if !cancel.is_cancelled() {
            self.recover(inc, failure, cancel).await;
        }
    }

    /// How long the session has been idle: zero while a process runs.
    fn idle_for(&self) -> Duration {
        if !self.state.lock().unwrap().processes.is_empty() {
            return Duration::ZERO;
        }
        self.last_activity.lock().unwrap().elapsed()
    }

    /// After a failure: ends the VM (its processes learn why), saves unapplied shadow changes if
    /// the agent still answers, and boots again with back-off, until the restart budget is
    /// spent and the session is `failed`.
    async fn recover(self: Arc<Self>, failed: Arc<Incarnation>, failure: Failure, cancel: CancellationToken) {
        let _lifecycle = tokio::select! {
            guard = self.lifecycle.lock() => guard,
            _ = cancel.cancelled() => return,
        };
        if cancel.is_cancelled() || self.status() != SessionStatus::Ready {
            return;
        }
        let Failure { mut reason, mut console } = failure;
        tracing::warn!(session = %self.name, "the VM failed: {reason}");
        self.emit(EventKind::HeartbeatFailure { reason: reason.clone() });
        self.set_status(SessionStatus::Restarting, Some(reason.clone()));
        if let Some(dir) = self.storage_dir() {
            failed.export_shadows(&dir, &self.report(), None).await;
        }
        let tail = failed.end(&format!("the session's VM failed ({reason}) and was restarted"), false).await;
        if console.is_empty() {
            console = tail;
        }
        {
            let mut state = self.state.lock().unwrap();
            state.current = None;
            state.last_console = console.clone();
        }
        drop(failed);
        let config = self.ctx.config();
        let window = Duration::from_secs(config.restart_window_secs);
        loop {
            let attempt = {
                let mut state = self.state.lock().unwrap();
                let now = Instant::now();
                state.failures.push_back(now);
                while state.failures.front().is_some_and(|t| now.duration_since(*t) > window) {
                    state.failures.pop_front();
                }
                state.failures.len() as u32
            };
            if attempt > config.max_restarts {
                let why = format!(
                    "{reason} ({} failure(s) within {}s; giving up after {} restart(s))",
                    attempt,
                    window.as_secs(),
                    config.max_restarts
                );
                self.emit(EventKind::Failed { reason: why.clone(), console });
                self.set_status(SessionStatus::Failed, Some(why));
                return;
            }
            let delay = RESTART_BASE.saturating_mul(1 << (attempt - 1).min(5)).min(RESTART_MAX);
            self.emit(EventKind::Restarting { attempt, reason: reason.clone(), delay_ms: delay.as_millis() as u64 });
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = cancel.cancelled() => return,
            }
            let booted = tokio::select! {
                r = self.boot_incarnation() => r,
                _ = cancel.cancelled() => return,
            };
            match booted {
                Ok(inc) => {
                    self.state.lock().unwrap().restarts += 1;
                    self.install(inc, cancel);
                    return;
                }
                Err(e) => {
                    self.emit(EventKind::StartupError { error: ApiError::new(e.code(), e.to_string()) });
                    reason = e.to_string();
                    console = String::new();
                }
            }
        }
    }

    /// Waits until the session is ready; an error if it fails or stops instead.
    pub async fn wait_ready(&self) -> Result<(), SessionError> {
        let mut rx = self.status.subscribe();
        loop {
            let status = *rx.borrow_and_update();
            match status {
                SessionStatus::Ready => return Ok(()),
                SessionStatus::Failed | SessionStatus::Stopped | SessionStatus::Stopping => {
                    let reason = self.state.lock().unwrap().record.last_error.clone();
                    return Err(SessionError::Failed {
                        name: self.name.clone(),
                        reason: reason.unwrap_or_else(|| format!("it is {status}")),
                    });
                }
                SessionStatus::Starting | SessionStatus::Restarting => {}
            }
            if rx.changed().await.is_err() {
                return Err(self.invalid_state("wait for it"));
            }
        }
    }

    /// Ends every process and the VM; folders, outputs and the disk stay. Idempotent.
    pub async fn stop(self: &Arc<Self>, why: StopReason) -> Result<(), SessionError> {
        let cancel = self.state.lock().unwrap().cancel.clone();
        cancel.cancel();
        let _lifecycle = self.lifecycle.lock().await;
        if matches!(self.status(), SessionStatus::Stopped | SessionStatus::Failed) {
            return Ok(());
        }
        let text = match why {
            StopReason::Requested => "the session was stopped".to_string(),
            StopReason::Idle => format!("the session stopped after {} s idle", self.settings().idle_timeout_secs),
            StopReason::Shutdown => "the session was stopped because its owner shut down".to_string(),
        };
        self.set_status(SessionStatus::Stopping, Some(text.clone()));
        let current = self.state.lock().unwrap().current.take();
        if let Some(inc) = current {
            // Shadow changes live in the guest: save them before the VM goes.
            if let Some(dir) = self.storage_dir() {
                inc.export_shadows(&dir, &self.report(), None).await;
            }
            let console = inc.end(&text, true).await;
            self.state.lock().unwrap().last_console = console;
        }
        self.set_status(SessionStatus::Stopped, Some(text));
        Ok(())
    }

    fn invalid_state(&self, what: &'static str) -> SessionError {
        SessionError::InvalidState { name: self.name.clone(), status: self.status(), what }
    }

    /// The running VM; waits while the session starts or restarts.
    async fn running(&self, what: &'static str) -> Result<Arc<Incarnation>, SessionError> {
        match self.status() {
            SessionStatus::Ready | SessionStatus::Starting | SessionStatus::Restarting => {}
            _ => return Err(self.invalid_state(what)),
        }
        self.wait_ready().await?;
        self.state.lock().unwrap().current.clone().ok_or_else(|| self.invalid_state(what))
    }

    // ---- processes ------------------------------------------------------------------------

    /// Starts a process; returns once the guest confirmed it (or refused: a missing command is
    /// [`umbra_api::ErrorCode::NotFound`]).
    pub async fn spawn(self: &Arc<Self>, req: ExecRequest) -> Result<Exec, SessionError> {
        self.touch();
        if req.argv.is_empty() || req.argv[0].is_empty() {
            return Err(SessionError::InvalidArgument("argv must name a command".into()));
        }
        let approval = self.state.lock().unwrap().record.settings.approval.clone();
        if let Some(settings) = approval {
            let inc = self.running("run a process").await?;
            let workspace = inc
                .folder_infos
                .lock()
                .unwrap()
                .iter()
                .filter(|f| f.name != crate::share::paths::UPLOADS)
                .map(|f| std::path::PathBuf::from(&f.guest_path))
                .collect();
            let request = umbra_policy::approval::CommandRequest {
                command: super::approval::command_line(&req.argv),
                cwd: req.cwd.clone().unwrap_or_else(|| "/".into()).into(),
                workspace,
                session: Some(self.name.clone()),
                env: req.env.clone(),
            };
            self.ctx.approvals.check(&settings, request, |kind| self.emit(kind)).await?;
        }
        let inc = self.running("run a process").await?;
        let spawn = umbra_proto::SpawnRequest {
            argv: req.argv.clone(),
            cwd: req.cwd.clone(),
            env: req.env.clone(),
            uid: None,
            gid: None,
            tty: req.tty,
        };
        let mut process = inc.agent.spawn(spawn)?;
        let id = self.ctx.next_process_id();
        let pid = match process.next_event().await {
            Some(crate::agent::ProcessEvent::Spawned { pid }) => pid,
            Some(crate::agent::ProcessEvent::SpawnFailed(e)) => {
                let error = SessionError::Agent(crate::agent::ClientError::Agent(e));
                self.emit(EventKind::SpawnFailed {
                    process: id,
                    error: ApiError::new(error.code(), error.to_string()),
                });
                return Err(error);
            }
            Some(crate::agent::ProcessEvent::Error(msg)) => {
                return Err(SessionError::Agent(crate::agent::ClientError::ConnectionLost(msg)))
            }
            _ => return Err(SessionError::Agent(crate::agent::ClientError::ConnectionLost("no spawn reply".into()))),
        };
        let weak = Arc::downgrade(self);
        let ctx = PumpContext {
            session: self.name.clone(),
            bus: self.ctx.bus.clone(),
            ended: inc.ended_receiver(),
            on_exit: Box::new(move || {
                if let Some(me) = weak.upgrade() {
                    me.state.lock().unwrap().processes.remove(&id);
                    me.touch();
                }
            }),
        };
        let exec = exec::start(id, pid, req.argv, process, inc.agent.clone(), req.timeout, ctx);
        self.state.lock().unwrap().processes.insert(id, exec.control());
        Ok(exec)
    }

    /// A running process of this session.
    pub fn process(&self, id: u64) -> Result<ExecControl, SessionError> {
        self.touch();
        self.state.lock().unwrap().processes.get(&id).cloned().ok_or(SessionError::NoSuchProcess(id))
    }

    /// Signals every process of the session.
    pub async fn kill_all(&self, signal: i32) -> Result<(), SessionError> {
        self.touch();
        let inc = self.running("signal its processes").await?;
        Ok(inc.agent.kill_all(signal).await?)
    }

    /// Replaces the network policy: new connections of the running VM follow it at once (open
    /// ones are not cut), and it is kept for restarts and resumes. It can only move within the
    /// session's merged policy (the daemon's configuration merged with the start's): when that
    /// policy says something about the network, a policy allowing more — a wider mode, a domain
    /// or range it does not allow — is refused, naming the ceiling, and nothing changes.
    pub fn set_network(&self, policy: umbra_api::session::NetworkPolicy) -> Result<(), SessionError> {
        self.touch();
        policy.validate().map_err(SessionError::InvalidArgument)?;
        let mut state = self.state.lock().unwrap();
        if let Some(ceiling) = &state.record.settings.policy.network {
            if let Some(excess) = umbra_policy::network_excess(&policy, ceiling) {
                return Err(SessionError::BeyondPolicy {
                    name: self.name.clone(),
                    wanted: format!("network {}", umbra_policy::describe_network(&policy)),
                    ceiling: format!("network {}", umbra_policy::describe_network(ceiling)),
                    excess,
                });
            }
        }
        // Under the state lock: two concurrent changes land in one order, record and proxy alike.
        *self.network.write().unwrap() = crate::egress::Policy::new(&policy);
        state.record.settings.network = policy;
        drop(state);
        self.persist();
        Ok(())
    }

    // ---- folders --------------------------------------------------------------------------

    /// Shares another host folder with the running session; it is shared again after a
    /// restart or resume.
    pub async fn mount(self: &Arc<Self>, spec: FolderSpec) -> Result<FolderInfo, SessionError> {
        self.touch();
        let inc = self.running("mount a folder").await?;
        let mut machine = inc.machine.lock().await;
        let machine = &mut *machine;
        machine.folders.share(&mut machine.vm, &self.name, &spec.path, spec.name.as_deref(), spec.mode).await?;
        let info = machine.folders.list().last().expect("just shared").info();
        {
            // The user's folders come before the session's own (outputs, uploads).
            let mut infos = inc.folder_infos.lock().unwrap();
            let at = infos.iter().position(|f| f.name == crate::share::paths::OUTPUTS).unwrap_or(infos.len());
            infos.insert(at, info.clone());
        }
        {
            let mut state = self.state.lock().unwrap();
            // Record the canonical path and the name it got, so a restart mounts the same.
            state.record.folders.push(FolderSpec {
                path: info.host_path.clone(),
                name: Some(info.name.clone()),
                mode: spec.mode,
            });
            state.record.pinned = machine.folders.pins().clone();
        }
        self.persist();
        self.emit(folder_mounted(&info));
        Ok(info)
    }

    pub async fn unmount(self: &Arc<Self>, name: &str) -> Result<(), SessionError> {
        self.touch();
        if name == crate::share::paths::OUTPUTS || name == crate::share::paths::UPLOADS {
            return Err(SessionError::InvalidArgument(format!("{name} is the session's own folder")));
        }
        let inc = self.running("unmount a folder").await?;
        if let Some(dir) = self.storage_dir() {
            // A shadow folder's unapplied changes would vanish with it: saved first.
            inc.export_shadows(&dir, &self.report(), Some(name)).await;
        }
        let mut machine = inc.machine.lock().await;
        let machine = &mut *machine;
        machine.folders.unshare(&mut machine.vm, name).await?;
        inc.folder_infos.lock().unwrap().retain(|f| f.name != name);
        {
            let mut state = self.state.lock().unwrap();
            state.record.folders.retain(|f| f.name.as_deref() != Some(name) && !default_name_is(&f.path, name));
        }
        self.persist();
        self.emit(EventKind::FolderUnmounted { name: name.into() });
        Ok(())
    }

    // ---- files ----------------------------------------------------------------------------

    /// A client's path as a guest path. Either way it must be absolute, without `..` or NUL;
    /// with `host` it is a host path that must lie inside one of the session's shared folders
    /// and is translated to that folder's guest path.
    fn guest_path(&self, inc: &Incarnation, path: &str, host: bool) -> Result<String, SessionError> {
        let bad = |why: &str| Err(SessionError::InvalidArgument(format!("path {path:?} {why}")));
        if path.contains('\0') {
            return bad("contains a NUL byte");
        }
        let p = Path::new(path);
        if !p.is_absolute() {
            return bad("is not absolute");
        }
        if p.components().any(|c| matches!(c, Component::ParentDir)) {
            return bad("contains a `..` component");
        }
        if !host {
            return Ok(path.to_string());
        }
        for f in inc.folder_infos.lock().unwrap().iter() {
            if let Ok(rel) = p.strip_prefix(&f.host_path) {
                let rel = rel.to_string_lossy();
                return Ok(if rel.is_empty() { f.guest_path.clone() } else { format!("{}/{rel}", f.guest_path) });
            }
        }
        Err(crate::share::paths::PathError::NotShared(path.to_string()).into())
    }

    /// Reads up to `len` bytes at `offset` (see [`Session::guest_path`] for `path` and `host`).
    pub async fn read_file(
        &self,
        path: &str,
        host: bool,
        offset: u64,
        len: u32,
    ) -> Result<(bytes::Bytes, bool), SessionError> {
        self.touch();
        let inc = self.running("read a file").await?;
        let guest = self.guest_path(&inc, path, host)?;
        Ok(inc.agent.read_file(&guest, offset, len.min(umbra_proto::MAX_FILE_CHUNK as u32)).await?)
    }

    pub async fn write_file(
        &self,
        path: &str,
        host: bool,
        data: &[u8],
        mode: WriteMode,
        create_dirs: bool,
        permissions: Option<u32>,
    ) -> Result<u64, SessionError> {
        self.touch();
        let inc = self.running("write a file").await?;
        let guest = self.guest_path(&inc, path, host)?;
        let request = WriteFileRequest { path: guest, mode, permissions, create_dirs };
        Ok(inc.agent.write_file(request, data).await?)
    }

    pub async fn stat(&self, path: &str, host: bool) -> Result<FileStat, SessionError> {
        self.touch();
        let inc = self.running("stat a file").await?;
        let guest = self.guest_path(&inc, path, host)?;
        Ok(inc.agent.stat(&guest).await?)
    }

    pub async fn list_dir(
        &self,
        path: &str,
        host: bool,
        limit: Option<u32>,
    ) -> Result<(Vec<DirEntry>, bool), SessionError> {
        self.touch();
        let inc = self.running("list a directory").await?;
        let guest = self.guest_path(&inc, path, host)?;
        Ok(inc.agent.list_dir(&guest, limit).await?)
    }

    // ---- shadow folders -------------------------------------------------------------------

    /// What the guest changed in shadow folder `folder`, captured on the host as a change-set
    /// (the folder's latest, replacing any earlier one).
    pub async fn shadow_diff(&self, folder: &str) -> Result<ShadowDiffResult, SessionError> {
        self.touch();
        let inc = self.running("diff a shadow folder").await?;
        let mut machine = inc.machine.lock().await;
        let machine = &mut *machine;
        Ok(machine.folders.shadow_diff(&machine.vm, folder).await?)
    }

    /// Applies change-set `changeset` (required) of shadow folder `folder`, all of it that
    /// applies by default or only `paths`: exactly the bytes its diff captured.
    pub async fn shadow_apply(
        &self,
        folder: &str,
        changeset: Option<&str>,
        paths: Option<&[String]>,
    ) -> Result<ShadowApplyReport, SessionError> {
        self.touch();
        let inc = self.running("apply a shadow folder").await?;
        let machine = inc.machine.lock().await;
        let report = machine.folders.shadow_apply(folder, changeset, paths)?;
        Ok(ShadowApplyReport {
            applied: report.applied,
            conflicts: report
                .conflicts
                .into_iter()
                .map(|c| umbra_api::event::ShadowConflict { path: c.path, reason: c.reason.to_string() })
                .collect(),
            errors: report
                .errors
                .into_iter()
                .map(|e| umbra_api::event::ShadowApplyError { path: e.path, message: e.error.to_string() })
                .collect(),
            skipped: report
                .skipped
                .into_iter()
                .map(|s| umbra_api::event::ShadowSkipped { path: s.path, reason: s.reason })
                .collect(),
        })
    }

    /// Writes a shadow folder's changes as a tar to `dest`; returns its size.
    pub async fn shadow_export(&self, folder: &str, dest: &Path) -> Result<u64, SessionError> {
        self.touch();
        let inc = self.running("export a shadow folder").await?;
        let machine = inc.machine.lock().await;
        let tmp = dest.with_extension("tar.part");
        let file = std::fs::File::create(&tmp).map_err(SessionError::io(format!("create {}", tmp.display())))?;
        let written = machine.folders.shadow_export(&machine.vm, folder, file).await;
        let file = match written {
            Ok(f) => f,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(e.into());
            }
        };
        file.sync_all().map_err(SessionError::io(format!("write {}", tmp.display())))?;
        std::fs::rename(&tmp, dest).map_err(SessionError::io(format!("rename to {}", dest.display())))?;
        Ok(std::fs::metadata(dest).map(|m| m.len()).unwrap_or(0))
    }

    pub async fn shadow_reset(&self, folder: &str) -> Result<(), SessionError> {
        self.touch();
        let inc = self.running("reset a shadow folder").await?;
        let mut machine = inc.machine.lock().await;
        let machine = &mut *machine;
        Ok(machine.folders.shadow_reset(&machine.vm, folder).await?)
    }

    /// The lines of the console the error context uses.
    pub const CONSOLE_LINES: usize = ERROR_CONTEXT_LINES;
}

/// Whether a folder recorded without a name got `name` by default.
fn default_name_is(path: &Path, name: &str) -> bool {
    crate::share::paths::default_folder_name(path).is_ok_and(|n| n == name)
}

/// Checks a session name before anything is created for it.
pub(super) fn check_name(name: &str) -> Result<(), SessionError> {
    validate_session_name(name).map_err(|e| SessionError::InvalidArgument(e.to_string()))
}
