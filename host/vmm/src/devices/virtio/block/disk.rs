//! The host side of virtio-blk: an image file, and the execution of parsed requests against it.
//!
//! Data moves between the file and guest memory without a bounce buffer: [`FileAt`] adapts
//! `pread`/`pwrite` at an explicit offset to vm-memory's volatile I/O traits, so each segment is
//! one or a few syscalls straight into (or out of) guest RAM. Explicit offsets mean no shared
//! file position, so one `Disk` can serve several threads. Every segment was checked by
//! [`super::request`]; this module only checks the sector range against the capacity.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use vm_memory::bitmap::BitmapSlice;
use vm_memory::{
    Bytes, GuestMemory as _, Permissions, ReadVolatile, VolatileMemoryError, VolatileSlice, WriteVolatile,
};

use super::request::{Request, RequestError, RequestKind, Segment, SECTOR_SIZE};
use crate::vstate::memory::GuestMemory;

/// The serial a GET_ID request returns (NUL-padded to 20 bytes; no NUL when all 20 are used).
pub const DEVICE_ID: &[u8] = b"umbra-blk";
/// Length of the GET_ID answer (VIRTIO_BLK_ID_BYTES).
pub const ID_BYTES: usize = 20;

/// A disk image opened for the guest.
#[derive(Debug)]
pub struct Disk {
    file: File,
    path: PathBuf,
    /// Size in 512-byte sectors.
    capacity: u64,
    read_only: bool,
}

impl Disk {
    /// Opens `path` read-only or read-write. The image's size must be a whole number of sectors:
    /// a trailing partial sector could be neither read nor written by the guest, and is almost
    /// always a sign the wrong file was passed.
    pub fn open(path: &Path, read_only: bool) -> io::Result<Disk> {
        let file = OpenOptions::new().read(true).write(!read_only).open(path).map_err(|e| {
            let mode = if read_only { "read-only" } else { "read-write" };
            io::Error::new(e.kind(), format!("cannot open disk image {} {mode}: {e}", path.display()))
        })?;
        // A regular file or a block device (whose metadata length is 0: ask by seeking).
        let file_type = file.metadata()?.file_type();
        if !file_type.is_file() && !file_type.is_block_device() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("disk image {} is neither a regular file nor a block device", path.display()),
            ));
        }
        let size = (&file).seek(SeekFrom::End(0))?;
        if size % SECTOR_SIZE != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "disk image {} is {size} bytes, not a multiple of {SECTOR_SIZE}: pad it (truncate -s %{SECTOR_SIZE})",
                    path.display()
                ),
            ));
        }
        Ok(Disk { file, path: path.to_path_buf(), capacity: size / SECTOR_SIZE, read_only })
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn read_only(&self) -> bool {
        self.read_only
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Executes `request` and returns how many bytes it wrote into guest memory, not counting
    /// the status byte.
    pub fn execute(&self, mem: &GuestMemory, request: &Request) -> Result<u32, RequestError> {
        match request.kind {
            RequestKind::In => {
                let mut file = FileAt { file: &self.file, offset: self.byte_offset(request)? };
                for segment in &request.data {
                    transfer(mem, segment, Permissions::Write, |slice| file.read_exact_volatile(slice))?;
                }
                // Bounded by MAX_DATA_LEN, which fits a u32.
                Ok(request.data_len as u32)
            }
            RequestKind::Out => {
                if self.read_only {
                    return Err(RequestError::ReadOnly);
                }
                let mut file = FileAt { file: &self.file, offset: self.byte_offset(request)? };
                for segment in &request.data {
                    transfer(mem, segment, Permissions::Read, |slice| file.write_all_volatile(slice))?;
                }
                Ok(0)
            }
            RequestKind::Flush => {
                // A read-only image has nothing of ours to flush.
                if !self.read_only {
                    self.file.sync_data().map_err(|e| RequestError::Io(e.to_string()))?;
                }
                Ok(0)
            }
            RequestKind::GetId => {
                let mut id = [0u8; ID_BYTES];
                id[..DEVICE_ID.len()].copy_from_slice(DEVICE_ID);
                let mut written = 0usize;
                for segment in &request.data {
                    let take = (ID_BYTES - written).min(segment.len as usize);
                    mem.write_slice(&id[written..written + take], segment.addr)
                        .map_err(|_| RequestError::OutsideMemory { addr: segment.addr.0, len: segment.len })?;
                    written += take;
                    if written == ID_BYTES {
                        break;
                    }
                }
                Ok(written as u32)
            }
            // Answered S_UNSUPP by the caller before it gets here.
            RequestKind::Unsupported(_) => Ok(0),
        }
    }

    /// The file offset of the request's first sector, once its whole range is inside the disk.
    fn byte_offset(&self, request: &Request) -> Result<u64, RequestError> {
        let sectors = request.data_len / SECTOR_SIZE;
        match request.sector.checked_add(sectors) {
            // capacity <= u64::MAX / 512, so the multiplication cannot overflow.
            Some(end) if end <= self.capacity => Ok(request.sector * SECTOR_SIZE),
            _ => Err(RequestError::OutOfRange { sector: request.sector, sectors, capacity: self.capacity }),
        }
    }
}

/// Runs `io` over the guest memory slices of `segment` (one per memory region it spans).
fn transfer<F>(mem: &GuestMemory, segment: &Segment, access: Permissions, mut io: F) -> Result<(), RequestError>
where
    F: FnMut(&mut VolatileSlice<'_, ()>) -> Result<(), VolatileMemoryError>,
{
    let outside = || RequestError::OutsideMemory { addr: segment.addr.0, len: segment.len };
    let slices = mem.get_slices(segment.addr, segment.len as usize, access).map_err(|_| outside())?;
    for slice in slices {
        let mut slice = slice.map_err(|_| outside())?;
        io(&mut slice).map_err(|e| RequestError::Io(e.to_string()))?;
    }
    Ok(())
}

/// A file seen through `pread`/`pwrite` at a moving offset: the volatile-I/O counterpart of
/// `FileExt::read_at`/`write_at`, so guest memory is never turned into a Rust slice.
struct FileAt<'a> {
    file: &'a File,
    offset: u64,
}

impl FileAt<'_> {
    fn offset(&self) -> Result<libc::off64_t, VolatileMemoryError> {
        libc::off64_t::try_from(self.offset)
            .map_err(|_| VolatileMemoryError::IOError(io::Error::from(io::ErrorKind::InvalidInput)))
    }
}

impl ReadVolatile for FileAt<'_> {
    fn read_volatile<B: BitmapSlice>(&mut self, buf: &mut VolatileSlice<B>) -> Result<usize, VolatileMemoryError> {
        let offset = self.offset()?;
        let guard = buf.ptr_guard_mut();
        // SAFETY: the fd is open for the lifetime of `self.file`; `guard` points at `buf.len()`
        // bytes of mapped guest memory that stay mapped while the guard lives (the invariant of
        // VolatileSlice), and the kernel writes at most that many bytes there.
        let read = unsafe { libc::pread64(self.file.as_raw_fd(), guard.as_ptr().cast(), buf.len(), offset) };
        if read < 0 {
            // Part of the buffer may have been written before the error.
            buf.bitmap().mark_dirty(0, buf.len());
            return Err(VolatileMemoryError::IOError(io::Error::last_os_error()));
        }
        let read = read as usize;
        buf.bitmap().mark_dirty(0, read);
        self.offset += read as u64;
        Ok(read)
    }
}

impl WriteVolatile for FileAt<'_> {
    fn write_volatile<B: BitmapSlice>(&mut self, buf: &VolatileSlice<B>) -> Result<usize, VolatileMemoryError> {
        let offset = self.offset()?;
        let guard = buf.ptr_guard();
        // SAFETY: the fd is open for the lifetime of `self.file`; `guard` points at `buf.len()`
        // readable bytes of mapped guest memory that stay mapped while the guard lives, and the
        // kernel only reads them.
        let written = unsafe { libc::pwrite64(self.file.as_raw_fd(), guard.as_ptr().cast(), buf.len(), offset) };
        if written < 0 {
            return Err(VolatileMemoryError::IOError(io::Error::last_os_error()));
        }
        self.offset += written as u64;
        Ok(written as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::test_utils::tempdir;
    use std::io::Write;

    #[test]
    fn capacity_is_in_sectors_and_partial_sectors_are_refused() {
        let dir = tempdir();
        let whole = dir.join("whole.img");
        std::fs::write(&whole, vec![0u8; 4096]).unwrap();
        let disk = Disk::open(&whole, true).unwrap();
        assert_eq!(disk.capacity(), 8);
        assert!(disk.read_only());

        let partial = dir.join("partial.img");
        std::fs::File::create(&partial).unwrap().write_all(&[0u8; 1000]).unwrap();
        let err = Disk::open(&partial, false).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert!(err.to_string().contains("not a multiple of 512"), "{err}");

        let not_a_file = Disk::open(&dir, true).unwrap_err();
        assert!(not_a_file.to_string().contains("neither a regular file"), "{not_a_file}");

        let missing = Disk::open(&dir.join("missing.img"), true).unwrap_err();
        assert!(missing.to_string().contains("missing.img"), "{missing}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
