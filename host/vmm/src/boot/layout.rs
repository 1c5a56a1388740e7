//! The guest-physical memory map of an Umbra microVM (x86-64), in one place.
//!
//! ```text
//! 0x0000_0500  GDT                     0x0000_6000  PVH start info (+ module list at 0x6040)
//! 0x0000_7000  zero page / PVH memmap  0x0000_8ff0  boot stack (64-bit boot protocol)
//! 0x0000_9000  page tables (PML4, PDPT, 4 PDs: the first 4 GiB identity-mapped)
//! 0x0002_0000  kernel command line     0x0009_fc00  MP table (EBDA) .. 1 MiB reserved
//! 0x0010_0000  kernel ...  initrd at the top of low RAM
//! 0xc000_0000  MMIO gap: virtio-mmio windows from 0xd000_0000, IOAPIC, LAPIC; RAM resumes at 4 GiB
//! ```

pub const GDT_START: u64 = 0x500;
pub const PVH_INFO_START: u64 = 0x6000;
pub const PVH_MODLIST_START: u64 = 0x6040;
pub const PVH_MEMMAP_START: u64 = 0x7000;
pub const ZERO_PAGE_START: u64 = 0x7000;
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
pub const PML4_START: u64 = 0x9000;
pub const PDPT_START: u64 = 0xa000;
pub const PD_START: u64 = 0xb000;
pub const CMDLINE_START: u64 = 0x2_0000;
/// x86 Linux keeps COMMAND_LINE_SIZE = 2048 bytes (with the NUL); anything longer is cut.
pub const CMDLINE_MAX_SIZE: usize = 2048;
pub const MPTABLE_START: u64 = 0x9_fc00;
pub const HIMEM_START: u64 = 0x10_0000;

/// RAM below this, the rest above 4 GiB: the gap holds the MMIO windows and the APICs.
pub const MMIO_GAP_START: u64 = 0xc000_0000;
pub const MMIO_GAP_END: u64 = 1 << 32;
pub const VIRTIO_MMIO_START: u64 = 0xd000_0000;
pub const IOAPIC_ADDR: u32 = 0xfec0_0000;
pub const APIC_ADDR: u32 = 0xfee0_0000;

/// IRQs 0–4 belong to the PIT, keyboard, cascade and COM ports; virtio devices take 5 onwards.
pub const SERIAL_IRQ: u32 = 4;
pub const VIRTIO_IRQ_START: u32 = 5;
/// The IOAPIC has 24 pins.
pub const IRQ_MAX: u32 = 23;

/// Where KVM keeps its TSS (three pages just below the BIOS area, as Firecracker does).
pub const KVM_TSS_ADDRESS: usize = 0xfffb_d000;

pub const PAGE_SIZE: u64 = 4096;
