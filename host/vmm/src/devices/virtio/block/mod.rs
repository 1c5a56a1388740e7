//! virtio-blk (virtio 1.2 §5.2): the guest's root image (read-only) and an optional scratch file.
//!
//! Files: `mod.rs` is the device — features, config space, activation, and the queue loop that
//! turns each descriptor chain into a used-ring entry; [`request`] parses and checks a chain
//! (every guest-controlled value is judged there); [`disk`] is the image file and executes
//! checked requests with `pread`/`pwrite` straight into guest memory.
//!
//! The queue loop's contract with a hostile driver: every chain it takes from the available ring
//! goes back on the used ring (unless its head index names no descriptor), with status S_OK,
//! S_IOERR or S_UNSUPP written to the chain's status byte — or, when the chain has no usable
//! status byte, with used length 0 and nothing written. One call handles at most a queue's worth
//! of chains and about [`MAX_BATCH_DATA`] bytes of data, each chain at most
//! [`request::MAX_DESCRIPTORS`] descriptors and [`request::MAX_DATA_LEN`] bytes, so work per call
//! is bounded; the worker comes back for the rest after checking its exit eventfd.

pub mod disk;
pub mod request;

#[cfg(test)]
mod tests;

use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX, VIRTIO_BLK_S_IOERR,
    VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP,
};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{ByteValued, Bytes};

use self::disk::Disk;
use self::request::{RequestKind, MAX_DESCRIPTORS, SEG_MAX, SIZE_MAX};
use super::worker::{activate_single_queue, Worker};
use super::{device_type, read_config_bytes, ActivateError, ActiveQueue, Interrupt, VirtioDevice};
use crate::seccomp::{Lane, ThreadKind};
use crate::vstate::memory::GuestMemory;

/// The size of the one request queue.
pub const QUEUE_SIZE: u16 = 256;
/// Data one call of the queue loop moves before it returns (finishing the request it is on),
/// so a reset or VM exit waits for at most this much I/O rather than a full ring of requests.
pub const MAX_BATCH_DATA: u64 = 32 << 20;

/// The part of `struct virtio_blk_config` this device fills in; the rest reads as zero.
///
/// ```text
/// struct virtio_blk_config {
///     le64 capacity;   // in 512-byte sectors
///     le32 size_max;   // VIRTIO_BLK_F_SIZE_MAX
///     le32 seg_max;    // VIRTIO_BLK_F_SEG_MAX
///     ...              // geometry, blk_size, topology, ...: not offered
/// };
/// ```
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct ConfigSpace {
    capacity: u64,
    size_max: u32,
    seg_max: u32,
}

// SAFETY: integer fields only, no padding (8 + 4 + 4 bytes, 8-aligned), any bit pattern valid.
unsafe impl ByteValued for ConfigSpace {}

/// A virtio-blk device backed by an image file.
pub struct Block {
    disk: Arc<Disk>,
    config: ConfigSpace,
    worker: Option<Worker>,
    lane: Lane,
}

impl Block {
    /// Opens `image` (read-only: `O_RDONLY`, and the guest is told with VIRTIO_BLK_F_RO). The
    /// image's size must be a multiple of 512 bytes.
    pub fn new(image: PathBuf, read_only: bool) -> io::Result<Block> {
        Block::with_disk(Disk::open(&image, read_only)?)
    }

    /// The device for a disk opened earlier (umbra-vmm opens every host file before it enters
    /// its jail).
    pub fn with_disk(disk: Disk) -> io::Result<Block> {
        let config =
            ConfigSpace { capacity: disk.capacity().to_le(), size_max: SIZE_MAX.to_le(), seg_max: SEG_MAX.to_le() };
        let lane = Lane::start(ThreadKind::Block, "umbra-blk")?;
        Ok(Block { disk: Arc::new(disk), config, worker: None, lane })
    }

    pub fn disk(&self) -> &Disk {
        &self.disk
    }

    /// Processes the chains the driver made available (at most a queue's worth, and about
    /// [`MAX_BATCH_DATA`] bytes) and returns whether the driver should be interrupted. The worker
    /// calls this, and again while `worker::queue_has_pending`; lane-(a) tests call it directly.
    pub fn process_queue(&mut self, mem: &GuestMemory, queue: &mut Queue) -> bool {
        process_queue(&self.disk, mem, queue)
    }
}

/// See [`Block::process_queue`].
fn process_queue(disk: &Disk, mem: &GuestMemory, queue: &mut Queue) -> bool {
    let budget = queue.size();
    let mut used = false;
    // Only a hint without EVENT_IDX, but without it the driver would kick for every request.
    let _ = queue.disable_notification(mem);
    let mut moved = 0u64;
    for _ in 0..budget {
        let Some(chain) = queue.pop_descriptor_chain(mem) else { break };
        let head = chain.head_index();
        let (len, data_len) = handle_chain(disk, mem, chain);
        // Fails only for a head index outside the descriptor table, which names no chain to
        // return; the driver gets nothing back for it.
        used |= queue.add_used(mem, head, len).is_ok();
        moved += data_len;
        if moved >= MAX_BATCH_DATA {
            break;
        }
    }
    // Re-enable before returning; chains that arrived meanwhile are seen by the worker's
    // `queue_has_pending` check after this call.
    let _ = queue.enable_notification(mem);
    used && queue.needs_notification(mem).unwrap_or(true)
}

/// Runs one request and returns the used length — bytes written into the chain, including the
/// status byte, or 0 when the chain has no status byte to write — and the data bytes the
/// request covered (for the batch bound).
fn handle_chain(disk: &Disk, mem: &GuestMemory, chain: DescriptorChain<&GuestMemory>) -> (u32, u64) {
    // The chain iterator ends loops (at most the table's size) and stops at descriptors outside
    // memory; a chain longer than any request needs is refused before parsing.
    let mut descriptors: Vec<Descriptor> = Vec::with_capacity(4);
    for descriptor in chain {
        if descriptors.len() == MAX_DESCRIPTORS {
            return (0, 0);
        }
        descriptors.push(descriptor);
    }
    let Some(status_addr) = request::status_address(mem, &descriptors) else { return (0, 0) };
    let (status, written, data_len) = match request::parse(mem, &descriptors) {
        Ok(req) if matches!(req.kind, RequestKind::Unsupported(_)) => (VIRTIO_BLK_S_UNSUPP, 0, 0),
        Ok(req) => match disk.execute(mem, &req) {
            Ok(written) => (VIRTIO_BLK_S_OK, written, req.data_len),
            Err(_) => (VIRTIO_BLK_S_IOERR, 0, req.data_len),
        },
        Err(_) => (VIRTIO_BLK_S_IOERR, 0, 0),
    };
    // status_address checked the byte is in guest memory.
    if mem.write_obj(status as u8, status_addr).is_err() {
        return (0, data_len);
    }
    (written + 1, data_len)
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        device_type::BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn avail_features(&self) -> u64 {
        let mut features = (1 << VIRTIO_BLK_F_SEG_MAX) | (1 << VIRTIO_BLK_F_SIZE_MAX);
        if self.disk.read_only() {
            features |= 1 << VIRTIO_BLK_F_RO;
        } else {
            // Writes land in the host page cache; FLUSH makes them durable (fdatasync).
            features |= 1 << VIRTIO_BLK_F_FLUSH;
        }
        features
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(self.config.as_slice(), offset, data);
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        interrupt: Arc<dyn Interrupt>,
        _acked_features: u64,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError> {
        let disk = self.disk.clone();
        activate_single_queue(&mut self.worker, &self.lane, "blk", mem, interrupt, queues, move |mem, queue| {
            process_queue(&disk, mem, queue)
        })
    }

    fn reset(&mut self) -> bool {
        // Joins the worker: it has finished its last request and holds no queue any more.
        self.worker = None;
        true
    }
}
