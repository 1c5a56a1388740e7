//! OCI images as installed bundles, for every front end (`vmctl image`, `vmctl run --image`,
//! umbrad's `session.start {image}`): pull or import (umbra-image), convert with a base
//! bundle's kernel and agent unless the same image on the same base is installed, sign with
//! this machine's build key, and install through the store's verified import without making it
//! `current`. A small index remembers which bundle a reference became, so a later start finds
//! it without a registry (as `docker run` uses a local image).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;
use umbra_bundle::{Arch, ExtractedBundle, PullOptions as BundlePullOptions, Store, Trust};
use umbra_image::{BlobCache, PullOptions};

#[derive(Debug, thiserror::Error)]
pub enum OciError {
    #[error(transparent)]
    Image(#[from] umbra_image::ImageError),
    #[error(transparent)]
    Bundle(#[from] umbra_bundle::BundleError),
    #[error("the base bundle {spec:?}: {reason}")]
    Base { spec: String, reason: String },
    #[error("{0}")]
    Io(String),
}

/// Where an image comes from.
pub enum Origin<'a> {
    Registry(&'a str),
    /// An OCI image layout directory or a `docker save` archive.
    Archive(&'a Path),
}

#[derive(Clone, Debug, Default)]
pub struct ObtainOptions {
    /// The guest's architecture [default: the host's].
    pub arch: Option<Arch>,
    /// The bundle whose kernel and agent the image boots with [default: `current` for this
    /// host's architecture, the built `minimal-<arch>` for another].
    pub base: Option<String>,
    pub allow_http_loopback: bool,
    pub credentials: Option<(String, String)>,
}

/// What getting an image did.
#[derive(Debug, Clone, Serialize)]
pub struct Obtained {
    pub reference: String,
    pub digest: String,
    /// The installed bundle: `--bundle` (and a session's `bundle`) takes it.
    pub bundle: String,
    pub arch: Arch,
    /// Layer bytes transferred by this pull, and found in the cache.
    pub downloaded_bytes: u64,
    pub cached_bytes: u64,
    /// Whether the bundle was made now (false: the same image on the same base was installed).
    pub converted: bool,
    pub seconds: f64,
}

fn store() -> Store {
    Store::new(Store::default_root())
}

fn images_dir() -> PathBuf {
    crate::paths::cache_dir().join("images")
}

/// `<arch> <reference>` → bundle version.
fn refs_path() -> PathBuf {
    images_dir().join("refs.json")
}

/// The references converted here, by `<arch> <reference>`, to their bundles.
pub fn refs() -> BTreeMap<String, String> {
    std::fs::read(refs_path()).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default()
}

fn remember(arch: Arch, reference: &str, version: &str) -> Result<(), OciError> {
    let dir = images_dir();
    std::fs::create_dir_all(&dir).map_err(|e| OciError::Io(format!("cannot create {}: {e}", dir.display())))?;
    // One writer at a time: two pulls must not lose each other's entry.
    let _lock = umbra_bundle::lock_exclusive(&images_dir().join(".refs.lock"))?;
    let mut all = refs();
    all.insert(format!("{arch} {reference}"), version.to_string());
    let path = refs_path();
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let io = |e: std::io::Error| OciError::Io(format!("cannot write {}: {e}", path.display()));
    std::fs::write(&tmp, serde_json::to_vec_pretty(&all).expect("a map of strings")).map_err(io)?;
    std::fs::rename(&tmp, &path).map_err(io)
}

/// The installed bundle of an image converted before, if it is still installed.
pub fn known(reference: &str, arch: Option<Arch>) -> Option<String> {
    let arch = arch.unwrap_or(Arch::host());
    let reference = umbra_image::registry::canonical(reference)?;
    let version = refs().remove(&format!("{arch} {reference}"))?;
    store().get(&version).is_ok().then_some(version)
}

fn base_bundle(opts: &ObtainOptions) -> Result<ExtractedBundle, OciError> {
    let arch = opts.arch.unwrap_or(Arch::host());
    let spec = opts.base.clone().unwrap_or_else(|| match arch == Arch::host() {
        true => "current".into(),
        false => crate::paths::built_bundle_name("minimal", arch),
    });
    let (bundle, _) = crate::image::extracted_with(&spec, &store(), false)
        .map_err(|e| OciError::Base { spec: spec.clone(), reason: e.to_string() })?;
    if bundle.manifest.arch != arch {
        return Err(OciError::Base { spec, reason: format!("it is for {}, not {arch}", bundle.manifest.arch) });
    }
    Ok(bundle)
}

/// Whom an install trusts, asked once the bundle is signed (the first conversion makes this
/// machine's key, which the trusted-keys directory then holds). The system policy's keys, when
/// it names any, stay the only ones: an image this machine converted is refused then, as a
/// bundle it built is.
pub type TrustFn<'a> = &'a (dyn Fn() -> Result<Trust, umbra_bundle::BundleError> + Sync);

/// Pulls or imports, converts unless the same image on the same base is installed, installs.
/// `progress` hears one line per step.
pub async fn obtain(
    origin: Origin<'_>,
    opts: &ObtainOptions,
    trust: TrustFn<'_>,
    progress: &mut (dyn FnMut(String) + Send),
) -> Result<Obtained, OciError> {
    let started = std::time::Instant::now();
    let base = base_bundle(opts)?;
    let arch = base.manifest.arch;
    let work = images_dir().join("work");
    let (source, downloaded, cached, _scratch) = match origin {
        Origin::Registry(reference) => {
            let pull = PullOptions {
                arch: Some(arch),
                allow_http_loopback: opts.allow_http_loopback,
                credentials: opts.credentials.clone(),
            };
            let cache = BlobCache::new(crate::paths::cache_dir().join("oci"));
            let pulled = umbra_image::pull(reference, &pull, &cache, progress).await?;
            (pulled.source, pulled.downloaded_bytes, pulled.cached_bytes, None)
        }
        Origin::Archive(path) => {
            let (path, work) = (path.to_path_buf(), work.clone());
            let imported = tokio::task::spawn_blocking(move || umbra_image::import::import(&path, arch, &work))
                .await
                .map_err(|e| OciError::Io(format!("the import stopped: {e}")))??;
            (imported.source, 0, 0, imported.scratch)
        }
    };
    let version = umbra_image::version_for(&source.digest, &base.manifest)?;
    let store = store();
    let converted = store.get(&version).is_err();
    if converted {
        let out = images_dir().join(&version);
        let (src, base, work, dir) = (source.clone(), base.clone(), work.clone(), out.clone());
        let done = tokio::task::spawn_blocking(move || umbra_image::convert(&src, &base, &work, &dir))
            .await
            .map_err(|e| OciError::Io(format!("the conversion stopped: {e}")))??;
        progress(format!(
            "converted {} in {:.1} s: {} entries ({} whiteouts, {} opaque, {} hard links), erofs {} bytes",
            source.reference,
            done.seconds,
            done.applied.entries,
            done.applied.whiteouts,
            done.applied.opaque,
            done.applied.hard_links,
            done.erofs.bytes
        ));
        let installed = (|| {
            let (key, made) = crate::bundle_trust::sign_local(&out, None)?;
            if let Some(public) = made {
                progress(format!("made this machine's signing key {key}; this user trusts it: {}", public.display()));
            }
            let opts = BundlePullOptions { trust: trust()?, keep_current: true, ..BundlePullOptions::default() };
            let store = store.clone();
            store.import(&out, &opts, &mut |_| {})?;
            Ok::<_, OciError>(())
        })();
        let _ = std::fs::remove_dir_all(&out);
        installed?;
    }
    remember(arch, &source.reference, &version)?;
    Ok(Obtained {
        reference: source.reference,
        digest: source.digest,
        bundle: version,
        arch,
        downloaded_bytes: downloaded,
        cached_bytes: cached,
        converted,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// The installed bundle for `reference` and its image's defaults, pulled and converted first
/// when it was not before.
pub async fn bundle_for(
    reference: &str,
    opts: &ObtainOptions,
    trust: TrustFn<'_>,
    progress: &mut (dyn FnMut(String) + Send),
) -> Result<(String, umbra_bundle::ImageInfo), OciError> {
    let version = match known(reference, opts.arch) {
        Some(v) => v,
        None => obtain(Origin::Registry(reference), opts, trust, progress).await?.bundle,
    };
    let info = store()
        .get(&version)?
        .manifest
        .image
        .ok_or_else(|| OciError::Base { spec: version.clone(), reason: "it was not made from an image".into() })?;
    Ok((version, info))
}
