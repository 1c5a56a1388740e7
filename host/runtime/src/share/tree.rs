//! Walking and copying a tree the guest writes (a session's `outputs/` and `uploads/`, or any
//! host folder a guest shares read-write): beneath its root only, following no symlink,
//! bounded. (A shadow folder's upper layer lives in the guest; its changes reach the host
//! through the agent and [`super::shadow`], not through a host walk.)
//!
//! The guest changes such a tree while the host reads it, so nothing here re-walks a path
//! string: every directory is opened `O_NOFOLLOW` from its parent's descriptor, every file is
//! opened the same way (`O_NONBLOCK`, so a FIFO swapped in cannot hang us) and must still be
//! the regular file the listing saw (same device and inode), or the walk stops with
//! [`TreeError::Changed`]. Symlinks are reported, never followed; a copy recreates them as
//! symlinks, whose targets mean something only inside a guest. Entries, bytes and depth are
//! bounded ([`TreeLimits`]), and a tree past a bound is an error naming the bound, never a
//! partial result passed off as whole.
//!
//! Hard links need no special case: a guest can only link files inside the same share (see
//! [`super::paths`]), and a copy reads each link's content into a file of its own, counting
//! every link against the byte bound, so linking one big file many times buys nothing.

use std::ffi::{OsStr, OsString};
use std::fs::{File, Metadata};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::beneath;

/// How much of a guest-written tree the host walks or copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeLimits {
    /// Entries of any kind, directories included (the root is not counted).
    pub max_entries: u64,
    /// Bytes of regular files, each hard link counted in full.
    pub max_bytes: u64,
    /// Directories nested below the root (also bounds the descriptors a walk holds open).
    pub max_depth: usize,
}

impl TreeLimits {
    /// The bounds on a session's own trees (what a fork copies, what the outputs watcher
    /// indexes): far beyond what an app's session produces, well short of what would exhaust
    /// the host.
    pub const GUEST_TREE: Self = Self { max_entries: 1_000_000, max_bytes: 64 << 30, max_depth: 256 };
}

/// Why a walk or copy of a guest-written tree stopped.
#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    #[error("{root} holds more than {limit} entries (the bound on a tree a guest writes)")]
    TooManyEntries { root: PathBuf, limit: u64 },
    #[error("{root} holds more than {limit} bytes (the bound on a tree a guest writes)")]
    TooLarge { root: PathBuf, limit: u64 },
    #[error("{path} is nested more than {limit} directories deep (the bound on a tree a guest writes)")]
    TooDeep { path: PathBuf, limit: usize },
    #[error("{path} changed while it was read: it is no longer the {was} the listing saw")]
    Changed { path: PathBuf, was: &'static str },
    /// Removed since the listing: a walk passes over it (the guest may delete what it likes).
    #[error("{path} was removed while the tree was read")]
    Vanished { path: PathBuf },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl TreeError {
    fn io(path: &Path) -> impl FnOnce(io::Error) -> Self + '_ {
        move |source| Self::Io { path: path.to_path_buf(), source }
    }
}

/// What an entry is, as `lstat` saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    Dir,
    File,
    Symlink,
    /// A FIFO, socket or device node: never opened.
    Other,
}

/// One entry met by [`walk`].
pub struct TreeEntry<'a> {
    /// Relative to the root.
    pub rel: &'a Path,
    /// The directory holding it, and its name there, for `*at` calls.
    pub dir: &'a File,
    pub name: &'a OsStr,
    pub kind: EntryKind,
    /// Its `lstat`.
    pub meta: &'a Metadata,
    /// The root (for messages).
    root: &'a Path,
}

impl TreeEntry<'_> {
    /// Where it is, for messages.
    pub fn shown(&self) -> PathBuf {
        self.root.join(self.rel)
    }

    /// Opens the regular file for reading, without following a symlink and without blocking on
    /// a FIFO; it must still be the file the listing saw.
    pub fn open_file(&self) -> Result<File, TreeError> {
        let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY;
        let file = beneath::openat(self.dir, self.name, flags, 0).map_err(|e| self.swapped_or(e, "regular file"))?;
        let meta = file.metadata().map_err(TreeError::io(&self.shown()))?;
        if !meta.is_file() || !same_inode(&meta, self.meta) {
            return Err(TreeError::Changed { path: self.shown(), was: "regular file" });
        }
        Ok(file)
    }

    /// The symlink's target (read, never followed).
    pub fn read_link(&self) -> Result<OsString, TreeError> {
        beneath::readlink_at(self.dir, self.name).map_err(|e| self.swapped_or(e, "symlink"))
    }

    fn swapped_or(&self, e: io::Error, was: &'static str) -> TreeError {
        swapped_or(self.shown(), e, was)
    }
}

/// A symlink where the listing saw something else (`ELOOP`; `ENOTDIR` from an `O_DIRECTORY`
/// open) or a non-symlink where it saw one (`EINVAL` from readlink): the tree changed under
/// us. Nothing there any more is [`TreeError::Vanished`].
fn swapped_or(path: PathBuf, e: io::Error, was: &'static str) -> TreeError {
    match e.raw_os_error() {
        Some(libc::ENOENT) => TreeError::Vanished { path },
        Some(libc::ELOOP | libc::EINVAL | libc::ENOTDIR) => TreeError::Changed { path, was },
        _ => TreeError::Io { path, source: e },
    }
}

fn same_inode(a: &Metadata, b: &Metadata) -> bool {
    a.dev() == b.dev() && a.ino() == b.ino()
}

/// Whether [`walk`] enters a directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Descend,
    Skip,
}

/// What a walk met.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TreeTotals {
    pub entries: u64,
    /// The regular files' sizes as listed (a copy counts what it actually read instead).
    pub bytes: u64,
}

/// A directory being listed: its descriptor, where it is, the names left to visit.
struct Level {
    dir: File,
    rel: PathBuf,
    names: std::vec::IntoIter<OsString>,
}

/// Visits every entry below `root` (an open directory; `shown` names it in errors), parents
/// before children, each directory's names in byte order. `visit` decides whether a directory
/// is entered; symlinks are never followed. Stops at the first error, `visit`'s included.
pub fn walk(
    root: &File,
    shown: &Path,
    limits: TreeLimits,
    mut visit: impl FnMut(&TreeEntry<'_>) -> Result<Step, TreeError>,
) -> Result<TreeTotals, TreeError> {
    let mut totals = TreeTotals::default();
    let root_dir =
        beneath::openat(root, OsStr::new("."), libc::O_RDONLY | libc::O_DIRECTORY, 0).map_err(TreeError::io(shown))?;
    let mut stack = vec![open_level(root_dir, PathBuf::new(), shown, limits, &totals)?];
    loop {
        let depth = stack.len();
        let Some(level) = stack.last_mut() else { break };
        let Some(name) = level.names.next() else {
            stack.pop();
            continue;
        };
        let level: &Level = level;
        let rel = level.rel.join(&name);
        totals.entries += 1;
        if totals.entries > limits.max_entries {
            return Err(TreeError::TooManyEntries { root: shown.to_path_buf(), limit: limits.max_entries });
        }
        let meta = match beneath::lstat_at(&level.dir, &name) {
            Ok(meta) => meta,
            // Deleted since the listing: the guest's to do, nothing to visit.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(TreeError::Io { path: shown.join(&rel), source: e }),
        };
        let file_type = meta.file_type();
        let kind = if file_type.is_dir() {
            EntryKind::Dir
        } else if file_type.is_file() {
            EntryKind::File
        } else if file_type.is_symlink() {
            EntryKind::Symlink
        } else {
            EntryKind::Other
        };
        if kind == EntryKind::File {
            totals.bytes = totals.bytes.saturating_add(meta.len());
            if totals.bytes > limits.max_bytes {
                return Err(TreeError::TooLarge { root: shown.to_path_buf(), limit: limits.max_bytes });
            }
        }
        let entry = TreeEntry { rel: &rel, dir: &level.dir, name: &name, kind, meta: &meta, root: shown };
        if visit(&entry)? == Step::Skip || kind != EntryKind::Dir {
            continue;
        }
        if depth > limits.max_depth {
            return Err(TreeError::TooDeep { path: shown.join(&rel), limit: limits.max_depth });
        }
        // O_NOFOLLOW: a directory swapped for a symlink since the lstat is refused, not entered.
        let sub = match beneath::open_subdir(&level.dir, &name) {
            Ok(sub) => sub,
            Err(e) => match swapped_or(shown.join(&rel), e, "directory") {
                TreeError::Vanished { .. } => continue,
                other => return Err(other),
            },
        };
        if !same_inode(&sub.metadata().map_err(TreeError::io(&shown.join(&rel)))?, &meta) {
            return Err(TreeError::Changed { path: shown.join(&rel), was: "directory" });
        }
        let next = open_level(sub, rel, shown, limits, &totals)?;
        stack.push(next);
    }
    Ok(totals)
}

/// Lists `dir`, reading no more names than the entry bound leaves room for.
fn open_level(
    dir: File,
    rel: PathBuf,
    shown: &Path,
    limits: TreeLimits,
    totals: &TreeTotals,
) -> Result<Level, TreeError> {
    let room = limits.max_entries.saturating_sub(totals.entries);
    let room = usize::try_from(room).unwrap_or(usize::MAX);
    let mut names = beneath::read_dir_at_most(&dir, room).map_err(TreeError::io(&shown.join(&rel)))?;
    if names.len() > room {
        return Err(TreeError::TooManyEntries { root: shown.to_path_buf(), limit: limits.max_entries });
    }
    names.sort();
    Ok(Level { dir, rel, names: names.into_iter() })
}

/// Copies the tree below `src` (an open directory; `shown` names it in errors) into the new
/// directory `dst`: directories and regular files with their permission bits (never set-id or
/// sticky bits: a guest's set-uid file must not become one on the host), symlinks as symlinks;
/// FIFOs, sockets and devices are skipped. `dst` must not exist (it is host-made, and nobody
/// else writes it during the copy). Returns what was copied, `bytes` as actually read: a file
/// growing during the copy is bounded all the same.
pub fn copy(src: &File, shown: &Path, dst: &Path, limits: TreeLimits) -> Result<TreeTotals, TreeError> {
    std::fs::DirBuilder::new().mode(0o700).create(dst).map_err(TreeError::io(dst))?;
    let mut copied = TreeTotals::default();
    walk(src, shown, limits, |entry| {
        let to = dst.join(entry.rel);
        let mode = entry.meta.mode() & 0o777;
        copied.entries += 1;
        match entry.kind {
            // Owner access first, so the copy can fill it; the listed bits are kept otherwise.
            EntryKind::Dir => {
                std::fs::DirBuilder::new().mode(mode | 0o700).create(&to).map_err(TreeError::io(&to))?;
                return Ok(Step::Descend);
            }
            EntryKind::File => {
                let mut from = match entry.open_file() {
                    Ok(from) => from,
                    // Deleted since the listing: the copy is of a moment after that.
                    Err(TreeError::Vanished { .. }) => return Ok(Step::Descend),
                    Err(e) => return Err(e),
                };
                let mut out = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .custom_flags(libc::O_NOFOLLOW)
                    .mode(mode)
                    .open(&to)
                    .map_err(TreeError::io(&to))?;
                let budget = limits.max_bytes - copied.bytes;
                let n = io::copy(&mut io::Read::take(&mut from, budget + 1), &mut out)
                    .map_err(TreeError::io(&entry.shown()))?;
                if n > budget {
                    return Err(TreeError::TooLarge { root: shown.to_path_buf(), limit: limits.max_bytes });
                }
                copied.bytes += n;
            }
            EntryKind::Symlink => match entry.read_link() {
                Ok(target) => std::os::unix::fs::symlink(target, &to).map_err(TreeError::io(&to))?,
                Err(TreeError::Vanished { .. }) => {}
                Err(e) => return Err(e),
            },
            EntryKind::Other => {}
        }
        Ok(Step::Descend)
    })?;
    Ok(copied)
}

/// Opens `path` (a host-made directory, such as a session's `outputs/`) to walk it: the path
/// itself is the host's, so following it is fine; what is below it is the guest's.
pub fn open_root(path: &Path) -> Result<File, TreeError> {
    beneath::open_dir(path).map_err(TreeError::io(path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{symlink, PermissionsExt};

    const SMALL: TreeLimits = TreeLimits { max_entries: 100, max_bytes: 1 << 20, max_depth: 8 };

    /// `src/` as a guest could leave it, next to a host secret the guest must not get copied.
    fn guest_tree() -> (tempfile::TempDir, PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("secret"), "HOST SECRET").unwrap();
        std::fs::create_dir_all(tmp.path().join("host-dir/deeper")).unwrap();
        std::fs::write(tmp.path().join("host-dir/deeper/key"), "HOST KEY").unwrap();
        let src = tmp.path().join("src");
        std::fs::create_dir_all(src.join("sub")).unwrap();
        std::fs::write(src.join("report.md"), "hello").unwrap();
        std::fs::write(src.join("sub/data.csv"), "1,2").unwrap();
        symlink(tmp.path().join("secret"), src.join("abs-out")).unwrap();
        symlink("../secret", src.join("rel-out")).unwrap();
        symlink(tmp.path().join("host-dir"), src.join("dir-out")).unwrap();
        symlink("report.md", src.join("inside")).unwrap();
        (tmp, src)
    }

    /// Every regular file's content below `root`, without following links.
    fn contents(root: &Path) -> Vec<(PathBuf, String)> {
        let mut out = Vec::new();
        let mut dirs = vec![root.to_path_buf()];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                let t = e.file_type().unwrap();
                if t.is_dir() {
                    dirs.push(e.path());
                } else if t.is_file() {
                    let rel = e.path().strip_prefix(root).unwrap().to_path_buf();
                    out.push((rel, std::fs::read_to_string(e.path()).unwrap()));
                }
            }
        }
        out.sort();
        out
    }

    #[test]
    fn a_copy_follows_no_symlink_out_of_the_tree() {
        let (tmp, src) = guest_tree();
        let dst = tmp.path().join("dst");
        let totals = copy(&open_root(&src).unwrap(), &src, &dst, SMALL).unwrap();
        assert_eq!(totals, TreeTotals { entries: 7, bytes: 8 });
        assert_eq!(
            contents(&dst),
            [(PathBuf::from("report.md"), "hello".to_string()), (PathBuf::from("sub/data.csv"), "1,2".to_string())]
        );
        // The links are copied as links, their targets as the guest wrote them.
        for (link, target) in [
            ("abs-out", tmp.path().join("secret")),
            ("rel-out", "../secret".into()),
            ("dir-out", tmp.path().join("host-dir")),
            ("inside", "report.md".into()),
        ] {
            assert!(std::fs::symlink_metadata(dst.join(link)).unwrap().file_type().is_symlink(), "{link}");
            assert_eq!(std::fs::read_link(dst.join(link)).unwrap(), target, "{link}");
        }
    }

    #[test]
    fn a_symlinked_root_subdirectory_or_file_swapped_in_is_not_followed() {
        let (tmp, src) = guest_tree();
        let root = open_root(&src).unwrap();
        // The guest swaps `sub` for a link to a host directory after the listing: the walk's
        // descent refuses it instead of entering the host directory.
        let mut seen = Vec::new();
        let err = walk(&root, &src, SMALL, |e| {
            seen.push(e.rel.to_path_buf());
            if e.rel == Path::new("sub") {
                std::fs::rename(src.join("sub"), tmp.path().join("moved")).unwrap();
                symlink(tmp.path().join("host-dir"), src.join("sub")).unwrap();
            }
            Ok(Step::Descend)
        })
        .unwrap_err();
        assert!(matches!(&err, TreeError::Changed { path, was: "directory" } if path == &src.join("sub")), "{err}");
        // Nothing below `sub` (nor below the host directory it now names) was visited.
        assert_eq!(seen.last().map(PathBuf::as_path), Some(Path::new("sub")), "{seen:?}");
        assert_eq!(seen.len(), 6, "{seen:?}");

        // A file swapped for a symlink between listing and open: refused, not followed.
        std::fs::remove_file(src.join("sub")).unwrap();
        std::fs::rename(tmp.path().join("moved"), src.join("sub")).unwrap();
        let err = walk(&root, &src, SMALL, |e| {
            if e.rel == Path::new("report.md") {
                std::fs::remove_file(src.join("report.md")).unwrap();
                symlink(tmp.path().join("secret"), src.join("report.md")).unwrap();
                e.open_file()?;
            }
            Ok(Step::Descend)
        })
        .unwrap_err();
        assert!(matches!(&err, TreeError::Changed { was: "regular file", .. }), "{err}");

        // ...or for another file (same name, another inode): refused too.
        std::fs::remove_file(src.join("report.md")).unwrap();
        std::fs::write(src.join("report.md"), "hello").unwrap();
        let err = walk(&root, &src, SMALL, |e| {
            if e.rel == Path::new("report.md") {
                // Made before the old one goes, so it cannot reuse its inode number.
                std::fs::write(src.join("report.new"), "other").unwrap();
                std::fs::rename(src.join("report.new"), src.join("report.md")).unwrap();
                e.open_file()?;
            }
            Ok(Step::Descend)
        })
        .unwrap_err();
        assert!(matches!(&err, TreeError::Changed { was: "regular file", .. }), "{err}");
    }

    #[test]
    fn what_the_guest_deletes_during_a_copy_is_passed_over() {
        let (tmp, src) = guest_tree();
        let root = open_root(&src).unwrap();
        let mut seen = Vec::new();
        walk(&root, &src, SMALL, |e| {
            seen.push(e.rel.to_path_buf());
            if e.rel == Path::new("report.md") {
                std::fs::remove_file(src.join("report.md")).unwrap();
                assert!(matches!(e.open_file(), Err(TreeError::Vanished { .. })));
                std::fs::remove_dir_all(src.join("sub")).unwrap();
            }
            Ok(Step::Descend)
        })
        .unwrap();
        assert!(!seen.iter().any(|p| p.starts_with("sub")), "{seen:?}");
        std::fs::write(src.join("report.md"), "hello").unwrap();
        let dst = tmp.path().join("dst");
        copy(&open_root(&src).unwrap(), &src, &dst, SMALL).unwrap();
        assert!(dst.join("report.md").is_file());
    }

    #[test]
    fn a_fifo_is_skipped_never_opened() {
        let (tmp, src) = guest_tree();
        nix_mkfifo(&src.join("pipe"));
        let dst = tmp.path().join("dst");
        copy(&open_root(&src).unwrap(), &src, &dst, SMALL).unwrap();
        assert!(!dst.join("pipe").exists());
        // A FIFO swapped in for a file fails fast instead of blocking the copy.
        let err = walk(&open_root(&src).unwrap(), &src, SMALL, |e| {
            if e.rel == Path::new("report.md") {
                std::fs::remove_file(src.join("report.md")).unwrap();
                nix_mkfifo(&src.join("report.md"));
                e.open_file()?;
            }
            Ok(Step::Descend)
        })
        .unwrap_err();
        assert!(matches!(&err, TreeError::Changed { was: "regular file", .. }), "{err}");
    }

    fn nix_mkfifo(path: &Path) {
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `c` is NUL-terminated and outlives the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {}", path.display());
    }

    #[test]
    fn hard_links_are_copied_apart_and_each_counts_against_the_byte_bound() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        std::fs::create_dir(&src).unwrap();
        std::fs::write(src.join("big"), vec![b'x'; 1000]).unwrap();
        for i in 0..3 {
            std::fs::hard_link(src.join("big"), src.join(format!("link{i}"))).unwrap();
        }
        assert_eq!(std::fs::metadata(src.join("big")).unwrap().nlink(), 4);
        let limits = TreeLimits { max_bytes: 3999, ..SMALL };
        let err = copy(&open_root(&src).unwrap(), &src, &tmp.path().join("over"), limits).unwrap_err();
        assert!(matches!(err, TreeError::TooLarge { limit: 3999, .. }), "{err}");
        assert!(err.to_string().contains("more than 3999 bytes"), "{err}");

        let dst = tmp.path().join("dst");
        let limits = TreeLimits { max_bytes: 4000, ..SMALL };
        assert_eq!(copy(&open_root(&src).unwrap(), &src, &dst, limits).unwrap().bytes, 4000);
        // The copies are files of their own: writing one changes neither the others nor the source.
        std::fs::write(dst.join("link0"), "changed").unwrap();
        assert_eq!(std::fs::metadata(dst.join("big")).unwrap().nlink(), 1);
        assert_eq!(std::fs::read(dst.join("big")).unwrap().len(), 1000);
        assert_eq!(std::fs::read(src.join("link0")).unwrap().len(), 1000);
    }

    #[test]
    fn entries_and_depth_are_bounded_with_an_error_naming_the_bound() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        std::fs::create_dir(&src).unwrap();
        for i in 0..20 {
            std::fs::write(src.join(format!("f{i:02}")), "").unwrap();
        }
        let limits = TreeLimits { max_entries: 19, ..SMALL };
        let err = walk(&open_root(&src).unwrap(), &src, limits, |_| Ok(Step::Descend)).unwrap_err();
        assert!(matches!(err, TreeError::TooManyEntries { limit: 19, .. }), "{err}");
        assert!(err.to_string().contains("more than 19 entries"), "{err}");
        let limits = TreeLimits { max_entries: 20, ..SMALL };
        assert_eq!(walk(&open_root(&src).unwrap(), &src, limits, |_| Ok(Step::Descend)).unwrap().entries, 20);

        let deep = tmp.path().join("deep");
        std::fs::create_dir_all(deep.join("1/2/3/4")).unwrap();
        let limits = TreeLimits { max_depth: 3, ..SMALL };
        let err = walk(&open_root(&deep).unwrap(), &deep, limits, |_| Ok(Step::Descend)).unwrap_err();
        assert!(matches!(&err, TreeError::TooDeep { path, limit: 3 } if path == &deep.join("1/2/3/4")), "{err}");
        let limits = TreeLimits { max_depth: 4, ..SMALL };
        assert_eq!(walk(&open_root(&deep).unwrap(), &deep, limits, |_| Ok(Step::Descend)).unwrap().entries, 4);
    }

    #[test]
    fn set_id_bits_do_not_survive_a_copy() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        std::fs::create_dir(&src).unwrap();
        std::fs::write(src.join("suid"), "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(src.join("suid"), std::fs::Permissions::from_mode(0o4755)).unwrap();
        let dst = tmp.path().join("dst");
        copy(&open_root(&src).unwrap(), &src, &dst, SMALL).unwrap();
        assert_eq!(std::fs::metadata(dst.join("suid")).unwrap().mode() & 0o7777, 0o755);
    }
}
