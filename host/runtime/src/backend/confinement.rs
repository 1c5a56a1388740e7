//! What confines a helper process, read from the kernel rather than from what was asked:
//! its user and capabilities, its seccomp mode, `no_new_privs`, and which namespaces it shares
//! with the caller. `vmctl doctor` lists every running helper's; the escape suite asserts on it.

use std::path::Path;

/// The processes a VM's guest talks to, by the name the kernel shows (`comm`, 15 bytes).
pub const HELPER_NAMES: [&str; 5] = ["qemu-system-", "umbra-vmm", "umbra-fsd", "virtiofsd", "vhost-device-vs"];

/// One process's confinement, as `/proc/<pid>` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Confinement {
    pub pid: u32,
    /// The kernel's name for it (`comm`).
    pub name: String,
    /// Real, effective uid and gid as the host sees them.
    pub uid: u32,
    pub gid: u32,
    /// Effective capabilities (hex, as in `/proc/<pid>/status`); all zeros is none.
    pub cap_eff: String,
    /// 0 none, 1 strict, 2 filter.
    pub seccomp: u8,
    pub no_new_privs: bool,
    /// The namespaces it does not share with the process asking (`mnt`, `pid`, `net`, `user`,
    /// `ipc`, `uts`).
    pub own_namespaces: Vec<String>,
}

impl Confinement {
    /// Reads process `pid`; `None` if it is gone or unreadable.
    pub fn of(pid: u32) -> Option<Confinement> {
        let proc = Path::new("/proc").join(pid.to_string());
        let status = std::fs::read_to_string(proc.join("status")).ok()?;
        let field = |name: &str| {
            status.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(':')).map(str::trim))
        };
        // "Uid: real effective saved fs": the effective one decides.
        let id = |name: &str| field(name)?.split_whitespace().nth(1)?.parse().ok();
        let mut own_namespaces = Vec::new();
        for ns in ["mnt", "pid", "net", "user", "ipc", "uts"] {
            let theirs = std::fs::read_link(proc.join("ns").join(ns)).ok();
            let ours = std::fs::read_link(Path::new("/proc/self/ns").join(ns)).ok();
            if theirs.is_some() && theirs != ours {
                own_namespaces.push(ns.to_string());
            }
        }
        Some(Confinement {
            pid,
            name: std::fs::read_to_string(proc.join("comm")).ok()?.trim().to_string(),
            uid: id("Uid")?,
            gid: id("Gid")?,
            cap_eff: field("CapEff")?.to_string(),
            seccomp: field("Seccomp").and_then(|v| v.parse().ok()).unwrap_or(0),
            no_new_privs: field("NoNewPrivs") == Some("1"),
            own_namespaces,
        })
    }

    /// No effective capability.
    pub fn no_capabilities(&self) -> bool {
        self.cap_eff.chars().all(|c| c == '0')
    }

    /// Every running helper process on this host (any user's VMs the caller may read).
    pub fn helpers() -> Vec<Confinement> {
        let mut found = Vec::new();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse::<u32>().ok()) else { continue };
            let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
            if HELPER_NAMES.iter().any(|h| comm.trim().starts_with(h)) {
                found.extend(Confinement::of(pid));
            }
        }
        found
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::Confinement;

    #[test]
    fn a_process_reads_as_itself_and_a_filtered_child_shows_its_filter() {
        let me = Confinement::of(std::process::id()).unwrap();
        // SAFETY: geteuid has no preconditions.
        assert_eq!(me.uid, unsafe { libc::geteuid() });
        assert!(me.own_namespaces.is_empty(), "{me:?}");
        // A child that set no_new_privs and changed its uts namespace (if it may).
        let mut child = std::process::Command::new("sleep");
        child.arg("5");
        // SAFETY: prctl and unshare only, between fork and exec.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut child, || {
                libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
                libc::unshare(libc::CLONE_NEWUTS);
                Ok(())
            });
        }
        let mut child = child.spawn().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(100));
        let seen = Confinement::of(child.id()).unwrap();
        let _ = child.kill();
        let _ = child.wait();
        assert!(seen.no_new_privs, "{seen:?}");
        assert_eq!(seen.name, "sleep");
        if me.uid == 0 {
            assert_eq!(seen.own_namespaces, ["uts"], "{seen:?}");
        }
        assert!(Confinement::of(u32::MAX).is_none());
    }
}
