//! The microVM an `umbra-vmm` process runs, as JSON (`--config vm.json`).
//!
//! ```json
//! { "kernel": "vmlinux", "initrd": "initramfs.cpio.zst", "cmdline": "console=ttyS0 reboot=k",
//!   "cpus": 2, "memory_mib": 512,
//!   "disks": [{ "path": "rootfs.erofs", "read_only": true }, { "path": "scratch.img" }],
//!   "vsock": { "guest_cid": 3, "uds_path": "/run/user/1000/umbra/vms/x/vsock.sock" },
//!   "fs": [{ "tag": "work", "socket": "/run/user/1000/umbra/vms/x/fs-work.sock" }],
//!   "console_log": "console.log", "rng": true,
//!   "jail": { "dir": "/run/user/1000/umbra/vms/x/vsock", "uid": 65534, "gid": 65534 } }
//! ```

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    pub kernel: PathBuf,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initrd: Option<PathBuf>,
    #[serde(default)]
    pub cmdline: String,
    #[serde(default = "default_cpus")]
    pub cpus: u8,
    #[serde(default = "default_memory_mib")]
    pub memory_mib: u32,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<DiskConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock: Option<VsockConfig>,
    /// Shared folders: one virtio-fs device per entry, served by the virtiofsd listening on
    /// `socket` (started by whoever launches the VM, before it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fs: Vec<FsConfig>,
    /// Where the serial console goes; standard output when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub console_log: Option<PathBuf>,
    #[serde(default = "default_true")]
    pub rng: bool,
    /// A virtio-balloon taking the guest's free page reports (the pages go back to the host);
    /// the last device. Off unless asked for: a snapshot taken without one restores without one.
    #[serde(default)]
    pub balloon: bool,
    /// Run confined in a jail; absent: unconfined but for seccomp.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jail: Option<JailConfig>,
    /// A Unix socket where the VMM takes requests while the guest runs ([`crate::control`]);
    /// in a jail, it must be directly in the jail dir.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control: Option<PathBuf>,
}

impl VmConfig {
    /// A config booting `kernel` with every other field at its default.
    pub fn new(kernel: PathBuf) -> Self {
        Self {
            kernel,
            initrd: None,
            cmdline: String::new(),
            cpus: default_cpus(),
            memory_mib: default_memory_mib(),
            disks: Vec::new(),
            vsock: None,
            fs: Vec::new(),
            console_log: None,
            rng: default_true(),
            balloon: false,
            jail: None,
            control: None,
        }
    }

    /// The virtio devices this config asks for (each takes one interrupt line).
    pub fn device_count(&self) -> u32 {
        self.disks.len() as u32
            + self.vsock.is_some() as u32
            + self.fs.len() as u32
            + self.rng as u32
            + self.balloon as u32
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JailConfig {
    /// The jail's root: an existing directory that holds the vsock socket, where host services
    /// listen for the guest's connections (`<uds_path>_<port>`). The VMM sees nothing else.
    pub dir: PathBuf,
    /// The user and group the VMM runs as when started as root (never 0); started as another
    /// user it keeps its own, in a user namespace.
    #[serde(default = "nobody")]
    pub uid: u32,
    #[serde(default = "nobody")]
    pub gid: u32,
}

/// `nobody`/`nogroup`: owns no files, so a process running as it can open none. A jailed
/// umbra-vmm, QEMU and vhost-device-vsock run as it when the runtime is root.
pub const NOBODY: u32 = 65534;

fn nobody() -> u32 {
    NOBODY
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskConfig {
    pub path: PathBuf,
    #[serde(default)]
    pub read_only: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsockConfig {
    pub guest_cid: u64,
    /// The hybrid vsock socket: hosts connect here and send `CONNECT <port>\n`; guest
    /// connections to host port P go to `<uds_path>_P`.
    pub uds_path: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FsConfig {
    /// The name the guest mounts it by (`mount -t virtiofs TAG DIR`): 1 to 36 bytes.
    pub tag: String,
    /// virtiofsd's vhost-user socket.
    pub socket: PathBuf,
}

fn default_cpus() -> u8 {
    1
}
fn default_memory_mib() -> u32 {
    256
}
fn default_true() -> bool {
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_and_an_empty_json_agree_on_every_default() {
        let parsed: VmConfig = serde_json::from_str(r#"{"kernel":"vmlinux"}"#).unwrap();
        assert_eq!(parsed, VmConfig::new("vmlinux".into()));
        assert_eq!((parsed.cpus, parsed.memory_mib, parsed.rng), (1, 256, true));
        assert_eq!(parsed.device_count(), 1, "rng");
    }

    #[test]
    fn it_round_trips_and_refuses_unknown_fields() {
        let mut c = VmConfig::new("k".into());
        c.fs.push(FsConfig { tag: "t".into(), socket: "/s".into() });
        c.jail = Some(JailConfig { dir: "/j".into(), uid: NOBODY, gid: NOBODY });
        let text = serde_json::to_string(&c).unwrap();
        assert_eq!(serde_json::from_str::<VmConfig>(&text).unwrap(), c);
        let e = serde_json::from_str::<VmConfig>(r#"{"kernel":"k","memory":1}"#).unwrap_err();
        assert!(e.to_string().contains("unknown field `memory`"), "{e}");
    }
}
