//! Where vmctl keeps things on this host.

use std::path::PathBuf;

/// `$UMBRA_CACHE_DIR`, else `~/.cache/umbra` (kernel builds, built bundles, extractions).
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("UMBRA_CACHE_DIR") {
        return d.into();
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| "/tmp".into());
    std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).unwrap_or_else(|| home.join(".cache")).join("umbra")
}

/// Bundles built by `vmctl bundle build`, one directory per flavor.
pub fn bundles_dir() -> PathBuf {
    cache_dir().join("bundles")
}

/// Verified, decompressed bundles, one directory per bundle version.
pub fn extracted_dir() -> PathBuf {
    cache_dir().join("extracted")
}
