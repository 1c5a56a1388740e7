//! A VM's private run directory (`$XDG_RUNTIME_DIR/umbra/vms/<id>/`): its sockets and console
//! log. Mode 0700, removed when the VM ends.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

pub struct RunDir {
    path: PathBuf,
}

fn runtime_root() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d).join("umbra"),
        // SAFETY: getuid cannot fail and has no memory effects.
        _ => std::env::temp_dir().join(format!("umbra-{}", unsafe { libc::getuid() })),
    }
}

impl RunDir {
    pub fn create(id: &str) -> std::io::Result<Self> {
        let vms = runtime_root().join("vms");
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&vms)?;
        let path = vms.join(id);
        std::fs::DirBuilder::new().mode(0o700).create(&path)?;
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

/// A VM id unique on this host: time and pid based, short enough for socket paths (108 bytes).
pub fn new_vm_id() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    format!("{:x}-{:x}-{}", std::process::id(), (nanos as u64) & 0xffff_ffff, SEQ.fetch_add(1, Ordering::Relaxed))
}
