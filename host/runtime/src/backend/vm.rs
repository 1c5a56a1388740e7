//! A running VM, whatever runs it, and the two traits a backend implements: [`Backend`]
//! (what it can do, how it launches a guest) and [`Machine`] (what it does differently once the
//! guest runs: helper processes or an in-process VM, snapshots, the folder share). The
//! generic [`Vm`] holds what every backend shares — the agent connection, the console, the run
//! directory — and asks its machine for the rest.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use umbra_sys::FolderIdentity;

use super::console;
use super::rundir::RunDir;
use super::{io, BackendKind, Capabilities, Protection, SharedFolder, SnapshotTaken, VmError, VmSpec};
use crate::agent::AgentClient;

/// How long a diagnosis waits for the console copier to catch up with a guest that ended.
pub(super) const CONSOLE_DRAIN: Duration = Duration::from_secs(1);

/// One way of running a guest (kata's `Hypervisor`, Cloud Hypervisor's `hypervisor` crate):
/// what it can do, as data, and how it boots a [`VmSpec`]. [`BackendKind::backend`] finds one.
#[async_trait]
pub trait Backend: Send + Sync {
    fn kind(&self) -> BackendKind;
    fn capabilities(&self) -> Capabilities;
    /// Boots `spec` (or resumes [`VmSpec::restore`]) and waits for the agent. The spec was
    /// checked against [`Backend::capabilities`] first ([`Vm::launch`]).
    async fn launch(&self, spec: &VmSpec) -> Result<Vm, VmError>;
}

/// The backend's half of a running VM.
#[async_trait]
pub trait Machine: Send + Sync {
    /// Pids of the helper processes (VMM and daemons); none for an in-process VM.
    fn pids(&self) -> Vec<u32>;
    /// Why the VM has ended, if it has: a helper exited, the in-process VM stopped.
    fn ended(&mut self) -> Option<String>;
    /// Waits up to `timeout` for the guest to stop by itself (it was asked to shut down).
    async fn wait_stopped(&mut self, timeout: Duration);
    /// Stops the guest and every helper now.
    fn kill(&mut self);
    /// The folder share, when the VM was launched with folder sharing.
    fn folders(&mut self) -> Option<&mut dyn FolderShare>;
    fn shares_folders(&self) -> bool;
    /// Pauses the guest for good and writes its snapshot into `state` and `memory` (empty files
    /// open for writing); returns the memory bytes written and where the pause went. Only a
    /// backend whose capabilities say `snapshot` is asked.
    async fn snapshot(&mut self, state: std::fs::File, memory: std::fs::File) -> Result<(u64, String), VmError>;
    /// Writes a snapshot of the guest into `state` and `memory` and lets it run on: the guest
    /// is paused only while its state is read and `during_pause` copies what must match the
    /// memory (the session disk). Returns the memory bytes written, where the time went, and
    /// how long the guest was paused. Only a backend whose capabilities say `live_fork` is asked.
    async fn fork(
        &mut self,
        _state: std::fs::File,
        _memory: std::fs::File,
        _during_pause: DuringPause,
    ) -> Result<(u64, String, Duration), VmError> {
        Err(VmError::BackendUnavailable("this backend cannot fork a running VM".into()))
    }
    /// Opens streams to the guest's vsock ports (exposed ports).
    fn dialer(&self) -> super::Dialer;
}

/// What a live fork copies while the guest is paused ([`Machine::fork`]).
pub type DuringPause = Box<dyn FnOnce() -> Result<(), String> + Send>;

/// The set of host folders a running VM's guest can mount (under [`super::fsd::FS_TAG`]).
#[async_trait]
pub trait FolderShare: Send {
    /// Puts the host directory `folder.source` into the share as `folder.name`, read-only on the
    /// host if `read_only`, with its protection applied where the backend can (and refused
    /// where it cannot). The source is opened without following links; given an identity (the
    /// folder's when first shared), anything else there is refused. Returns the identity shared.
    async fn add(&mut self, folder: &SharedFolder) -> Result<FolderIdentity, VmError>;
    /// Takes folder `name` out of the share.
    async fn remove(&mut self, name: &str) -> Result<(), VmError>;
}

/// A running VM. Dropping it stops the guest, kills every helper process and removes its run
/// directory.
pub struct Vm {
    pub id: String,
    pub backend: BackendKind,
    pub capabilities: Capabilities,
    /// Time from launch until the agent answered the handshake.
    pub boot_time: Duration,
    pub(super) agent: AgentClient,
    pub(super) console_log: PathBuf,
    /// Copies a VMM's console pipe into `console_log`, or the in-process VM's console.
    pub(super) console: Option<console::ConsoleCopier>,
    pub(super) machine: Box<dyn Machine>,
    /// Last: removed once the machine is gone.
    pub(super) run_dir: RunDir,
}

impl Vm {
    pub fn agent(&self) -> &AgentClient {
        &self.agent
    }

    /// Opens streams to the guest's vsock ports while the VM runs.
    pub fn dialer(&self) -> super::Dialer {
        self.machine.dialer()
    }

    /// Snapshots the VM into `dir`, a new directory (0700) that gets `state` and `memory`, and
    /// ends the VM (drop it then); [`super::Restore`] resumes it, as often as wanted. The guest
    /// is paused from the request on and never runs again here; a refused request (a backend
    /// without snapshots) leaves it running. Once this returns, the session disk
    /// ([`VmSpec::disk`]) is what the snapshot's memory expects: each restore needs a copy of it
    /// as it is now ([`super::disk::copy_sparse`]). A failed snapshot leaves no `dir` behind.
    pub async fn snapshot(&mut self, dir: &Path) -> Result<SnapshotTaken, VmError> {
        if !self.capabilities.snapshot {
            return Err(VmError::BackendUnavailable(format!(
                "the {} backend cannot snapshot a VM: snapshots need the kvm backend (umbra-vmm)",
                self.backend.name()
            )));
        }
        let files = create_snapshot_files(dir)?;
        let taken = async {
            let (state, memory) = files;
            let started = Instant::now();
            let (memory_bytes, phases) = self.machine.snapshot(state, memory).await?;
            Ok(SnapshotTaken { memory_bytes, took: started.elapsed(), phases })
        }
        .await;
        if taken.is_err() {
            let _ = std::fs::remove_dir_all(dir);
        }
        taken
    }

    /// Snapshots the running VM into `dir` (as [`Vm::snapshot`]) and lets it run on: a live
    /// fork's snapshot. `during_pause` runs while the guest is paused (it copies the session
    /// disk, which must match the memory); `took` is how long the guest was paused. A failure
    /// leaves no `dir` behind, and the VM running unless it says the VM ended.
    pub async fn fork(&mut self, dir: &Path, during_pause: DuringPause) -> Result<SnapshotTaken, VmError> {
        if !self.capabilities.live_fork {
            return Err(VmError::BackendUnavailable(format!(
                "the {} backend cannot fork a running VM: that needs the kvm backend (umbra-vmm)",
                self.backend.name()
            )));
        }
        let files = create_snapshot_files(dir)?;
        let taken = async {
            let (state, memory) = files;
            let (memory_bytes, phases, took) = self.machine.fork(state, memory, during_pause).await?;
            Ok(SnapshotTaken { memory_bytes, took, phases })
        }
        .await;
        if taken.is_err() {
            let _ = std::fs::remove_dir_all(dir);
        }
        taken
    }

    /// Whether folders can be shared with this VM (it was launched with `folder_sharing`).
    pub fn shares_folders(&self) -> bool {
        self.machine.shares_folders()
    }

    /// Puts `source` into the VM's folder share as `name` (see [`FolderShare::add`]).
    pub async fn add_folder(
        &mut self,
        name: &str,
        source: &Path,
        read_only: bool,
        protection: &Protection,
        expected: Option<FolderIdentity>,
    ) -> Result<FolderIdentity, VmError> {
        let folder = SharedFolder {
            name: name.into(),
            source: source.into(),
            read_only,
            protection: protection.clone(),
            identity: expected,
        };
        self.machine.folders().ok_or(VmError::NoFolderSharing)?.add(&folder).await
    }

    /// Takes folder `name` out of the VM's folder share.
    pub async fn remove_folder(&mut self, name: &str) -> Result<(), VmError> {
        self.machine.folders().ok_or(VmError::NoFolderSharing)?.remove(name).await
    }

    pub fn run_dir(&self) -> &Path {
        self.run_dir.path()
    }

    pub fn console_tail(&self, lines: usize) -> String {
        console::tail(&self.console_log, lines)
    }

    /// Pids of the helper processes (VMM and daemons).
    pub fn pids(&self) -> Vec<u32> {
        self.machine.pids()
    }

    /// If the VM has ended, why — the console's diagnosis (a kernel panic says more than the
    /// exit status it caused), else the machine's — with the console's last lines.
    pub fn check_alive(&mut self) -> Result<(), VmError> {
        let Some(ended) = self.machine.ended() else { return Ok(()) };
        if let Some(copier) = &self.console {
            copier.wait_drained(CONSOLE_DRAIN);
        }
        let console = self.console_tail(console::ERROR_CONTEXT_LINES);
        let reason = console::diagnose(&console).map(str::to_string).unwrap_or(ended);
        Err(VmError::GuestDied { reason, console })
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

    /// Asks the guest to shut down, waits for it to stop, then kills what is left.
    pub async fn shutdown(mut self) {
        self.shutdown_in_place().await;
    }

    /// [`Vm::shutdown`] for a VM owned by something that outlives it.
    pub async fn shutdown_in_place(&mut self) {
        let asked = tokio::time::timeout(Duration::from_secs(2), self.agent.shutdown()).await;
        // Only wait for a guest that accepted the request; a dead or deaf one is just killed.
        if matches!(asked, Ok(Ok(()))) {
            self.machine.wait_stopped(Duration::from_secs(10)).await;
        }
        self.kill();
    }

    /// Kills the VMM and every helper now.
    pub fn kill(&mut self) {
        self.machine.kill();
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Host memory held by the processes `pids` (a VM's VMM and helpers) and their descendants (a
/// jailed helper runs under a relay, in a pid namespace of its own), in KiB: the sum of their
/// proportional set sizes (`Pss` in `/proc/PID/smaps_rollup`), so the guest memory several of
/// them map is counted once. `None` when there are none or `/proc` cannot tell (a process gone,
/// no permission).
pub fn host_memory_kib(pids: &[u32]) -> Option<u64> {
    if pids.is_empty() {
        return None;
    }
    let mut total = 0;
    let mut todo: Vec<u32> = pids.to_vec();
    let mut seen = std::collections::HashSet::new();
    while let Some(pid) = todo.pop() {
        if !seen.insert(pid) || seen.len() > 256 {
            continue;
        }
        let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
        let pss = rollup.lines().find_map(|l| l.strip_prefix("Pss:"))?;
        total += pss.trim().trim_end_matches("kB").trim().parse::<u64>().ok()?;
        for task in std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten() {
            let children = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            todo.extend(children.split_whitespace().filter_map(|c| c.parse::<u32>().ok()));
        }
    }
    Some(total)
}

/// Creates `dir` (0700) with its empty `state` and `memory` files (0600), open for writing.
fn create_snapshot_files(dir: &Path) -> Result<(std::fs::File, std::fs::File), VmError> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(dir)
        .map_err(io(format!("create the snapshot directory {}", dir.display())))?;
    let create = |name: &str| {
        let path = dir.join(name);
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(io(format!("create {}", path.display())))
    };
    let files = create("state").and_then(|state| Ok((state, create("memory")?)));
    if files.is_err() {
        let _ = std::fs::remove_dir_all(dir);
    }
    files
}

#[cfg(test)]
mod memory_tests {
    #[test]
    fn the_host_memory_of_this_process_is_its_pss() {
        let me = super::host_memory_kib(&[std::process::id()]).expect("our own smaps_rollup");
        assert!(me > 100, "{me} KiB");
        assert_eq!(super::host_memory_kib(&[]), None);
        assert_eq!(super::host_memory_kib(&[std::process::id(), u32::MAX]), None, "a process gone");
    }
}
