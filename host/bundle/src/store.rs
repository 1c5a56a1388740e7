//! The installed bundles on this host, under one root (`$XDG_DATA_HOME/umbra/bundles`):
//!
//! ```text
//! <version>/          manifest.json, the artifacts, .complete (written last)
//! current -> <version> a symlink, replaced by rename so readers see the old or the new one
//! warm/<version>/     a complete bundle downloaded ahead of time, promoted by rename
//! .staging/<version>/ a download in progress: artifacts verified so far, a .part per artifact
//! .locks/<version>.lock  one pull, promotion or removal of a version at a time
//! .trash/             directories renamed out of the way before they are deleted
//! ```
//!
//! Every change is a rename within this one filesystem, so a crash at any point leaves each
//! version either absent or complete, and `current` naming a complete one. Nothing here deletes
//! a directory in place: it is first renamed into `.trash`, so a reader never sees half of one.

use std::fs::{self, File};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use serde::Serialize;

use crate::digest::Hashing;
use crate::extract::{ExtractedBundle, COMPLETE_MARKER};
use crate::lock::{self, Lock};
use crate::manifest::{safe_name, Manifest, ManifestError};
use crate::{io_err, BundleError};

pub(crate) const CURRENT: &str = "current";
pub(crate) const WARM: &str = "warm";
const STAGING: &str = ".staging";
const LOCKS: &str = ".locks";
const TRASH: &str = ".trash";

/// Installed bundles under one root directory.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
    host_version: String,
}

/// One installed (or warm) bundle, as `vmctl bundle ls` shows it.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct InstalledInfo {
    pub version: String,
    pub flavor: String,
    /// Uncompressed bytes of its artifacts.
    pub bytes: u64,
    /// Seconds since the epoch when it was completed.
    pub installed: u64,
    pub current: bool,
    /// In the warm slot: downloaded ahead, not yet promoted.
    pub warm: bool,
    pub dir: PathBuf,
    /// Completion time in nanoseconds, for ordering installs within one second.
    #[serde(skip)]
    order: u128,
}

/// The result of re-hashing one installed artifact.
#[derive(Debug, Clone, Serialize)]
pub struct ArtifactCheck {
    pub name: String,
    pub path: PathBuf,
    pub expected_size: u64,
    /// None when the file is missing or unreadable (`error` says why).
    pub actual_size: Option<u64>,
    pub expected_sha256: String,
    pub actual_sha256: Option<String>,
    pub error: Option<String>,
}

impl ArtifactCheck {
    pub fn ok(&self) -> bool {
        self.actual_size == Some(self.expected_size) && self.actual_sha256.as_deref() == Some(&self.expected_sha256)
    }
}

static UNIQUE: AtomicU32 = AtomicU32::new(0);

/// A name no other thread or process of this host uses at the same time.
pub(crate) fn unique(prefix: &str) -> String {
    format!("{prefix}.{}.{}", std::process::id(), UNIQUE.fetch_add(1, Ordering::Relaxed))
}

pub(crate) fn sync_dir(dir: &Path) -> Result<(), BundleError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err("cannot fsync", dir))
}

/// Swaps two paths in one step (Linux: renameat2 RENAME_EXCHANGE; macOS: renamex_np
/// RENAME_SWAP). ENOENT when either is missing, EINVAL (Linux) or ENOTSUP (macOS) where the
/// filesystem cannot swap.
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(|_| std::io::ErrorKind::InvalidInput);
    let (a, b) = (c(a)?, c(b)?);
    // SAFETY: both are NUL-terminated paths alive for the call; AT_FDCWD resolves relative
    // paths as rename(2) does. No other memory is passed.
    #[cfg(target_os = "linux")]
    let rc = unsafe { libc::renameat2(libc::AT_FDCWD, a.as_ptr(), libc::AT_FDCWD, b.as_ptr(), libc::RENAME_EXCHANGE) };
    // SAFETY: as above; renamex_np takes the two paths and the flag only.
    #[cfg(target_os = "macos")]
    let rc = unsafe { libc::renamex_np(a.as_ptr(), b.as_ptr(), libc::RENAME_SWAP) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Bytes an unprivileged writer may still use on the filesystem holding `path`.
pub(crate) fn available_bytes(path: &Path) -> Result<u64, BundleError> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| BundleError::Io {
        what: "path has a NUL byte",
        path: path.display().to_string(),
        source: std::io::ErrorKind::InvalidInput.into(),
    })?;
    // SAFETY: statvfs is plain old data, so all-zero is a valid value for the kernel to overwrite.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid statvfs, both alive for the call.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io_err("cannot statvfs", path)(std::io::Error::last_os_error()));
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// sha256 and length of a file, read in large blocks.
pub(crate) fn hash_file(path: &Path) -> std::io::Result<(u64, String)> {
    let mut h = Hashing::new(std::io::sink());
    let mut f = File::open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        std::io::Write::write_all(&mut h, &buf[..n])?;
    }
    let (n, sha, _) = h.finish();
    Ok((n, sha))
}

impl Store {
    /// A store at `root` for a host of this crate's version.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self::with_host_version(root, env!("CARGO_PKG_VERSION"))
    }

    pub fn with_host_version(root: impl Into<PathBuf>, host_version: &str) -> Self {
        Self { root: root.into(), host_version: host_version.to_string() }
    }

    /// `$UMBRA_DATA_DIR/bundles`, else `$XDG_DATA_HOME/umbra/bundles`, else
    /// `~/.local/share/umbra/bundles`.
    pub fn default_root() -> PathBuf {
        if let Some(d) = std::env::var_os("UMBRA_DATA_DIR") {
            return PathBuf::from(d).join("bundles");
        }
        let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| "/tmp".into());
        let data = std::env::var_os("XDG_DATA_HOME")
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
            .unwrap_or_else(|| home.join(".local/share"));
        data.join("umbra/bundles")
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn host_version(&self) -> &str {
        &self.host_version
    }

    pub(crate) fn version_dir(&self, version: &str) -> PathBuf {
        self.root.join(version)
    }

    pub(crate) fn warm_dir(&self, version: &str) -> PathBuf {
        self.root.join(WARM).join(version)
    }

    pub(crate) fn staging_dir(&self, version: &str) -> PathBuf {
        self.root.join(STAGING).join(version)
    }

    pub(crate) fn ensure_layout(&self) -> Result<(), BundleError> {
        for d in [self.root.clone(), self.root.join(LOCKS), self.root.join(STAGING), self.root.join(WARM)] {
            fs::create_dir_all(&d).map_err(io_err("cannot create", &d))?;
        }
        Ok(())
    }

    /// A version name that can be a directory here: safe, and not one of the store's own names.
    pub(crate) fn check_version(&self, version: &str) -> Result<(), BundleError> {
        if !safe_name(version) || version == CURRENT || version == WARM {
            return Err(BundleError::Manifest(ManifestError::Invalid {
                field: "bundle_version".into(),
                reason: format!("{version:?} cannot name an installed bundle"),
            }));
        }
        Ok(())
    }

    pub(crate) fn lock(&self, version: &str) -> Result<Lock, BundleError> {
        self.ensure_layout()?;
        lock::exclusive(&self.lock_path(version))
    }

    pub(crate) fn lock_path(&self, version: &str) -> PathBuf {
        self.root.join(LOCKS).join(format!("{version}.lock"))
    }

    /// The manifest of a complete bundle directory.
    pub(crate) fn complete_manifest(&self, dir: &Path) -> Option<Manifest> {
        let json = fs::read(dir.join(COMPLETE_MARKER)).ok()?;
        Manifest::parse(&json, &self.host_version).ok()
    }

    /// Whether `dir` keeps the exact manifest it was installed from with a signature over it
    /// (by whichever key; the pull that put it there checked the key).
    pub(crate) fn signed_copy(&self, dir: &Path) -> bool {
        let (Ok(json), Ok(sig)) =
            (fs::read(dir.join(crate::MANIFEST_FILE)), fs::read(dir.join(crate::sign::SIGNATURE_FILE)))
        else {
            return false;
        };
        let parsed = Manifest::parse(&json, &self.host_version).ok();
        parsed.is_some() && parsed == self.complete_manifest(dir) && crate::sign::self_consistent(&json, &sig)
    }

    /// Whether `dir` holds exactly this bundle, complete.
    pub(crate) fn is_complete(&self, dir: &Path, manifest: &Manifest) -> bool {
        fs::read(dir.join(COMPLETE_MARKER)).ok().as_deref() == Some(manifest.to_json().as_bytes())
    }

    /// Moves `dir` into the trash and deletes it there.
    pub(crate) fn discard(&self, dir: &Path) -> Result<(), BundleError> {
        match self.move_aside(dir)? {
            Some(to) => fs::remove_dir_all(&to).map_err(io_err("cannot remove", &to)),
            None => Ok(()),
        }
    }

    /// Renames `dir` into the trash (and fsyncs its parent); where it went, or None if absent.
    fn move_aside(&self, dir: &Path) -> Result<Option<PathBuf>, BundleError> {
        if fs::symlink_metadata(dir).is_err() {
            return Ok(None);
        }
        let trash = self.root.join(TRASH);
        fs::create_dir_all(&trash).map_err(io_err("cannot create", &trash))?;
        let to = trash.join(unique(&dir.file_name().unwrap_or_default().to_string_lossy()));
        fs::rename(dir, &to).map_err(io_err("cannot move aside", dir))?;
        if let Some(parent) = dir.parent() {
            sync_dir(parent)?;
        }
        Ok(Some(to))
    }

    /// Renames the complete directory `from` to `to`, replacing whatever was there. A directory
    /// being replaced (an incomplete one, or another build under the same name that `current`
    /// may name) is swapped out in one step and deleted only once the new one is in place on
    /// disk: no crash or failed rename leaves `to` missing.
    pub(crate) fn install_dir(&self, from: &Path, to: &Path) -> Result<(), BundleError> {
        let swapped = match exchange(from, to) {
            Ok(()) => true,
            // Nothing to replace.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                fs::rename(from, to).map_err(io_err("cannot rename into", to))?;
                false
            }
            // A filesystem without RENAME_EXCHANGE.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) => {
                return self.replace_by_renames(from, to)
            }
            Err(e) => return Err(io_err("cannot swap into", to)(e)),
        };
        sync_dir(to.parent().unwrap_or(&self.root))?;
        if let Some(p) = from.parent() {
            sync_dir(p)?;
        }
        if swapped {
            // The replaced directory is at `from` now. The install is done either way: what
            // cannot be deleted now stays for `gc`.
            let _ = self.discard(from);
        }
        Ok(())
    }

    /// [`Self::install_dir`] without an atomic swap: the old directory into the trash, the new
    /// one into place (the old one back if that fails), fsync, and only then delete the old one.
    fn replace_by_renames(&self, from: &Path, to: &Path) -> Result<(), BundleError> {
        let old = self.move_aside(to)?;
        if let Err(e) = fs::rename(from, to) {
            if let Some(old) = &old {
                let _ = fs::rename(old, to);
            }
            return Err(io_err("cannot rename into", to)(e));
        }
        sync_dir(to.parent().unwrap_or(&self.root))?;
        if let Some(p) = from.parent() {
            sync_dir(p)?;
        }
        if let Some(old) = old {
            let _ = fs::remove_dir_all(&old);
        }
        Ok(())
    }

    /// The version `current` points at.
    pub fn current(&self) -> Option<String> {
        let target = fs::read_link(self.root.join(CURRENT)).ok()?;
        Some(target.file_name()?.to_str()?.to_string())
    }

    /// Points `current` at an installed version: a new symlink under a temp name renamed over
    /// the old one, so there is no instant without a `current`. The version's lock is held
    /// meanwhile, so `gc` or `rm` cannot remove it under the switch.
    pub fn set_current(&self, version: &str) -> Result<(), BundleError> {
        self.check_version(version)?;
        let _lock = self.lock(version)?;
        self.point_current(version)
    }

    /// [`Self::set_current`] for a caller that holds the version's lock. Everything that moves
    /// `current` holds the lock of the version it moves it to: `gc` relies on that.
    pub(crate) fn point_current(&self, version: &str) -> Result<(), BundleError> {
        self.check_version(version)?;
        if self.complete_manifest(&self.version_dir(version)).is_none() {
            return Err(self.not_installed(version));
        }
        let tmp = self.root.join(unique(".current"));
        let _ = fs::remove_file(&tmp);
        std::os::unix::fs::symlink(version, &tmp).map_err(io_err("cannot create symlink", &tmp))?;
        let link = self.root.join(CURRENT);
        if let Err(e) = fs::rename(&tmp, &link) {
            let _ = fs::remove_file(&tmp);
            return Err(io_err("cannot replace", &link)(e));
        }
        sync_dir(&self.root)
    }

    fn not_installed(&self, version: &str) -> BundleError {
        BundleError::NotInstalled { version: version.to_string(), root: self.root.display().to_string() }
    }

    /// `current` or a version name → the version name.
    pub fn resolve(&self, spec: &str) -> Result<String, BundleError> {
        if spec == CURRENT {
            return self.current().ok_or_else(|| self.not_installed(CURRENT));
        }
        self.check_version(spec).map_err(|_| self.not_installed(spec))?;
        Ok(spec.to_string())
    }

    /// An installed bundle (`current` or a version), ready to boot.
    pub fn get(&self, spec: &str) -> Result<ExtractedBundle, BundleError> {
        let version = self.resolve(spec)?;
        let dir = self.version_dir(&version);
        let manifest = self.complete_manifest(&dir).ok_or_else(|| self.not_installed(&version))?;
        Ok(ExtractedBundle { manifest, dir })
    }

    fn info(&self, dir: &Path, manifest: &Manifest, current: Option<&str>, warm: bool) -> InstalledInfo {
        let since_epoch = fs::metadata(dir.join(COMPLETE_MARKER))
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .unwrap_or_default();
        InstalledInfo {
            version: manifest.bundle_version.clone(),
            flavor: manifest.flavor.clone(),
            bytes: manifest.size_total(),
            installed: since_epoch.as_secs(),
            order: since_epoch.as_nanos(),
            current: !warm && current == Some(manifest.bundle_version.as_str()),
            warm,
            dir: dir.to_path_buf(),
        }
    }

    fn scan(&self, dir: &Path, warm: bool, current: Option<&str>) -> Vec<InstalledInfo> {
        let mut out = Vec::new();
        let Ok(entries) = fs::read_dir(dir) else { return out };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || name == CURRENT || name == WARM {
                continue;
            }
            let path = e.path();
            if let Some(m) = self.complete_manifest(&path).filter(|m| m.bundle_version == name) {
                out.push(self.info(&path, &m, current, warm));
            }
        }
        out.sort_by(|a, b| b.order.cmp(&a.order).then_with(|| a.version.cmp(&b.version)));
        out
    }

    /// Installed bundles, newest first, then the warm slot.
    pub fn list(&self) -> Vec<InstalledInfo> {
        let current = self.current();
        let mut all = self.scan(&self.root, false, current.as_deref());
        all.extend(self.scan(&self.root.join(WARM), true, None));
        all
    }

    /// Re-hashes every artifact of an installed bundle against its manifest.
    pub fn verify(&self, spec: &str) -> Result<Vec<ArtifactCheck>, BundleError> {
        let b = self.get(spec)?;
        let mut checks = Vec::new();
        for a in &b.manifest.artifacts {
            let path = b.dir.join(&a.name);
            let (actual_size, actual_sha256, error) = match hash_file(&path) {
                Ok((n, sha)) => (Some(n), Some(sha), None),
                Err(e) => (None, None, Some(e.to_string())),
            };
            checks.push(ArtifactCheck {
                name: a.name.clone(),
                path,
                expected_size: a.size,
                actual_size,
                expected_sha256: a.sha256.clone(),
                actual_sha256,
                error,
            });
        }
        Ok(checks)
    }

    /// Removes an installed (or warm) version. The current one only with `force`, and then
    /// `current` goes too.
    pub fn remove(&self, version: &str, force: bool) -> Result<(), BundleError> {
        self.check_version(version).map_err(|_| self.not_installed(version))?;
        let _lock = self.lock(version)?;
        let is_current = self.current().as_deref() == Some(version);
        if is_current && !force {
            return Err(BundleError::InUse { version: version.to_string() });
        }
        let dir = self.version_dir(version);
        let warm = self.warm_dir(version);
        if !dir.exists() && !warm.exists() {
            return Err(self.not_installed(version));
        }
        if is_current {
            let link = self.root.join(CURRENT);
            fs::remove_file(&link).map_err(io_err("cannot remove", &link))?;
        }
        self.discard(&dir)?;
        self.discard(&warm)
    }

    /// Keeps the `keep` most recently installed versions and `current`, and removes the other
    /// versions, stale downloads, warm copies of installed versions and the trash. Versions
    /// another process is working on are skipped. Returns the removed versions.
    pub fn gc(&self, keep: usize) -> Result<Vec<String>, BundleError> {
        self.ensure_layout()?;
        let mut removed = Vec::new();
        for info in self.gc_candidates(keep) {
            if self.discard_unless_current(&info)? {
                removed.push(info.version);
            }
        }
        for info in self.scan(&self.root.join(WARM), true, None) {
            if self.version_dir(&info.version).join(COMPLETE_MARKER).exists() {
                if let Some(_lock) = lock::try_exclusive(&self.lock_path(&info.version))? {
                    self.discard(&info.dir)?;
                }
            }
        }
        // Leftovers of interrupted work: downloads nobody is resuming, temp links, the trash.
        for entry in fs::read_dir(self.root.join(STAGING)).into_iter().flatten().flatten() {
            let version = entry.file_name().to_string_lossy().into_owned();
            if let Some(_lock) = lock::try_exclusive(&self.lock_path(&version))? {
                self.discard(&entry.path())?;
            }
        }
        for entry in fs::read_dir(&self.root).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let pid_alive = |n: &str| {
                n.split('.')
                    .nth(2)
                    .and_then(|p| p.parse::<u32>().ok())
                    .is_some_and(|p| Path::new(&format!("/proc/{p}")).exists())
            };
            if name.starts_with(".current.") && !pid_alive(&name) {
                let _ = fs::remove_file(entry.path());
            }
        }
        let trash = self.root.join(TRASH);
        for entry in fs::read_dir(&trash).into_iter().flatten().flatten() {
            let _ = fs::remove_dir_all(entry.path());
        }
        Ok(removed)
    }

    /// The installed versions beyond the `keep` newest, except the one `current` names now.
    fn gc_candidates(&self, keep: usize) -> Vec<InstalledInfo> {
        let current = self.current();
        self.scan(&self.root, false, current.as_deref()).into_iter().skip(keep).filter(|i| !i.current).collect()
    }

    /// Discards an installed version unless another process holds its lock or it is current.
    /// `current` is read again under the lock: a pull may have switched to this version since
    /// the scan, and it did so holding the lock.
    fn discard_unless_current(&self, info: &InstalledInfo) -> Result<bool, BundleError> {
        let Some(_lock) = lock::try_exclusive(&self.lock_path(&info.version))? else {
            return Ok(false);
        };
        if self.current().as_deref() == Some(info.version.as_str()) {
            return Ok(false);
        }
        self.discard(&info.dir)?;
        Ok(true)
    }

    /// When the version `current` names was completed, for ordering against a warm bundle.
    fn current_order(&self) -> Option<u128> {
        let dir = self.version_dir(&self.current()?);
        let manifest = self.complete_manifest(&dir)?;
        Some(self.info(&dir, &manifest, None, false).order)
    }

    /// Promotes a complete warm bundle, if there is one: renamed into place and made current.
    /// This is what a start does before it would download. A warm bundle completed before the
    /// current one was installed is stale (a newer bundle was pulled since): it is discarded,
    /// not promoted, so `current` never moves back to an older download.
    pub fn promote_warm(&self) -> Result<Option<ExtractedBundle>, BundleError> {
        let Some(info) = self.scan(&self.root.join(WARM), true, None).into_iter().next() else {
            return Ok(None);
        };
        let _lock = self.lock(&info.version)?;
        if self.current().as_deref() != Some(info.version.as_str())
            && self.current_order().is_some_and(|current| info.order < current)
        {
            self.discard(&info.dir)?;
            return Ok(None);
        }
        let installed = self.version_dir(&info.version);
        if self.complete_manifest(&installed).is_some() {
            self.discard(&info.dir)?;
        } else if !self.signed_copy(&info.dir) {
            // A warm download nobody signed (one from before signatures were required): a
            // start must not make it current. A pull of it checks it afresh.
            self.discard(&info.dir)?;
            return Ok(None);
        } else if self.complete_manifest(&info.dir).is_some() {
            self.install_dir(&info.dir, &installed)?;
        } else {
            // Promoted or removed by someone else meanwhile.
            return Ok(None);
        }
        self.point_current(&info.version)?;
        self.get(&info.version).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{ArtifactRole, Boot};

    /// A complete bundle directory at `dir` for `version`; `build` tells builds of one version
    /// apart. Only the marker matters to the store's bookkeeping, so there are no artifacts.
    fn fake(dir: &Path, version: &str, build: &str) -> Manifest {
        let art = crate::manifest::tests::test_artifact;
        let m = Manifest {
            schema_version: 1,
            bundle_version: version.into(),
            flavor: "minimal".into(),
            arch: crate::Arch::X86_64,
            min_host_version: "0.1.0".into(),
            boot: Boot { cmdline: build.into() },
            artifacts: vec![art("kernel", ArtifactRole::Kernel), art("initramfs", ArtifactRole::Initrd)],
            image: None,
        };
        fs::create_dir_all(dir).unwrap();
        fs::write(dir.join(COMPLETE_MARKER), m.to_json()).unwrap();
        // Kept as a pull keeps them: the signed bytes and their signature.
        fs::write(dir.join(crate::MANIFEST_FILE), m.to_json()).unwrap();
        let sig = crate::SecretKey::from_seed([5; 32]).sign(m.to_json().as_bytes());
        let file = crate::SignatureFile { schema_version: 1, signatures: vec![sig] };
        fs::write(dir.join(crate::SIGNATURE_FILE), file.to_json()).unwrap();
        m
    }

    #[test]
    fn a_warm_bundle_nobody_signed_is_dropped_not_promoted() {
        let (_d, s) = store();
        fake(&s.version_dir("y"), "y", "");
        completed_at(&s.version_dir("y"), 100);
        s.set_current("y").unwrap();
        // Warmed before signatures were required: no manifest.sig.
        fake(&s.warm_dir("z"), "z", "");
        completed_at(&s.warm_dir("z"), 300);
        fs::remove_file(s.warm_dir("z").join(crate::SIGNATURE_FILE)).unwrap();
        assert!(s.promote_warm().unwrap().is_none());
        assert_eq!(s.current().as_deref(), Some("y"));
        assert!(!s.warm_dir("z").exists());
        // Nor one whose kept manifest is not the one it was completed with.
        fake(&s.warm_dir("w"), "w", "");
        completed_at(&s.warm_dir("w"), 300);
        fs::write(s.warm_dir("w").join(crate::MANIFEST_FILE), fake(&s.root.join("other"), "w", "x").to_json()).unwrap();
        assert!(s.promote_warm().unwrap().is_none());
        assert_eq!(s.current().as_deref(), Some("y"));
    }

    fn store() -> (tempfile::TempDir, Store) {
        let d = tempfile::tempdir().unwrap();
        let s = Store::with_host_version(d.path().join("bundles"), "0.1.0");
        s.ensure_layout().unwrap();
        (d, s)
    }

    fn trash_is_empty(s: &Store) -> bool {
        fs::read_dir(s.root.join(TRASH)).map_or(true, |mut d| d.next().is_none())
    }

    /// Sets when `dir` was completed, as install order reads it.
    fn completed_at(dir: &Path, secs: u64) {
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs);
        File::options().write(true).open(dir.join(COMPLETE_MARKER)).unwrap().set_modified(t).unwrap();
    }

    #[test]
    fn gc_keeps_a_version_made_current_after_its_scan() {
        let (_d, s) = store();
        fake(&s.version_dir("a"), "a", "");
        fake(&s.version_dir("b"), "b", "");
        s.set_current("a").unwrap();
        let planned: Vec<_> = s.gc_candidates(0);
        assert_eq!(planned.iter().map(|i| i.version.as_str()).collect::<Vec<_>>(), ["b"]);
        // A pull of the installed `b` switches to it between gc's scan and its lock.
        s.set_current("b").unwrap();
        assert!(!s.discard_unless_current(&planned[0]).unwrap());
        assert_eq!(s.get("current").unwrap().manifest.bundle_version, "b");
        assert_eq!(s.gc(0).unwrap(), ["a"]);
        assert!(s.get("current").is_ok());
    }

    #[test]
    fn replacing_a_version_swaps_and_a_failed_install_keeps_the_old_one() {
        let (_d, s) = store();
        let to = s.version_dir("v");
        let old = fake(&to, "v", "old");
        s.set_current("v").unwrap();

        // Nothing to install: the old build stays, complete and current.
        for install in [Store::install_dir, Store::replace_by_renames] {
            assert!(install(&s, &s.staging_dir("v"), &to).is_err());
            assert!(s.is_complete(&to, &old));
            assert_eq!(s.get("current").unwrap().manifest, old);
        }

        // A new build under the same name replaces it, by a swap or by renames.
        for (i, install) in [Store::install_dir, Store::replace_by_renames].into_iter().enumerate() {
            let from = s.staging_dir("v");
            let new = fake(&from, "v", &format!("new{i}"));
            install(&s, &from, &to).unwrap();
            assert!(s.is_complete(&to, &new));
            assert!(!from.exists());
            assert!(trash_is_empty(&s), "the old build is deleted once replaced");
        }
    }

    #[test]
    fn a_warm_bundle_older_than_current_is_not_promoted() {
        let (_d, s) = store();
        // Warmed at t=100, then a newer bundle was installed at t=200 and made current.
        fake(&s.warm_dir("x"), "x", "");
        completed_at(&s.warm_dir("x"), 100);
        fake(&s.version_dir("y"), "y", "");
        completed_at(&s.version_dir("y"), 200);
        s.set_current("y").unwrap();
        assert!(s.promote_warm().unwrap().is_none());
        assert_eq!(s.current().as_deref(), Some("y"));
        assert!(!s.warm_dir("x").exists(), "the stale warm bundle is dropped");

        // One completed after the current install is promoted.
        fake(&s.warm_dir("z"), "z", "");
        completed_at(&s.warm_dir("z"), 300);
        assert_eq!(s.promote_warm().unwrap().unwrap().manifest.bundle_version, "z");
        assert_eq!(s.current().as_deref(), Some("z"));
    }
}
