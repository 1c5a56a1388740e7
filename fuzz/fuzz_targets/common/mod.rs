//! What the virtqueue fuzz targets share: reading integers off the input, and building a split
//! virtqueue — descriptor table, available ring and index — from it, the way a hostile guest
//! would. Included by each target with `mod common;`.

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// Reads little-endian integers off the front of the input, zero when it runs out.
pub struct Input<'a>(pub &'a [u8]);

impl Input<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let n = N.min(self.0.len());
        out[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        out
    }
    pub fn u8(&mut self) -> u8 {
        self.take::<1>()[0]
    }
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take())
    }
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }
    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }
}

/// Where a queue's rings sit in guest memory, and what the fuzzer's descriptors aim at.
pub struct RingLayout {
    pub desc_table: u64,
    pub avail_ring: u64,
    pub used_ring: u64,
    /// The end of guest memory: most descriptor addresses fall below it plus a page, so they
    /// hit memory, its edges and its holes.
    pub mem_end: u64,
    /// The bound on "small" descriptor lengths (most are; the rest are anything).
    pub small_len: u32,
}

/// Writes a queue of `size` descriptors, its available ring and index from the input, and
/// returns the device's view of it.
pub fn build_queue(input: &mut Input<'_>, mem: &GuestMemoryMmap, layout: &RingLayout, size: u16) -> Queue {
    for i in 0..size {
        // Addresses mostly near guest memory, sometimes anywhere; lengths mostly small,
        // sometimes anything; flags and next raw.
        let addr = input.u64();
        let addr = if addr >> 63 == 0 { addr % (layout.mem_end + 0x1000) } else { addr };
        let len = input.u32();
        let len = if len >> 31 == 0 { len % layout.small_len } else { len };
        let flags = input.u16();
        let next = input.u16();
        let mut raw = [0u8; 16];
        raw[0..8].copy_from_slice(&addr.to_le_bytes());
        raw[8..12].copy_from_slice(&len.to_le_bytes());
        raw[12..14].copy_from_slice(&flags.to_le_bytes());
        raw[14..16].copy_from_slice(&next.to_le_bytes());
        mem.write_slice(&raw, GuestAddress(layout.desc_table + 16 * u64::from(i))).unwrap();
    }
    // Up to a queue's worth of raw head indices, and an index that is usually their count but
    // sometimes anything.
    let heads = u16::from(input.u8()) % (size + 1);
    for i in 0..heads {
        let head = input.u16();
        mem.write_obj(head, GuestAddress(layout.avail_ring + 4 + 2 * u64::from(i))).unwrap();
    }
    let raw_idx = input.u16();
    let avail_idx = if raw_idx & 0x8000 == 0 { heads } else { raw_idx };
    mem.write_obj(avail_idx, GuestAddress(layout.avail_ring + 2)).unwrap();

    let mut queue = Queue::new(size).unwrap();
    queue.set_size(size);
    queue.try_set_desc_table_address(GuestAddress(layout.desc_table)).unwrap();
    queue.try_set_avail_ring_address(GuestAddress(layout.avail_ring)).unwrap();
    queue.try_set_used_ring_address(GuestAddress(layout.used_ring)).unwrap();
    queue.set_ready(true);
    assert!(queue.is_valid(mem));
    queue
}
