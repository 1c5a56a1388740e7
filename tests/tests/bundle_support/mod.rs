//! Shared by the bundle tests: a served directory of synthetic bundles, a store beside it, and a
//! byte-for-byte snapshot of a directory tree to prove a failure left it alone.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use umbra_bundle::testserver::{synthetic_bundle, TestServer};
use umbra_bundle::{Manifest, PullOptions, RetryPolicy, Store};
use umbra_tests::TempDir;

pub struct Env {
    pub dir: TempDir,
    pub server: TestServer,
    pub store: Store,
}

impl Env {
    /// A server over `<tmp>/www` and a store at `<tmp>/data/bundles` (where vmctl looks with
    /// `UMBRA_DATA_DIR=<tmp>/data`), or at `store_root`.
    pub fn new(tag: &str) -> Self {
        Self::with_store_root(tag, None)
    }

    pub fn with_store_root(tag: &str, store_root: Option<PathBuf>) -> Self {
        let dir = TempDir::new(tag);
        std::fs::create_dir_all(dir.0.join("www")).unwrap();
        let server = TestServer::start(dir.0.join("www")).unwrap();
        let store = Store::new(store_root.unwrap_or_else(|| dir.0.join("data").join("bundles")));
        Self { dir, server, store }
    }

    /// `UMBRA_DATA_DIR` for a vmctl that should use this store.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.0.join("data")
    }

    /// The environment of a vmctl that uses this store and a configuration of its own, whose
    /// trusted-keys directory holds the test key (and nothing of the user's).
    pub fn vmctl_env(&self) -> [(&'static str, PathBuf); 2] {
        let config = self.dir.0.join("config");
        let keys = config.join("umbra").join("trusted-keys");
        std::fs::create_dir_all(&keys).unwrap();
        let line = umbra_bundle::testserver::test_key().public().to_line("test") + "\n";
        std::fs::write(keys.join("test.pub"), line).unwrap();
        [("UMBRA_DATA_DIR", self.data_dir()), ("XDG_CONFIG_HOME", config)]
    }

    /// Packs a bundle served at `/<version>/`.
    pub fn bundle(&self, version: &str, kernel: usize, initrd: usize) -> Manifest {
        self.bundle_for_host(version, kernel, initrd, "0.1.0")
    }

    pub fn bundle_for_host(&self, version: &str, kernel: usize, initrd: usize, min_host: &str) -> Manifest {
        let out = self.dir.0.join("www").join(version);
        synthetic_bundle(&self.dir.0.join("work"), &out, version, kernel, initrd, 3, min_host).unwrap()
    }

    pub fn url(&self, version: &str) -> String {
        self.server.url(&format!("{version}/"))
    }

    pub fn path(&self, version: &str, file: &str) -> String {
        format!("/{version}/{file}")
    }

    /// The served bytes of one bundle file.
    pub fn served(&self, version: &str, file: &str) -> Vec<u8> {
        std::fs::read(self.dir.0.join("www").join(version).join(file)).unwrap()
    }

    /// Pulls with quick retries, ignoring progress.
    pub fn pull(&self, version: &str) -> Result<umbra_bundle::Pulled, umbra_bundle::BundleError> {
        self.store.pull(&self.url(version), &fast(), &mut |_| {})
    }
}

/// Retries that do not slow the tests down.
pub fn fast() -> PullOptions {
    PullOptions {
        retry: RetryPolicy {
            retries: 4,
            initial: std::time::Duration::from_millis(10),
            max: std::time::Duration::from_millis(50),
        },
        trust: umbra_bundle::testserver::test_trust(),
        ..PullOptions::default()
    }
}

/// Every file, symlink and directory under `root` with its bytes or target.
pub fn snapshot(root: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, Vec<u8>>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for e in entries.flatten() {
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap().to_path_buf();
            let ft = e.file_type().unwrap();
            if ft.is_symlink() {
                out.insert(rel, std::fs::read_link(&p).unwrap().into_os_string().into_encoded_bytes());
            } else if ft.is_dir() {
                out.insert(rel.clone(), b"<dir>".to_vec());
                walk(root, &p, out);
            } else {
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

/// What a failed pull must leave: `current` and the installed version exactly as before, and no
/// temp files anywhere in the store.
pub fn assert_untouched(store: &Store, version: &str, before: &BTreeMap<PathBuf, Vec<u8>>) {
    assert_eq!(store.current().as_deref(), Some(version), "the previous bundle is still current");
    let after = snapshot(&store.root().join(version));
    assert!(after == *before, "the previous bundle is byte-identical");
    assert_eq!(leftovers(store.root()), Vec::<PathBuf>::new(), "no temp files are left");
    assert!(store.verify("current").unwrap().iter().all(|c| c.ok()));
}

/// Temp files and staging directories anywhere under the store.
pub fn leftovers(root: &Path) -> Vec<PathBuf> {
    snapshot(root)
        .into_keys()
        .filter(|p| {
            let s = p.to_string_lossy();
            s.contains(".partial") || s.contains(".part") || s.contains(".current.") || {
                // Anything inside .staging/ or .trash/ (the directories themselves may stay).
                let mut c = p.components();
                matches!(
                    c.next().map(|c| c.as_os_str().to_string_lossy().into_owned()).as_deref(),
                    Some(".staging" | ".trash")
                ) && c.next().is_some()
            }
        })
        .collect()
}

/// Installs `v1` as the known-good previous bundle and returns its snapshot.
pub fn install_previous(env: &Env) -> BTreeMap<PathBuf, Vec<u8>> {
    env.bundle("v1", 200_000, 300_000);
    env.pull("v1").unwrap();
    snapshot(&env.store.root().join("v1"))
}
