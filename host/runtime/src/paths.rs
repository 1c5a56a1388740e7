//! Where Umbra keeps things on this host; one definition shared by vmctl, the tests and
//! (by the same rule) `scripts/build-kernel`.

use std::path::PathBuf;

/// `$UMBRA_CACHE_DIR`, else `${XDG_CACHE_HOME:-~/.cache}/umbra`: kernel builds, built bundles,
/// extractions.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("UMBRA_CACHE_DIR") {
        return d.into();
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| "/tmp".into());
    std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).unwrap_or_else(|| home.join(".cache")).join("umbra")
}
