//! Runs the vsock device's tx then rx processing over virtqueues the fuzzer builds: both
//! descriptor tables, both available rings and all buffer contents (packet headers, data) come
//! from the input — addresses inside, straddling and outside guest memory, raw lengths, flags
//! (NEXT loops, WRITE in tx, read-only in rx, INDIRECT), next and head indices, available
//! indices. Before the guest's packets arrive, a real host process may have connected through
//! the hybrid vsock socket (`CONNECT 1024`, with bytes queued behind it), so packets for a live
//! connection — RESPONSE, RW, SHUTDOWN, credit — reach the connection state machine too.
//! Must never panic or hang, and never return more chains than it took.
#![no_main]

mod common;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use umbra_vmm::devices::virtio::vsock::VsockMuxer;
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use common::{build_queue, Input, RingLayout};

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

/// A queue's rings at `base`: descriptor table, then the avail and used rings.
fn ring_layout(base: u64) -> RingLayout {
    RingLayout {
        desc_table: base,
        avail_ring: base + AVAIL_OFFSET,
        used_ring: base + USED_OFFSET,
        mem_end: MEM_END,
        // Mostly packet-sized.
        small_len: 0x1_2000,
    }
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
    let mut tx = build_queue(&mut input, &mem, &ring_layout(TX_RING), tx_size);
    let mut rx = build_queue(&mut input, &mem, &ring_layout(RX_RING), rx_size);
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
