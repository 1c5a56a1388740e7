//! Runs the vsock device's tx then rx processing over virtqueues the fuzzer builds: both
//! descriptor tables, both available rings and all buffer contents (packet headers, data) come
//! from the input — addresses inside, straddling and outside guest memory, raw lengths, flags
//! (NEXT loops, WRITE in tx, read-only in rx, INDIRECT), next and head indices, available
//! indices. Before the guest's packets arrive, a real host process may have connected through
//! the hybrid vsock socket (`CONNECT 1024`, with bytes queued behind it), so packets for a live
//! connection — RESPONSE, RW, SHUTDOWN, credit — reach the connection state machine too.
//! Must never panic or hang, and never return more chains than it took.
#![no_main]

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use umbra_vmm::devices::virtio::vsock::VsockMuxer;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const GUEST_CID: u64 = 3;
/// Guest memory: [0, 64K) and [64K, 128K) adjacent, a 4 KiB hole, then [132K, 136K).
const REGIONS: [(u64, usize); 3] = [(0, 0x1_0000), (0x1_0000, 0x1_0000), (0x2_1000, 0x1000)];
const MEM_END: u64 = 0x2_2000;
const TX_RING: u64 = 0x0;
const RX_RING: u64 = 0x800;
/// Offsets of the avail and used rings from the descriptor table (room for 32 descriptors).
const AVAIL_OFFSET: u64 = 0x200;
const USED_OFFSET: u64 = 0x300;
/// Where the input's free-form bytes (headers, data) are copied; they run across the boundary
/// between the first two regions.
const DATA: u64 = 0x1000;
const DATA_MAX: usize = 0x1_f000;

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

/// Writes a queue of `size` descriptors, its available ring and index from the input, and
/// returns the device's view of it.
fn build_queue(input: &mut Input<'_>, mem: &GuestMemoryMmap, base: u64, size: u16) -> Queue {
    for i in 0..size {
        // Addresses mostly near guest memory (hitting it, its edges and the hole), sometimes
        // anywhere; lengths mostly packet-sized, sometimes anything; flags and next raw.
        let addr = input.u64();
        let addr = if addr >> 63 == 0 { addr % (MEM_END + 0x1000) } else { addr };
        let len = input.u32();
        let len = if len >> 31 == 0 { len % 0x1_2000 } else { len };
        let flags = input.u16();
        let next = input.u16();
        let mut raw = [0u8; 16];
        raw[0..8].copy_from_slice(&addr.to_le_bytes());
        raw[8..12].copy_from_slice(&len.to_le_bytes());
        raw[12..14].copy_from_slice(&flags.to_le_bytes());
        raw[14..16].copy_from_slice(&next.to_le_bytes());
        mem.write_slice(&raw, GuestAddress(base + 16 * u64::from(i))).unwrap();
    }
    let heads = u16::from(input.u8()) % (size + 1);
    for i in 0..heads {
        let head = input.u16();
        mem.write_obj(head, GuestAddress(base + AVAIL_OFFSET + 4 + 2 * u64::from(i))).unwrap();
    }
    let raw_idx = input.u16();
    let avail_idx = if raw_idx & 0x8000 == 0 { heads } else { raw_idx };
    mem.write_obj(avail_idx, GuestAddress(base + AVAIL_OFFSET + 2)).unwrap();

    let mut queue = Queue::new(size).unwrap();
    queue.set_size(size);
    queue.try_set_desc_table_address(GuestAddress(base)).unwrap();
    queue.try_set_avail_ring_address(GuestAddress(base + AVAIL_OFFSET)).unwrap();
    queue.try_set_used_ring_address(GuestAddress(base + USED_OFFSET)).unwrap();
    queue.set_ready(true);
    assert!(queue.is_valid(mem));
    queue
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let sizes = input.u8();
    let tx_size = 1u16 << (sizes % 6); // 1..=32
    let rx_size = 1u16 << ((sizes >> 3) % 6);
    let control = input.u8();
    let host_connects = control & 1 != 0;
    let host_writes = control & 2 != 0;
    let expire = control & 4 != 0;
    let rounds = 1 + (control >> 3) % 3;

    let mem = GuestMemoryMmap::from_ranges(&REGIONS.map(|(start, len)| (GuestAddress(start), len))).unwrap();
    let mut tx = build_queue(&mut input, &mem, TX_RING, tx_size);
    let mut rx = build_queue(&mut input, &mem, RX_RING, rx_size);
    let rest = &input.0[..input.0.len().min(DATA_MAX)];
    mem.write_slice(rest, GuestAddress(DATA)).unwrap();

    static N: AtomicU64 = AtomicU64::new(0);
    // A fresh device per input, so runs do not depend on each other; the socket file goes
    // with it.
    let path = std::env::temp_dir().join(format!(
        "umbra-fuzz-vsock-{}-{}.sock",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let mut muxer = VsockMuxer::new(GUEST_CID, &path).unwrap();

    // A host process asks for guest port 1024 (host port 1 << 30) and may queue bytes behind
    // the line; it stays connected for the whole run.
    let _host = host_connects.then(|| {
        let mut host = UnixStream::connect(&path).unwrap();
        host.write_all(b"CONNECT 1024\n").unwrap();
        if host_writes {
            host.write_all(&[0xa5; 9000]).unwrap();
        }
        muxer.handle_host_events();
        host
    });

    for _ in 0..rounds {
        muxer.process_tx(&mem, &mut tx);
        muxer.handle_host_events();
        muxer.process_rx(&mem, &mut rx);
    }
    if expire {
        muxer.process_timeouts(Instant::now() + Duration::from_secs(10));
        muxer.process_rx(&mem, &mut rx);
    }

    // The device returns at most the chains it took, and takes at most 256 per call. (Its rx
    // writes may land on the rings themselves, where the guest's buffers pointed them, so
    // the available index can move mid-run; the checks use the device's own queue state.)
    let calls = u32::from(rounds) + 1;
    for queue in [&tx, &rx] {
        let (taken, returned) = (queue.next_avail(), queue.next_used());
        assert!(returned <= taken, "returned {returned} of {taken} chains");
        assert!(u32::from(taken) <= 256 * calls, "took {taken} chains in {calls} calls");
    }
    assert!(muxer.connection_count() <= 1 + usize::from(tx.next_avail()));
});
