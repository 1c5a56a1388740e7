//! Entering a private mount namespace — inside a new user namespace when unprivileged.

use nix::mount::{mount, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::unistd::{getegid, geteuid};

/// After this, mounts made by this process (and its children) are invisible outside it.
pub fn enter_private() -> Result<(), String> {
    let (uid, gid) = (geteuid(), getegid());
    if uid.is_root() {
        unshare(CloneFlags::CLONE_NEWNS).map_err(|e| format!("unshare(CLONE_NEWNS): {e}"))?;
    } else {
        unshare(CloneFlags::CLONE_NEWUSER | CloneFlags::CLONE_NEWNS).map_err(|e| {
            format!("unshare(CLONE_NEWUSER|CLONE_NEWNS): {e} (are unprivileged user namespaces enabled? sysctl kernel.unprivileged_userns_clone)")
        })?;
        // Map ourselves to root inside, so we may mount; nothing else is mapped.
        std::fs::write("/proc/self/setgroups", "deny").map_err(|e| format!("setgroups: {e}"))?;
        std::fs::write("/proc/self/uid_map", format!("0 {uid} 1")).map_err(|e| format!("uid_map: {e}"))?;
        std::fs::write("/proc/self/gid_map", format!("0 {gid} 1")).map_err(|e| format!("gid_map: {e}"))?;
    }
    // Nothing we mount may propagate back to the host's namespace (a slave receives, never
    // sends). What the host mounts under a shared mount still reaches us: the containerd shim
    // mounts a pod's later containers' rootfs under a shared directory after this server
    // started, and shares them (docs/kubernetes.md).
    mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_SLAVE, None::<&str>)
        .map_err(|e| format!("make / a slave: {e}"))
}
