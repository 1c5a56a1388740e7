//! A real virtiofsd for tests, serving a fresh directory. Shared by the lane-(a) device tests
//! (`src/devices/virtio/fs/tests.rs`) and the lane-(b) tests in this folder, which both include
//! this file by path; each uses part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// virtiofsd: `UMBRA_VIRTIOFSD`, `~/.cargo/bin/virtiofsd` or `PATH`. A missing one fails the test
/// (scripts/install-deps provides it).
pub fn virtiofsd_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("UMBRA_VIRTIOFSD") {
        return path.into();
    }
    let home = std::env::var_os("HOME").map(|h| Path::new(&h).join(".cargo/bin/virtiofsd"));
    let on_path = std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).map(|p| p.join("virtiofsd")).find(|p| p.is_file()));
    home.filter(|p| p.is_file())
        .or(on_path)
        .expect("virtiofsd not found (scripts/install-deps, or set UMBRA_VIRTIOFSD)")
}

/// A virtiofsd serving `dir/shared` on `dir/fs.sock`; killed, and `dir` removed, on drop.
pub struct Virtiofsd {
    child: Child,
    dir: PathBuf,
    pub shared: PathBuf,
    pub socket: PathBuf,
}

impl Virtiofsd {
    /// Starts virtiofsd (unsandboxed, with `extra_args`) and returns once its socket listens.
    pub fn start(dir: PathBuf, extra_args: &[&str]) -> Virtiofsd {
        let binary = virtiofsd_binary();
        let shared = dir.join("shared");
        std::fs::create_dir(&shared).unwrap();
        let socket = dir.join("fs.sock");
        let child = Command::new(&binary)
            .arg("--shared-dir")
            .arg(&shared)
            .arg("--socket-path")
            .arg(&socket)
            .args(["--sandbox", "none", "--log-level", "error"])
            .args(extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", binary.display()));
        let mut fs = Virtiofsd { child, dir, shared, socket };
        let started = Instant::now();
        while !umbra_sys::unix_socket_listening(&fs.socket) {
            if let Some(status) = fs.child.try_wait().unwrap() {
                panic!("virtiofsd exited before listening: {status}");
            }
            assert!(started.elapsed() < Duration::from_secs(10), "virtiofsd did not listen on {}", fs.socket.display());
            std::thread::sleep(Duration::from_millis(5));
        }
        eprintln!("virtiofsd listening after {:?}", started.elapsed());
        fs
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Virtiofsd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
