//! The microVM a `umbra-vmm` process runs, as JSON (`--config vm.json`) and/or flags. The
//! types are the runtime's contract with umbra-vmm (`umbra_contract::vm`); what this machine can
//! build of them is checked here ([`validate`]).
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

use std::path::Path;

pub use umbra_contract::vm::{DiskConfig, FsConfig, JailConfig, VmConfig, VsockConfig, NOBODY};

use crate::boot::layout::{IRQ_MAX, VIRTIO_IRQ_START};
use crate::boot::mptable::MAX_CPUS;
use crate::devices::virtio::fs::device::{tag_is_valid, MAX_TAG_LEN};

/// Memory bounds: enough for a kernel and initramfs; at most what the host has, and never
/// more than a 64-bit guest with our page tables can address sensibly.
pub const MIN_MEMORY_MIB: u32 = 32;
pub const MAX_MEMORY_MIB: u32 = 1 << 20;
/// Disks, vsock, fs and rng each take one IRQ between VIRTIO_IRQ_START and IRQ_MAX.
pub const MAX_DEVICES: u32 = IRQ_MAX - VIRTIO_IRQ_START + 1;
/// Shared folders per VM: each is a virtiofsd process, two queues and a thread.
pub const MAX_FS_DEVICES: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("{path} is not a valid VM config: {source}")]
    Parse { path: String, source: serde_json::Error },
    #[error("{0}")]
    Invalid(String),
}

/// Reads a config from a JSON file.
pub fn from_file(path: &Path) -> Result<VmConfig, ConfigError> {
    let text = std::fs::read(path).map_err(|source| ConfigError::Read { path: path.display().to_string(), source })?;
    serde_json::from_slice(&text).map_err(|source| ConfigError::Parse { path: path.display().to_string(), source })
}

/// Whether this VMM can build `cfg`: counts, ranges, names and the jail's layout.
pub fn validate(cfg: &VmConfig) -> Result<(), ConfigError> {
    let invalid = |m: String| Err(ConfigError::Invalid(m));
    if cfg.cpus == 0 || cfg.cpus > MAX_CPUS {
        return invalid(format!("cpus must be 1 to {MAX_CPUS}, not {}", cfg.cpus));
    }
    if !(MIN_MEMORY_MIB..=MAX_MEMORY_MIB).contains(&cfg.memory_mib) {
        return invalid(format!("memory_mib must be {MIN_MEMORY_MIB} to {MAX_MEMORY_MIB}, not {}", cfg.memory_mib));
    }
    if cfg.device_count() > MAX_DEVICES {
        return invalid(format!("{} virtio devices requested; at most {MAX_DEVICES} fit", cfg.device_count()));
    }
    if let Some(v) = &cfg.vsock {
        // 0–2 are reserved (hypervisor, local, host); u32::MAX is VMADDR_CID_ANY.
        if v.guest_cid < 3 || v.guest_cid >= u32::MAX as u64 {
            return invalid(format!("vsock guest_cid must be 3 to {}, not {}", u32::MAX - 1, v.guest_cid));
        }
    }
    if cfg.fs.len() > MAX_FS_DEVICES {
        return invalid(format!("{} shared folders (fs) requested; at most {MAX_FS_DEVICES}", cfg.fs.len()));
    }
    if let Some(jail) = &cfg.jail {
        if !jail.dir.is_absolute() {
            return invalid(format!("jail dir {} must be an absolute path", jail.dir.display()));
        }
        if jail.uid == 0 || jail.gid == 0 {
            return invalid("the jail's uid and gid must not be 0 (root)".to_string());
        }
        match &cfg.vsock {
            Some(v) if v.uds_path.parent() == Some(jail.dir.as_path()) => {}
            _ => {
                return invalid(format!(
                    "a jailed VMM needs its vsock socket directly in the jail dir {}",
                    jail.dir.display()
                ))
            }
        }
    }
    for (i, f) in cfg.fs.iter().enumerate() {
        if !tag_is_valid(&f.tag) {
            return invalid(format!("fs tag {:?} must be 1 to {MAX_TAG_LEN} bytes and contain no NUL", f.tag));
        }
        if cfg.fs[..i].iter().any(|earlier| earlier.tag == f.tag) {
            return invalid(format!("fs tag {:?} is used twice; the guest mounts shares by tag", f.tag));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_minimal_config_gets_defaults() {
        let c: VmConfig = serde_json::from_str(r#"{"kernel":"vmlinux"}"#).unwrap();
        assert_eq!((c.cpus, c.memory_mib, c.rng), (1, 256, true));
        validate(&c).unwrap();
    }

    #[test]
    fn typos_and_bad_values_are_refused_by_name() {
        let e = serde_json::from_str::<VmConfig>(r#"{"kernel":"k","memory":1}"#).unwrap_err().to_string();
        assert!(e.contains("unknown field `memory`"), "{e}");
        let mut c: VmConfig = serde_json::from_str(r#"{"kernel":"k","cpus":0}"#).unwrap();
        assert!(validate(&c).unwrap_err().to_string().contains("cpus must be 1 to 32"));
        c.cpus = 1;
        c.vsock = Some(VsockConfig { guest_cid: 2, uds_path: "s".into() });
        assert!(validate(&c).unwrap_err().to_string().contains("guest_cid"));
        c.vsock = None;
        c.disks = (0..20).map(|i| DiskConfig { path: format!("d{i}").into(), read_only: true }).collect();
        assert!(validate(&c).unwrap_err().to_string().contains("virtio devices"));
    }

    #[test]
    fn a_jail_holds_the_vsock_socket_and_never_runs_as_root() {
        let mut c: VmConfig = serde_json::from_str(
            r#"{"kernel":"k","vsock":{"guest_cid":3,"uds_path":"/r/j/v.sock"},"jail":{"dir":"/r/j"}}"#,
        )
        .unwrap();
        assert_eq!(c.jail, Some(JailConfig { dir: "/r/j".into(), uid: NOBODY, gid: NOBODY }));
        validate(&c).unwrap();
        let jail = c.jail.clone().unwrap();
        c.jail = Some(JailConfig { dir: "/r".into(), ..jail.clone() });
        assert!(validate(&c).unwrap_err().to_string().contains("directly in the jail dir /r"));
        c.jail = Some(JailConfig { dir: "r/j".into(), ..jail.clone() });
        assert!(validate(&c).unwrap_err().to_string().contains("absolute"));
        c.jail = Some(JailConfig { uid: 0, ..jail.clone() });
        assert!(validate(&c).unwrap_err().to_string().contains("not be 0"));
        c.jail = Some(jail);
        c.vsock = None;
        assert!(validate(&c).unwrap_err().to_string().contains("needs its vsock socket"));
    }

    #[test]
    fn shared_folders_are_counted_and_their_tags_checked() {
        let mut c: VmConfig =
            serde_json::from_str(r#"{"kernel":"k","fs":[{"tag":"work","socket":"/run/fs.sock"}]}"#).unwrap();
        assert_eq!(c.fs, vec![FsConfig { tag: "work".into(), socket: "/run/fs.sock".into() }]);
        assert_eq!(c.device_count(), 2, "fs + rng");
        validate(&c).unwrap();
        let e = serde_json::from_str::<VmConfig>(r#"{"kernel":"k","fs":[{"tag":"t","path":"s"}]}"#).unwrap_err();
        assert!(e.to_string().contains("unknown field `path`"), "{e}");
        assert!(!serde_json::to_string(&VmConfig { fs: vec![], ..c.clone() }).unwrap().contains("fs"));

        for bad in ["", "a\0b", &"x".repeat(37)] {
            c.fs[0].tag = bad.to_string();
            assert!(validate(&c).unwrap_err().to_string().contains("fs tag"), "{bad:?}");
        }
        c.fs[0].tag = "x".repeat(36);
        validate(&c).unwrap();
        c.fs.push(c.fs[0].clone());
        assert!(validate(&c).unwrap_err().to_string().contains("used twice"));
        c.fs = (0..9).map(|i| FsConfig { tag: format!("t{i}"), socket: "s".into() }).collect();
        assert!(validate(&c).unwrap_err().to_string().contains("at most 8"));
    }
}
