//! A VM's private run directory (`$XDG_RUNTIME_DIR/umbra/vms/<id>/`): its sockets and console
//! log. Mode 0700, removed when the VM ends. The hybrid vsock sockets live apart, in
//! [`VSOCK_DIR`]: a jailed umbra-vmm's whole filesystem is that directory.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

pub struct RunDir {
    path: PathBuf,
}

impl RunDir {
    pub fn create(id: &str) -> std::io::Result<Self> {
        // The runtime directory must be ours and private (in the /tmp fallback another user
        // could have made it first); below it, everything is ours.
        let vms = umbra_api::paths::private_runtime_dir().map_err(std::io::Error::other)?.join("vms");
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&vms)?;
        sweep_dead(&vms);
        let path = vms.join(id);
        std::fs::DirBuilder::new().mode(0o700).create(&path)?;
        std::fs::DirBuilder::new().mode(0o700).create(path.join(VSOCK_DIR))?;
        Ok(Self { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// The directory of a VM's hybrid vsock sockets, in its run directory: the socket the host
/// connects to the guest through, and the `<socket>_<port>` listeners of host services.
pub const VSOCK_DIR: &str = "vsock";

/// The hybrid vsock socket of the VM whose run directory is `run`.
pub fn vsock_socket(run: &Path) -> PathBuf {
    run.join(VSOCK_DIR).join("vsock.sock")
}

/// Where a host service listens for the guest's connections to vsock port `port`.
pub fn vsock_port_socket(run: &Path, port: u32) -> PathBuf {
    run.join(VSOCK_DIR).join(format!("vsock.sock_{port}"))
}

/// Lets a jailed umbra-vmm, which runs as another user, connect to a host service's socket
/// (connecting needs write permission on it). Only that user and the owner can reach it: the
/// directory is 0700 and belongs to the VMM's user (see `kvm::launch`).
pub fn open_to_vmm(socket: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o666))
}

/// Removes run directories left by an owner that died without cleaning up (SIGKILL: its VMM
/// died with it through PDEATHSIG, but nothing removed the directory). Ids start with the
/// owner's pid in hex; a directory whose owner still runs (or whose pid was reused) is kept.
fn sweep_dead(vms: &Path) {
    for entry in std::fs::read_dir(vms).into_iter().flatten().flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.split('-').next()).and_then(|p| u32::from_str_radix(p, 16).ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// A VM id unique on this host: time and pid based, short enough for socket paths (108 bytes).
pub fn new_vm_id() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    format!("{:x}-{:x}-{}", std::process::id(), (nanos as u64) & 0xffff_ffff, SEQ.fetch_add(1, Ordering::Relaxed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_dirs_of_dead_owners_are_swept_and_live_ones_kept() {
        let root = std::env::temp_dir().join(format!("umbra-sweep-{}", std::process::id()));
        let vms = root.join("vms");
        let dead = vms.join("7ffffffe-1-0"); // pid 0x7ffffffe is above pid_max: never alive
        let alive = vms.join(format!("{:x}-1-0", std::process::id()));
        let foreign = vms.join("not-a-vm");
        for d in [&dead, &alive, &foreign] {
            std::fs::create_dir_all(d).unwrap();
        }
        sweep_dead(&vms);
        assert!(!dead.exists() && alive.exists() && foreign.exists());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
