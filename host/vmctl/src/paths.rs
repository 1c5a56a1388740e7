//! Where vmctl keeps things on this host: the runtime's rules.

use std::path::PathBuf;

use anyhow::Context;
pub use umbra_runtime::paths::{built_bundles_dir, cache_dir};

/// A packed bundle directory (or built flavor) by name, for the benchmarks that boot one
/// directly.
pub fn bundle_dir(spec: &str) -> anyhow::Result<PathBuf> {
    umbra_runtime::image::packed_dir(spec).with_context(|| {
        format!("no bundle {spec:?} (a directory with manifest.json, or a flavor built by `vmctl bundle build`)")
    })
}
