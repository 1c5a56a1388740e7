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
//! What is applied is what was reviewed: [`ChangeSet::capture`]-ing a diff copies every
//! changed file's bytes to host storage the runtime owns (a private spool directory, its files
//! opened beneath it with no symlink followed), bounded in bytes ([`MAX_CAPTURE_BYTES`]) and
//! entries ([`MAX_CAPTURE_ENTRIES`]), and records each one's SHA-256. [`ChangeSet::apply`] then
//! writes those bytes (checked against their hash as they are copied) and nothing else: a guest
//! that changes a file after the diff, or adds one, changes nothing the apply writes. Entries
//! carry [`ShadowRisk`]s for the reviewer; `.git` and ignored paths are applied only when named,
//! `.git` never under `block_git_writes`, symlinks and special files never (see [`Rules`]).
//!
//! Change paths come from the guest and are hostile: they must be relative, `/`-separated,
//! without `.`, `..`, empty components or NUL. Applying walks from the root one directory
//! descriptor at a time and refuses *any* symlink on the way (even one staying inside — unlike
//! reads, writes have no reason to go through one), so nothing is written or removed outside
//! the root, even if the host folder holds symlinks or they are swapped in during the apply.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::fs::{File, Metadata, Permissions};
use std::io::{self, Read, Write};
use std::ops::Bound;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};
use umbra_api::event::{ShadowApplies, ShadowEntry, ShadowRisk};
use umbra_policy::IgnoreSet;
use umbra_proto::FileStat;

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

impl From<umbra_proto::FileKind> for FileKind {
    /// The same kinds as the protocol's; this one is kept in baselines under its own names.
    fn from(kind: umbra_proto::FileKind) -> Self {
        match kind {
            umbra_proto::FileKind::File => FileKind::File,
            umbra_proto::FileKind::Dir => FileKind::Dir,
            umbra_proto::FileKind::Symlink => FileKind::Symlink,
            umbra_proto::FileKind::Other => FileKind::Other,
        }
    }
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
        EntryStat {
            kind: FileKind::from(umbra_proto::FileKind::from(meta.file_type())),
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
    #[error("the changes are too large to capture: more than {limit}; apply fewer at a time or export them")]
    CaptureTooLarge { limit: String },
    #[error("{0:?} changed in the guest while it was captured; take the diff again")]
    ChangedWhileCaptured(String),
    #[error("{0:?} is not in the change-set; name only paths its diff listed")]
    NotInChangeSet(String),
    #[error("{path:?} cannot be applied: {reason}")]
    NeverApplied { path: String, reason: String },
    #[error("the captured bytes of {0:?} no longer match their SHA-256; nothing of it was written")]
    HashMismatch(String),
}

#[derive(Debug)]
pub struct ApplyError {
    pub path: String,
    pub error: ShadowError,
}

/// What [`apply`] did with each change: every change lands in exactly one list. `errors` may
/// also name a directory whose closing fsync failed (its changes are made, maybe not durable).
/// `skipped` lists the entries of a [`ChangeSet`] left out by its [`Rules`].
#[derive(Debug, Default)]
pub struct ApplyReport {
    pub applied: Vec<String>,
    pub conflicts: Vec<Conflict>,
    pub errors: Vec<ApplyError>,
    pub skipped: Vec<Skipped>,
}

/// A change-set entry an apply left out, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skipped {
    pub path: String,
    pub reason: String,
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

/// Most bytes one [`ChangeSet`] captures (files' contents, summed).
pub const MAX_CAPTURE_BYTES: u64 = 1 << 30;
/// Most entries one [`ChangeSet`] holds (the guest agent lists at most 100,000 anyway).
pub const MAX_CAPTURE_ENTRIES: usize = 100_000;

/// Bounds of one capture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CaptureLimits {
    pub bytes: u64,
    pub entries: usize,
}

impl Default for CaptureLimits {
    fn default() -> Self {
        Self { bytes: MAX_CAPTURE_BYTES, entries: MAX_CAPTURE_ENTRIES }
    }
}

/// What the sandbox policy guards in a shadow folder's changes.
#[derive(Debug, Default)]
pub struct Rules {
    /// `block_git_writes`: nothing under a `.git` is ever applied.
    pub block_git: bool,
    /// The policy's `ignore` patterns, for folders served with them.
    pub ignore: Option<IgnoreSet>,
}

/// Whether a path component is a `.git` (file or directory, at any depth: a nested
/// repository's or a submodule's is as dangerous as the top one).
fn in_git(path: &str) -> bool {
    path.split('/').any(|c| c == ".git")
}

/// The risks of a change, judged from its path, what the guest has there (`guest`, an lstat)
/// and what the host had at the session's start.
pub fn risks_of(
    change: &ShadowChange,
    guest: Option<&FileStat>,
    baseline: &Baseline,
    ignore: Option<&IgnoreSet>,
) -> BTreeSet<ShadowRisk> {
    let mut risks = BTreeSet::new();
    let components: Vec<&str> = change.path.split('/').collect();
    if components.contains(&".git") {
        risks.insert(ShadowRisk::Git);
    }
    if components.windows(2).any(|w| w == [".git", "hooks"]) {
        risks.insert(ShadowRisk::GitHook);
    }
    if components.iter().any(|c| c.starts_with('.')) {
        risks.insert(ShadowRisk::Dotfile);
    }
    match guest.map(|g| g.kind) {
        Some(umbra_proto::FileKind::Symlink) => {
            risks.insert(ShadowRisk::Symlink);
        }
        Some(umbra_proto::FileKind::Other) => {
            risks.insert(ShadowRisk::Special);
        }
        _ => {}
    }
    let base = baseline.get(&change.path);
    let host_exec = base.is_some_and(|b| b.kind == FileKind::File && b.perm & 0o111 != 0);
    let guest_exec = guest.is_some_and(|g| g.kind == umbra_proto::FileKind::File && g.mode & 0o111 != 0);
    let writes_file = change.kind != ChangeKind::Deleted && !change.is_dir;
    // New or newly executable in the guest, or new contents for a host file that is executable
    // (an apply keeps its permissions).
    if writes_file && (guest_exec || host_exec) {
        risks.insert(ShadowRisk::Executable);
    }
    if let Some(ignore) = ignore {
        if ignore.is_ignored(Path::new(&change.path), change.is_dir) {
            risks.insert(ShadowRisk::Ignored);
        }
    }
    // Deleting a directory deletes what the host has below it, seen by the guest or not.
    if change.kind == ChangeKind::Deleted && change.is_dir {
        for below in baseline.descendants(Path::new(&change.path)) {
            let rel = below.to_string_lossy();
            if in_git(&rel) {
                risks.insert(ShadowRisk::Git);
            }
            let is_dir = baseline.entries.get(below).is_some_and(|e| e.kind == FileKind::Dir);
            if ignore.is_some_and(|i| i.is_ignored(below, is_dir)) {
                risks.insert(ShadowRisk::Ignored);
            }
        }
    }
    risks
}

/// When an entry with `risks` is applied under `rules`, and why not by default.
fn applies_of(risks: &BTreeSet<ShadowRisk>, rules: &Rules) -> (ShadowApplies, Option<&'static str>) {
    if risks.contains(&ShadowRisk::Symlink) {
        (ShadowApplies::Never, Some("a symlink in the guest; symlinks are never applied"))
    } else if risks.contains(&ShadowRisk::Special) {
        (ShadowApplies::Never, Some("not a regular file in the guest"))
    } else if risks.contains(&ShadowRisk::Git) && rules.block_git {
        (ShadowApplies::Never, Some("in .git, and the policy blocks git writes (block_git_writes)"))
    } else if risks.contains(&ShadowRisk::Git) {
        (ShadowApplies::WhenNamed, Some("in .git; applied only when named"))
    } else if risks.contains(&ShadowRisk::Ignored) {
        (ShadowApplies::WhenNamed, Some("matches the policy's ignore patterns; applied only when named"))
    } else {
        (ShadowApplies::ByDefault, None)
    }
}

/// One entry of a [`ChangeSet`].
#[derive(Debug)]
pub struct Captured {
    pub change: ShadowChange,
    /// What the guest had (an lstat), for an added or modified non-directory.
    pub guest: Option<FileStat>,
    /// Bytes captured and their SHA-256, for a regular file.
    pub size: Option<u64>,
    pub sha256: Option<[u8; 32]>,
    pub risks: BTreeSet<ShadowRisk>,
    pub applies: ShadowApplies,
    /// Why it does not apply by default.
    why_not: Option<&'static str>,
    /// Its file in the spool directory.
    spooled: Option<OsString>,
}

impl Captured {
    /// As `shadow.diff` reports it.
    pub fn entry(&self) -> ShadowEntry {
        let file_kind = match (&self.guest, self.change.kind, self.change.is_dir) {
            (_, ChangeKind::Deleted, _) => None,
            (Some(g), _, _) => Some(g.kind),
            (None, _, true) => Some(umbra_proto::FileKind::Dir),
            (None, _, false) => None,
        };
        ShadowEntry {
            path: self.change.path.clone(),
            kind: self.change.kind,
            is_dir: self.change.is_dir,
            file_kind,
            size: self.size,
            sha256: self.sha256.map(|h| hex(&h)),
            risks: self.risks.iter().copied().collect(),
            applies: self.applies,
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A file being captured into a [`ChangeSet`] (see [`ChangeSet::add`]).
pub struct FileCapture {
    index: usize,
    file: File,
    hasher: Sha256,
    len: u64,
}

impl fmt::Debug for FileCapture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileCapture").field("index", &self.index).field("len", &self.len).finish()
    }
}

/// A shadow diff captured on the host: its entries, their risks, and the bytes of every changed
/// file, spooled in a directory of its own that is removed when the change-set is dropped.
pub struct ChangeSet {
    id: String,
    dir: PathBuf,
    spool: File,
    entries: Vec<Captured>,
    /// Paths of the entries that are not deletions: a guest listing one twice is refused, so
    /// an entry's bytes are the only bytes its path can get.
    kept: HashSet<String>,
    captured: u64,
    limits: CaptureLimits,
}

impl fmt::Debug for ChangeSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChangeSet").field("id", &self.id).field("entries", &self.entries.len()).finish()
    }
}

impl ChangeSet {
    /// An empty change-set spooling into a new private directory in `parent` (storage the
    /// runtime owns, e.g. the VM's run directory).
    pub fn create(parent: &Path, limits: CaptureLimits) -> Result<ChangeSet, ShadowError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let millis = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis());
        let id = format!("cs-{millis:x}-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let dir = parent.join(format!("changeset-{id}"));
        let io_err = |source| ShadowError::Io { path: dir.display().to_string(), source };
        let parent_dir = beneath::open_dir(parent).map_err(io_err)?;
        // A fresh directory (mkdirat fails on anything already there, a symlink included).
        beneath::mkdir_at(&parent_dir, dir.file_name().expect("named above"), 0o700).map_err(io_err)?;
        let spool = beneath::open_subdir(&parent_dir, dir.file_name().expect("named above")).map_err(io_err)?;
        Ok(ChangeSet { id, dir, spool, entries: Vec::new(), kept: HashSet::new(), captured: 0, limits })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn entries(&self) -> &[Captured] {
        &self.entries
    }

    /// The entries as `shadow.diff` reports them.
    pub fn report(&self) -> Vec<ShadowEntry> {
        self.entries.iter().map(Captured::entry).collect()
    }

    /// Records `change` (with `guest`, the guest's lstat of an added or modified non-directory).
    /// For a regular file, returns the capture its bytes go to: [`Self::write`] them, then
    /// [`Self::finish`].
    pub fn add(
        &mut self,
        change: ShadowChange,
        guest: Option<FileStat>,
        baseline: &Baseline,
        rules: &Rules,
    ) -> Result<Option<FileCapture>, ShadowError> {
        parse_relative(&change.path)?;
        if self.entries.len() >= self.limits.entries {
            return Err(ShadowError::CaptureTooLarge { limit: format!("{} entries", self.limits.entries) });
        }
        if change.kind != ChangeKind::Deleted && !self.kept.insert(change.path.clone()) {
            return Err(ShadowError::InvalidPath { path: change.path, reason: "listed twice by the guest" });
        }
        let writes_file = change.kind != ChangeKind::Deleted && !change.is_dir;
        if writes_file && guest.is_none() {
            return Err(ShadowError::ChangedWhileCaptured(change.path));
        }
        let risks = risks_of(&change, guest.as_ref(), baseline, rules.ignore.as_ref());
        let (applies, why_not) = applies_of(&risks, rules);
        let regular = writes_file && guest.as_ref().is_some_and(|g| g.kind == umbra_proto::FileKind::File);
        let index = self.entries.len();
        let capture = if regular {
            let name = OsString::from(index.to_string());
            let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW;
            let file = beneath::openat(&self.spool, &name, flags, 0o600)
                .map_err(|source| ShadowError::Io { path: change.path.clone(), source })?;
            Some((name, FileCapture { index, file, hasher: Sha256::new(), len: 0 }))
        } else {
            None
        };
        let (spooled, capture) = capture.map_or((None, None), |(n, c)| (Some(n), Some(c)));
        self.entries.push(Captured { change, guest, size: None, sha256: None, risks, applies, why_not, spooled });
        Ok(capture)
    }

    /// Appends the next bytes of a file being captured.
    pub fn write(&mut self, capture: &mut FileCapture, bytes: &[u8]) -> Result<(), ShadowError> {
        let entry = &self.entries[capture.index];
        let expected = entry.guest.as_ref().map_or(0, |g| g.size);
        if capture.len + bytes.len() as u64 > expected {
            return Err(ShadowError::ChangedWhileCaptured(entry.change.path.clone()));
        }
        if self.captured + bytes.len() as u64 > self.limits.bytes {
            return Err(ShadowError::CaptureTooLarge { limit: format!("{} bytes", self.limits.bytes) });
        }
        capture.file.write_all(bytes).map_err(|source| ShadowError::Io { path: entry.change.path.clone(), source })?;
        capture.hasher.update(bytes);
        capture.len += bytes.len() as u64;
        self.captured += bytes.len() as u64;
        Ok(())
    }

    /// Completes a file's capture: it must hold as many bytes as the guest's lstat said.
    pub fn finish(&mut self, capture: FileCapture) -> Result<(), ShadowError> {
        let entry = &mut self.entries[capture.index];
        if entry.guest.as_ref().map(|g| g.size) != Some(capture.len) {
            return Err(ShadowError::ChangedWhileCaptured(entry.change.path.clone()));
        }
        entry.size = Some(capture.len);
        entry.sha256 = Some(capture.hasher.finalize().into());
        Ok(())
    }

    /// The changes an apply of `paths` (default: every entry that applies by default) writes,
    /// and the entries it leaves out. Naming a path that is not in the change-set, that was not
    /// captured whole, or that is never applied refuses the whole apply.
    pub fn select(&self, paths: Option<&[String]>) -> Result<(Vec<ShadowChange>, Vec<Skipped>), ShadowError> {
        let named: Option<HashSet<&str>> = paths.map(|p| p.iter().map(String::as_str).collect());
        if let Some(named) = &named {
            for path in named {
                let mut matching = self.entries.iter().filter(|e| e.change.path == *path).peekable();
                if matching.peek().is_none() {
                    return Err(ShadowError::NotInChangeSet(path.to_string()));
                }
                for entry in matching {
                    if entry.applies == ShadowApplies::Never {
                        let reason = entry.why_not.unwrap_or("never applied").to_owned();
                        return Err(ShadowError::NeverApplied { path: path.to_string(), reason });
                    }
                }
            }
        }
        let mut selected = Vec::new();
        let mut skipped = Vec::new();
        for entry in &self.entries {
            let is_named = named.as_ref().is_some_and(|n| n.contains(entry.change.path.as_str()));
            let chosen = match (&named, entry.applies) {
                (_, ShadowApplies::Never) => false,
                (Some(_), _) => is_named,
                (None, ShadowApplies::ByDefault) => true,
                (None, ShadowApplies::WhenNamed) => false,
            };
            let writes_file = entry.change.kind != ChangeKind::Deleted && !entry.change.is_dir;
            if chosen && writes_file && entry.sha256.is_none() {
                // A capture cut short by an error is never applied in part.
                return Err(ShadowError::ChangedWhileCaptured(entry.change.path.clone()));
            }
            if chosen {
                selected.push(entry.change.clone());
            } else {
                let reason = entry.why_not.unwrap_or("not among the paths named").to_owned();
                skipped.push(Skipped { path: entry.change.path.clone(), reason });
            }
        }
        Ok((selected, skipped))
    }

    /// Applies `paths` of this change-set (see [`Self::select`]) to the host folder `root` with
    /// [`apply`]'s rules, writing the captured bytes, each checked against its SHA-256 as it is
    /// copied. An `Err` means nothing was applied.
    pub fn apply(
        &self,
        root: &Path,
        baseline: &Baseline,
        paths: Option<&[String]>,
    ) -> Result<ApplyReport, ShadowError> {
        let (selected, skipped) = self.select(paths)?;
        let spooled: HashMap<&str, &Captured> = self
            .entries
            .iter()
            .filter(|e| e.spooled.is_some() && e.sha256.is_some())
            .map(|e| (e.change.path.as_str(), e))
            .collect();
        let open = |path: &str| -> io::Result<Verified<File>> {
            let entry = spooled.get(path).ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "not captured"))?;
            let name = entry.spooled.as_ref().expect("filtered above");
            let file = beneath::openat(&self.spool, name, libc::O_RDONLY | libc::O_NOFOLLOW, 0)?;
            Ok(Verified { inner: file, hasher: Sha256::new(), expected: entry.sha256.expect("filtered above") })
        };
        let mut report = apply(root, baseline, &selected, open);
        for error in &mut report.errors {
            if let ShadowError::Fetch { source, .. } | ShadowError::Io { source, .. } = &error.error {
                if source.get_ref().is_some_and(|e| e.is::<HashMismatch>()) {
                    error.error = ShadowError::HashMismatch(error.path.clone());
                }
            }
        }
        report.skipped = skipped;
        Ok(report)
    }

    /// Writes the captured changes as a tar (see [`export_tar`]); symlinks and special files,
    /// which have no captured bytes, are left out.
    pub fn export_tar<W: Write>(&self, out: W) -> Result<W, ShadowError> {
        let changes: Vec<ShadowChange> = self
            .entries
            .iter()
            .filter(|e| e.change.kind == ChangeKind::Deleted || e.change.is_dir || e.sha256.is_some())
            .map(|e| ShadowChange { size: e.size, ..e.change.clone() })
            .collect();
        let by_path: HashMap<&str, &OsString> =
            self.entries.iter().filter_map(|e| Some((e.change.path.as_str(), e.spooled.as_ref()?))).collect();
        let open = |path: &str| -> io::Result<File> {
            let name = by_path.get(path).ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "not captured"))?;
            beneath::openat(&self.spool, name, libc::O_RDONLY | libc::O_NOFOLLOW, 0)
        };
        export_tar(&changes, open, out)
    }
}

impl Drop for ChangeSet {
    fn drop(&mut self) {
        let _ = remove_tree(&self.spool);
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// The error a [`Verified`] read ends with when the bytes are not the captured ones.
#[derive(Debug)]
struct HashMismatch;

impl fmt::Display for HashMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the captured bytes do not match their SHA-256")
    }
}

impl std::error::Error for HashMismatch {}

/// Reads `inner` and, at its end, fails with [`HashMismatch`] unless what was read has the
/// `expected` SHA-256: [`apply`] then removes its temporary file and replaces nothing.
struct Verified<R> {
    inner: R,
    hasher: Sha256,
    expected: [u8; 32],
}

impl<R: Read> Read for Verified<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n == 0 && !buf.is_empty() {
            let digest: [u8; 32] = self.hasher.clone().finalize().into();
            if digest != self.expected {
                return Err(io::Error::new(io::ErrorKind::InvalidData, HashMismatch));
            }
        }
        self.hasher.update(&buf[..n]);
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

    // ---- change-sets: capture, apply exactly, subsets, refusals ----

    fn stat(kind: umbra_proto::FileKind, size: usize, mode: u32) -> FileStat {
        FileStat { kind, size: size as u64, mode, uid: 0, gid: 0, mtime_ms: 0 }
    }

    /// Captures one change as the runtime does: the guest's lstat, then its bytes.
    fn capture(set: &mut ChangeSet, baseline: &Baseline, rules: &Rules, path: &str, kind: ChangeKind, bytes: &str) {
        capture_as(set, baseline, rules, path, kind, bytes, 0o100644, umbra_proto::FileKind::File);
    }

    #[allow(clippy::too_many_arguments)]
    fn capture_as(
        set: &mut ChangeSet,
        baseline: &Baseline,
        rules: &Rules,
        path: &str,
        kind: ChangeKind,
        bytes: &str,
        mode: u32,
        file_kind: umbra_proto::FileKind,
    ) {
        let guest = (kind != Deleted).then(|| stat(file_kind, bytes.len(), mode));
        if let Some(mut c) = set.add(change(path, kind, false), guest, baseline, rules).unwrap() {
            // In two pieces, as chunks come from the agent.
            let (a, b) = bytes.as_bytes().split_at(bytes.len() / 2);
            set.write(&mut c, a).unwrap();
            set.write(&mut c, b).unwrap();
            set.finish(c).unwrap();
        }
    }

    fn entry_of<'a>(set: &'a ChangeSet, path: &str) -> &'a Captured {
        set.entries().iter().find(|e| e.change.path == path).unwrap()
    }

    fn sha256_hex(bytes: &[u8]) -> String {
        hex(&Sha256::digest(bytes))
    }

    #[test]
    fn a_change_set_applies_exactly_the_captured_bytes_and_cleans_up() {
        let (tmp, root) = project();
        let baseline = Baseline::record(&root).unwrap();
        let run = tmp.path().join("run");
        std::fs::create_dir(&run).unwrap();
        let rules = Rules::default();
        let mut set = ChangeSet::create(&run, CaptureLimits::default()).unwrap();
        capture(&mut set, &baseline, &rules, "src/lib.rs", Modified, "reviewed lib");
        capture(&mut set, &baseline, &rules, "new.txt", Added, "reviewed new");
        set.add(change("del.txt", Deleted, false), None, &baseline, &rules).unwrap();
        let report = set.report();
        assert_eq!(report[0].sha256.as_deref(), Some(sha256_hex(b"reviewed lib").as_str()));
        assert_eq!((report[1].size, report[1].applies), (Some(12), ShadowApplies::ByDefault));
        assert_eq!((report[2].size, &report[2].sha256, report[2].file_kind), (None, &None, None));
        assert!(report.iter().all(|e| e.risks.is_empty()), "{report:?}");
        let spool = set.dir.clone();
        let mode = std::fs::metadata(&spool).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o700, "the spool is private to the runtime");

        // Whatever the guest does after the diff, the apply reads the spool only.
        let report = set.apply(&root, &baseline, None).unwrap();
        assert!(report.is_clean() && report.skipped.is_empty(), "{report:?}");
        assert_eq!(report.applied.len(), 3);
        assert_eq!(std::fs::read(root.join("src/lib.rs")).unwrap(), b"reviewed lib");
        assert_eq!(std::fs::read(root.join("new.txt")).unwrap(), b"reviewed new");
        assert!(!root.join("del.txt").exists());
        drop(set);
        assert!(!spool.exists(), "a dropped change-set removes its spool");
    }

    #[test]
    fn a_path_the_guest_lists_twice_is_refused_but_a_type_change_is_not() {
        let (tmp, root) = project();
        let baseline = Baseline::record(&root).unwrap();
        let rules = Rules::default();
        let mut set = ChangeSet::create(tmp.path(), CaptureLimits::default()).unwrap();
        capture(&mut set, &baseline, &rules, "new.txt", Added, "first");
        let again = set.add(
            change("new.txt", Added, false),
            Some(stat(umbra_proto::FileKind::File, 6, 0o100644)),
            &baseline,
            &rules,
        );
        assert!(matches!(again, Err(ShadowError::InvalidPath { .. })), "{again:?}");
        // A file that became a directory comes as a deletion and an addition of one path.
        set.add(change("src/lib.rs", Deleted, false), None, &baseline, &rules).unwrap();
        set.add(change("src/lib.rs", Added, true), None, &baseline, &rules).unwrap();
    }

    #[test]
    fn tampered_spool_bytes_are_never_written() {
        let (tmp, root) = project();
        let baseline = Baseline::record(&root).unwrap();
        let rules = Rules::default();
        let mut set = ChangeSet::create(tmp.path(), CaptureLimits::default()).unwrap();
        capture(&mut set, &baseline, &rules, "src/lib.rs", Modified, "reviewed");
        let before = snapshot(&root);
        let spooled = set.dir.join(entry_of(&set, "src/lib.rs").spooled.as_ref().unwrap());
        std::fs::write(&spooled, "tampered").unwrap();
        let report = set.apply(&root, &baseline, None).unwrap();
        assert!(report.applied.is_empty(), "{report:?}");
        assert!(matches!(report.errors[0].error, ShadowError::HashMismatch(_)), "{report:?}");
        assert_eq!(snapshot(&root), before, "the file is untouched and no temporary is left");
    }

    #[test]
    fn a_subset_applies_only_the_named_paths_and_unknown_names_refuse_everything() {
        let (tmp, root) = project();
        let baseline = Baseline::record(&root).unwrap();
        let rules = Rules::default();
        let mut set = ChangeSet::create(tmp.path(), CaptureLimits::default()).unwrap();
        capture(&mut set, &baseline, &rules, "src/lib.rs", Modified, "guest lib");
        capture(&mut set, &baseline, &rules, "new.txt", Added, "guest new");
        let before = snapshot(&root);
        for names in [vec!["new.txt", "f.txt"], vec![".git/config"], vec!["src"]] {
            let names: Vec<String> = names.into_iter().map(String::from).collect();
            let err = set.apply(&root, &baseline, Some(&names)).unwrap_err();
            assert!(matches!(err, ShadowError::NotInChangeSet(_)), "{err}");
            assert_eq!(snapshot(&root), before, "a refused apply writes nothing");
        }
        let report = set.apply(&root, &baseline, Some(&["new.txt".to_owned()])).unwrap();
        assert_eq!(report.applied, ["new.txt"]);
        assert_eq!(report.skipped, [Skipped { path: "src/lib.rs".into(), reason: "not among the paths named".into() }]);
        assert_eq!(std::fs::read(root.join("src/lib.rs")).unwrap(), b"old lib");
        assert_eq!(std::fs::read(root.join("new.txt")).unwrap(), b"guest new");
    }

    #[test]
    fn git_paths_apply_only_when_named_and_never_under_block_git_writes() {
        let (tmp, root) = project();
        write(&root, ".git/config", "[core]\n");
        write(&root, "sub/.git/HEAD", "ref: main\n");
        for block_git in [false, true] {
            let baseline = Baseline::record(&root).unwrap();
            let rules = Rules { block_git, ignore: None };
            let mut set = ChangeSet::create(tmp.path(), CaptureLimits::default()).unwrap();
            capture(&mut set, &baseline, &rules, "keep.txt", Modified, "reviewed");
            capture(&mut set, &baseline, &rules, ".git/config", Modified, "[core]\n\tfsmonitor = evil\n");
            let hook = "#!/bin/sh\nevil\n";
            capture_as(
                &mut set,
                &baseline,
                &rules,
                ".git/hooks/pre-commit",
                Added,
                hook,
                0o100755,
                umbra_proto::FileKind::File,
            );
            set.add(change("sub", Deleted, true), None, &baseline, &rules).unwrap();
            let config = entry_of(&set, ".git/config").entry();
            assert_eq!(config.risks, [ShadowRisk::Git, ShadowRisk::Dotfile]);
            let hook_risks = entry_of(&set, ".git/hooks/pre-commit").entry().risks;
            let expected = [ShadowRisk::Git, ShadowRisk::GitHook, ShadowRisk::Dotfile, ShadowRisk::Executable];
            assert_eq!(hook_risks, expected);
            assert_eq!(entry_of(&set, "sub").entry().risks, [ShadowRisk::Git], "it deletes a .git below it");
            let guarded = if block_git { ShadowApplies::Never } else { ShadowApplies::WhenNamed };
            for path in [".git/config", ".git/hooks/pre-commit", "sub"] {
                assert_eq!(entry_of(&set, path).applies, guarded, "{path}");
            }

            // Not named: applied around, never written.
            let before = snapshot(&root);
            let report = set.apply(&root, &baseline, None).unwrap();
            assert_eq!(report.applied, ["keep.txt"], "{report:?}");
            let mut skipped: Vec<&str> = report.skipped.iter().map(|s| s.path.as_str()).collect();
            skipped.sort();
            assert_eq!(skipped, [".git/config", ".git/hooks/pre-commit", "sub"]);
            assert_eq!(std::fs::read(root.join(".git/config")).unwrap(), b"[core]\n");
            assert!(!root.join(".git/hooks").exists() && root.join("sub/.git/HEAD").exists());
            let mut expected = before;
            expected.insert("keep.txt".into(), Some(b"reviewed".to_vec()));
            assert_eq!(snapshot(&root), expected);
            write(&root, "keep.txt", "keep");
            let baseline_now = Baseline::record(&root).unwrap();

            // Named: applied, unless the policy blocks git writes (then nothing at all is).
            let named = vec![".git/config".to_owned(), "keep.txt".to_owned()];
            let before = snapshot(&root);
            match set.apply(&root, &baseline_now, Some(&named)) {
                Ok(report) if !block_git => {
                    assert!(report.is_clean(), "{report:?}");
                    assert_eq!(std::fs::read(root.join(".git/config")).unwrap(), b"[core]\n\tfsmonitor = evil\n");
                    write(&root, ".git/config", "[core]\n");
                }
                Err(ShadowError::NeverApplied { path, reason }) if block_git => {
                    assert_eq!(path, ".git/config");
                    assert!(reason.contains("block_git_writes"), "{reason}");
                    assert_eq!(snapshot(&root), before, "a refused apply writes nothing");
                }
                other => panic!("block_git {block_git}: {other:?}"),
            }
            write(&root, "keep.txt", "keep");
        }
    }

    #[test]
    fn ignored_paths_apply_only_when_named_and_symlinks_never() {
        let (tmp, root) = project();
        write(&root, ".env", "HOST_SECRET=1\n");
        write(&root, "conf/.env", "OTHER=1\n");
        let baseline = Baseline::record(&root).unwrap();
        let ignore = IgnoreSet::new(&root, &[".env".to_owned()]).unwrap();
        let rules = Rules { block_git: false, ignore: Some(ignore) };
        let mut set = ChangeSet::create(tmp.path(), CaptureLimits::default()).unwrap();
        // The guest never saw the host's .env (hidden), so its own is "added" over it.
        capture(&mut set, &baseline, &rules, ".env", Added, "GUEST=1\n");
        set.add(change("conf", Deleted, true), None, &baseline, &rules).unwrap();
        let link = stat(umbra_proto::FileKind::Symlink, 11, 0o120777);
        assert!(set.add(change("link", Added, false), Some(link), &baseline, &rules).unwrap().is_none());
        let special = stat(umbra_proto::FileKind::Other, 0, 0o010644);
        assert!(set.add(change("fifo", Added, false), Some(special), &baseline, &rules).unwrap().is_none());
        assert_eq!(entry_of(&set, ".env").entry().risks, [ShadowRisk::Dotfile, ShadowRisk::Ignored]);
        assert_eq!(entry_of(&set, ".env").applies, ShadowApplies::WhenNamed);
        assert_eq!(entry_of(&set, "conf").entry().risks, [ShadowRisk::Ignored], "it deletes an ignored file");
        let link = entry_of(&set, "link").entry();
        assert_eq!(
            (link.risks.as_slice(), link.applies, link.sha256),
            (&[ShadowRisk::Symlink][..], ShadowApplies::Never, None)
        );
        assert_eq!(entry_of(&set, "fifo").entry().risks, [ShadowRisk::Special]);

        let before = snapshot(&root);
        let report = set.apply(&root, &baseline, None).unwrap();
        assert!(report.applied.is_empty(), "{report:?}");
        assert_eq!(report.skipped.len(), 4);
        assert_eq!(snapshot(&root), before);
        let err = set.apply(&root, &baseline, Some(&["link".to_owned()])).unwrap_err();
        assert!(matches!(err, ShadowError::NeverApplied { .. }), "{err}");
        let report = set.apply(&root, &baseline, Some(&[".env".to_owned()])).unwrap();
        assert_eq!(report.applied, [".env"], "{report:?}");
        assert_eq!(std::fs::read(root.join(".env")).unwrap(), b"GUEST=1\n");
    }

    #[test]
    fn executables_are_marked() {
        let (tmp, root) = project();
        let baseline = Baseline::record(&root).unwrap();
        let rules = Rules::default();
        let mut set = ChangeSet::create(tmp.path(), CaptureLimits::default()).unwrap();
        let file = umbra_proto::FileKind::File;
        capture_as(&mut set, &baseline, &rules, "tool", Added, "#!/bin/sh\n", 0o100755, file);
        capture_as(&mut set, &baseline, &rules, "keep.txt", Modified, "x", 0o100744, file);
        capture_as(&mut set, &baseline, &rules, "run.sh", Modified, "#!/bin/sh\nnew\n", 0o100644, file);
        capture_as(&mut set, &baseline, &rules, "src/lib.rs", Modified, "plain", 0o100644, file);
        let marked = |p| entry_of(&set, p).risks.contains(&ShadowRisk::Executable);
        assert!(marked("tool"), "a new executable");
        assert!(marked("keep.txt"), "made executable");
        assert!(marked("run.sh"), "new contents for a host executable, which keeps its mode");
        assert!(!marked("src/lib.rs"));
    }

    #[test]
    fn captures_are_bounded_and_must_match_the_guests_size() {
        let (tmp, root) = project();
        let baseline = Baseline::record(&root).unwrap();
        let rules = Rules::default();
        let file = |n| Some(stat(umbra_proto::FileKind::File, n, 0o100644));
        let mut set = ChangeSet::create(tmp.path(), CaptureLimits { bytes: 10, entries: 3 }).unwrap();
        let mut c = set.add(change("a", Added, false), file(8), &baseline, &rules).unwrap().unwrap();
        set.write(&mut c, b"12345678").unwrap();
        set.finish(c).unwrap();
        let mut c = set.add(change("b", Added, false), file(8), &baseline, &rules).unwrap().unwrap();
        let err = set.write(&mut c, b"123").unwrap_err();
        assert!(matches!(err, ShadowError::CaptureTooLarge { .. }), "{err}");
        // A file that grew past what the guest reported, or came up short, is refused.
        let mut c = set.add(change("c", Added, false), file(1), &baseline, &rules).unwrap().unwrap();
        assert!(matches!(set.write(&mut c, b"12").unwrap_err(), ShadowError::ChangedWhileCaptured(_)));
        assert!(matches!(set.finish(c).unwrap_err(), ShadowError::ChangedWhileCaptured(_)));
        let err = set.add(change("d", Added, true), None, &baseline, &rules).unwrap_err();
        assert!(matches!(err, ShadowError::CaptureTooLarge { .. }), "{err}");
        // What was not captured whole is never applied, not even in part.
        let err = set.apply(&root, &baseline, Some(&["b".to_owned()])).unwrap_err();
        assert!(matches!(err, ShadowError::ChangedWhileCaptured(_)), "{err}");
        // A file the guest removed before its lstat, or a hostile path, fails the capture.
        let err = set.add(change("e", Added, false), None, &baseline, &rules).unwrap_err();
        assert!(matches!(err, ShadowError::ChangedWhileCaptured(_) | ShadowError::CaptureTooLarge { .. }));
        let mut set = ChangeSet::create(tmp.path(), CaptureLimits::default()).unwrap();
        assert!(matches!(
            set.add(change("e", Added, false), None, &baseline, &rules),
            Err(ShadowError::ChangedWhileCaptured(_))
        ));
        assert!(matches!(
            set.add(change("../x", Added, false), file(1), &baseline, &rules),
            Err(ShadowError::InvalidPath { .. })
        ));
    }

    #[test]
    fn export_writes_the_captured_bytes() {
        let (tmp, root) = project();
        let baseline = Baseline::record(&root).unwrap();
        let rules = Rules::default();
        let mut set = ChangeSet::create(tmp.path(), CaptureLimits::default()).unwrap();
        capture(&mut set, &baseline, &rules, "new.txt", Added, "captured");
        let link = stat(umbra_proto::FileKind::Symlink, 3, 0o120777);
        set.add(change("link", Added, false), Some(link), &baseline, &rules).unwrap();
        let tar = set.export_tar(Vec::new()).unwrap();
        let mut names = Vec::new();
        for entry in tar::Archive::new(tar.as_slice()).entries().unwrap() {
            let mut entry = entry.unwrap();
            let mut content = String::new();
            entry.read_to_string(&mut content).unwrap();
            names.push((entry.path().unwrap().to_str().unwrap().to_owned(), content));
        }
        assert_eq!(names, [("new.txt".into(), "captured".into()), (DELETED_MANIFEST.into(), String::new())]);
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
