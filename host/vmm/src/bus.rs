//! The guest's I/O buses: port I/O for the legacy devices, MMIO for the virtio-mmio windows.
//! Shared by every vCPU thread; each device sits behind its own lock so vCPUs touching
//! different devices do not serialise.

use std::sync::Mutex;

use crate::devices::legacy::LegacyBus;
use crate::devices::virtio::mmio::{MmioTransport, TransportState, MMIO_WINDOW};

pub struct IoBus {
    legacy: Mutex<LegacyBus>,
    mmio: Vec<(u64, Mutex<MmioTransport>)>,
}

/// What a port write asked of the VMM.
#[derive(Debug, PartialEq, Eq)]
pub enum PioOutcome {
    Continue,
    /// The guest pulsed the reset line (i8042 command 0xFE).
    Reset,
}

impl IoBus {
    /// `mmio` lists each device with the base of its window.
    pub fn new(legacy: LegacyBus, mmio: Vec<(u64, MmioTransport)>) -> Self {
        Self { legacy: Mutex::new(legacy), mmio: mmio.into_iter().map(|(base, t)| (base, Mutex::new(t))).collect() }
    }

    /// The serial port's state, for a snapshot.
    pub fn serial_state(&self) -> crate::devices::legacy::SerialSnapshot {
        self.legacy.lock().unwrap_or_else(|p| p.into_inner()).serial.save()
    }

    /// The virtio device types, in the order of their windows.
    pub fn device_types(&self) -> Vec<u32> {
        self.mmio.iter().map(|(_, t)| t.lock().unwrap_or_else(|p| p.into_inner()).device_type()).collect()
    }

    /// Stops every virtio device (its worker joined, between batches) and returns each
    /// transport's state, for a snapshot; the devices do not run again.
    pub fn quiesce(&self) -> Result<Vec<TransportState>, String> {
        self.mmio
            .iter()
            .map(|(base, t)| {
                t.lock().unwrap_or_else(|p| p.into_inner()).quiesce().map_err(|e| format!("device at {base:#x}: {e}"))
            })
            .collect()
    }

    /// Stops every virtio device between batches for a live fork ([`MmioTransport::suspend`])
    /// and returns each transport's state; [`IoBus::resume`] starts them again.
    pub fn suspend(&self) -> Result<Vec<TransportState>, String> {
        let mut states = Vec::with_capacity(self.mmio.len());
        for (i, (base, t)) in self.mmio.iter().enumerate() {
            match t.lock().unwrap_or_else(|p| p.into_inner()).suspend() {
                Ok(state) => states.push(state),
                Err(e) => {
                    // The ones stopped already run again: the fork is refused, the VM runs on.
                    // Not the one that refused: it either runs still (it refused before
                    // stopping) or cannot start again anyway.
                    let undo = self.resume_first(i);
                    let undo = undo.err().map(|u| format!("; and starting the others again: {u}")).unwrap_or_default();
                    return Err(format!("device at {base:#x}: {e}{undo}"));
                }
            }
        }
        Ok(states)
    }

    /// Each transport's registers as they are now, with the device states [`IoBus::suspend`]
    /// returned: for a fork whose guest ran on while its devices were stopped (the driver may
    /// have acknowledged interrupts meanwhile).
    pub fn transport_states(&self, suspended: Vec<TransportState>) -> Vec<TransportState> {
        self.mmio
            .iter()
            .zip(suspended)
            .map(|((_, t), before)| t.lock().unwrap_or_else(|p| p.into_inner()).fork_state(before.device))
            .collect()
    }

    /// Starts every device [`IoBus::suspend`] stopped. Each is tried; the first error says
    /// which failed (those are marked failed for the driver).
    pub fn resume(&self) -> Result<(), String> {
        self.resume_first(self.mmio.len())
    }

    fn resume_first(&self, count: usize) -> Result<(), String> {
        let mut first = Ok(());
        for (base, t) in &self.mmio[..count] {
            if let Err(e) = t.lock().unwrap_or_else(|p| p.into_inner()).resume() {
                if first.is_ok() {
                    first = Err(format!("device at {base:#x}: {e}"));
                }
            }
        }
        first
    }

    pub fn pio_write(&self, port: u16, data: &[u8]) -> PioOutcome {
        let mut legacy = self.legacy.lock().unwrap_or_else(|p| p.into_inner());
        legacy.write(port, data);
        if legacy.i8042.reset_requested() {
            PioOutcome::Reset
        } else {
            PioOutcome::Continue
        }
    }

    pub fn pio_read(&self, port: u16, data: &mut [u8]) {
        self.legacy.lock().unwrap_or_else(|p| p.into_inner()).read(port, data);
    }

    fn find(&self, addr: u64) -> Option<(&Mutex<MmioTransport>, u64)> {
        self.mmio
            .iter()
            .find(|(base, _)| addr >= *base && addr - *base < MMIO_WINDOW)
            .map(|(base, dev)| (dev, addr - base))
    }

    /// Reads from an address no device claims see all ones, as on real hardware.
    pub fn mmio_read(&self, addr: u64, data: &mut [u8]) {
        match self.find(addr) {
            Some((dev, offset)) => dev.lock().unwrap_or_else(|p| p.into_inner()).read(offset, data),
            None => data.fill(0xff),
        }
    }

    pub fn mmio_write(&self, addr: u64, data: &[u8]) {
        if let Some((dev, offset)) = self.find(addr) {
            dev.lock().unwrap_or_else(|p| p.into_inner()).write(offset, data);
        }
    }
}
