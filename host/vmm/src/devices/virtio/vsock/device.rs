//! The virtio-vsock device (virtio 1.2 §5.10) as the MMIO transport sees it: device ID 19,
//! three queues, an 8-byte configuration space holding the guest CID, no feature bits of its
//! own (stream sockets are implicit; VIRTIO_VSOCK_F_SEQPACKET is not offered).
//!
//! The device is a shell around the [`VsockMuxer`]: while the driver has not activated it the
//! muxer sits here (its listener bound, host connections waiting in the backlog); activation
//! moves it onto a worker thread, and reset brings it back with its connections dropped, so
//! the socket path survives a driver reload.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::muxer::VsockMuxer;
use super::unix_backend::HostListener;
use super::worker::Worker;
use crate::devices::virtio::persist::{DeviceState, DeviceStateError};
use crate::devices::virtio::{device_type, read_config_bytes, ActivateError, ActiveQueue, Interrupt, VirtioDevice};
use crate::seccomp::{Lane, ThreadKind};
use crate::vstate::memory::GuestMemory;

/// rx, tx, event.
pub const QUEUE_SIZES: [u16; 3] = [256; 3];

/// A virtio-vsock device whose host side is a hybrid vsock Unix socket.
#[derive(Debug)]
pub struct Vsock {
    guest_cid: u64,
    uds_path: PathBuf,
    /// Present while the device is not active.
    muxer: Option<VsockMuxer>,
    worker: Option<Worker>,
    /// The thread the worker runs on, started with the device.
    lane: Lane,
    /// The next activation tells the driver its connections were reset (set on a restore).
    reset_event: bool,
}

impl Vsock {
    /// Creates the device for a guest with CID `guest_cid` (3 ..= u32::MAX - 1: 0–2 are
    /// reserved and u32::MAX is VMADDR_CID_ANY; the upper 32 bits of the config field must be
    /// zero) and binds the listening Unix socket at `uds_path`, which must not exist yet. Host
    /// services that accept guest connections to port P listen at `<uds_path>_<P>`. The socket
    /// file is removed when the device is dropped.
    pub fn new(guest_cid: u64, uds_path: PathBuf) -> io::Result<Vsock> {
        Vsock::with_listener(guest_cid, HostListener::bind(&uds_path)?)
    }

    /// The device around a socket bound earlier (umbra-vmm binds it before it enters its jail;
    /// the listener's path is then the one the jail sees).
    pub fn with_listener(guest_cid: u64, listener: HostListener) -> io::Result<Vsock> {
        if !(3..u64::from(u32::MAX)).contains(&guest_cid) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("guest CID {guest_cid} is reserved or out of range (3 ..= {})", u32::MAX - 1),
            ));
        }
        let uds_path = listener.path().to_path_buf();
        let muxer = VsockMuxer::with_listener(guest_cid, listener)?;
        let lane = Lane::start(ThreadKind::Vsock, "umbra-vsock")?;
        Ok(Vsock { guest_cid, uds_path, muxer: Some(muxer), worker: None, lane, reset_event: false })
    }

    pub fn guest_cid(&self) -> u64 {
        self.guest_cid
    }

    pub fn uds_path(&self) -> &Path {
        &self.uds_path
    }

    /// Makes the next activation (a restored transport's) start with a transport-reset event:
    /// the guest's connections existed in the VM the snapshot was taken of, not in this one.
    pub fn queue_transport_reset(&mut self) {
        self.reset_event = true;
    }

    /// Joins the worker and takes its muxer back; `reset` drops its connections (a reset
    /// device), otherwise they are kept for the next activation (a live fork's pause).
    fn stop_worker(&mut self, reset: bool) -> bool {
        match self.worker.take() {
            None => true,
            Some(worker) => match worker.stop() {
                Some(mut muxer) => {
                    if reset {
                        muxer.reset();
                    }
                    self.muxer = Some(muxer);
                    true
                }
                None => false,
            },
        }
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        device_type::VSOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn avail_features(&self) -> u64 {
        0
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.guest_cid.to_le_bytes(), offset, data);
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        interrupt: Arc<dyn Interrupt>,
        _acked_features: u64,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError> {
        ActivateError::check_queue_count(&queues, QUEUE_SIZES.len())?;
        let Some(muxer) = self.muxer.take() else {
            return Err(ActivateError::Other("the vsock device is already active".into()));
        };
        match Worker::spawn(&self.lane, muxer, mem, interrupt, queues, self.reset_event) {
            Ok(worker) => {
                self.worker = Some(worker);
                self.reset_event = false;
                Ok(())
            }
            Err((muxer, e)) => {
                self.muxer = muxer.map(|m| *m);
                Err(ActivateError::Worker(e))
            }
        }
    }

    fn prepare_restore(&mut self, state: &DeviceState) -> Result<(), DeviceStateError> {
        state.expect_stateless()?;
        self.queue_transport_reset();
        Ok(())
    }

    fn reset(&mut self) -> bool {
        self.stop_worker(true)
    }

    /// The guest's connections stay: the worker stops between batches and the next activation
    /// (the same queues, the same driver) carries on with them. A fork made of this pause gets
    /// no connection (its restore queues a transport reset, as every restore does).
    fn suspend(&mut self) -> Result<DeviceState, DeviceStateError> {
        match self.stop_worker(false) {
            true => Ok(DeviceState::Stateless),
            false => Err(DeviceStateError::CannotStop),
        }
    }
}

impl Drop for Vsock {
    fn drop(&mut self) {
        // Joins the worker; the muxer, and with it the socket file, goes right after.
        self.stop_worker(true);
    }
}
