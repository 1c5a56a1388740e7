//! File requests: read, write, stat, list — each bounded in size and with errors that name the
//! path. Blocking filesystem calls; the connection runs them on tokio's blocking pool.

use std::fs::{self, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use nix::fcntl::{fcntl, FcntlArg, OFlag};
use umbra_proto::{
    DirEntry, ErrorBody, ErrorCode, FileKind, FileStat, WriteFileRequest, WriteMode, MAX_BODY_LEN, MAX_FILE_CHUNK,
};

use crate::text::shown;

const DEFAULT_LIST_LIMIT: u32 = 10_000;
const MAX_LIST_LIMIT: u32 = 100_000;
/// Encoded bytes the entries of one listing may take: whatever the names, the response must
/// fit in one frame, with room to spare for its envelope.
const LIST_BUDGET: usize = MAX_BODY_LEN - 64 * 1024;

fn absolute(path: &str) -> Result<&Path, ErrorBody> {
    let p = Path::new(path);
    if !p.is_absolute() {
        return Err(ErrorBody::new(ErrorCode::BadRequest, format!("path {} is not absolute", shown(path))));
    }
    Ok(p)
}

pub fn io_error(what: &str, path: &str, e: io::Error) -> ErrorBody {
    let code = match e.kind() {
        io::ErrorKind::NotFound => ErrorCode::NotFound,
        io::ErrorKind::PermissionDenied => ErrorCode::PermissionDenied,
        _ => ErrorCode::Io,
    };
    ErrorBody::new(code, format!("{what} {}: {e}", shown(path)))
}

fn not_regular(path: &str, what: &str) -> ErrorBody {
    ErrorBody::new(
        ErrorCode::BadRequest,
        format!("{} is {what}, not a regular file; only regular files can be read or written", shown(path)),
    )
}

/// Opens `p` for a file request. Only regular files qualify: opening a FIFO blocks until its
/// other end shows up (forever, for a request), and devices are no files to copy. So the open
/// itself does not block (O_NONBLOCK) nor adopt a terminal (O_NOCTTY), and fstat decides.
fn open_regular(opts: &mut OpenOptions, path: &str, p: &Path) -> Result<(fs::File, fs::Metadata), ErrorBody> {
    let f = opts.custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY).open(p).map_err(|e| match e.raw_os_error() {
        // A FIFO without a reader refuses a non-blocking writer; so does a device without a device.
        Some(libc::ENXIO) => not_regular(path, "a FIFO or device"),
        _ => io_error("cannot open", path, e),
    })?;
    let md = f.metadata().map_err(|e| io_error("cannot stat", path, e))?;
    let ft = md.file_type();
    if !ft.is_file() {
        let what = if ft.is_dir() {
            "a directory"
        } else if ft.is_fifo() {
            "a FIFO"
        } else if ft.is_socket() {
            "a socket"
        } else {
            "a device"
        };
        return Err(not_regular(path, what));
    }
    // Regular files ignore O_NONBLOCK; clear it anyway so it does not linger on the description.
    let cleared = fcntl(&f, FcntlArg::F_GETFL)
        .and_then(|flags| fcntl(&f, FcntlArg::F_SETFL(OFlag::from_bits_truncate(flags) - OFlag::O_NONBLOCK)));
    cleared.map_err(|e| io_error("cannot configure", path, e.into()))?;
    Ok((f, md))
}

/// Reads up to `len` bytes at `offset`; returns the bytes and whether the end of file was reached.
pub fn read(path: &str, offset: u64, len: u32) -> Result<(Vec<u8>, bool), ErrorBody> {
    if len as usize > MAX_FILE_CHUNK {
        return Err(ErrorBody::new(
            ErrorCode::TooLarge,
            format!("read of {len} bytes exceeds the {MAX_FILE_CHUNK}-byte limit per request; read in chunks"),
        ));
    }
    let p = absolute(path)?;
    let (mut f, md) = open_regular(OpenOptions::new().read(true), path, p)?;
    let size = md.len();
    f.seek(SeekFrom::Start(offset)).map_err(|e| io_error("cannot seek in", path, e))?;
    let mut buf = Vec::with_capacity((len as u64).min(size.saturating_sub(offset)) as usize);
    f.take(len as u64).read_to_end(&mut buf).map_err(|e| io_error("cannot read", path, e))?;
    let eof = offset + buf.len() as u64 >= size;
    Ok((buf, eof))
}

pub fn write(req: &WriteFileRequest, data: &[u8]) -> Result<u64, ErrorBody> {
    if data.len() > MAX_FILE_CHUNK {
        return Err(ErrorBody::new(
            ErrorCode::TooLarge,
            format!("write of {} bytes exceeds the {MAX_FILE_CHUNK}-byte limit per request", data.len()),
        ));
    }
    let path = req.path.as_str();
    let p = absolute(path)?;
    if req.create_dirs {
        if let Some(parent) = p.parent() {
            fs::create_dir_all(parent).map_err(|e| io_error("cannot create parent of", path, e))?;
        }
    }
    let mut opts = OpenOptions::new();
    opts.write(true).create(true).mode(req.permissions.unwrap_or(0o644));
    match req.mode {
        WriteMode::Truncate => opts.truncate(true),
        WriteMode::Append => opts.append(true),
        WriteMode::At(_) => &mut opts,
    };
    let (mut f, _) = open_regular(&mut opts, path, p)?;
    if let WriteMode::At(off) = req.mode {
        f.seek(SeekFrom::Start(off)).map_err(|e| io_error("cannot seek in", path, e))?;
    }
    f.write_all(data).map_err(|e| io_error("cannot write", path, e))?;
    Ok(data.len() as u64)
}

/// Stats without following a final symlink, so a caller sees links as links.
pub fn stat(path: &str) -> Result<FileStat, ErrorBody> {
    let md = fs::symlink_metadata(absolute(path)?).map_err(|e| io_error("cannot stat", path, e))?;
    Ok(FileStat {
        kind: FileKind::from(md.file_type()),
        size: md.len(),
        mode: md.mode(),
        uid: md.uid(),
        gid: md.gid(),
        mtime_ms: mtime_ms(md.mtime(), md.mtime_nsec()),
    })
}

/// Saturates: a file may carry any timestamp, and seconds × 1000 overflows near the extremes.
fn mtime_ms(secs: i64, nsec: i64) -> i64 {
    secs.saturating_mul(1000).saturating_add(nsec / 1_000_000)
}

/// Lists at most `limit` entries, sorted by name; `truncated` says whether more exist. The
/// listing also stops when its encoding would outgrow one response frame.
pub fn list(path: &str, limit: Option<u32>) -> Result<(Vec<DirEntry>, bool), ErrorBody> {
    list_within(path, limit, LIST_BUDGET)
}

fn list_within(path: &str, limit: Option<u32>, budget: usize) -> Result<(Vec<DirEntry>, bool), ErrorBody> {
    let limit = limit.unwrap_or(DEFAULT_LIST_LIMIT).min(MAX_LIST_LIMIT) as usize;
    let rd = fs::read_dir(absolute(path)?).map_err(|e| io_error("cannot list", path, e))?;
    let mut entries = Vec::new();
    let mut truncated = false;
    let mut encoded = 0;
    for entry in rd {
        let entry = entry.map_err(|e| io_error("cannot list", path, e))?;
        if entries.len() == limit {
            truncated = true;
            break;
        }
        let md = entry.metadata().ok();
        let entry = DirEntry {
            name: entry.file_name().to_string_lossy().into_owned(),
            kind: md.as_ref().map_or(FileKind::Other, |m| FileKind::from(m.file_type())),
            size: md.map_or(0, |m| m.len()),
        };
        // Its JSON plus the separating comma; names escape to up to 6 bytes per byte.
        encoded += serde_json::to_vec(&entry).expect("protocol types serialize").len() + 1;
        if encoded > budget {
            truncated = true;
            break;
        }
        entries.push(entry);
    }
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((entries, truncated))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp() -> std::path::PathBuf {
        let d =
            std::env::temp_dir().join(format!("umbra-files-{}-{:?}", std::process::id(), std::thread::current().id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn write_read_append_and_offsets() {
        let d = tmp();
        let p = d.join("sub/f.bin");
        let path = p.to_str().unwrap();
        let req = |mode| WriteFileRequest { path: path.into(), mode, permissions: None, create_dirs: true };
        write(&req(WriteMode::Truncate), b"hello").unwrap();
        write(&req(WriteMode::Append), b" world").unwrap();
        write(&req(WriteMode::At(0)), b"J").unwrap();
        assert_eq!(read(path, 0, 100).unwrap(), (b"Jello world".to_vec(), true));
        assert_eq!(read(path, 6, 3).unwrap(), (b"wor".to_vec(), false));
        assert_eq!(stat(path).unwrap().size, 11);
        let (entries, truncated) = list(d.join("sub").to_str().unwrap(), None).unwrap();
        assert_eq!((entries.len(), truncated, entries[0].name.as_str()), (1, false, "f.bin"));
    }

    #[test]
    fn errors_name_the_path_and_bounds_hold() {
        let e = read("/nonexistent/x", 0, 1).unwrap_err();
        assert_eq!(e.code, ErrorCode::NotFound);
        assert!(e.message.contains("/nonexistent/x"), "{}", e.message);
        assert_eq!(read("relative", 0, 1).unwrap_err().code, ErrorCode::BadRequest);
        assert_eq!(read("/etc/hostname", 0, u32::MAX).unwrap_err().code, ErrorCode::TooLarge);
        let big = vec![0u8; MAX_FILE_CHUNK + 1];
        let req = WriteFileRequest {
            path: "/tmp/x".into(),
            mode: WriteMode::Truncate,
            permissions: None,
            create_dirs: false,
        };
        assert_eq!(write(&req, &big).unwrap_err().code, ErrorCode::TooLarge);
    }

    #[test]
    fn listing_is_bounded() {
        let d = tmp();
        for i in 0..5 {
            fs::write(d.join(format!("f{i}")), b"").unwrap();
        }
        let (entries, truncated) = list(d.to_str().unwrap(), Some(3)).unwrap();
        assert_eq!((entries.len(), truncated), (3, true));
    }

    #[test]
    fn listing_is_bounded_by_its_encoded_size() {
        let d = tmp();
        for i in 0..50 {
            fs::write(d.join(format!("{i:0>200}")), b"").unwrap();
        }
        let (entries, truncated) = list_within(d.to_str().unwrap(), None, 2000).unwrap();
        assert!(truncated);
        let json = serde_json::to_vec(&entries).unwrap();
        assert!(!entries.is_empty() && json.len() <= 2000, "{} entries, {} bytes", entries.len(), json.len());
        let (entries, truncated) = list_within(d.to_str().unwrap(), None, 1 << 20).unwrap();
        assert_eq!((entries.len(), truncated), (50, false));
    }

    #[test]
    fn mtime_of_extreme_timestamps_saturates() {
        assert_eq!(mtime_ms(1, 500_000_000), 1500);
        assert_eq!(mtime_ms(i64::MAX, 999_999_999), i64::MAX);
        assert_eq!(mtime_ms(i64::MIN, 0), i64::MIN);
    }

    /// Runs `f` on a thread and fails the test if it does not finish promptly (a hang, not a
    /// slow test, is the bug being guarded against).
    fn promptly<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(f()));
        rx.recv_timeout(std::time::Duration::from_secs(5)).expect("file request blocked")
    }

    #[test]
    fn fifos_directories_and_devices_are_refused_without_blocking() {
        let d = tmp();
        let fifo = d.join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let fifo = fifo.to_str().unwrap().to_string();
        let f = fifo.clone();
        let e = promptly(move || read(&f, 0, 10)).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadRequest);
        assert!(e.message.contains("FIFO") && e.message.contains(&fifo), "{}", e.message);
        for mode in [WriteMode::Truncate, WriteMode::Append] {
            let req = WriteFileRequest { path: fifo.clone(), mode, permissions: None, create_dirs: false };
            let e = promptly(move || write(&req, b"x")).unwrap_err();
            assert_eq!(e.code, ErrorCode::BadRequest, "{}", e.message);
        }
        // With a reader present, the writer's open succeeds and fstat refuses it.
        let reader = fs::File::options().read(true).custom_flags(libc::O_NONBLOCK).open(&fifo).unwrap();
        let req =
            WriteFileRequest { path: fifo.clone(), mode: WriteMode::Truncate, permissions: None, create_dirs: false };
        assert!(promptly(move || write(&req, b"x")).unwrap_err().message.contains("FIFO"));
        drop(reader);
        let dir = d.to_str().unwrap().to_string();
        assert!(read(&dir, 0, 1).unwrap_err().message.contains("directory"));
        assert!(read("/dev/null", 0, 1).unwrap_err().message.contains("device"));
    }
}
