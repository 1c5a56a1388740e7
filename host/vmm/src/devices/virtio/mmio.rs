//! The virtio-mmio transport (virtio 1.2 §4.2), version 2 ("modern") register layout.
//!
//! The register file is driven by vCPU MMIO exits; queue notifications normally bypass it
//! through ioeventfds (KVM signals the queue's eventfd on a write to QueueNotify without leaving
//! the kernel), and interrupts go out through an irqfd. Every register access from the guest is
//! bounds- and state-checked: an out-of-range queue index, a misaligned or odd-sized access, or a
//! queue set up with an invalid layout never reaches the device.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use virtio_queue::{Queue, QueueT};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::persist::{DeviceState, DeviceStateError, FsState};
use super::{features, ActiveQueue, Interrupt, VirtioDevice};
use crate::vstate::memory::GuestMemory;

/// Size of one device's MMIO window.
pub const MMIO_WINDOW: u64 = 0x1000;
/// Offset of QueueNotify, where the ioeventfds are registered.
pub const QUEUE_NOTIFY_OFFSET: u64 = 0x50;

const MAGIC: u32 = 0x7472_6976; // "virt"
const VERSION: u32 = 2;
const VENDOR_ID: u32 = 0x4255_4d55; // "UMUB"
const CONFIG_SPACE: u64 = 0x100;

pub const INTERRUPT_USED_RING: u32 = 1;
pub const INTERRUPT_CONFIG: u32 = 2;

mod status {
    pub const ACKNOWLEDGE: u32 = 1;
    pub const DRIVER: u32 = 2;
    pub const DRIVER_OK: u32 = 4;
    pub const FEATURES_OK: u32 = 8;
    pub const DEVICE_NEEDS_RESET: u32 = 64;
    pub const FAILED: u32 = 128;
}

/// The interrupt line of one device: the status register plus an eventfd that injects the IRQ
/// (an irqfd registered with KVM's in-kernel irqchip).
pub struct MmioInterrupt {
    status: Arc<AtomicU32>,
    irq: EventFd,
}

impl MmioInterrupt {
    fn raise(&self, bit: u32) {
        self.status.fetch_or(bit, Ordering::SeqCst);
        // A full eventfd counter (2^64-2 pending) still means "pending": nothing to do.
        let _ = self.irq.write(1);
    }
}

impl Interrupt for MmioInterrupt {
    fn signal_used_queue(&self) {
        self.raise(INTERRUPT_USED_RING);
    }
    fn signal_config_change(&self) {
        self.raise(INTERRUPT_CONFIG);
    }
}

/// One device on the MMIO transport.
pub struct MmioTransport {
    device: Box<dyn VirtioDevice>,
    mem: GuestMemory,
    queues: Vec<Queue>,
    queue_evts: Vec<EventFd>,
    interrupt_status: Arc<AtomicU32>,
    irq: EventFd,
    device_features_sel: u32,
    driver_features_sel: u32,
    acked_features: u64,
    queue_sel: u32,
    status: u32,
    config_generation: u32,
    activated: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("cannot create an eventfd: {0}")]
    EventFd(std::io::Error),
    #[error("invalid queue size {0}: virtio queues are a power of two up to 32768")]
    QueueSize(u16),
    #[error("cannot save virtio device {device_type}: {source}")]
    Save { device_type: u32, source: DeviceStateError },
    #[error("cannot restore virtio device {device_type}: {source}")]
    Restore { device_type: u32, source: RestoreError },
}

/// Why a saved transport does not fit the device it is restored around.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("the machine has device {0} in its place")]
    DeviceType(u32),
    #[error("{saved} queues saved, the device has {device}")]
    QueueCount { saved: usize, device: usize },
    #[error("queue {queue}: size {size}: {source}")]
    QueueSize { queue: usize, size: u16, source: virtio_queue::Error },
    #[error("queue {queue}: used ring at {addr:#x}: {source}")]
    UsedRing { queue: usize, addr: u64, source: vm_memory::GuestMemoryError },
    #[error("it did not activate again (see the log above)")]
    NotActivated,
    #[error(transparent)]
    Device(#[from] DeviceStateError),
    #[error("its format-2 device state is not base64: {0}")]
    LegacyState(base64::DecodeError),
}

/// A transport's state in a snapshot: its registers and each queue's configuration.
///
/// Queue positions are not kept. A device is quiesced with every buffer it took from a queue
/// used (its worker stops between batches, and each batch uses what it pops), so a queue's
/// next available and next used index both equal the used ring's index in the saved memory;
/// [`MmioTransport::restore`] reads them from there.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TransportState {
    pub device_type: u32,
    pub status: u32,
    pub acked_features: u64,
    pub device_features_sel: u32,
    pub driver_features_sel: u32,
    pub queue_sel: u32,
    pub config_generation: u32,
    pub interrupt_status: u32,
    pub activated: bool,
    pub queues: Vec<QueueConfig>,
    /// What the device itself keeps beyond the transport ([`VirtioDevice::quiesce`]).
    #[serde(default)]
    pub device: DeviceState,
    /// Format 2's form of `device`: base64 bytes (virtiofsd's state for virtio-fs, empty for
    /// every other device). Read so that a session paused before the upgrade still resumes;
    /// never written.
    #[serde(default, rename = "device_state", skip_serializing)]
    pub legacy_device_state: Option<String>,
}

impl TransportState {
    /// The device's saved state, from either format.
    fn device_state(&self) -> Result<DeviceState, RestoreError> {
        use base64::Engine as _;
        let Some(text) = &self.legacy_device_state else { return Ok(self.device.clone()) };
        let bytes = base64::engine::general_purpose::STANDARD.decode(text).map_err(RestoreError::LegacyState)?;
        // Only virtio-fs kept bytes in format 2; any other device refuses them in its restore.
        Ok(match bytes.is_empty() {
            true => DeviceState::Stateless,
            false => DeviceState::Fs(FsState { virtiofsd: bytes }),
        })
    }
}

/// What the driver set up for one queue.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QueueConfig {
    pub size: u16,
    pub ready: bool,
    pub desc_table: u64,
    pub avail_ring: u64,
    pub used_ring: u64,
}

impl MmioTransport {
    pub fn new(device: Box<dyn VirtioDevice>, mem: GuestMemory) -> Result<Self, TransportError> {
        let mut queues = Vec::new();
        let mut queue_evts = Vec::new();
        for &max in device.queue_max_sizes() {
            queues.push(Queue::new(max).map_err(|_| TransportError::QueueSize(max))?);
            queue_evts.push(EventFd::new(EFD_NONBLOCK).map_err(TransportError::EventFd)?);
        }
        Ok(Self {
            device,
            mem,
            queues,
            queue_evts,
            interrupt_status: Arc::new(AtomicU32::new(0)),
            irq: EventFd::new(EFD_NONBLOCK).map_err(TransportError::EventFd)?,
            device_features_sel: 0,
            driver_features_sel: 0,
            acked_features: 0,
            queue_sel: 0,
            status: 0,
            config_generation: 0,
            activated: false,
        })
    }

    /// The transport's registers and queue configuration, for a snapshot. The device must be
    /// quiesced (see [`TransportState`]).
    pub fn save(&self) -> TransportState {
        TransportState {
            device: DeviceState::Stateless,
            legacy_device_state: None,
            device_type: self.device.device_type(),
            status: self.status,
            acked_features: self.acked_features,
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            queue_sel: self.queue_sel,
            config_generation: self.config_generation,
            interrupt_status: self.interrupt_status.load(Ordering::SeqCst),
            activated: self.activated,
            queues: self
                .queues
                .iter()
                .map(|q| QueueConfig {
                    size: q.size(),
                    ready: q.ready(),
                    desc_table: q.desc_table(),
                    avail_ring: q.avail_ring(),
                    used_ring: q.used_ring(),
                })
                .collect(),
        }
    }

    /// The transport of `device` (new, of the type and queue count that was saved) as `state`
    /// left it, over the restored guest memory. An activated device is activated again with
    /// its queues resuming at the used ring's index, so the driver sees nothing change; one
    /// that cannot be (a queue outside memory, a device that refuses) is an error here, not a
    /// failed device in the restored guest.
    pub fn restore(
        device: Box<dyn VirtioDevice>,
        mem: GuestMemory,
        state: &TransportState,
    ) -> Result<Self, TransportError> {
        let device_type = state.device_type;
        let refuse = |source: RestoreError| TransportError::Restore { device_type, source };
        if device.device_type() != device_type {
            return Err(refuse(RestoreError::DeviceType(device.device_type())));
        }
        let mut device = device;
        device.prepare_restore(&state.device_state().map_err(refuse)?).map_err(|e| refuse(e.into()))?;
        let mut t = Self::new(device, mem)?;
        if t.queues.len() != state.queues.len() {
            return Err(refuse(RestoreError::QueueCount { saved: state.queues.len(), device: t.queues.len() }));
        }
        for (i, (q, c)) in t.queues.iter_mut().zip(&state.queues).enumerate() {
            q.try_set_size(c.size)
                .map_err(|source| refuse(RestoreError::QueueSize { queue: i, size: c.size, source }))?;
            q.set_desc_table_address(Some(c.desc_table as u32), Some((c.desc_table >> 32) as u32));
            q.set_avail_ring_address(Some(c.avail_ring as u32), Some((c.avail_ring >> 32) as u32));
            q.set_used_ring_address(Some(c.used_ring as u32), Some((c.used_ring >> 32) as u32));
            q.set_ready(c.ready);
        }
        if state.activated {
            t.queues_from_used_rings().map_err(refuse)?;
        }
        t.acked_features = state.acked_features & t.avail_features();
        t.device_features_sel = state.device_features_sel;
        t.driver_features_sel = state.driver_features_sel;
        t.queue_sel = state.queue_sel;
        t.config_generation = state.config_generation;
        t.status = state.status;
        // Before activation: the worker it starts may set a bit of its own at once (vsock's
        // reset event), which a later store would wipe.
        t.interrupt_status.store(state.interrupt_status, Ordering::SeqCst);
        if state.activated {
            t.activate();
            if !t.activated {
                return Err(refuse(RestoreError::NotActivated));
            }
            // The driver may have queued buffers and notified the VM the state was taken of
            // (a live fork's guest runs on while its devices are stopped): the notifications
            // went there. One notification per queue makes the device look at what is queued.
            t.notify_queues();
        }
        if state.interrupt_status != 0 {
            // An interrupt the driver had not acknowledged yet: raise it again (a spurious one
            // costs the driver one status read).
            let _ = t.irq.write(1);
        }
        Ok(t)
    }

    /// Sets each ready queue's next available and next used index to its used ring's index:
    /// where a device quiesced between batches left it (see [`TransportState`]).
    fn queues_from_used_rings(&mut self) -> Result<(), RestoreError> {
        for (i, q) in self.queues.iter_mut().enumerate() {
            if !q.ready() {
                continue;
            }
            let used_ring = q.used_ring();
            // struct virtq_used { le16 flags; le16 idx; ... }
            let idx: u16 = vm_memory::Bytes::read_obj(&self.mem, vm_memory::GuestAddress(used_ring.wrapping_add(2)))
                .map_err(|source| RestoreError::UsedRing { queue: i, addr: used_ring, source })?;
            q.set_next_avail(idx);
            q.set_next_used(idx);
        }
        Ok(())
    }

    /// [`MmioTransport::quiesce`] for a live fork: the device stops between batches
    /// ([`VirtioDevice::suspend`]) and [`MmioTransport::resume`] starts it again in this VM.
    pub fn suspend(&mut self) -> Result<TransportState, TransportError> {
        let device = if self.activated {
            let device_type = self.device.device_type();
            self.device.suspend().map_err(|source| TransportError::Save { device_type, source })?
        } else {
            DeviceState::Stateless
        };
        Ok(self.fork_state(device))
    }

    /// The transport's registers as they are now, with `device` (what [`MmioTransport::suspend`]
    /// returned), as a fork records them. An activated device's used-ring interrupt is set: a
    /// batch the device finished while it stopped may have signalled an interrupt nobody
    /// forwarded (virtio-fs: virtiofsd completing the request GET_VRING_BASE waited for), and a
    /// spurious one costs the driver a look at its rings.
    pub fn fork_state(&self, device: DeviceState) -> TransportState {
        let mut state = self.save();
        state.device = device;
        if state.activated {
            state.interrupt_status |= INTERRUPT_USED_RING;
        }
        state
    }

    /// Starts a device [`MmioTransport::suspend`] stopped, over the same queues, each going on
    /// from its used ring's index: the driver sees nothing change. A device that does not
    /// start again is failed (DEVICE_NEEDS_RESET), and the error says why.
    pub fn resume(&mut self) -> Result<(), TransportError> {
        if !self.activated {
            return Ok(());
        }
        let device_type = self.device.device_type();
        self.activated = false;
        if let Err(source) = self.queues_from_used_rings() {
            self.fail();
            return Err(TransportError::Restore { device_type, source });
        }
        self.activate();
        if !self.activated {
            return Err(TransportError::Restore { device_type, source: RestoreError::NotActivated });
        }
        // What finished while the device was stopped may have signalled no one (see
        // `fork_state`): the driver looks at its rings once more, and so does the device.
        self.interrupt_status.fetch_or(INTERRUPT_USED_RING, Ordering::SeqCst);
        let _ = self.irq.write(1);
        self.notify_queues();
        Ok(())
    }

    /// Signals every queue's notification eventfd once, as a driver's notify would: a device
    /// with nothing queued finds nothing.
    fn notify_queues(&self) {
        for (q, evt) in self.queues.iter().zip(&self.queue_evts) {
            if q.ready() {
                let _ = evt.write(1);
            }
        }
    }

    /// Saves the transport's state and stops the device (its worker joined between batches, so
    /// every buffer it took is used): what a snapshot records. The device does not run again.
    pub fn quiesce(&mut self) -> Result<TransportState, TransportError> {
        // Stopped first, then saved: a batch the worker finishes meanwhile sets its interrupt
        // bit before the status is read, so the restored VM raises it again.
        let device = if self.activated {
            let device_type = self.device.device_type();
            self.device.quiesce().map_err(|source| TransportError::Save { device_type, source })?
        } else {
            DeviceState::Stateless
        };
        let mut state = self.save();
        state.device = device;
        self.activated = false;
        Ok(state)
    }

    /// The eventfds the driver's notifications of each queue land on (register them as
    /// ioeventfds at `base + QUEUE_NOTIFY_OFFSET` with the queue index as datamatch).
    pub fn queue_evts(&self) -> &[EventFd] {
        &self.queue_evts
    }

    /// The eventfd that raises this device's interrupt (register it as an irqfd).
    pub fn irq_evt(&self) -> &EventFd {
        &self.irq
    }

    pub fn device_type(&self) -> u32 {
        self.device.device_type()
    }

    pub fn is_activated(&self) -> bool {
        self.activated
    }

    pub fn status(&self) -> u32 {
        self.status
    }

    fn avail_features(&self) -> u64 {
        self.device.avail_features() | (1 << features::VIRTIO_F_VERSION_1)
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_sel as usize)
    }

    /// A guest read at `offset` within the window. Anything but an aligned 4-byte read of a
    /// register (config space allows any size) reads as zero.
    pub fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= CONFIG_SPACE {
            self.device.read_config(offset - CONFIG_SPACE, data);
            return;
        }
        data.fill(0);
        if data.len() != 4 || offset % 4 != 0 {
            return;
        }
        let value = match offset {
            0x00 => MAGIC,
            0x04 => VERSION,
            0x08 => self.device.device_type(),
            0x0c => VENDOR_ID,
            0x10 => match self.device_features_sel {
                0 => self.avail_features() as u32,
                1 => (self.avail_features() >> 32) as u32,
                _ => 0,
            },
            0x34 => self.selected_queue().map_or(0, |q| q.max_size() as u32),
            0x44 => self.selected_queue().map_or(0, |q| q.ready() as u32),
            0x60 => self.interrupt_status.load(Ordering::SeqCst),
            0x70 => self.status,
            // No shared memory regions: SHMLenLow/High read as all ones (§4.2.2).
            0xb0 | 0xb4 => u32::MAX,
            0xfc => self.config_generation,
            _ => 0,
        };
        data.copy_from_slice(&value.to_le_bytes());
    }

    /// A guest write at `offset` within the window.
    pub fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= CONFIG_SPACE {
            // Config writes are only meaningful once the driver is set up.
            if self.status & status::DRIVER != 0 && !self.failed() {
                self.device.write_config(offset - CONFIG_SPACE, data);
            }
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else { return };
        if offset % 4 != 0 {
            return;
        }
        let value = u32::from_le_bytes(bytes);
        // Queue and feature registers may only change before DRIVER_OK (§4.2.2.2).
        let setting_up = self.status & status::DRIVER_OK == 0 && !self.failed();
        match offset {
            0x14 => self.device_features_sel = value,
            0x20 if setting_up && self.status & status::FEATURES_OK == 0 => {
                let shift = match self.driver_features_sel {
                    0 => 0,
                    1 => 32,
                    _ => return,
                };
                let mask = 0xffff_ffffu64 << shift;
                // Only bits the device offered can be acknowledged.
                let acked = ((value as u64) << shift) & self.avail_features();
                self.acked_features = (self.acked_features & !mask) | acked;
            }
            0x24 => self.driver_features_sel = value,
            0x30 => self.queue_sel = value,
            0x38 if setting_up => self.with_queue(|q| q.set_size(value as u16)),
            0x44 if setting_up => self.with_queue(|q| q.set_ready(value == 1)),
            0x50 => self.notify(value),
            0x64 => {
                self.interrupt_status.fetch_and(!value, Ordering::SeqCst);
            }
            0x70 => self.set_status(value),
            0x80 if setting_up => self.with_queue(|q| q.set_desc_table_address(Some(value), None)),
            0x84 if setting_up => self.with_queue(|q| q.set_desc_table_address(None, Some(value))),
            0x90 if setting_up => self.with_queue(|q| q.set_avail_ring_address(Some(value), None)),
            0x94 if setting_up => self.with_queue(|q| q.set_avail_ring_address(None, Some(value))),
            0xa0 if setting_up => self.with_queue(|q| q.set_used_ring_address(Some(value), None)),
            0xa4 if setting_up => self.with_queue(|q| q.set_used_ring_address(None, Some(value))),
            _ => {}
        }
    }

    fn with_queue(&mut self, f: impl FnOnce(&mut Queue)) {
        if let Some(q) = self.selected_queue() {
            f(q);
        }
    }

    /// A notification that did not go through an ioeventfd (no KVM, or registration failed):
    /// forward it to the same eventfd the device worker waits on.
    fn notify(&mut self, queue: u32) {
        if let Some(evt) = self.queue_evts.get(queue as usize) {
            let _ = evt.write(1);
        }
    }

    fn failed(&self) -> bool {
        self.status & status::FAILED != 0
    }

    fn set_status(&mut self, value: u32) {
        if value == 0 {
            self.reset();
            return;
        }
        // The driver may only add bits, in order (§3.1.1); anything else is ignored.
        if value & self.status != self.status {
            return;
        }
        let new = value & !self.status;
        if new & status::FEATURES_OK != 0 && self.acked_features & (1 << features::VIRTIO_F_VERSION_1) == 0 {
            // A legacy driver: refuse FEATURES_OK so it gives up cleanly.
            self.status = value & !status::FEATURES_OK;
            return;
        }
        self.status = value;
        if new & status::DRIVER_OK != 0 && !self.activated {
            self.activate();
        }
    }

    fn activate(&mut self) {
        let needs_status = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK;
        let queues_valid = self.queues.iter().all(|q| !q.ready() || q.is_valid(&self.mem));
        if self.status & needs_status != needs_status || !queues_valid {
            self.fail();
            return;
        }
        let mut active = Vec::with_capacity(self.queues.len());
        for (i, q) in self.queues.iter().enumerate() {
            let notify = match self.queue_evts[i].try_clone() {
                Ok(evt) => evt,
                Err(_) => return self.fail(),
            };
            let Ok(queue) = Queue::try_from(q.state()) else { return self.fail() };
            active.push(ActiveQueue { queue, notify });
        }
        let irq = match self.irq.try_clone() {
            Ok(evt) => evt,
            Err(_) => return self.fail(),
        };
        let interrupt = Arc::new(MmioInterrupt { status: self.interrupt_status.clone(), irq });
        match self.device.activate(self.mem.clone(), interrupt, self.acked_features, active) {
            Ok(()) => self.activated = true,
            Err(e) => {
                log_warn(&format!("virtio device {} failed to activate: {e}", self.device.device_type()));
                self.fail();
            }
        }
    }

    /// Marks the device broken: the driver sees DEVICE_NEEDS_RESET and a config interrupt.
    fn fail(&mut self) {
        self.status |= status::DEVICE_NEEDS_RESET;
        self.interrupt_status.fetch_or(INTERRUPT_CONFIG, Ordering::SeqCst);
        let _ = self.irq.write(1);
    }

    fn reset(&mut self) {
        if self.activated && !self.device.reset() {
            // The device cannot stop: keep it quarantined rather than hand it new queues.
            self.status = status::FAILED;
            return;
        }
        self.activated = false;
        self.status = 0;
        self.acked_features = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.queue_sel = 0;
        self.interrupt_status.store(0, Ordering::SeqCst);
        self.config_generation = self.config_generation.wrapping_add(1);
        for q in &mut self.queues {
            q.reset();
        }
    }
}

// The VMM logs to stderr through its console; keep the transport free of a logging dependency.
fn log_warn(msg: &str) {
    eprintln!("umbra-vmm: {msg}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{GuestAddress, GuestMemoryMmap};

    /// What the probe was activated with: acked features, ready queues.
    type Seen = Arc<Mutex<Option<(u64, usize)>>>;

    /// A device that records what the transport hands it.
    #[derive(Default)]
    struct Probe {
        activated: Seen,
        resettable: bool,
        /// Each ready queue's (next available, next used) at activation.
        positions: Arc<Mutex<Vec<(u16, u16)>>>,
    }

    impl VirtioDevice for Probe {
        fn device_type(&self) -> u32 {
            4
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[16, 16]
        }
        fn avail_features(&self) -> u64 {
            1 << 3
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            for (i, b) in data.iter_mut().enumerate() {
                *b = (offset as usize + i) as u8;
            }
        }
        fn activate(
            &mut self,
            _mem: GuestMemory,
            _interrupt: Arc<dyn Interrupt>,
            acked: u64,
            queues: Vec<ActiveQueue>,
        ) -> Result<(), super::super::ActivateError> {
            *self.activated.lock().unwrap() = Some((acked, queues.iter().filter(|q| q.queue.ready()).count()));
            *self.positions.lock().unwrap() = queues
                .iter()
                .filter(|q| q.queue.ready())
                .map(|q| (q.queue.next_avail(), q.queue.next_used()))
                .collect();
            Ok(())
        }
        fn reset(&mut self) -> bool {
            self.resettable
        }
    }

    fn mem() -> GuestMemory {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap()
    }

    fn r32(t: &mut MmioTransport, off: u64) -> u32 {
        let mut b = [0u8; 4];
        t.read(off, &mut b);
        u32::from_le_bytes(b)
    }

    fn w32(t: &mut MmioTransport, off: u64, v: u32) {
        t.write(off, &v.to_le_bytes());
    }

    fn transport(resettable: bool) -> (MmioTransport, Seen, GuestMemory) {
        let probe = Probe { resettable, ..Default::default() };
        let seen = probe.activated.clone();
        let m = mem();
        (MmioTransport::new(Box::new(probe), m.clone()).unwrap(), seen, m)
    }

    /// Sets up queue `i` at the layout of a mock queue, as the Linux driver does.
    fn setup_queue(t: &mut MmioTransport, i: u32, m: &GuestMemory, base: u64) {
        let mock = MockSplitQueue::create(m, GuestAddress(base), 16);
        w32(t, 0x30, i);
        assert_eq!(r32(t, 0x34), 16);
        w32(t, 0x38, 16);
        w32(t, 0x80, mock.desc_table_addr().0 as u32);
        w32(t, 0x84, 0);
        w32(t, 0x90, mock.avail_addr().0 as u32);
        w32(t, 0x94, 0);
        w32(t, 0xa0, mock.used_addr().0 as u32);
        w32(t, 0xa4, 0);
        w32(t, 0x44, 1);
    }

    fn negotiate(t: &mut MmioTransport) {
        w32(t, 0x70, status::ACKNOWLEDGE);
        w32(t, 0x70, status::ACKNOWLEDGE | status::DRIVER);
        w32(t, 0x24, 0);
        w32(t, 0x20, 1 << 3);
        w32(t, 0x24, 1);
        w32(t, 0x20, 1);
        w32(t, 0x70, status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK);
    }

    #[test]
    fn identifies_itself_and_offers_version_1() {
        let (mut t, _, _) = transport(true);
        assert_eq!(r32(&mut t, 0x00), MAGIC);
        assert_eq!(r32(&mut t, 0x04), 2);
        assert_eq!(r32(&mut t, 0x08), 4);
        w32(&mut t, 0x14, 1);
        assert_eq!(r32(&mut t, 0x10), 1, "VERSION_1 is bit 32");
        w32(&mut t, 0x14, 0);
        assert_eq!(r32(&mut t, 0x10), 1 << 3);
        let mut cfg = [0u8; 3];
        t.read(0x102, &mut cfg);
        assert_eq!(cfg, [2, 3, 4]);
    }

    #[test]
    fn full_setup_activates_with_negotiated_features_and_ready_queues() {
        let (mut t, seen, m) = transport(true);
        negotiate(&mut t);
        assert_ne!(r32(&mut t, 0x70) & status::FEATURES_OK, 0);
        setup_queue(&mut t, 0, &m, 0x1000);
        setup_queue(&mut t, 1, &m, 0x8000);
        w32(&mut t, 0x70, status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK);
        assert!(t.is_activated());
        assert_eq!(*seen.lock().unwrap(), Some(((1 << 32) | (1 << 3), 2)));
        // Queue registers are frozen after DRIVER_OK.
        w32(&mut t, 0x30, 0);
        w32(&mut t, 0x44, 0);
        assert_eq!(r32(&mut t, 0x44), 1);
    }

    #[test]
    fn unoffered_feature_bits_cannot_be_acked() {
        let (mut t, seen, m) = transport(true);
        w32(&mut t, 0x70, status::ACKNOWLEDGE | status::DRIVER);
        w32(&mut t, 0x24, 0);
        w32(&mut t, 0x20, u32::MAX);
        w32(&mut t, 0x24, 1);
        w32(&mut t, 0x20, u32::MAX);
        w32(&mut t, 0x70, status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK);
        setup_queue(&mut t, 0, &m, 0x1000);
        w32(&mut t, 0x70, status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK);
        assert_eq!(seen.lock().unwrap().unwrap().0, (1 << 32) | (1 << 3));
    }

    #[test]
    fn a_format_2_device_state_reads_as_its_typed_form() {
        let v2 = |device_type: u32, bytes: &str| {
            serde_json::from_value::<TransportState>(serde_json::json!({
                "device_type": device_type, "status": 15, "acked_features": 0, "device_features_sel": 0,
                "driver_features_sel": 0, "queue_sel": 0, "config_generation": 0, "interrupt_status": 0,
                "activated": true, "queues": [], "device_state": bytes,
            }))
            .unwrap()
        };
        let fs = v2(crate::devices::virtio::device_type::FS, "c2Vzc2lvbg==");
        assert_eq!(fs.device_state().unwrap(), DeviceState::Fs(FsState { virtiofsd: b"session".to_vec() }));
        assert_eq!(v2(crate::devices::virtio::device_type::VSOCK, "").device_state().unwrap(), DeviceState::Stateless);
        assert!(matches!(
            v2(crate::devices::virtio::device_type::FS, "not base64!").device_state(),
            Err(RestoreError::LegacyState(_))
        ));
        // Written in format 3 only.
        let text = serde_json::to_string(&fs).unwrap();
        assert!(!text.contains("device_state"), "{text}");
    }

    #[test]
    fn a_legacy_driver_is_refused_features_ok() {
        let (mut t, _, _) = transport(true);
        w32(&mut t, 0x70, status::ACKNOWLEDGE | status::DRIVER);
        w32(&mut t, 0x20, 1 << 3);
        w32(&mut t, 0x70, status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK);
        assert_eq!(r32(&mut t, 0x70) & status::FEATURES_OK, 0);
    }

    #[test]
    fn a_queue_outside_guest_memory_fails_the_device_not_the_vmm() {
        let (mut t, seen, _) = transport(true);
        negotiate(&mut t);
        w32(&mut t, 0x30, 0);
        w32(&mut t, 0x38, 16);
        w32(&mut t, 0x80, 0);
        w32(&mut t, 0x84, 0x10); // far beyond 1 MiB
        w32(&mut t, 0x44, 1);
        w32(&mut t, 0x70, status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK);
        assert!(!t.is_activated());
        assert!(seen.lock().unwrap().is_none());
        assert_ne!(r32(&mut t, 0x70) & status::DEVICE_NEEDS_RESET, 0);
        assert_ne!(r32(&mut t, 0x60) & INTERRUPT_CONFIG, 0);
    }

    #[test]
    fn hostile_register_accesses_are_harmless() {
        let (mut t, _, _) = transport(true);
        w32(&mut t, 0x30, 9999); // queue index out of range
        assert_eq!(r32(&mut t, 0x34), 0);
        w32(&mut t, 0x38, 3); // not a power of two: rejected by the queue
        w32(&mut t, 0x50, 12345); // notify a queue that does not exist
        t.write(0x02, &[1, 2]); // odd size and alignment
        let mut b = [0xaa; 2];
        t.read(0x01, &mut b);
        assert_eq!(b, [0, 0]);
        t.read(0xfff, &mut [0u8; 8]); // config read crossing the window end
        assert_eq!(r32(&mut t, 0xb0), u32::MAX, "no shared memory regions");
    }

    #[test]
    fn writing_zero_resets_and_queues_can_be_set_up_again() {
        let (mut t, seen, m) = transport(true);
        negotiate(&mut t);
        setup_queue(&mut t, 0, &m, 0x1000);
        w32(&mut t, 0x70, status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK);
        assert!(t.is_activated());
        w32(&mut t, 0x70, 0);
        assert!(!t.is_activated());
        assert_eq!(r32(&mut t, 0x70), 0);
        w32(&mut t, 0x30, 0);
        assert_eq!(r32(&mut t, 0x44), 0, "reset clears queue readiness");
        *seen.lock().unwrap() = None;
        negotiate(&mut t);
        setup_queue(&mut t, 0, &m, 0x1000);
        w32(&mut t, 0x70, status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK);
        assert!(seen.lock().unwrap().is_some());
    }

    #[test]
    fn a_device_that_cannot_reset_stays_failed() {
        let (mut t, _, m) = transport(false);
        negotiate(&mut t);
        setup_queue(&mut t, 0, &m, 0x1000);
        w32(&mut t, 0x70, status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK);
        w32(&mut t, 0x70, 0);
        assert_eq!(r32(&mut t, 0x70), status::FAILED);
        negotiate(&mut t);
        assert_eq!(r32(&mut t, 0x70), status::FAILED, "no way back once failed");
    }

    #[test]
    fn notify_writes_reach_the_queue_eventfd_and_interrupts_are_acked() {
        let (mut t, _, _) = transport(true);
        w32(&mut t, 0x50, 1);
        assert_eq!(t.queue_evts()[1].read().unwrap(), 1);
        t.interrupt_status.store(INTERRUPT_USED_RING | INTERRUPT_CONFIG, Ordering::SeqCst);
        w32(&mut t, 0x64, INTERRUPT_USED_RING);
        assert_eq!(r32(&mut t, 0x60), INTERRUPT_CONFIG);
    }

    #[test]
    fn a_saved_transport_restores_activated_at_the_used_rings_index() {
        let (mut t, _, m) = transport(true);
        negotiate(&mut t);
        setup_queue(&mut t, 0, &m, 0x1000);
        setup_queue(&mut t, 1, &m, 0x8000);
        w32(&mut t, 0x70, status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK);
        t.interrupt_status.store(INTERRUPT_USED_RING, Ordering::SeqCst);
        let state = t.save();
        // The driver and device had gone 5 and 9 buffers round each ring.
        vm_memory::Bytes::write_obj(&m, 5u16, GuestAddress(state.queues[0].used_ring + 2)).unwrap();
        vm_memory::Bytes::write_obj(&m, 9u16, GuestAddress(state.queues[1].used_ring + 2)).unwrap();
        let state: TransportState = serde_json::from_str(&serde_json::to_string(&state).unwrap()).unwrap();

        let probe = Probe { resettable: true, ..Default::default() };
        let (seen, positions) = (probe.activated.clone(), probe.positions.clone());
        let mut r = MmioTransport::restore(Box::new(probe), m.clone(), &state).unwrap();
        assert!(r.is_activated());
        assert_eq!(*seen.lock().unwrap(), Some(((1 << 32) | (1 << 3), 2)));
        assert_eq!(*positions.lock().unwrap(), vec![(5, 5), (9, 9)]);
        assert_eq!(r.save(), state, "the registers the driver reads are as they were");
        assert_eq!(r32(&mut r, 0x60), INTERRUPT_USED_RING);
        assert_eq!(r.irq_evt().read().unwrap(), 1, "the pending interrupt is raised again");
        // Still resettable and usable as before.
        w32(&mut r, 0x70, 0);
        assert!(!r.is_activated());
    }

    #[test]
    fn a_suspended_device_starts_again_in_place_at_the_used_rings_index() {
        let probe = Probe { resettable: true, ..Default::default() };
        let (seen, positions) = (probe.activated.clone(), probe.positions.clone());
        let m = mem();
        let mut t = MmioTransport::new(Box::new(probe), m.clone()).unwrap();
        negotiate(&mut t);
        setup_queue(&mut t, 0, &m, 0x1000);
        setup_queue(&mut t, 1, &m, 0x8000);
        w32(&mut t, 0x70, status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK);
        *seen.lock().unwrap() = None;
        let state = t.suspend().unwrap();
        assert!(state.activated && t.is_activated(), "suspended, not reset: {state:?}");
        // The device went 3 and 7 buffers round its rings before it stopped.
        vm_memory::Bytes::write_obj(&m, 3u16, GuestAddress(state.queues[0].used_ring + 2)).unwrap();
        vm_memory::Bytes::write_obj(&m, 7u16, GuestAddress(state.queues[1].used_ring + 2)).unwrap();
        t.resume().unwrap();
        assert_eq!(*seen.lock().unwrap(), Some(((1 << 32) | (1 << 3), 2)), "activated again");
        assert_eq!(*positions.lock().unwrap(), vec![(3, 3), (7, 7)]);
        assert_eq!(t.save(), state, "the driver sees the registers it set");

        // A device that cannot stop refuses the suspension and keeps running.
        let (mut stuck, _, m) = transport(false);
        negotiate(&mut stuck);
        setup_queue(&mut stuck, 0, &m, 0x1000);
        w32(&mut stuck, 0x70, status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK);
        assert!(stuck.suspend().is_err());
        assert!(stuck.is_activated() && stuck.status() & status::DEVICE_NEEDS_RESET == 0);
    }

    #[test]
    fn a_state_that_does_not_fit_the_device_is_refused() {
        let (mut t, _, m) = transport(true);
        negotiate(&mut t);
        setup_queue(&mut t, 0, &m, 0x1000);
        w32(&mut t, 0x70, status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK);
        let state = t.save();
        let restore = |s: &TransportState| {
            MmioTransport::restore(Box::new(Probe::default()), m.clone(), s).err().map(|e| e.to_string())
        };
        assert!(restore(&TransportState { device_type: 19, ..state.clone() })
            .unwrap()
            .contains("device 4 in its place"));
        let mut fewer = state.clone();
        fewer.queues.pop();
        assert!(restore(&fewer).unwrap().contains("1 queues saved, the device has 2"));
        let mut odd = state.clone();
        odd.queues[0].size = 3;
        assert!(restore(&odd).unwrap().contains("queue 0: size 3"));
        let mut outside = state.clone();
        outside.queues[0].used_ring = 1 << 40;
        assert!(restore(&outside).unwrap().contains("used ring"), "{:?}", restore(&outside));
        let mut broken = state;
        broken.queues[0].desc_table = 1 << 40;
        assert!(restore(&broken).unwrap().contains("did not activate"), "{:?}", restore(&broken));
    }
}
