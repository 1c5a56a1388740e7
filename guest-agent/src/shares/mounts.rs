//! The mount operations shares are made of, each with an error that says what and where.

use std::io;
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};

/// Shared folders never carry setuid programs or device nodes into the guest.
const SHARE_FLAGS: MsFlags = MsFlags::MS_NOSUID.union(MsFlags::MS_NODEV);

#[derive(Debug, thiserror::Error)]
#[error("cannot {what} {path:?}: {source}")]
pub struct MountError {
    pub what: &'static str,
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

fn failed<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(nix::Error) -> MountError + 'a {
    move |e| MountError { what, path: path.to_path_buf(), source: e.into() }
}

/// Mounts the virtio-fs tag `tag` at `target`.
pub fn virtiofs(tag: &str, target: &Path) -> Result<(), MountError> {
    mount(Some(tag), target, Some("virtiofs"), SHARE_FLAGS, None::<&str>).map_err(|e| MountError {
        what: "mount the virtio-fs tag (does the VM have its shared-folder device?) on",
        path: target.to_path_buf(),
        source: e.into(),
    })
}

/// Binds `source` at `target`, read-only if asked. A bind ignores MS_RDONLY, so read-only
/// takes a second, remounting call.
pub fn bind(source: &Path, target: &Path, read_only: bool) -> Result<(), MountError> {
    mount(Some(source), target, None::<&str>, MsFlags::MS_BIND | SHARE_FLAGS, None::<&str>)
        .map_err(failed("bind the shared folder on", target))?;
    if read_only {
        if let Err(e) = remount_bind(target, true) {
            let _ = detach(target);
            return Err(e);
        }
    }
    Ok(())
}

/// Flips a bind mount between read-only and read-write in place (processes inside keep going).
pub fn remount_bind(target: &Path, read_only: bool) -> Result<(), MountError> {
    let mut flags = MsFlags::MS_REMOUNT | MsFlags::MS_BIND | SHARE_FLAGS;
    if read_only {
        flags |= MsFlags::MS_RDONLY;
    }
    mount(None::<&str>, target, None::<&str>, flags, None::<&str>).map_err(failed("remount", target))
}

/// A private tmpfs: the writable layer of one shadow share.
pub fn tmpfs(target: &Path) -> Result<(), MountError> {
    mount(Some("tmpfs"), target, Some("tmpfs"), SHARE_FLAGS, Some("mode=0700"))
        .map_err(failed("mount a tmpfs on", target))
}

/// An overlay of `upper` over `lower`. Redirects and metacopy stay off whatever the kernel's
/// defaults: the diff then only has to understand whiteouts and opaque directories (a renamed
/// lower directory is copied and deleted, a chmod copies the whole file up).
pub fn overlay(lower: &Path, upper: &Path, work: &Path, target: &Path) -> Result<(), MountError> {
    for p in [lower, upper, work] {
        let s = p.to_string_lossy();
        if s.contains([',', ':', '\\']) || p.to_str().is_none() {
            return Err(MountError {
                what: "use as an overlay layer (a ',', ':', '\\' or non-UTF-8 byte in the path)",
                path: p.to_path_buf(),
                source: io::Error::from(io::ErrorKind::InvalidInput),
            });
        }
    }
    let opts = format!(
        "lowerdir={},upperdir={},workdir={},redirect_dir=off,metacopy=off,index=off",
        lower.display(),
        upper.display(),
        work.display()
    );
    mount(Some("overlay"), target, Some("overlay"), SHARE_FLAGS, Some(opts.as_str()))
        .map_err(failed("mount the shadow overlay on", target))
}

/// Detaches a mount even while processes still use it: they keep what they hold open, new
/// lookups no longer see it.
pub fn detach(target: &Path) -> Result<(), MountError> {
    umount2(target, MntFlags::MNT_DETACH).map_err(failed("unmount", target))
}

/// Whether something is mounted exactly at `path` (which must be canonical), by
/// /proc/self/mountinfo.
pub fn is_mount_point(path: &Path) -> io::Result<bool> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(info.lines().filter_map(|l| l.split(' ').nth(4)).any(|m| Path::new(&unescape(m)) == path))
}

/// mountinfo writes space, tab, newline and backslash in paths as `\ooo` octal escapes.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = |c: &u8| (b'0'..=b'7').contains(c);
        if b[i] == b'\\' && i + 3 < b.len() && (b'0'..=b'3').contains(&b[i + 1]) && b[i + 2..i + 4].iter().all(octal) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape(r"/a\040b\134c"), r"/a b\c");
        assert_eq!(unescape(r"/plain"), "/plain");
        assert_eq!(unescape(r"/end\04"), r"/end\04");
        assert_eq!(unescape(r"/big\777"), r"/big\777");
    }

    #[test]
    fn proc_is_a_mount_point_and_its_subdirectory_is_not() {
        assert!(is_mount_point(Path::new("/proc")).unwrap());
        assert!(!is_mount_point(Path::new("/proc/self")).unwrap());
    }
}
