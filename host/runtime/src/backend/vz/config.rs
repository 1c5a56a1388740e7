//! The VM a `vz` launch asks Virtualization.framework for, as plain data: [`vz_config`] maps a
//! [`VmSpec`] onto it, and the macOS shim ([`super::machine`]) turns each item into the VZ
//! object of the same name, one for one. Kept free of Objective-C so the mapping is unit-tested
//! on every host.

use std::path::{Path, PathBuf};

use crate::backend::{VmError, VmSpec};

/// The guest console is a virtio console (`hvc0`); a reboot or a panic is a PSCI call that
/// stops the VM (Virtualization.framework has no "reboot": the VM just stops).
pub const VZ_CMDLINE: &str = "console=hvc0 quiet panic=-1";
/// Virtualization.framework sizes guest memory in bytes, in whole MiB.
const MIB: u64 = 1 << 20;
/// The smallest guest Virtualization.framework accepts
/// (`VZVirtualMachineConfiguration.minimumAllowedMemorySize` is 128 MiB on every release so far).
pub const MIN_MEMORY_MIB: u32 = 128;

/// `VZVirtualMachineConfiguration` with a `VZLinuxBootLoader`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VzConfig {
    /// `VZLinuxBootLoader.kernelURL`: the arm64 `Image` (uncompressed).
    pub kernel: PathBuf,
    /// `VZLinuxBootLoader.initialRamdiskURL`.
    pub initrd: Option<PathBuf>,
    /// `VZLinuxBootLoader.commandLine`.
    pub cmdline: String,
    /// `cpuCount`.
    pub cpus: u32,
    /// `memorySize`.
    pub memory_bytes: u64,
    /// In the order they are configured; block devices become `vda`, `vdb`, … in this order.
    pub devices: Vec<VzDevice>,
}

/// One device of the VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VzDevice {
    /// `VZVirtioBlockDeviceConfiguration` over a `VZDiskImageStorageDeviceAttachment`.
    Block { path: PathBuf, read_only: bool },
    /// `VZVirtioSocketDeviceConfiguration`: the host connects to the agent on `agent_port` and
    /// listens (`VZVirtioSocketListener`) for its readiness announcement on `ready_port`.
    Socket { agent_port: u32, ready_port: u32 },
    /// `VZVirtioFileSystemDeviceConfiguration` whose share is a `VZMultipleDirectoryShare`:
    /// each folder one `VZSharedDirectory`, read-only where the host must not be written
    /// (`ro`, `shadow`), writable otherwise; the agent gives each mode its semantics as on
    /// Linux. The share set is replaced on the running VM when a folder is added or removed.
    FileSystem { tag: String, shares: Vec<VzShare> },
    /// `VZVirtioEntropyDeviceConfiguration`: the guest's RNG is seeded from the host's.
    Entropy,
    /// `VZVirtioConsoleDeviceSerialPortConfiguration` with a `VZFileHandleSerialPortAttachment`
    /// writing into a pipe, which the runtime copies into `log` under the same size cap as on
    /// Linux (a guest flooding its console cannot fill the host's disk).
    Console { log: PathBuf },
}

/// A host folder in the file system device's share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VzShare {
    /// The directory name under the share's mount point in the guest.
    pub name: String,
    pub path: PathBuf,
    pub read_only: bool,
}

/// The configuration for `spec`, with the console written to `console_log`. Refuses a memory
/// size below the framework's minimum, which it would refuse later with a vaguer error (the
/// architecture was checked against the backend's capabilities before, by `Vm::launch`).
pub fn vz_config(spec: &VmSpec, console_log: &Path) -> Result<VzConfig, VmError> {
    if spec.memory_mib < MIN_MEMORY_MIB {
        return Err(VmError::BackendUnavailable(format!(
            "the vz backend needs at least {MIN_MEMORY_MIB} MiB of guest memory, not {}",
            spec.memory_mib
        )));
    }
    let mut devices = Vec::new();
    // The rootfs first, so the image's `root=/dev/vda` names it; the agent finds the session
    // disk by its label.
    if let Some(rootfs) = &spec.image.rootfs {
        devices.push(VzDevice::Block { path: rootfs.clone(), read_only: true });
    }
    if let Some(disk) = &spec.disk {
        devices.push(VzDevice::Block { path: disk.clone(), read_only: false });
    }
    devices.push(VzDevice::Socket {
        agent_port: umbra_proto::AGENT_VSOCK_PORT,
        ready_port: umbra_proto::AGENT_READY_VSOCK_PORT,
    });
    if spec.folder_sharing {
        devices.push(VzDevice::FileSystem { tag: crate::backend::fsd::FS_TAG.to_string(), shares: Vec::new() });
    }
    devices.push(VzDevice::Entropy);
    devices.push(VzDevice::Console { log: console_log.to_path_buf() });
    let cmdline = format!("{VZ_CMDLINE} {}", spec.image.cmdline);
    Ok(VzConfig {
        kernel: spec.image.kernel.clone(),
        initrd: spec.image.initrd.clone(),
        cmdline: cmdline.trim().to_string(),
        cpus: spec.cpus.max(1),
        memory_bytes: u64::from(spec.memory_mib) * MIB,
        devices,
    })
}

#[cfg(test)]
mod tests {
    use umbra_bundle::Arch;

    use super::*;
    use crate::backend::BootImage;

    fn spec(arch: Arch) -> VmSpec {
        let mut spec = VmSpec::new(BootImage {
            version: "standard-test".into(),
            arch,
            kernel: PathBuf::from("/b/Image"),
            initrd: None,
            rootfs: Some(PathBuf::from("/b/root.erofs")),
            cmdline: "root=/dev/vda rootfstype=erofs ro init=/sbin/umbra-agent".into(),
            image: None,
        });
        spec.cpus = 2;
        spec.memory_mib = 1024;
        spec.disk = Some(PathBuf::from("/s/disk.img"));
        spec.folder_sharing = true;
        spec
    }

    #[test]
    fn a_spec_maps_to_the_expected_devices_in_order() {
        let cfg = vz_config(&spec(Arch::Aarch64), Path::new("/r/console.log")).unwrap();
        assert_eq!(cfg.kernel, PathBuf::from("/b/Image"));
        assert_eq!(cfg.initrd, None);
        assert_eq!(cfg.cmdline, "console=hvc0 quiet panic=-1 root=/dev/vda rootfstype=erofs ro init=/sbin/umbra-agent");
        assert_eq!((cfg.cpus, cfg.memory_bytes), (2, 1 << 30));
        assert_eq!(
            cfg.devices,
            [
                VzDevice::Block { path: "/b/root.erofs".into(), read_only: true },
                VzDevice::Block { path: "/s/disk.img".into(), read_only: false },
                VzDevice::Socket { agent_port: 1024, ready_port: 1025 },
                VzDevice::FileSystem { tag: crate::backend::fsd::FS_TAG.into(), shares: vec![] },
                VzDevice::Entropy,
                VzDevice::Console { log: "/r/console.log".into() },
            ]
        );
    }

    #[test]
    fn a_minimal_spec_has_no_disks_and_no_file_system() {
        let mut s = spec(Arch::Aarch64);
        s.image.rootfs = None;
        s.image.initrd = Some(PathBuf::from("/b/initramfs"));
        s.disk = None;
        s.folder_sharing = false;
        let cfg = vz_config(&s, Path::new("/r/console.log")).unwrap();
        assert_eq!(cfg.initrd, Some(PathBuf::from("/b/initramfs")));
        assert!(cfg.devices.iter().all(|d| !matches!(d, VzDevice::Block { .. } | VzDevice::FileSystem { .. })));
        assert_eq!(cfg.devices.len(), 3, "{:?}", cfg.devices);
    }

    #[test]
    fn too_little_memory_is_refused_by_name() {
        let mut s = spec(Arch::Aarch64);
        s.memory_mib = 64;
        let e = vz_config(&s, Path::new("/c")).unwrap_err().to_string();
        assert!(e.contains("128 MiB"), "{e}");
    }
}
