//! The KVM VM: its fd, the guest memory registered with it, the in-kernel interrupt
//! controllers, and the irqfd/ioeventfd plumbing that lets devices bypass the vCPU threads.

use kvm_bindings::{kvm_pit_config, kvm_userspace_memory_region, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{IoEventAddress, Kvm, VmFd};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

use super::memory::GuestMemory;
use super::VstateError;
use crate::boot::layout::KVM_TSS_ADDRESS;

pub struct Vm {
    pub kvm: Kvm,
    pub fd: VmFd,
    pub memory: GuestMemory,
}

impl Vm {
    pub fn new(memory: GuestMemory) -> Result<Self, VstateError> {
        Self::with_kvm(Kvm::new().map_err(VstateError::Kvm)?, memory)
    }

    /// The VM on a `/dev/kvm` opened earlier (umbra-vmm opens it before it enters its jail).
    pub fn with_kvm(kvm: Kvm, memory: GuestMemory) -> Result<Self, VstateError> {
        let fd = kvm.create_vm().map_err(|source| VstateError::Ioctl { step: "create VM", source })?;
        for (slot, region) in memory.iter().enumerate() {
            let host = memory
                .get_host_address(region.start_addr())
                .map_err(|e| VstateError::Memory(format!("host address of region {slot}: {e}")))?;
            let mem_region = kvm_userspace_memory_region {
                slot: slot as u32,
                flags: 0,
                guest_phys_addr: region.start_addr().0,
                memory_size: region.len(),
                userspace_addr: host as u64,
            };
            // SAFETY: the mapping behind `host` is owned by `memory`, which this Vm owns and
            // keeps alive (and mapped) for as long as the VM fd exists.
            unsafe { fd.set_user_memory_region(mem_region) }
                .map_err(|source| VstateError::Ioctl { step: "register guest memory", source })?;
        }
        Ok(Self { kvm, fd, memory })
    }

    /// The in-kernel PIC, IOAPIC, LAPICs and PIT a Linux guest needs. Must precede the vCPUs.
    pub fn setup_irqchip(&self) -> Result<(), VstateError> {
        self.fd
            .set_tss_address(KVM_TSS_ADDRESS)
            .map_err(|source| VstateError::Ioctl { step: "set TSS address", source })?;
        self.fd.create_irq_chip().map_err(|source| VstateError::Ioctl { step: "create irqchip", source })?;
        // The PC speaker port is a no-op rather than an exit per beep.
        let pit = kvm_pit_config { flags: KVM_PIT_SPEAKER_DUMMY, ..Default::default() };
        self.fd.create_pit2(pit).map_err(|source| VstateError::Ioctl { step: "create PIT", source })
    }

    /// Writes to `evt` raise `gsi` on the in-kernel irqchip.
    pub fn register_irqfd(&self, evt: &EventFd, gsi: u32) -> Result<(), VstateError> {
        self.fd.register_irqfd(evt, gsi).map_err(|source| VstateError::Ioctl { step: "register irqfd", source })
    }

    /// A 4-byte guest write of `value` at `addr` signals `evt` inside KVM, without an exit.
    pub fn register_mmio_ioeventfd(&self, evt: &EventFd, addr: u64, value: u32) -> Result<(), VstateError> {
        self.fd
            .register_ioevent(evt, &IoEventAddress::Mmio(addr), value)
            .map_err(|source| VstateError::Ioctl { step: "register ioeventfd", source })
    }
}
