//! Host side of shadow mode: bringing a guest's copy-on-write changes back to the real folder.
//!
//! A shadow share is the host folder as the read-only lower layer of an overlay in the guest:
//! the session works freely, and its changes stay in the guest until the user asks for them.
//! The guest agent reports them as [`ShadowChange`]s and serves their contents; the host then
//! [`apply`]s them to the folder or [`export_tar`]s them.
//!
//! The user keeps working on the host meanwhile, so applying must never overwrite their work:
//! a [`Baseline`] taken at session start records what every entry looked like, and a change
//! whose host path no longer matches it (edited, created, removed) is a [`Conflict`] that leaves
//! the host untouched. Everything else is applied one file at a time, atomically (a temporary
//! file beside the target, fsynced, renamed over it), so a crash leaves each file old or new,
//! never half-written.
//!
//! Change paths come from the guest and are hostile: they must be relative, `/`-separated,
//! without `.`, `..`, empty components or NUL. Applying walks from the root one directory
//! descriptor at a time and refuses *any* symlink on the way (even one staying inside — unlike
//! reads, writes have no reason to go through one), so nothing is written or removed outside
//! the root, even if the host folder holds symlinks or they are swapped in during the apply.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::fs::{File, Metadata, Permissions};
use std::io::{self, Read, Write};
use std::ops::Bound;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use super::beneath;

/// [`Baseline::record`] refuses folders with more entries than this.
pub const DEFAULT_MAX_ENTRIES: usize = 1_000_000;
/// Name, at the archive root, of [`export_tar`]'s list of deleted paths.
pub const DELETED_MANIFEST: &str = ".umbra-deleted";
/// Permissions of an added file (a modified one keeps the original's).
const NEW_FILE_MODE: u32 = 0o644;
/// Permissions of a created directory, before the umask.
const NEW_DIR_MODE: u32 = 0o755;

/// How an entry differs from the host folder, and one entry of a shadow folder's diff as the
/// guest agent reports it (a type change comes as `deleted` then `added`): the protocol's types.
pub use umbra_proto::{ChangeKind, ShadowChange};

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    /// FIFOs, sockets, devices.
    Other,
}

/// What a host entry looked like; two equal stats are taken to mean "unchanged".
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EntryStat {
    pub kind: FileKind,
    pub size: u64,
    pub mtime_ns: i128,
    pub ino: u64,
    pub dev: u64,
    /// Permission bits (`mode & 0o7777`).
    pub perm: u32,
}

impl EntryStat {
    /// From `lstat` metadata.
    pub fn of(meta: &Metadata) -> Self {
        let ft = meta.file_type();
        let kind = if ft.is_symlink() {
            FileKind::Symlink
        } else if ft.is_dir() {
            FileKind::Dir
        } else if ft.is_file() {
            FileKind::File
        } else {
            FileKind::Other
        };
        EntryStat {
            kind,
            size: meta.size(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            ino: meta.ino(),
            dev: meta.dev(),
            perm: meta.mode() & 0o7777,
        }
    }

    /// Whether `now` is this entry, unchanged. A directory's size and mtime move whenever a
    /// child comes or goes, and children are compared on their own, so directories compare by
    /// identity and permissions only.
    pub fn unchanged(&self, now: &EntryStat) -> bool {
        if self.kind == FileKind::Dir && now.kind == FileKind::Dir {
            (self.ino, self.dev, self.perm) == (now.ino, now.dev, now.perm)
        } else {
            self == now
        }
    }
}

/// The state of a host folder when its shadow session started (kept in a session snapshot, so
/// a resumed or forked session checks its apply against the same state).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Baseline {
    root: EntryStat,
    entries: BTreeMap<PathBuf, EntryStat>,
}

impl Baseline {
    /// Records every entry under `root` (a directory, not a symlink to one) without following
    /// symlinks, refusing folders of more than [`DEFAULT_MAX_ENTRIES`] entries.
    pub fn record(root: &Path) -> io::Result<Baseline> {
        Self::record_with_limit(root, DEFAULT_MAX_ENTRIES)
    }

    pub fn record_with_limit(root: &Path, max_entries: usize) -> io::Result<Baseline> {
        let root_meta = std::fs::symlink_metadata(root)?;
        if !root_meta.is_dir() {
            return Err(io::Error::new(io::ErrorKind::NotADirectory, format!("{} is not a directory", root.display())));
        }
        let mut entries = BTreeMap::new();
        let mut pending = vec![PathBuf::new()];
        while let Some(dir) = pending.pop() {
            for entry in std::fs::read_dir(root.join(&dir))? {
                let entry = entry?;
                if entries.len() >= max_entries {
                    let msg = format!("{} has more than {max_entries} entries; too many to shadow", root.display());
                    return Err(io::Error::other(msg));
                }
                // DirEntry::metadata is an lstat: symlinks are recorded, never followed.
                let stat = EntryStat::of(&entry.metadata()?);
                let rel = dir.join(entry.file_name());
                if stat.kind == FileKind::Dir {
                    pending.push(rel.clone());
                }
                entries.insert(rel, stat);
            }
        }
        Ok(Baseline { root: EntryStat::of(&root_meta), entries })
    }

    /// Number of entries below the root.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The recorded state of `rel` (relative, `/`-separated).
    pub fn get(&self, rel: &str) -> Option<&EntryStat> {
        self.entries.get(Path::new(rel))
    }

    /// The entries strictly below `dir` (contiguous in `Path` order).
    fn descendants<'a>(&'a self, dir: &'a Path) -> impl Iterator<Item = &'a PathBuf> + 'a {
        let after = (Bound::Excluded(dir), Bound::Unbounded);
        self.entries.range::<Path, _>(after).map(|(path, _)| path).take_while(move |path| path.starts_with(dir))
    }
}

/// Why a change was not applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConflictReason {
    /// The host entry was modified since the baseline.
    Changed,
    /// The host entry did not exist at the baseline and does now.
    Appeared,
    /// The host entry existed at the baseline and is gone.
    Disappeared,
    /// Something under a directory to delete changed since the baseline.
    TreeChanged,
    /// The folder itself was replaced since the baseline.
    RootReplaced,
}

impl fmt::Display for ConflictReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ConflictReason::Changed => "changed on the host since the session started",
            ConflictReason::Appeared => "created on the host since the session started",
            ConflictReason::Disappeared => "removed on the host since the session started",
            ConflictReason::TreeChanged => "its contents changed on the host since the session started",
            ConflictReason::RootReplaced => "the shared folder was replaced since the session started",
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conflict {
    pub path: String,
    pub reason: ConflictReason,
}

#[derive(Debug, thiserror::Error)]
pub enum ShadowError {
    #[error("invalid change path {path:?}: {reason}")]
    InvalidPath { path: String, reason: &'static str },
    #[error("refusing to write through symlink {0:?}")]
    ThroughSymlink(PathBuf),
    #[error("{0:?} is not a directory on the host")]
    NotADirectory(PathBuf),
    #[error("{0:?} changed between file and directory; expected it reported as deleted then added")]
    TypeChange(String),
    #[error("fetching {path:?} from the guest: {source}")]
    Fetch { path: String, source: io::Error },
    #[error("the guest sent a different length for {path:?} than the {expected} bytes it reported")]
    SizeMismatch { path: String, expected: u64 },
    #[error("{path:?}: {source}")]
    Io { path: String, source: io::Error },
}

#[derive(Debug)]
pub struct ApplyError {
    pub path: String,
    pub error: ShadowError,
}

/// What [`apply`] did with each change: every change lands in exactly one list. `errors` may
/// also name a directory whose closing fsync failed (its changes are made, maybe not durable).
#[derive(Debug, Default)]
pub struct ApplyReport {
    pub applied: Vec<String>,
    pub conflicts: Vec<Conflict>,
    pub errors: Vec<ApplyError>,
}

impl ApplyReport {
    /// True when every change was applied.
    pub fn is_clean(&self) -> bool {
        self.conflicts.is_empty() && self.errors.is_empty()
    }
}

enum Outcome {
    Applied,
    Conflict(ConflictReason),
}

/// Applies `changes` to the host folder `root` (the path the `baseline` was recorded from),
/// reading added and modified contents through `fetch(path)`. Deletions go first, deepest
/// first; then additions and modifications, parents first. Each file is fsynced before it
/// replaces the old one; the directories that changed are fsynced once each at the end. See
/// the module docs for the rules.
pub fn apply<F, R>(root: &Path, baseline: &Baseline, changes: &[ShadowChange], fetch: F) -> ApplyReport
where
    F: FnMut(&str) -> io::Result<R>,
    R: Read,
{
    let mut report = ApplyReport::default();
    let root_dir = match beneath::open_dir(root).and_then(|dir| Ok((dir.metadata()?, dir))) {
        Ok((meta, dir)) if baseline.root.unchanged(&EntryStat::of(&meta)) => dir,
        Ok(_) => {
            let conflict = |c: &ShadowChange| Conflict { path: c.path.clone(), reason: ConflictReason::RootReplaced };
            report.conflicts = changes.iter().map(conflict).collect();
            return report;
        }
        Err(e) => {
            for change in changes {
                let source = io::Error::new(e.kind(), e.to_string());
                let error = ShadowError::Io { path: root.display().to_string(), source };
                report.errors.push(ApplyError { path: change.path.clone(), error });
            }
            return report;
        }
    };
    let mut ordered: Vec<&ShadowChange> = changes.iter().collect();
    ordered.sort_by(|a, b| {
        let (a_del, b_del) = (a.kind == ChangeKind::Deleted, b.kind == ChangeKind::Deleted);
        let (a_path, b_path) = (Path::new(&a.path), Path::new(&b.path));
        b_del.cmp(&a_del).then_with(|| if a_del { b_path.cmp(a_path) } else { a_path.cmp(b_path) })
    });
    let mut applier = Applier {
        root: &root_dir,
        baseline,
        fetch,
        created: HashSet::new(),
        removed: HashSet::new(),
        dirty: BTreeSet::new(),
    };
    for change in ordered {
        let path = change.path.clone();
        match applier.apply_one(change) {
            Ok(Outcome::Applied) => report.applied.push(path),
            Ok(Outcome::Conflict(reason)) => report.conflicts.push(Conflict { path, reason }),
            Err(error) => report.errors.push(ApplyError { path, error }),
        }
    }
    for dir in std::mem::take(&mut applier.dirty) {
        if let Err(error) = applier.sync_dir(&dir) {
            report.errors.push(ApplyError { path: dir.display().to_string(), error });
        }
    }
    report
}

struct Applier<'a, F> {
    root: &'a File,
    baseline: &'a Baseline,
    fetch: F,
    /// Directories this apply created (an `added` directory may already be one of them).
    created: HashSet<PathBuf>,
    /// Entries this apply deleted (a deleted parent then need not find them).
    removed: HashSet<PathBuf>,
    /// Directories whose entries changed: fsynced once each at the end, not once per change.
    dirty: BTreeSet<PathBuf>,
}

impl<F, R> Applier<'_, F>
where
    F: FnMut(&str) -> io::Result<R>,
    R: Read,
{
    fn apply_one(&mut self, change: &ShadowChange) -> Result<Outcome, ShadowError> {
        let rel = parse_relative(&change.path)?;
        let io_err = |source| ShadowError::Io { path: change.path.clone(), source };
        let name = rel.file_name().expect("a validated path ends in a name");
        if change.kind == ChangeKind::Added && change.is_dir && self.created.contains(&rel) {
            return Ok(Outcome::Applied);
        }
        // Something this apply deleted is no longer the baseline's to defend (a type change).
        let replaced = rel.ancestors().any(|a| self.removed.contains(a));
        let base = self.baseline.entries.get(&rel).filter(|_| !replaced);
        let parent = self.parent_dir(&rel, false)?;
        let current = match &parent {
            Some(dir) => lstat_opt(dir, name).map_err(io_err)?,
            None => None,
        };
        let now = current.as_ref().map(EntryStat::of);
        if change.kind == ChangeKind::Deleted && now.is_none() {
            // Gone on both sides: the host is already as the guest wants it.
            self.removed.insert(rel);
            return Ok(Outcome::Applied);
        }
        let reason = match (base, &now) {
            (None, None) => None,
            (None, Some(_)) => Some(ConflictReason::Appeared),
            (Some(_), None) => Some(ConflictReason::Disappeared),
            (Some(base), Some(now)) => (!base.unchanged(now)).then_some(ConflictReason::Changed),
        };
        if let Some(reason) = reason {
            return Ok(Outcome::Conflict(reason));
        }
        match (change.kind, change.is_dir) {
            (ChangeKind::Deleted, _) => {
                let parent = parent.expect("an existing entry has a parent");
                self.delete(&parent, &rel, now.expect("checked above").kind, &change.path)
            }
            (_, true) => match now.map(|n| n.kind) {
                Some(FileKind::Dir) => Ok(Outcome::Applied),
                Some(_) => Err(ShadowError::TypeChange(change.path.clone())),
                None => {
                    let parent = self.make_parent(&rel)?;
                    beneath::mkdir_at(&parent, name, NEW_DIR_MODE).map_err(io_err)?;
                    self.mark_dirty(&rel);
                    self.created.insert(rel);
                    Ok(Outcome::Applied)
                }
            },
            (_, false) => {
                if now.is_some_and(|n| n.kind == FileKind::Dir) {
                    return Err(ShadowError::TypeChange(change.path.clone()));
                }
                let parent = self.make_parent(&rel)?;
                let outcome = self.write_file(&parent, name, current.as_ref(), change)?;
                if matches!(outcome, Outcome::Applied) {
                    self.mark_dirty(&rel);
                }
                Ok(outcome)
            }
        }
    }

    /// Replaces (or creates) `name` in `parent` with the guest's content, atomically. `current`
    /// is the entry the conflict check passed; if it changed meanwhile, nothing is replaced.
    fn write_file(
        &mut self,
        parent: &File,
        name: &OsStr,
        current: Option<&Metadata>,
        change: &ShadowChange,
    ) -> Result<Outcome, ShadowError> {
        let io_err = |source| ShadowError::Io { path: change.path.clone(), source };
        // A modified file keeps its permissions, less setuid/setgid: the content is not the
        // one that was trusted with them.
        let mode = current.filter(|m| m.is_file()).map_or(NEW_FILE_MODE, |m| m.mode() & 0o777);
        let (temp_name, mut temp) = create_temp(parent, mode).map_err(io_err)?;
        let written = (|| {
            temp.set_permissions(Permissions::from_mode(mode)).map_err(io_err)?; // not the umask's
            if let Some(meta) = current {
                // Keep the owner when we may (running as root); otherwise the file is ours.
                let _ = std::os::unix::fs::fchown(&temp, Some(meta.uid()), Some(meta.gid()));
            }
            let mut content = (self.fetch)(&change.path)
                .map_err(|source| ShadowError::Fetch { path: change.path.clone(), source })?;
            io::copy(&mut content, &mut temp).map_err(io_err)?;
            temp.sync_all().map_err(io_err)?;
            let still = lstat_opt(parent, name).map_err(io_err)?;
            if still.as_ref().map(EntryStat::of) != current.map(EntryStat::of) {
                return Ok(Outcome::Conflict(ConflictReason::Changed));
            }
            beneath::rename_at(parent, &temp_name, name).map_err(io_err)?;
            Ok(Outcome::Applied)
        })();
        if !matches!(written, Ok(Outcome::Applied)) {
            let _ = beneath::unlink_at(parent, &temp_name, false);
        }
        written
    }

    fn delete(&mut self, parent: &File, rel: &Path, kind: FileKind, path: &str) -> Result<Outcome, ShadowError> {
        let io_err = |source| ShadowError::Io { path: path.to_owned(), source };
        let name = rel.file_name().expect("a validated path ends in a name");
        if kind == FileKind::Dir {
            let dir = self.subdir(parent, name, rel)?;
            if !self.tree_unchanged(&dir, rel).map_err(io_err)? {
                return Ok(Outcome::Conflict(ConflictReason::TreeChanged));
            }
            remove_tree(&dir).map_err(io_err)?;
        }
        beneath::unlink_at(parent, name, kind == FileKind::Dir).map_err(io_err)?;
        self.mark_dirty(rel);
        self.removed.insert(rel.to_owned());
        Ok(Outcome::Applied)
    }

    /// Whether everything under `dir` (the host directory `rel`) is as the baseline recorded,
    /// apart from what this apply already deleted.
    fn tree_unchanged(&self, dir: &File, rel: &Path) -> io::Result<bool> {
        let mut seen = 0;
        if !self.tree_matches(dir, rel, &mut seen)? {
            return Ok(false);
        }
        let was_removed = |p: &Path| p.ancestors().any(|a| self.removed.contains(a));
        let expected = self.baseline.descendants(rel).filter(|p| !was_removed(p)).count();
        Ok(seen == expected)
    }

    fn tree_matches(&self, dir: &File, rel: &Path, seen: &mut usize) -> io::Result<bool> {
        for name in beneath::read_dir(dir)? {
            let child = rel.join(&name);
            let Some(meta) = lstat_opt(dir, &name)? else { return Ok(false) };
            let now = EntryStat::of(&meta);
            if !self.baseline.entries.get(&child).is_some_and(|base| base.unchanged(&now)) {
                return Ok(false);
            }
            *seen += 1;
            if now.kind == FileKind::Dir && !self.tree_matches(&beneath::open_subdir(dir, &name)?, &child, seen)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Notes that the directory holding `rel` changed (and, if this apply created it, the
    /// directories holding those).
    fn mark_dirty(&mut self, rel: &Path) {
        for dir in rel.ancestors().skip(1) {
            self.dirty.insert(dir.to_owned());
            if !self.created.contains(dir) {
                break;
            }
        }
    }

    /// Makes a changed directory's entries durable; it is re-walked, as it may be gone.
    fn sync_dir(&mut self, dir: &Path) -> Result<(), ShadowError> {
        match self.open_dir(dir, false)? {
            Some(file) => file.sync_all().map_err(|source| ShadowError::Io { path: dir.display().to_string(), source }),
            None => Ok(()),
        }
    }

    /// Opens the directory holding `rel` (see [`Self::open_dir`]).
    fn parent_dir(&mut self, rel: &Path, create: bool) -> Result<Option<File>, ShadowError> {
        self.open_dir(rel.parent().unwrap_or(Path::new("")), create)
    }

    /// Opens the directory `rel` (empty for the root), walking down from the root and refusing
    /// symlinks. Missing directories are created with `create`, else give `None`.
    fn open_dir(&mut self, rel: &Path, create: bool) -> Result<Option<File>, ShadowError> {
        let io_err = |source| ShadowError::Io { path: rel.display().to_string(), source };
        let mut dir =
            beneath::openat(self.root, OsStr::new("."), libc::O_RDONLY | libc::O_DIRECTORY, 0).map_err(io_err)?;
        let mut walked = PathBuf::new();
        for component in rel {
            walked.push(component);
            if create && lstat_opt(&dir, component).map_err(io_err)?.is_none() {
                match beneath::mkdir_at(&dir, component, NEW_DIR_MODE) {
                    Ok(()) => {
                        self.created.insert(walked.clone());
                    }
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                    Err(e) => return Err(io_err(e)),
                }
            }
            dir = match self.subdir(&dir, component, &walked) {
                Ok(next) => next,
                Err(ShadowError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(e),
            };
        }
        Ok(Some(dir))
    }

    fn make_parent(&mut self, rel: &Path) -> Result<File, ShadowError> {
        let missing = || ShadowError::Io { path: rel.display().to_string(), source: io::ErrorKind::NotFound.into() };
        self.parent_dir(rel, true)?.ok_or_else(missing)
    }

    /// Opens the real directory `name` in `dir` (which is `rel` beneath the root).
    fn subdir(&self, dir: &File, name: &OsStr, rel: &Path) -> Result<File, ShadowError> {
        beneath::open_subdir(dir, name).map_err(|source| match source.raw_os_error() {
            Some(libc::ELOOP) => ShadowError::ThroughSymlink(rel.to_owned()),
            Some(libc::ENOTDIR) => ShadowError::NotADirectory(rel.to_owned()),
            _ => ShadowError::Io { path: rel.display().to_string(), source },
        })
    }
}

/// Checks a guest-reported change path and makes it a relative `PathBuf` of normal components.
fn parse_relative(path: &str) -> Result<PathBuf, ShadowError> {
    let invalid = |reason| Err(ShadowError::InvalidPath { path: path.to_owned(), reason });
    if path.is_empty() {
        return invalid("empty");
    }
    if path.starts_with('/') {
        return invalid("absolute");
    }
    if path.contains('\0') {
        return invalid("contains a NUL byte");
    }
    for component in path.split('/') {
        match component {
            "" => return invalid("empty component"),
            "." | ".." => return invalid("`.` or `..` component"),
            _ => {}
        }
    }
    Ok(PathBuf::from(path))
}

/// `lstat` of `name` in `dir`, `None` if absent.
fn lstat_opt(dir: &File, name: &OsStr) -> io::Result<Option<Metadata>> {
    match beneath::lstat_at(dir, name) {
        Ok(meta) => Ok(Some(meta)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// A new, exclusively created temporary file in `dir`, hidden and unique to this process.
fn create_temp(dir: &File, mode: u32) -> io::Result<(OsString, File)> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    loop {
        let name = format!(".umbra-tmp.{}.{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed));
        let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW;
        match beneath::openat(dir, OsStr::new(&name), flags, mode) {
            Ok(file) => return Ok((name.into(), file)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Removes everything inside `dir`, never following a symlink.
fn remove_tree(dir: &File) -> io::Result<()> {
    for name in beneath::read_dir(dir)? {
        let is_dir = beneath::lstat_at(dir, &name)?.is_dir();
        if is_dir {
            remove_tree(&beneath::open_subdir(dir, &name)?)?;
        }
        beneath::unlink_at(dir, &name, is_dir)?;
    }
    Ok(())
}

/// Writes the added and modified files (and added directories) of `changes` as a tar to `out`,
/// contents read through `fetch`, plus a [`DELETED_MANIFEST`] at the archive root listing the
/// deleted paths one per line (directories with a trailing `/`). Entries are in path order,
/// files 0644 and directories 0755, timestamped now. A file whose `size` is known is streamed;
/// one without is buffered to learn its length. Returns `out`.
pub fn export_tar<F, R, W>(changes: &[ShadowChange], mut fetch: F, out: W) -> Result<W, ShadowError>
where
    F: FnMut(&str) -> io::Result<R>,
    R: Read,
    W: Write,
{
    let mut builder = tar::Builder::new(out);
    let mtime = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let header = |kind, mode, size| {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(kind);
        header.set_mode(mode);
        header.set_mtime(mtime);
        header.set_size(size);
        header
    };
    let mut sorted: Vec<&ShadowChange> = changes.iter().collect();
    sorted.sort_by(|a, b| Path::new(&a.path).cmp(Path::new(&b.path)));
    let mut deleted = String::new();
    for change in sorted {
        let path = &change.path;
        parse_relative(path)?;
        if path == DELETED_MANIFEST || path.contains('\n') {
            return Err(ShadowError::InvalidPath { path: path.clone(), reason: "clashes with the deletion manifest" });
        }
        let io_err = |source| ShadowError::Io { path: path.clone(), source };
        match (change.kind, change.is_dir) {
            (ChangeKind::Deleted, is_dir) => {
                deleted.push_str(path);
                deleted.push_str(if is_dir { "/\n" } else { "\n" });
            }
            (ChangeKind::Added, true) => {
                let mut dir = header(tar::EntryType::Directory, NEW_DIR_MODE, 0);
                builder.append_data(&mut dir, path, io::empty()).map_err(io_err)?;
            }
            // A modified directory's own metadata is not carried.
            (ChangeKind::Modified, true) => {}
            (_, false) => {
                let mut content = fetch(path).map_err(|source| ShadowError::Fetch { path: path.clone(), source })?;
                match change.size {
                    Some(size) => {
                        let mut file = header(tar::EntryType::Regular, NEW_FILE_MODE, size);
                        let mut counted = Counted { inner: content.take(size), count: 0 };
                        builder.append_data(&mut file, path, &mut counted).map_err(io_err)?;
                        let longer = counted.inner.into_inner().read(&mut [0u8]).map_err(io_err)? > 0;
                        if counted.count != size || longer {
                            return Err(ShadowError::SizeMismatch { path: path.clone(), expected: size });
                        }
                    }
                    None => {
                        let mut data = Vec::new();
                        content.read_to_end(&mut data).map_err(io_err)?;
                        let mut file = header(tar::EntryType::Regular, NEW_FILE_MODE, data.len() as u64);
                        builder.append_data(&mut file, path, data.as_slice()).map_err(io_err)?;
                    }
                }
            }
        }
    }
    let manifest_err = |source| ShadowError::Io { path: DELETED_MANIFEST.to_owned(), source };
    let mut manifest = header(tar::EntryType::Regular, NEW_FILE_MODE, deleted.len() as u64);
    builder.append_data(&mut manifest, DELETED_MANIFEST, deleted.as_bytes()).map_err(manifest_err)?;
    builder.into_inner().map_err(manifest_err)
}

/// Counts the bytes read through it (the tar header promised a size; we check it was kept).
struct Counted<R> {
    inner: R,
    count: u64,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count += n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::io::Cursor;
    use std::os::unix::fs::symlink;
    use std::time::Instant;

    type Snapshot = BTreeMap<String, Option<Vec<u8>>>;

    /// The folder as path → contents (`None` for a directory, `-> target` for a symlink).
    fn snapshot(root: &Path) -> Snapshot {
        let mut out = BTreeMap::new();
        let mut pending = vec![PathBuf::new()];
        while let Some(dir) = pending.pop() {
            for entry in std::fs::read_dir(root.join(&dir)).unwrap() {
                let entry = entry.unwrap();
                let rel = dir.join(entry.file_name());
                let key = rel.to_str().unwrap().to_owned();
                let ft = entry.file_type().unwrap();
                if ft.is_symlink() {
                    let target = std::fs::read_link(entry.path()).unwrap();
                    out.insert(key, Some(format!("-> {}", target.display()).into_bytes()));
                } else if ft.is_dir() {
                    out.insert(key, None);
                    pending.push(rel);
                } else {
                    out.insert(key, Some(std::fs::read(entry.path()).unwrap()));
                }
            }
        }
        out
    }

    fn entry(path: &str, content: Option<&str>) -> (String, Option<Vec<u8>>) {
        (path.to_owned(), content.map(|c| c.as_bytes().to_vec()))
    }

    fn change(path: &str, kind: ChangeKind, is_dir: bool) -> ShadowChange {
        ShadowChange { path: path.to_owned(), kind, size: None, is_dir }
    }

    use ChangeKind::{Added, Deleted, Modified};

    /// The guest side: serves the contents of the files it changed.
    fn guest(files: &[(&str, &str)]) -> impl FnMut(&str) -> io::Result<Cursor<Vec<u8>>> {
        let files: HashMap<String, Vec<u8>> =
            files.iter().map(|(p, c)| (p.to_string(), c.as_bytes().to_vec())).collect();
        move |path| {
            files.get(path).cloned().map(Cursor::new).ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, path))
        }
    }

    fn write(root: &Path, rel: &str, content: &str) {
        let path = root.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, content).unwrap();
    }

    fn mode(path: &Path) -> u32 {
        std::fs::symlink_metadata(path).unwrap().mode() & 0o7777
    }

    /// A project folder: `keep.txt`, `src/lib.rs`, an executable `run.sh`, `del.txt`,
    /// `old/{a.txt,nested/b.txt}` and an empty `empty_old/`.
    fn project() -> (tempfile::TempDir, PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("project");
        for (rel, content) in [
            ("keep.txt", "keep"),
            ("src/lib.rs", "old lib"),
            ("run.sh", "#!/bin/sh\n"),
            ("del.txt", "bye"),
            ("old/a.txt", "a"),
            ("old/nested/b.txt", "b"),
        ] {
            write(&root, rel, content);
        }
        std::fs::set_permissions(root.join("run.sh"), Permissions::from_mode(0o755)).unwrap();
        std::fs::create_dir(root.join("empty_old")).unwrap();
        (tmp, root)
    }

    #[test]
    fn apply_makes_the_folder_match_the_guest() {
        let (_tmp, root) = project();
        let baseline = Baseline::record(&root).unwrap();
        assert_eq!(baseline.len(), 10);
        let changes = [
            change("new/deep/file.txt", Added, false),
            change("new", Added, true),
            change("new/deep", Added, true),
            change("empty_new", Added, true),
            change("src/lib.rs", Modified, false),
            change("run.sh", Modified, false),
            change("src", Modified, true),
            change("del.txt", Deleted, false),
            change("old", Deleted, true),
            change("old/nested/b.txt", Deleted, false),
            change("empty_old", Deleted, true),
        ];
        let contents = [("new/deep/file.txt", "fresh"), ("src/lib.rs", "new lib"), ("run.sh", "#!/bin/sh\necho hi\n")];
        let report = apply(&root, &baseline, &changes, guest(&contents));
        assert!(report.is_clean(), "{report:?}");
        assert_eq!(report.applied.len(), changes.len());
        let expected: Snapshot = [
            entry("keep.txt", Some("keep")),
            entry("src", None),
            entry("src/lib.rs", Some("new lib")),
            entry("run.sh", Some("#!/bin/sh\necho hi\n")),
            entry("new", None),
            entry("new/deep", None),
            entry("new/deep/file.txt", Some("fresh")),
            entry("empty_new", None),
        ]
        .into_iter()
        .collect();
        assert_eq!(snapshot(&root), expected, "no temporary files left, nothing else touched");
        assert_eq!(mode(&root.join("run.sh")), 0o755, "a modified file keeps its permissions");
        assert_eq!(mode(&root.join("new/deep/file.txt")), 0o644);
    }

    #[test]
    fn host_changes_since_the_baseline_are_conflicts() {
        let (_tmp, root) = project();
        let baseline = Baseline::record(&root).unwrap();
        // The user keeps working on the host.
        write(&root, "src/lib.rs", "user's edit");
        write(&root, "new.txt", "user's new file");
        write(&root, "old/nested/user.txt", "user's note");
        std::fs::remove_file(root.join("keep.txt")).unwrap();
        std::fs::set_permissions(root.join("del.txt"), Permissions::from_mode(0o600)).unwrap();
        let before = snapshot(&root);
        let changes = [
            change("src/lib.rs", Modified, false),
            change("new.txt", Added, false),
            change("old", Deleted, true),
            change("keep.txt", Modified, false),
            change("del.txt", Deleted, false),
            change("run.sh", Modified, false),
        ];
        let contents =
            [("src/lib.rs", "guest"), ("new.txt", "guest"), ("keep.txt", "guest"), ("run.sh", "#!/bin/sh\nguest\n")];
        let report = apply(&root, &baseline, &changes, guest(&contents));
        assert!(report.errors.is_empty(), "{report:?}");
        assert_eq!(report.applied, ["run.sh"]);
        let mut conflicts: Vec<_> = report.conflicts.iter().map(|c| (c.path.as_str(), c.reason)).collect();
        conflicts.sort_by_key(|(path, _)| *path);
        assert_eq!(
            conflicts,
            [
                ("del.txt", ConflictReason::Changed),
                ("keep.txt", ConflictReason::Disappeared),
                ("new.txt", ConflictReason::Appeared),
                ("old", ConflictReason::TreeChanged),
                ("src/lib.rs", ConflictReason::Changed),
            ]
        );
        let mut expected = before;
        expected.insert("run.sh".into(), Some(b"#!/bin/sh\nguest\n".to_vec()));
        assert_eq!(snapshot(&root), expected, "conflicting host files are untouched");
    }

    #[test]
    fn deleting_what_the_host_already_deleted_is_applied() {
        let (_tmp, root) = project();
        let baseline = Baseline::record(&root).unwrap();
        std::fs::remove_file(root.join("del.txt")).unwrap();
        let report = apply(&root, &baseline, &[change("del.txt", Deleted, false)], guest(&[]));
        assert_eq!(report.applied, ["del.txt"]);
    }

    #[test]
    fn symlinks_in_the_folder_are_never_written_through() {
        let (tmp, root) = project();
        let outside = tmp.path().join("outside");
        write(&outside, "victim.txt", "precious");
        symlink("../outside", root.join("rel")).unwrap();
        symlink(&outside, root.join("abs")).unwrap();
        symlink(outside.join("victim.txt"), root.join("file_link")).unwrap();
        let baseline = Baseline::record(&root).unwrap();
        let changes = [
            change("rel/pwned.txt", Added, false),
            change("abs/pwned.txt", Added, false),
            change("rel/sub/pwned.txt", Added, false),
            change("abs/sub", Added, true),
            change("rel/victim.txt", Modified, false),
            change("abs/victim.txt", Deleted, false),
        ];
        let all: Vec<(&str, &str)> = changes.iter().map(|c| (c.path.as_str(), "pwned")).collect();
        let report = apply(&root, &baseline, &changes, guest(&all));
        assert!(report.applied.is_empty() && report.conflicts.is_empty(), "{report:?}");
        assert_eq!(report.errors.len(), changes.len());
        for error in &report.errors {
            assert!(matches!(error.error, ShadowError::ThroughSymlink(_)), "{error:?}");
        }
        assert_eq!(snapshot(&outside), [entry("victim.txt", Some("precious"))].into_iter().collect());
        // Replacing a symlink itself is fine: rename swaps the link, not its target.
        let report = apply(&root, &baseline, &[change("file_link", Modified, false)], guest(&[("file_link", "mine")]));
        assert!(report.is_clean(), "{report:?}");
        assert_eq!(std::fs::read(root.join("file_link")).unwrap(), b"mine");
        assert_eq!(std::fs::read(outside.join("victim.txt")).unwrap(), b"precious");
    }

    #[test]
    fn hostile_paths_are_errors() {
        let (_tmp, root) = project();
        let baseline = Baseline::record(&root).unwrap();
        let before = snapshot(&root);
        let paths = ["../x", "/etc/passwd", "src/../../x", "a//b", "./a", "a/.", "a\0b", "", "src/"];
        let changes: Vec<_> = paths.iter().map(|p| change(p, Added, false)).collect();
        let report = apply(&root, &baseline, &changes, guest(&[]));
        assert_eq!(report.errors.len(), paths.len(), "{report:?}");
        assert!(report.errors.iter().all(|e| matches!(e.error, ShadowError::InvalidPath { .. })));
        assert_eq!(snapshot(&root), before);
    }

    #[test]
    fn a_replaced_root_conflicts_everything() {
        let (tmp, root) = project();
        let baseline = Baseline::record(&root).unwrap();
        std::fs::rename(&root, tmp.path().join("moved")).unwrap();
        write(&root, "keep.txt", "another folder");
        let report = apply(&root, &baseline, &[change("keep.txt", Modified, false)], guest(&[("keep.txt", "x")]));
        assert_eq!(report.conflicts, [Conflict { path: "keep.txt".into(), reason: ConflictReason::RootReplaced }]);
        assert_eq!(std::fs::read(root.join("keep.txt")).unwrap(), b"another folder");
    }

    #[test]
    fn a_failed_fetch_leaves_the_file_and_no_temporary() {
        let (_tmp, root) = project();
        let baseline = Baseline::record(&root).unwrap();
        let before = snapshot(&root);
        let report = apply(&root, &baseline, &[change("src/lib.rs", Modified, false)], guest(&[]));
        assert!(matches!(report.errors[0].error, ShadowError::Fetch { .. }), "{report:?}");
        assert_eq!(snapshot(&root), before);
    }

    #[test]
    fn type_changes_apply_as_delete_then_add() {
        let (_tmp, root) = project();
        let baseline = Baseline::record(&root).unwrap();
        let changes = [
            change("keep.txt", Added, true),
            change("keep.txt", Deleted, false),
            change("keep.txt/inner", Added, false),
        ];
        let report = apply(&root, &baseline, &changes, guest(&[("keep.txt/inner", "now a dir")]));
        assert!(report.is_clean(), "{report:?}");
        assert_eq!(std::fs::read(root.join("keep.txt/inner")).unwrap(), b"now a dir");
        // Reported as a modification instead, it is refused.
        let report = apply(&root, &baseline, &[change("src", Modified, false)], guest(&[("src", "x")]));
        assert!(matches!(report.errors[0].error, ShadowError::TypeChange(_)), "{report:?}");
    }

    #[test]
    fn export_tar_round_trips() {
        let changes = [
            ShadowChange { size: Some(5), ..change("a.txt", Added, false) },
            change("dir/b.txt", Modified, false),
            change("newdir", Added, true),
            change("somedir", Modified, true),
            change("gone.txt", Deleted, false),
            change("gonedir", Deleted, true),
        ];
        let tar = export_tar(&changes, guest(&[("a.txt", "hello"), ("dir/b.txt", "bee")]), Vec::new()).unwrap();
        let mut listed = Vec::new();
        for entry in tar::Archive::new(tar.as_slice()).entries().unwrap() {
            let mut entry = entry.unwrap();
            let path = entry.path().unwrap().to_str().unwrap().trim_end_matches('/').to_owned();
            let kind = entry.header().entry_type();
            let mut content = String::new();
            entry.read_to_string(&mut content).unwrap();
            listed.push((path, kind, content));
        }
        let expected = [
            ("a.txt", tar::EntryType::Regular, "hello"),
            ("dir/b.txt", tar::EntryType::Regular, "bee"),
            ("newdir", tar::EntryType::Directory, ""),
            (DELETED_MANIFEST, tar::EntryType::Regular, "gone.txt\ngonedir/\n"),
        ]
        .map(|(p, k, c)| (p.to_owned(), k, c.to_owned()));
        assert_eq!(listed, expected);
    }

    #[test]
    fn export_tar_checks_reported_sizes_and_paths() {
        for size in [2, 10] {
            let changes = [ShadowChange { size: Some(size), ..change("a.txt", Added, false) }];
            let result = export_tar(&changes, guest(&[("a.txt", "hello")]), Vec::new());
            assert!(matches!(result, Err(ShadowError::SizeMismatch { expected, .. }) if expected == size));
        }
        for path in ["../x", DELETED_MANIFEST, "a\nb"] {
            let result = export_tar(&[change(path, Added, false)], guest(&[(path, "x")]), Vec::new());
            assert!(matches!(result, Err(ShadowError::InvalidPath { .. })), "{path:?}");
        }
    }

    #[test]
    fn changes_serialise_with_lowercase_kinds() {
        let json = r#"[{"path":"a/b","kind":"modified","size":3},{"path":"d","kind":"deleted","is_dir":true}]"#;
        let changes: Vec<ShadowChange> = serde_json::from_str(json).unwrap();
        assert_eq!(changes[0], ShadowChange { size: Some(3), ..change("a/b", Modified, false) });
        assert_eq!(changes[1], change("d", Deleted, true));
        assert_eq!(
            serde_json::to_string(&change("x", Added, false)).unwrap(),
            r#"{"path":"x","kind":"added","is_dir":false}"#
        );
    }

    #[test]
    fn baseline_refuses_too_many_entries_and_non_directories() {
        let (_tmp, root) = project();
        assert!(Baseline::record_with_limit(&root, 10).is_ok());
        let err = Baseline::record_with_limit(&root, 9).unwrap_err();
        assert!(err.to_string().contains("more than 9 entries"), "{err}");
        assert!(Baseline::record(&root.join("keep.txt")).is_err());
    }

    /// Run with `--nocapture` to see the timings.
    #[test]
    fn baseline_and_apply_are_cheap_for_a_10k_file_project() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("big");
        for d in 0..100 {
            let dir = root.join(format!("dir{d:03}"));
            std::fs::create_dir_all(&dir).unwrap();
            for f in 0..100 {
                std::fs::write(dir.join(format!("file{f:03}.rs")), format!("// {d} {f}\n")).unwrap();
            }
        }
        let start = Instant::now();
        let baseline = Baseline::record(&root).unwrap();
        let recorded = start.elapsed();
        assert_eq!(baseline.len(), 10_100);
        let changes: Vec<_> =
            (0..200).map(|i| change(&format!("dir{:03}/file{:03}.rs", i / 2, i % 2), Modified, false)).collect();
        let start = Instant::now();
        let report = apply(&root, &baseline, &changes, |_: &str| Ok(Cursor::new(b"// changed\n".to_vec())));
        let applied = start.elapsed();
        assert!(report.is_clean(), "{:?}", &report.errors[..1]);
        println!("baseline of 10,100 entries: {recorded:?}; apply of 200 modified files in 100 dirs (fsync each): {applied:?}");
        assert!(recorded.as_secs() < 10, "baseline took {recorded:?}");
    }
}
