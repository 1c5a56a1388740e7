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
use super::launch::{Bundle, Disk, Prepared, BOOT_HOSTNAME};
use super::outputs::{OutputsChange, OutputsWatcher};
use super::snapshot::SessionSnapshot;
use crate::agent::AgentClient;
use crate::backend::{Restore, Vm, VmError};
use crate::share::paths::{OUTPUTS, READONLY_TMP, UPLOADS};
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
    /// The folders the session shared before, which must still be what they were.
    pub pins: crate::share::FolderPins,
    /// What the egress proxy needs to give the session's secrets to their hosts.
    pub broker: crate::egress::Broker,
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
    /// The bundle spec it booted from (a snapshot records it, to restore the same).
    pub bundle: String,
    /// The guest's hostname.
    pub hostname: String,
    /// The image config's defaults, when the bundle was converted from an OCI image.
    pub image: Option<umbra_bundle::ImageInfo>,
    /// The folders as clients see them (readable without waiting for `machine`).
    pub folder_infos: Mutex<Vec<FolderInfo>>,
    /// Why this VM ended, once it has: processes that lose their connection report it.
    ended: watch::Sender<Option<String>>,
    _outputs: Option<OutputsWatcher>,
    /// Carries the guest's connections (dropped, and every connection with it, at the end).
    _egress: crate::egress::EgressProxy,
    /// Opens streams to the guest's ports (exposed ports' connections).
    pub dialer: crate::backend::Dialer,
    /// Live forks begun and ended (odd while one holds the VM's devices): a heartbeat the
    /// agent missed across one is not a failure.
    pub forks: std::sync::atomic::AtomicU64,
}

/// Why a VM failed, as the supervisor saw it.
pub(super) struct Failure {
    pub reason: String,
    pub console: String,
}

impl BootPlan {
    /// The session's disk, when it has storage and a disk size.
    fn disk(&self) -> Disk {
        match (&self.storage_dir, self.settings.disk_size_mib) {
            (Some(dir), size_mib) if size_mib > 0 => Disk::Fresh { path: dir.join(DISK_FILE), size_mib },
            _ => Disk::None,
        }
    }
}

/// One folder a boot shares: a session folder, or a path the policy adds (read-only or not).
enum Ask<'a> {
    Folder(&'a FolderSpec),
    Extra(&'a std::path::PathBuf, bool),
}

/// Everything a boot shares with its VM. The VM gets a folder server exactly when this has
/// anything in it ([`Shares::any`]): one decision, used to launch and to share.
struct Shares<'a> {
    asks: Vec<Ask<'a>>,
    readonly_tmp: bool,
    session_dirs: Option<&'a std::path::Path>,
}

impl<'a> Shares<'a> {
    fn of(plan: &'a BootPlan, policy: &'a umbra_policy::EffectivePolicy) -> Self {
        let asks = plan
            .folders
            .iter()
            .map(Ask::Folder)
            .chain(policy.additional_readwrite_paths.iter().map(|p| Ask::Extra(p, false)))
            .chain(policy.additional_readonly_paths.iter().map(|p| Ask::Extra(p, true)))
            .collect();
        Self { asks, readonly_tmp: policy.disable_tmp_write, session_dirs: plan.storage_dir.as_deref() }
    }

    fn any(&self) -> bool {
        !self.asks.is_empty() || self.readonly_tmp || self.session_dirs.is_some()
    }
}

impl Incarnation {
    /// Boots `plan`: prepares the VM (bundle, backend, size), takes a pooled VM that fits or
    /// launches one in a boot slot, and shares every folder. The boot timeout counts from the
    /// slot, not from the queue.
    pub async fn boot(plan: &BootPlan, ctx: &Context, report: Report) -> Result<Incarnation, SessionError> {
        let policy = plan.settings.policy.effective();
        let shares = Shares::of(plan, &policy);
        let bundle = Bundle::Spec { spec: &plan.settings.bundle, promote: true };
        let prepared = Prepared::new(bundle, &ctx.bundles, plan.settings.backend, false)
            .await
            .map_err(SessionError::launch(&plan.session))?
            .size(plan.settings.cpus, plan.settings.memory_mib, plan.boot_timeout)
            .folder_sharing(shares.any());
        let (backend, why, version) = (prepared.backend, prepared.why.clone(), prepared.image.version.clone());
        let prepared_image = prepared.image.image.clone();
        let disk = plan.disk();
        // Only a session with storage can take a pooled VM: those boot with folder sharing.
        let key = super::pool::key_of(&prepared.image, backend, &plan.settings);
        let warm = match (&plan.storage_dir, &disk) {
            (Some(_), Disk::Fresh { path, .. }) => ctx.pool.take(&key, Some(path)).await,
            (Some(_), _) => ctx.pool.take(&key, None).await,
            (None, _) => None,
        };
        let from_pool = warm.is_some();
        let mut vm = match warm {
            Some(warm) => warm.vm,
            None => prepared
                .launch(&ctx.admission, |position| report(EventKind::BootQueued { position }), disk, None)
                .await
                .map_err(SessionError::launch(&plan.session))?,
        };
        let folder_policy = FolderPolicy::from_policy(&policy);
        let mut folders = SharedFolders::with_policy(folder_policy.clone()).with_pins(plan.pins.clone());
        // Read-only folders first: one nested in a writable folder is then pinned read-only
        // inside it before the guest can open anything there (the folder server refuses the
        // other order). Clients see them in the order they were asked for.
        let writable = |ask: &Ask| match ask {
            Ask::Folder(f) => folder_policy.workspace_mode(f.mode).host_writable(),
            Ask::Extra(_, read_only) => !read_only,
        };
        let mut order: Vec<usize> = (0..shares.asks.len()).collect();
        order.sort_by_key(|i| writable(&shares.asks[*i]));
        let mut shared_infos = Vec::new();
        for i in order {
            match &shares.asks[i] {
                Ask::Folder(f) => folders.share(&mut vm, &plan.session, &f.path, f.name.as_deref(), f.mode).await?,
                Ask::Extra(path, read_only) => folders.share_extra(&mut vm, &plan.session, path, *read_only).await?,
            };
            let info = folders.list().last().expect("just shared").info();
            report(folder_mounted(&info));
            shared_infos.push((i, info));
        }
        shared_infos.sort_by_key(|(i, _)| *i);
        let mut infos: Vec<FolderInfo> = shared_infos.into_iter().map(|(_, info)| info).collect();
        if shares.readonly_tmp {
            folders.readonly_tmp(&mut vm, &plan.session).await?;
        }
        if let Some(dir) = shares.session_dirs {
            let first_session_dir = folders.list().len();
            folders.share_session_dirs(&mut vm, &plan.session, dir).await?;
            for shared in &folders.list()[first_session_dir..] {
                let info = shared.info();
                report(folder_mounted(&info));
                infos.push(info);
            }
        }
        let info = VmInfo {
            backend: backend.name().into(),
            backend_reason: why,
            bundle_version: version,
            boot_ms: vm.boot_time.as_millis() as u64,
            pids: vm.pids(),
            run_dir: vm.run_dir().to_path_buf(),
            from_pool,
            host_memory_kib: None,
        };
        let names = (plan.settings.bundle.clone(), BOOT_HOSTNAME.to_string(), prepared_image);
        Self::attach(plan, report, Machine { vm, folders }, infos, info, names)
    }

    /// Restores `snapshot` for `plan` (a resume, or a fork's first start): a copy of the
    /// snapshot's disk becomes the session's disk, the folder server serves the snapshot's
    /// folders again (the session's own from its storage), and the guest, already mounting them,
    /// resumes under `hostname` with fresh entropy and this host's clock.
    pub async fn restore(
        plan: &BootPlan,
        ctx: &Context,
        report: Report,
        snapshot: &SessionSnapshot,
        hostname: &str,
    ) -> Result<Incarnation, SessionError> {
        let meta = &snapshot.meta;
        let Some(storage) = plan.storage_dir.clone() else {
            return Err(SessionError::Unsupported("a session without storage has no snapshot".into()));
        };
        // The bundle the snapshot booted: by its spec, or by its version if the spec has moved on.
        let bundle = Bundle::Snapshotted { spec: &meta.bundle, version: &meta.bundle_version };
        let prepared = Prepared::new(bundle, &ctx.bundles, plan.settings.backend, true)
            .await
            .map_err(SessionError::launch(&plan.session))?
            .size(meta.cpus, meta.memory_mib, plan.boot_timeout)
            .folder_sharing(meta.folder_sharing);
        let (backend, why, version) = (prepared.backend, prepared.why.clone(), prepared.image.version.clone());
        let prepared_image = prepared.image.image.clone();

        // The session's own folders come from its storage, a read-only `/tmp` from an empty
        // directory there; the user's folders are the snapshot's.
        let mut saved = meta.folders.clone();
        for f in &mut saved {
            if f.name == OUTPUTS || f.name == UPLOADS {
                f.host_path = storage.join(&f.name);
            } else if f.name == READONLY_TMP {
                f.host_path = storage.join(READONLY_TMP);
            }
            if f.name == READONLY_TMP || f.name == OUTPUTS || f.name == UPLOADS {
                std::fs::create_dir_all(&f.host_path)
                    .map_err(SessionError::io(format!("create {}", f.host_path.display())))?;
                if f.name == OUTPUTS {
                    crate::backend::fsd::give_to_share_owner(&f.host_path)
                        .map_err(SessionError::io(format!("chown {}", f.host_path.display())))?;
                }
                // The session's own storage, not the snapshotted session's.
                f.identity = None;
            } else {
                // The user's folders must still be what they were when first shared.
                f.identity = f.identity.or_else(|| plan.pins.get(&f.host_path).map(|p| p.identity));
            }
        }
        let policy = FolderPolicy::from_policy(&plan.settings.policy.effective());
        let folders = SharedFolders::restored(policy, saved).with_pins(plan.pins.clone());

        let disk = match meta.disk {
            true => Disk::CopyOf { from: snapshot.disk(), to: storage.join(DISK_FILE) },
            false => Disk::None,
        };
        let restore =
            Restore { snapshot: snapshot.vm_dir(), hostname: hostname.into(), folders: folders.server_folders() };
        let vm = prepared
            .launch(&ctx.admission, |position| report(EventKind::BootQueued { position }), disk, Some(restore))
            .await
            .map_err(SessionError::launch(&plan.session))?;
        let infos: Vec<FolderInfo> = folders.list().iter().map(|s| s.info()).collect();
        for info in &infos {
            report(folder_mounted(info));
        }
        let info = VmInfo {
            backend: backend.name().into(),
            backend_reason: format!("restored from the snapshot of {} ({why})", meta.session),
            bundle_version: version,
            boot_ms: vm.boot_time.as_millis() as u64,
            pids: vm.pids(),
            run_dir: vm.run_dir().to_path_buf(),
            from_pool: false,
            host_memory_kib: None,
        };
        let names = (meta.bundle.clone(), hostname.to_string(), prepared_image);
        Self::attach(plan, report, Machine { vm, folders }, infos, info, names)
    }

    /// What every VM of a session gets once its folders are shared: the egress proxy on its
    /// vsock socket, and the outputs watcher.
    fn attach(
        plan: &BootPlan,
        report: Report,
        machine: Machine,
        infos: Vec<FolderInfo>,
        info: VmInfo,
        (bundle, hostname, image): (String, String, Option<umbra_bundle::ImageInfo>),
    ) -> Result<Incarnation, SessionError> {
        // Guest connections to host port 1026 arrive on `<vsock socket>_1026`.
        let egress_socket =
            crate::backend::vsock_port_socket(machine.vm.run_dir(), umbra_proto::egress::EGRESS_VSOCK_PORT);
        let egress_report = report.clone();
        let egress = crate::egress::EgressProxy::start(
            &egress_socket,
            plan.network.clone(),
            Some(plan.broker.clone()),
            std::sync::Arc::new(move |kind| egress_report(kind)),
            crate::egress::EgressLimits::default(),
        )
        .map_err(SessionError::io(format!("listen on {}", egress_socket.display())))?;
        let mut outputs = None;
        if let Some(dir) = &plan.storage_dir {
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
        let agent = machine.vm.agent().clone();
        let dialer = machine.vm.dialer();
        let (ended, _) = watch::channel(None);
        Ok(Incarnation {
            dialer,
            machine: tokio::sync::Mutex::new(machine),
            agent,
            info,
            bundle,
            hostname,
            image,
            folder_infos: Mutex::new(infos),
            ended,
            _outputs: outputs,
            _egress: egress,
            forks: Default::default(),
        })
    }

    /// Makes the guest trust the session's CA (see `Request::InstallCa`). An agent older than
    /// protocol 1.6 cannot: its guest gets no secrets' values over TLS, and a warning says so.
    pub async fn trust(&self, ca: &crate::egress::SessionCa) -> Result<(), SessionError> {
        match self.agent.install_ca(ca.pem()).await {
            Ok(()) => Ok(()),
            Err(crate::agent::ClientError::Agent(e))
                if matches!(e.code, umbra_proto::ErrorCode::Unsupported | umbra_proto::ErrorCode::BadRequest) =>
            {
                tracing::warn!("the guest agent cannot install the session CA ({}): secrets stay unread", e.message);
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// What processes are told when their connection drops (`None`: it is not expected to).
    pub fn set_ending(&self, reason: Option<String>) {
        self.ended.send_replace(reason);
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
        use std::sync::atomic::Ordering;
        let forks = self.forks.load(Ordering::Acquire);
        let why = match tokio::time::timeout(timeout, self.agent.ping()).await {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => format!("the agent connection failed: {e}"),
            // A live fork holds the devices (vsock with them) for as long as its copies take.
            Err(_) if forks % 2 == 1 || self.forks.load(Ordering::Acquire) != forks => return Ok(()),
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
            if let Ok(Ok(0)) =
                tokio::time::timeout(Duration::from_secs(10), machine.folders.shadow_count(&machine.vm, &folder)).await
            {
                continue;
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
