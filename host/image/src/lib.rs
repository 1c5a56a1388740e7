//! Guest images made from OCI images. A registry pull ([`registry`]) or an archive
//! ([`import`]) gives the manifest's config and layers, each blob verified; the layers are
//! applied into an in-memory tree ([`layers`], [`tree`]) and written as a read-only erofs root
//! ([`erofs`]); with a base bundle's kernel and agent that is a bundle like any other
//! ([`convert`]), which the caller signs and installs.

pub mod cache;
pub mod config;
pub mod convert;
pub mod erofs;
pub mod import;
pub mod layers;
pub mod registry;
pub mod tree;

use std::path::{Path, PathBuf};

pub use cache::BlobCache;
pub use convert::{convert, version_for, Converted};
pub use registry::{pull, PullOptions, Pulled};

/// One layer blob (compressed or not) on disk, its digest already checked.
#[derive(Clone, Debug)]
pub struct Layer {
    pub digest: String,
    pub path: PathBuf,
}

/// An image ready to convert: its identity, its config's bytes (digest checked) and its
/// layers, bottom first.
#[derive(Clone, Debug)]
pub struct Source {
    pub reference: String,
    /// The image manifest's digest, or for a `docker save` archive without one, the config's.
    pub digest: String,
    pub config: Vec<u8>,
    pub layers: Vec<Layer>,
}

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Registry(String),
    #[error(transparent)]
    Layer(#[from] layers::LayerError),
    #[error("cannot {what} {path}: {source}")]
    Io { what: String, path: String, source: std::io::Error },
    #[error(transparent)]
    Bundle(#[from] umbra_bundle::BundleError),
}

impl ImageError {
    pub(crate) fn io(what: &str, path: &Path, source: std::io::Error) -> Self {
        ImageError::Io { what: what.to_string(), path: path.display().to_string(), source }
    }
}
