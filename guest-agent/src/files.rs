//! File requests: read, write, stat, list — each bounded in size and with errors that name the
//! path. Blocking filesystem calls; the connection runs them on tokio's blocking pool.

use std::fs::{self, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use umbra_proto::{DirEntry, ErrorBody, ErrorCode, FileKind, FileStat, WriteFileRequest, WriteMode, MAX_FILE_CHUNK};

const DEFAULT_LIST_LIMIT: u32 = 10_000;
const MAX_LIST_LIMIT: u32 = 100_000;

fn absolute(path: &str) -> Result<&Path, ErrorBody> {
    let p = Path::new(path);
    if !p.is_absolute() {
        return Err(ErrorBody::new(ErrorCode::BadRequest, format!("path {path:?} is not absolute")));
    }
    Ok(p)
}

pub fn io_error(what: &str, path: &str, e: io::Error) -> ErrorBody {
    let code = match e.kind() {
        io::ErrorKind::NotFound => ErrorCode::NotFound,
        io::ErrorKind::PermissionDenied => ErrorCode::PermissionDenied,
        _ => ErrorCode::Io,
    };
    ErrorBody::new(code, format!("{what} {path:?}: {e}"))
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
    let mut f = fs::File::open(p).map_err(|e| io_error("cannot open", path, e))?;
    let size = f.metadata().map_err(|e| io_error("cannot stat", path, e))?.len();
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
    let mut f = opts.open(p).map_err(|e| io_error("cannot open", path, e))?;
    if let WriteMode::At(off) = req.mode {
        f.seek(SeekFrom::Start(off)).map_err(|e| io_error("cannot seek in", path, e))?;
    }
    f.write_all(data).map_err(|e| io_error("cannot write", path, e))?;
    Ok(data.len() as u64)
}

fn kind_of(ft: fs::FileType) -> FileKind {
    if ft.is_symlink() {
        FileKind::Symlink
    } else if ft.is_dir() {
        FileKind::Dir
    } else if ft.is_file() {
        FileKind::File
    } else {
        FileKind::Other
    }
}

/// Stats without following a final symlink, so a caller sees links as links.
pub fn stat(path: &str) -> Result<FileStat, ErrorBody> {
    let md = fs::symlink_metadata(absolute(path)?).map_err(|e| io_error("cannot stat", path, e))?;
    Ok(FileStat {
        kind: kind_of(md.file_type()),
        size: md.len(),
        mode: md.mode(),
        uid: md.uid(),
        gid: md.gid(),
        mtime_ms: md.mtime() * 1000 + md.mtime_nsec() / 1_000_000,
    })
}

/// Lists at most `limit` entries, sorted by name; `truncated` says whether more exist.
pub fn list(path: &str, limit: Option<u32>) -> Result<(Vec<DirEntry>, bool), ErrorBody> {
    let limit = limit.unwrap_or(DEFAULT_LIST_LIMIT).min(MAX_LIST_LIMIT) as usize;
    let rd = fs::read_dir(absolute(path)?).map_err(|e| io_error("cannot list", path, e))?;
    let mut entries = Vec::new();
    let mut truncated = false;
    for entry in rd {
        let entry = entry.map_err(|e| io_error("cannot list", path, e))?;
        if entries.len() == limit {
            truncated = true;
            break;
        }
        let md = entry.metadata().ok();
        entries.push(DirEntry {
            name: entry.file_name().to_string_lossy().into_owned(),
            kind: md.as_ref().map_or(FileKind::Other, |m| kind_of(m.file_type())),
            size: md.map_or(0, |m| m.len()),
        });
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
}
