//! Guest memory: anonymous when only the VMM maps it, backed by a memfd when a vhost-user
//! backend (virtiofsd) must map it too.
//!
//! Anonymous memory is the default because the host can back it with transparent huge pages:
//! every 2 MiB page the guest touches costs the host one nested page fault instead of 512.
//! Measured in the nested lane (where every fault is an exit to L1's KVM), the same guest's
//! kernel time to agent-ready fell from 1.36–2.18 s to 0.95–1.01 s. Both kinds are advised
//! `MADV_HUGEPAGE` (shmem honours it where `shmem_enabled` is `advise`) and named
//! `umbra-guest-memory` (in `/proc/PID/maps`: `memfd:` or `[anon:]`).
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

/// Where `len` bytes of guest memory at guest address `addr` are mapped in this process, when
/// they lie wholly inside one region (a range across regions, past RAM or overflowing: `None`).
pub fn host_range(mem: &GuestMemory, addr: u64, len: u64) -> Option<*mut u8> {
    use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
    let (region, offset) = mem.to_region_addr(GuestAddress(addr))?;
    offset.0.checked_add(len).filter(|&end| end <= region.len())?;
    region.get_host_address(offset).ok()
}

/// The guest-physical RAM ranges `(start, len)` for `size` bytes of memory.
pub fn ram_ranges(size: u64) -> Vec<(u64, u64)> {
    let low = size.min(MMIO_GAP_START);
    let mut ranges = vec![(0, low)];
    if size > low {
        ranges.push((MMIO_GAP_END, size - low));
    }
    ranges
}

/// The name guest memory goes by in `/proc/PID/maps` and `smaps`.
pub const NAME: &str = "umbra-guest-memory";

/// Creates `size` bytes of anonymous guest memory (the VMM alone maps it).
pub fn anonymous(size: usize) -> Result<GuestMemory, VstateError> {
    let ranges: Vec<(GuestAddress, usize)> =
        ram_ranges(size as u64).into_iter().map(|(start, len)| (GuestAddress(start), len as usize)).collect();
    let memory = GuestMemoryMmap::from_ranges(&ranges).map_err(|e| VstateError::Memory(e.to_string()))?;
    advise(&memory, true);
    Ok(memory)
}

/// Asks for transparent huge pages over every region, and names anonymous ones. Both are hints:
/// a host without THP or VMA names boots the same guest, only slower to fault in.
fn advise(memory: &GuestMemory, anonymous: bool) {
    use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
    let name = std::ffi::CString::new(NAME).expect("no NUL in the name");
    for region in memory.iter() {
        let Ok(host) = memory.get_host_address(region.start_addr()) else { continue };
        let len = region.len() as usize;
        // SAFETY: `host..host+len` is exactly this region's mapping, owned by `memory`; madvise
        // only changes how the kernel backs it.
        unsafe { libc::madvise(host.cast(), len, libc::MADV_HUGEPAGE) };
        if anonymous {
            // SAFETY: PR_SET_VMA_ANON_NAME reads the NUL-terminated name during the call, over
            // the same mapping; it fails harmlessly on kernels without CONFIG_ANON_VMA_NAME.
            unsafe {
                libc::prctl(libc::PR_SET_VMA, libc::PR_SET_VMA_ANON_NAME, host as libc::c_ulong, len, name.as_ptr())
            };
        }
    }
}

/// Creates `size` bytes of guest memory, and returns the memfd behind it.
pub fn memfd_backed(size: usize) -> Result<(GuestMemory, File), VstateError> {
    let name = c"umbra-guest-memory"; // NAME, as the kernel prefixes it with "memfd:"
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
    advise(&memory, false);
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
    fn anonymous_memory_is_named_and_bounded_like_the_memfd() {
        let mem = anonymous(4 << 20).unwrap();
        mem.write_obj(7u64, GuestAddress(0x2000)).unwrap();
        assert_eq!(mem.read_obj::<u64>(GuestAddress(0x2000)).unwrap(), 7);
        assert!(mem.write_obj(1u64, GuestAddress((4 << 20) - 4)).is_err(), "straddles the end");
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        // Named where the kernel can (CONFIG_ANON_VMA_NAME, Linux 5.17+).
        let host = mem.get_host_address(GuestAddress(0)).unwrap() as usize;
        let line = maps
            .lines()
            .find(|l| l.split('-').next().and_then(|a| usize::from_str_radix(a, 16).ok()) == Some(host))
            .expect("the guest memory mapping");
        if line.contains("[anon:") {
            assert!(line.contains(NAME), "{line}");
        }
    }

    #[test]
    fn memory_above_3_gib_continues_at_4_gib() {
        assert_eq!(ram_ranges(1 << 30), vec![(0, 1 << 30)]);
        assert_eq!(ram_ranges(4 << 30), vec![(0, 3 << 30), (4 << 30, 1 << 30)]);
    }
}
