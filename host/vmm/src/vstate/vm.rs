//! The KVM VM: its fd and the guest memory registered with it.

use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::{Kvm, VmFd};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use super::memory::GuestMemory;
use super::VstateError;

pub struct Vm {
    pub kvm: Kvm,
    pub fd: VmFd,
    pub memory: GuestMemory,
}

impl Vm {
    pub fn new(memory: GuestMemory) -> Result<Self, VstateError> {
        let kvm = Kvm::new().map_err(VstateError::Kvm)?;
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
}
