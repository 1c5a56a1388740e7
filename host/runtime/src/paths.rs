//! Where Umbra keeps things on this host; one definition shared by vmctl, umbrad, the tests and
//! (by the same rule) `scripts/build-kernel`. Per-user state (sockets, sessions, config) follows
//! `umbra_api::paths`, which clients use too.

use std::path::PathBuf;

pub use umbra_api::paths::{config_dir, data_dir, runtime_dir, state_dir};

/// `$UMBRA_CACHE_DIR`, else `${XDG_CACHE_HOME:-~/.cache}/umbra`: kernel builds, built bundles,
/// extractions.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("UMBRA_CACHE_DIR") {
        return d.into();
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| "/tmp".into());
    std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).unwrap_or_else(|| home.join(".cache")).join("umbra")
}

/// Bundles built by `vmctl bundle build`, one directory per flavor (see [`built_bundle_name`]).
pub fn built_bundles_dir() -> PathBuf {
    cache_dir().join("bundles")
}

/// The name `vmctl bundle build` gives a flavor in [`built_bundles_dir`]: the flavor for this
/// host's architecture (what `--bundle minimal` finds), `<flavor>-<arch>` for another one
/// (`minimal-aarch64` on an x86_64 host).
pub fn built_bundle_name(flavor: &str, arch: umbra_bundle::Arch) -> String {
    if arch == umbra_bundle::Arch::host() {
        flavor.to_string()
    } else {
        format!("{flavor}-{arch}")
    }
}

/// Verified, decompressed bundles, one directory per bundle version.
pub fn extracted_dir() -> PathBuf {
    cache_dir().join("extracted")
}
