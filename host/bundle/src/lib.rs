//! Umbra guest bundles: what a guest is made of, how it is packed, and how it is unpacked with
//! every byte verified.
//!
//! A bundle is a directory (or, later, a URL) holding `manifest.json` and one zstd-compressed
//! file per artifact. The manifest pins the size and sha256 of both the compressed and the
//! uncompressed bytes, so a download can be checked before and after decompression.
//! `docs/bundle.md` is the schema's reference.

mod digest;
mod extract;
mod manifest;
mod pack;

pub use extract::{extract_artifact, Extracted, ExtractedBundle};
pub use manifest::{Artifact, ArtifactRole, Boot, Manifest, ManifestError, MANIFEST_FILE, SCHEMA_VERSION};
pub use pack::{pack, PackInput, PackOptions};

/// Everything that can go wrong with a bundle. Messages name the artifact, the file and the
/// expected and actual values.
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
}

pub(crate) fn io_err<'a>(
    what: &'static str,
    path: &'a std::path::Path,
) -> impl FnOnce(std::io::Error) -> BundleError + 'a {
    move |source| BundleError::Io { what, path: path.display().to_string(), source }
}
