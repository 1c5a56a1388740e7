//! Virtio devices (virtio 1.2) on the MMIO transport.
//!
//! Each device implements [`VirtioDevice`]: the transport ([`mmio`]) owns the register file,
//! feature negotiation and queue setup, and hands the device its ready queues on activation.
//! A device processes its queues on its own worker thread (Cloud Hypervisor's model: a slow disk
//! never stalls the vsock stream), woken by the queues' ioeventfds; the queue-processing code is
//! plain synchronous functions over guest memory so lane-(a) tests drive it without a vCPU.
//!
//! Everything read from a virtqueue is hostile: descriptor chains are walked by `virtio-queue`
//! (bounded by the queue size, so loops end) and every length and address is checked before use.
//! A malformed request fails that request; a device that cannot go on marks itself failed
//! (DEVICE_NEEDS_RESET) — the VMM never panics or hangs on guest input.

pub mod balloon;
pub mod block;
pub mod fs;
pub mod mmio;
pub mod persist;
pub mod rng;
#[cfg(test)]
pub(crate) mod test_utils;
pub mod vsock;
pub mod worker;

use std::sync::Arc;

use virtio_queue::Queue;
use vmm_sys_util::eventfd::EventFd;

use self::persist::{DeviceState, DeviceStateError};
use crate::vstate::memory::GuestMemory;

/// Virtio device IDs (virtio 1.2 §5).
pub mod device_type;
/// Feature bits shared by every device (virtio 1.2 §6).
pub mod features;

/// How a device tells the driver something happened: sets the interrupt status bit and injects
/// the device's IRQ (through an irqfd on KVM).
pub trait Interrupt: Send + Sync {
    /// Buffers were added to a used ring.
    fn signal_used_queue(&self);
    /// The configuration space changed.
    fn signal_config_change(&self);
}

/// A queue handed to a device at activation, with the eventfd the driver's notifications land on.
pub struct ActiveQueue {
    pub queue: Queue,
    pub notify: EventFd,
}

#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    #[error("the driver set up {got} queues, the device needs {want}")]
    QueueCount { want: usize, got: usize },
    #[error("cannot start the device worker: {0}")]
    Worker(std::io::Error),
    #[error("{0}")]
    Other(String),
}

impl ActivateError {
    /// Checks that the driver set up the `want` queues a device needs.
    pub(crate) fn check_queue_count(queues: &[ActiveQueue], want: usize) -> Result<(), ActivateError> {
        match queues.len() {
            got if got == want => Ok(()),
            got => Err(ActivateError::QueueCount { want, got }),
        }
    }
}

/// Copies `config[offset..]` into `data`; bytes past the end of `config` read as zero.
pub(crate) fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    for (i, byte) in data.iter_mut().enumerate() {
        *byte = offset
            .checked_add(i as u64)
            .and_then(|at| usize::try_from(at).ok())
            .and_then(|at| config.get(at).copied())
            .unwrap_or(0);
    }
}

/// A virtio device behind the MMIO transport.
pub trait VirtioDevice: Send {
    /// The virtio device ID (see [`device_type`]).
    fn device_type(&self) -> u32;
    /// The maximum size of each queue; its length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// Device-specific feature bits offered (the transport adds VIRTIO_F_VERSION_1).
    fn avail_features(&self) -> u64;
    /// Reads the device configuration space; bytes past its end read as zero.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Writes the device configuration space; most devices ignore it.
    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}
    /// Starts the device with the negotiated features and ready queues: from here on it
    /// processes requests on its own worker until reset or VM exit.
    fn activate(
        &mut self,
        mem: GuestMemory,
        interrupt: Arc<dyn Interrupt>,
        acked_features: u64,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError>;
    /// Stops the device for a snapshot (its worker joined between batches, so every buffer it
    /// took is used) and returns the state the transport cannot see (virtio-fs: virtiofsd's; see
    /// [`persist`]). By default the device is reset and has no state of its own.
    fn quiesce(&mut self) -> Result<DeviceState, DeviceStateError> {
        if self.reset() {
            Ok(DeviceState::Stateless)
        } else {
            Err(DeviceStateError::CannotStop)
        }
    }
    /// Stops the device for a live fork: as [`VirtioDevice::quiesce`], but the VM runs on
    /// afterwards, activated again by its transport over the same queues
    /// ([`super::mmio::MmioTransport::resume`]), so whatever the device holds for the running
    /// guest (vsock's connections) must survive. By default the same as `quiesce`.
    fn suspend(&mut self) -> Result<DeviceState, DeviceStateError> {
        self.quiesce()
    }
    /// Called on a device about to be activated by a restored transport (the driver set it up
    /// in the VM the snapshot was taken of), with what [`VirtioDevice::quiesce`] returned: e.g.
    /// vsock tells the driver its connections are gone, virtio-fs loads virtiofsd's state.
    fn prepare_restore(&mut self, state: &DeviceState) -> Result<(), DeviceStateError> {
        state.expect_stateless()
    }
    /// Stops the worker and drops the queues, so the driver can set the device up again.
    /// Returns false if the device cannot be reset (the transport then marks it failed).
    fn reset(&mut self) -> bool {
        false
    }
}
