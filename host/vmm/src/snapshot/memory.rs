//! Guest memory to and from the memory file.
//!
//! The file is guest RAM in the order of [`crate::vstate::memory::ram_ranges`], written
//! sparsely: a zero page is a hole, so a file's disk use is what the guest touched. A restore
//! maps it `MAP_PRIVATE`: a page is read from the file (the page cache, shared by every VM
//! restored from it) until the guest writes it, and a write copies that one page into the
//! VM's own memory, never into the file.
//!
//! A VM with shared folders cannot be mapped that way: virtiofsd maps guest memory from the
//! descriptor the VMM sends it, so guest memory must be one shared memfd. Such a restore copies
//! the file's data into a new memfd ([`copy_to_memfd`]) and shares no page with its siblings.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, GuestRegionMmap,
    MmapRegion,
};

use super::SnapshotError;
use crate::vstate::memory::{memfd_backed, ram_ranges, GuestMemory};

const PAGE: usize = 4096;
/// What a page that is a hole in the memory file holds.
static ZERO_PAGE: [u8; PAGE] = [0; PAGE];
/// Guest memory is copied out this much at a time.
const CHUNK: usize = 2 << 20;

/// Writes `size` bytes of `memory` to a new file at `path`; returns the bytes written (the
/// rest are holes). The vCPUs and devices must not be writing guest memory meanwhile.
pub fn dump(memory: &GuestMemory, size: u64, path: &Path) -> Result<u64, SnapshotError> {
    let file = File::create(path).map_err(SnapshotError::io(format!("create the memory file {}", path.display())))?;
    dump_to(memory, size, &file)
}

/// [`dump`] into a file opened by someone else (umbra-vmm's threads open no paths); whatever it
/// held is discarded.
pub fn dump_to(memory: &GuestMemory, size: u64, file: &File) -> Result<u64, SnapshotError> {
    let written = write_to(memory, size, file)?;
    file.sync_all().map_err(SnapshotError::io("write the memory file".to_string()))?;
    Ok(written)
}

/// [`dump_to`] without making the file durable (a live fork syncs it once the guest runs
/// again).
pub fn write_to(memory: &GuestMemory, size: u64, file: &File) -> Result<u64, SnapshotError> {
    let what = || "write the memory file".to_string();
    // Emptied first: zero pages are not written, so old bytes of a reused file would survive.
    file.set_len(0).map_err(SnapshotError::io(what()))?;
    file.set_len(size).map_err(SnapshotError::io(what()))?;
    let mut buf = vec![0u8; CHUNK];
    let (mut offset, mut written) = (0u64, 0u64);
    for (start, len) in ram_ranges(size) {
        // Memory backed by a memfd (a VM with shared folders) is read only where the memfd has
        // data: reading a hole would allocate it, and a guest touches a fraction of its RAM.
        // Only a shared mapping's file is guest memory: a VM restored `MAP_PRIVATE` from a
        // memory file has written pages that file's holes know nothing of.
        let backing = memory
            .find_region(GuestAddress(start))
            .filter(|r| r.flags() & libc::MAP_SHARED != 0)
            .and_then(|r| r.file_offset())
            .map(|f| {
                use std::os::fd::AsRawFd;
                (f.file().as_raw_fd(), f.start())
            });
        let mut done = 0u64;
        while done < len {
            let mut n = (len - done).min(CHUNK as u64) as usize;
            if let Some((fd, base)) = backing {
                match data_range(fd, base + done, base + len) {
                    Some((from, to)) => {
                        done = from - base;
                        n = (to - from).min(CHUNK as u64) as usize;
                    }
                    None => break,
                }
            }
            memory
                .read_slice(&mut buf[..n], GuestAddress(start + done))
                .map_err(|e| SnapshotError::Mismatch(format!("guest memory at {:#x}: {e}", start + done)))?;
            // Runs of non-zero pages are written at once. A page compares against a zero page
            // (one memcmp), not byte by byte: this loop reads all of guest memory.
            let pages = n.div_ceil(PAGE);
            let mut run: Option<usize> = None;
            for i in 0..=pages {
                let data = i < pages && {
                    let page = &buf[i * PAGE..((i + 1) * PAGE).min(n)];
                    page != &ZERO_PAGE[..page.len()]
                };
                match (data, run) {
                    (true, None) => run = Some(i),
                    (false, Some(first)) => {
                        let bytes = &buf[first * PAGE..(i * PAGE).min(n)];
                        file.write_all_at(bytes, offset + done + (first * PAGE) as u64)
                            .map_err(SnapshotError::io(what()))?;
                        written += bytes.len() as u64;
                        run = None;
                    }
                    _ => {}
                }
            }
            done += n as u64;
        }
        offset += len;
    }
    Ok(written)
}

/// Writes the pages at guest addresses `pages` of `memory` into a memory file [`dump_to`] wrote
/// earlier (a live fork's pre-copy: the pages written since), at their places in it; zero pages
/// are written too, as the earlier copy may hold data there. Returns the bytes written; the
/// file is not synced.
pub fn rewrite_pages(memory: &GuestMemory, size: u64, file: &File, pages: &[u64]) -> Result<u64, SnapshotError> {
    // Each RAM range with the offset its bytes start at in the file.
    let mut placed = Vec::new();
    let mut offset = 0u64;
    for (start, len) in ram_ranges(size) {
        placed.push((start, len, offset));
        offset += len;
    }
    // Runs of consecutive pages (the log lists them in address order) go in one write each:
    // this runs while the vCPUs are paused.
    let mut buf = vec![0u8; CHUNK];
    let mut written = 0u64;
    let mut rest = pages;
    while let Some(&first) = rest.first() {
        let Some(&(start, len, base)) = placed.iter().find(|(start, len, _)| first >= *start && first < start + len)
        else {
            return Err(SnapshotError::Mismatch(format!("dirty page {first:#x} is outside guest RAM")));
        };
        let mut count = 1;
        while count < rest.len()
            && count * PAGE < CHUNK
            && rest[count] == first + (count * PAGE) as u64
            && rest[count] < start + len
        {
            count += 1;
        }
        let bytes = &mut buf[..count * PAGE];
        memory
            .read_slice(bytes, GuestAddress(first))
            .map_err(|e| SnapshotError::Mismatch(format!("guest memory at {first:#x}: {e}")))?;
        file.write_all_at(bytes, base + (first - start))
            .map_err(|e| SnapshotError::io("write the memory file".to_string())(e))?;
        written += bytes.len() as u64;
        rest = &rest[count..];
    }
    Ok(written)
}

/// The first range of data in `fd` within `[at, end)`, page-aligned: `None` if only holes are
/// left (or the file cannot say, which reads as data to the end).
fn data_range(fd: std::os::fd::RawFd, at: u64, end: u64) -> Option<(u64, u64)> {
    // SAFETY: lseek on a descriptor the caller keeps open; no memory is involved.
    let data = unsafe { libc::lseek(fd, at as i64, libc::SEEK_DATA) };
    if data < 0 {
        let unsupported = std::io::Error::last_os_error().raw_os_error() != Some(libc::ENXIO);
        return unsupported.then_some((at, end));
    }
    let from = (data as u64 & !(PAGE as u64 - 1)).max(at);
    if from >= end {
        return None;
    }
    // SAFETY: as above.
    let hole = unsafe { libc::lseek(fd, from as i64, libc::SEEK_HOLE) };
    let to = if hole < 0 { end } else { (hole as u64).next_multiple_of(PAGE as u64).min(end) };
    Some((from, to.max(from + PAGE as u64).min(end)))
}

/// Maps the memory file at `path` as `size` bytes of private guest memory.
pub fn map_private(path: &Path, size: u64, prefault: bool) -> Result<GuestMemory, SnapshotError> {
    let file = File::open(path).map_err(SnapshotError::io(format!("open the memory file {}", path.display())))?;
    map_private_file(&file, path, size, prefault)
}

/// [`map_private`] over a memory file opened earlier (before the VMM entered its jail); `path`
/// names it in errors. With `prefault`, every page of data is mapped now ([`prefault_data`]);
/// without, a page is mapped when the guest first touches it.
pub fn map_private_file(file: &File, path: &Path, size: u64, prefault: bool) -> Result<GuestMemory, SnapshotError> {
    let len = file.metadata().map_err(SnapshotError::io(format!("stat {}", path.display())))?.len();
    if len != size {
        return Err(SnapshotError::Mismatch(format!(
            "the memory file {} has {len} bytes; the state says the guest has {size}",
            path.display()
        )));
    }
    let mut regions = Vec::new();
    let mut offset = 0u64;
    for (start, len) in ram_ranges(size) {
        let handle = file.try_clone().map_err(SnapshotError::io("dup the memory file"))?;
        let region = MmapRegion::<()>::build(
            Some(FileOffset::new(handle, offset)),
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_NORESERVE,
        )
        .map_err(|e| SnapshotError::Mismatch(format!("map {len} bytes of {}: {e}", path.display())))?;
        if prefault {
            prefault_data(file, offset, len, region.as_ptr());
        }
        let region = GuestRegionMmap::new(region, GuestAddress(start))
            .ok_or_else(|| SnapshotError::Mismatch("guest region overflows the address space".into()))?;
        regions.push(region);
        offset += len;
    }
    GuestMemoryMmap::from_regions(regions).map_err(|e| SnapshotError::Mismatch(e.to_string()))
}

/// A new memfd-backed guest memory of `size` bytes holding the memory file's contents (only
/// its data is copied; holes stay holes), for a VM whose memory is shared with a vhost-user
/// backend. Returns the memory and the memfd, as [`memfd_backed`] does.
pub fn copy_to_memfd(file: &File, path: &Path, size: u64) -> Result<(GuestMemory, File), SnapshotError> {
    use std::os::fd::AsRawFd;
    let len = file.metadata().map_err(SnapshotError::io(format!("stat {}", path.display())))?.len();
    if len != size {
        return Err(SnapshotError::Mismatch(format!(
            "the memory file {} has {len} bytes; the state says the guest has {size}",
            path.display()
        )));
    }
    let (memory, memfd) = memfd_backed(size as usize).map_err(|e| SnapshotError::Mismatch(e.to_string()))?;
    let what = || format!("copy the memory file {} into guest memory", path.display());
    let mut buf = vec![0u8; CHUNK];
    let mut at = 0u64;
    while at < size {
        // SAFETY: lseek only reads the fd's extent map.
        let data = unsafe { libc::lseek(file.as_raw_fd(), at as libc::off_t, libc::SEEK_DATA) };
        if data < 0 || data as u64 >= size {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(file.as_raw_fd(), data, libc::SEEK_HOLE) };
        let end = if hole < 0 { size } else { (hole as u64).min(size) };
        let mut from = data as u64;
        while from < end {
            let n = (end - from).min(CHUNK as u64) as usize;
            file.read_exact_at(&mut buf[..n], from).map_err(SnapshotError::io(what()))?;
            memfd.write_all_at(&buf[..n], from).map_err(SnapshotError::io(what()))?;
            from += n as u64;
        }
        at = end;
    }
    Ok((memory, memfd))
}

/// Maps, read-only and shared with the page cache, every page of `file[offset..offset+len]`
/// (mapped at `host`) that holds data — what the guest had touched — so its first reads after a
/// restore take no host page fault; the holes stay unmapped, and a write still copies just that
/// page. `MADV_POPULATE_READ` (Linux 5.14); a hint: without it the pages fault in as used.
fn prefault_data(file: &File, offset: u64, len: u64, host: *mut u8) {
    use std::os::fd::AsRawFd;
    const MADV_POPULATE_READ: libc::c_int = 22;
    let (fd, end) = (file.as_raw_fd(), offset + len);
    let mut at = offset;
    while at < end {
        // SAFETY: lseek only reads the fd's extent map.
        let data = unsafe { libc::lseek(fd, at as libc::off_t, libc::SEEK_DATA) };
        if data < 0 || data as u64 >= end {
            return;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        let hole = if hole < 0 { end } else { (hole as u64).min(end) };
        let (from, to) = (data as u64, hole);
        // SAFETY: [host + from - offset, host + to - offset) lies inside the region just mapped
        // over [offset, end); MADV_POPULATE_READ only faults those pages in.
        unsafe { libc::madvise(host.add((from - offset) as usize).cast(), (to - from) as usize, MADV_POPULATE_READ) };
        at = to;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vstate::memory::anonymous;

    #[test]
    fn runs_of_pages_are_written_whole_and_zero_pages_are_holes() {
        let (anon, (memfd, file)) = (anonymous(4 << 20).unwrap(), memfd_backed(4 << 20).unwrap());
        dump_and_compare(&anon, "anon", None);
        dump_and_compare(&memfd, "memfd", Some(&file));
    }

    #[test]
    fn pages_written_again_land_at_their_places_runs_and_zeros_included() {
        let size = 4u64 << 20;
        let mem = anonymous(size as usize).unwrap();
        let dir = std::env::temp_dir().join(format!("umbra-rewrite-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("memory");
        mem.write_slice(&[1; 3 * PAGE], GuestAddress(0x10_000)).unwrap();
        mem.write_slice(&[2; PAGE], GuestAddress(0x30_000)).unwrap();
        dump(&mem, size, &path).unwrap();
        // Written since: a run of three, a lone page, and one zeroed again.
        mem.write_slice(&[3; 3 * PAGE], GuestAddress(0x20_000)).unwrap();
        mem.write_slice(&[4; PAGE], GuestAddress(0x3f_f000)).unwrap();
        mem.write_slice(&[0; PAGE], GuestAddress(0x30_000)).unwrap();
        let file = File::options().write(true).open(&path).unwrap();
        let pages = [0x20_000, 0x21_000, 0x22_000, 0x30_000, 0x3f_f000];
        assert_eq!(rewrite_pages(&mem, size, &file, &pages).unwrap(), 5 * PAGE as u64);
        let mut expected = vec![0u8; size as usize];
        mem.read_slice(&mut expected, GuestAddress(0)).unwrap();
        assert!(std::fs::read(&path).unwrap() == expected, "the file is guest memory as it is now");
        let e = rewrite_pages(&mem, size, &file, &[size]).unwrap_err();
        assert!(e.to_string().contains("outside guest RAM"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn dump_and_compare(mem: &GuestMemory, tag: &str, memfd: Option<&File>) {
        let dir = std::env::temp_dir().join(format!("umbra-snapruns-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("memory");
        let size = 4u64 << 20;
        // Pages 0-2, then 4, then the two pages across the first 2 MiB chunk's end, then the last.
        let chunk = CHUNK as u64;
        let pages = [0, 1, 2, 4, chunk / PAGE as u64 - 1, chunk / PAGE as u64, size / PAGE as u64 - 1];
        for p in pages {
            mem.write_obj(p + 1, GuestAddress(p * PAGE as u64 + 8)).unwrap();
        }
        assert_eq!(dump(mem, size, &path).unwrap(), pages.len() as u64 * PAGE as u64);
        if let Some(memfd) = memfd {
            // Its holes were skipped, not read: a read would have allocated them.
            use std::os::unix::fs::MetadataExt;
            let allocated = memfd.metadata().unwrap().blocks() * 512;
            assert!(allocated < 1 << 20, "the dump allocated the memfd's holes: {allocated} bytes");
        }
        let file = std::fs::read(&path).unwrap();
        let mut want = vec![0u8; size as usize];
        mem.read_slice(&mut want, GuestAddress(0)).unwrap();
        assert!(file == want, "the file is guest memory, byte for byte");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_vm_restored_from_a_memory_file_dumps_the_pages_it_wrote_over_its_holes() {
        let dir = std::env::temp_dir().join(format!("umbra-snapredump-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (first, second) = (dir.join("memory"), dir.join("memory2"));
        let size = 4u64 << 20;
        let mem = anonymous(size as usize).unwrap();
        mem.write_obj(0xfeed_u64, GuestAddress(0x1000)).unwrap();
        dump(&mem, size, &first).unwrap();
        // Restored: the guest writes pages that are holes in the file it was mapped from.
        let restored = map_private(&first, size, true).unwrap();
        restored.write_obj(0xbeef_u64, GuestAddress(0x3000)).unwrap();
        restored.write_obj(0xcafe_u64, GuestAddress(size - 8)).unwrap();
        assert_eq!(dump(&restored, size, &second).unwrap(), 3 * PAGE as u64, "every written page");
        let again = map_private(&second, size, false).unwrap();
        assert_eq!(again.read_obj::<u64>(GuestAddress(0x1000)).unwrap(), 0xfeed);
        assert_eq!(again.read_obj::<u64>(GuestAddress(0x3000)).unwrap(), 0xbeef, "not the old file's hole");
        assert_eq!(again.read_obj::<u64>(GuestAddress(size - 8)).unwrap(), 0xcafe);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_file_is_sparse_and_a_restored_vm_never_writes_it() {
        let dir = std::env::temp_dir().join(format!("umbra-snapmem-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("memory");
        let size = 8u64 << 20;
        let mem = anonymous(size as usize).unwrap();
        mem.write_obj(0xfeed_u64, GuestAddress(0x1000)).unwrap();
        mem.write_obj(0xbeef_u64, GuestAddress(size - 8)).unwrap();
        assert_eq!(dump(&mem, size, &path).unwrap(), 2 * PAGE as u64, "two pages touched");
        use std::os::unix::fs::MetadataExt;
        let blocks = std::fs::metadata(&path).unwrap().blocks() * 512;
        assert!(blocks < 1 << 20, "the file is sparse: {blocks} bytes allocated");

        let a = map_private(&path, size, true).unwrap();
        let b = map_private(&path, size, false).unwrap();
        assert_eq!(a.read_obj::<u64>(GuestAddress(0x1000)).unwrap(), 0xfeed);
        assert_eq!(a.read_obj::<u64>(GuestAddress(size - 8)).unwrap(), 0xbeef);
        a.write_obj(1u64, GuestAddress(0x1000)).unwrap();
        assert_eq!(b.read_obj::<u64>(GuestAddress(0x1000)).unwrap(), 0xfeed, "b does not see a's write");
        drop((a, b));
        let file = std::fs::read(&path).unwrap();
        assert_eq!(u64::from_le_bytes(file[0x1000..0x1008].try_into().unwrap()), 0xfeed, "the file is unchanged");

        // A copy for a VM with shared folders: the same bytes, in memory of its own.
        let (c, _memfd) = copy_to_memfd(&File::open(&path).unwrap(), &path, size).unwrap();
        assert_eq!(c.read_obj::<u64>(GuestAddress(0x1000)).unwrap(), 0xfeed);
        assert_eq!(c.read_obj::<u64>(GuestAddress(size - 8)).unwrap(), 0xbeef);
        assert_eq!(c.read_obj::<u64>(GuestAddress(0x2000)).unwrap(), 0, "a hole reads as zero");
        let e = copy_to_memfd(&File::open(&path).unwrap(), &path, size * 2).unwrap_err().to_string();
        assert!(e.contains("has 8388608 bytes"), "{e}");

        let e = map_private(&path, size * 2, true).unwrap_err().to_string();
        assert!(e.contains("has 8388608 bytes; the state says the guest has 16777216"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
