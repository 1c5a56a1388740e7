//! Host ↔ guest path translation for a session's shared folders.
//!
//! In the guest every share lives at `/sessions/<session>/mnt/<folder>`, next to two reserved
//! ones backed by the session's storage directory: `mnt/outputs` (`<storage>/outputs`) and
//! `mnt/uploads` (`<storage>/uploads`). The guest names files; the host acts on them (shows
//! them, opens them for the user, applies a shadow diff). Everything a guest sends is hostile.
//!
//! Translation ([`SessionShares::guest_to_host`]) is lexical and strict: the path must be
//! absolute, NUL-free, of this session, under a known share, and contain no `..` component at
//! all — `..` is rejected before any normalisation, so `a/../../x` never gets the chance to be
//! "harmless". Nothing is decoded: `%2e%2e` is a file name, not `..`.
//!
//! A lexically clean path can still leave the share through a symlink the guest planted inside
//! it, so host-side opening ([`SessionShares::open_beneath`]) resolves the path *beneath* the
//! share root (`openat2(RESOLVE_BENEATH)`): symlinks that stay inside work, anything that would
//! leave fails with [`PathError::Escape`].
//!
//! Hard links need no check here: a hard link inside a share to a file outside it can only be
//! made on the host by someone who can already reach both. The guest cannot make one — its
//! `link` requests reach virtiofsd, whose sandbox only sees the shared directory, so both ends of
//! any link it creates are inside the share.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Component, Path, PathBuf};

use super::beneath;

/// Where every session's tree starts in the guest.
pub const GUEST_SESSIONS_DIR: &str = "/sessions";
/// Reserved share backed by `<storage>/outputs`: what the session produces for the user.
pub const OUTPUTS: &str = "outputs";
/// Reserved share backed by `<storage>/uploads`: what the user hands the session.
pub const UPLOADS: &str = "uploads";
/// Reserved share behind a read-only `/tmp` (the policy's `disable_tmp_write`): an empty host
/// directory the guest binds over `/tmp`.
pub const READONLY_TMP: &str = ".readonly-tmp";
/// Longest session or folder name, in bytes.
pub const MAX_NAME_LEN: usize = 64;

/// Binaries a host must never open for the user (compared lowercase, without the dot).
pub const BLOCKED_BINARY_EXTENSIONS: &[&str] = &["exe", "com", "msi", "bin", "app", "dmg", "pkg", "jar"];
/// Scripts a desktop "open" would run rather than show.
pub const BLOCKED_SCRIPT_EXTENSIONS: &[&str] = &[
    "sh",
    "bash",
    "zsh",
    "command",
    "bat",
    "cmd",
    "ps1",
    "vb",
    "jnlp",
    "js",
    "pl",
    "py",
    "rb",
    "scpt",
    "scptd",
    "applescript",
    "workflow",
];

/// What went wrong with a path, naming it. Paths are shown `{:?}`-quoted: they come from a
/// guest and may hold control characters.
#[derive(Debug, thiserror::Error)]
pub enum PathError {
    #[error("invalid {what} name {name:?}: {reason}")]
    InvalidName { what: &'static str, name: String, reason: &'static str },
    #[error("folder name {0:?} is reserved for the session's own storage")]
    ReservedName(String),
    #[error("two shared folders are named {0:?}; give one a different name")]
    DuplicateFolder(String),
    #[error("{0:?} is not an absolute path")]
    NotAbsolute(String),
    #[error("path {0:?} contains a NUL byte")]
    Nul(String),
    #[error("path {0:?} contains a `..` component")]
    Traversal(String),
    #[error("path {path:?} is not in session {session:?}")]
    SessionMismatch { path: String, session: String },
    #[error("path {0:?} is not inside a shared folder of this session")]
    NotShared(String),
    #[error("path {0:?} resolves outside its shared folder (through a symlink, or a symlink loop)")]
    Escape(String),
    #[error("refusing to open {path:?} on the host: .{ext} files can run code")]
    BlockedExtension { path: String, ext: String },
    #[error("path {path:?} is in a {mode} share: the host does not write to it")]
    ReadOnly { path: String, mode: ShareMode },
    #[error("{0:?} is not a regular file or directory")]
    UnsupportedFileType(String),
    #[error("{0:?} is not a directory")]
    NotADirectory(PathBuf),
    #[error("{path:?}: {source}")]
    Io { path: String, source: io::Error },
}

/// How a folder is shared: the protocol's own type, so host and guest cannot disagree.
pub use umbra_proto::{ParseShareModeError, ShareMode};

/// One host folder shared into a session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedFolder {
    /// The guest-side name: `/sessions/<session>/mnt/<name>`.
    pub name: String,
    /// Canonical, absolute host directory.
    pub host_path: PathBuf,
    pub mode: ShareMode,
}

impl SharedFolder {
    /// Shares the directory `host_path` (canonicalised here) as `name`, by default
    /// [`default_folder_name`] of it.
    pub fn new(host_path: impl AsRef<Path>, name: Option<&str>, mode: ShareMode) -> Result<Self, PathError> {
        let given = host_path.as_ref();
        let host_path = given.canonicalize().map_err(|source| io_error(given, source))?;
        if !host_path.is_dir() {
            return Err(PathError::NotADirectory(host_path));
        }
        let name = match name {
            Some(name) => name.to_owned(),
            None => default_folder_name(&host_path)?,
        };
        validate_folder_name(&name)?;
        Ok(SharedFolder { name, host_path, mode })
    }
}

/// The default guest name of a shared host folder: its basename, with every byte outside
/// `[A-Za-z0-9._-]` replaced by `_` and cut to [`MAX_NAME_LEN`] (so `My Project` → `My_Project`).
pub fn default_folder_name(host_path: &Path) -> Result<String, PathError> {
    let base = host_path.file_name().map(|n| n.as_encoded_bytes()).unwrap_or_default();
    let name: String = base.iter().take(MAX_NAME_LEN).map(|&b| if is_name_byte(b) { b as char } else { '_' }).collect();
    validate_folder_name(&name)?;
    Ok(name)
}

fn is_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')
}

fn validate_name(what: &'static str, name: &str) -> Result<(), PathError> {
    let reason = if name.is_empty() {
        "empty"
    } else if name.len() > MAX_NAME_LEN {
        "longer than 64 bytes"
    } else if name == "." || name == ".." {
        "`.` and `..` are not names"
    } else if !name.bytes().all(is_name_byte) {
        "only letters, digits, `.`, `_` and `-` are allowed"
    } else {
        return Ok(());
    };
    Err(PathError::InvalidName { what, name: name.to_owned(), reason })
}

/// A session name is one path component of `[A-Za-z0-9._-]`, at most 64 bytes, not `.`/`..`.
pub fn validate_session_name(name: &str) -> Result<(), PathError> {
    validate_name("session", name)
}

/// A folder name follows the session-name rules and is not `outputs` or `uploads` (in any case:
/// on a case-insensitive host the two would be one directory).
pub fn validate_folder_name(name: &str) -> Result<(), PathError> {
    validate_name("folder", name)?;
    if name.eq_ignore_ascii_case(OUTPUTS) || name.eq_ignore_ascii_case(UPLOADS) || name == READONLY_TMP {
        return Err(PathError::ReservedName(name.to_owned()));
    }
    Ok(())
}

/// A guest path translated to the host: a share root and a lexically clean path beneath it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostPath {
    /// The folder name, or `outputs`/`uploads`.
    pub share: String,
    pub mode: ShareMode,
    /// The share's host directory.
    pub root: PathBuf,
    /// Beneath `root`: only normal components, empty for the root itself.
    pub relative: PathBuf,
}

impl HostPath {
    /// `root/relative`. Lexically inside the share; only [`SessionShares::open_beneath`] also
    /// guarantees no symlink leads out of it.
    pub fn path(&self) -> PathBuf {
        if self.relative.as_os_str().is_empty() {
            self.root.clone()
        } else {
            self.root.join(&self.relative)
        }
    }
}

/// A session's shares: the folders it was given plus its own outputs and uploads.
#[derive(Clone, Debug)]
pub struct SessionShares {
    session: String,
    storage_dir: PathBuf,
    folders: Vec<SharedFolder>,
}

impl SessionShares {
    /// Checks the session name, every folder name (valid, not reserved, unique) and that the
    /// storage directory and every folder's host path are absolute without `..`.
    pub fn new(
        session: impl Into<String>,
        storage_dir: impl Into<PathBuf>,
        folders: Vec<SharedFolder>,
    ) -> Result<Self, PathError> {
        let (session, storage_dir) = (session.into(), storage_dir.into());
        validate_session_name(&session)?;
        check_host_root(&storage_dir)?;
        for (i, folder) in folders.iter().enumerate() {
            validate_folder_name(&folder.name)?;
            check_host_root(&folder.host_path)?;
            if folders[..i].iter().any(|other| other.name == folder.name) {
                return Err(PathError::DuplicateFolder(folder.name.clone()));
            }
        }
        Ok(SessionShares { session, storage_dir, folders })
    }

    pub fn session(&self) -> &str {
        &self.session
    }

    pub fn storage_dir(&self) -> &Path {
        &self.storage_dir
    }

    pub fn folders(&self) -> &[SharedFolder] {
        &self.folders
    }

    /// `/sessions/<session>/mnt/<share>`, for a folder name or `outputs`/`uploads`.
    pub fn guest_mount_point(&self, share: &str) -> String {
        format!("{GUEST_SESSIONS_DIR}/{}/mnt/{share}", self.session)
    }

    /// Every share as (name, mode, host root), the reserved ones first.
    fn shares(&self) -> impl Iterator<Item = (&str, ShareMode, PathBuf)> {
        let reserved = [OUTPUTS, UPLOADS].into_iter().map(|name| (name, ShareMode::Rw, self.storage_dir.join(name)));
        reserved.chain(self.folders.iter().map(|f| (f.name.as_str(), f.mode, f.host_path.clone())))
    }

    /// Translates a guest path to the host path it names, lexically (see the module docs).
    pub fn guest_to_host(&self, guest_path: &str) -> Result<HostPath, PathError> {
        if guest_path.contains('\0') {
            return Err(PathError::Nul(guest_path.to_owned()));
        }
        if !guest_path.starts_with('/') {
            return Err(PathError::NotAbsolute(guest_path.to_owned()));
        }
        let components: Vec<&str> = guest_path.split('/').filter(|c| !c.is_empty() && *c != ".").collect();
        if components.contains(&"..") {
            return Err(PathError::Traversal(guest_path.to_owned()));
        }
        let not_shared = || PathError::NotShared(guest_path.to_owned());
        let ["sessions", session, rest @ ..] = components.as_slice() else {
            return Err(not_shared());
        };
        if *session != self.session {
            return Err(PathError::SessionMismatch { path: guest_path.to_owned(), session: self.session.clone() });
        }
        let ["mnt", share, sub @ ..] = rest else {
            return Err(not_shared());
        };
        let (share, mode, root) = self.shares().find(|(name, ..)| name == share).ok_or_else(not_shared)?;
        Ok(HostPath { share: share.to_owned(), mode, root, relative: sub.iter().collect() })
    }

    /// The guest path of a host path inside one of the shares (the most specific one if shares
    /// nest), or `None`. Lexical: pass canonical paths; `..` and non-UTF-8 paths give `None`.
    pub fn host_to_guest(&self, host_path: &Path) -> Option<String> {
        if !host_path.is_absolute() || host_path.components().any(|c| c == Component::ParentDir) {
            return None;
        }
        let (share, rel) = self
            .shares()
            .filter_map(|(name, _, root)| Some((name, host_path.strip_prefix(&root).ok()?, root)))
            .max_by_key(|(.., root)| root.components().count())
            .map(|(name, rel, _)| (name, rel))?;
        let mut guest = self.guest_mount_point(share);
        for component in rel.components() {
            guest.push('/');
            guest.push_str(component.as_os_str().to_str()?);
        }
        Some(guest)
    }

    /// Opens a guest-named file on the host with `open(2)` `flags` (mode 0666 less umask when
    /// creating), resolving it beneath its share root so no symlink leads out. Opening for write
    /// in a `ro` or `shadow` share is refused: the host never writes those on a guest's behalf.
    pub fn open_beneath(&self, guest_path: &str, flags: libc::c_int) -> Result<File, PathError> {
        let host = self.guest_to_host(guest_path)?;
        let writes = flags & libc::O_ACCMODE != libc::O_RDONLY || flags & (libc::O_CREAT | libc::O_TRUNC) != 0;
        if writes && !host.mode.host_writable() {
            return Err(PathError::ReadOnly { path: guest_path.to_owned(), mode: host.mode });
        }
        let root = beneath::open_dir(&host.root).map_err(|source| io_error(&host.root, source))?;
        beneath::open_beneath(&root, &host.relative, flags, 0o666).map_err(|source| {
            if beneath::is_escape(&source) {
                PathError::Escape(guest_path.to_owned())
            } else {
                PathError::Io { path: guest_path.to_owned(), source }
            }
        })
    }

    /// Checks that a guest-named file may be opened on the host for the user (handed to the
    /// desktop's opener) and returns the host path to open: the file's real location, symlinks
    /// resolved, beneath its share. Refused: anything [`guest_to_host`](Self::guest_to_host) or
    /// [`open_beneath`](Self::open_beneath) refuses, [`check_openable_extension`] on the guest
    /// name *and* on the resolved target (`notes.txt` → `run.sh` is a script), and anything but
    /// a regular file or directory.
    ///
    /// The opener re-resolves the returned path; a guest racing to swap a component for a
    /// symlink in between could still redirect it. Callers should show the user what is being
    /// opened, and prefer this over opening raw guest paths.
    pub fn host_open_for_user(&self, guest_path: &str) -> Result<PathBuf, PathError> {
        check_openable_extension(guest_path)?;
        // O_PATH: no read access needed, and a FIFO cannot block us.
        let file = self.open_beneath(guest_path, beneath::O_PATH)?;
        let io = |source| PathError::Io { path: guest_path.to_owned(), source };
        let kind = file.metadata().map_err(io)?.file_type();
        if !kind.is_file() && !kind.is_dir() {
            return Err(PathError::UnsupportedFileType(guest_path.to_owned()));
        }
        let resolved = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())).map_err(io)?;
        let root = self.guest_to_host(guest_path)?.root;
        if !resolved.starts_with(&root) {
            return Err(PathError::Escape(guest_path.to_owned()));
        }
        check_openable_extension(&resolved)?;
        Ok(resolved)
    }
}

/// Refuses a path whose extension is on [`BLOCKED_BINARY_EXTENSIONS`] or
/// [`BLOCKED_SCRIPT_EXTENSIONS`], case-insensitively. Trailing dots and spaces are ignored
/// (`run.SH.` is a script to some openers), and a bare `.py` counts as a `py` file.
pub fn check_openable_extension(path: impl AsRef<Path>) -> Result<(), PathError> {
    let path = path.as_ref();
    let Some(name) = path.file_name() else { return Ok(()) };
    let name = name.to_string_lossy();
    let Some((_, ext)) = name.trim_end_matches(['.', ' ']).rsplit_once('.') else { return Ok(()) };
    let ext = ext.to_ascii_lowercase();
    if BLOCKED_BINARY_EXTENSIONS.contains(&ext.as_str()) || BLOCKED_SCRIPT_EXTENSIONS.contains(&ext.as_str()) {
        return Err(PathError::BlockedExtension { path: path.to_string_lossy().into_owned(), ext });
    }
    Ok(())
}

fn check_host_root(path: &Path) -> Result<(), PathError> {
    if !path.is_absolute() || path.components().any(|c| c == Component::ParentDir) {
        return Err(PathError::NotAbsolute(path.to_string_lossy().into_owned()));
    }
    Ok(())
}

fn io_error(path: &Path, source: io::Error) -> PathError {
    PathError::Io { path: path.to_string_lossy().into_owned(), source }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::fs::symlink;

    struct Fixture {
        _tmp: tempfile::TempDir,
        project: PathBuf,
        outside: PathBuf,
        shares: SessionShares,
    }

    /// Session `s` sharing `<tmp>/project` as `project` (rw) and `<tmp>/docs` as `docs` (ro),
    /// storage in `<tmp>/storage`; `<tmp>/outside.txt` is not shared.
    fn fixture() -> Fixture {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().canonicalize().unwrap();
        let (project, docs, storage) = (base.join("project"), base.join("docs"), base.join("storage"));
        for dir in [project.join("src"), docs.clone(), storage.join(OUTPUTS), storage.join(UPLOADS)] {
            std::fs::create_dir_all(dir).unwrap();
        }
        std::fs::write(project.join("src/main.rs"), "fn main() {}").unwrap();
        std::fs::write(docs.join("readme.txt"), "docs").unwrap();
        let outside = base.join("outside.txt");
        std::fs::write(&outside, "secret").unwrap();
        let folders = vec![
            SharedFolder::new(&project, None, ShareMode::Rw).unwrap(),
            SharedFolder::new(&docs, Some("docs"), ShareMode::Ro).unwrap(),
        ];
        let shares = SessionShares::new("s", &storage, folders).unwrap();
        Fixture { _tmp: tmp, project, outside, shares }
    }

    fn read(file: File) -> String {
        let mut s = String::new();
        { file }.read_to_string(&mut s).unwrap();
        s
    }

    #[test]
    fn guest_paths_translate_to_their_share() {
        let f = fixture();
        let host = f.shares.guest_to_host("/sessions/s/mnt/project/src/main.rs").unwrap();
        assert_eq!((host.share.as_str(), host.mode), ("project", ShareMode::Rw));
        assert_eq!(host.path(), f.project.join("src/main.rs"));
        assert_eq!(f.shares.guest_to_host("/sessions/s/mnt/project").unwrap().path(), f.project);
        // Empty and `.` components are harmless and dropped.
        assert_eq!(f.shares.guest_to_host("//sessions/./s/mnt/project//src/./main.rs").unwrap(), host);
        let storage = f.shares.storage_dir().to_owned();
        let out = f.shares.guest_to_host("/sessions/s/mnt/outputs/report.pdf").unwrap();
        assert_eq!((out.share.as_str(), out.path()), (OUTPUTS, storage.join("outputs/report.pdf")));
        let up = f.shares.guest_to_host("/sessions/s/mnt/uploads/a/b.csv").unwrap();
        assert_eq!(up.path(), storage.join("uploads/a/b.csv"));
    }

    #[test]
    fn guest_path_rejections() {
        let f = fixture();
        let err = |p: &str| f.shares.guest_to_host(p).unwrap_err();
        assert!(matches!(err("/sessions/s/mnt/project/../docs/x"), PathError::Traversal(_)));
        assert!(matches!(err("/sessions/s/mnt/project/a/../../x"), PathError::Traversal(_)));
        assert!(matches!(err("/sessions/s/mnt/project/.."), PathError::Traversal(_)));
        assert!(matches!(err("/sessions/other/../s/mnt/project/x"), PathError::Traversal(_)));
        assert!(matches!(err("/sessions/other/mnt/project/x"), PathError::SessionMismatch { .. }));
        assert!(matches!(err("/sessions/s2/mnt/project/x"), PathError::SessionMismatch { .. }));
        assert!(matches!(err("/etc/passwd"), PathError::NotShared(_)));
        assert!(matches!(err("/sessions"), PathError::NotShared(_)));
        assert!(matches!(err("/sessions/s"), PathError::NotShared(_)));
        assert!(matches!(err("/sessions/s/mnt"), PathError::NotShared(_)));
        assert!(matches!(err("/sessions/s/home/x"), PathError::NotShared(_)));
        assert!(matches!(err("/sessions/s/mnt/unknown/x"), PathError::NotShared(_)));
        // Share names are exact: no case folding, no prefixes.
        assert!(matches!(err("/sessions/s/mnt/Project/x"), PathError::NotShared(_)));
        assert!(matches!(err("/sessions/s/mnt/proj/x"), PathError::NotShared(_)));
        assert!(matches!(err("/sessions/s/mnt/project\0/x"), PathError::Nul(_)));
        assert!(matches!(err("sessions/s/mnt/project/x"), PathError::NotAbsolute(_)));
        assert!(matches!(err(""), PathError::NotAbsolute(_)));
        // The message names the path.
        assert!(err("/sessions/s/mnt/unknown/x").to_string().contains("/sessions/s/mnt/unknown/x"));
    }

    #[test]
    fn percent_encoding_is_not_decoded() {
        let f = fixture();
        let host = f.shares.guest_to_host("/sessions/s/mnt/project/%2e%2e/%2e%2e/etc/passwd").unwrap();
        assert_eq!(host.path(), f.project.join("%2e%2e/%2e%2e/etc/passwd"));
        let host = f.shares.guest_to_host("/sessions/s/mnt/project/..%2f..%2fx").unwrap();
        assert_eq!(host.relative, Path::new("..%2f..%2fx"));
    }

    #[test]
    fn host_paths_translate_back() {
        let f = fixture();
        let guest = |p: &Path| f.shares.host_to_guest(p);
        assert_eq!(guest(&f.project.join("src/main.rs")).as_deref(), Some("/sessions/s/mnt/project/src/main.rs"));
        assert_eq!(guest(&f.project).as_deref(), Some("/sessions/s/mnt/project"));
        let report = f.shares.storage_dir().join("outputs/r.pdf");
        assert_eq!(guest(&report).as_deref(), Some("/sessions/s/mnt/outputs/r.pdf"));
        assert_eq!(guest(&f.outside), None);
        assert_eq!(guest(&f.project.join("../outside.txt")), None);
        assert_eq!(guest(Path::new("relative/x")), None);
        // Round trip.
        let back = f.shares.guest_to_host(&guest(&f.project.join("src/main.rs")).unwrap()).unwrap();
        assert_eq!(back.path(), f.project.join("src/main.rs"));
    }

    #[test]
    fn nested_shares_translate_to_the_most_specific() {
        let f = fixture();
        let inner = SharedFolder::new(f.project.join("src"), Some("src"), ShareMode::Ro).unwrap();
        let outer = f.shares.folders()[0].clone();
        let shares = SessionShares::new("s", f.shares.storage_dir(), vec![inner, outer]).unwrap();
        assert_eq!(shares.host_to_guest(&f.project.join("src/main.rs")).unwrap(), "/sessions/s/mnt/src/main.rs");
    }

    #[test]
    fn open_beneath_stays_in_the_share() {
        let f = fixture();
        symlink(&f.outside, f.project.join("abs_out")).unwrap();
        symlink("/etc/passwd", f.project.join("passwd")).unwrap();
        symlink("../outside.txt", f.project.join("rel_out")).unwrap();
        symlink("../../outside.txt", f.project.join("src/deep_out")).unwrap();
        symlink("src/main.rs", f.project.join("in")).unwrap();
        symlink("../src/main.rs", f.project.join("src/up_in")).unwrap();
        let open = |p: &str| f.shares.open_beneath(p, libc::O_RDONLY);
        assert_eq!(read(open("/sessions/s/mnt/project/src/main.rs").unwrap()), "fn main() {}");
        assert_eq!(read(open("/sessions/s/mnt/project/in").unwrap()), "fn main() {}");
        assert_eq!(read(open("/sessions/s/mnt/project/src/up_in").unwrap()), "fn main() {}");
        assert_eq!(read(open("/sessions/s/mnt/docs/readme.txt").unwrap()), "docs");
        for escape in ["abs_out", "passwd", "rel_out", "src/deep_out"] {
            let path = format!("/sessions/s/mnt/project/{escape}");
            assert!(matches!(open(&path), Err(PathError::Escape(p)) if p == path), "{escape}");
        }
        assert!(matches!(open("/sessions/s/mnt/project/../outside.txt"), Err(PathError::Traversal(_))));
        assert!(
            matches!(open("/sessions/s/mnt/project/missing"), Err(PathError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound)
        );
    }

    #[test]
    fn open_beneath_refuses_writes_to_ro_and_shadow_shares() {
        let f = fixture();
        let docs = "/sessions/s/mnt/docs/readme.txt";
        assert!(matches!(f.shares.open_beneath(docs, libc::O_RDWR), Err(PathError::ReadOnly { .. })));
        assert!(matches!(f.shares.open_beneath(docs, libc::O_RDONLY | libc::O_TRUNC), Err(PathError::ReadOnly { .. })));
        let created = f.shares.open_beneath("/sessions/s/mnt/outputs/new.txt", libc::O_WRONLY | libc::O_CREAT).unwrap();
        drop(created);
        assert!(f.shares.storage_dir().join("outputs/new.txt").is_file());
    }

    #[test]
    fn host_open_for_user_checks_extensions_and_targets() {
        let f = fixture();
        std::fs::write(f.project.join("notes.txt"), "hi").unwrap();
        std::fs::write(f.project.join("run.sh"), "rm -rf ~").unwrap();
        symlink("run.sh", f.project.join("innocent.txt")).unwrap();
        symlink(&f.outside, f.project.join("out.txt")).unwrap();
        let open = |p: &str| f.shares.host_open_for_user(&format!("/sessions/s/mnt/project/{p}"));
        assert_eq!(open("notes.txt").unwrap(), f.project.join("notes.txt"));
        assert_eq!(open("src").unwrap(), f.project.join("src"));
        assert!(matches!(open("run.sh"), Err(PathError::BlockedExtension { ext, .. }) if ext == "sh"));
        assert!(matches!(open("innocent.txt"), Err(PathError::BlockedExtension { ext, .. }) if ext == "sh"));
        assert!(matches!(open("out.txt"), Err(PathError::Escape(_))));
        assert!(matches!(open("../outside.txt"), Err(PathError::Traversal(_))));
    }

    #[test]
    fn blocked_extensions_are_case_insensitive() {
        for blocked in ["a.exe", "A.EXE", "setup.Msi", "x.JAR", "b.sh", "B.Sh", "c.PY", "d.applescript", "e.Workflow"] {
            assert!(matches!(check_openable_extension(blocked), Err(PathError::BlockedExtension { .. })), "{blocked}");
        }
        for blocked in ["run.sh.", "run.sh ", ".py", "dir/Thing.app", "archive.tar.jar"] {
            assert!(check_openable_extension(blocked).is_err(), "{blocked}");
        }
        for fine in ["a.txt", "a.pdf", "Makefile", "a.sh.txt", "shell", "a.json", "a.jsx", "a.binary", "dir.sh/notes"] {
            assert!(check_openable_extension(fine).is_ok(), "{fine}");
        }
        let err = check_openable_extension("/x/Run.SH").unwrap_err().to_string();
        assert!(err.contains("/x/Run.SH") && err.contains(".sh"), "{err}");
    }

    #[test]
    fn names_are_validated() {
        for ok in ["s", "local_0a1B-2.c", &"x".repeat(64)] {
            validate_session_name(ok).unwrap();
            validate_folder_name(ok).unwrap();
        }
        for bad in ["", ".", "..", "a/b", "a b", "a\0", "é", &"x".repeat(65)] {
            assert!(matches!(validate_session_name(bad), Err(PathError::InvalidName { .. })), "{bad:?}");
            assert!(matches!(validate_folder_name(bad), Err(PathError::InvalidName { .. })), "{bad:?}");
        }
        for reserved in ["outputs", "uploads", "Outputs"] {
            validate_session_name(reserved).unwrap();
            assert!(matches!(validate_folder_name(reserved), Err(PathError::ReservedName(_))));
        }
    }

    #[test]
    fn session_shares_reject_bad_configuration() {
        let f = fixture();
        let folder = f.shares.folders()[0].clone();
        let storage = f.shares.storage_dir().to_owned();
        let dup = SessionShares::new("s", &storage, vec![folder.clone(), folder.clone()]);
        assert!(matches!(dup, Err(PathError::DuplicateFolder(name)) if name == "project"));
        let reserved = SharedFolder { name: "outputs".into(), ..folder.clone() };
        assert!(matches!(SessionShares::new("s", &storage, vec![reserved]), Err(PathError::ReservedName(_))));
        assert!(matches!(SessionShares::new("../s", &storage, vec![]), Err(PathError::InvalidName { .. })));
        assert!(matches!(SessionShares::new("s", "relative", vec![]), Err(PathError::NotAbsolute(_))));
        let relative = SharedFolder { host_path: "project".into(), ..folder };
        assert!(matches!(SessionShares::new("s", &storage, vec![relative]), Err(PathError::NotAbsolute(_))));
        assert!(matches!(SharedFolder::new(f.outside.clone(), None, ShareMode::Rw), Err(PathError::NotADirectory(_))));
    }

    #[test]
    fn default_folder_names_come_from_the_basename() {
        let name = |p: &str| default_folder_name(Path::new(p));
        assert_eq!(name("/home/u/My Project").unwrap(), "My_Project");
        assert_eq!(name("/home/u/café").unwrap(), "caf__");
        assert_eq!(name(&format!("/h/{}", "y".repeat(80))).unwrap().len(), MAX_NAME_LEN);
        assert!(matches!(name("/home/u/outputs"), Err(PathError::ReservedName(_))));
        assert!(name("/").is_err());
    }

    #[test]
    fn share_modes_parse_and_serialise_lowercase() {
        for mode in [ShareMode::Ro, ShareMode::Rw, ShareMode::Rwd, ShareMode::Shadow] {
            assert_eq!(mode.as_str().parse::<ShareMode>().unwrap(), mode);
            assert_eq!(serde_json::to_string(&mode).unwrap(), format!("\"{mode}\""));
        }
        assert!("RW".parse::<ShareMode>().is_err());
        assert_eq!(serde_json::from_str::<ShareMode>("\"shadow\"").unwrap(), ShareMode::Shadow);
    }
}
