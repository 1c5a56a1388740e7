//! Runs the virtio-blk and virtio-rng queue processing over a virtqueue the fuzzer builds:
//! descriptor table, available ring and buffer contents all come from the input — addresses
//! (inside, straddling and far outside guest memory), lengths, flags (NEXT loops, WRITE,
//! INDIRECT tables), next indices, head indices and the available index. Guest memory has two
//! adjacent regions and one after a hole, so buffers also straddle region boundaries and gaps.
//! Must never panic or hang, and the device must never return more chains than it took.
#![no_main]

use std::sync::{Mutex, OnceLock};

use libfuzzer_sys::fuzz_target;
use umbra_vmm::devices::virtio::block::Block;
use umbra_vmm::devices::virtio::rng::Rng;
use umbra_vmm::devices::virtio::VirtioDevice;
use umbra_vmm::vstate::memory::GuestMemory;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// Guest memory: [0, 32K) and [32K, 64K) adjacent, then a 4 KiB hole, then [68K, 72K).
const REGIONS: [(u64, usize); 3] = [(0, 0x8000), (0x8000, 0x8000), (0x1_1000, 0x1000)];
const MEM_END: u64 = 0x1_2000;
const DESC_TABLE: u64 = 0;
const AVAIL_RING: u64 = 0x1000;
const USED_RING: u64 = 0x2000;
/// Where the input's free-form bytes (headers, indirect tables, data) are copied.
const DATA: u64 = 0x3000;
/// The image: 64 sectors.
const IMAGE_LEN: u64 = 64 * 512;

struct Devices {
    read_only: Block,
    writable: Block,
    rng: Rng,
}

/// One small image file shared by every run, opened through `Block::new` as the VMM does and
/// unlinked at once (the devices keep it open), so nothing is left behind.
fn devices() -> &'static Mutex<Devices> {
    static DEVICES: OnceLock<Mutex<Devices>> = OnceLock::new();
    DEVICES.get_or_init(|| {
        let path = std::env::temp_dir().join(format!("umbra-fuzz-blk-{}.img", std::process::id()));
        std::fs::write(&path, vec![0x5a; IMAGE_LEN as usize]).unwrap();
        let devices = Devices {
            read_only: Block::new(path.clone(), true).unwrap(),
            writable: Block::new(path.clone(), false).unwrap(),
            rng: Rng::new(),
        };
        std::fs::remove_file(&path).unwrap();
        Mutex::new(devices)
    })
}

/// Reads little-endian integers off the front of the input, zero when it runs out.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let n = N.min(self.0.len());
        out[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        out
    }
    fn u8(&mut self) -> u8 {
        self.take::<1>()[0]
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let control = input.u8();
    let queue_size = 1u16 << (control % 6); // 1..=32
    let device = (control >> 3) % 3;
    let rounds = 1 + (control >> 5) % 3;

    let mem: GuestMemory =
        GuestMemoryMmap::from_ranges(&REGIONS.map(|(start, len)| (GuestAddress(start), len))).unwrap();

    // Descriptors: addresses mostly near guest memory (so they hit it, its edges and the hole),
    // sometimes anywhere; lengths mostly small, sometimes anything; flags and next raw.
    for i in 0..queue_size {
        let addr = input.u64();
        let addr = if addr >> 63 == 0 { addr % (MEM_END + 0x1000) } else { addr };
        let len = input.u32();
        let len = if len >> 31 == 0 { len % 0x4000 } else { len };
        let flags = input.u16();
        let next = input.u16();
        let mut raw = [0u8; 16];
        raw[0..8].copy_from_slice(&addr.to_le_bytes());
        raw[8..12].copy_from_slice(&len.to_le_bytes());
        raw[12..14].copy_from_slice(&flags.to_le_bytes());
        raw[14..16].copy_from_slice(&next.to_le_bytes());
        mem.write_slice(&raw, GuestAddress(DESC_TABLE + 16 * u64::from(i))).unwrap();
    }
    // Available ring: up to a queue's worth of raw head indices, and an index that is usually
    // their count but sometimes anything.
    let heads = input.u8() as u16 % (queue_size + 1);
    for i in 0..heads {
        let head = input.u16();
        mem.write_obj(head, GuestAddress(AVAIL_RING + 4 + 2 * u64::from(i))).unwrap();
    }
    let raw_idx = input.u16();
    let avail_idx = if raw_idx & 0x8000 == 0 { heads } else { raw_idx };
    mem.write_obj(avail_idx, GuestAddress(AVAIL_RING + 2)).unwrap();
    // Everything left is buffer contents: request headers, indirect tables, data.
    let rest = &input.0[..input.0.len().min(0x5000)];
    mem.write_slice(rest, GuestAddress(DATA)).unwrap();

    let mut queue = Queue::new(queue_size).unwrap();
    queue.set_size(queue_size);
    queue.set_desc_table_address(Some(DESC_TABLE as u32), Some(0));
    queue.set_avail_ring_address(Some(AVAIL_RING as u32), Some(0));
    queue.set_used_ring_address(Some(USED_RING as u32), Some(0));
    queue.set_ready(true);
    assert!(queue.is_valid(&mem));

    let mut devices = devices().lock().unwrap();
    let devices = &mut *devices;
    for _ in 0..rounds {
        match device {
            0 => drop(devices.read_only.process_queue(&mem, &mut queue)),
            1 => drop(devices.writable.process_queue(&mem, &mut queue)),
            _ => drop(devices.rng.process_queue(&mem, &mut queue)),
        }
    }

    // The device returns at most the chains it took, and takes at most a queue's worth per
    // call. (Guest memory, rings included, may have been overwritten by the device on the
    // guest's instructions, so the check uses the device's own queue state.)
    let (taken, returned) = (queue.next_avail(), queue.next_used());
    assert!(returned <= taken, "returned {returned} of {taken} chains");
    assert!(taken <= queue_size * u16::from(rounds), "took {taken} in {rounds} rounds of {queue_size}");

    // The config space answers any offset and size.
    let mut config = [0u8; 16];
    let offset = u64::from(control).wrapping_mul(0x0101_0101_0101_0101);
    devices.writable.read_config(offset, &mut config);
});
