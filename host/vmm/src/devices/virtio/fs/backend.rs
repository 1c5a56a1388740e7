//! The vhost-user connection to one `virtiofsd`: what is said on the socket, in which order.
//!
//! The `vhost` crate encodes the messages; this file decides the conversation. At connection:
//! SET_OWNER, GET_FEATURES, and (when the backend speaks them) protocol features — REPLY_ACK so
//! every setup message is confirmed, MQ to check the backend has both queues, RESET_DEVICE so a
//! guest reset can be passed on. At activation ([`Backend::start`]): SET_FEATURES, SET_MEM_TABLE
//! with every guest RAM region, then per ring NUM, ADDR, BASE, CALL, KICK and ENABLE (the call
//! eventfd first, so the backend can signal from the first request it takes). At reset
//! ([`Backend::stop`]): GET_VRING_BASE per started ring (which stops it) and RESET_DEVICE.
//!
//! For a snapshot ([`Backend::save_state`]): GET_VRING_BASE per ring, then SET_DEVICE_STATE_FD
//! (save, phase "stopped") with a pipe's write end, the state read to end-of-file, and
//! CHECK_DEVICE_STATE. virtiofsd's state is its FUSE session: negotiated options, every inode
//! the guest holds (by path in the shared directory) and every open handle. On restore
//! ([`Backend::load_state`]), before the rings start, the same with a pipe's read end: a new
//! virtiofsd — over another directory, for a fork — takes up the session where it was.
//!
//! Each phase (negotiation, start, stop) must finish within [`BACKEND_TIMEOUT`], or the
//! [`Watchdog`] shuts the socket down, so a backend that stops answering fails the device rather
//! than hanging the vCPU thread that activates or resets it. After any failed exchange the
//! connection is out of step (a late reply would be read as the answer to the next request), so
//! the backend is marked broken and refuses everything afterwards.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{VhostTransferStateDirection, VhostTransferStatePhase, VhostUserHeaderFlag};
use vhost::vhost_user::{Frontend, VhostUserFrontend, VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::GuestMemoryBackend;
use vmm_sys_util::eventfd::EventFd;

use super::transfer;
use super::watchdog::Watchdog;
use crate::vstate::memory::GuestMemory;

/// How long one phase of the conversation with virtiofsd (negotiation, starting the rings,
/// stopping them) may take before the connection is given up.
pub const BACKEND_TIMEOUT: Duration = Duration::from_secs(10);

/// The protocol features this frontend uses when the backend offers them.
fn wanted_protocol_features() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::RESET_DEVICE
        | VhostUserProtocolFeatures::DEVICE_STATE
}

/// The most device state accepted from or sent to a backend: virtiofsd's is a few hundred bytes
/// per inode the guest holds, so this allows tens of thousands while bounding what a confused
/// backend can make the VMM hold.
pub const MAX_DEVICE_STATE: usize = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("virtio-fs tag {tag:?} must be 1 to {max} bytes and contain no NUL")]
    Tag { tag: String, max: usize },
    #[error(
        "cannot connect to the virtiofsd socket {}: {source} (is virtiofsd running and listening there?)",
        socket.display()
    )]
    Connect { socket: PathBuf, source: std::io::Error },
    #[error("vhost-user {step} with virtiofsd at {}: {source}", socket.display())]
    Protocol { socket: PathBuf, step: &'static str, source: vhost::Error },
    #[error("virtiofsd at {} did not answer vhost-user {step} within {timeout:?}", socket.display())]
    Timeout { socket: PathBuf, step: &'static str, timeout: Duration },
    #[error("the vhost-user backend at {} {what}", socket.display())]
    Unsupported { socket: PathBuf, what: String },
    #[error("the connection to virtiofsd at {} is broken (an earlier request failed or it hung up)", socket.display())]
    Broken { socket: PathBuf },
    #[error("guest memory cannot be shared with virtiofsd: {0}")]
    Memory(String),
    #[error("{0}")]
    Queue(String),
    #[error("cannot create an eventfd: {0}")]
    EventFd(std::io::Error),
    #[error("cannot start the virtio-fs interrupt thread: {0}")]
    Thread(std::io::Error),
    #[error("moving virtiofsd's state at {}: {reason}", socket.display())]
    State { socket: PathBuf, reason: String },
}

/// One ring to start: the driver's queue, translated to addresses in this process (which the
/// backend maps back through the memory table it was given).
pub struct RingSetup<'a> {
    pub index: usize,
    pub size: u16,
    pub max_size: u16,
    pub desc_table: u64,
    pub avail_ring: u64,
    pub used_ring: u64,
    /// Where the backend takes up the ring: 0 at boot, the used ring's index on restore.
    pub base: u16,
    pub kick: &'a EventFd,
    pub call: &'a EventFd,
}

/// A vhost-user connection to virtiofsd.
pub struct Backend {
    frontend: Frontend,
    socket: PathBuf,
    /// What GET_FEATURES returned.
    features: u64,
    protocol: VhostUserProtocolFeatures,
    /// The rings started since the last stop.
    started: Vec<usize>,
    broken: bool,
    watchdog: Watchdog,
    timeout: Duration,
}

/// Connects to the vhost-user backend listening at `socket`.
pub fn connect(socket: &Path) -> Result<UnixStream, FsError> {
    UnixStream::connect(socket).map_err(|source| FsError::Connect { socket: socket.to_path_buf(), source })
}

impl Backend {
    /// Connects to the backend at `socket` and negotiates the connection-wide features. The
    /// backend must serve at least `num_queues` rings and speak virtio 1.
    pub fn connect(socket: &Path, num_queues: usize) -> Result<Backend, FsError> {
        Backend::connect_with_timeout(socket, num_queues, BACKEND_TIMEOUT)
    }

    /// [`Backend::connect`] with another deadline per phase (tests use a short one).
    pub fn connect_with_timeout(socket: &Path, num_queues: usize, timeout: Duration) -> Result<Backend, FsError> {
        Backend::over(connect(socket)?, socket, num_queues, timeout)
    }

    /// Negotiates over a connection made earlier; `socket` names the backend in errors.
    pub fn over(stream: UnixStream, socket: &Path, num_queues: usize, timeout: Duration) -> Result<Backend, FsError> {
        let connect_error = |source| FsError::Connect { socket: socket.to_path_buf(), source };
        let watchdog = Watchdog::spawn(stream.try_clone().map_err(connect_error)?).map_err(FsError::Thread)?;
        let mut backend = Backend {
            frontend: Frontend::from_stream(stream, num_queues as u64),
            socket: socket.to_path_buf(),
            features: 0,
            protocol: VhostUserProtocolFeatures::empty(),
            started: Vec::new(),
            broken: false,
            watchdog,
            timeout,
        };
        backend.negotiate(num_queues)?;
        Ok(backend)
    }

    fn negotiate(&mut self, num_queues: usize) -> Result<(), FsError> {
        let _deadline = self.watchdog.arm(self.timeout);
        let r = self.frontend.set_owner();
        self.check("SET_OWNER", r)?;
        let r = self.frontend.get_features();
        self.features = self.check("GET_FEATURES", r)?;
        if self.features & (1 << crate::devices::virtio::features::VIRTIO_F_VERSION_1) == 0 {
            return Err(self.unsupported("does not offer VIRTIO_F_VERSION_1"));
        }
        if self.features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() == 0 {
            // A minimal backend: no acks, no queue count, no reset. Rings start on SET_FEATURES.
            return Ok(());
        }
        let r = self.frontend.get_protocol_features();
        let offered = self.check("GET_PROTOCOL_FEATURES", r)?;
        let protocol = offered & wanted_protocol_features();
        let r = self.frontend.set_protocol_features(protocol);
        self.check("SET_PROTOCOL_FEATURES", r)?;
        self.protocol = protocol;
        if protocol.contains(VhostUserProtocolFeatures::REPLY_ACK) {
            // From here on every request without a reply of its own is acknowledged, so a
            // backend that cannot map memory or start a ring says so.
            self.frontend.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
        }
        if protocol.contains(VhostUserProtocolFeatures::MQ) {
            let r = self.frontend.get_queue_num();
            let offered = self.check("GET_QUEUE_NUM", r)?;
            if offered < num_queues as u64 {
                return Err(self.unsupported(&format!("serves {offered} queues; virtio-fs needs {num_queues}")));
            }
        }
        Ok(())
    }

    /// The virtio feature bits the backend offered (GET_FEATURES), including vhost-user ones.
    pub fn features(&self) -> u64 {
        self.features
    }

    /// Whether a guest reset can be passed on (RESET_DEVICE was negotiated).
    pub fn can_reset(&self) -> bool {
        self.protocol.contains(VhostUserProtocolFeatures::RESET_DEVICE)
    }

    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// Marks the connection unusable (the interrupt thread saw virtiofsd hang up).
    pub fn set_broken(&mut self) {
        self.broken = true;
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Starts the device on the backend: `guest_features` are the bits the driver acknowledged
    /// (only ones [`Backend::features`] offered reach the backend), `mem` is shared region by
    /// region, and every ring in `rings` is set up and enabled. On failure the connection is
    /// broken: the backend may hold part of the setup.
    pub fn start(&mut self, mem: &GuestMemory, guest_features: u64, rings: &[RingSetup]) -> Result<(), FsError> {
        if self.broken {
            return Err(FsError::Broken { socket: self.socket.clone() });
        }
        let regions = memory_table(mem)?;
        let _deadline = self.watchdog.arm(self.timeout);
        let result = self.start_rings(&regions, guest_features, rings);
        if result.is_err() {
            self.broken = true;
        }
        result
    }

    fn start_rings(
        &mut self,
        regions: &[VhostUserMemoryRegionInfo],
        guest_features: u64,
        rings: &[RingSetup],
    ) -> Result<(), FsError> {
        let protocol_features = self.features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        let r = self.frontend.set_features((guest_features & self.features) | protocol_features);
        self.check("SET_FEATURES", r)?;
        let r = self.frontend.set_mem_table(regions);
        self.check("SET_MEM_TABLE", r)?;
        for ring in rings {
            let config = VringConfigData {
                queue_max_size: ring.max_size,
                queue_size: ring.size,
                flags: 0,
                desc_table_addr: ring.desc_table,
                used_ring_addr: ring.used_ring,
                avail_ring_addr: ring.avail_ring,
                log_addr: None,
            };
            let r = self.frontend.set_vring_num(ring.index, ring.size);
            self.check("SET_VRING_NUM", r)?;
            let r = self.frontend.set_vring_addr(ring.index, &config);
            self.check("SET_VRING_ADDR", r)?;
            let r = self.frontend.set_vring_base(ring.index, ring.base);
            self.check("SET_VRING_BASE", r)?;
            // Recorded before the kick: from SET_VRING_KICK on the backend may run the ring.
            self.started.push(ring.index);
            let r = self.frontend.set_vring_call(ring.index, ring.call);
            self.check("SET_VRING_CALL", r)?;
            let r = self.frontend.set_vring_kick(ring.index, ring.kick);
            self.check("SET_VRING_KICK", r)?;
            if protocol_features != 0 {
                // With PROTOCOL_FEATURES negotiated rings start disabled (without it they were
                // enabled by SET_FEATURES).
                let r = self.frontend.set_vring_enable(ring.index, true);
                self.check("SET_VRING_ENABLE", r)?;
            }
        }
        Ok(())
    }

    /// Stops every started ring (GET_VRING_BASE: the backend stops processing it and drops its
    /// kick and call eventfds) and resets the backend's device state (RESET_DEVICE: for
    /// virtiofsd, the FUSE session ends, so the driver's next FUSE_INIT starts afresh). Returns
    /// the failed exchange, leaving the connection broken, if that is not possible.
    pub fn stop(&mut self) -> Result<(), FsError> {
        if self.broken {
            return Err(FsError::Broken { socket: self.socket.clone() });
        }
        if !self.can_reset() {
            self.broken = true;
            return Err(self.unsupported("cannot reset the device (no VHOST_USER_PROTOCOL_F_RESET_DEVICE)"));
        }
        let _deadline = self.watchdog.arm(self.timeout);
        for index in std::mem::take(&mut self.started) {
            let r = self.frontend.get_vring_base(index);
            self.check("GET_VRING_BASE", r)?;
        }
        let r = self.frontend.reset_device();
        self.check("RESET_DEVICE", r)
    }

    /// Stops every started ring and reads the backend's device state (its FUSE session), for a
    /// snapshot. The backend is left stopped with its state intact (no RESET_DEVICE): the VM
    /// ends after a snapshot. Fails, leaving the connection broken, if the backend cannot
    /// save its state (no VHOST_USER_PROTOCOL_F_DEVICE_STATE, virtiofsd before 1.9) or does not
    /// within [`Backend`]'s timeout.
    pub fn save_state(&mut self) -> Result<Vec<u8>, FsError> {
        self.check_state_transfer()?;
        let _deadline = self.watchdog.arm(self.timeout);
        for index in std::mem::take(&mut self.started) {
            let r = self.frontend.get_vring_base(index);
            self.check("GET_VRING_BASE", r)?;
        }
        let (read_end, write_end) = self.pipe()?;
        let r = self.frontend.set_device_state_fd(
            VhostTransferStateDirection::SAVE,
            VhostTransferStatePhase::STOPPED,
            write_end,
        );
        // The write end was sent and closed here: end-of-file comes when the backend is done.
        self.check("SET_DEVICE_STATE_FD", r)?;
        let state = transfer::read_all(read_end, MAX_DEVICE_STATE, Instant::now() + self.timeout);
        let state = state.map_err(|reason| self.state_error(reason))?;
        let r = self.frontend.check_device_state();
        self.check("CHECK_DEVICE_STATE", r)?;
        Ok(state)
    }

    /// Hands the backend the device state a snapshot saved, before its rings start. Fails,
    /// leaving the connection broken, if the backend cannot load it (it says why in its log:
    /// for virtiofsd, a path that no longer exists in the shared directory).
    pub fn load_state(&mut self, state: &[u8]) -> Result<(), FsError> {
        self.check_state_transfer()?;
        if state.len() > MAX_DEVICE_STATE {
            return Err(self.state_error(format!("{} bytes exceed {MAX_DEVICE_STATE}", state.len())));
        }
        let _deadline = self.watchdog.arm(self.timeout);
        let (read_end, write_end) = self.pipe()?;
        let r = self.frontend.set_device_state_fd(
            VhostTransferStateDirection::LOAD,
            VhostTransferStatePhase::STOPPED,
            read_end,
        );
        self.check("SET_DEVICE_STATE_FD", r)?;
        transfer::write_all(write_end, state, Instant::now() + self.timeout)
            .map_err(|reason| self.state_error(reason))?;
        let r = self.frontend.check_device_state();
        self.check("CHECK_DEVICE_STATE", r)
    }

    pub(crate) fn check_state_transfer(&mut self) -> Result<(), FsError> {
        if self.broken {
            return Err(FsError::Broken { socket: self.socket.clone() });
        }
        if !self.protocol.contains(VhostUserProtocolFeatures::DEVICE_STATE) {
            return Err(self.unsupported(
                "cannot save or load its state (no VHOST_USER_PROTOCOL_F_DEVICE_STATE; virtiofsd 1.9 or later has it)",
            ));
        }
        Ok(())
    }

    fn pipe(&mut self) -> Result<(OwnedFd, OwnedFd), FsError> {
        transfer::pipe().map_err(|e| self.state_error(format!("cannot create a pipe: {e}")))
    }

    fn state_error(&mut self, reason: String) -> FsError {
        self.broken = true;
        FsError::State { socket: self.socket.clone(), reason }
    }

    /// Passes a result through, marking the connection broken if the exchange failed.
    fn check<T>(&mut self, step: &'static str, result: vhost::Result<T>) -> Result<T, FsError> {
        result.map_err(|source| {
            self.broken = true;
            let socket = self.socket.clone();
            if self.watchdog.fired() {
                FsError::Timeout { socket, step, timeout: self.timeout }
            } else {
                FsError::Protocol { socket, step, source }
            }
        })
    }

    fn unsupported(&self, what: &str) -> FsError {
        FsError::Unsupported { socket: self.socket.clone(), what: what.to_string() }
    }
}

impl AsRawFd for Backend {
    /// The socket, for the interrupt thread to notice a hang-up (it never reads it).
    fn as_raw_fd(&self) -> RawFd {
        self.frontend.as_raw_fd()
    }
}

/// Every guest RAM region as (guest address, size, address here, memfd, offset in it).
fn memory_table(mem: &GuestMemory) -> Result<Vec<VhostUserMemoryRegionInfo>, FsError> {
    mem.iter()
        .map(|region| {
            VhostUserMemoryRegionInfo::from_guest_region(region).map_err(|_| {
                FsError::Memory(format!(
                    "the region at {:#x} is not file-backed (guest memory must come from memory::memfd_backed)",
                    vm_memory::GuestMemoryRegion::start_addr(region).0
                ))
            })
        })
        .collect()
}
