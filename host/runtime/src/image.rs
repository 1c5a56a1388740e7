//! What a bundle spec boots: a packed bundle directory, a flavor built by `vmctl bundle build`
//! (both verified and extracted into the cache), or a version installed in the store, where
//! `current` first promotes a warm download — the "next start" a warm pull waits for.

use std::path::PathBuf;

use umbra_bundle::{BundleError, Store};

use crate::backend::BootImage;
use crate::paths;

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error(
        "no bundle {spec:?}: not a bundle directory, not a built flavor in {built}, not installed in {store} \
         (build one with `vmctl bundle build --flavor minimal`, or `vmctl bundle pull URL`)"
    )]
    NoSuchBundle { spec: String, built: String, store: String },
    #[error("bundle {spec:?} failed verification: {source}")]
    Invalid { spec: String, source: Box<BundleError> },
    #[error("cannot promote the warm bundle: {0}")]
    Promote(Box<BundleError>),
}

/// A boot image and what resolving it did on the way.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub image: BootImage,
    /// The warm bundle that was promoted to `current` first, if any.
    pub promoted_warm: Option<String>,
}

/// The packed bundle directory `spec` names (a path holding `manifest.json`, or a built
/// flavor), if there is one.
pub fn packed_dir(spec: &str) -> Option<PathBuf> {
    let as_path = PathBuf::from(spec);
    if as_path.join("manifest.json").is_file() {
        return Some(as_path);
    }
    let built = paths::built_bundles_dir().join(spec);
    // A spec is a name here, never a path that could climb out of the directory.
    (!spec.contains('/') && built.join("manifest.json").is_file()).then_some(built)
}

/// Resolves `spec` against the store at `store`.
pub fn resolve(spec: &str, store: &Store) -> Result<Resolved, ImageError> {
    resolve_with(spec, store, true)
}

/// [`resolve`], promoting a warm download to `current` first only when `promote` (a session
/// start does; the warm pool, which only looks ahead, does not).
pub fn resolve_with(spec: &str, store: &Store, promote: bool) -> Result<Resolved, ImageError> {
    if let Some(dir) = packed_dir(spec) {
        let image = BootImage::from_bundle_dir(&dir, &paths::extracted_dir())
            .map_err(|source| ImageError::Invalid { spec: spec.into(), source: Box::new(source) })?;
        return Ok(Resolved { image, promoted_warm: None });
    }
    let promoted_warm = if spec == "current" && promote {
        store.promote_warm().map_err(|e| ImageError::Promote(Box::new(e)))?.map(|b| b.manifest.bundle_version.clone())
    } else {
        None
    };
    let bundle = store.get(spec).map_err(|e| match e {
        BundleError::NotInstalled { .. } => ImageError::NoSuchBundle {
            spec: spec.into(),
            built: paths::built_bundles_dir().display().to_string(),
            store: store.root().display().to_string(),
        },
        other => ImageError::Invalid { spec: spec.into(), source: Box::new(other) },
    })?;
    Ok(Resolved { image: BootImage::from_extracted(&bundle), promoted_warm })
}

/// [`resolve`] against the default store.
pub fn resolve_default(spec: &str) -> Result<Resolved, ImageError> {
    resolve(spec, &Store::new(Store::default_root()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_spec_names_every_place_it_looked() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path().join("store"));
        let e = resolve("no-such-bundle", &store).unwrap_err().to_string();
        assert!(e.contains("no-such-bundle") && e.contains("store") && e.contains("vmctl bundle build"), "{e}");
        assert!(packed_dir("../../etc").is_none());
    }
}
