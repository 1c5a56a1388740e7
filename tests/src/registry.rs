//! Debian's `docker-registry` for tests that pull OCI images (`images`, `containerd`): on a
//! free port of 127.0.0.1, storing under the test's directory, started and stopped by the test.

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

pub const PASSWORD: &str = "secret-pass";
/// bcrypt of PASSWORD (docker-registry's htpasswd wants bcrypt).
const HTPASSWD: &str = "tester:$2b$10$u5y2yFM9JUzarR0RW9pm5OL12HfHX1ZEDqC56AfMTzlaj5BMd1LFS\n";

/// Debian's `docker-registry` on a free port of 127.0.0.1, storing under the test's directory,
/// optionally with basic auth; killed on drop.
pub struct Registry {
    child: Child,
    pub addr: String,
    storage: PathBuf,
}

impl Registry {
    pub fn start(dir: &Path, name: &str, auth: bool) -> Self {
        let root = dir.join(name);
        let storage = root.join("storage");
        std::fs::create_dir_all(&storage).unwrap();
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let addr = format!("127.0.0.1:{port}");
        let mut config = format!(
            "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    \
             rootdirectory: {}\nhttp:\n  addr: {addr}\n",
            storage.display()
        );
        if auth {
            std::fs::write(root.join("htpasswd"), HTPASSWD).unwrap();
            config +=
                &format!("auth:\n  htpasswd:\n    realm: umbra-test\n    path: {}\n", root.join("htpasswd").display());
        }
        std::fs::write(root.join("config.yml"), config).unwrap();
        let log = std::fs::File::create(root.join("registry.log")).unwrap();
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(root.join("config.yml"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("docker-registry (scripts/install-deps installs it)");
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(&addr).is_err() {
            assert!(
                Instant::now() < deadline,
                "the registry did not listen: {}",
                std::fs::read_to_string(root.join("registry.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Registry { child, addr, storage }
    }

    /// The file holding a blob's bytes in the registry's storage.
    pub fn blob_file(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap();
        self.storage.join("docker/registry/v2/blobs/sha256").join(&hex[..2]).join(hex).join("data")
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
