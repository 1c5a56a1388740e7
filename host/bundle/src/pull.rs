//! Pulling a bundle by URL into the store: manifest, lock, download-and-verify each artifact
//! into `.staging/<version>/`, then one rename into place and one into `current`.
//!
//! The order is what keeps failures harmless. The manifest is checked (schema, host version,
//! names) before anything is written; the version lock makes a second pull of the same version
//! wait and then find it installed; artifacts are verified before the staging directory is
//! renamed; `current` moves last. So a failure at any step leaves the previous bundle current
//! and untouched. The staging directory is removed on failure, except that after a network
//! failure the received compressed bytes (`.part`) stay for the next pull to resume from.

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use crate::extract::{extract_into, ExtractedBundle, COMPLETE_MARKER};
use crate::fetch::{Fetcher, Location, SourceCheck};
use crate::manifest::{Artifact, Manifest, MANIFEST_FILE};
use crate::progress::{Meter, Phase, Progress};
use crate::resume::Resuming;
use crate::retry::RetryPolicy;
use crate::sign::{Trust, SIGNATURE_FILE, SIGNATURE_LIMIT};
use crate::store::{available_bytes, hash_file, sync_dir, Store};
use crate::{io_err, BundleError};

/// A manifest is a few KB; anything near this is not one.
const MANIFEST_LIMIT: u64 = 1 << 20;

#[derive(Debug, Clone)]
pub struct PullOptions {
    /// Download into the warm slot instead of installing: the next start promotes it.
    pub warm: bool,
    pub retry: RetryPolicy,
    /// How long one connect, header wait or read may be silent before it counts as a network
    /// error (and is retried).
    pub idle_timeout: Duration,
    /// Download even if this version is installed (or warm), and replace the installed copy
    /// only once the new one is verified: a failed reinstall leaves the old copy current.
    pub reinstall: bool,
    /// The keys a bundle must be signed by, and whether loopback `http://` is allowed. The
    /// default trusts no key: every pull is refused until the caller says whom it trusts.
    pub trust: Trust,
    /// Where the bundle may come from (the system policy's `bundle_sources`), held to every
    /// redirect; the caller checks the URL it passes. `None`: anywhere the URL rules allow.
    pub sources: Option<SourceCheck>,
    /// Install without making it `current` (nor touching the warm slot): a bundle converted
    /// from an image, which sessions name themselves.
    pub keep_current: bool,
}

impl Default for PullOptions {
    fn default() -> Self {
        Self {
            warm: false,
            retry: RetryPolicy::default(),
            idle_timeout: Duration::from_secs(30),
            reinstall: false,
            trust: Trust::default(),
            sources: None,
            keep_current: false,
        }
    }
}

#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PulledHow {
    /// Downloaded, verified, installed and made current.
    Downloaded,
    /// Already installed (perhaps by a concurrent pull); made current.
    AlreadyInstalled,
    /// Found complete in the warm slot; renamed into place and made current.
    PromotedWarm,
    /// Downloaded into (or already in) the warm slot; `current` unchanged.
    Warmed,
}

/// A manifest, its exact bytes, and the signature a trusted key made over them.
#[derive(Debug, Clone)]
pub struct Signed {
    pub manifest: Manifest,
    pub json: Vec<u8>,
    pub signature: Option<Vec<u8>>,
    /// The id of the trusted key that signed.
    pub signer: String,
}

#[derive(Debug, Clone)]
pub struct Pulled {
    pub bundle: ExtractedBundle,
    pub how: PulledHow,
    /// Compressed bytes transferred by this pull.
    pub downloaded: u64,
}

/// Whether a failure may go away on a later pull, so the received bytes are worth keeping.
fn resumable(e: &BundleError) -> bool {
    match e {
        BundleError::Network { .. } => true,
        BundleError::Http { status, .. } => *status >= 500,
        _ => false,
    }
}

/// Whether a failure condemns the bytes received (as opposed to the transfer or the disk).
fn content_failure(e: &BundleError) -> bool {
    matches!(e, BundleError::SizeMismatch { .. } | BundleError::DigestMismatch { .. } | BundleError::Decompress { .. })
}

impl Store {
    /// Downloads, verifies and installs the bundle at `url` (`http(s)://` or `file://`, of
    /// `manifest.json` or its directory), and makes it current (or, with `warm`, leaves it in
    /// the warm slot). `progress` is called on this thread. It blocks (reqwest's blocking
    /// client): async callers run it under `spawn_blocking`.
    pub fn pull(
        &self,
        url: &str,
        opts: &PullOptions,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<Pulled, BundleError> {
        let manifest_loc = Location::manifest(url)?;
        manifest_loc.check(url, opts.trust.allow_http_loopback)?;
        let fetcher =
            Fetcher::new(opts.retry.clone(), opts.idle_timeout, opts.trust.allow_http_loopback, opts.sources.clone());
        let mut meter = Meter::new(progress, "");
        meter.emit(Phase::Manifest, Some(manifest_loc.display()));
        // Before anything is written or any artifact fetched: only a bundle signed by a trusted
        // key goes further, so an unsigned or altered one leaves the store as it was.
        let Signed { manifest, json, signature, signer } = self.fetch_signed(&fetcher, &manifest_loc, &opts.trust)?;
        let version = manifest.bundle_version.clone();
        meter.emit(Phase::Manifest, Some(format!("signed by {signer}")));
        meter.set_version(&version);
        meter.set_total(manifest.compressed_total());
        self.ensure_layout()?;

        let lock_path = self.lock_path(&version);
        let _lock = match crate::lock::try_exclusive(&lock_path)? {
            Some(l) => l,
            None => {
                meter.emit(Phase::Waiting, Some(format!("another pull of {version} is running")));
                crate::lock::exclusive(&lock_path)?
            }
        };
        let done = |store: &Store, how, meter: &mut Meter, downloaded| -> Result<Pulled, BundleError> {
            let dir = if how == PulledHow::Warmed { store.warm_dir(&version) } else { store.version_dir(&version) };
            meter.emit(Phase::Done, None);
            Ok(Pulled { bundle: ExtractedBundle { manifest: manifest.clone(), dir }, how, downloaded })
        };

        let installed = self.version_dir(&version);
        let warm = self.warm_dir(&version);
        if !opts.reinstall && self.is_complete(&installed, &manifest) {
            keep_signed(&installed, &json, signature.as_deref())?;
            if !opts.warm && !opts.keep_current {
                self.point_current(&version)?;
                self.drop_other_warm(&version);
            }
            return done(self, PulledHow::AlreadyInstalled, &mut meter, 0);
        }
        if !opts.reinstall && self.is_complete(&warm, &manifest) {
            keep_signed(&warm, &json, signature.as_deref())?;
            if opts.warm {
                return done(self, PulledHow::Warmed, &mut meter, 0);
            }
            meter.emit(Phase::Promote, None);
            self.install_dir(&warm, &installed)?;
            if !opts.keep_current {
                self.point_current(&version)?;
                self.drop_other_warm(&version);
            }
            return done(self, PulledHow::PromotedWarm, &mut meter, 0);
        }

        let staging = self.staging_dir(&version);
        fs::create_dir_all(&staging).map_err(io_err("cannot create", &staging))?;
        let result = self.download_all(&fetcher, &manifest_loc, &manifest, &staging, &mut meter);
        let downloaded = meter.received();
        if let Err(e) = result {
            // Kept only when there is something to resume from.
            let empty = fs::read_dir(&staging).map_or(true, |mut d| d.next().is_none());
            if !resumable(&e) || empty {
                let _ = self.discard(&staging);
            }
            return Err(e);
        }

        meter.emit(Phase::Install, None);
        let finish = || -> Result<(), BundleError> {
            // The exact bytes that were signed, and the signature: `vmctl bundle verify` checks
            // an installed bundle's signature again later.
            write_synced(&staging.join(MANIFEST_FILE), &json)?;
            if let Some(sig) = &signature {
                write_synced(&staging.join(SIGNATURE_FILE), sig)?;
            }
            write_synced(&staging.join(COMPLETE_MARKER), manifest.to_json().as_bytes())?;
            sync_dir(&staging)?;
            if opts.warm {
                self.install_dir(&staging, &warm)?;
                self.drop_other_warm(&version);
            } else {
                self.install_dir(&staging, &installed)?;
                if !opts.keep_current {
                    self.point_current(&version)?;
                    self.drop_other_warm(&version);
                }
            }
            Ok(())
        };
        if let Err(e) = finish() {
            let _ = self.discard(&staging);
            return Err(e);
        }
        let how = if opts.warm { PulledHow::Warmed } else { PulledHow::Downloaded };
        done(self, how, &mut meter, downloaded)
    }

    /// The manifest of the bundle at `url` if it is signed by a key `opts.trust` trusts (what
    /// `vmctl bundle verify URL|DIR` checks); no artifact is fetched.
    pub fn check_signature(&self, url: &str, opts: &PullOptions) -> Result<Signed, BundleError> {
        let loc = Location::manifest(url)?;
        loc.check(url, opts.trust.allow_http_loopback)?;
        let fetcher =
            Fetcher::new(opts.retry.clone(), opts.idle_timeout, opts.trust.allow_http_loopback, opts.sources.clone());
        self.fetch_signed(&fetcher, &loc, &opts.trust)
    }

    /// Whether the installed bundle `spec` (`current`, a version) still carries a signature by a
    /// key `trust` trusts over its manifest as installed.
    pub fn check_installed_signature(&self, spec: &str, trust: &Trust) -> Result<String, BundleError> {
        let b = self.get(spec)?;
        let mpath = b.dir.join(MANIFEST_FILE);
        let json = fs::read(&mpath).map_err(io_err("cannot read", &mpath))?;
        let spath = b.dir.join(SIGNATURE_FILE);
        let signature = match fs::read(&spath) {
            Ok(bytes) => Some(bytes),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(io_err("cannot read", &spath)(e)),
        };
        // The manifest beside the artifacts must be the one they were installed from.
        let manifest = Manifest::parse(&json, self.host_version())?;
        if manifest != b.manifest {
            return Err(BundleError::BadSignature {
                version: b.manifest.bundle_version.clone(),
                reason: format!("{} differs from the manifest it was installed with", mpath.display()),
            });
        }
        trust.verify(&manifest.bundle_version, &json, signature.as_deref(), &mpath.display().to_string())
    }

    fn fetch_signed(&self, fetcher: &Fetcher, loc: &Location, trust: &Trust) -> Result<Signed, BundleError> {
        let json = fetcher.fetch_small(loc, "manifest", MANIFEST_LIMIT)?;
        let manifest = Manifest::parse(&json, self.host_version())?;
        self.check_version(&manifest.bundle_version)?;
        let signature = fetch_optional(fetcher, &loc.sibling(SIGNATURE_FILE))?;
        let signer = trust.verify(&manifest.bundle_version, &json, signature.as_deref(), &loc.display())?;
        Ok(Signed { manifest, json, signature, signer })
    }

    /// Installs a bundle directory (as `vmctl bundle build` or `pack` writes it) from disk.
    pub fn import(
        &self,
        bundle_dir: &Path,
        opts: &PullOptions,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<Pulled, BundleError> {
        self.pull(&dir_url(bundle_dir)?, opts, progress)
    }

    /// The warm slot holds one bundle: the newest. A warm pull keeps only its own; a pull that
    /// makes a version current drops any other, which would otherwise be promoted over it.
    fn drop_other_warm(&self, keep: &str) {
        for entry in fs::read_dir(self.root().join(crate::store::WARM)).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name != keep && !name.starts_with('.') {
                if let Ok(Some(_lock)) = crate::lock::try_exclusive(&self.lock_path(&name)) {
                    let _ = self.discard(&entry.path());
                }
            }
        }
    }

    fn download_all(
        &self,
        fetcher: &Fetcher,
        manifest_loc: &Location,
        manifest: &Manifest,
        staging: &Path,
        meter: &mut Meter,
    ) -> Result<(), BundleError> {
        // What an earlier, interrupted pull already verified stays; its temp outputs do not.
        let mut todo = Vec::new();
        for a in &manifest.artifacts {
            let _ = fs::remove_file(staging.join(format!(".{}.partial", a.name)));
            let dst = staging.join(&a.name);
            if matches!(hash_file(&dst), Ok((n, sha)) if n == a.size && sha == a.sha256) {
                meter.skip(a.compressed_size);
            } else {
                todo.push(a);
            }
        }
        // The uncompressed artifacts, and the largest compressed download beside them, must fit.
        // (Validation bounds every size, so this cannot overflow; saturating all the same.)
        let needed = todo
            .iter()
            .fold(0u64, |n, a| n.saturating_add(a.size))
            .saturating_add(todo.iter().map(|a| a.compressed_size).max().unwrap_or(0));
        let available = available_bytes(staging)?;
        if needed > available {
            return Err(BundleError::NoSpace {
                path: self.root().display().to_string(),
                version: manifest.bundle_version.clone(),
                needed,
                available,
            });
        }
        for a in todo {
            let loc = manifest_loc.sibling(&a.file);
            self.download_one(fetcher, &loc, a, staging, meter)?;
        }
        Ok(())
    }

    fn download_one(
        &self,
        fetcher: &Fetcher,
        loc: &Location,
        a: &Artifact,
        staging: &Path,
        meter: &mut Meter,
    ) -> Result<(), BundleError> {
        let part_path = staging.join(format!(".{}.part", a.file));
        meter.set_artifact(Some(&a.name));
        let mut from_scratch = false;
        loop {
            let (prefix, part, prefix_len) = if loc.is_remote() {
                if from_scratch {
                    let _ = fs::remove_file(&part_path);
                }
                let mut len = fs::metadata(&part_path).map_or(0, |m| m.len());
                if len > a.compressed_size {
                    let _ = fs::remove_file(&part_path);
                    len = 0;
                }
                let append = OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&part_path)
                    .map_err(io_err("cannot create", &part_path))?;
                let prefix = if len > 0 {
                    Some(File::open(&part_path).map_err(io_err("cannot open", &part_path))?)
                } else {
                    None
                };
                (prefix, Some((append, part_path.clone())), len)
            } else {
                (None, None, 0)
            };
            meter.skip(prefix_len);
            if prefix_len > 0 {
                meter.emit(Phase::Download, Some(format!("resuming {} from byte {prefix_len} on disk", a.name)));
            }
            let start = meter.done();
            let mut src = Resuming::new(
                fetcher,
                loc.clone(),
                format!("artifact {}", a.name),
                a.compressed_size,
                prefix,
                part,
                meter,
            );
            let result = extract_into(&mut src, a, &loc.display(), staging);
            let failure = src.error.take();
            drop(src);
            match result {
                Ok(path) => {
                    // Installed artifacts are never written again; say so to everyone else too.
                    let _ = fs::set_permissions(&path, fs::Permissions::from_mode(0o444));
                    let _ = fs::remove_file(&part_path);
                    return Ok(());
                }
                Err(e) => {
                    let e = failure.unwrap_or(e);
                    if content_failure(&e) && prefix_len > 0 && !from_scratch {
                        // The bytes kept by an earlier process may be what is wrong: once more
                        // from the start before blaming the server.
                        let back = meter.done() - start + prefix_len;
                        meter.skip_back(back);
                        meter.emit(Phase::Retry, Some(format!("{e}; downloading {} again from the start", a.name)));
                        from_scratch = true;
                        continue;
                    }
                    let received = fs::metadata(&part_path).map_or(0, |m| m.len());
                    if !resumable(&e) || received == 0 {
                        let _ = fs::remove_file(&part_path);
                    }
                    return Err(e);
                }
            }
        }
    }
}

/// Puts the verified manifest bytes and their signature into an installed (or warm) copy made
/// before either was kept, so `verify` and a later promotion see what was checked now.
fn keep_signed(dir: &Path, json: &[u8], signature: Option<&[u8]>) -> Result<(), BundleError> {
    let Some(sig) = signature else { return Ok(()) };
    for (name, bytes) in [(MANIFEST_FILE, json), (SIGNATURE_FILE, sig)] {
        let path = dir.join(name);
        if fs::read(&path).ok().as_deref() == Some(bytes) {
            continue;
        }
        let tmp = dir.join(format!(".{name}.tmp"));
        write_synced(&tmp, bytes)?;
        fs::rename(&tmp, &path).map_err(io_err("cannot rename", &path))?;
    }
    Ok(())
}

/// The `file://` URL of a bundle directory.
pub fn dir_url(bundle_dir: &Path) -> Result<String, BundleError> {
    let abs = bundle_dir.canonicalize().map_err(io_err("cannot open", bundle_dir))?;
    let url = reqwest::Url::from_directory_path(&abs).map_err(|()| BundleError::Url {
        url: abs.display().to_string(),
        reason: "not an absolute directory path".into(),
    })?;
    Ok(url.to_string())
}

/// The file at `loc`, or `None` when there is none (404, 410 or no such file).
fn fetch_optional(fetcher: &Fetcher, loc: &Location) -> Result<Option<Vec<u8>>, BundleError> {
    match fetcher.fetch_small(loc, "signature", SIGNATURE_LIMIT) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(BundleError::Http { status: 404 | 410, .. }) => Ok(None),
        Err(BundleError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), BundleError> {
    let mut f = File::create(path).map_err(io_err("cannot create", path))?;
    std::io::Write::write_all(&mut f, bytes).map_err(io_err("cannot write", path))?;
    f.sync_all().map_err(io_err("cannot fsync", path))
}
