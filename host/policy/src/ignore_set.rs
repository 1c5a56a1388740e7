//! Ignore patterns: which files of a workspace folder never reach the guest.
//!
//! Patterns are gitignore syntax, compiled by ripgrep's `ignore` crate (the same matcher git
//! users expect: `*.pem` at any depth, `/build` anchored, `secrets/**`, `dir/` for directories,
//! `!keep.pem` to re-include). A file is ignored when it or any of its parent directories
//! matches, as in git: `secrets/` hides everything below it.

use std::path::{Path, PathBuf};

use ignore::gitignore::{Gitignore, GitignoreBuilder};

/// Compiled ignore patterns for one folder.
#[derive(Debug, Clone)]
pub struct IgnoreSet {
    root: PathBuf,
    matcher: Gitignore,
}

impl IgnoreSet {
    /// Compiles `patterns` for the folder at `root` (a path the matched paths are under, or
    /// relative paths are taken from).
    pub fn new(root: impl Into<PathBuf>, patterns: &[String]) -> Result<Self, IgnoreError> {
        let root = root.into();
        let mut builder = GitignoreBuilder::new(&root);
        for pattern in patterns {
            builder
                .add_line(None, pattern)
                .map_err(|e| IgnoreError { pattern: pattern.clone(), error: e.to_string() })?;
        }
        let matcher =
            builder.build().map_err(|e| IgnoreError { pattern: patterns.join(", "), error: e.to_string() })?;
        Ok(Self { root, matcher })
    }

    /// Whether `path` (absolute under the root, or relative to it) is hidden. A path outside
    /// the root is not this folder's to hide.
    pub fn is_ignored(&self, path: &Path, is_dir: bool) -> bool {
        let relative = if path.is_absolute() {
            match path.strip_prefix(&self.root) {
                Ok(r) => r,
                Err(_) => return false,
            }
        } else {
            path
        };
        if relative.as_os_str().is_empty() {
            return false;
        }
        self.matcher.matched_path_or_any_parents(relative, is_dir).is_ignore()
    }
}

/// A pattern that is not a gitignore pattern.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("ignore: {pattern:?} is not a gitignore pattern: {error}")]
pub struct IgnoreError {
    pub pattern: String,
    pub error: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(patterns: &[&str]) -> IgnoreSet {
        IgnoreSet::new("/w", &patterns.iter().map(|p| p.to_string()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn gitignore_semantics() {
        let s = set(&[".env", "*.pem", "secrets/**", "/build", "cache/", "!keep.pem"]);
        let cases = [
            ("/w/.env", false, true),
            ("/w/app/.env", false, true),
            ("/w/.env.example", false, false),
            ("/w/certs/server.pem", false, true),
            ("/w/keep.pem", false, false),
            ("/w/secrets/db/password", false, true),
            ("/w/build/out.o", false, true),
            ("/w/src/build/out.o", false, false),
            ("/w/cache", true, true),
            ("/w/cache/x", false, true),
            ("/w/cache", false, false),
            ("/w/src/main.rs", false, false),
            ("/elsewhere/.env", false, false),
            ("app/.env", false, true),
        ];
        for (path, is_dir, want) in cases {
            assert_eq!(s.is_ignored(Path::new(path), is_dir), want, "{path} (dir: {is_dir})");
        }
    }

    #[test]
    fn a_bad_pattern_is_refused_with_its_text() {
        let err = IgnoreSet::new("/w", &["x[z-a]".to_string()]).unwrap_err();
        assert!(err.to_string().contains("x[z-a]"), "{err}");
    }
}
