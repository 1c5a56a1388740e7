//! Runs the virtio-blk and virtio-rng queue processing over a virtqueue the fuzzer builds:
//! descriptor table, available ring and buffer contents all come from the input — addresses
//! (inside, straddling and far outside guest memory), lengths, flags (NEXT loops, WRITE,
//! INDIRECT tables), next indices, head indices and the available index. Guest memory has two
//! adjacent regions and one after a hole, so buffers also straddle region boundaries and gaps.
//! Must never panic or hang, and the device must never return more chains than it took.
#![no_main]

mod common;

use std::sync::{Mutex, OnceLock};

use libfuzzer_sys::fuzz_target;
use umbra_vmm::devices::virtio::block::Block;
use umbra_vmm::devices::virtio::rng::Rng;
use umbra_vmm::devices::virtio::VirtioDevice;
use umbra_vmm::vstate::memory::GuestMemory;
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use common::{build_queue, Input, RingLayout};

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
            rng: Rng::new().unwrap(),
        };
        std::fs::remove_file(&path).unwrap();
        Mutex::new(devices)
    })
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let control = input.u8();
    let queue_size = 1u16 << (control % 6); // 1..=32
    let device = (control >> 3) % 3;
    let rounds = 1 + (control >> 5) % 3;

    let mem: GuestMemory =
        GuestMemoryMmap::from_ranges(&REGIONS.map(|(start, len)| (GuestAddress(start), len))).unwrap();

    let layout = RingLayout {
        desc_table: DESC_TABLE,
        avail_ring: AVAIL_RING,
        used_ring: USED_RING,
        mem_end: MEM_END,
        small_len: 0x4000,
    };
    let mut queue = build_queue(&mut input, &mem, &layout, queue_size);
    // Everything left is buffer contents: request headers, indirect tables, data.
    let rest = &input.0[..input.0.len().min(0x5000)];
    mem.write_slice(rest, GuestAddress(DATA)).unwrap();

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
