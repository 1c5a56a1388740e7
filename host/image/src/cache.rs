//! The blob cache: each blob once, named by its digest (`blobs/sha256/<hex>`), written under a
//! temporary name and renamed only once its digest was checked, so a name always holds the
//! bytes it names.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::ImageError;

#[derive(Clone, Debug)]
pub struct BlobCache {
    root: PathBuf,
}

static PARTIAL: AtomicU64 = AtomicU64::new(0);

/// The hex of a `sha256:` digest, checked: it becomes a file name.
pub fn sha256_hex(digest: &str) -> Result<&str, ImageError> {
    digest
        .strip_prefix("sha256:")
        .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
        .ok_or_else(|| ImageError::Invalid(format!("{digest:?} is not a sha256 digest")))
}

impl BlobCache {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        BlobCache { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn dir(&self) -> PathBuf {
        self.root.join("blobs").join("sha256")
    }

    /// The cached blob, if there is one.
    pub fn get(&self, digest: &str) -> Result<Option<PathBuf>, ImageError> {
        let path = self.dir().join(sha256_hex(digest)?);
        Ok(path.is_file().then_some(path))
    }

    /// A fresh temporary path for a blob being written.
    pub fn partial_path(&self, digest: &str) -> Result<PathBuf, ImageError> {
        let hex = sha256_hex(digest)?;
        let dir = self.dir();
        std::fs::create_dir_all(&dir).map_err(|e| ImageError::io("create", &dir, e))?;
        let n = PARTIAL.fetch_add(1, Ordering::Relaxed);
        Ok(dir.join(format!(".{hex}.partial-{}-{n}", std::process::id())))
    }

    /// Puts a verified blob in place.
    pub fn commit(&self, digest: &str, partial: &Path) -> Result<PathBuf, ImageError> {
        let path = self.dir().join(sha256_hex(digest)?);
        std::fs::rename(partial, &path).map_err(|e| ImageError::io("rename", partial, e))?;
        Ok(path)
    }

    /// Bytes the cached blobs take.
    pub fn bytes(&self) -> u64 {
        std::fs::read_dir(self.dir())
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.metadata().ok())
            .filter(|m| m.is_file())
            .map(|m| m.len())
            .sum()
    }
}
