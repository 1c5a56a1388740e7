//! What a VM is asked to be ([`VmSpec`], from a [`BootImage`]), what a backend is and can do
//! ([`BackendKind`], [`Capabilities`]), and the folders and snapshots it is given: the data
//! every backend and every caller shares.

use std::path::{Path, PathBuf};
use std::time::Duration;

use umbra_bundle::{Arch, ArtifactRole, BundleError, ExtractedBundle};
use umbra_sys::FolderIdentity;

use super::error::VmError;

pub const DEFAULT_BOOT_TIMEOUT: Duration = Duration::from_secs(30);
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
    pub const ALL: [BackendKind; 3] = [BackendKind::Kvm, BackendKind::Qemu, BackendKind::Vz];

    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Kvm => "kvm",
            BackendKind::Qemu => "qemu",
            BackendKind::Vz => "vz",
        }
    }

    /// The choice that asks for this backend by name.
    pub fn choice(self) -> umbra_api::BackendChoice {
        match self {
            BackendKind::Kvm => umbra_api::BackendChoice::Kvm,
            BackendKind::Qemu => umbra_api::BackendChoice::Qemu,
            BackendKind::Vz => umbra_api::BackendChoice::Vz,
        }
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

/// What a backend can do, as data: callers ask this rather than match on the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// [`Vm::snapshot`] and [`VmSpec::restore`] work.
    pub snapshot: bool,
    /// [`Vm::fork`] works: a snapshot the running VM survives (a live fork).
    pub live_fork: bool,
    /// A share can keep `.git` read-only and hide ignored files ([`Protection`]).
    pub folder_protection: bool,
    /// The guest architectures it boots at all.
    pub guest_arches: &'static [Arch],
    /// It runs guests of an architecture other than the host's (by emulating them).
    pub emulates: bool,
}

impl Capabilities {
    /// Whether backend `kind` with these capabilities can run `image` here.
    pub fn check_arch(&self, kind: BackendKind, image: &BootImage) -> Result<(), VmError> {
        if image.arch != Arch::host() && !self.emulates {
            return Err(VmError::WrongArch {
                version: image.version.clone(),
                guest: image.arch,
                host: Arch::host(),
                backend: kind.name(),
            });
        }
        if !self.guest_arches.contains(&image.arch) {
            let arches: Vec<&str> = self.guest_arches.iter().map(|a| a.as_str()).collect();
            return Err(VmError::BackendUnavailable(format!(
                "bundle {} is {}: the {} backend boots {} guests only",
                image.version,
                image.arch,
                kind.name(),
                arches.join(" and ")
            )));
        }
        Ok(())
    }

    /// Whether `spec` asks for nothing these capabilities lack.
    pub fn check(&self, kind: BackendKind, spec: &VmSpec) -> Result<(), VmError> {
        self.check_arch(kind, &spec.image)?;
        if spec.restore.is_some() && !self.snapshot {
            return Err(VmError::BackendUnavailable(format!(
                "the {} backend cannot restore a snapshot: snapshots need the kvm backend (umbra-vmm)",
                kind.name()
            )));
        }
        Ok(())
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
    /// For a bundle converted from an OCI image: its config's defaults for processes.
    pub image: Option<umbra_bundle::ImageInfo>,
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
            image: b.manifest.image.clone(),
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

/// One folder in a VM's folder share (see `Vm::add_folder`).
#[derive(Debug, Clone)]
pub struct SharedFolder {
    pub name: String,
    pub source: PathBuf,
    pub read_only: bool,
    pub protection: Protection,
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

/// What umbra-fsd enforces inside a share beyond its mode (a sandbox policy's filesystem
/// fields): `.git` read-only, files matching gitignore patterns never opened for the guest.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Protection {
    pub protect_git: bool,
    pub hide: Vec<String>,
}
