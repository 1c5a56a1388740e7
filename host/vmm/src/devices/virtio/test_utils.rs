//! A minimal virtio driver for lane-(a) device tests: it writes descriptors and ring entries
//! into a `GuestMemoryMmap` the way a guest would (including the ways a hostile guest would),
//! and reads back the used ring; an interrupt that counts; waiting with a deadline. Shared by the
//! device tests (block, rng, virtio-fs, vsock).
//!
//! It lays the rings out itself rather than with `virtio_queue::mock::MockSplitQueue`: in
//! virtio-queue 0.18 the mock places the used ring `len` bytes (not `2 * len`) after the start
//! of the available ring's entries, so once more than half the ring has been used the device's
//! used-ring writes overwrite available entries.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use virtio_bindings::virtio_ring::VRING_DESC_F_NEXT;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::{Queue, QueueT};
use vm_memory::{ByteValued, Bytes, GuestAddress, GuestMemoryMmap};

use super::Interrupt;
use crate::vstate::memory::GuestMemory;

/// Guest memory for tests: 1 MiB at address 0. The rings sit at the bottom, buffers from
/// [`BUFFERS`] up.
pub fn guest_memory() -> GuestMemory {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap()
}

/// Where [`TestDriver::alloc`] hands out buffers.
pub const BUFFERS: u64 = 0x1_0000;

pub struct TestDriver<'a> {
    pub mem: &'a GuestMemory,
    size: u16,
    avail: u64,
    used: u64,
    next_desc: u16,
    avail_idx: u16,
    used_seen: u16,
    next_buffer: u64,
}

impl<'a> TestDriver<'a> {
    /// A driver for a queue of `size` entries: descriptor table at 0, then the available ring
    /// (flags, idx, ring, used_event), then the 4-aligned used ring.
    pub fn new(mem: &'a GuestMemory, size: u16) -> Self {
        let avail = 16 * u64::from(size);
        let used = (avail + 6 + 2 * u64::from(size) + 3) & !3;
        assert!(used + 6 + 8 * u64::from(size) <= BUFFERS);
        mem.write_slice(&vec![0u8; BUFFERS as usize], GuestAddress(0)).unwrap();
        TestDriver { mem, size, avail, used, next_desc: 0, avail_idx: 0, used_seen: 0, next_buffer: BUFFERS }
    }

    /// The device side of the queue, as the transport would hand it over.
    pub fn queue(&self) -> Queue {
        let mut q = Queue::new(self.size).unwrap();
        q.set_size(self.size);
        q.set_desc_table_address(Some(0), Some(0));
        q.set_avail_ring_address(Some(self.avail as u32), Some(0));
        q.set_used_ring_address(Some(self.used as u32), Some(0));
        q.set_ready(true);
        assert!(q.is_valid(self.mem));
        q
    }

    /// A fresh, zeroed, 16-byte-aligned buffer of `len` bytes.
    pub fn alloc(&mut self, len: u32) -> u64 {
        let addr = self.next_buffer;
        self.next_buffer = (addr + u64::from(len) + 15) & !15;
        assert!(self.next_buffer <= 1 << 20, "test buffers exhausted");
        self.mem.write_slice(&vec![0u8; len as usize], GuestAddress(addr)).unwrap();
        addr
    }

    /// Writes `(addr, len, flags)` as consecutive descriptors linked with NEXT, makes the chain
    /// available, and returns its head index.
    pub fn add_chain(&mut self, descriptors: &[(u64, u32, u16)]) -> u16 {
        let head = self.next_desc;
        for (i, &(addr, len, flags)) in descriptors.iter().enumerate() {
            let index = self.next_desc;
            self.next_desc = (self.next_desc + 1) % self.size;
            let (flags, next) =
                if i + 1 < descriptors.len() { (flags | VRING_DESC_F_NEXT as u16, self.next_desc) } else { (flags, 0) };
            self.write_descriptor(index, Descriptor::new(addr, len, flags, next));
        }
        self.make_available(head);
        head
    }

    /// Writes one raw descriptor at `index`, as a hostile driver may (loops, bad addresses).
    pub fn write_descriptor(&self, index: u16, descriptor: Descriptor) {
        assert!(index < self.size);
        self.write(16 * u64::from(index), RawDescriptor::from(descriptor).as_slice());
    }

    /// Puts `head` on the available ring, whatever it is.
    pub fn make_available(&mut self, head: u16) {
        let slot = self.avail + 4 + 2 * u64::from(self.avail_idx % self.size);
        self.mem.write_obj(head.to_le(), GuestAddress(slot)).unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.set_avail_idx(self.avail_idx);
    }

    /// How many buffers the driver made available so far (the available ring's index).
    pub fn avail_idx(&self) -> u16 {
        self.avail_idx
    }

    /// Writes the available ring's index directly (a hostile driver may claim anything).
    pub fn set_avail_idx(&self, idx: u16) {
        self.mem.write_obj(idx.to_le(), GuestAddress(self.avail + 2)).unwrap();
    }

    /// Skips `n` descriptor slots, so the next chain does not reuse ones a test wrote by hand.
    pub fn skip_descriptors(&mut self, n: u16) {
        self.next_desc = (self.next_desc + n) % self.size;
    }

    /// The next used-ring entry the device wrote, as `(head, len)`, if any.
    pub fn next_used(&mut self) -> Option<(u32, u32)> {
        let used = self.used;
        let idx = u16::from_le(self.mem.read_obj(GuestAddress(used + 2)).unwrap());
        if idx == self.used_seen {
            return None;
        }
        let slot = used + 4 + 8 * u64::from(self.used_seen % self.size);
        let id = u32::from_le(self.mem.read_obj(GuestAddress(slot)).unwrap());
        let len = u32::from_le(self.mem.read_obj(GuestAddress(slot + 4)).unwrap());
        self.used_seen = self.used_seen.wrapping_add(1);
        Some((id, len))
    }

    pub fn read(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        self.mem.read_slice(&mut buf, GuestAddress(addr)).unwrap();
        buf
    }

    pub fn write(&self, addr: u64, bytes: &[u8]) {
        self.mem.write_slice(bytes, GuestAddress(addr)).unwrap();
    }
}

/// A fresh directory under the system temp dir (the crate has no tempfile dependency); tests
/// remove it when they are done.
pub fn tempdir() -> PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "umbra-vmm-test-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Counts used-buffer interrupts.
#[derive(Default)]
pub struct CountingInterrupt(pub AtomicUsize);

impl CountingInterrupt {
    pub fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

impl Interrupt for CountingInterrupt {
    fn signal_used_queue(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
    fn signal_config_change(&self) {}
}

/// Polls `done` until it holds; fails the test naming `what` after 10 s.
pub fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}
