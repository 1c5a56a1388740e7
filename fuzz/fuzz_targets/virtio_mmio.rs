//! A guest's register accesses to a virtio-mmio device: any sequence of reads and writes, of any
//! size, at any offset, with queue addresses anywhere — the transport must validate it all
//! against guest memory, never panic, and activate the device only with a sound setup.
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use umbra_vmm::devices::virtio::mmio::MmioTransport;
use umbra_vmm::devices::virtio::{ActivateError, ActiveQueue, Interrupt, VirtioDevice};
use umbra_vmm::vstate::memory::GuestMemory;
use vm_memory::GuestAddress;

/// A device with two queues and a small config space that accepts any activation.
struct Dummy {
    config: [u8; 8],
}

impl VirtioDevice for Dummy {
    fn device_type(&self) -> u32 {
        4
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[16, 256]
    }
    fn avail_features(&self) -> u64 {
        1 << 5
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            *b = self.config.get(offset as usize + i).copied().unwrap_or(0);
        }
    }
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        for (i, b) in data.iter().enumerate() {
            if let Some(slot) = self.config.get_mut(offset as usize + i) {
                *slot = *b;
            }
        }
    }
    fn activate(
        &mut self,
        _mem: GuestMemory,
        _interrupt: Arc<dyn Interrupt>,
        _acked_features: u64,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError> {
        assert!(!queues.is_empty() && queues.len() <= 2, "activated with {} queues", queues.len());
        Ok(())
    }
    fn reset(&mut self) -> bool {
        true
    }
}

fuzz_target!(|data: &[u8]| {
    thread_local! {
        static MEM: GuestMemory = GuestMemory::from_ranges(&[(GuestAddress(0), 64 << 10)]).unwrap();
    }
    let mem = MEM.with(Clone::clone);
    let Ok(mut transport) = MmioTransport::new(Box::new(Dummy { config: [0; 8] }), mem) else { return };
    // Each access: 1 byte op (bit 0 write, bits 1-2 size), 2 bytes offset, 4 bytes value.
    for op in data.chunks_exact(7) {
        let size = [1usize, 2, 4, 8][usize::from(op[0] >> 1 & 3)];
        let offset = u64::from(u16::from_le_bytes([op[1], op[2]])) & 0x1ff;
        let value = u64::from(u32::from_le_bytes([op[3], op[4], op[5], op[6]])).to_le_bytes();
        if op[0] & 1 == 1 {
            transport.write(offset, &value[..size]);
        } else {
            let mut buf = [0u8; 8];
            transport.read(offset, &mut buf[..size]);
        }
    }
});
