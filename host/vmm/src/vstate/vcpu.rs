//! A vCPU: its boot state and its run loop.
//!
//! Boot state follows the x86-64 Linux boot protocol's 64-bit entry (and Firecracker's layout):
//! a flat GDT, identity-mapped page tables for the first 1 GiB with 2 MiB pages, paging and long
//! mode on, interrupts off. The run loop turns every exit into device emulation or a [`VmExit`];
//! nothing the guest does can make it panic.

use kvm_bindings::{kvm_regs, kvm_segment, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{VcpuExit, VcpuFd};
use vm_memory::{Bytes, GuestAddress};

use super::vm::Vm;
use super::VstateError;
use crate::devices::legacy::LegacyBus;
use crate::exit::VmExit;

// Guest-physical layout of the boot structures (below 1 MiB, like Firecracker's).
const GDT_ADDR: u64 = 0x500;
const PML4_ADDR: u64 = 0x9000;
const PDPT_ADDR: u64 = 0xa000;
const PD_ADDR: u64 = 0xb000;

// GDT entries: null, 64-bit code, data, TSS. Flat base 0, limit 4 GiB.
const GDT: [u64; 4] = [0, 0x00af_9b00_0000_ffff, 0x00cf_9300_0000_ffff, 0x008f_8b00_0000_ffff];
const CODE_SELECTOR: u16 = 0x08;
const DATA_SELECTOR: u16 = 0x10;
const TSS_SELECTOR: u16 = 0x18;

const CR0_PE: u64 = 1;
const CR0_PG: u64 = 1 << 31;
const CR4_PAE: u64 = 1 << 5;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;

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

pub struct Vcpu {
    pub fd: VcpuFd,
}

impl Vcpu {
    pub fn new(vm: &Vm, id: u64) -> Result<Self, VstateError> {
        let fd = vm.fd.create_vcpu(id).map_err(|source| VstateError::Ioctl { step: "create vCPU", source })?;
        let cpuid = vm
            .kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(|source| VstateError::Ioctl { step: "get supported CPUID", source })?;
        fd.set_cpuid2(&cpuid).map_err(|source| VstateError::Ioctl { step: "set CPUID", source })?;
        Ok(Self { fd })
    }

    /// Puts the vCPU in 64-bit mode at `entry` with stack `rsp`, writing the GDT and page
    /// tables into guest memory.
    pub fn configure_long_mode(&self, vm: &Vm, entry: GuestAddress, rsp: u64) -> Result<(), VstateError> {
        let mem = &vm.memory;
        let oob = |what| move |_| VstateError::OutOfGuestMemory { what, addr: 0 };
        for (i, e) in GDT.iter().enumerate() {
            mem.write_obj(*e, GuestAddress(GDT_ADDR + 8 * i as u64)).map_err(oob("GDT"))?;
        }
        mem.write_obj(PDPT_ADDR | 0x03, GuestAddress(PML4_ADDR)).map_err(oob("page tables"))?;
        mem.write_obj(PD_ADDR | 0x03, GuestAddress(PDPT_ADDR)).map_err(oob("page tables"))?;
        for i in 0..512u64 {
            // Present, writable, 2 MiB page.
            mem.write_obj((i << 21) | 0x83, GuestAddress(PD_ADDR + i * 8)).map_err(oob("page tables"))?;
        }

        let mut sregs = self.fd.get_sregs().map_err(|source| VstateError::Ioctl { step: "get sregs", source })?;
        sregs.gdt.base = GDT_ADDR;
        sregs.gdt.limit = (GDT.len() * 8 - 1) as u16;
        sregs.idt.base = 0;
        sregs.idt.limit = 0;
        let data = segment(DATA_SELECTOR, GDT[2]);
        sregs.cs = segment(CODE_SELECTOR, GDT[1]);
        sregs.ds = data;
        sregs.es = data;
        sregs.fs = data;
        sregs.gs = data;
        sregs.ss = data;
        sregs.tr = segment(TSS_SELECTOR, GDT[3]);
        sregs.cr3 = PML4_ADDR;
        sregs.cr4 |= CR4_PAE;
        sregs.cr0 |= CR0_PE | CR0_PG;
        sregs.efer |= EFER_LME | EFER_LMA;
        self.fd.set_sregs(&sregs).map_err(|source| VstateError::Ioctl { step: "set sregs", source })?;

        let regs = kvm_regs { rip: entry.0, rsp, rbp: rsp, rflags: 0x2, ..Default::default() };
        self.fd.set_regs(&regs).map_err(|source| VstateError::Ioctl { step: "set regs", source })?;
        Ok(())
    }

    /// Runs until the guest ends; every exit is handled or turned into a [`VmExit`].
    pub fn run(&mut self, bus: &mut LegacyBus) -> VmExit {
        loop {
            match self.fd.run() {
                Ok(VcpuExit::IoOut(port, data)) => {
                    bus.write(port, data);
                    if bus.i8042.reset_requested() {
                        return VmExit::Reset;
                    }
                }
                Ok(VcpuExit::IoIn(port, data)) => bus.read(port, data),
                // No MMIO devices yet: reads see all ones, writes are dropped.
                Ok(VcpuExit::MmioRead(_, data)) => data.fill(0xff),
                Ok(VcpuExit::MmioWrite(..)) => {}
                Ok(VcpuExit::Hlt) => return VmExit::Halted,
                Ok(VcpuExit::Shutdown) => return VmExit::TripleFault,
                Ok(VcpuExit::SystemEvent(kind, _)) => return VmExit::Internal(format!("system event {kind}")),
                Ok(VcpuExit::FailEntry(reason, cpu)) => {
                    return VmExit::Internal(format!("KVM could not enter the guest (reason {reason:#x}, cpu {cpu})"))
                }
                Ok(VcpuExit::InternalError) => return VmExit::Internal("KVM internal error".into()),
                Ok(other) => return VmExit::Internal(format!("unhandled vCPU exit {other:?}")),
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => continue,
                Err(e) => return VmExit::Internal(format!("KVM_RUN failed: {e}")),
            }
        }
    }
}
