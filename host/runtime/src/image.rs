//! What a bundle spec boots: a packed bundle directory, a flavor built by `vmctl bundle build`
//! (both verified and extracted into the cache), or a version installed in the store, where
//! `current` first promotes a warm download — the "next start" a warm pull waits for.

use std::path::PathBuf;

use umbra_bundle::{BundleError, ExtractedBundle, Store};

use crate::backend::BootImage;
use crate::paths;

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error(
        "no bundle {spec:?}: not a bundle directory, not a built flavor in {built} (built: {built_names}), not \
         installed in {store} (installed: {installed_names}); build one with `vmctl bundle build --flavor \
         minimal`, or `vmctl bundle pull URL`",
        built_names = none_if_empty(built_flavors),
        installed_names = none_if_empty(installed)
    )]
    NoSuchBundle { spec: String, built: String, built_flavors: Vec<String>, store: String, installed: Vec<String> },
    #[error("bundle {spec:?} failed verification: {source}")]
    Invalid { spec: String, source: Box<BundleError> },
    #[error("cannot promote the warm bundle: {0}")]
    Promote(Box<BundleError>),
}

fn none_if_empty(names: &[String]) -> String {
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

/// The flavors `vmctl bundle build` has built for this host's architecture, in the order a
/// missing `current` falls back to them: `minimal` (what `scripts/sandbox` builds), then
/// `standard`, then the rest by name.
pub fn built_flavors() -> Vec<String> {
    let dir = paths::built_bundles_dir();
    let host = umbra_bundle::Arch::host().as_str();
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_string();
            let manifest: serde_json::Value =
                serde_json::from_slice(&std::fs::read(e.path().join("manifest.json")).ok()?).ok()?;
            (manifest["arch"].as_str() == Some(host)).then_some(name)
        })
        .collect();
    let rank = |n: &str| ["minimal", "standard"].iter().position(|f| *f == n).unwrap_or(2);
    names.sort_by(|a, b| rank(a).cmp(&rank(b)).then_with(|| a.cmp(b)));
    names
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
    let (bundle, promoted_warm) = extracted_with(spec, store, promote)?;
    Ok(Resolved { image: BootImage::from_extracted(&bundle), promoted_warm })
}

/// [`resolve_with`]'s bundle itself (its manifest and directory), and the warm bundle it
/// promoted first, if any.
pub fn extracted_with(
    spec: &str,
    store: &Store,
    promote: bool,
) -> Result<(ExtractedBundle, Option<String>), ImageError> {
    if let Some(dir) = packed_dir(spec) {
        let bundle = ExtractedBundle::from_dir(&dir, &paths::extracted_dir(), env!("CARGO_PKG_VERSION"))
            .map_err(|source| ImageError::Invalid { spec: spec.into(), source: Box::new(source) })?;
        return Ok((bundle, None));
    }
    let promoted_warm = if spec == "current" && promote {
        store.promote_warm().map_err(|e| ImageError::Promote(Box::new(e)))?.map(|b| b.manifest.bundle_version.clone())
    } else {
        None
    };
    let bundle = match store.get(spec) {
        Ok(bundle) => bundle,
        // The default, with nothing installed yet: the flavor this machine built (what a first
        // `scripts/sandbox` or `vmctl bundle build` leaves), so a first session just works.
        Err(BundleError::NotInstalled { .. }) if spec == "current" => {
            if let Some(flavor) = built_flavors().into_iter().next() {
                return extracted_with(&flavor, store, promote);
            }
            return Err(no_such_bundle(spec, store));
        }
        Err(BundleError::NotInstalled { .. }) => return Err(no_such_bundle(spec, store)),
        Err(other) => return Err(ImageError::Invalid { spec: spec.into(), source: Box::new(other) }),
    };
    Ok((bundle, promoted_warm))
}

fn no_such_bundle(spec: &str, store: &Store) -> ImageError {
    ImageError::NoSuchBundle {
        spec: spec.into(),
        built: paths::built_bundles_dir().display().to_string(),
        built_flavors: built_flavors(),
        store: store.root().display().to_string(),
        installed: store.list().into_iter().filter(|b| !b.warm).map(|b| b.version).collect(),
    }
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
        assert!(e.contains("installed: none"), "{e}");
        assert!(packed_dir("../../etc").is_none());
    }
}
