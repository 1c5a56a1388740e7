//! Guest memory backed by a memfd: one file the VMM maps, and that vhost-user backends
//! (virtiofsd, vhost-device-vsock) can map too when it is shared with them.

use std::fs::File;
use std::os::fd::FromRawFd;

use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

use super::VstateError;

pub type GuestMemory = GuestMemoryMmap<()>;

/// Creates `size` bytes of guest memory at guest physical address 0, and returns the memfd.
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
    let handle = file.try_clone().map_err(|e| VstateError::Memory(format!("dup memfd: {e}")))?;
    let region = MmapRegion::<()>::from_file(FileOffset::new(handle, 0), size)
        .map_err(|e| VstateError::Memory(format!("mmap {size} bytes: {e}")))?;
    let region = GuestRegionMmap::new(region, GuestAddress(0))
        .ok_or_else(|| VstateError::Memory("guest region overflows the address space".into()))?;
    let memory = GuestMemoryMmap::from_regions(vec![region]).map_err(|e| VstateError::Memory(e.to_string()))?;
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
}
