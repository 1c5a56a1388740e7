//! What this host can run: the kind of KVM it has, and where the helper binaries are.

use std::path::PathBuf;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvmKind {
    /// /dev/kvm backed by VT-x or AMD-V: guests run at native speed.
    Hardware,
    /// /dev/kvm is kvm_pvm, a software hypervisor that cannot boot an ordinary Linux kernel.
    Pvm,
    /// No usable /dev/kvm.
    Absent,
}

impl KvmKind {
    pub fn detect() -> Self {
        let usable = std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm").is_ok();
        if !usable {
            return KvmKind::Absent;
        }
        if std::path::Path::new("/sys/module/kvm_pvm").exists() {
            return KvmKind::Pvm;
        }
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let virt = cpuinfo
            .lines()
            .filter(|l| l.starts_with("flags"))
            .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"));
        if virt {
            KvmKind::Hardware
        } else {
            KvmKind::Pvm
        }
    }
}

/// A program Umbra runs: where it is looked for and how to get it. The one table vmctl,
/// umbrad, the backends and `vmctl doctor` share.
#[derive(Debug, Clone, Copy)]
pub struct Program {
    pub name: &'static str,
    /// An environment variable that names it explicitly (then nothing else is searched).
    pub env: &'static str,
    /// One of Umbra's own binaries: looked for next to the running one first (vmctl, umbrad,
    /// umbra-vmm and umbra-fsd ship together).
    pub ships_with_umbra: bool,
    /// Searched after PATH (sbin directories a non-root PATH often lacks).
    pub also_in: &'static [&'static str],
    /// What to do when it is missing.
    pub fix: &'static str,
}

pub const QEMU: Program = Program {
    name: "qemu-system-x86_64",
    env: "UMBRA_QEMU",
    ships_with_umbra: false,
    also_in: &[],
    fix: "run scripts/install-deps (apt-get install qemu-system-x86)",
};
/// The emulator for arm64 guests (QEMU `-M virt`; TCG on an x86_64 host).
pub const QEMU_AARCH64: Program = Program {
    name: "qemu-system-aarch64",
    env: "UMBRA_QEMU_AARCH64",
    ships_with_umbra: false,
    also_in: &[],
    fix: "run scripts/install-deps (apt-get install qemu-system-arm)",
};
pub const VHOST_VSOCK: Program = Program {
    name: "vhost-device-vsock",
    env: "UMBRA_VHOST_VSOCK",
    ships_with_umbra: false,
    also_in: &[],
    fix: "run scripts/install-deps (cargo install --locked vhost-device-vsock@0.3.0)",
};
pub const VIRTIOFSD: Program = Program {
    name: "virtiofsd",
    env: "UMBRA_VIRTIOFSD",
    ships_with_umbra: false,
    also_in: &[],
    fix: "run scripts/install-deps (cargo install --locked virtiofsd@1.14.0)",
};
pub const MKFS_EXT4: Program = Program {
    name: "mkfs.ext4",
    env: "UMBRA_MKFS_EXT4",
    ships_with_umbra: false,
    also_in: &["/usr/sbin", "/sbin"],
    fix: "apt-get install e2fsprogs",
};
pub const UMBRA_VMM: Program = Program {
    name: "umbra-vmm",
    env: "UMBRA_VMM_BIN",
    ships_with_umbra: true,
    also_in: &[],
    fix: "run scripts/install (it builds umbra-vmm and keeps it next to vmctl and umbrad), or set UMBRA_VMM_BIN",
};
pub const UMBRA_FSD: Program = Program {
    name: "umbra-fsd",
    env: "UMBRA_FSD_BIN",
    ships_with_umbra: true,
    also_in: &[],
    fix: "run scripts/install (it builds umbra-fsd and keeps it next to vmctl and umbrad), or set UMBRA_FSD_BIN",
};
pub const UMBRAD: Program = Program {
    name: "umbrad",
    env: "UMBRA_UMBRAD_BIN",
    ships_with_umbra: true,
    also_in: &[],
    fix: "run scripts/install (it builds umbrad next to vmctl)",
};

/// Every program, in the order `vmctl doctor` lists them.
pub const PROGRAMS: [Program; 8] =
    [QEMU, QEMU_AARCH64, UMBRA_VMM, VHOST_VSOCK, VIRTIOFSD, UMBRA_FSD, UMBRAD, MKFS_EXT4];

impl Program {
    /// The override, else (for Umbra's own) next to the running executable, else PATH, then
    /// `~/.cargo/bin` (where `cargo install` puts vhost-device-vsock and virtiofsd), then
    /// [`Program::also_in`]. An override that points nowhere is "not found", never a silent
    /// fallback.
    pub fn find(&self) -> Option<PathBuf> {
        if let Some(p) = std::env::var_os(self.env) {
            return Some(PathBuf::from(p)).filter(|p| p.is_file());
        }
        if self.ships_with_umbra {
            if let Some(p) = beside_current_exe(self.name) {
                return Some(p);
            }
        }
        let path = std::env::var_os("PATH").unwrap_or_default();
        let mut dirs: Vec<PathBuf> = std::env::split_paths(&path).collect();
        if let Some(home) = std::env::var_os("HOME") {
            dirs.push(PathBuf::from(home).join(".cargo/bin"));
        }
        dirs.extend(self.also_in.iter().map(PathBuf::from));
        dirs.into_iter().map(|d| d.join(self.name)).find(|p| p.is_file())
    }

    /// [`Program::find`], or the error that says how to get it.
    pub fn require(&self) -> Result<PathBuf, super::VmError> {
        self.find().ok_or(super::VmError::Missing { what: self.name, fix: self.fix })
    }
}

/// `name` in the directory of the running executable (Umbra's binaries ship together), or one
/// level up (test binaries live in `target/<profile>/deps`).
pub fn beside_current_exe(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?.to_path_buf();
    [dir.join(name), dir.parent()?.join(name)].into_iter().find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_override_that_points_nowhere_is_not_found() {
        let p = Program { env: "UMBRA_TEST_NO_SUCH_OVERRIDE", ..MKFS_EXT4 };
        std::env::set_var(p.env, "/nonexistent/mkfs.ext4");
        assert!(p.find().is_none());
        let e = p.require().unwrap_err().to_string();
        assert!(e.contains("mkfs.ext4") && e.contains("e2fsprogs"), "{e}");
        std::env::remove_var(p.env);
        let names: std::collections::HashSet<_> = PROGRAMS.iter().map(|p| p.name).collect();
        assert_eq!(names.len(), PROGRAMS.len());
    }
}
