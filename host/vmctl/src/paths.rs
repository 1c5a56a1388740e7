//! Where vmctl keeps things on this host.

use std::path::PathBuf;

pub use umbra_runtime::paths::cache_dir;

/// Bundles built by `vmctl bundle build`, one directory per flavor.
pub fn bundles_dir() -> PathBuf {
    cache_dir().join("bundles")
}

/// Verified, decompressed bundles, one directory per bundle version.
pub fn extracted_dir() -> PathBuf {
    cache_dir().join("extracted")
}
