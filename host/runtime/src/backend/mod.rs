//! VM backends: launch a guest from a bundle, wait until its agent answers, tear it down.
//!
//! Every backend gives the same [`Vm`]: an agent connection over the backend's hybrid vsock
//! socket, a console log, and supervised helper processes that die with the VM — or with us.
//! Readiness is the agent handshake, not "the process started".

#[cfg(test)]
mod boot_wait_tests;
mod children;
pub mod confinement;
pub mod console;
pub mod disk;
pub mod fsd;
#[cfg(target_os = "linux")]
mod helper_jail;
pub mod host;
pub mod kvm;
mod postmortem;
mod qemu;
pub use qemu::QEMU_SANDBOX;
mod rundir;
pub mod select;
pub mod vz;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use umbra_bundle::{Arch, ArtifactRole, BundleError, ExtractedBundle};

pub use children::Supervised;
pub use host::KvmKind;
pub use rundir::{open_to_vmm, vsock_port_socket, vsock_socket, RunDir};
pub use umbra_sys::FolderIdentity;

use crate::agent::AgentClient;

pub const DEFAULT_BOOT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a diagnosis waits for the console copier to catch up with a VMM that exited.
const CONSOLE_DRAIN: Duration = Duration::from_secs(1);
/// How long umbra-vmm may take to exit once it has answered a snapshot request.
const SNAPSHOT_STOP: Duration = Duration::from_secs(30);
/// Every x86_64 guest kernel under QEMU gets these; `reboot=t` ends the VM on a guest reboot
/// without waiting on an i8042 that microVMs lack, `panic=-1` reboots (and so ends the VM) on a
/// panic. `no_timer_check`: on a starved emulated vCPU (dozens of guests booting at once under
/// TCG) the IO-APIC timer check fails and the kernel panics ("IO-APIC + timer doesn't work!");
/// the check only matters on broken real hardware.
pub const BASE_CMDLINE: &str = "console=ttyS0 reboot=t quiet panic=-1 no_timer_check";
/// The same for an arm64 guest on QEMU `-M virt`: its console is the PL011 (`ttyAMA0`), and a
/// reboot is a PSCI call that `-no-reboot` turns into QEMU's exit.
pub const BASE_CMDLINE_AARCH64: &str = "console=ttyAMA0 quiet panic=-1";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// Umbra's own VMM (`umbra-vmm`) on KVM.
    Kvm,
    /// QEMU `-M microvm` (`-M virt` for arm64): the headless test harness and the fallback.
    Qemu,
    /// Apple's Virtualization.framework, in-process (macOS only).
    Vz,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Kvm => "kvm",
            BackendKind::Qemu => "qemu",
            BackendKind::Vz => "vz",
        }
    }

    /// Whether [`Vm::snapshot`] and [`VmSpec::restore`] work on this backend (umbra-vmm only).
    pub fn can_snapshot(self) -> bool {
        self == BackendKind::Kvm
    }

    /// The choice that asks for this backend by name.
    pub fn choice(self) -> umbra_api::BackendChoice {
        match self {
            BackendKind::Kvm => umbra_api::BackendChoice::Kvm,
            BackendKind::Qemu => umbra_api::BackendChoice::Qemu,
            BackendKind::Vz => umbra_api::BackendChoice::Vz,
        }
    }

    /// Whether this backend can run `image` here: QEMU runs every architecture (emulating the
    /// ones that are not the host's), the others only the host's.
    pub fn check_arch(self, image: &BootImage) -> Result<(), VmError> {
        // vz boots arm64 guests only: the x86_64 kernel has no virtio-pci or virtio console,
        // which Virtualization.framework's devices need.
        if self == BackendKind::Vz && image.arch == Arch::host() && image.arch != Arch::Aarch64 {
            return Err(VmError::BackendUnavailable(format!(
                "bundle {} is {}: the vz backend boots aarch64 guests only (Apple silicon)",
                image.version, image.arch
            )));
        }
        if self == BackendKind::Qemu || image.arch == Arch::host() {
            return Ok(());
        }
        Err(VmError::WrongArch {
            version: image.version.clone(),
            guest: image.arch,
            host: Arch::host(),
            backend: self.name(),
        })
    }

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "kvm" => Some(BackendKind::Kvm),
            "qemu" => Some(BackendKind::Qemu),
            "vz" => Some(BackendKind::Vz),
            _ => None,
        }
    }
}

/// What to boot, extracted from a verified bundle.
#[derive(Debug, Clone)]
pub struct BootImage {
    pub version: String,
    /// The guest's architecture (the bundle's `arch`): it picks the QEMU binary and machine,
    /// and the backends that run only the host's architecture refuse the others.
    pub arch: Arch,
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub rootfs: Option<PathBuf>,
    /// The image's own kernel arguments (root device, init).
    pub cmdline: String,
}

impl BootImage {
    /// Verifies and extracts the bundle in `bundle_dir` (cached under `cache_root`).
    pub fn from_bundle_dir(bundle_dir: &Path, cache_root: &Path) -> Result<Self, BundleError> {
        let b = ExtractedBundle::from_dir(bundle_dir, cache_root, env!("CARGO_PKG_VERSION"))?;
        Ok(Self::from_extracted(&b))
    }

    /// The image of a bundle already verified and extracted (an installed one).
    pub fn from_extracted(b: &ExtractedBundle) -> Self {
        Self {
            version: b.manifest.bundle_version.clone(),
            arch: b.manifest.arch,
            kernel: b.kernel(),
            initrd: b.path(ArtifactRole::Initrd),
            rootfs: b.path(ArtifactRole::Rootfs),
            cmdline: b.manifest.boot.cmdline.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct VmSpec {
    pub image: BootImage,
    pub cpus: u32,
    pub memory_mib: u32,
    pub boot_timeout: Duration,
    /// Start the folder server (umbra-fsd + virtiofsd) and attach a virtio-fs device, so
    /// folders can be shared with the running VM.
    pub folder_sharing: bool,
    /// A writable session disk (ext4, see [`disk`]) that holds the guest's overlay upper layer;
    /// `None` keeps guest writes in RAM.
    pub disk: Option<PathBuf>,
    /// Resume this snapshot instead of booting (the kvm backend only). The rest of the spec
    /// must describe the machine that was snapshotted: same image, vCPUs, memory, disks in
    /// order, folder sharing on or off.
    pub restore: Option<Restore>,
}

/// What resumes a snapshot that [`Vm::snapshot`] took.
#[derive(Debug, Clone)]
pub struct Restore {
    /// The snapshot's directory (its `state` and `memory` files). Any number of VMs may resume
    /// one snapshot at once: each maps the memory file privately.
    pub snapshot: PathBuf,
    /// The restored guest's hostname. With it the guest takes fresh entropy from this host and
    /// this host's clock (the agent's `reidentify`), so forks never share random streams.
    pub hostname: String,
    /// The folders the snapshotted VM's folder server shared, by name. The new folder server
    /// shares them (the same names, any sources: a fork's own copies) before the guest resumes,
    /// so the files the guest had open are found again by their paths.
    pub folders: Vec<SharedFolder>,
}

/// One folder in a VM's folder share (see [`Vm::add_folder`]).
#[derive(Debug, Clone)]
pub struct SharedFolder {
    pub name: String,
    pub source: PathBuf,
    pub read_only: bool,
    pub protection: fsd::Protection,
    /// The folder as it was first shared: a restore refuses anything else at `source`.
    pub identity: Option<FolderIdentity>,
}

/// The identity of folder `path`, refusing a path with a symbolic link anywhere in it. Where
/// umbra-fsd serves the folders it repeats the check race-free on the descriptor it mounts;
/// the vz backend, which hands paths to the framework, has this check alone.
pub fn folder_identity(path: &Path) -> std::io::Result<FolderIdentity> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::symlink_metadata(path)?;
    if !meta.is_dir() || path.canonicalize()? != path {
        return Err(std::io::Error::other(format!(
            "{} is not a directory reached without symbolic links",
            path.display()
        )));
    }
    Ok(FolderIdentity { dev: meta.dev(), ino: meta.ino() })
}

/// What [`Vm::snapshot`] wrote.
#[derive(Debug, Clone)]
pub struct SnapshotTaken {
    /// Bytes of guest memory in the memory file (a sparse file: untouched pages are holes).
    pub memory_bytes: u64,
    /// From the request until both files were written (the guest paused throughout).
    pub took: Duration,
    /// Where that time went, as umbra-vmm measured it ("vcpus 2 ms, devices 5 ms, …").
    pub phases: String,
}

impl VmSpec {
    pub fn new(image: BootImage) -> Self {
        Self {
            image,
            cpus: 1,
            memory_mib: 512,
            boot_timeout: boot_timeout_from_env(),
            folder_sharing: false,
            disk: None,
            restore: None,
        }
    }
}

/// `UMBRA_BOOT_TIMEOUT_SECS` overrides the default boot timeout: slow hosts (software
/// emulation, the nested lane on a loaded machine) need more than 30 s.
fn boot_timeout_from_env() -> Duration {
    std::env::var("UMBRA_BOOT_TIMEOUT_SECS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs)
        .unwrap_or(DEFAULT_BOOT_TIMEOUT)
}

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("{what} not found: {fix}")]
    Missing { what: &'static str, fix: &'static str },
    /// The requested backend cannot run on this host.
    #[error("{0}")]
    BackendUnavailable(String),
    /// The bundle is for an architecture the backend cannot run.
    #[error("bundle {version} is an {guest} guest; the {backend} backend runs only {host} guests on this host (use the qemu backend, which emulates {guest})")]
    WrongArch { version: String, guest: Arch, host: Arch, backend: &'static str },
    #[error("cannot {what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error("{helper} exited during start-up ({status}); its log:\n{log}")]
    HelperFailed { helper: &'static str, status: String, log: String },
    #[error("the guest did not answer within {timeout:?} (agent not reachable: {last_error}); its processes:\n{processes}last console lines:\n{console}")]
    BootTimeout { timeout: Duration, last_error: String, processes: String, console: String },
    /// The folder server (umbra-fsd) refused a request.
    #[error("the folder server refused: {0}")]
    FolderServer(String),
    #[error("the VM was launched without folder sharing")]
    NoFolderSharing,
    #[error("the VM ended ({reason}); last console lines:\n{console}")]
    GuestDied { reason: String, console: String },
    #[error("cannot snapshot the VM: {0}")]
    Snapshot(String),
    #[error("cannot restore the snapshot: {0}")]
    Restore(String),
}

/// A running VM. Dropping it kills every helper process and removes its run directory.
pub struct Vm {
    pub id: String,
    pub backend: BackendKind,
    agent: AgentClient,
    /// VMM last: dropped (killed) before the daemons it uses.
    children: Vec<Supervised>,
    console_log: PathBuf,
    /// Copies a VMM's console pipe into `console_log` (an in-process VM writes it itself).
    console: Option<console::ConsoleCopier>,
    /// Time from launch until the agent answered the handshake.
    pub boot_time: Duration,
    run_dir: RunDir,
    /// The folder server, when the VM was launched with folder sharing.
    folders: Option<fsd::FolderServer>,
    /// The in-process VM of the vz backend.
    #[cfg(target_os = "macos")]
    vz: Option<std::sync::Arc<vz::VzMachine>>,
    /// The vz VM's folder share set, when it was launched with folder sharing.
    #[cfg(target_os = "macos")]
    vz_shares: Option<Vec<vz::VzShare>>,
}

impl Vm {
    /// Boots `spec` on `backend` and waits for the agent.
    pub async fn launch(backend: BackendKind, spec: &VmSpec) -> Result<Self, VmError> {
        backend.check_arch(&spec.image)?;
        if spec.restore.is_some() && !backend.can_snapshot() {
            return Err(VmError::BackendUnavailable(format!(
                "the {} backend cannot restore a snapshot: snapshots need the kvm backend (umbra-vmm)",
                backend.name()
            )));
        }
        match backend {
            BackendKind::Kvm => kvm::launch(spec).await,
            BackendKind::Qemu => qemu::launch(spec).await,
            #[cfg(target_os = "macos")]
            BackendKind::Vz => vz::launch(spec).await,
            #[cfg(not(target_os = "macos"))]
            BackendKind::Vz => Err(VmError::BackendUnavailable(
                "backend vz is Apple's Virtualization.framework: it runs only on macOS".into(),
            )),
        }
    }

    pub fn agent(&self) -> &AgentClient {
        &self.agent
    }

    /// Snapshots the VM into `dir`, a new directory (0700) that gets `state` and `memory`, and
    /// ends the VM (drop it then); [`Restore`] resumes it, as often as wanted. The guest is
    /// paused from the request on and never runs again here; a refused request (another
    /// backend) leaves it running. Once this returns, the session disk
    /// ([`VmSpec::disk`]) is what the snapshot's memory expects: each restore needs a copy of it
    /// as it is now ([`disk::copy_sparse`]). A failed snapshot leaves no `dir` behind. The kvm
    /// backend only.
    pub async fn snapshot(&mut self, dir: &Path) -> Result<SnapshotTaken, VmError> {
        if !self.backend.can_snapshot() {
            return Err(VmError::BackendUnavailable(format!(
                "the {} backend cannot snapshot a VM: snapshots need the kvm backend (umbra-vmm)",
                self.backend.name()
            )));
        }
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(dir)
            .map_err(io(format!("create the snapshot directory {}", dir.display())))?;
        let taken = async {
            let create = |name: &str| {
                let path = dir.join(name);
                std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&path)
                    .map_err(io(format!("create {}", path.display())))
            };
            let (state, memory) = (create("state")?, create("memory")?);
            let control = kvm::control_socket(self.run_dir.path());
            let started = Instant::now();
            let (memory_bytes, phases) =
                tokio::task::spawn_blocking(move || kvm::request_snapshot(&control, &state, &memory))
                    .await
                    .map_err(|e| VmError::Snapshot(format!("the request failed: {e}")))?
                    .map_err(VmError::Snapshot)?;
            let took = started.elapsed();
            let vmm = self.children.last_mut().expect("a running VM has its VMM");
            match vmm.wait_timeout(SNAPSHOT_STOP).await {
                Some(s) if s.code() == Some(umbra_contract::exit::VmmStatus::Snapshotted.code()) => {
                    Ok(SnapshotTaken { memory_bytes, took, phases })
                }
                Some(s) => Err(VmError::Snapshot(format!("umbra-vmm ended with {s} after writing it"))),
                None => Err(VmError::Snapshot(format!("umbra-vmm did not stop within {SNAPSHOT_STOP:?} of it"))),
            }
        }
        .await;
        if taken.is_err() {
            let _ = std::fs::remove_dir_all(dir);
        }
        taken
    }

    /// Whether folders can be shared with this VM (it was launched with `folder_sharing`).
    pub fn shares_folders(&self) -> bool {
        #[cfg(target_os = "macos")]
        if self.vz.is_some() {
            return self.vz_shares.is_some();
        }
        self.folders.is_some()
    }

    /// Puts the host directory `source` into the VM's folder share as `name`, read-only on the
    /// host if `read_only`; the guest mounts it from there. Linux: the folder server binds it
    /// (with `protection` applied on the host). vz: the framework's share set is replaced.
    /// `source` is opened without following links; given `expected` (the folder's identity
    /// when first shared), anything else there is refused. Returns the identity shared.
    pub async fn add_folder(
        &mut self,
        name: &str,
        source: &Path,
        read_only: bool,
        protection: &fsd::Protection,
        expected: Option<FolderIdentity>,
    ) -> Result<FolderIdentity, VmError> {
        #[cfg(target_os = "macos")]
        if let (Some(machine), Some(shares)) = (&self.vz, &mut self.vz_shares) {
            return vz::add_folder(machine, shares, name, source, read_only, protection, expected).await;
        }
        let server = self.folders.as_mut().ok_or(VmError::NoFolderSharing)?;
        server.add(name, source, read_only, protection, expected).await
    }

    /// Takes folder `name` out of the VM's folder share.
    pub async fn remove_folder(&mut self, name: &str) -> Result<(), VmError> {
        #[cfg(target_os = "macos")]
        if let (Some(machine), Some(shares)) = (&self.vz, &mut self.vz_shares) {
            return vz::remove_folder(machine, shares, name).await;
        }
        let server = self.folders.as_mut().ok_or(VmError::NoFolderSharing)?;
        server.remove(name).await
    }

    pub fn run_dir(&self) -> &Path {
        self.run_dir.path()
    }

    pub fn console_tail(&self, lines: usize) -> String {
        console::tail(&self.console_log, lines)
    }

    /// Pids of the helper processes (VMM and daemons).
    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().map(Supervised::pid).collect()
    }

    /// If the VM has ended (any helper exited), why — with the console's last lines.
    pub fn check_alive(&mut self) -> Result<(), VmError> {
        #[cfg(target_os = "macos")]
        if let Some(ended) = self.vz.as_ref().and_then(|m| vz::ended(m)) {
            // A panic ends a vz VM the way a power-off does: the console says which.
            if let Some(copier) = &self.console {
                copier.wait_drained(CONSOLE_DRAIN);
            }
            let console = self.console_tail(console::ERROR_CONTEXT_LINES);
            let reason = console::diagnose(&console).map(str::to_string).unwrap_or(ended);
            return Err(VmError::GuestDied { reason, console });
        }
        let dead = self.children.iter_mut().find_map(|c| c.try_exited().map(|s| (c.name, s)));
        match dead {
            None => Ok(()),
            Some((name, status)) => Err(self.died(name, status)),
        }
    }

    fn died(&self, name: &str, status: std::process::ExitStatus) -> VmError {
        if let Some(copier) = &self.console {
            copier.wait_drained(CONSOLE_DRAIN);
        }
        let console = self.console_tail(console::ERROR_CONTEXT_LINES);
        let reason = match console::diagnose(&console) {
            Some(why) => why.to_string(),
            None => exit_reason(name, status),
        };
        VmError::GuestDied { reason, console }
    }

    /// Waits until the VM ends by itself, up to `timeout`; returns why it ended.
    pub async fn wait(&mut self, timeout: Duration) -> Option<VmError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Err(e) = self.check_alive() {
                return Some(e);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Asks the guest to shut down, waits for the VMM to exit, then kills what is left.
    pub async fn shutdown(mut self) {
        self.shutdown_in_place().await;
    }

    /// [`Vm::shutdown`] for a VM owned by something that outlives it.
    pub async fn shutdown_in_place(&mut self) {
        let asked = tokio::time::timeout(Duration::from_secs(2), self.agent.shutdown()).await;
        // Only wait for a guest that accepted the request; a dead or deaf one is just killed.
        if matches!(asked, Ok(Ok(()))) {
            if let Some(vmm) = self.children.last_mut() {
                vmm.wait_timeout(Duration::from_secs(10)).await;
            }
            #[cfg(target_os = "macos")]
            if self.vz.is_some() {
                let _ = self.wait(Duration::from_secs(10)).await;
            }
        }
        self.kill();
    }

    /// Kills the VMM and every helper now.
    pub fn kill(&mut self) {
        #[cfg(target_os = "macos")]
        if let Some(machine) = &self.vz {
            machine.kill();
        }
        for c in self.children.iter_mut().rev() {
            c.kill();
        }
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.kill();
    }
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> VmError {
    let what = what.into();
    move |source| VmError::Io { what, source }
}

fn log_file(path: &Path) -> Result<File, VmError> {
    File::create(path).map_err(io(format!("create {}", path.display())))
}

/// Starts the VM's folder server when `spec` asks for folder sharing; its process joins
/// `children` (before the VMM, which is killed first).
async fn start_folder_server(
    spec: &VmSpec,
    run: &RunDir,
    children: &mut Vec<Supervised>,
) -> Result<Option<fsd::FolderServer>, VmError> {
    if !spec.folder_sharing {
        return Ok(None);
    }
    let (server, child) = fsd::FolderServer::start(run).await?;
    children.push(child);
    Ok(Some(server))
}

/// What a backend has set up before it starts the process that runs the guest.
struct Launch {
    backend: BackendKind,
    /// When the launch began: boot time is measured from here.
    started: Instant,
    id: String,
    run: RunDir,
    /// The helpers already running (daemons, the folder server).
    children: Vec<Supervised>,
    folders: Option<fsd::FolderServer>,
}

/// The process that runs the guest (QEMU or umbra-vmm). Its stdout is the guest console; its
/// stderr goes to `log`, which says more than the console when the guest dies during boot.
struct GuestProcess<'a> {
    name: &'static str,
    binary: &'a Path,
    cmd: Command,
    log: PathBuf,
    /// Put before the log's text where it joins a boot failure's console lines.
    log_label: &'static str,
    jail: Option<children::Jail>,
    /// Descriptors the process inherits, closed here once it has started.
    held: Vec<std::os::fd::OwnedFd>,
}

impl Launch {
    /// Starts `guest`, copies its console to `console.log` in the run directory and waits for the
    /// agent on the run directory's vsock socket.
    async fn finish(self, spec: &VmSpec, guest: GuestProcess<'_>) -> Result<Vm, VmError> {
        let Launch { backend, started, id, run, mut children, folders } = self;
        let GuestProcess { name, binary, mut cmd, log, log_label, jail, held } = guest;
        let console_log = run.join("console.log");
        // Listen for the agent's readiness announcement before the guest can make it.
        let ready_path = rundir::vsock_port_socket(run.path(), umbra_proto::AGENT_READY_VSOCK_PORT);
        let ready = tokio::net::UnixListener::bind(&ready_path).map_err(io("listen for the agent's readiness"))?;
        rundir::open_to_vmm(&ready_path).map_err(io("open the readiness socket to the VMM"))?;
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(log_file(&log)?);
        let mut process =
            Supervised::spawn_jailed(name, cmd, jail).map_err(io(format!("start {}", binary.display())))?;
        drop(held);
        let console_out = process.take_stdout().unwrap_or_else(|| panic!("{name} spawned with a stdout pipe"));
        let copier =
            console::ConsoleCopier::start(console_out, console_log.clone()).map_err(io("start the console copier"))?;
        children.push(process);

        let waited = wait_for_agent(&run, ready, &mut children, &copier, spec.boot_timeout).await;
        let _ = std::fs::remove_file(&ready_path);
        let agent = match waited {
            Ok(a) => a,
            Err(VmError::GuestDied { reason, console }) => {
                // The VMM's own complaint (bad image, KVM refused a step) says more than the console.
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                let console =
                    if text.trim().is_empty() { console } else { format!("{console}\n{log_label}{}", text.trim()) };
                return Err(VmError::GuestDied { reason, console });
            }
            Err(e) => return Err(e),
        };
        Ok(Vm {
            id,
            backend,
            agent,
            children,
            console_log,
            console: Some(copier),
            boot_time: started.elapsed(),
            run_dir: run,
            folders,
            #[cfg(target_os = "macos")]
            vz: None,
            #[cfg(target_os = "macos")]
            vz_shares: None,
        })
    }
}

/// Why a helper's exit ended the VM: umbra-vmm's status says what happened to the guest.
fn exit_reason(name: &str, status: std::process::ExitStatus) -> String {
    match (name, kvm::describe_exit(status.code())) {
        ("umbra-vmm", Some(why)) => format!("{why} (umbra-vmm {status})"),
        _ => format!("{name} exited: {status}"),
    }
}

/// How long one connection attempt may take once the agent has announced itself.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);

/// Waits for the agent: first for its readiness announcement (a guest connection to
/// [`umbra_proto::AGENT_READY_VSOCK_PORT`]), then connects through the hybrid vsock socket,
/// retrying with exponential backoff from 2 ms, while watching that the helpers stay alive.
///
/// Connecting before the announcement is what the announcement exists to avoid: a host
/// connection that reaches vhost-device-vsock while the guest driver is still starting the
/// device finds a queue not ready, and the backend's worker thread exits for good. An agent
/// that never announces (built before protocol 1.2) is polled after half the timeout.
async fn wait_for_agent(
    run: &RunDir,
    ready: tokio::net::UnixListener,
    children: &mut [Supervised],
    copier: &console::ConsoleCopier,
    timeout: Duration,
) -> Result<AgentClient, VmError> {
    let (vsock_uds, console_log) = (rundir::vsock_socket(run.path()), run.join("console.log"));
    let started = Instant::now();
    let mut announced = false;
    let mut delay = Duration::from_millis(2);
    let mut last_error = String::from("the agent has not announced itself yet");
    loop {
        if let Some((name, status)) = children.iter_mut().find_map(|c| c.try_exited().map(|s| (c.name, s))) {
            copier.wait_drained(CONSOLE_DRAIN);
            let console = console::tail(&console_log, console::ERROR_CONTEXT_LINES);
            let reason = console::diagnose(&console).map(str::to_string).unwrap_or_else(|| exit_reason(name, status));
            return Err(VmError::GuestDied { reason: format!("during boot: {reason}"), console });
        }
        let elapsed = started.elapsed();
        if elapsed >= timeout {
            return Err(VmError::BootTimeout {
                timeout,
                last_error,
                processes: postmortem::report(run.path(), children),
                console: console::tail(&console_log, console::ERROR_CONTEXT_LINES),
            });
        }
        if !announced {
            // Wake often enough to notice a helper that died.
            if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(50), ready.accept()).await {
                announced = true;
            } else if elapsed >= timeout / 2 {
                announced = true;
                tracing::debug!("no readiness announcement after {elapsed:?}: polling the agent");
            }
            continue;
        }
        if vsock_uds.exists() {
            let attempt = AgentClient::connect_hybrid_vsock(&vsock_uds, umbra_proto::AGENT_VSOCK_PORT);
            // Once the agent has announced itself an answer takes milliseconds, but a loaded
            // host may need seconds: be patient rather than abandon CONNECTs in flight.
            let patience = timeout.saturating_sub(started.elapsed()).clamp(Duration::from_millis(100), ATTEMPT_TIMEOUT);
            match tokio::time::timeout(patience, attempt).await {
                Ok(Ok(client)) => return Ok(client),
                Ok(Err(e)) => last_error = e.to_string(),
                Err(_) => last_error = "handshake timed out".into(),
            }
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(100));
    }
}

#[cfg(test)]
mod arch_tests {
    use super::*;

    #[tokio::test]
    async fn a_backend_that_runs_only_the_hosts_architecture_refuses_another_by_name() {
        let other = if Arch::host() == Arch::X86_64 { Arch::Aarch64 } else { Arch::X86_64 };
        let image = BootImage {
            version: "minimal-test".into(),
            arch: other,
            kernel: PathBuf::from("/nonexistent/Image"),
            initrd: None,
            rootfs: None,
            cmdline: String::new(),
        };
        for backend in [BackendKind::Kvm, BackendKind::Vz] {
            let e = Vm::launch(backend, &VmSpec::new(image.clone())).await.err().expect("refused");
            let text = e.to_string();
            assert!(matches!(e, VmError::WrongArch { .. }), "{backend:?}: {text}");
            assert!(text.contains(other.as_str()) && text.contains(Arch::host().as_str()), "{text}");
            assert!(text.contains("minimal-test") && text.contains("qemu"), "{text}");
        }
        assert!(BackendKind::Qemu.check_arch(&image).is_ok(), "QEMU emulates it");
    }

    #[test]
    fn vz_boots_only_arm64_guests() {
        let mut image = BootImage {
            version: "minimal-test".into(),
            arch: Arch::X86_64,
            kernel: PathBuf::from("/nonexistent/vmlinux"),
            initrd: None,
            rootfs: None,
            cmdline: String::new(),
        };
        let e = BackendKind::Vz.check_arch(&image).unwrap_err().to_string();
        assert!(e.contains("aarch64 guests only") || e.contains("x86_64"), "{e}");
        image.arch = Arch::Aarch64;
        assert_eq!(BackendKind::Vz.check_arch(&image).is_ok(), Arch::host() == Arch::Aarch64);
    }
}
