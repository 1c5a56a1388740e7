//! Landlock rules that keep spawned processes from deleting inside `rw` shares.
//!
//! Landlock is an allow-list: a ruleset names the access rights it *handles*, and a sandboxed
//! process keeps a handled right only beneath the directories a rule grants it on. We handle
//! only removal (`REMOVE_FILE`, `REMOVE_DIR`) and, where the kernel knows it (ABI ≥ 2),
//! reparenting (`REFER`), so that a file cannot be renamed out of a share either. Everything
//! else (reading, writing, creating, truncating) stays unrestricted.
//!
//! To allow removal everywhere *except* beneath the protected directories, the rules grant the
//! handled rights on every sibling subtree along each protected path: the entries of `/` except
//! the one leading to a protected path, the entries of that one except the next, and so on,
//! down to the protected directories themselves, which get nothing. Consequences, documented in
//! `docs/protocol.md`:
//! - removing or renaming an entry *directly in* an ancestor directory (a file in `/`, a
//!   session directory in `/sessions`) is denied: the right belongs to the parent;
//! - a directory created at those levels after the spawn is not covered (also denied);
//! - renaming within an `rw` share is denied too: a rename removes the old name.
//!
//! The ruleset is built before the fork (it allocates and opens files); the child only calls
//! `landlock_restrict_self` (and, if it lacks CAP_SYS_ADMIN, `prctl(PR_SET_NO_NEW_PRIVS)`),
//! both async-signal-safe syscalls. A sandboxed process cannot mount or unmount either (the
//! kernel denies changes to the mount topology of a landlocked process), so it cannot remount
//! its way out; its descendants inherit the domain.

use std::collections::BTreeSet;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

const ACCESS_FS_REMOVE_DIR: u64 = 1 << 4;
const ACCESS_FS_REMOVE_FILE: u64 = 1 << 5;
/// ABI 2 (Linux 5.19).
const ACCESS_FS_REFER: u64 = 1 << 13;
const CREATE_RULESET_VERSION: u32 = 1 << 0;
const RULE_PATH_BENEATH: libc::c_int = 1;

/// `struct landlock_ruleset_attr`, first field only: later fields (net, scopes) are newer than
/// the guest kernel, and the kernel accepts a shorter struct from an older caller.
#[repr(C)]
struct RulesetAttr {
    handled_access_fs: u64,
}

/// `struct landlock_path_beneath_attr` (packed in the UAPI header):
/// `{ __u64 allowed_access; __s32 parent_fd; } __attribute__((packed))`.
#[repr(C, packed)]
struct PathBeneathAttr {
    allowed_access: u64,
    parent_fd: i32,
}

#[derive(Debug, thiserror::Error)]
pub enum LandlockError {
    #[error(
        "this kernel has no landlock ({0}), which an rw share needs to deny deletions; \
         share the folder as rwd or ro, or boot a kernel with CONFIG_SECURITY_LANDLOCK and landlock in CONFIG_LSM"
    )]
    Unavailable(io::Error),
    #[error("cannot build the landlock ruleset: {what} {path:?}: {source}")]
    Rule { what: &'static str, path: PathBuf, source: io::Error },
}

/// The landlock ABI version of the running kernel, or why there is none (ENOSYS: not built
/// in; EOPNOTSUPP: built in but not enabled at boot).
pub fn abi_version() -> Result<u32, LandlockError> {
    // SAFETY: with a null attr, size 0 and the VERSION flag, the syscall reads no memory.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<RulesetAttr>(),
            0usize,
            CREATE_RULESET_VERSION,
        )
    };
    if rc < 0 {
        return Err(LandlockError::Unavailable(io::Error::last_os_error()));
    }
    Ok(rc as u32)
}

/// A ruleset ready to be applied in a child between fork and exec.
#[derive(Debug)]
pub struct Ruleset {
    fd: OwnedFd,
}

impl Ruleset {
    /// Restricts the calling process. Called between fork and exec: only syscalls, no heap.
    /// A child that still has CAP_SYS_ADMIN (root) may restrict itself without
    /// `no_new_privs`, which keeps setuid programs usable; any other needs it set first.
    pub fn restrict_self(fd: RawFd) -> io::Result<()> {
        // SAFETY: plain syscalls with integer arguments.
        unsafe {
            if libc::syscall(libc::SYS_landlock_restrict_self, fd, 0u32) == 0 {
                return Ok(());
            }
            // Reading errno into an io::Error allocates nothing.
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EPERM) {
                return Err(e);
            }
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::syscall(libc::SYS_landlock_restrict_self, fd, 0u32) != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }

    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// A ruleset that denies removal (and, from ABI 2, reparenting) beneath every directory of
/// `protected` and allows it everywhere else; `None` when nothing is protected. The paths must
/// be absolute and free of symlinks (landlock acts on the real hierarchy).
pub fn deny_removal_beneath(protected: &[PathBuf]) -> Result<Option<Ruleset>, LandlockError> {
    if protected.is_empty() {
        return Ok(None);
    }
    let abi = abi_version()?;
    let handled = ACCESS_FS_REMOVE_DIR | ACCESS_FS_REMOVE_FILE | if abi >= 2 { ACCESS_FS_REFER } else { 0 };
    let attr = RulesetAttr { handled_access_fs: handled };
    // SAFETY: `attr` is a valid ruleset_attr of the size passed, alive for the call.
    let fd = unsafe {
        libc::syscall(libc::SYS_landlock_create_ruleset, &attr as *const RulesetAttr, size_of::<RulesetAttr>(), 0u32)
    };
    if fd < 0 {
        return Err(LandlockError::Unavailable(io::Error::last_os_error()));
    }
    // SAFETY: the syscall returned a new fd (O_CLOEXEC) that nobody else owns.
    let ruleset = Ruleset { fd: unsafe { OwnedFd::from_raw_fd(fd as RawFd) } };
    for dir in granted_dirs(protected)? {
        add_rule(&ruleset, &dir, handled)?;
    }
    Ok(Some(ruleset))
}

/// The sibling subtrees along each protected path: entries of every ancestor directory that
/// are neither protected nor themselves ancestors of a protected path.
fn granted_dirs(protected: &[PathBuf]) -> Result<Vec<PathBuf>, LandlockError> {
    let is_protected = |p: &Path| protected.iter().any(|q| p.starts_with(q));
    let ancestors: BTreeSet<&Path> =
        protected.iter().flat_map(|p| p.ancestors().skip(1)).filter(|a| !is_protected(a)).collect();
    let mut granted = Vec::new();
    for dir in &ancestors {
        let entries = std::fs::read_dir(dir).map_err(|source| LandlockError::Rule {
            what: "cannot list",
            path: dir.to_path_buf(),
            source,
        })?;
        for entry in entries.flatten() {
            let path = entry.path();
            if !ancestors.contains(path.as_path()) && !is_protected(&path) {
                granted.push(path);
            }
        }
    }
    Ok(granted)
}

/// Grants `access` beneath `dir`. Entries that are no (longer) directories — files, symlinks
/// (never followed: their targets are covered where they live) — are skipped: a rule on them
/// could not carry directory rights.
fn add_rule(ruleset: &Ruleset, dir: &Path, access: u64) -> Result<(), LandlockError> {
    let rule_error = |what, source| LandlockError::Rule { what, path: dir.to_path_buf(), source };
    let c_path = CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| rule_error("NUL in", io::Error::from(io::ErrorKind::InvalidInput)))?;
    let flags = libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: `c_path` is a valid NUL-terminated string for the call.
    let fd = unsafe { libc::open(c_path.as_ptr(), flags) };
    if fd < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENOTDIR | libc::ELOOP | libc::ENOENT | libc::EACCES) => Ok(()),
            _ => Err(rule_error("cannot open", e)),
        };
    }
    // SAFETY: open returned a new fd owned by nobody else.
    let parent = unsafe { OwnedFd::from_raw_fd(fd) };
    let attr = PathBeneathAttr { allowed_access: access, parent_fd: parent.as_raw_fd() };
    // SAFETY: `attr` is a valid path_beneath_attr alive for the call; the fds are open.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_landlock_add_rule,
            ruleset.raw_fd(),
            RULE_PATH_BENEATH,
            &attr as *const PathBeneathAttr,
            0u32,
        )
    };
    if rc != 0 {
        return Err(rule_error("cannot add a rule for", io::Error::last_os_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_every_sibling_along_the_protected_paths_and_nothing_beneath_them() {
        let d = std::env::temp_dir().join(format!("umbra-landlock-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        for sub in ["s/mnt/rw1/inner", "s/mnt/rw2", "s/mnt/ro", "s/other", "t", "u/v"] {
            std::fs::create_dir_all(d.join(sub)).unwrap();
        }
        std::fs::write(d.join("s/file"), b"").unwrap();
        let protected = vec![d.join("s/mnt/rw1"), d.join("s/mnt/rw2")];
        let granted = granted_dirs(&protected).unwrap();
        let has = |p: &str| granted.contains(&d.join(p));
        assert!(has("t") && has("u") && has("s/other") && has("s/mnt/ro") && has("s/file"));
        assert!(!has("s") && !has("s/mnt") && !has("s/mnt/rw1") && !has("s/mnt/rw1/inner") && !has("u/v"));
        assert!(granted.iter().all(|p| !p.starts_with(d.join("s/mnt/rw1"))));
        // `/` is an ancestor of everything: its entries (but not the way down) are granted.
        assert!(granted.contains(&PathBuf::from("/proc")));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn nothing_protected_means_no_ruleset() {
        assert!(deny_removal_beneath(&[]).unwrap().is_none());
    }
}
