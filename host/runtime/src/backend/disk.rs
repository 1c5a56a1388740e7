//! The writable session disk: a sparse file on the host, formatted ext4 with the label
//! [`SESSION_DISK_LABEL`], attached to the VM as a second virtio-blk disk. The agent finds it by
//! that label, mounts it and keeps the root overlay's upper and work directories on it, so what
//! a session installs survives a VM restart and does not live in guest RAM.
//!
//! Formatting choices (`mkfs.ext4`):
//! - the journal stays: the VM can be killed at any moment (a host kill, a guest panic, a
//!   timeout), and a journal makes the next mount replay instead of leaving a half-written
//!   filesystem behind; it costs 32 MiB of the disk's size but no host blocks until used
//!   (`lazy_journal_init`);
//! - `-E lazy_itable_init=1,lazy_journal_init=1`: nothing is zeroed, the file stays sparse. On a
//!   regular file mke2fs discards (punches) the whole range first and then marks every inode
//!   table as already zeroed, so the guest kernel has no background zeroing to do either;
//! - `-m 0`: no blocks reserved for root (everything in the guest runs as root anyway);
//! - `-e remount-ro`: a corrupted filesystem stops taking writes instead of carrying on;
//! - `-E root_owner=0:0`: mke2fs would otherwise give the root directory to whoever runs it.

use std::fs::{File, OpenOptions};
use std::io::{Error, ErrorKind};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use umbra_proto::SESSION_DISK_LABEL;

use super::VmError;

/// Creates the session disk at `path` unless it exists: a sparse file of `size_bytes` (a whole
/// number of 512-byte sectors), formatted ext4. Returns true if it created the disk, false if a
/// file was already there — which is left exactly as it is (never reformatted, never resized:
/// it holds the data of an earlier run).
///
/// The disk is formatted in a temporary file next to `path` and then linked into place, so
/// `path` is either absent or a complete filesystem, and two callers racing for the same path
/// never overwrite each other.
pub fn ensure_session_disk(path: &Path, size_bytes: u64) -> Result<bool, VmError> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => {
            return Err(VmError::Io {
                what: format!("use {} as the session disk", path.display()),
                source: Error::new(ErrorKind::InvalidInput, "it is a directory"),
            })
        }
        Ok(_) => return Ok(false),
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(VmError::Io { what: format!("inspect the session disk {}", path.display()), source: e }),
    }
    if size_bytes == 0 || size_bytes % 512 != 0 {
        return Err(VmError::Io {
            what: format!("create the session disk {}", path.display()),
            source: Error::new(
                ErrorKind::InvalidInput,
                format!("size {size_bytes} is not a positive whole number of 512-byte sectors"),
            ),
        });
    }
    let mkfs = super::host::MKFS_EXT4.require()?;
    let tmp = TempFile(temp_path(path));
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp.0)
        .map_err(|e| VmError::Io { what: format!("create {}", tmp.0.display()), source: e })?;
    file.set_len(size_bytes)
        .map_err(|e| VmError::Io { what: format!("size {} to {size_bytes} bytes", tmp.0.display()), source: e })?;
    drop(file);
    format(&mkfs, &tmp.0)?;
    // The data must be on disk before the name is: after a host crash, `path` is either
    // absent or a complete filesystem.
    File::open(&tmp.0)
        .and_then(|f| f.sync_all())
        .map_err(|e| VmError::Io { what: format!("sync {}", tmp.0.display()), source: e })?;
    // link(2), unlike rename(2), refuses to replace a disk someone else created meanwhile.
    match std::fs::hard_link(&tmp.0, path) {
        Ok(()) => {
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                let _ = File::open(dir).and_then(|d| d.sync_all());
            }
            Ok(true)
        }
        Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(VmError::Io { what: format!("move the new session disk to {}", path.display()), source: e }),
    }
}

/// Copies the session disk `src` to `dst`, a new file, keeping it sparse: only the ranges that
/// hold data are copied (SEEK_DATA/SEEK_HOLE, then copy_file_range, which shares blocks where
/// the filesystem can reflink), so a 4 GiB disk with 40 MiB written costs 40 MiB. This is how
/// each VM restored from a snapshot gets the disk the snapshot's memory expects: copy it while
/// no VM uses it. The copy goes to a temporary file linked into place, so `dst` is either
/// absent or whole. Returns the bytes of data copied.
pub fn copy_sparse(src: &Path, dst: &Path) -> Result<u64, VmError> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let failed = |source: Error| VmError::Io {
        what: format!("copy the session disk {} to {}", src.display(), dst.display()),
        source,
    };
    let from = File::open(src).map_err(failed)?;
    let len = from.metadata().map_err(failed)?.len();
    let tmp = TempFile(temp_path(dst));
    let to = OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp.0).map_err(failed)?;
    to.set_len(len).map_err(failed)?;
    let src_fd = from.as_raw_fd();
    let (mut at, mut copied) = (0i64, 0u64);
    while (at as u64) < len {
        // SAFETY: lseek on a descriptor this function owns; no memory is involved.
        let data = unsafe { libc::lseek(src_fd, at, libc::SEEK_DATA) };
        if data < 0 {
            let e = Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // no data after `at`: the rest is a hole
            }
            return Err(failed(e));
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(src_fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(failed(Error::last_os_error()));
        }
        copied += copy_range(&from, &to, data as u64, (hole - data) as u64).map_err(failed)?;
        at = hole;
    }
    to.sync_all().map_err(failed)?;
    std::fs::hard_link(&tmp.0, dst).map_err(failed)?;
    Ok(copied)
}

/// Copies `len` bytes at `off` from `from` to the same offset in `to`. On Linux this is
/// copy_file_range, which stays in the kernel and shares blocks where the filesystem can.
#[cfg(target_os = "linux")]
fn copy_range(from: &File, to: &File, off: u64, len: u64) -> Result<u64, Error> {
    use std::os::fd::AsRawFd;
    let (mut src_off, mut dst_off) = (off as i64, off as i64);
    let end = (off + len) as i64;
    while src_off < end {
        let want = (end - src_off) as usize;
        // SAFETY: both descriptors are open for the call; the offset pointers point at locals
        // that live across it, and the kernel only updates them.
        let n = unsafe { libc::copy_file_range(from.as_raw_fd(), &mut src_off, to.as_raw_fd(), &mut dst_off, want, 0) };
        match n {
            n if n > 0 => {}
            0 => return Err(Error::new(ErrorKind::UnexpectedEof, "the disk shrank while being copied")),
            _ => {
                let e = Error::last_os_error();
                if e.kind() != ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(len)
}

/// Elsewhere (macOS), positioned reads and writes through a 1 MiB buffer.
#[cfg(not(target_os = "linux"))]
fn copy_range(from: &File, to: &File, off: u64, len: u64) -> Result<u64, Error> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; 1 << 20];
    let mut at = off;
    while at < off + len {
        let want = buf.len().min((off + len - at) as usize);
        let n = from.read_at(&mut buf[..want], at)?;
        if n == 0 {
            return Err(Error::new(ErrorKind::UnexpectedEof, "the disk shrank while being copied"));
        }
        to.write_all_at(&buf[..n], at)?;
        at += n as u64;
    }
    Ok(len)
}

/// Removed on drop: the temporary disk never outlives [`ensure_session_disk`].
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// `.<name>.tmp-<pid>-<n>` in the same directory (so the final link stays on one filesystem).
fn temp_path(path: &Path) -> PathBuf {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "disk".into());
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    path.with_file_name(format!(".{name}.tmp-{}-{n}", std::process::id()))
}

fn format(mkfs: &Path, image: &Path) -> Result<(), VmError> {
    let out = Command::new(mkfs)
        .args(["-q", "-F", "-L", SESSION_DISK_LABEL, "-m", "0", "-e", "remount-ro"])
        .args(["-E", "lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0"])
        .arg(image)
        .env("LC_ALL", "C")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| VmError::Io { what: format!("run {}", mkfs.display()), source: e })?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    Err(VmError::Io {
        what: format!("format the session disk {} with {}", image.display(), mkfs.display()),
        source: Error::other(format!("{} ({}): {}", mkfs.display(), out.status, stderr.trim())),
    })
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Seek, SeekFrom, Write};
    use std::os::unix::fs::MetadataExt;

    use super::*;

    const MIB: u64 = 1024 * 1024;

    fn read_at(path: &Path, offset: u64, len: usize) -> Vec<u8> {
        let mut f = File::open(path).unwrap();
        f.seek(SeekFrom::Start(offset)).unwrap();
        let mut buf = vec![0u8; len];
        f.read_exact(&mut buf).unwrap();
        buf
    }

    #[test]
    fn creates_a_sparse_labelled_ext4_disk_once() {
        let dir = tempfile::tempdir().unwrap();
        let disk = dir.path().join("session.img");
        assert!(ensure_session_disk(&disk, 256 * MIB).unwrap(), "a new disk is created");

        let meta = std::fs::metadata(&disk).unwrap();
        assert_eq!(meta.len(), 256 * MIB);
        let allocated = meta.blocks() * 512;
        assert!(allocated < 16 * MIB, "the disk should stay sparse, but {allocated} bytes are allocated");

        // The ext4 superblock starts at byte 1024: magic at +56, volume label at +120.
        let sb = read_at(&disk, 1024, 1024);
        assert_eq!(u16::from_le_bytes([sb[56], sb[57]]), 0xEF53, "ext4 magic");
        let label = &sb[120..136];
        let end = label.iter().position(|&b| b == 0).unwrap_or(label.len());
        assert_eq!(&label[..end], SESSION_DISK_LABEL.as_bytes());

        // A second call leaves the disk (and what the guest wrote on it) alone.
        let marker_at = 200 * MIB;
        let mut f = OpenOptions::new().write(true).open(&disk).unwrap();
        f.seek(SeekFrom::Start(marker_at)).unwrap();
        f.write_all(b"umbra-marker").unwrap();
        drop(f);
        assert!(!ensure_session_disk(&disk, 512 * MIB).unwrap(), "an existing disk is kept");
        assert_eq!(read_at(&disk, marker_at, 12), b"umbra-marker");
        assert_eq!(std::fs::metadata(&disk).unwrap().len(), 256 * MIB, "not resized");

        // No temporary file is left behind.
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["session.img"]);
    }

    #[test]
    fn a_copy_keeps_the_data_and_the_holes() {
        let dir = tempfile::tempdir().unwrap();
        let (disk, copy) = (dir.path().join("session.img"), dir.path().join("fork.img"));
        assert!(ensure_session_disk(&disk, 256 * MIB).unwrap());
        let mut f = OpenOptions::new().write(true).open(&disk).unwrap();
        f.seek(SeekFrom::Start(100 * MIB)).unwrap();
        f.write_all(&vec![0xa5; 3 * MIB as usize]).unwrap();
        drop(f);

        let copied = copy_sparse(&disk, &copy).unwrap();
        assert_eq!(std::fs::read(&disk).unwrap(), std::fs::read(&copy).unwrap(), "byte for byte");
        assert!((3 * MIB..32 * MIB).contains(&copied), "only the data ranges: {copied} bytes");
        let allocated = std::fs::metadata(&copy).unwrap().blocks() * 512;
        assert!(allocated < 40 * MIB, "the copy stays sparse: {allocated} bytes allocated");

        // Never over an existing file, and nothing left behind when refused.
        let err = copy_sparse(&disk, &copy).unwrap_err().to_string();
        assert!(err.contains("fork.img") && err.contains("exists"), "{err}");
        let err = copy_sparse(&dir.path().join("missing.img"), &dir.path().join("other.img")).unwrap_err().to_string();
        assert!(err.contains("missing.img"), "{err}");
        let mut names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        names.sort();
        assert_eq!(names, ["fork.img", "session.img"]);
    }

    #[test]
    fn refuses_bad_sizes_and_directories() {
        let dir = tempfile::tempdir().unwrap();
        let disk = dir.path().join("odd.img");
        let err = ensure_session_disk(&disk, 1000).unwrap_err().to_string();
        assert!(err.contains("odd.img") && err.contains("512-byte sectors"), "{err}");
        assert!(!disk.exists());
        let err = ensure_session_disk(dir.path(), 64 * MIB).unwrap_err().to_string();
        assert!(err.contains("directory"), "{err}");
    }

    #[test]
    fn a_failing_mkfs_reports_its_stderr_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let disk = dir.path().join("session.img");
        // Far too small for ext4: mke2fs refuses and says why.
        let err = ensure_session_disk(&disk, 4096).unwrap_err().to_string();
        assert!(err.contains("format the session disk") && err.contains("mkfs.ext4"), "{err}");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert!(names.is_empty(), "left behind: {names:?}");
    }
}
