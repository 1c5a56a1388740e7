//! Where a pod's containers' rootfs are mounted: `/run/umbra-shim/<key>/<folder>`, keyed by
//! containerd's address, the namespace and the pod (so a `delete` after a crash finds it).
//! The directory is bound onto itself and made a shared mount before the VM's folder server
//! starts: that server's mount namespace is a slave of the host's, so a rootfs mounted here
//! later (a pod's second container) reaches it and can be shared with the running VM.

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use sha2::{Digest, Sha256};

const BASE: &str = "/run/umbra-shim";

/// The pod's directory (not created).
pub fn path(address: &str, namespace: &str, pod: &str) -> PathBuf {
    let key = Sha256::digest(format!("{address}\0{namespace}\0{pod}").as_bytes());
    let hex: String = key.iter().take(8).map(|b| format!("{b:02x}")).collect();
    Path::new(BASE).join(hex)
}

fn is_mount_point(dir: &Path) -> bool {
    let dir = dir.display().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(dir.as_str()))
}

/// Creates the directory as a shared mount, once.
pub fn ensure(dir: &Path) -> Result<PathBuf, String> {
    if is_mount_point(dir) {
        return Ok(dir.to_path_buf());
    }
    // Root's alone (0700): the rootfs mounted in it hold the images' files, which no other
    // user of the host may reach (containerd keeps its snapshots at 0700 for the same reason).
    for d in [Path::new(BASE), dir] {
        std::fs::DirBuilder::new()
            .mode(0o700)
            .recursive(true)
            .create(d)
            .map_err(|e| format!("{}: {e}", d.display()))?;
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| format!("{}: {e}", d.display()))?;
    }
    mount(Some(dir), dir, None::<&str>, MsFlags::MS_BIND, None::<&str>)
        .map_err(|e| format!("binding {} onto itself: {e}", dir.display()))?;
    mount(None::<&str>, dir, None::<&str>, MsFlags::MS_SHARED, None::<&str>)
        .map_err(|e| format!("making {} a shared mount: {e}", dir.display()))?;
    Ok(dir.to_path_buf())
}

/// Detaches everything mounted in the directory and removes it.
pub fn remove(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let _ = umount2(&e.path(), MntFlags::MNT_DETACH);
            let _ = std::fs::remove_dir(e.path());
        }
    }
    let _ = umount2(dir, MntFlags::MNT_DETACH);
    let _ = std::fs::remove_dir(dir);
}

/// [`remove`] once no container's rootfs is left in it.
pub fn remove_if_empty(dir: &Path) {
    if std::fs::read_dir(dir).is_ok_and(|mut entries| entries.next().is_none()) {
        remove(dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_get_their_own_directory() {
        let a = path("/run/containerd/containerd.sock", "k8s.io", "pod-a");
        assert_eq!(a, path("/run/containerd/containerd.sock", "k8s.io", "pod-a"));
        assert_ne!(a, path("/run/containerd/containerd.sock", "k8s.io", "pod-b"));
        assert_ne!(a, path("/run/containerd/containerd.sock", "default", "pod-a"));
        assert!(a.starts_with(BASE));
    }
}
