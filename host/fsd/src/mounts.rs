//! Mounts made by descriptor, never by a path a guest could have changed.
//!
//! A shared folder is opened once with no symbolic link followed anywhere in its path
//! (`openat2` with `RESOLVE_NO_SYMLINKS`), its identity (device, inode) is checked against the
//! one recorded when it was first shared, and the mount is cloned from that descriptor
//! (`open_tree(OPEN_TREE_CLONE)`), given its flags while still detached (`mount_setattr`), and
//! attached with `move_mount`. Nothing between the check and the mount resolves a path again,
//! so a guest that swaps a directory for a symlink — through another share, or while the VM
//! was stopped — gets a refusal naming the folder, never a mount of what the link points to.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

pub use umbra_sys::FolderIdentity as Identity;

fn cstring(path: &Path) -> Result<CString, String> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| format!("{} has a NUL byte", path.display()))
}

fn last_error() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// `struct open_how` (libc's is non-exhaustive, so it cannot be built here).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// Opens directory `path` beneath `dir` (or absolute, from the root, when `dir` is `None`)
/// as an `O_PATH` descriptor, following no symbolic link in any component.
pub fn open_dir_nofollow(dir: Option<&OwnedFd>, path: &Path) -> Result<OwnedFd, std::io::Error> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "a NUL byte in the path"))?;
    let mut resolve = libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
    if dir.is_some() {
        resolve |= libc::RESOLVE_BENEATH;
    }
    let how = OpenHow { flags: (libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) as u64, mode: 0, resolve };
    let dirfd = dir.map_or(libc::AT_FDCWD, |d| d.as_raw_fd());
    // SAFETY: `c` is NUL-terminated and `how` is a valid open_how of the size passed; both
    // outlive the call, which only reads them.
    let fd = unsafe {
        libc::syscall(libc::SYS_openat2, dirfd, c.as_ptr(), &how as *const OpenHow, std::mem::size_of::<OpenHow>())
    };
    if fd < 0 {
        return Err(last_error());
    }
    // SAFETY: openat2 returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The identity of what `fd` refers to.
pub fn identity(fd: &OwnedFd) -> Result<Identity, std::io::Error> {
    // SAFETY: fstat writes into the zeroed stat it is given, which outlives the call.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above; `fd` is a valid descriptor.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(last_error());
    }
    Ok(Identity { dev: st.st_dev, ino: st.st_ino })
}

/// Opens folder `source` (an absolute path without symbolic links, as the runtime recorded it)
/// and checks it is still the folder `expected` names.
pub fn open_folder(source: &Path, expected: Option<Identity>) -> Result<(OwnedFd, Identity), String> {
    if !source.is_absolute() {
        return Err(format!("{} is not an absolute path", source.display()));
    }
    let fd = open_dir_nofollow(None, source).map_err(|e| match e.raw_os_error() {
        Some(libc::ELOOP) => format!(
            "{} has a symbolic link in its path: a shared folder is opened without following links \
             (was the folder replaced by a link?)",
            source.display()
        ),
        Some(libc::ENOTDIR) => format!("{} is not a directory", source.display()),
        _ => format!("{}: {e}", source.display()),
    })?;
    let found = identity(&fd).map_err(|e| format!("stat {}: {e}", source.display()))?;
    if let Some(expected) = expected {
        if expected != found {
            return Err(format!(
                "{} is no longer the folder that was shared (device:inode {}:{} then, {}:{} now): \
                 refusing to share what replaced it",
                source.display(),
                expected.dev,
                expected.ino,
                found.dev,
                found.ino
            ));
        }
    }
    Ok((fd, found))
}

/// `struct mount_attr` from `<linux/mount.h>`.
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// Clones the directory `from` refers to (that directory only, not mounts beneath it) as a
/// detached private mount, `nosuid,nodev` and read-only if asked, and attaches it over `onto` (a
/// directory descriptor) — or at `onto_path` when `onto` is `None`. Returns a descriptor of
/// the new mount's root, through which it can be unmounted later.
pub fn attach(from: &OwnedFd, onto: Option<&OwnedFd>, onto_path: &Path, read_only: bool) -> Result<OwnedFd, String> {
    let empty = c"";
    // SAFETY: `from` is a valid descriptor and `empty` a NUL-terminated string; open_tree only
    // reads them and returns a new descriptor or -1.
    let tree = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            from.as_raw_fd(),
            empty.as_ptr(),
            libc::OPEN_TREE_CLONE | libc::OPEN_TREE_CLOEXEC | libc::AT_EMPTY_PATH as libc::c_uint,
        )
    };
    if tree < 0 {
        return Err(format!("clone the mount of {}: {}", onto_path.display(), last_error()));
    }
    // SAFETY: open_tree returned a new descriptor that nothing else owns.
    let tree = unsafe { OwnedFd::from_raw_fd(tree as i32) };
    let mut set = libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV;
    if read_only {
        set |= libc::MOUNT_ATTR_RDONLY;
    }
    // Private: this namespace is a slave of the host's (`namespace.rs`), and a clone of a slave
    // mount would be a slave too — a mount the host made beneath the folder later would then
    // appear in the share with its own flags (writable in a read-only share).
    let attr = MountAttr { attr_set: set, attr_clr: 0, propagation: libc::MS_PRIVATE, userns_fd: 0 };
    // SAFETY: `tree` is valid, `empty` NUL-terminated, `attr` a mount_attr of the size passed;
    // the kernel only reads them.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if r != 0 {
        return Err(format!("set the flags of {}: {}", onto_path.display(), last_error()));
    }
    let target = cstring(onto_path)?;
    let (to_fd, to_path, flags) = match onto {
        Some(dir) => (dir.as_raw_fd(), empty.as_ptr(), libc::MOVE_MOUNT_F_EMPTY_PATH | libc::MOVE_MOUNT_T_EMPTY_PATH),
        None => (libc::AT_FDCWD, target.as_ptr(), libc::MOVE_MOUNT_F_EMPTY_PATH),
    };
    // SAFETY: both descriptors are valid and both paths NUL-terminated; move_mount only reads
    // them.
    let r = unsafe { libc::syscall(libc::SYS_move_mount, tree.as_raw_fd(), empty.as_ptr(), to_fd, to_path, flags) };
    if r != 0 {
        return Err(format!("mount {}: {}", onto_path.display(), last_error()));
    }
    Ok(tree)
}
