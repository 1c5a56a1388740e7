//! The `kvm` backend: Umbra's own VMM (`umbra-vmm`), one process per VM, configured by a
//! `vm.json` in the VM's run directory. Its vsock device serves the same hybrid Unix socket as
//! QEMU's vhost-device-vsock, so the agent connection is the same code; no helper daemons.

mod control;
pub use control::{control_socket, request_fork, request_snapshot, ControlError};

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use umbra_bundle::Arch;
use umbra_contract::exit::VmmStatus;
use umbra_contract::vm::{DiskConfig, FsConfig, JailConfig, VmConfig, VsockConfig, NOBODY};

use super::fsd::FolderServer;
use super::launch::{start_folder_server, GuestProcess, Helpers, Launch};
use super::rundir::{new_vm_id, RunDir};
use super::vm::{Backend, FolderShare, Machine, Vm};
use super::{io, BackendKind, Capabilities, VmError, VmSpec};

/// `reboot=k`: the guest's reboot (how the agent ends the VM) pulses the i8042 reset line,
/// which umbra-vmm reports as a clean exit; a triple fault then always means a crash.
/// `no_timer_check`: a starved vCPU can fail the kernel's IO-APIC timer check, which then
/// panics ("IO-APIC + timer doesn't work!"); the check only matters on broken real hardware.
pub const KVM_CMDLINE: &str = "console=ttyS0 reboot=k quiet panic=-1 no_timer_check";
const GUEST_CID: u64 = 3;
/// How long umbra-vmm may take to exit once it has answered a snapshot request.
const SNAPSHOT_STOP: Duration = Duration::from_secs(30);

/// umbra-vmm on KVM: the host's architecture (x86_64), snapshots and restores, every folder
/// policy (umbra-fsd enforces them).
pub struct KvmBackend;

#[async_trait]
impl Backend for KvmBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Kvm
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            snapshot: true,
            live_fork: true,
            folder_protection: true,
            guest_arches: &[Arch::X86_64],
            emulates: false,
        }
    }

    async fn launch(&self, spec: &VmSpec) -> Result<Vm, VmError> {
        launch(spec).await
    }
}
/// umbra-vmm, if this host has it (see [`super::host::UMBRA_VMM`]).
pub fn find_vmm() -> Option<PathBuf> {
    super::host::UMBRA_VMM.find()
}

/// The user a jailed umbra-vmm runs as when the runtime is root (`nobody`): it owns nothing but
/// the VM's vsock directory.
pub const JAIL_ID: u32 = NOBODY;

/// Whether umbra-vmm runs jailed (see umbra_vmm::jail): yes unless `UMBRA_VMM_JAIL=off`, a
/// switch for debugging, not for use.
pub fn jail_enabled() -> bool {
    std::env::var("UMBRA_VMM_JAIL").map_or(true, |v| v != "off")
}

/// The VM description umbra-vmm reads (`vm.json`). With `jail`, the VMM's root is the
/// directory holding `vsock_uds`.
pub fn vm_config(spec: &VmSpec, vsock_uds: &Path, fs_socket: Option<&Path>, jail: bool) -> Result<VmConfig, VmError> {
    let cpus = u8::try_from(spec.cpus)
        .map_err(|_| VmError::BackendUnavailable(format!("{} vCPUs asked; umbra-vmm runs at most 255", spec.cpus)))?;
    let mut cfg = VmConfig::new(spec.image.kernel.clone());
    cfg.initrd = spec.image.initrd.clone();
    cfg.cmdline = format!("{KVM_CMDLINE} {}", spec.image.cmdline).trim().to_string();
    cfg.cpus = cpus;
    cfg.memory_mib = spec.memory_mib;
    if let Some(rootfs) = &spec.image.rootfs {
        cfg.disks.push(DiskConfig { path: rootfs.clone(), read_only: true });
    }
    // After the rootfs, so the image's `root=/dev/vda` still names it; the agent finds the
    // session disk by its label, not by its position.
    if let Some(disk) = &spec.disk {
        cfg.disks.push(DiskConfig { path: disk.clone(), read_only: false });
    }
    cfg.vsock = Some(VsockConfig { guest_cid: GUEST_CID, uds_path: vsock_uds.to_path_buf() });
    if let Some(socket) = fs_socket {
        cfg.fs.push(FsConfig { tag: super::fsd::FS_TAG.into(), socket: socket.to_path_buf() });
    }
    // Free page reporting: memory the guest frees goes back to the host (`docs/sessions.md`).
    cfg.balloon = true;
    if let Some(dir) = vsock_uds.parent() {
        // Beside the vsock socket (see `control_socket`): where `Vm::snapshot` asks for a snapshot.
        cfg.control = Some(dir.join("control.sock"));
        if jail {
            cfg.jail = Some(JailConfig { dir: dir.to_path_buf(), uid: JAIL_ID, gid: JAIL_ID });
        }
    }
    Ok(cfg)
}

/// What an umbra-vmm exit code means.
pub fn describe_exit(code: i32) -> Option<&'static str> {
    VmmStatus::from_code(code).map(VmmStatus::describe)
}

/// A running umbra-vmm and its folder server: [`Helpers`] that can also snapshot, through
/// the VMM's control socket.
struct KvmMachine {
    helpers: Helpers,
    control: PathBuf,
}

#[async_trait]
impl Machine for KvmMachine {
    fn pids(&self) -> Vec<u32> {
        self.helpers.pids()
    }

    fn ended(&mut self) -> Option<String> {
        self.helpers.ended()
    }

    async fn wait_stopped(&mut self, timeout: Duration) {
        self.helpers.wait_stopped(timeout).await
    }

    fn kill(&mut self) {
        self.helpers.kill()
    }

    fn folders(&mut self) -> Option<&mut dyn FolderShare> {
        self.helpers.folders()
    }

    fn shares_folders(&self) -> bool {
        self.helpers.shares_folders()
    }

    fn dialer(&self) -> crate::backend::Dialer {
        self.helpers.dialer()
    }

    async fn fork(
        &mut self,
        state: std::fs::File,
        memory: std::fs::File,
        during_pause: crate::backend::DuringPause,
    ) -> Result<(u64, String, Duration), VmError> {
        let control = self.control.clone();
        tokio::task::spawn_blocking(move || request_fork(&control, &state, &memory, during_pause))
            .await
            .map_err(|e| VmError::Snapshot(format!("the fork request failed: {e}")))?
            .map_err(|e| VmError::Snapshot(e.to_string()))
    }

    async fn snapshot(&mut self, state: std::fs::File, memory: std::fs::File) -> Result<(u64, String), VmError> {
        let control = self.control.clone();
        let taken = tokio::task::spawn_blocking(move || request_snapshot(&control, &state, &memory))
            .await
            .map_err(|e| VmError::Snapshot(format!("the request failed: {e}")))?
            .map_err(|e| VmError::Snapshot(e.to_string()))?;
        match self.helpers.guest_process().wait_timeout(SNAPSHOT_STOP).await {
            Some(s) if s.code() == Some(VmmStatus::Snapshotted.code()) => Ok(taken),
            Some(s) => Err(VmError::Snapshot(format!("umbra-vmm ended with {s} after writing it"))),
            None => Err(VmError::Snapshot(format!("umbra-vmm did not stop within {SNAPSHOT_STOP:?} of it"))),
        }
    }
}

async fn launch(spec: &VmSpec) -> Result<Vm, VmError> {
    let started = Instant::now();
    let vmm = super::host::UMBRA_VMM.require()?;
    let id = new_vm_id();
    let run = RunDir::create(&id).map_err(io("create the VM run directory"))?;
    let vsock_uds = super::rundir::vsock_socket(run.path());
    let jail = jail_enabled();
    // SAFETY: geteuid has no preconditions.
    if jail && unsafe { libc::geteuid() } == 0 {
        // The jailed VMM runs as JAIL_ID: its root directory must be its own.
        let dir = vsock_uds.parent().expect("the vsock socket is in a directory");
        std::os::unix::fs::chown(dir, Some(JAIL_ID), Some(JAIL_ID))
            .map_err(io(format!("give {} to the VMM's user", dir.display())))?;
    }
    let config = run.join("vm.json");
    let mut children = Vec::new();
    let mut folders = start_folder_server(spec, &run, &mut children).await?;
    if let Some(restore) = &spec.restore {
        share_before_restore(restore, folders.as_mut()).await?;
    }
    let fs_socket = folders.as_ref().map(FolderServer::socket);
    let text = serde_json::to_vec_pretty(&vm_config(spec, &vsock_uds, fs_socket, jail)?).expect("a config serialises");
    std::fs::write(&config, text).map_err(io(format!("write {}", config.display())))?;

    let mut cmd = Command::new(&vmm);
    cmd.arg("--config").arg(&config);
    if let Some(restore) = &spec.restore {
        cmd.arg("--restore").arg(&restore.snapshot);
    }
    let guest = GuestProcess {
        name: "umbra-vmm",
        binary: &vmm,
        cmd,
        log: run.join("umbra-vmm.log"),
        log_label: "",
        // umbra-vmm jails itself, once it has opened its files (umbra_vmm::jail).
        jail: None,
        held: Vec::new(),
        describe_exit,
    };
    let control = control_socket(run.path());
    let launch =
        Launch { kind: BackendKind::Kvm, capabilities: KvmBackend.capabilities(), started, id, run, children, folders };
    let vm = launch.finish(spec, guest, |helpers| Box::new(KvmMachine { helpers, control })).await?;
    if let Some(restore) = &spec.restore {
        // The guest resumed with the snapshotted VM's hostname, entropy pool and clock.
        vm.agent()
            .reidentify(&restore.hostname)
            .await
            .map_err(|e| VmError::Restore(format!("the resumed guest did not take its new identity: {e}")))?;
    }
    Ok(vm)
}

/// Checks that `restore` names a snapshot, and shares its folders through the new folder
/// server before the guest resumes (virtiofsd finds the guest's open files by path).
async fn share_before_restore(restore: &super::Restore, folders: Option<&mut FolderServer>) -> Result<(), VmError> {
    for file in ["state", "memory"] {
        if !restore.snapshot.join(file).is_file() {
            return Err(VmError::Restore(format!(
                "{} is not a snapshot (it has no {file} file)",
                restore.snapshot.display()
            )));
        }
    }
    match folders {
        None if !restore.folders.is_empty() => Err(VmError::NoFolderSharing),
        None => Ok(()),
        Some(server) => {
            // Read-only folders first, as at boot: a nested one is pinned inside its writable
            // parent as that parent is shared.
            let mut folders: Vec<_> = restore.folders.iter().collect();
            folders.sort_by_key(|f| !f.read_only);
            for f in folders {
                server.add(f).await?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::backend::BootImage;

    #[test]
    fn the_session_disk_follows_the_rootfs_and_is_writable() {
        let mut spec = VmSpec::new(BootImage {
            version: "test".into(),
            arch: umbra_bundle::Arch::X86_64,
            kernel: PathBuf::from("/k/vmlinux"),
            initrd: None,
            rootfs: Some(PathBuf::from("/b/root.erofs")),
            cmdline: "root=/dev/vda".into(),
            image: None,
        });
        let cfg = vm_config(&spec, Path::new("/r/vsock/vsock.sock"), None, false).unwrap();
        assert_eq!(cfg.disks, [DiskConfig { path: "/b/root.erofs".into(), read_only: true }]);
        assert!(cfg.cmdline.contains("no_timer_check"));
        assert!(cfg.balloon, "free page reporting");
        assert_eq!(cfg.jail, None);
        assert_eq!(cfg.control, Some(PathBuf::from("/r/vsock/control.sock")));
        let jailed = vm_config(&spec, Path::new("/r/vsock/vsock.sock"), None, true).unwrap();
        assert_eq!(jailed.jail, Some(JailConfig { dir: "/r/vsock".into(), uid: JAIL_ID, gid: JAIL_ID }));

        spec.disk = Some(PathBuf::from("/s/session.img"));
        let cfg = vm_config(&spec, Path::new("/r/vsock/vsock.sock"), None, false).unwrap();
        assert_eq!(
            cfg.disks,
            [
                DiskConfig { path: "/b/root.erofs".into(), read_only: true },
                DiskConfig { path: "/s/session.img".into(), read_only: false },
            ]
        );
        spec.cpus = 300;
        assert!(vm_config(&spec, Path::new("/r/vsock/vsock.sock"), None, false).is_err());
    }
}
