//! Umbra guest bundles: what a guest is made of, how it is packed, and how it is downloaded,
//! unpacked with every byte verified, and kept.
//!
//! A bundle is a directory or a URL holding `manifest.json` and one zstd-compressed file per
//! artifact. The manifest pins the size and sha256 of both the compressed and the uncompressed
//! bytes, so a download can be checked before and after decompression. [`Store`] is the installed
//! side: versions under `$XDG_DATA_HOME/umbra/bundles`, a `current` link, a warm slot.
//! `docs/bundle.md` is the schema's and the store's reference.

mod digest;
mod extract;
mod fetch;
mod lock;
mod manifest;
mod pack;
mod progress;
mod pull;
mod resume;
mod retry;
mod sign;
mod store;
#[cfg(feature = "testserver")]
pub mod testserver;

pub use extract::{extract_artifact, Extracted, ExtractedBundle};
pub use fetch::SourceCheck;
pub use lock::{exclusive as lock_exclusive, Lock};
pub use manifest::{
    Arch, Artifact, ArtifactRole, Boot, ImageInfo, Manifest, ManifestError, MANIFEST_FILE, SCHEMA_VERSION,
};
pub use pack::{current, pack, PackInput, PackOptions};
pub use progress::{Phase, Progress};
pub use pull::{dir_url, PullOptions, Pulled, PulledHow, Signed};
pub use retry::RetryPolicy;
pub use sign::{
    check_url, public_path, sign_dir, PublicKey, SecretKey, SignatureEntry, SignatureFile, Trust, SIGNATURE_FILE,
};
pub use store::{ArtifactCheck, InstalledInfo, Store};

/// Everything that can go wrong with a bundle. Messages name the artifact, the file or URL and
/// the expected and actual values.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    #[error("{what} {path}: {source}")]
    Io { what: &'static str, path: String, source: std::io::Error },
    #[error("artifact {artifact} ({file}): {kind} size mismatch: expected {expected} bytes, got {actual}")]
    SizeMismatch { artifact: String, file: String, kind: &'static str, expected: u64, actual: u64 },
    #[error("artifact {artifact} ({file}): {kind} sha256 mismatch: expected {expected}, got {actual}")]
    DigestMismatch { artifact: String, file: String, kind: &'static str, expected: String, actual: String },
    #[error("artifact {artifact} ({file}): corrupt zstd stream: {source}")]
    Decompress { artifact: String, file: String, source: std::io::Error },
    /// `what` is `manifest` or `artifact <name>`.
    /// `note` says whether it was retried.
    #[error("{what} ({url}): HTTP {status}{note}")]
    Http { what: String, url: String, status: u16, note: &'static str },
    #[error("{what} ({url}): network error after {attempts} attempts: {message}")]
    Network { what: String, url: String, attempts: u32, message: String },
    #[error("{what} ({url}): {reason}")]
    Protocol { what: String, url: String, reason: String },
    #[error("bundle URL {url:?}: {reason}")]
    Url { url: String, reason: String },
    #[error(
        "not enough disk space (ENOSPC) in {path} for bundle {version}: needs {needed} bytes, {available} available"
    )]
    NoSpace { path: String, version: String, needed: u64, available: u64 },
    #[error("artifact {artifact} ({file}): no space left on device (ENOSPC) writing {path}")]
    DiskFull { artifact: String, file: String, path: String },
    #[error("no space left on device (ENOSPC) writing {path}")]
    NoSpaceLeft { path: String },
    #[error("bundle {version} is not installed in {root}")]
    NotInstalled { version: String, root: String },
    #[error("bundle {version} is current; switch to another version first (or force)")]
    InUse { version: String },
    #[error(
        "bundle {version} is not signed: there is no manifest.sig beside {location}; refusing it (bundles must be signed: vmctl bundle sign)"
    )]
    Unsigned { version: String, location: String },
    #[error("bundle {version} is wrongly signed: {reason}; refusing it")]
    BadSignature { version: String, reason: String },
    #[error("bundle {version} is signed only by {signers}, which this host does not trust; refusing it ({hint})")]
    UntrustedSigner { version: String, signers: String, hint: String },
    #[error("key {path}: {reason}")]
    Key { path: String, reason: String },
}

pub(crate) fn io_err<'a>(
    what: &'static str,
    path: &'a std::path::Path,
) -> impl FnOnce(std::io::Error) -> BundleError + 'a {
    move |source| match source.raw_os_error() {
        // A full disk is the one write error users can act on, so it is named as such.
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => BundleError::NoSpaceLeft { path: path.display().to_string() },
        _ => BundleError::Io { what, path: path.display().to_string(), source },
    }
}
