//! The virtio-fs device: what the guest driver sees (device type 26, a hiprio queue and one
//! request queue, the `tag` in config space), and the hand-over of its queues to virtiofsd.
//!
//! Linux's virtio_fs driver reads `tag` and `num_request_queues` from config space, finds
//! `1 + num_request_queues` queues ("hiprio" for FORGET/INTERRUPT, then "requests.N") and mounts
//! with `mount -t virtiofs TAG DIR`. The tag comes from our config rather than from virtiofsd
//! (VHOST_USER_PROTOCOL_F_CONFIG is not used), so the VM description alone says what is shared
//! under which name.
//!
//! Feature bits are the backend's, filtered to what a split-ring MMIO device can carry:
//! indirect descriptors, event index, VERSION_1. Anything else a backend offers —
//! VHOST_USER_F_PROTOCOL_FEATURES, VHOST_F_LOG_ALL (migration), packed rings, notification
//! queues — never reaches the guest.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;

use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use virtio_queue::QueueT;
use vm_memory::ByteValued;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::backend::{self, Backend, FsError, RingSetup, BACKEND_TIMEOUT};
use super::call_forwarder::CallForwarder;
use crate::devices::virtio::persist::{DeviceState, DeviceStateError, FsState};
use crate::devices::virtio::{
    device_type, features, read_config_bytes, ActivateError, ActiveQueue, Interrupt, VirtioDevice,
};
use crate::seccomp::{Lane, ThreadKind};
use crate::vstate::memory::GuestMemory;

/// The longest tag (the config field's size).
pub const MAX_TAG_LEN: usize = 36;
/// The hiprio queue and one request queue.
pub const NUM_QUEUES: usize = 2;
/// The maximum size of each queue (virtiofsd accepts up to 32768).
pub const QUEUE_SIZE: u16 = 1024;
const NUM_REQUEST_QUEUES: u32 = NUM_QUEUES as u32 - 1;

/// The backend's feature bits that are passed on to the guest when offered.
const PASSTHROUGH_FEATURES: u64 =
    (1 << VIRTIO_RING_F_INDIRECT_DESC) | (1 << VIRTIO_RING_F_EVENT_IDX) | (1 << features::VIRTIO_F_VERSION_1);

/// The configuration space (virtio 1.2 §5.11.4).
///
/// ```text
/// struct virtio_fs_config {
///     u8 tag[36];                 // UTF-8, NUL-padded, not NUL-terminated when 36 bytes long
///     le32 num_request_queues;
///     le32 notify_buf_size;       // VIRTIO_FS_F_NOTIFICATION only: not offered
/// };
/// ```
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct VirtioFsConfig {
    tag: [u8; MAX_TAG_LEN],
    num_request_queues: u32,
}

// SAFETY: a plain-old-data struct of byte and u32 fields with no padding (36 is a multiple of
// 4), so every byte pattern is a valid value.
unsafe impl ByteValued for VirtioFsConfig {}

/// Whether `tag` can be a virtio-fs tag: 1 to 36 bytes, no NUL (the driver stops at the first).
pub fn tag_is_valid(tag: &str) -> bool {
    (1..=MAX_TAG_LEN).contains(&tag.len()) && !tag.contains('\0')
}

/// A virtio-fs device whose file server is the virtiofsd listening on a vhost-user socket.
pub struct FsDevice {
    tag: String,
    config: VirtioFsConfig,
    // Declared before `backend`: dropped (the thread stopped) before the socket it watches.
    forwarder: Option<CallForwarder>,
    /// The thread the forwarder runs on, started with the device.
    lane: Lane,
    backend: Backend,
}

impl FsDevice {
    /// Connects to virtiofsd at `socket` and negotiates with it; the guest will see the share as
    /// `tag`. Fails, naming the socket, if nothing is listening there or the backend cannot
    /// serve virtio-fs.
    pub fn new(tag: &str, socket: &Path) -> Result<FsDevice, FsError> {
        if !tag_is_valid(tag) {
            return Err(FsError::Tag { tag: tag.to_string(), max: MAX_TAG_LEN });
        }
        let stream = backend::connect(socket)?;
        FsDevice::with_stream(tag, socket, stream)
    }

    /// The device over a connection to virtiofsd made earlier (umbra-vmm connects before it
    /// enters its jail); `socket` names it in errors.
    pub fn with_stream(tag: &str, socket: &Path, stream: UnixStream) -> Result<FsDevice, FsError> {
        if !tag_is_valid(tag) {
            return Err(FsError::Tag { tag: tag.to_string(), max: MAX_TAG_LEN });
        }
        let backend = Backend::over(stream, socket, NUM_QUEUES, BACKEND_TIMEOUT)?;
        let mut config = VirtioFsConfig { tag: [0; MAX_TAG_LEN], num_request_queues: NUM_REQUEST_QUEUES.to_le() };
        config.tag[..tag.len()].copy_from_slice(tag.as_bytes());
        let lane = Lane::start(ThreadKind::FsCalls, "umbra-fs").map_err(FsError::Thread)?;
        Ok(FsDevice { tag: tag.to_string(), config, forwarder: None, lane, backend })
    }

    pub fn tag(&self) -> &str {
        &self.tag
    }

    fn state_error(&self, source: FsError) -> DeviceStateError {
        DeviceStateError::Fs { tag: self.tag.clone(), source }
    }

    /// Starts the interrupt thread, then the backend's rings (so no call is missed); on failure
    /// nothing keeps running.
    fn start(
        &mut self,
        mem: &GuestMemory,
        interrupt: Arc<dyn Interrupt>,
        acked_features: u64,
        queues: &[ActiveQueue],
    ) -> Result<CallForwarder, FsError> {
        if self.backend.is_broken() {
            return Err(FsError::Broken { socket: self.backend.socket().to_path_buf() });
        }
        let calls = (0..queues.len()).map(|_| EventFd::new(EFD_NONBLOCK)).collect::<Result<Vec<_>, _>>();
        let calls = calls.map_err(FsError::EventFd)?;
        let mut rings = Vec::with_capacity(queues.len());
        for (index, (active, call)) in queues.iter().zip(&calls).enumerate() {
            // A queue the driver did not set up stays off; Linux sets up every queue.
            if active.queue.ready() {
                rings.push(ring_setup(mem, index, active, call)?);
            }
        }
        let message = format!(
            "virtio-fs {:?}: virtiofsd at {} hung up; the shared folder no longer answers",
            self.tag,
            self.backend.socket().display()
        );
        let forwarder_calls = calls.iter().map(EventFd::try_clone).collect::<Result<Vec<_>, _>>();
        let forwarder_calls = forwarder_calls.map_err(FsError::EventFd)?;
        let mut forwarder =
            CallForwarder::spawn(&self.lane, forwarder_calls, self.backend.as_raw_fd(), interrupt, message)
                .map_err(FsError::Thread)?;
        if let Err(e) = self.backend.start(mem, acked_features, &rings) {
            forwarder.stop();
            return Err(e);
        }
        Ok(forwarder)
    }
}

/// The ring addresses of queue `index` in this process, each ring checked to lie inside one
/// guest memory region (the backend translates them through the memory table).
fn ring_setup<'a>(
    mem: &GuestMemory,
    index: usize,
    active: &'a ActiveQueue,
    call: &'a EventFd,
) -> Result<RingSetup<'a>, FsError> {
    let q = &active.queue;
    let size = u64::from(q.size());
    Ok(RingSetup {
        index,
        size: q.size(),
        max_size: q.max_size(),
        desc_table: host_address(mem, q.desc_table(), 16 * size, index, "descriptor table")?,
        avail_ring: host_address(mem, q.avail_ring(), 6 + 2 * size, index, "available ring")?,
        used_ring: host_address(mem, q.used_ring(), 6 + 8 * size, index, "used ring")?,
        base: q.next_avail(),
        kick: &active.notify,
        call,
    })
}

fn host_address(mem: &GuestMemory, addr: u64, len: u64, queue: usize, what: &str) -> Result<u64, FsError> {
    let host = crate::vstate::memory::host_range(mem, addr, len).ok_or_else(|| {
        FsError::Queue(format!("queue {queue}: the {what} at {addr:#x} (+{len:#x}) is outside guest RAM"))
    })?;
    Ok(host as u64)
}

impl VirtioDevice for FsDevice {
    fn device_type(&self) -> u32 {
        device_type::FS
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE; NUM_QUEUES]
    }

    fn avail_features(&self) -> u64 {
        self.backend.features() & PASSTHROUGH_FEATURES
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(self.config.as_slice(), offset, data);
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        interrupt: Arc<dyn Interrupt>,
        acked_features: u64,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError> {
        if self.forwarder.is_some() {
            return Err(ActivateError::Other("virtio-fs is already active".into()));
        }
        ActivateError::check_queue_count(&queues, NUM_QUEUES)?;
        // The queues' notify eventfds went to virtiofsd (SCM_RIGHTS duplicates them); ours close
        // when `queues` is dropped, and KVM keeps signalling the transport's originals.
        let forwarder = self
            .start(&mem, interrupt, acked_features, &queues)
            .map_err(|e| ActivateError::Other(format!("virtio-fs {:?}: {e}", self.tag)))?;
        self.forwarder = Some(forwarder);
        Ok(())
    }

    /// The device as a snapshot records it: the interrupt thread stopped, then the backend's
    /// rings, and virtiofsd's FUSE session read out (see [`Backend::save_state`]).
    fn quiesce(&mut self) -> Result<DeviceState, DeviceStateError> {
        if self.forwarder.is_none() {
            return Ok(DeviceState::Stateless);
        }
        // A virtiofsd that cannot save its state refuses before anything stops: a live fork
        // refused for it leaves the folder running.
        self.backend.check_state_transfer().map_err(|e| self.state_error(e))?;
        let Some(mut forwarder) = self.forwarder.take() else { return Ok(DeviceState::Stateless) };
        forwarder.stop();
        if forwarder.hung_up() {
            self.backend.set_broken();
        }
        let virtiofsd = self.backend.save_state().map_err(|e| self.state_error(e))?;
        Ok(DeviceState::Fs(FsState { virtiofsd }))
    }

    /// Gives the new virtiofsd the FUSE session the snapshot saved, before the restored
    /// transport activates the device again: the guest's inodes and open files are found by
    /// their paths in the directory this virtiofsd serves.
    fn prepare_restore(&mut self, state: &DeviceState) -> Result<(), DeviceStateError> {
        match state {
            // Saved before the driver started it: a fresh virtiofsd is what it had.
            DeviceState::Stateless => Ok(()),
            DeviceState::Fs(FsState { virtiofsd }) => {
                self.backend.load_state(virtiofsd).map_err(|e| self.state_error(e))
            }
        }
    }

    /// Stops the interrupt thread, then the backend's rings (GET_VRING_BASE) and its device state
    /// (RESET_DEVICE). If virtiofsd hung up, did not negotiate RESET_DEVICE, or fails a request,
    /// the device cannot be reset and the transport keeps it failed.
    fn reset(&mut self) -> bool {
        let Some(mut forwarder) = self.forwarder.take() else { return !self.backend.is_broken() };
        forwarder.stop();
        if forwarder.hung_up() {
            self.backend.set_broken();
        }
        match self.backend.stop() {
            Ok(()) => true,
            Err(e) => {
                eprintln!("umbra-vmm: virtio-fs {:?} cannot be reset and stays failed: {e}", self.tag);
                false
            }
        }
    }
}
