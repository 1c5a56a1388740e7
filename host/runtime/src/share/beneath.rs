//! Opening and changing paths *beneath* a trusted directory without ever leaving it.
//!
//! Everything here works relative to a directory file descriptor (a share root the host opened
//! itself), never by re-walking a path string: whoever swaps a directory for a symlink between
//! our check and our use can at worst make an operation fail, never redirect it outside the root.
//!
//! [`open_beneath`] follows symlinks only while they stay inside the root. It asks the kernel to
//! enforce that (`openat2` with `RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS`, Linux ≥ 5.6) and on
//! older kernels falls back to [`walk_beneath`], a userspace walk with the same rules: absolute
//! symlinks and `..` above the root fail with `EXDEV`, symlink loops with `ELOOP`, and every
//! component is opened with `O_NOFOLLOW` so a link swapped in mid-walk is an error, not a jump.
//!
//! The `*_at` helpers take a single name component (no `/`) and never follow a final symlink;
//! [`super::shadow`] builds its strict "no symlinks at all" walk for writes out of them.
//! [`open_strict`] is that rule for one path (`RESOLVE_NO_SYMLINKS`), and [`super::tree`]
//! walks and copies a whole guest-written tree by it.

use std::collections::VecDeque;
use std::ffi::{CStr, CString, OsStr, OsString};
use std::fs::{File, Metadata, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
#[cfg(target_os = "linux")]
use std::sync::atomic::{AtomicBool, Ordering};

/// `struct open_how` from `<linux/openat2.h>` (libc's copy is `#[non_exhaustive]`, so it cannot
/// be built outside libc):
/// ```c
/// struct open_how { __u64 flags; __u64 mode; __u64 resolve; };
/// ```
#[cfg(target_os = "linux")]
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// Linux's MAXSYMLINKS: the userspace walk gives up with `ELOOP` after this many links.
const MAX_SYMLINKS: usize = 40;
/// `RESOLVE_BENEATH` answers `EAGAIN` when a rename raced the lookup; retrying is the documented
/// remedy, a bound keeps a hostile renamer from spinning us forever.
#[cfg(target_os = "linux")]
const EAGAIN_RETRIES: usize = 16;

/// Set once `openat2` answered `ENOSYS` (pre-5.6 kernel, or a seccomp filter hiding it).
#[cfg(target_os = "linux")]
static OPENAT2_UNSUPPORTED: AtomicBool = AtomicBool::new(false);

/// Opens a name for `*at` calls and metadata only. Linux: `O_PATH` (no read access needed,
/// a FIFO cannot block). macOS has no `O_PATH`: read-only and non-blocking is the nearest,
/// and `O_SYMLINK` describes a final symlink instead of failing on it with `O_NOFOLLOW`.
#[cfg(target_os = "linux")]
pub const O_PATH: libc::c_int = libc::O_PATH;
#[cfg(not(target_os = "linux"))]
pub const O_PATH: libc::c_int = libc::O_RDONLY | libc::O_NONBLOCK;
/// `O_PATH` for an entry that may itself be a symlink, which is described, not followed.
#[cfg(target_os = "linux")]
const O_PATH_LINK: libc::c_int = libc::O_PATH | libc::O_NOFOLLOW;
#[cfg(not(target_os = "linux"))]
const O_PATH_LINK: libc::c_int = O_PATH | libc::O_SYMLINK;

/// True for the errors by which a beneath-resolution says "this path leads out of the root":
/// `EXDEV` (absolute symlink, `..` above the root, magic link) and `ELOOP` (a symlink where none
/// may be followed, or a loop).
pub fn is_escape(err: &io::Error) -> bool {
    matches!(err.raw_os_error(), Some(libc::ELOOP | libc::EXDEV))
}

/// Opens a trusted directory (a share root) to resolve paths beneath it.
pub fn open_dir(path: &Path) -> io::Result<File> {
    OpenOptions::new().read(true).custom_flags(libc::O_DIRECTORY).open(path)
}

/// Opens `rel` beneath `root` with `open(2)` `flags` (`O_CLOEXEC` is always added), following
/// only symlinks that resolve inside `root`. An empty `rel` opens `root` itself.
pub fn open_beneath(root: &File, rel: &Path, flags: libc::c_int, mode: u32) -> io::Result<File> {
    // macOS has no beneath-resolving open: the walk does it (with O_NOFOLLOW at each step).
    #[cfg(target_os = "linux")]
    if !OPENAT2_UNSUPPORTED.load(Ordering::Relaxed) {
        match openat2_beneath(root, rel, flags, mode) {
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => OPENAT2_UNSUPPORTED.store(true, Ordering::Relaxed),
            // Older container seccomp profiles answer unknown syscalls with EPERM. The walk
            // gives a genuine EPERM again, so only the cost of asking twice is at stake.
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {}
            other => return other,
        }
    }
    walk_beneath(root, rel, flags, mode)
}

#[cfg(target_os = "linux")]
fn openat2_beneath(root: &File, rel: &Path, flags: libc::c_int, mode: u32) -> io::Result<File> {
    openat2(root, rel, flags, mode, libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS)
}

/// `openat2(root, rel, {flags | O_CLOEXEC, mode, resolve})`, retried on `EAGAIN`/`EINTR`.
#[cfg(target_os = "linux")]
fn openat2(root: &File, rel: &Path, flags: libc::c_int, mode: u32, resolve: u64) -> io::Result<File> {
    let rel = if rel.as_os_str().is_empty() { Path::new(".") } else { rel };
    let path = CString::new(rel.as_os_str().as_bytes()).map_err(|_| einval())?;
    let flags = flags | libc::O_CLOEXEC;
    // openat2 rejects a mode unless the call may create a file.
    let creates = flags & libc::O_CREAT != 0 || flags & libc::O_TMPFILE == libc::O_TMPFILE;
    let how = OpenHow { flags: flags as u32 as u64, mode: if creates { u64::from(mode) } else { 0 }, resolve };
    for _ in 0..EAGAIN_RETRIES {
        // SAFETY: `path` is NUL-terminated and `how` is a fully initialised `open_how`; both
        // outlive the call, and the size passed is exactly the struct the kernel reads.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                root.as_raw_fd(),
                path.as_ptr(),
                &how as *const OpenHow,
                std::mem::size_of::<OpenHow>(),
            )
        };
        if fd >= 0 {
            // SAFETY: the kernel just handed us this descriptor; nothing else owns it.
            return Ok(unsafe { File::from_raw_fd(fd as libc::c_int) });
        }
        let err = io::Error::last_os_error();
        if !matches!(err.raw_os_error(), Some(libc::EAGAIN | libc::EINTR)) {
            return Err(err);
        }
    }
    Err(io::Error::from_raw_os_error(libc::EAGAIN))
}

/// Opens `rel` beneath `root` following no symlink at all, not even one that stays inside:
/// the strict resolution for a tree the guest writes, where a link is the guest's to swap at
/// any moment. A symlink anywhere on the way (the final component included) fails with
/// `ELOOP`, `..` and absolute paths with `EXDEV`. Kernel-enforced with `openat2`
/// (`RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`), else a walk opening each directory `O_NOFOLLOW`.
pub fn open_strict(root: &File, rel: &Path, flags: libc::c_int) -> io::Result<File> {
    #[cfg(target_os = "linux")]
    if !OPENAT2_UNSUPPORTED.load(Ordering::Relaxed) {
        let resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS;
        match openat2(root, rel, flags & !libc::O_NOFOLLOW, 0, resolve) {
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => OPENAT2_UNSUPPORTED.store(true, Ordering::Relaxed),
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {}
            other => return other,
        }
    }
    walk_strict(root, rel, flags)
}

/// The `openat2`-less fallback of [`open_strict`] (public to the module for its tests).
pub(super) fn walk_strict(root: &File, rel: &Path, flags: libc::c_int) -> io::Result<File> {
    let bytes = rel.as_os_str().as_bytes();
    if bytes.first() == Some(&b'/') {
        return Err(io::Error::from_raw_os_error(libc::EXDEV));
    }
    let names: Vec<&[u8]> = bytes.split(|&b| b == b'/').filter(|c| !c.is_empty() && *c != b".").collect();
    if names.iter().any(|n| *n == b"..") {
        return Err(io::Error::from_raw_os_error(libc::EXDEV));
    }
    let Some((last, parents)) = names.split_last() else {
        return openat(root, OsStr::new("."), flags, 0);
    };
    let mut dir: Option<File> = None;
    for name in parents {
        dir = Some(open_subdir(dir.as_ref().unwrap_or(root), OsStr::from_bytes(name))?);
    }
    let dir = dir.as_ref().unwrap_or(root);
    let file = openat(dir, OsStr::from_bytes(last), flags | libc::O_NOFOLLOW, 0)?;
    // With O_PATH, O_NOFOLLOW opens a final symlink itself instead of failing: refuse it.
    if file.metadata()?.file_type().is_symlink() {
        return Err(io::Error::from_raw_os_error(libc::ELOOP));
    }
    Ok(file)
}

/// The `openat2`-less fallback of [`open_beneath`], with the same rules (public to the module
/// so tests can exercise it on kernels that have `openat2`).
pub(super) fn walk_beneath(root: &File, rel: &Path, flags: libc::c_int, mode: u32) -> io::Result<File> {
    let mut pending = VecDeque::new();
    push_front_components(&mut pending, rel.as_os_str())?;
    // Directories entered below the root; `..` pops, and popping past the root is an escape.
    let mut dirs: Vec<File> = Vec::new();
    let mut links = 0;
    let exclusive_create = libc::O_CREAT | libc::O_EXCL;
    let follow_final = flags & libc::O_NOFOLLOW == 0 && flags & exclusive_create != exclusive_create;
    while let Some(name) = pending.pop_front() {
        if name == ".." {
            if dirs.pop().is_none() {
                return Err(io::Error::from_raw_os_error(libc::EXDEV));
            }
            continue;
        }
        let dir = dirs.last().unwrap_or(root);
        let last = pending.is_empty();
        match lstat_at(dir, &name) {
            Ok(meta) if meta.file_type().is_symlink() && (!last || follow_final) => {
                links += 1;
                if links > MAX_SYMLINKS {
                    return Err(io::Error::from_raw_os_error(libc::ELOOP));
                }
                push_front_components(&mut pending, &readlink_at(dir, &name)?)?;
                continue;
            }
            Ok(_) => {}
            // A missing final component is for the open to judge (O_CREAT may create it).
            Err(e) if last && e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        if last {
            // O_NOFOLLOW: a symlink swapped in since the lstat fails instead of being followed.
            return openat(dir, &name, flags | libc::O_NOFOLLOW, mode);
        }
        let next = openat(dir, &name, O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW, 0)?;
        dirs.push(next);
    }
    // The path named a directory: the root, or one reached through `..` or a symlink.
    openat(dirs.last().unwrap_or(root), OsStr::new("."), flags, mode)
}

/// Queues `path`'s components ahead of `pending`; an absolute path is an escape (`EXDEV`).
fn push_front_components(pending: &mut VecDeque<OsString>, path: &OsStr) -> io::Result<()> {
    let bytes = path.as_bytes();
    if bytes.first() == Some(&b'/') {
        return Err(io::Error::from_raw_os_error(libc::EXDEV));
    }
    let components = bytes.split(|&b| b == b'/').filter(|c| !c.is_empty() && *c != b".");
    for component in components.rev() {
        pending.push_front(OsStr::from_bytes(component).to_owned());
    }
    Ok(())
}

fn einval() -> io::Error {
    io::Error::from_raw_os_error(libc::EINVAL)
}

/// A single path component as a C string: `.` is allowed, `/`, NUL and the empty name are not.
fn component(name: &OsStr) -> io::Result<CString> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.contains(&b'/') {
        return Err(einval());
    }
    CString::new(bytes).map_err(|_| einval())
}

/// Retries a libc call while it fails with `EINTR`; returns its non-negative result.
fn retry<T: Copy + PartialOrd + Default>(mut call: impl FnMut() -> T) -> io::Result<T> {
    loop {
        let ret = call();
        if ret >= T::default() {
            return Ok(ret);
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINTR) {
            return Err(err);
        }
    }
}

/// `openat(dir, name, flags | O_CLOEXEC, mode)` for one component.
pub fn openat(dir: &File, name: &OsStr, flags: libc::c_int, mode: u32) -> io::Result<File> {
    let name = component(name)?;
    // SAFETY: `name` is NUL-terminated and outlives the call; `dir` is an open descriptor.
    let fd = retry(|| unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags | libc::O_CLOEXEC, mode) })?;
    // SAFETY: the kernel just handed us this descriptor; nothing else owns it.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// `lstat` of one entry of `dir` (a final symlink is described, not followed).
pub fn lstat_at(dir: &File, name: &OsStr) -> io::Result<Metadata> {
    openat(dir, name, O_PATH_LINK, 0)?.metadata()
}

/// Opens the existing directory `name` in `dir` for further `*at` calls, refusing a symlink
/// (`ELOOP`) or a non-directory (`ENOTDIR`).
pub fn open_subdir(dir: &File, name: &OsStr) -> io::Result<File> {
    openat(dir, name, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW, 0).map_err(|e| {
        // With O_DIRECTORY the kernel reports a symlink as ENOTDIR; say what it is.
        let symlink = e.raw_os_error() == Some(libc::ENOTDIR)
            && lstat_at(dir, name).is_ok_and(|meta| meta.file_type().is_symlink());
        if symlink {
            io::Error::from_raw_os_error(libc::ELOOP)
        } else {
            e
        }
    })
}

pub fn readlink_at(dir: &File, name: &OsStr) -> io::Result<OsString> {
    let name = component(name)?;
    let mut buf = vec![0u8; libc::PATH_MAX as usize];
    // SAFETY: `buf` is writable for `buf.len()` bytes and `name` is NUL-terminated; both outlive the call.
    let len =
        retry(|| unsafe { libc::readlinkat(dir.as_raw_fd(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) })?;
    buf.truncate(len as usize);
    Ok(OsString::from_vec(buf))
}

pub fn mkdir_at(dir: &File, name: &OsStr, mode: u32) -> io::Result<()> {
    let name = component(name)?;
    // SAFETY: `name` is NUL-terminated and outlives the call.
    retry(|| unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), mode as libc::mode_t) }).map(drop)
}

/// `unlinkat`; `dir_entry` selects `AT_REMOVEDIR` (which only removes an empty directory).
pub fn unlink_at(dir: &File, name: &OsStr, dir_entry: bool) -> io::Result<()> {
    let name = component(name)?;
    let flags = if dir_entry { libc::AT_REMOVEDIR } else { 0 };
    // SAFETY: `name` is NUL-terminated and outlives the call.
    retry(|| unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), flags) }).map(drop)
}

/// Renames `from` to `to` within the one directory `dir`, replacing `to` atomically.
pub fn rename_at(dir: &File, from: &OsStr, to: &OsStr) -> io::Result<()> {
    let (from, to) = (component(from)?, component(to)?);
    let fd = dir.as_raw_fd();
    // SAFETY: both names are NUL-terminated and outlive the call.
    retry(|| unsafe { libc::renameat(fd, from.as_ptr(), fd, to.as_ptr()) }).map(drop)
}

/// The names in `dir`, without `.` and `..`.
pub fn read_dir(dir: &File) -> io::Result<Vec<OsString>> {
    read_dir_at_most(dir, usize::MAX)
}

/// The names in `dir`, without `.` and `..`, stopping after `limit + 1` of them: a result
/// longer than `limit` says the directory holds more (and costs no more memory than that).
pub fn read_dir_at_most(dir: &File, limit: usize) -> io::Result<Vec<OsString>> {
    // fdopendir takes over its descriptor and moves its offset: give it a fresh one.
    let fd = openat(dir, OsStr::new("."), libc::O_RDONLY | libc::O_DIRECTORY, 0)?.into_raw_fd();
    // SAFETY: `fd` is an open directory descriptor we own; on success the stream owns it.
    let stream = unsafe { libc::fdopendir(fd) };
    if stream.is_null() {
        let err = io::Error::last_os_error();
        // SAFETY: fdopendir failed, so `fd` is still ours to close.
        unsafe { libc::close(fd) };
        return Err(err);
    }
    let stream = DirStream(stream);
    let mut names = Vec::new();
    loop {
        // readdir signals errors only through errno, so clear it first.
        clear_errno();
        // SAFETY: `stream.0` is an open DIR stream owned by `stream`.
        let entry = unsafe { libc::readdir(stream.0) };
        if entry.is_null() {
            let err = io::Error::last_os_error();
            return if err.raw_os_error() == Some(0) { Ok(names) } else { Err(err) };
        }
        // SAFETY: readdir returned a valid entry whose `d_name` is NUL-terminated; it stays
        // valid until the next readdir on this stream, and we copy it out before that.
        let name = unsafe { CStr::from_ptr((*entry).d_name.as_ptr()) }.to_bytes();
        if name != b"." && name != b".." {
            names.push(OsStr::from_bytes(name).to_owned());
            if names.len() > limit {
                return Ok(names);
            }
        }
    }
}

/// Closes a `DIR` stream (and with it its descriptor) on drop.
struct DirStream(*mut libc::DIR);

impl Drop for DirStream {
    fn drop(&mut self) {
        // SAFETY: the stream came from a successful fdopendir and is closed exactly once, here.
        unsafe { libc::closedir(self.0) };
    }
}

/// Sets this thread's `errno` to 0 (readdir reports errors only through it).
fn clear_errno() {
    // SAFETY: __errno_location (Linux) and __error (macOS) return this thread's errno slot,
    // always valid for a write.
    #[cfg(target_os = "linux")]
    unsafe {
        *libc::__errno_location() = 0
    };
    // SAFETY: as above.
    #[cfg(target_os = "macos")]
    unsafe {
        *libc::__error() = 0
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::fs::symlink;

    /// A share root with `inside.txt`, `sub/deep.txt`, and `outside.txt` next to the root.
    fn fixture() -> (tempfile::TempDir, File) {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("outside.txt"), "outside").unwrap();
        let root = tmp.path().join("root");
        std::fs::create_dir_all(root.join("sub")).unwrap();
        std::fs::write(root.join("inside.txt"), "inside").unwrap();
        std::fs::write(root.join("sub/deep.txt"), "deep").unwrap();
        symlink("/etc/passwd", root.join("abs")).unwrap();
        symlink("../outside.txt", root.join("rel_out")).unwrap();
        symlink("sub/../../outside.txt", root.join("sneaky")).unwrap();
        symlink("inside.txt", root.join("rel_in")).unwrap();
        symlink("../inside.txt", root.join("sub/up_in")).unwrap();
        symlink("sub", root.join("subdir_link")).unwrap();
        symlink("loop", root.join("loop")).unwrap();
        let dir = open_dir(&root).unwrap();
        (tmp, dir)
    }

    fn read(f: io::Result<File>) -> io::Result<String> {
        let mut s = String::new();
        f?.read_to_string(&mut s)?;
        Ok(s)
    }

    /// Both resolvers must agree on every case.
    fn check(open: fn(&File, &Path, libc::c_int, u32) -> io::Result<File>) {
        let (_tmp, root) = fixture();
        let o = |p: &str| read(open(&root, Path::new(p), libc::O_RDONLY, 0));
        assert_eq!(o("inside.txt").unwrap(), "inside");
        assert_eq!(o("sub/deep.txt").unwrap(), "deep");
        assert_eq!(o("rel_in").unwrap(), "inside");
        assert_eq!(o("sub/up_in").unwrap(), "inside");
        assert_eq!(o("subdir_link/deep.txt").unwrap(), "deep");
        assert_eq!(o("sub/../inside.txt").unwrap(), "inside");
        for escape in ["abs", "rel_out", "sneaky", "../outside.txt", "sub/../../outside.txt", "/etc/passwd", "loop"] {
            let err = o(escape).unwrap_err();
            assert!(is_escape(&err), "{escape}: {err}");
        }
        assert_eq!(o("missing").unwrap_err().kind(), io::ErrorKind::NotFound);
        // The root itself, and a directory reached through a symlink.
        assert!(open(&root, Path::new(""), libc::O_RDONLY | libc::O_DIRECTORY, 0).is_ok());
        assert!(open(&root, Path::new("subdir_link"), libc::O_RDONLY | libc::O_DIRECTORY, 0).is_ok());
        // O_NOFOLLOW refuses a final symlink even when it stays inside.
        let err = open(&root, Path::new("rel_in"), libc::O_RDONLY | libc::O_NOFOLLOW, 0).unwrap_err();
        assert!(is_escape(&err), "{err}");
        // O_CREAT through an in-share symlinked directory creates inside.
        open(&root, Path::new("subdir_link/new.txt"), libc::O_WRONLY | libc::O_CREAT, 0o600).unwrap();
        assert!(lstat_at(&open_subdir(&root, OsStr::new("sub")).unwrap(), OsStr::new("new.txt")).is_ok());
        // ...but never through one that leaves.
        let err = open(&root, Path::new("abs"), libc::O_WRONLY | libc::O_CREAT, 0o600).unwrap_err();
        assert!(is_escape(&err), "{err}");
    }

    #[test]
    fn open_beneath_follows_only_inner_symlinks() {
        check(open_beneath);
    }

    #[test]
    fn userspace_walk_matches_openat2() {
        check(walk_beneath);
    }

    /// Both strict resolvers refuse every symlink, inner ones included.
    fn check_strict(open: fn(&File, &Path, libc::c_int) -> io::Result<File>) {
        let (_tmp, root) = fixture();
        let o = |p: &str| read(open(&root, Path::new(p), libc::O_RDONLY));
        assert_eq!(o("inside.txt").unwrap(), "inside");
        assert_eq!(o("sub/deep.txt").unwrap(), "deep");
        let links = ["rel_in", "sub/up_in", "subdir_link/deep.txt", "abs", "rel_out", "sneaky", "loop"];
        for escape in links.into_iter().chain(["../outside.txt", "sub/../../outside.txt", "/etc/passwd"]) {
            let err = o(escape).unwrap_err();
            assert!(is_escape(&err), "{escape}: {err}");
        }
        // O_PATH describes a final symlink elsewhere; here it is refused all the same.
        for flags in [O_PATH, O_PATH | libc::O_NOFOLLOW] {
            let err = open(&root, Path::new("rel_in"), flags).unwrap_err();
            assert!(is_escape(&err), "{err}");
        }
        assert!(open(&root, Path::new("sub"), libc::O_RDONLY | libc::O_DIRECTORY).is_ok());
        assert!(open(&root, Path::new(""), libc::O_RDONLY | libc::O_DIRECTORY).is_ok());
        assert_eq!(o("missing").unwrap_err().kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn open_strict_follows_no_symlink_at_all() {
        check_strict(open_strict);
    }

    #[test]
    fn strict_userspace_walk_matches_openat2() {
        check_strict(walk_strict);
    }

    #[test]
    fn read_dir_at_most_stops_one_past_the_limit() {
        let (_tmp, root) = fixture();
        assert_eq!(read_dir_at_most(&root, 3).unwrap().len(), 4);
        assert_eq!(read_dir_at_most(&root, 100).unwrap().len(), 8);
    }

    #[test]
    fn helpers_refuse_multi_component_names() {
        let (_tmp, root) = fixture();
        for bad in ["sub/deep.txt", "", "a\0b"] {
            assert_eq!(
                openat(&root, OsStr::new(bad), libc::O_RDONLY, 0).unwrap_err().raw_os_error(),
                Some(libc::EINVAL)
            );
        }
        assert!(is_escape(&open_subdir(&root, OsStr::new("subdir_link")).unwrap_err()));
        let mut names = read_dir(&root).unwrap();
        names.sort();
        let expected = ["abs", "inside.txt", "loop", "rel_in", "rel_out", "sneaky", "sub", "subdir_link"];
        assert_eq!(names, expected.map(OsString::from));
    }
}
