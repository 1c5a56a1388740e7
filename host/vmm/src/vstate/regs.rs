//! The register state a vCPU starts in, per boot protocol.
//!
//! - PVH: 32-bit protected mode, paging off, flat segments, `%ebx` = start info.
//! - Linux x86-64 boot protocol (and bare test guests): long mode with a flat GDT and the first
//!   4 GiB identity-mapped with 2 MiB pages, `%rsi` = zero page.

use kvm_bindings::{kvm_regs, kvm_segment, kvm_sregs};
use vm_memory::{Bytes, GuestAddress};

use super::memory::GuestMemory;
use super::VstateError;
use crate::boot::layout::{GDT_START, PDPT_START, PD_START, PML4_START};

// GDT entries: null, code, data, TSS; flat base 0, limit 4 GiB.
const GDT_64: [u64; 4] = [0, 0x00af_9b00_0000_ffff, 0x00cf_9300_0000_ffff, 0x008f_8b00_0000_ffff];
const GDT_32: [u64; 4] = [0, 0x00cf_9b00_0000_ffff, 0x00cf_9300_0000_ffff, 0x008f_8b00_0000_ffff];
const CODE_SELECTOR: u16 = 0x08;
const DATA_SELECTOR: u16 = 0x10;
const TSS_SELECTOR: u16 = 0x18;

const CR0_PE: u64 = 1;
const CR0_ET: u64 = 1 << 4;
const CR0_PG: u64 = 1 << 31;
const CR4_PAE: u64 = 1 << 5;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;

/// Identity-mapped: 4 page directories of 512 × 2 MiB pages.
const IDENTITY_MAPPED_GIB: u64 = 4;

/// A kvm_segment from a GDT entry, as the CPU would load it.
fn segment(selector: u16, entry: u64) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g: ((entry >> 55) & 1) as u8,
        avl: ((entry >> 52) & 1) as u8,
        unusable: 0,
        padding: 0,
    }
}

fn oob(what: &'static str, addr: u64) -> impl Fn(vm_memory::GuestMemoryError) -> VstateError {
    move |_| VstateError::OutOfGuestMemory { what, addr }
}

fn write_gdt(mem: &GuestMemory, gdt: &[u64; 4], sregs: &mut kvm_sregs) -> Result<(), VstateError> {
    for (i, e) in gdt.iter().enumerate() {
        let addr = GDT_START + 8 * i as u64;
        mem.write_obj(*e, GuestAddress(addr)).map_err(oob("GDT", addr))?;
    }
    sregs.gdt.base = GDT_START;
    sregs.gdt.limit = (gdt.len() * 8 - 1) as u16;
    sregs.idt.base = 0;
    sregs.idt.limit = 0;
    let data = segment(DATA_SELECTOR, gdt[2]);
    sregs.cs = segment(CODE_SELECTOR, gdt[1]);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = segment(TSS_SELECTOR, gdt[3]);
    Ok(())
}

/// Long mode: GDT, identity page tables, paging on.
pub fn long_mode(mem: &GuestMemory, sregs: &mut kvm_sregs) -> Result<(), VstateError> {
    write_gdt(mem, &GDT_64, sregs)?;
    mem.write_obj(PDPT_START | 0x03, GuestAddress(PML4_START)).map_err(oob("page tables", PML4_START))?;
    for gib in 0..IDENTITY_MAPPED_GIB {
        let pd = PD_START + gib * 0x1000;
        mem.write_obj(pd | 0x03, GuestAddress(PDPT_START + gib * 8)).map_err(oob("page tables", PDPT_START))?;
        for i in 0..512u64 {
            // Present, writable, 2 MiB page.
            let page = (gib << 30) | (i << 21) | 0x83;
            mem.write_obj(page, GuestAddress(pd + i * 8)).map_err(oob("page tables", pd))?;
        }
    }
    sregs.cr3 = PML4_START;
    sregs.cr4 |= CR4_PAE;
    sregs.cr0 |= CR0_PE | CR0_PG;
    sregs.efer |= EFER_LME | EFER_LMA;
    Ok(())
}

/// PVH: 32-bit protected mode with flat segments and paging off.
pub fn protected_mode(mem: &GuestMemory, sregs: &mut kvm_sregs) -> Result<(), VstateError> {
    write_gdt(mem, &GDT_32, sregs)?;
    sregs.cr0 = CR0_PE | CR0_ET;
    sregs.cr4 = 0;
    sregs.efer = 0;
    Ok(())
}

/// General registers for an entry at `rip`: interrupts off, the given `rsi`/`rbx`/`rsp`.
pub fn entry_regs(rip: u64, rsp: u64, rsi: u64, rbx: u64) -> kvm_regs {
    kvm_regs { rip, rsp, rbp: rsp, rsi, rbx, rflags: 0x2, ..Default::default() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vstate::memory::memfd_backed;

    #[test]
    fn long_mode_identity_maps_4_gib_and_sets_the_mode_bits() {
        let (mem, _f) = memfd_backed(1 << 20).unwrap();
        let mut sregs = kvm_sregs::default();
        long_mode(&mem, &mut sregs).unwrap();
        assert_eq!(sregs.efer & (EFER_LME | EFER_LMA), EFER_LME | EFER_LMA);
        assert_eq!(sregs.cs.l, 1, "64-bit code segment");
        // The entry mapping 0xd000_0000 (virtio-mmio) is in the fourth page directory.
        let pd3 = PD_START + 3 * 0x1000;
        let idx = (0xd000_0000u64 >> 21) & 511;
        assert_eq!(mem.read_obj::<u64>(GuestAddress(pd3 + idx * 8)).unwrap(), 0xd000_0000 | 0x83);
    }

    #[test]
    fn protected_mode_has_a_32_bit_flat_code_segment() {
        let (mem, _f) = memfd_backed(1 << 20).unwrap();
        let mut sregs = kvm_sregs { cr0: CR0_PG, ..Default::default() };
        protected_mode(&mem, &mut sregs).unwrap();
        assert_eq!((sregs.cs.db, sregs.cs.l, sregs.cs.g), (1, 0, 1));
        assert_eq!(sregs.cr0 & CR0_PG, 0, "paging off");
    }
}
