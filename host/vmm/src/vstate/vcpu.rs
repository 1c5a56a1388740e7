//! A vCPU: its boot state and its run loop. The run loop turns every exit into device emulation
//! or a [`VmExit`]; nothing the guest does can make it panic.

use kvm_bindings::KVM_MAX_CPUID_ENTRIES;
use kvm_ioctls::{VcpuExit, VcpuFd};
use vm_memory::GuestAddress;

use super::vm::Vm;
use super::{cpu_model, regs, VstateError};
use crate::boot::layout::BOOT_STACK_POINTER;
use crate::boot::BootEntry;
use crate::bus::{IoBus, PioOutcome};
use crate::exit::VmExit;

pub struct Vcpu {
    pub fd: VcpuFd,
    id: u8,
}

impl Vcpu {
    /// Creates vCPU `id` of `count` with its CPUID. With an in-kernel irqchip, vCPU 0 is the
    /// boot processor and the others wait for the guest's INIT/SIPI.
    pub fn new(vm: &Vm, id: u8, count: u8) -> Result<Self, VstateError> {
        let fd = vm.fd.create_vcpu(id as u64).map_err(|source| VstateError::Ioctl { step: "create vCPU", source })?;
        let mut cpuid = vm
            .kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(|source| VstateError::Ioctl { step: "get supported CPUID", source })?;
        let tsc_deadline = vm.kvm.check_extension(kvm_ioctls::Cap::TscDeadlineTimer);
        cpu_model::patch_cpuid(&mut cpuid, id, count, tsc_deadline);
        fd.set_cpuid2(&cpuid).map_err(|source| VstateError::Ioctl { step: "set CPUID", source })?;
        Ok(Self { fd, id })
    }

    pub fn id(&self) -> u8 {
        self.id
    }

    /// Everything a Linux guest expects of a vCPU at boot: MSRs, FPU, LAPIC pins, and for the
    /// boot vCPU the entry state of the boot protocol.
    pub fn configure_linux(&self, vm: &Vm, entry: BootEntry) -> Result<(), VstateError> {
        cpu_model::set_boot_msrs(&self.fd)?;
        cpu_model::set_boot_fpu(&self.fd)?;
        cpu_model::set_lint(&self.fd)?;
        let mut sregs = self.fd.get_sregs().map_err(|source| VstateError::Ioctl { step: "get sregs", source })?;
        let r = match entry {
            BootEntry::Pvh { entry, start_info } => {
                regs::protected_mode(&vm.memory, &mut sregs)?;
                regs::entry_regs(entry.0, 0, 0, start_info.0)
            }
            BootEntry::Linux64 { entry, zero_page } => {
                regs::long_mode(&vm.memory, &mut sregs)?;
                regs::entry_regs(entry.0, BOOT_STACK_POINTER, zero_page.0, 0)
            }
        };
        self.fd.set_sregs(&sregs).map_err(|source| VstateError::Ioctl { step: "set sregs", source })?;
        self.fd.set_regs(&r).map_err(|source| VstateError::Ioctl { step: "set regs", source })
    }

    /// Puts the vCPU in 64-bit mode at `entry` with stack `rsp` (bare test guests).
    pub fn configure_long_mode(&self, vm: &Vm, entry: GuestAddress, rsp: u64) -> Result<(), VstateError> {
        let mut sregs = self.fd.get_sregs().map_err(|source| VstateError::Ioctl { step: "get sregs", source })?;
        regs::long_mode(&vm.memory, &mut sregs)?;
        self.fd.set_sregs(&sregs).map_err(|source| VstateError::Ioctl { step: "set sregs", source })?;
        self.fd
            .set_regs(&regs::entry_regs(entry.0, rsp, 0, 0))
            .map_err(|source| VstateError::Ioctl { step: "set regs", source })
    }

    /// Completes what the last exit left pending in KVM (an I/O or MMIO instruction finishes
    /// only on the next KVM_RUN) without running guest code, so the state read next is that
    /// of an instruction boundary. Call on a vCPU out of KVM_RUN before saving its state.
    pub fn settle(&mut self) -> Result<(), VstateError> {
        self.fd.set_kvm_immediate_exit(1);
        let r = self.fd.run().map(drop);
        self.fd.set_kvm_immediate_exit(0);
        match r {
            Err(e) if e.errno() == libc::EINTR => Ok(()),
            Ok(()) => Err(VstateError::Setup("KVM_RUN with immediate_exit entered the guest".into())),
            Err(source) => Err(VstateError::Ioctl { step: "complete the pending exit", source }),
        }
    }

    /// Runs until the guest ends; every exit is handled or turned into a [`VmExit`].
    pub fn run(&mut self, bus: &IoBus) -> VmExit {
        loop {
            match self.fd.run() {
                Ok(VcpuExit::IoOut(port, data)) => {
                    if bus.pio_write(port, data) == PioOutcome::Reset {
                        return VmExit::Reset;
                    }
                }
                Ok(VcpuExit::IoIn(port, data)) => bus.pio_read(port, data),
                Ok(VcpuExit::MmioRead(addr, data)) => bus.mmio_read(addr, data),
                Ok(VcpuExit::MmioWrite(addr, data)) => bus.mmio_write(addr, data),
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
