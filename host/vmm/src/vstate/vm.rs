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
        let vm = Self { kvm, fd, memory };
        vm.register_memory(0, "register guest memory")?;
        Ok(vm)
    }

    /// Registers (or registers again, with new `flags`) every memory region as a slot, in
    /// region order.
    fn register_memory(&self, flags: u32, step: &'static str) -> Result<(), VstateError> {
        for (slot, region) in self.memory.iter().enumerate() {
            let host = self
                .memory
                .get_host_address(region.start_addr())
                .map_err(|e| VstateError::Memory(format!("host address of region {slot}: {e}")))?;
            let mem_region = kvm_userspace_memory_region {
                slot: slot as u32,
                flags,
                guest_phys_addr: region.start_addr().0,
                memory_size: region.len(),
                userspace_addr: host as u64,
            };
            // SAFETY: the mapping behind `host` is owned by `memory`, which this Vm owns and
            // keeps alive (and mapped) for as long as the VM fd exists; a slot registered again
            // keeps its address and size and changes only its flags.
            unsafe { self.fd.set_user_memory_region(mem_region) }
                .map_err(|source| VstateError::Ioctl { step, source })?;
        }
        Ok(())
    }

    /// Starts or stops KVM's dirty-page log over all guest memory (a live fork's pre-copy):
    /// from the start, every page a vCPU (or KVM itself, for the guest) writes is recorded
    /// until [`Vm::take_dirty_pages`] reads it.
    pub fn set_dirty_logging(&self, on: bool) -> Result<(), VstateError> {
        let flags = if on { kvm_bindings::KVM_MEM_LOG_DIRTY_PAGES } else { 0 };
        self.register_memory(flags, "switch the dirty-page log")
    }

    /// The guest-physical addresses of the pages written since logging started or the last
    /// call (the log is cleared as it is read).
    pub fn take_dirty_pages(&self) -> Result<Vec<u64>, VstateError> {
        const PAGE: u64 = 4096;
        let mut pages = Vec::new();
        for (slot, region) in self.memory.iter().enumerate() {
            let bitmap = self
                .fd
                .get_dirty_log(slot as u32, region.len() as usize)
                .map_err(|source| VstateError::Ioctl { step: "read the dirty-page log", source })?;
            for (word_index, word) in bitmap.iter().enumerate() {
                let mut bits = *word;
                while bits != 0 {
                    let bit = bits.trailing_zeros() as u64;
                    bits &= bits - 1;
                    pages.push(region.start_addr().0 + (word_index as u64 * 64 + bit) * PAGE);
                }
            }
        }
        Ok(pages)
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
