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

/// Finds a helper binary: an explicit override, then PATH, then `~/.cargo/bin` (where
/// `cargo install` puts vhost-device-vsock and virtiofsd).
pub fn find_binary(name: &str, env_override: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(env_override) {
        // An override that points nowhere is "not found", not a silent fallback to PATH.
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs: Vec<PathBuf> = std::env::split_paths(&path).collect();
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(PathBuf::from(home).join(".cargo/bin"));
    }
    dirs.into_iter().map(|d| d.join(name)).find(|p| p.is_file())
}
