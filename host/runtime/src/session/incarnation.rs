//! One VM of a session, from boot to its end: the boot sequence (bundle, backend, a boot slot,
//! the session disk, launch, folders, the outputs watcher), the checks that notice it failing,
//! and its teardown. A session has at most one incarnation at a time; a restart is a new one
//! with the same folders, disk and settings.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use umbra_api::{EventKind, FolderInfo, FolderSpec, SessionSettings, VmInfo};

use super::context::Context;
use super::error::SessionError;
use super::outputs::{OutputsChange, OutputsWatcher};
use crate::agent::AgentClient;
use crate::backend::{select, Vm, VmError, VmSpec};
use crate::share::paths::OUTPUTS;
use crate::share::{FolderPolicy, SharedFolders};

/// Where a session's writable disk lives in its storage directory.
pub const DISK_FILE: &str = "disk.img";

/// Reports boot progress (queued, folders mounted, outputs changes) as events of the session.
pub(super) type Report = Arc<dyn Fn(EventKind) + Send + Sync>;

/// What to boot.
pub(super) struct BootPlan {
    pub session: String,
    pub settings: SessionSettings,
    pub folders: Vec<FolderSpec>,
    /// The session's own storage (outputs, uploads, disk), if it has one.
    pub storage_dir: Option<PathBuf>,
    pub boot_timeout: Duration,
    /// The session's network policy, which the session may replace while the VM runs.
    pub network: crate::egress::SharedPolicy,
}

/// The VM and the folders shared with it, changed together.
pub(super) struct Machine {
    pub vm: Vm,
    pub folders: SharedFolders,
}

pub(super) struct Incarnation {
    pub machine: tokio::sync::Mutex<Machine>,
    pub agent: AgentClient,
    pub info: VmInfo,
    /// The folders as clients see them (readable without waiting for `machine`).
    pub folder_infos: Mutex<Vec<FolderInfo>>,
    /// Why this VM ended, once it has: processes that lose their connection report it.
    ended: watch::Sender<Option<String>>,
    _outputs: Option<OutputsWatcher>,
    /// Carries the guest's connections (dropped, and every connection with it, at the end).
    _egress: crate::egress::EgressProxy,
}

/// Why a VM failed, as the supervisor saw it.
pub(super) struct Failure {
    pub reason: String,
    pub console: String,
}

impl Incarnation {
    /// Boots `plan`: resolves the bundle, waits for a boot slot, prepares the disk, launches the
    /// VM and shares every folder. The boot timeout counts from the slot, not from the queue.
    pub async fn boot(plan: &BootPlan, ctx: &Context, report: Report) -> Result<Incarnation, SessionError> {
        let spec = plan.settings.bundle.clone();
        let store = ctx.bundles.clone();
        let resolved = tokio::task::spawn_blocking(move || crate::image::resolve(&spec, &store))
            .await
            .map_err(|e| SessionError::InvalidArgument(format!("bundle resolution panicked: {e}")))??;
        let (backend, why) = select::choose(plan.settings.backend, resolved.image.arch)
            .map_err(|source| SessionError::Boot { name: plan.session.clone(), source })?;

        let disk_path = match (&plan.storage_dir, plan.settings.disk_size_mib) {
            (Some(dir), size) if size > 0 => Some(dir.join(DISK_FILE)),
            _ => None,
        };
        // Only a session with storage can take a pooled VM: those boot with folder sharing.
        let key = super::pool::key_of(&resolved.image, backend, &plan.settings);
        let warm = match plan.storage_dir {
            Some(_) => ctx.pool.take(&key, disk_path.as_deref()).await,
            None => None,
        };
        let from_pool = warm.is_some();
        let policy = plan.settings.policy.effective();
        let mut vm = match warm {
            Some(warm) => warm.vm,
            None => Self::launch(plan, ctx, &report, resolved.image.clone(), backend, disk_path).await?,
        };
        // Guest connections to host port 1026 arrive on `<vsock socket>_1026`.
        let egress_socket = crate::backend::vsock_port_socket(vm.run_dir(), umbra_proto::egress::EGRESS_VSOCK_PORT);
        let egress_report = report.clone();
        let egress = crate::egress::EgressProxy::start(
            &egress_socket,
            plan.network.clone(),
            std::sync::Arc::new(move |kind| egress_report(kind)),
            crate::egress::EgressLimits::default(),
        )
        .map_err(SessionError::io(format!("listen on {}", egress_socket.display())))?;

        let mut folders = SharedFolders::with_policy(FolderPolicy::from_policy(&policy));
        let mut infos = Vec::new();
        for f in &plan.folders {
            folders.share(&mut vm, &plan.session, &f.path, f.name.as_deref(), f.mode).await?;
            let info = folders.list().last().expect("just shared").info();
            report(folder_mounted(&info));
            infos.push(info);
        }
        let extras = policy.additional_readwrite_paths.iter().map(|p| (p, false));
        for (path, read_only) in extras.chain(policy.additional_readonly_paths.iter().map(|p| (p, true))) {
            folders.share_extra(&mut vm, &plan.session, path, read_only).await?;
            let info = folders.list().last().expect("just shared").info();
            report(folder_mounted(&info));
            infos.push(info);
        }
        if policy.disable_tmp_write {
            folders.readonly_tmp(&mut vm, &plan.session).await?;
        }
        let first_session_dir = folders.list().len();
        let mut outputs = None;
        if let Some(dir) = &plan.storage_dir {
            folders.share_session_dirs(&mut vm, &plan.session, dir).await?;
            for shared in &folders.list()[first_session_dir..] {
                let info = shared.info();
                report(folder_mounted(&info));
                infos.push(info);
            }
            let watch_report = report.clone();
            let watcher = OutputsWatcher::start(&dir.join(OUTPUTS), move |change| {
                watch_report(match change {
                    OutputsChange::Created { path, host_path } => EventKind::OutputsFileCreated { path, host_path },
                    OutputsChange::Deleted { path, host_path } => EventKind::OutputsFileDeleted { path, host_path },
                })
            });
            match watcher {
                Ok(w) => outputs = Some(w),
                // Sessions work without it; the app just hears of outputs later.
                Err(e) => tracing::warn!("session {}: cannot watch its outputs folder: {e}", plan.session),
            }
        }
        let info = VmInfo {
            backend: backend.name().into(),
            backend_reason: why,
            bundle_version: resolved.image.version.clone(),
            boot_ms: vm.boot_time.as_millis() as u64,
            pids: vm.pids(),
            run_dir: vm.run_dir().to_path_buf(),
            from_pool,
        };
        let agent = vm.agent().clone();
        let (ended, _) = watch::channel(None);
        Ok(Incarnation {
            machine: tokio::sync::Mutex::new(Machine { vm, folders }),
            agent,
            info,
            folder_infos: Mutex::new(infos),
            ended,
            _outputs: outputs,
            _egress: egress,
        })
    }

    /// Launches a fresh VM for `plan` in a boot slot, with its session disk at `disk`.
    async fn launch(
        plan: &BootPlan,
        ctx: &Context,
        report: &Report,
        image: crate::backend::BootImage,
        backend: crate::backend::BackendKind,
        disk: Option<PathBuf>,
    ) -> Result<Vm, SessionError> {
        let slot = ctx.admission.enter(|position| report(EventKind::BootQueued { position })).await;
        if let (Some(path), Some(dir)) = (&disk, &plan.storage_dir) {
            std::fs::create_dir_all(dir).map_err(SessionError::io(format!("create {}", dir.display())))?;
            let (p, bytes) = (path.clone(), plan.settings.disk_size_mib << 20);
            tokio::task::spawn_blocking(move || crate::backend::disk::ensure_session_disk(&p, bytes))
                .await
                .map_err(|e| SessionError::InvalidArgument(format!("disk preparation panicked: {e}")))?
                .map_err(|source| SessionError::Boot { name: plan.session.clone(), source })?;
        }
        let mut vm_spec = VmSpec::new(image);
        vm_spec.cpus = plan.settings.cpus;
        vm_spec.memory_mib = plan.settings.memory_mib;
        vm_spec.boot_timeout = plan.boot_timeout;
        let policy = plan.settings.policy.effective();
        vm_spec.folder_sharing = plan.storage_dir.is_some()
            || !plan.folders.is_empty()
            || policy.disable_tmp_write
            || !policy.additional_readonly_paths.is_empty()
            || !policy.additional_readwrite_paths.is_empty();
        vm_spec.disk = disk;
        let vm = Vm::launch(backend, &vm_spec)
            .await
            .map_err(|source| SessionError::Boot { name: plan.session.clone(), source })?;
        drop(slot);
        Ok(vm)
    }

    /// Tells processes why their connection is about to drop.
    pub fn ended_receiver(&self) -> watch::Receiver<Option<String>> {
        self.ended.subscribe()
    }

    /// Whether the VM's processes are all alive; the failure if not. Skipped (Ok) while another
    /// task holds the machine: a long shadow apply must not look like a failure.
    pub fn check_alive(&self) -> Result<(), Failure> {
        let Ok(mut machine) = self.machine.try_lock() else { return Ok(()) };
        machine.vm.check_alive().map_err(failure)
    }

    /// One heartbeat: the agent must answer a ping within `timeout`. When it does not, the
    /// failure names the VM's own end if it ended meanwhile (a panic says more than a timeout).
    pub async fn heartbeat(&self, timeout: Duration) -> Result<(), Failure> {
        let why = match tokio::time::timeout(timeout, self.agent.ping()).await {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => format!("the agent connection failed: {e}"),
            Err(_) => format!("the agent did not answer a heartbeat within {timeout:?}"),
        };
        let mut machine = self.machine.lock().await;
        match machine.vm.wait(Duration::from_secs(2)).await {
            Some(e) => Err(failure(e)),
            None => Err(Failure {
                reason: why,
                console: machine.vm.console_tail(crate::backend::console::ERROR_CONTEXT_LINES),
            }),
        }
    }

    /// Ends the VM: processes are told `reason` first, then the guest is asked to shut down
    /// (`graceful`) or killed. Returns the console's last lines.
    pub async fn end(&self, reason: &str, graceful: bool) -> String {
        self.ended.send_replace(Some(reason.to_string()));
        let mut machine = self.machine.lock().await;
        let console = machine.vm.console_tail(crate::backend::console::ERROR_CONTEXT_LINES);
        if graceful {
            machine.vm.shutdown_in_place().await;
        } else {
            machine.vm.kill();
        }
        console
    }

    /// Saves the unapplied changes of the shadow folders (all, or only `only`) as tars in `dir`,
    /// if the agent answers; reports what was saved and what could not be.
    pub async fn export_shadows(&self, dir: &std::path::Path, report: &Report, only: Option<&str>) {
        let machine = self.machine.lock().await;
        let shadows: Vec<String> = machine
            .folders
            .list()
            .iter()
            .filter(|s| s.mode == umbra_proto::ShareMode::Shadow && only.is_none_or(|o| o == s.name))
            .map(|s| s.name.clone())
            .collect();
        if shadows.is_empty() {
            return;
        }
        let answers = matches!(tokio::time::timeout(Duration::from_secs(2), self.agent.ping()).await, Ok(Ok(_)));
        for folder in shadows {
            if !answers {
                report(EventKind::ShadowLost { folder, reason: "the agent did not answer".into() });
                continue;
            }
            // Nothing to save is not worth a file (or an event).
            if let Ok(Ok(changes)) =
                tokio::time::timeout(Duration::from_secs(10), machine.folders.shadow_diff(&machine.vm, &folder)).await
            {
                if changes.is_empty() {
                    continue;
                }
            }
            let path = dir.join(format!("shadow-{folder}-{}.tar", umbra_api::event::now_ms()));
            let exported = async {
                std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
                let file = std::fs::File::create(&path).map_err(|e| e.to_string())?;
                machine.folders.shadow_export(&machine.vm, &folder, file).await.map_err(|e| e.to_string())
            };
            match tokio::time::timeout(Duration::from_secs(30), exported).await {
                Ok(Ok(_)) => report(EventKind::ShadowExported { folder, path }),
                Ok(Err(reason)) => {
                    let _ = std::fs::remove_file(&path);
                    report(EventKind::ShadowLost { folder, reason })
                }
                Err(_) => {
                    let _ = std::fs::remove_file(&path);
                    report(EventKind::ShadowLost { folder, reason: "the export took longer than 30 s".into() })
                }
            }
        }
    }
}

pub(super) fn folder_mounted(info: &FolderInfo) -> EventKind {
    EventKind::FolderMounted {
        name: info.name.clone(),
        host_path: info.host_path.clone(),
        guest_path: info.guest_path.clone(),
        mode: info.mode,
    }
}

fn failure(e: VmError) -> Failure {
    match e {
        VmError::GuestDied { reason, console } => Failure { reason, console },
        other => Failure { reason: other.to_string(), console: String::new() },
    }
}
