//! A full disk during a bundle pull, on a real 2 MiB tmpfs: refused up front when the bundle
//! cannot fit, and when the disk fills up mid-download the error says ENOSPC, names the artifact
//! and URL, and the previous bundle stays current and byte-identical. Needs root (mount); skips
//! otherwise.

mod bundle_support;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use bundle_support::*;
use umbra_bundle::testserver::Fault;
use umbra_bundle::{BundleError, Phase};
use umbra_tests::TempDir;

/// A tmpfs mounted for the test, unmounted on drop.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Option<Self> {
        std::fs::create_dir_all(dir).unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .ok()?;
        if !out.status.success() {
            eprintln!("skipping: cannot mount a tmpfs: {}", String::from_utf8_lossy(&out.stderr).trim());
            return None;
        }
        Some(Self(dir.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[test]
fn a_full_disk_is_named_and_leaves_the_previous_bundle() {
    let mnt = TempDir::new("bundle-tmpfs");
    let Some(fs) = Tmpfs::mount(&mnt.0.join("fs"), "2M") else { return };
    let env = Env::with_store_root("bundle-diskfull", Some(fs.0.join("bundles")));
    env.bundle("v1", 100_000, 100_000);
    env.pull("v1").unwrap();
    let before = snapshot(&env.store.root().join("v1"));

    // Too big to fit at all: refused before any artifact is requested.
    env.bundle("v2", 1_500_000, 1_500_000);
    let e = env.pull("v2").unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, BundleError::NoSpace { .. }), "{msg}");
    assert!(msg.contains("ENOSPC") && msg.contains("v2") && msg.contains("needs"), "{msg}");
    assert_eq!(env.server.count(&env.path("v2", "kernel.zst")), 0);
    assert_untouched(&env.store, "v1", &before);

    // Fits, but the disk fills up while it downloads.
    env.bundle("v3", 300_000, 900_000);
    let slow = Fault::Slow { chunk: 16 * 1024, delay: Duration::from_millis(20) };
    env.server.set_faults(&env.path("v3", "initramfs.zst"), vec![slow]);
    let filler = fs.0.join("filler");
    let mut filled = false;
    let e = env
        .store
        .pull(&env.url("v3"), &fast(), &mut |p| {
            if p.phase == Phase::Download && p.artifact.as_deref() == Some("initramfs") && !filled {
                filled = true;
                let mut f = std::fs::File::create(&filler).unwrap();
                let block = vec![0xaau8; 4096];
                while f.write_all(&block).is_ok() {}
            }
        })
        .unwrap_err();
    let msg = e.to_string();
    assert!(filled, "the download was under way when the disk filled");
    eprintln!("{msg}");
    assert!(matches!(e, BundleError::DiskFull { .. }), "{msg}");
    assert!(msg.contains("ENOSPC") && msg.contains("artifact initramfs"), "{msg}");
    assert!(msg.contains(&env.server.url("v3/initramfs.zst")), "{msg}");
    std::fs::remove_file(&filler).unwrap();
    assert_untouched(&env.store, "v1", &before);

    // With space again, the same pull succeeds.
    env.server.set_faults(&env.path("v3", "initramfs.zst"), vec![]);
    env.pull("v3").unwrap();
    assert_eq!(env.store.current().as_deref(), Some("v3"));
    drop(env);
}
