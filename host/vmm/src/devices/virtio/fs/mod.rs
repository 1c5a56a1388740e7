//! virtio-fs (virtio 1.2 §5.11) as a vhost-user frontend: the file server is `virtiofsd`, a
//! separate sandboxed process per shared folder (DESIGN §4), and this device only wires the guest's
//! virtqueues to it.
//!
//! The data path never enters the VMM: virtiofsd maps guest memory (the memfd behind
//! [`crate::vstate::memory::memfd_backed`], sent over the socket), waits on the queues' ioeventfds
//! (so a guest kick goes from KVM straight to virtiofsd) and signals one "call" eventfd per queue
//! when it has used buffers. The call eventfds cannot be the device's irqfd, because the MMIO
//! transport must set its interrupt-status bit before the IRQ is injected; a small thread
//! ([`call_forwarder`]) turns each call into [`Interrupt::signal_used_queue`].
//!
//! Files: [`device`] is the virtio device (features, the `tag` config space, activation and reset);
//! [`backend`] is the vhost-user connection (feature negotiation, memory table, starting and
//! stopping rings, saving and loading virtiofsd's state for snapshots, through [`transfer`]);
//! [`watchdog`] puts a deadline on each phase of that conversation, so a stuck
//! backend fails the device instead of hanging a vCPU; [`call_forwarder`] is the interrupt
//! thread, which also notices when virtiofsd hangs up.
//!
//! [`Interrupt::signal_used_queue`]: super::Interrupt::signal_used_queue

pub mod backend;
pub mod call_forwarder;
pub mod device;
mod transfer;
pub mod watchdog;

#[cfg(test)]
mod tests;

pub use backend::FsError;

pub use device::{FsDevice, MAX_TAG_LEN, NUM_QUEUES, QUEUE_SIZE};
