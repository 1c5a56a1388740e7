//! Lane-(a) tests of virtio-blk: a test driver builds descriptor chains in `GuestMemoryMmap`
//! over a real image file, and the queue loop runs without a vCPU. Every hostile chain must get
//! a defined answer (a status byte, or used length 0) and leave the device serving the next.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX, VIRTIO_BLK_S_IOERR,
    VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::Queue;
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::*;
use crate::devices::virtio::test_utils::{guest_memory, tempdir, wait_for, CountingInterrupt, TestDriver};
use crate::devices::virtio::worker::queue_has_pending;

const W: u16 = VRING_DESC_F_WRITE as u16;
const SECTORS: u64 = 64;

/// The image's initial content: distinct in every sector.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add((i / 512) as u8).wrapping_add(seed)).collect()
}

struct Fixture {
    dir: PathBuf,
    image: PathBuf,
    block: Block,
}

impl Fixture {
    fn new(read_only: bool) -> Fixture {
        let dir = tempdir();
        let image = dir.join("disk.img");
        std::fs::write(&image, pattern(SECTORS as usize * 512, 0)).unwrap();
        let block = Block::new(image.clone(), read_only).unwrap();
        Fixture { dir, image, block }
    }

    fn contents(&self) -> Vec<u8> {
        std::fs::read(&self.image).unwrap()
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn header(d: &mut TestDriver, request_type: u32, sector: u64) -> (u64, u32, u16) {
    let addr = d.alloc(16);
    let mut bytes = request_type.to_le_bytes().to_vec();
    bytes.extend_from_slice(&0u32.to_le_bytes());
    bytes.extend_from_slice(&sector.to_le_bytes());
    d.write(addr, &bytes);
    (addr, 16, 0)
}

/// A one-byte status descriptor, pre-filled with 0xff so an untouched status is visible.
fn status(d: &mut TestDriver) -> (u64, u32, u16) {
    let addr = d.alloc(1);
    d.write(addr, &[0xff]);
    (addr, 1, W)
}

/// Submits one chain, runs the device, and returns (status byte, used len).
fn submit(block: &mut Block, d: &mut TestDriver, q: &mut Queue, chain: &[(u64, u32, u16)]) -> (u8, u32) {
    let head = d.add_chain(chain);
    block.process_queue(d.mem, q);
    let (id, len) = d.next_used().expect("the chain was returned");
    assert_eq!(id, u32::from(head));
    assert_eq!(d.next_used(), None, "exactly one chain returned");
    let &(addr, len_last, _) = chain.last().unwrap();
    (d.read(addr + u64::from(len_last.max(1)) - 1, 1)[0], len)
}

/// Reads `len` bytes at `sector` through the device and returns them.
fn read_sectors(block: &mut Block, d: &mut TestDriver, q: &mut Queue, sector: u64, len: u32) -> Vec<u8> {
    let h = header(d, VIRTIO_BLK_T_IN, sector);
    let data = d.alloc(len);
    let s = status(d);
    assert_eq!(submit(block, d, q, &[h, (data, len, W), s]), (VIRTIO_BLK_S_OK as u8, len + 1));
    d.read(data, len as usize)
}

/// A valid request after a hostile one: the device is still serving.
fn assert_still_serving(f: &mut Fixture, d: &mut TestDriver, q: &mut Queue) {
    let got = read_sectors(&mut f.block, d, q, 1, 512);
    assert_eq!(got, f.contents()[512..1024]);
}

#[test]
fn reads_and_writes_round_trip_at_several_sectors() {
    let mut f = Fixture::new(false);
    let mem = guest_memory();
    let mut d = TestDriver::new(&mem, 16);
    let mut q = d.queue();
    let mut expected = f.contents();

    for (i, &sector) in [0u64, 5, 17, SECTORS - 2].iter().enumerate() {
        // Write two sectors from two buffers of different sizes (a 512 + 512 split).
        let new = pattern(1024, 100 + i as u8);
        let h = header(&mut d, VIRTIO_BLK_T_OUT, sector);
        let (a, b) = (d.alloc(512), d.alloc(512));
        d.write(a, &new[..512]);
        d.write(b, &new[512..]);
        let s = status(&mut d);
        let answer = submit(&mut f.block, &mut d, &mut q, &[h, (a, 512, 0), (b, 512, 0), s]);
        assert_eq!(answer, (VIRTIO_BLK_S_OK as u8, 1), "a write returns only the status byte");
        let at = sector as usize * 512;
        expected[at..at + 1024].copy_from_slice(&new);
        assert_eq!(f.contents(), expected, "file after writing sector {sector}");

        // Read the same range back into one buffer.
        assert_eq!(read_sectors(&mut f.block, &mut d, &mut q, sector, 1024), new);
    }
    // And a large read across the whole disk, in 4 KiB segments.
    let h = header(&mut d, VIRTIO_BLK_T_IN, 0);
    let mut chain = vec![h];
    for _ in 0..8 {
        let a = d.alloc(4096);
        chain.push((a, 4096, W));
    }
    chain.push(status(&mut d));
    assert_eq!(submit(&mut f.block, &mut d, &mut q, &chain), (VIRTIO_BLK_S_OK as u8, 32 * 1024 + 1));
    let read: Vec<u8> = chain[1..9].iter().flat_map(|&(a, len, _)| d.read(a, len as usize)).collect();
    assert_eq!(read, expected);
}

#[test]
fn flush_and_get_id() {
    let mut f = Fixture::new(false);
    let mem = guest_memory();
    let mut d = TestDriver::new(&mem, 16);
    let mut q = d.queue();

    let h = header(&mut d, VIRTIO_BLK_T_FLUSH, 0);
    let s = status(&mut d);
    assert_eq!(submit(&mut f.block, &mut d, &mut q, &[h, s]), (VIRTIO_BLK_S_OK as u8, 1));

    let h = header(&mut d, VIRTIO_BLK_T_GET_ID, 0);
    let id = d.alloc(20);
    d.write(id, &[0xaa; 20]);
    let s = status(&mut d);
    assert_eq!(submit(&mut f.block, &mut d, &mut q, &[h, (id, 20, W), s]), (VIRTIO_BLK_S_OK as u8, 21));
    let mut want = b"umbra-blk".to_vec();
    want.resize(20, 0);
    assert_eq!(d.read(id, 20), want);

    // A shorter buffer gets a prefix; the rest of the chain is untouched.
    let h = header(&mut d, VIRTIO_BLK_T_GET_ID, 0);
    let id = d.alloc(5);
    let s = status(&mut d);
    assert_eq!(submit(&mut f.block, &mut d, &mut q, &[h, (id, 5, W), s]), (VIRTIO_BLK_S_OK as u8, 6));
    assert_eq!(d.read(id, 5), b"umbra");

    // Unknown request types are unsupported, not errors.
    let h = header(&mut d, 0x1234, 0);
    let s = status(&mut d);
    assert_eq!(submit(&mut f.block, &mut d, &mut q, &[h, s]), (VIRTIO_BLK_S_UNSUPP as u8, 1));
}

#[test]
fn a_read_only_device_refuses_writes_and_leaves_the_file_alone() {
    let mut f = Fixture::new(true);
    let before = f.contents();
    let mem = guest_memory();
    let mut d = TestDriver::new(&mem, 16);
    let mut q = d.queue();

    let h = header(&mut d, VIRTIO_BLK_T_OUT, 3);
    let data = d.alloc(512);
    d.write(data, &[0x5a; 512]);
    let s = status(&mut d);
    assert_eq!(submit(&mut f.block, &mut d, &mut q, &[h, (data, 512, 0), s]), (VIRTIO_BLK_S_IOERR as u8, 1));
    assert_eq!(f.contents(), before);

    // Flush has nothing to do, and reads work.
    let h = header(&mut d, VIRTIO_BLK_T_FLUSH, 0);
    let s = status(&mut d);
    assert_eq!(submit(&mut f.block, &mut d, &mut q, &[h, s]), (VIRTIO_BLK_S_OK as u8, 1));
    assert_still_serving(&mut f, &mut d, &mut q);
}

#[test]
fn out_of_range_and_overflowing_sectors_are_io_errors() {
    let mut f = Fixture::new(false);
    let before = f.contents();
    let mem = guest_memory();
    let mut d = TestDriver::new(&mem, 16);
    let mut q = d.queue();

    let cases = [
        (VIRTIO_BLK_T_IN, SECTORS, 512),             // starts at the end
        (VIRTIO_BLK_T_IN, SECTORS - 1, 1024),        // runs past the end
        (VIRTIO_BLK_T_IN, u64::MAX, 512),            // sector + count overflows
        (VIRTIO_BLK_T_OUT, u64::MAX / 512 + 1, 512), // sector * 512 would overflow
        (VIRTIO_BLK_T_OUT, SECTORS, 512),
    ];
    for (request_type, sector, len) in cases {
        let h = header(&mut d, request_type, sector);
        let data = d.alloc(len);
        let flags = if request_type == VIRTIO_BLK_T_IN { W } else { 0 };
        let s = status(&mut d);
        let answer = submit(&mut f.block, &mut d, &mut q, &[h, (data, len, flags), s]);
        assert_eq!(answer, (VIRTIO_BLK_S_IOERR as u8, 1), "type {request_type} sector {sector} len {len}");
    }
    assert_eq!(f.contents(), before);
    // The last sector itself is fine.
    assert_eq!(read_sectors(&mut f.block, &mut d, &mut q, SECTORS - 1, 512), before[before.len() - 512..]);
}

#[test]
fn lengths_that_are_not_whole_sectors_are_io_errors() {
    let mut f = Fixture::new(false);
    let before = f.contents();
    let mem = guest_memory();
    let mut d = TestDriver::new(&mem, 16);
    let mut q = d.queue();
    for (request_type, len) in [(VIRTIO_BLK_T_IN, 100), (VIRTIO_BLK_T_IN, 513), (VIRTIO_BLK_T_OUT, 511)] {
        let h = header(&mut d, request_type, 0);
        let data = d.alloc(len);
        let flags = if request_type == VIRTIO_BLK_T_IN { W } else { 0 };
        let s = status(&mut d);
        let answer = submit(&mut f.block, &mut d, &mut q, &[h, (data, len, flags), s]);
        assert_eq!(answer, (VIRTIO_BLK_S_IOERR as u8, 1));
        if request_type == VIRTIO_BLK_T_IN {
            assert_eq!(d.read(data, len as usize), vec![0; len as usize], "nothing read into the guest");
        }
    }
    assert_eq!(f.contents(), before);
    assert_still_serving(&mut f, &mut d, &mut q);
}

#[test]
fn a_header_split_over_two_descriptors_is_valid() {
    let mut f = Fixture::new(false);
    let mem = guest_memory();
    let mut d = TestDriver::new(&mem, 16);
    let mut q = d.queue();
    let (h, _, _) = header(&mut d, VIRTIO_BLK_T_IN, 9);
    // Move the header's last 6 bytes to a separate buffer.
    let tail = d.alloc(6);
    d.write(tail, &d.read(h + 10, 6));
    d.write(h + 10, &[0xee; 6]);
    let data = d.alloc(512);
    let s = status(&mut d);
    let answer = submit(&mut f.block, &mut d, &mut q, &[(h, 10, 0), (tail, 6, 0), (data, 512, W), s]);
    assert_eq!(answer, (VIRTIO_BLK_S_OK as u8, 513));
    assert_eq!(d.read(data, 512), f.contents()[9 * 512..10 * 512]);
}

#[test]
fn chains_without_a_status_byte_come_back_with_length_zero() {
    let mut f = Fixture::new(false);
    let mem = guest_memory();
    let mut d = TestDriver::new(&mem, 16);
    let mut q = d.queue();

    // Header and data, no status.
    let h = header(&mut d, VIRTIO_BLK_T_IN, 0);
    let data = d.alloc(512);
    let head = d.add_chain(&[h, (data, 512, W), (data, 0, W)]);
    // Only a readable header.
    let h2 = header(&mut d, VIRTIO_BLK_T_IN, 0);
    let head2 = d.add_chain(&[h2]);
    // A status byte outside guest memory.
    let h3 = header(&mut d, VIRTIO_BLK_T_IN, 0);
    let head3 = d.add_chain(&[h3, (1 << 20, 1, W)]);
    f.block.process_queue(&mem, &mut q);
    assert_eq!(d.next_used(), Some((u32::from(head), 0)));
    assert_eq!(d.next_used(), Some((u32::from(head2), 0)));
    assert_eq!(d.next_used(), Some((u32::from(head3), 0)));
    assert_eq!(d.read(data, 512), vec![0; 512], "nothing written");
    assert_still_serving(&mut f, &mut d, &mut q);
}

#[test]
fn a_chain_without_a_header_gets_an_io_error() {
    let mut f = Fixture::new(false);
    let mem = guest_memory();
    let mut d = TestDriver::new(&mem, 16);
    let mut q = d.queue();
    let data = d.alloc(512);
    let s = status(&mut d);
    assert_eq!(submit(&mut f.block, &mut d, &mut q, &[(data, 512, W), s]), (VIRTIO_BLK_S_IOERR as u8, 1));
    let s = status(&mut d);
    assert_eq!(submit(&mut f.block, &mut d, &mut q, &[s]), (VIRTIO_BLK_S_IOERR as u8, 1));
    assert_still_serving(&mut f, &mut d, &mut q);
}

#[test]
fn buffers_in_the_wrong_direction_are_io_errors() {
    let mut f = Fixture::new(false);
    let before = f.contents();
    let mem = guest_memory();
    let mut d = TestDriver::new(&mem, 16);
    let mut q = d.queue();

    // A read whose data buffer is device-readable.
    let h = header(&mut d, VIRTIO_BLK_T_IN, 0);
    let data = d.alloc(512);
    let s = status(&mut d);
    assert_eq!(submit(&mut f.block, &mut d, &mut q, &[h, (data, 512, 0), s]), (VIRTIO_BLK_S_IOERR as u8, 1));
    // A write whose data buffer is device-writable: the file is untouched, the buffer too.
    let h = header(&mut d, VIRTIO_BLK_T_OUT, 0);
    let data = d.alloc(512);
    d.write(data, &[0x77; 512]);
    let s = status(&mut d);
    assert_eq!(submit(&mut f.block, &mut d, &mut q, &[h, (data, 512, W), s]), (VIRTIO_BLK_S_IOERR as u8, 1));
    assert_eq!(d.read(data, 512), vec![0x77; 512]);
    // A readable buffer after a writable one.
    let h = header(&mut d, VIRTIO_BLK_T_OUT, 0);
    let (a, b) = (d.alloc(512), d.alloc(512));
    let s = status(&mut d);
    assert_eq!(submit(&mut f.block, &mut d, &mut q, &[h, (a, 512, W), (b, 512, 0), s]), (VIRTIO_BLK_S_IOERR as u8, 1));
    assert_eq!(f.contents(), before);
    assert_still_serving(&mut f, &mut d, &mut q);
}

#[test]
fn buffers_outside_guest_memory_are_io_errors() {
    let mut f = Fixture::new(false);
    let mem = guest_memory();
    let mut d = TestDriver::new(&mem, 16);
    let mut q = d.queue();
    let end = 1u64 << 20;
    for data in [(end, 512, W), (end - 256, 512, W), (u64::MAX - 511, 512, W), (u64::MAX, 512, W)] {
        let h = header(&mut d, VIRTIO_BLK_T_IN, 0);
        let s = status(&mut d);
        assert_eq!(submit(&mut f.block, &mut d, &mut q, &[h, data, s]), (VIRTIO_BLK_S_IOERR as u8, 1), "{data:?}");
    }
    // The header itself outside memory.
    let data = d.alloc(512);
    let s = status(&mut d);
    let answer = submit(&mut f.block, &mut d, &mut q, &[(end + 0x1000, 16, 0), (data, 512, W), s]);
    assert_eq!(answer, (VIRTIO_BLK_S_IOERR as u8, 1));
    assert_still_serving(&mut f, &mut d, &mut q);
}

#[test]
fn descriptor_loops_end_and_the_chain_is_returned() {
    let mut f = Fixture::new(false);
    let mem = guest_memory();
    let mut d = TestDriver::new(&mem, 16);
    let mut q = d.queue();
    let next = VRING_DESC_F_NEXT as u16;

    // 0 -> 1 -> 0 -> ...: header, writable status, header, ...
    let (h, _, _) = header(&mut d, VIRTIO_BLK_T_IN, 0);
    let s = d.alloc(1);
    d.write_descriptor(0, Descriptor::new(h, 16, next, 1));
    d.write_descriptor(1, Descriptor::new(s, 1, next | W, 0));
    d.make_available(0);
    // 2 -> 2 -> ...: a descriptor that points at itself.
    d.write_descriptor(2, Descriptor::new(s, 1, next | W, 2));
    d.make_available(2);
    d.skip_descriptors(3);
    f.block.process_queue(&mem, &mut q);
    let (id, len) = d.next_used().unwrap();
    assert_eq!(id, 0);
    assert!(len <= 1, "IOERR or no status, got used len {len}");
    let (id, len) = d.next_used().unwrap();
    assert_eq!(id, 2);
    assert!(len <= 1, "IOERR or no status, got used len {len}");
    assert_still_serving(&mut f, &mut d, &mut q);
}

#[test]
fn over_long_chains_through_indirect_tables_are_refused() {
    let mut f = Fixture::new(false);
    let mem = guest_memory();
    let mut d = TestDriver::new(&mem, 16);
    let mut q = d.queue();

    // An indirect table of MAX_DESCRIPTORS + 44 descriptors: header, 1-byte fillers, status.
    let count = request::MAX_DESCRIPTORS as u16 + 44;
    let table = d.alloc(16 * u32::from(count));
    let (h, _, _) = header(&mut d, VIRTIO_BLK_T_FLUSH, 0);
    let s = status(&mut d).0;
    for i in 0..count {
        let next = VRING_DESC_F_NEXT as u16;
        let desc = match i {
            0 => Descriptor::new(h, 16, next, 1),
            i if i + 1 == count => Descriptor::new(s, 1, W, 0),
            i => Descriptor::new(s, 1, next | W, i + 1),
        };
        d.write(table + 16 * u64::from(i), Descriptor::as_slice(&desc));
    }
    let head = d.add_chain(&[(table, 16 * u32::from(count), VRING_DESC_F_INDIRECT as u16)]);
    f.block.process_queue(&mem, &mut q);
    assert_eq!(d.next_used(), Some((u32::from(head), 0)));
    assert_eq!(d.read(s, 1), [0xff], "no status written");

    // The same through a table of a legal length works.
    let table = d.alloc(32);
    d.write(table, Descriptor::new(h, 16, VRING_DESC_F_NEXT as u16, 1).as_slice());
    d.write(table + 16, Descriptor::new(s, 1, W, 0).as_slice());
    let answer = submit(&mut f.block, &mut d, &mut q, &[(table, 32, VRING_DESC_F_INDIRECT as u16)]);
    // The last byte of the indirect table is not the status; read it where it is.
    assert_eq!(answer.1, 1);
    assert_eq!(d.read(s, 1), [VIRTIO_BLK_S_OK as u8]);
    assert_still_serving(&mut f, &mut d, &mut q);
}

#[test]
fn hostile_ring_indices_neither_hang_nor_stop_the_device() {
    let mut f = Fixture::new(false);
    let mem = guest_memory();
    let mut d = TestDriver::new(&mem, 16);
    let mut q = d.queue();

    // A head index outside the descriptor table: taken, and nothing can be returned for it.
    d.make_available(999);
    assert!(!f.block.process_queue(&mem, &mut q));
    assert_eq!(d.next_used(), None);
    assert_still_serving(&mut f, &mut d, &mut q);

    // An available index claiming more than a queue's worth of new chains: refused as a whole,
    // and the worker is not told to come back for it.
    d.set_avail_idx(q.next_avail().wrapping_add(1000));
    let started = Instant::now();
    assert!(!f.block.process_queue(&mem, &mut q));
    assert!(!queue_has_pending(&q, &mem));
    assert!(started.elapsed() < Duration::from_secs(1));
    assert_eq!(d.next_used(), None);
}

#[test]
fn one_call_processes_at_most_a_queue_worth_of_chains() {
    let mut f = Fixture::new(false);
    let mem = guest_memory();
    let mut d = TestDriver::new(&mem, 4);
    let mut q = d.queue();
    for _ in 0..4 {
        let h = header(&mut d, VIRTIO_BLK_T_FLUSH, 0);
        let s = status(&mut d);
        d.add_chain(&[h, s]);
    }
    assert!(f.block.process_queue(&mem, &mut q));
    for _ in 0..4 {
        assert_eq!(d.next_used().unwrap().1, 1);
    }
    assert!(!queue_has_pending(&q, &mem));
}

#[test]
fn one_call_moves_a_bounded_amount_of_data() {
    let dir = tempdir();
    let image = dir.join("big.img");
    std::fs::File::create(&image).unwrap().set_len(request::MAX_DATA_LEN).unwrap();
    let mut block = Block::new(image, true).unwrap();
    let size = (request::MAX_DATA_LEN + (2 << 20)) as usize;
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), size)]).unwrap();
    let mut d = TestDriver::new(&mem, 16);
    let mut q = d.queue();
    // Requests of the maximal size, all into the same guest buffer above the test buffers.
    let per_call = (MAX_BATCH_DATA / request::MAX_DATA_LEN) as usize;
    for _ in 0..per_call + 1 {
        let h = header(&mut d, VIRTIO_BLK_T_IN, 0);
        let s = status(&mut d);
        d.add_chain(&[h, (1 << 20, request::MAX_DATA_LEN as u32, W), s]);
    }
    assert!(block.process_queue(&mem, &mut q));
    for _ in 0..per_call {
        assert_eq!(d.next_used().unwrap().1, request::MAX_DATA_LEN as u32 + 1);
    }
    assert_eq!(d.next_used(), None, "the batch stops at MAX_BATCH_DATA");
    assert!(queue_has_pending(&q, &mem), "and the worker is told to come back");
    assert!(block.process_queue(&mem, &mut q));
    assert_eq!(d.next_used().unwrap().1, request::MAX_DATA_LEN as u32 + 1);
    assert!(!queue_has_pending(&q, &mem));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn features_and_config_space() {
    let ro = Fixture::new(true);
    let rw = Fixture::new(false);
    let common = (1 << VIRTIO_BLK_F_SEG_MAX) | (1 << VIRTIO_BLK_F_SIZE_MAX);
    assert_eq!(ro.block.avail_features(), common | (1 << VIRTIO_BLK_F_RO));
    assert_eq!(rw.block.avail_features(), common | (1 << VIRTIO_BLK_F_FLUSH));
    assert_eq!(ro.block.device_type(), 2);
    assert_eq!(ro.block.queue_max_sizes(), &[256]);

    let mut config = [0xffu8; 24];
    ro.block.read_config(0, &mut config);
    assert_eq!(u64::from_le_bytes(config[0..8].try_into().unwrap()), SECTORS);
    assert_eq!(u32::from_le_bytes(config[8..12].try_into().unwrap()), request::SIZE_MAX);
    assert_eq!(u32::from_le_bytes(config[12..16].try_into().unwrap()), request::SEG_MAX);
    assert_eq!(config[16..], [0; 8], "past the end reads as zero");
    let mut byte = [0xff];
    ro.block.read_config(0, &mut byte);
    assert_eq!(byte, [SECTORS as u8]);
    let mut far = [0xffu8; 4];
    ro.block.read_config(u64::MAX - 1, &mut far);
    assert_eq!(far, [0; 4]);
}

#[test]
fn image_files_must_be_whole_sectors() {
    let dir = tempdir();
    let image = dir.join("odd.img");
    std::fs::write(&image, [0u8; 700]).unwrap();
    let err = Block::new(image, true).err().expect("a partial sector is refused");
    assert!(err.to_string().contains("not a multiple of 512"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn the_worker_serves_notifications_until_reset() {
    let mut f = Fixture::new(true);
    let expected = f.contents();
    let mem = guest_memory();
    let mut d = TestDriver::new(&mem, 16);
    let notify = EventFd::new(EFD_NONBLOCK).unwrap();
    let kick = notify.try_clone().unwrap();
    let interrupt = Arc::new(CountingInterrupt::default());

    // A request made available before activation is served by the first pass.
    let h = header(&mut d, VIRTIO_BLK_T_IN, 2);
    let data = d.alloc(512);
    let s = status(&mut d);
    d.add_chain(&[h, (data, 512, W), s]);
    let queues = vec![ActiveQueue { queue: d.queue(), notify }];
    f.block.activate(mem.clone(), interrupt.clone(), 0, queues).unwrap();
    wait_for("the first interrupt", || interrupt.0.load(Ordering::SeqCst) >= 1);
    assert_eq!(d.next_used().unwrap().1, 513);
    assert_eq!(d.read(data, 512), expected[1024..1536]);

    // Later requests are served on notification.
    let h = header(&mut d, VIRTIO_BLK_T_GET_ID, 0);
    let id = d.alloc(20);
    let s = status(&mut d);
    d.add_chain(&[h, (id, 20, W), s]);
    kick.write(1).unwrap();
    wait_for("the second interrupt", || interrupt.0.load(Ordering::SeqCst) >= 2);
    assert_eq!(d.next_used().unwrap().1, 21);

    // A second activation without reset is refused; after reset nothing is served.
    let again = vec![ActiveQueue { queue: d.queue(), notify: kick.try_clone().unwrap() }];
    assert!(f.block.activate(mem.clone(), interrupt.clone(), 0, again).is_err());
    assert!(f.block.reset());
    let h = header(&mut d, VIRTIO_BLK_T_FLUSH, 0);
    let s = status(&mut d);
    d.add_chain(&[h, s]);
    kick.write(1).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(d.next_used(), None);
}

#[test]
fn activation_needs_exactly_one_queue() {
    let mut f = Fixture::new(true);
    let mem = guest_memory();
    let interrupt = Arc::new(CountingInterrupt::default());
    let err = f.block.activate(mem, interrupt, 0, Vec::new()).unwrap_err();
    assert!(matches!(err, ActivateError::QueueCount { want: 1, got: 0 }), "{err}");
}
