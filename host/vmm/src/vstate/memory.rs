//! Guest memory backed by a memfd: one file the VMM maps, and that vhost-user backends
//! (virtiofsd, vhost-device-vsock) can map too when it is shared with them.
//!
//! RAM is split around the MMIO gap below 4 GiB (see [`crate::boot::layout`]): the first
//! region covers `[0, min(size, 3 GiB))`, any remainder continues at 4 GiB, backed by the
//! following bytes of the same memfd.

use std::fs::File;
use std::os::fd::FromRawFd;

use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

use super::VstateError;
use crate::boot::layout::{MMIO_GAP_END, MMIO_GAP_START};

pub type GuestMemory = GuestMemoryMmap<()>;

/// The guest-physical RAM ranges `(start, len)` for `size` bytes of memory.
pub fn ram_ranges(size: u64) -> Vec<(u64, u64)> {
    let low = size.min(MMIO_GAP_START);
    let mut ranges = vec![(0, low)];
    if size > low {
        ranges.push((MMIO_GAP_END, size - low));
    }
    ranges
}

/// Creates `size` bytes of guest memory, and returns the memfd behind it.
pub fn memfd_backed(size: usize) -> Result<(GuestMemory, File), VstateError> {
    let name = c"umbra-guest-memory";
    // SAFETY: memfd_create reads a NUL-terminated name and returns a new fd or -1.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(VstateError::Memory(format!("memfd_create: {}", std::io::Error::last_os_error())));
    }
    // SAFETY: `fd` was just returned by memfd_create and nothing else owns it.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size as u64)
        .map_err(|e| VstateError::Memory(format!("cannot size the memfd to {size} bytes: {e}")))?;
    let mut regions = Vec::new();
    let mut offset = 0u64;
    for (start, len) in ram_ranges(size as u64) {
        let handle = file.try_clone().map_err(|e| VstateError::Memory(format!("dup memfd: {e}")))?;
        let region = MmapRegion::<()>::from_file(FileOffset::new(handle, offset), len as usize)
            .map_err(|e| VstateError::Memory(format!("mmap {len} bytes: {e}")))?;
        let region = GuestRegionMmap::new(region, GuestAddress(start))
            .ok_or_else(|| VstateError::Memory("guest region overflows the address space".into()))?;
        regions.push(region);
        offset += len;
    }
    let memory = GuestMemoryMmap::from_regions(regions).map_err(|e| VstateError::Memory(e.to_string()))?;
    Ok((memory, file))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestMemoryBackend};

    #[test]
    fn memfd_memory_reads_back_and_bounds_are_checked() {
        let (mem, file) = memfd_backed(2 << 20).unwrap();
        assert_eq!(file.metadata().unwrap().len(), 2 << 20);
        mem.write_obj(0xdead_beef_u32, GuestAddress(0x1000)).unwrap();
        assert_eq!(mem.read_obj::<u32>(GuestAddress(0x1000)).unwrap(), 0xdead_beef);
        assert!(mem.write_obj(1u64, GuestAddress((2 << 20) - 4)).is_err(), "straddles the end");
        assert!(mem.read_obj::<u8>(GuestAddress(u64::MAX)).is_err());
        assert_eq!(mem.last_addr(), GuestAddress((2 << 20) - 1));
    }

    #[test]
    fn memory_above_3_gib_continues_at_4_gib() {
        assert_eq!(ram_ranges(1 << 30), vec![(0, 1 << 30)]);
        assert_eq!(ram_ranges(4 << 30), vec![(0, 3 << 30), (4 << 30, 1 << 30)]);
    }
}
