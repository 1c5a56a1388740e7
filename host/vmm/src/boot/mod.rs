//! Loading Linux into guest memory and describing the machine to it.
//!
//! Three kernel formats, two boot protocols:
//! - an ELF `vmlinux` with a PVH note (Umbra's own guest kernel): entered in 32-bit protected
//!   mode with `%ebx` pointing at an `hvm_start_info` (memory map, command line, initrd);
//! - an ELF `vmlinux` without one, or a `bzImage`: the x86-64 Linux boot protocol, entered in
//!   64-bit mode with `%rsi` pointing at the zero page (`boot_params`, e820 map).
//!
//! The VMM also writes the MP table (so SMP guests find their vCPUs and the IOAPIC without
//! ACPI) and appends one `virtio_mmio.device=` argument per device to the command line.

mod error;
pub mod layout;
pub mod mptable;

use std::fs::File;
use std::path::Path;

use linux_loader::cmdline::Cmdline;
use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::loader::elf::start_info::{hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info};
use linux_loader::loader::{self, BzImage, Elf, KernelLoader, KernelLoaderResult, PvhBootCapability};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use crate::vstate::memory::GuestMemory;
pub use error::BootError;
use layout::*;

/// How the boot vCPU starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootEntry {
    /// PVH: 32-bit protected mode at `entry`, `%ebx` = start info.
    Pvh { entry: GuestAddress, start_info: GuestAddress },
    /// Linux x86-64 boot protocol: long mode at `entry`, `%rsi` = zero page.
    Linux64 { entry: GuestAddress, zero_page: GuestAddress },
}

/// A virtio-mmio device window as the guest learns it from the command line.
#[derive(Debug, Clone, Copy)]
pub struct MmioSlot {
    pub base: u64,
    pub size: u64,
    pub irq: u32,
}

pub struct BootSpec<'a> {
    pub kernel: &'a Path,
    pub initrd: Option<&'a Path>,
    pub cmdline: &'a str,
    pub cpus: u8,
    pub devices: &'a [MmioSlot],
}

pub fn open(what: &'static str, path: &Path) -> Result<File, BootError> {
    File::open(path).map_err(|source| BootError::Open { what, path: path.display().to_string(), source })
}

/// Loads kernel, initrd and command line, writes the MP table and boot parameters.
pub fn load(mem: &GuestMemory, spec: &BootSpec) -> Result<BootEntry, BootError> {
    let kernel = open("kernel", spec.kernel)?;
    let initrd = spec.initrd.map(|path| open("initrd", path)).transpose()?;
    load_files(mem, spec, kernel, initrd)
}

/// [`load`] from kernel and initrd files opened earlier (umbra-vmm opens them before it enters
/// its jail); `spec`'s paths name them in errors.
pub fn load_files(
    mem: &GuestMemory,
    spec: &BootSpec,
    mut kernel: File,
    initrd: Option<File>,
) -> Result<BootEntry, BootError> {
    let himem = Some(GuestAddress(HIMEM_START));
    let loaded = match Elf::load(mem, None, &mut kernel, himem) {
        Ok(r) => r,
        Err(elf) => BzImage::load(mem, None, &mut kernel, himem).map_err(|bzimage| BootError::Kernel {
            path: spec.kernel.display().to_string(),
            elf,
            bzimage,
        })?,
    };

    if let Some(hdr) = loaded.setup_header {
        if hdr.xloadflags & XLF_KERNEL_64 == 0 {
            return Err(BootError::Not64Bit { path: spec.kernel.display().to_string() });
        }
    }
    let initrd = match initrd {
        Some(file) => Some(load_initrd(mem, file, kernel_footprint_end(&loaded))?),
        None => None,
    };

    // try_from splits at " -- " so the device arguments land before the init arguments.
    let mut cmdline =
        Cmdline::try_from(spec.cmdline, CMDLINE_MAX_SIZE).map_err(|e| BootError::Cmdline(e.to_string()))?;
    for d in spec.devices {
        cmdline
            .add_virtio_mmio_device(d.size, GuestAddress(d.base), d.irq, None)
            .map_err(|e| BootError::Cmdline(format!("{e} (too many devices for {CMDLINE_MAX_SIZE} bytes?)")))?;
    }
    loader::load_cmdline(mem, GuestAddress(CMDLINE_START), &cmdline).map_err(|e| BootError::Cmdline(e.to_string()))?;
    let cmdline_len = cmdline.as_cstring().map_err(|e| BootError::Cmdline(e.to_string()))?.as_bytes().len();

    mptable::write(mem, spec.cpus)?;

    match loaded.pvh_boot_cap {
        PvhBootCapability::PvhEntryPresent(entry) => {
            write_pvh_info(mem, initrd)?;
            Ok(BootEntry::Pvh { entry, start_info: GuestAddress(PVH_INFO_START) })
        }
        _ => {
            let entry = write_zero_page(mem, &loaded, initrd, cmdline_len)?;
            Ok(BootEntry::Linux64 { entry, zero_page: GuestAddress(ZERO_PAGE_START) })
        }
    }
}

/// A bzImage decompresses itself into `[max(load, 16 MiB) aligned, + init_size)`, beyond the
/// compressed image; nothing may be placed there.
fn kernel_footprint_end(loaded: &KernelLoaderResult) -> u64 {
    match loaded.setup_header {
        Some(hdr) => {
            let align = (hdr.kernel_alignment as u64).max(PAGE_SIZE);
            let start = loaded.kernel_load.0.max(BZIMAGE_MIN_DECOMPRESS_ADDR).div_ceil(align) * align;
            loaded.kernel_end.max(start.saturating_add(hdr.init_size as u64))
        }
        None => loaded.kernel_end,
    }
}

/// Places the initrd page-aligned at the top of low RAM, above the kernel.
fn load_initrd(mem: &GuestMemory, mut file: File, kernel_end: u64) -> Result<(GuestAddress, u64), BootError> {
    let size = file.metadata().map_err(|e| BootError::Initrd(e.to_string()))?.len();
    let low_end = low_ram_end(mem);
    let addr = low_end
        .checked_sub(size)
        .map(|a| a & !(PAGE_SIZE - 1))
        .filter(|a| *a >= kernel_end)
        .ok_or(BootError::InitrdTooBig { size })?;
    mem.read_exact_volatile_from(GuestAddress(addr), &mut file, size as usize)
        .map_err(|e| BootError::Initrd(e.to_string()))?;
    Ok((GuestAddress(addr), size))
}

/// The end of the RAM region that starts at 0 (RAM below the MMIO gap).
fn low_ram_end(mem: &GuestMemory) -> u64 {
    mem.iter().find(|r| r.start_addr().0 == 0).map_or(0, |r| r.len())
}

/// RAM as the guest must see it: base memory up to the EBDA, then everything from 1 MiB, with
/// the MMIO gap left out. Types: 1 = RAM.
fn ram_map(mem: &GuestMemory) -> Vec<(u64, u64)> {
    let mut map = vec![(0, MPTABLE_START)];
    for r in mem.iter() {
        let start = r.start_addr().0.max(HIMEM_START);
        let end = r.start_addr().0 + r.len();
        if end > start {
            map.push((start, end - start));
        }
    }
    map
}

const E820_RAM: u32 = 1;
const XEN_HVM_START_MAGIC: u32 = 0x336e_c578;

fn write_pvh_info(mem: &GuestMemory, initrd: Option<(GuestAddress, u64)>) -> Result<(), BootError> {
    let memmap: Vec<hvm_memmap_table_entry> = ram_map(mem)
        .into_iter()
        .map(|(addr, size)| hvm_memmap_table_entry { addr, size, type_: E820_RAM, reserved: 0 })
        .collect();
    let mut info = hvm_start_info {
        magic: XEN_HVM_START_MAGIC,
        version: 1,
        cmdline_paddr: CMDLINE_START,
        memmap_paddr: PVH_MEMMAP_START,
        memmap_entries: memmap.len() as u32,
        ..Default::default()
    };
    let mut params;
    if let Some((addr, size)) = initrd {
        info.nr_modules = 1;
        info.modlist_paddr = PVH_MODLIST_START;
        params = BootParams::new(&info, GuestAddress(PVH_INFO_START));
        params.set_modules(
            &[hvm_modlist_entry { paddr: addr.0, size, ..Default::default() }],
            GuestAddress(PVH_MODLIST_START),
        );
    } else {
        params = BootParams::new(&info, GuestAddress(PVH_INFO_START));
    }
    params.set_sections(&memmap, GuestAddress(PVH_MEMMAP_START));
    PvhBootConfigurator::write_bootparams::<GuestMemory>(&params, mem).map_err(|e| BootError::Configure(e.to_string()))
}

// Boot protocol constants (Documentation/arch/x86/boot.rst).
const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448; // "HdrS"
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT_BYTES: u32 = 0x100_0000;
/// The 64-bit entry point is 0x200 past the start of a bzImage's protected-mode kernel.
const BZIMAGE_64BIT_ENTRY_OFFSET: u64 = 0x200;
/// `xloadflags` bit: the kernel has the 64-bit entry point at +0x200.
const XLF_KERNEL_64: u16 = 1;
/// LOAD_PHYSICAL_ADDR of x86-64 kernels: where a bzImage decompresses at the lowest.
const BZIMAGE_MIN_DECOMPRESS_ADDR: u64 = 0x100_0000;

fn write_zero_page(
    mem: &GuestMemory,
    loaded: &KernelLoaderResult,
    initrd: Option<(GuestAddress, u64)>,
    cmdline_len: usize,
) -> Result<GuestAddress, BootError> {
    let mut params = boot_params::default();
    let entry = match loaded.setup_header {
        Some(hdr) => {
            params.hdr = hdr;
            loaded.kernel_load.unchecked_add(BZIMAGE_64BIT_ENTRY_OFFSET)
        }
        None => {
            params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
            params.hdr.header = KERNEL_HDR_MAGIC;
            params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT_BYTES;
            loaded.kernel_load
        }
    };
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.cmd_line_ptr = CMDLINE_START as u32;
    params.hdr.cmdline_size = cmdline_len as u32;
    if let Some((addr, size)) = initrd {
        params.hdr.ramdisk_image = addr.0 as u32;
        params.hdr.ramdisk_size = size as u32;
    }
    let map = ram_map(mem);
    if map.len() > params.e820_table.len() {
        return Err(BootError::Configure("too many e820 entries".into()));
    }
    for (i, (addr, size)) in map.iter().enumerate() {
        params.e820_table[i] = boot_e820_entry { addr: *addr, size: *size, r#type: E820_RAM };
    }
    params.e820_entries = map.len() as u8;
    LinuxBootConfigurator::write_bootparams::<GuestMemory>(
        &BootParams::new(&params, GuestAddress(ZERO_PAGE_START)),
        mem,
    )
    .map_err(|e| BootError::Configure(e.to_string()))?;
    Ok(entry)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vstate::memory::memfd_backed;

    #[test]
    fn the_ram_map_skips_the_legacy_hole_and_the_mmio_gap() {
        let (mem, _f) = memfd_backed(64 << 20).unwrap();
        assert_eq!(ram_map(&mem), vec![(0, MPTABLE_START), (HIMEM_START, (64 << 20) - HIMEM_START)]);
    }

    #[test]
    fn a_missing_or_bogus_kernel_is_a_clear_error() {
        let (mem, _f) = memfd_backed(64 << 20).unwrap();
        let spec =
            |k: &'static str| BootSpec { kernel: Path::new(k), initrd: None, cmdline: "", cpus: 1, devices: &[] };
        let e = load(&mem, &spec("/nonexistent/vmlinux")).unwrap_err().to_string();
        assert!(e.contains("cannot open kernel /nonexistent/vmlinux"), "{e}");
        let e = load(&mem, &spec("/etc/hostname")).unwrap_err().to_string();
        assert!(e.contains("neither an ELF vmlinux nor a bzImage"), "{e}");
    }

    #[test]
    fn device_arguments_go_before_the_init_arguments() {
        let dir = std::env::temp_dir().join(format!("umbra-cmdline-{}.elf", std::process::id()));
        std::fs::write(&dir, crate::bare::BareGuest::new().reset().to_elf()).unwrap();
        let (mem, _f) = memfd_backed(32 << 20).unwrap();
        let slot = MmioSlot { base: 0xd000_0000, size: 0x1000, irq: 5 };
        let spec = BootSpec { kernel: &dir, initrd: None, cmdline: "quiet -- --agent-flag", cpus: 1, devices: &[slot] };
        load(&mem, &spec).unwrap();
        std::fs::remove_file(&dir).unwrap();
        let mut buf = [0u8; 128];
        mem.read_slice(&mut buf, GuestAddress(CMDLINE_START)).unwrap();
        let text = String::from_utf8_lossy(&buf[..buf.iter().position(|b| *b == 0).unwrap()]).into_owned();
        assert_eq!(text, "quiet virtio_mmio.device=4K@0xd0000000:5 -- --agent-flag");
    }

    #[test]
    fn an_initrd_that_does_not_fit_is_refused() {
        let dir = std::env::temp_dir().join(format!("umbra-initrd-{}", std::process::id()));
        std::fs::write(&dir, vec![0u8; 3 << 20]).unwrap();
        let (mem, _f) = memfd_backed(4 << 20).unwrap();
        let e = load_initrd(&mem, File::open(&dir).unwrap(), 2 << 20).unwrap_err();
        std::fs::remove_file(&dir).unwrap();
        assert!(matches!(e, BootError::InitrdTooBig { .. }), "{e}");
    }
}
