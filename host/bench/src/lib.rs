//! The benchmarks behind `vmctl bench …`, out of the operator CLI: each prints its numbers
//! beside an anchor measured in the same run (QEMU's own launch, native file I/O, the host's
//! own network, curl | zstd | sha256, Firecracker where one is installed). `vmctl` parses the
//! command line into these argument types and calls the matching function.

#[cfg(target_os = "linux")]
pub mod anchor_firecracker;
pub mod boot;
pub mod bundle;
pub mod density;
pub mod fs;
pub mod image;
pub mod lint;
pub mod net;
pub mod ports;
pub mod session;
#[cfg(target_os = "linux")]
pub mod vmm;

use std::path::PathBuf;

use anyhow::Context;
use umbra_runtime::backend::BootImage;

/// Where the runtime keeps things on this host.
pub(crate) mod paths {
    pub use umbra_runtime::paths::extracted_dir;
}

/// A bundle spec as a directory (the benchmarks that start helpers by hand need its files).
pub(crate) fn bundle_dir(spec: &str) -> anyhow::Result<PathBuf> {
    umbra_runtime::image::packed_dir(spec)
        .with_context(|| format!("no bundle directory or built flavor {spec:?} to benchmark"))
}

/// What `--bundle SPEC` boots (see `umbra_runtime::image`); says so when a warm download is
/// promoted on the way.
pub(crate) fn boot_image(spec: &str) -> anyhow::Result<BootImage> {
    let resolved = umbra_runtime::image::resolve_default(spec)?;
    if let Some(version) = resolved.promoted_warm {
        eprintln!("vmctl: promoted the warm bundle {version}");
    }
    Ok(resolved.image)
}
