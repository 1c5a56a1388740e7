//! Shared folders: the host's folders, served over one virtio-fs tag, mounted per session.
//!
//! The host runs one virtiofsd per VM over a staging directory in which every shared folder is
//! a subdirectory (tag [`SHARES_TAG`]). On the first share the agent mounts the tag at a hidden
//! `/umbra/shares`; each share then becomes `/sessions/<session>/mnt/<name>`:
//! - `ro`: a read-only bind (the host enforces read-only too);
//! - `rw`, `rwd`: a bind; for `rw` every spawned process gets landlock rules that deny removal
//!   beneath it (see [`crate::process::landlock`]), which is why `rw` needs landlock;
//! - `shadow`: an overlay with the host folder as its lower layer and, as upper and work
//!   directories, a tmpfs of its own at `/umbra/shadow/<session>/<name>` (a tmpfs per share
//!   makes a reset one unmount, and keeps trusted.* xattrs working whatever the root is).
//!
//! The state (which share has which mode) lives here; one lock serialises changes, so two
//! requests for the same share never interleave their mounts. On the host (tests) every path
//! hangs below a configurable root instead of `/`, and the share root can be a directory the
//! test prepared instead of a virtio-fs mount.

mod diff;
mod mounts;

pub use mounts::bind;

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use umbra_proto::{ErrorCode, ShadowChange, ShareMode, MAX_SHARE_NAME, SHARES_TAG};

use crate::process::landlock::{self, LandlockError};
use crate::text::shown;
use mounts::MountError;

/// Where shares live. In a guest the root is `/`.
#[derive(Debug, Clone)]
pub struct Layout {
    root: PathBuf,
    /// A share root that is already in place (tests): no virtio-fs mount is made.
    premounted: Option<PathBuf>,
}

impl Layout {
    /// `root` and `premounted` are made absolute and symlink-free: landlock rules and the
    /// mountinfo lookup compare real paths.
    pub fn new(root: &Path, premounted: Option<&Path>) -> io::Result<Self> {
        std::fs::create_dir_all(root)?;
        Ok(Self { root: root.canonicalize()?, premounted: premounted.map(Path::canonicalize).transpose()? })
    }

    fn shares_root(&self) -> PathBuf {
        self.premounted.clone().unwrap_or_else(|| self.root.join("umbra/shares"))
    }

    fn target(&self, key: &ShareKey) -> PathBuf {
        self.root.join("sessions").join(&key.session).join("mnt").join(&key.name)
    }

    fn shadow_dir(&self, key: &ShareKey) -> PathBuf {
        self.root.join("umbra/shadow").join(&key.session).join(&key.name)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct ShareKey {
    session: String,
    name: String,
}

impl std::fmt::Display for ShareKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "share {} of session {}", self.name, self.session)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ShareError {
    #[error("{what} name {shown}: {reason}", shown = shown(name))]
    BadName { what: &'static str, name: String, reason: &'static str },
    #[error("shared folders need --root DIR when the agent is not PID 1 (it would mount over the host)")]
    Disabled,
    #[error("there is no {0}")]
    NotShared(String),
    #[error("{key} is {mode}, not shadow")]
    NotShadow { key: String, mode: ShareMode },
    #[error("{key} is {from}; changing it to {to} would {consequence}: unshare it first")]
    ModeChange { key: String, from: ShareMode, to: ShareMode, consequence: &'static str },
    #[error("the host shares no folder named {name} (no directory {path:?})")]
    NoSuchFolder { name: String, path: PathBuf },
    #[error(transparent)]
    Landlock(#[from] LandlockError),
    #[error(transparent)]
    Mount(#[from] MountError),
    #[error("cannot {what} {path:?}: {source}")]
    Io { what: &'static str, path: PathBuf, source: io::Error },
}

impl ShareError {
    /// The protocol's error code for this failure.
    pub fn code(&self) -> ErrorCode {
        match self {
            ShareError::BadName { .. } | ShareError::NotShadow { .. } | ShareError::ModeChange { .. } => {
                ErrorCode::BadRequest
            }
            ShareError::NotShared(_) | ShareError::NoSuchFolder { .. } => ErrorCode::NotFound,
            ShareError::Landlock(LandlockError::Unavailable(_)) | ShareError::Disabled => ErrorCode::Unsupported,
            ShareError::Landlock(_) | ShareError::Mount(_) | ShareError::Io { .. } => ErrorCode::Io,
        }
    }
}

fn io_failed<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> ShareError + 'a {
    move |source| ShareError::Io { what, path: path.to_path_buf(), source }
}

/// A session or share name: one path component of `[A-Za-z0-9._-]`, not `.` or `..`, at most
/// [`MAX_SHARE_NAME`] bytes.
pub fn check_name(what: &'static str, name: &str) -> Result<(), ShareError> {
    let reason = if name.is_empty() {
        "is empty"
    } else if name.len() > MAX_SHARE_NAME {
        "is longer than 64 bytes"
    } else if name == "." || name == ".." {
        "is not a name"
    } else if !name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')) {
        "may only contain A-Z, a-z, 0-9, '.', '_' and '-'"
    } else {
        return Ok(());
    };
    Err(ShareError::BadName { what, name: name.to_string(), reason })
}

fn key(session: &str, name: &str) -> Result<ShareKey, ShareError> {
    check_name("session", session)?;
    check_name("share", name)?;
    Ok(ShareKey { session: session.to_string(), name: name.to_string() })
}

/// The agent's shares.
#[derive(Debug)]
pub struct Shares {
    /// None for a host-side agent started without `--root`: it must not mount over the host.
    layout: Option<Layout>,
    /// Serialises changes (held across their mounts, which may wait on the host's virtiofsd);
    /// true once the share root is mounted.
    changing: Mutex<bool>,
    /// The mounted shares. Held only briefly, never across a mount, so a spawn (which reads
    /// it for its landlock rules) never waits on a slow share.
    modes: Mutex<BTreeMap<ShareKey, ShareMode>>,
}

impl Shares {
    pub fn new(layout: Option<Layout>) -> Self {
        Self { layout, changing: Mutex::new(false), modes: Mutex::default() }
    }

    fn layout(&self) -> Result<&Layout, ShareError> {
        self.layout.as_ref().ok_or(ShareError::Disabled)
    }

    fn mode(&self, key: &ShareKey) -> Option<ShareMode> {
        self.modes.lock().unwrap().get(key).copied()
    }

    /// Mounts a share, or changes its mode; returns where it is in the guest. Sharing again
    /// with the same mode is a no-op. Between `ro`, `rw` and `rwd` the bind is remounted in
    /// place (running processes keep the landlock rules they were spawned with); into or out of
    /// `shadow` is refused, since it would discard or expose the guest's changes.
    pub fn share(&self, session: &str, name: &str, mode: ShareMode) -> Result<PathBuf, ShareError> {
        let key = key(session, name)?;
        let layout = self.layout()?;
        if mode == ShareMode::Rw {
            // Fail now rather than at every spawn.
            landlock::abi_version()?;
        }
        let target = layout.target(&key);
        let mut root_ready = self.changing.lock().unwrap();
        if let Some(current) = self.mode(&key) {
            if current == mode {
                return Ok(target);
            }
            if current == ShareMode::Shadow || mode == ShareMode::Shadow {
                let consequence =
                    if current == ShareMode::Shadow { "discard the guest's changes" } else { "hide the folder" };
                return Err(ShareError::ModeChange { key: key.to_string(), from: current, to: mode, consequence });
            }
            if (current == ShareMode::Ro) != (mode == ShareMode::Ro) {
                mounts::remount_bind(&target, mode == ShareMode::Ro)?;
            }
            self.modes.lock().unwrap().insert(key, mode);
            return Ok(target);
        }
        let shares_root = ready_root(layout, &mut root_ready)?;
        let source = shares_root.join(&key.name);
        if !std::fs::symlink_metadata(&source).is_ok_and(|m| m.is_dir()) {
            return Err(ShareError::NoSuchFolder { name: key.name, path: source });
        }
        std::fs::create_dir_all(&target).map_err(io_failed("create the mount point", &target))?;
        match mode {
            ShareMode::Ro | ShareMode::Rw | ShareMode::Rwd => mounts::bind(&source, &target, mode == ShareMode::Ro)?,
            ShareMode::Shadow => mount_shadow(&layout.shadow_dir(&key), &source, &target)?,
        }
        self.modes.lock().unwrap().insert(key, mode);
        Ok(target)
    }

    pub fn unshare(&self, session: &str, name: &str) -> Result<(), ShareError> {
        let key = key(session, name)?;
        let layout = self.layout()?;
        let _changing = self.changing.lock().unwrap();
        let Some(mode) = self.mode(&key) else { return Err(ShareError::NotShared(key.to_string())) };
        let target = layout.target(&key);
        mounts::detach(&target)?;
        self.modes.lock().unwrap().remove(&key);
        // Best effort: a process may have created something next to the mount point.
        let _ = std::fs::remove_dir(&target);
        if mode == ShareMode::Shadow {
            let shadow = layout.shadow_dir(&key);
            mounts::detach(&shadow)?;
            let _ = std::fs::remove_dir(&shadow);
        }
        Ok(())
    }

    /// The changes of a shadow share relative to the host folder, and whether the list is cut.
    /// The walk takes no lock: it may be long, and it only reads.
    pub fn shadow_diff(&self, session: &str, name: &str) -> Result<(Vec<ShadowChange>, bool), ShareError> {
        let key = key(session, name)?;
        let layout = self.layout()?;
        self.expect_shadow(&key)?;
        let lower = layout.shares_root().join(&key.name);
        let upper = layout.shadow_dir(&key).join("upper");
        diff::shadow_changes(&lower, &upper).map_err(io_failed("walk the shadow changes in", &upper))
    }

    /// Discards a shadow share's changes: the overlay and its tmpfs are detached (processes
    /// inside keep their old view until they look the path up again) and mounted afresh.
    pub fn shadow_reset(&self, session: &str, name: &str) -> Result<(), ShareError> {
        let key = key(session, name)?;
        let layout = self.layout()?;
        let _changing = self.changing.lock().unwrap();
        self.expect_shadow(&key)?;
        let (target, shadow) = (layout.target(&key), layout.shadow_dir(&key));
        mounts::detach(&target)?;
        mounts::detach(&shadow)?;
        mount_shadow(&shadow, &layout.shares_root().join(&key.name), &target)
    }

    /// Directories beneath which spawned processes may not remove anything: every `rw` share,
    /// and the share root it is also reachable through. Empty without `rw` shares.
    pub fn protected_paths(&self) -> Vec<PathBuf> {
        let Some(layout) = &self.layout else { return Vec::new() };
        let modes = self.modes.lock().unwrap();
        let rw: Vec<PathBuf> =
            modes.iter().filter(|(_, &m)| m == ShareMode::Rw).map(|(k, _)| layout.target(k)).collect();
        if rw.is_empty() {
            return rw;
        }
        let mut protected = vec![layout.shares_root()];
        protected.extend(rw);
        protected
    }

    fn expect_shadow(&self, key: &ShareKey) -> Result<(), ShareError> {
        match self.mode(key) {
            None => Err(ShareError::NotShared(key.to_string())),
            Some(ShareMode::Shadow) => Ok(()),
            Some(mode) => Err(ShareError::NotShadow { key: key.to_string(), mode }),
        }
    }
}

/// The share root, mounting the virtio-fs tag there first if nothing is mounted yet.
fn ready_root(layout: &Layout, ready: &mut bool) -> Result<PathBuf, ShareError> {
    let root = layout.shares_root();
    if *ready {
        return Ok(root);
    }
    if layout.premounted.is_none() {
        std::fs::create_dir_all(&root).map_err(io_failed("create the share root", &root))?;
        let mounted = mounts::is_mount_point(&root).map_err(io_failed("read the mount table for", &root))?;
        if !mounted {
            mounts::virtiofs(SHARES_TAG, &root)?;
        }
    } else if !root.is_dir() {
        return Err(io_failed("use as the share root", &root)(io::ErrorKind::NotFound.into()));
    }
    *ready = true;
    Ok(root)
}

/// A fresh tmpfs at `shadow` holding `upper` and `work`, and the overlay of `upper` over
/// `source` at `target`.
fn mount_shadow(shadow: &Path, source: &Path, target: &Path) -> Result<(), ShareError> {
    std::fs::create_dir_all(shadow).map_err(io_failed("create", shadow))?;
    mounts::tmpfs(shadow)?;
    let (upper, work) = (shadow.join("upper"), shadow.join("work"));
    let made = std::fs::create_dir(&upper)
        .and_then(|_| std::fs::create_dir(&work))
        .map_err(io_failed("create the overlay's layers in", shadow))
        .and_then(|_| Ok(mounts::overlay(source, &upper, &work, target)?));
    if made.is_err() {
        let _ = mounts::detach(shadow);
    }
    made
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_single_plain_components() {
        for ok in ["src", "my-project_2.0", "a", &"x".repeat(64), "..."] {
            assert!(check_name("share", ok).is_ok(), "{ok}");
        }
        for bad in ["", ".", "..", "a/b", "/abs", "sp ace", "ü", "a\0b", &"x".repeat(65), "x\n"] {
            let e = check_name("share", bad).unwrap_err();
            assert_eq!(e.code(), ErrorCode::BadRequest, "{bad:?}");
        }
        let e = check_name("session", &"é".repeat(1000)).unwrap_err().to_string();
        assert!(e.starts_with("session name") && e.len() < 1000, "{e}");
    }

    #[test]
    fn unknown_shares_are_not_found_and_nothing_is_protected_without_rw() {
        let dir = std::env::temp_dir().join(format!("umbra-shares-{}", std::process::id()));
        let shares = Shares::new(Some(Layout::new(&dir.join("root"), None).unwrap()));
        assert_eq!(shares.unshare("s", "x").unwrap_err().code(), ErrorCode::NotFound);
        assert_eq!(shares.shadow_diff("s", "x").unwrap_err().code(), ErrorCode::NotFound);
        assert_eq!(shares.shadow_reset("s", "../x").unwrap_err().code(), ErrorCode::BadRequest);
        assert!(shares.protected_paths().is_empty());
        let _ = std::fs::remove_dir_all(&dir);
        let host = Shares::new(None);
        assert_eq!(host.share("s", "x", ShareMode::Ro).unwrap_err().code(), ErrorCode::Unsupported);
    }
}
