//! A fake guest driver for lane-(a) tests: split queues in a `GuestMemoryMmap` (laid out by
//! virtio-queue's `MockSplitQueue`), descriptor chains written the way Linux's virtio_vsock
//! driver writes them, and a temporary directory for the real Unix sockets.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use virtio_bindings::bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::{ByteValued, Bytes, GuestAddress, GuestMemoryMmap};

use super::connection::BUF_ALLOC;
use super::muxer::VsockMuxer;
use super::packet::{op, VsockPacketHeader, HDR_SIZE, HOST_CID, TYPE_STREAM};

pub const GUEST_CID: u64 = 3;
pub const QUEUE_SIZE: u16 = 256;
/// Linux's rx buffer: a header descriptor and a 4 KiB data descriptor.
pub const RX_DATA_SIZE: u32 = 4096;
const MEM_SIZE: usize = 48 << 20;
const TX_RING: u64 = 0x0;
const RX_RING: u64 = 0x8000;
const USED_RING_OFFSET: u64 = 0x2000;
/// Each descriptor index owns a buffer slot big enough for a header and 64 KiB of data.
const SLOT: u64 = 0x1_1000;
const TX_BUFS: u64 = 0x10_0000;
const RX_BUFS: u64 = 0x140_0000;

/// Free guest memory for tests' hand-made buffers (up to the end of memory at 48 MiB).
pub const SCRATCH: u64 = 0x280_0000;
pub const WRITE: u16 = VRING_DESC_F_WRITE as u16;

pub fn guest_memory() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap()
}

/// A directory under the system temp dir, removed (with the sockets in it) on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new() -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "umbra-vsock-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn socket(&self) -> PathBuf {
        self.0.join("v.sock")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One split queue seen from the driver side. `MockSplitQueue` lays out the descriptor table
/// and avail ring; the used ring gets its own place, because the mock (virtio-queue 0.18) puts
/// it `len` bytes after the avail ring's start, overlapping avail entries from `len / 2` on.
pub struct Ring<'a> {
    mock: MockSplitQueue<'a, GuestMemoryMmap>,
    mem: &'a GuestMemoryMmap,
    used_ring: u64,
    pub queue: Queue,
    next_desc: u16,
    avail_idx: u16,
    used_seen: u16,
    bufs: u64,
}

impl<'a> Ring<'a> {
    pub fn new(mem: &'a GuestMemoryMmap, ring: u64, bufs: u64) -> Ring<'a> {
        let mock = MockSplitQueue::create(mem, GuestAddress(ring), QUEUE_SIZE);
        let used_ring = ring + USED_RING_OFFSET;
        assert!(mock.avail_addr().0 + 6 + 2 * u64::from(QUEUE_SIZE) <= used_ring);
        mem.write_slice(&[0; 4], GuestAddress(used_ring)).unwrap();
        let mut ring = Ring {
            mock,
            mem,
            used_ring,
            queue: Queue::new(QUEUE_SIZE).unwrap(),
            next_desc: 0,
            avail_idx: 0,
            used_seen: 0,
            bufs,
        };
        ring.queue = ring.device_queue();
        ring
    }

    /// A device-side queue over this ring, as the transport would hand one to `activate`.
    pub fn device_queue(&self) -> Queue {
        let mut q = Queue::new(QUEUE_SIZE).unwrap();
        q.set_size(QUEUE_SIZE);
        q.try_set_desc_table_address(self.mock.desc_table_addr()).unwrap();
        q.try_set_avail_ring_address(self.mock.avail_addr()).unwrap();
        q.try_set_used_ring_address(GuestAddress(self.used_ring)).unwrap();
        q.set_ready(true);
        q
    }

    /// The buffer slot owned by descriptor `index`.
    pub fn slot(&self, index: u16) -> u64 {
        self.bufs + u64::from(index) * SLOT
    }

    /// The table index the next chain of `n` descriptors will start at.
    pub fn next_head(&self, n: u16) -> u16 {
        if self.next_desc + n > QUEUE_SIZE {
            0
        } else {
            self.next_desc
        }
    }

    /// Publishes a chain of raw (addr, len, flags, next) descriptors starting at the next free
    /// table index; NEXT links are added unless `link` is false (then `next`/flags are as given).
    pub fn publish_raw(&mut self, descs: &[(u64, u32, u16, u16)], link: bool) -> u16 {
        let n = descs.len() as u16;
        let head = self.next_head(n);
        for (i, &(addr, len, flags, next)) in descs.iter().enumerate() {
            let index = head + i as u16;
            let (flags, next) = if link && i + 1 < descs.len() {
                (flags | VRING_DESC_F_NEXT as u16, index + 1)
            } else if link {
                (flags & !(VRING_DESC_F_NEXT as u16), 0)
            } else {
                (flags, next)
            };
            let desc = RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next));
            self.mock.desc_table().store(index, desc).unwrap();
        }
        self.next_desc = (head + n) % QUEUE_SIZE;
        self.publish_head(head);
        head
    }

    /// Puts `head` on the avail ring.
    pub fn publish_head(&mut self, head: u16) {
        let ring = self.mock.avail().ring();
        ring.ref_at(usize::from(self.avail_idx % QUEUE_SIZE)).unwrap().store(head);
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.mock.avail().idx().store(self.avail_idx);
    }

    /// Sets the avail index directly (to lie about how many buffers there are).
    pub fn set_avail_idx(&mut self, idx: u16) {
        self.avail_idx = idx;
        self.mock.avail().idx().store(idx);
    }

    /// Used entries added since the last call, as (head, len).
    pub fn take_used(&mut self) -> Vec<(u16, u32)> {
        let idx: u16 = self.mem.read_obj(GuestAddress(self.used_ring + 2)).unwrap();
        let mut out = Vec::new();
        while self.used_seen != idx {
            let at = self.used_ring + 4 + 8 * u64::from(self.used_seen % QUEUE_SIZE);
            let id: u32 = self.mem.read_obj(GuestAddress(at)).unwrap();
            let len: u32 = self.mem.read_obj(GuestAddress(at + 4)).unwrap();
            out.push((id as u16, len));
            self.used_seen = self.used_seen.wrapping_add(1);
        }
        out
    }
}

/// A packet the device put on the rx queue.
#[derive(Debug, Clone)]
pub struct RxPacket {
    pub hdr: VsockPacketHeader,
    pub data: Vec<u8>,
}

/// The guest side: a tx and an rx queue and the helpers to speak vsock over them.
pub struct Driver<'a> {
    pub mem: &'a GuestMemoryMmap,
    pub tx: Ring<'a>,
    pub rx: Ring<'a>,
    /// rx chains the device returned with length 0.
    pub rx_dropped: usize,
}

impl<'a> Driver<'a> {
    pub fn new(mem: &'a GuestMemoryMmap) -> Driver<'a> {
        Driver { mem, tx: Ring::new(mem, TX_RING, TX_BUFS), rx: Ring::new(mem, RX_RING, RX_BUFS), rx_dropped: 0 }
    }

    /// Queues a packet as Linux 6.1 does (header descriptor, then a data descriptor if any)
    /// without running the device.
    pub fn queue_packet(&mut self, hdr: &VsockPacketHeader, data: &[u8]) -> u16 {
        let mut hdr = *hdr;
        if hdr.len() == 0 {
            hdr.set_len(data.len() as u32);
        }
        let slot = self.tx.slot(self.tx.next_head(if data.is_empty() { 1 } else { 2 }));
        self.mem.write_slice(hdr.as_slice(), GuestAddress(slot)).unwrap();
        self.mem.write_slice(data, GuestAddress(slot + HDR_SIZE as u64)).unwrap();
        if data.is_empty() {
            self.tx.publish_raw(&[(slot, HDR_SIZE as u32, 0, 0)], true)
        } else {
            self.tx
                .publish_raw(&[(slot, HDR_SIZE as u32, 0, 0), (slot + HDR_SIZE as u64, data.len() as u32, 0, 0)], true)
        }
    }

    /// Queues a packet and runs the device's tx processing; every tx chain comes back with
    /// used length 0.
    pub fn send(&mut self, muxer: &mut VsockMuxer, hdr: &VsockPacketHeader, data: &[u8]) {
        self.queue_packet(hdr, data);
        self.run_tx(muxer);
    }

    pub fn run_tx(&mut self, muxer: &mut VsockMuxer) -> Vec<(u16, u32)> {
        muxer.process_tx(self.mem, &mut self.tx.queue);
        let used = self.tx.take_used();
        assert!(used.iter().all(|&(_, len)| len == 0), "tx buffers are returned with length 0");
        used
    }

    /// Posts `n` rx buffers shaped like Linux's (44-byte header + 4 KiB data descriptors).
    pub fn post_rx(&mut self, n: usize) {
        for _ in 0..n {
            let slot = self.rx.slot(self.rx.next_head(2));
            self.rx.publish_raw(
                &[(slot, HDR_SIZE as u32, WRITE, 0), (slot + HDR_SIZE as u64, RX_DATA_SIZE, WRITE, 0)],
                true,
            );
        }
    }

    /// Runs the device's rx processing and returns the packets it delivered.
    pub fn recv(&mut self, muxer: &mut VsockMuxer) -> Vec<RxPacket> {
        muxer.process_rx(self.mem, &mut self.rx.queue);
        self.collect_rx()
    }

    /// Reads packets the device (or its worker) put on the used ring.
    pub fn collect_rx(&mut self) -> Vec<RxPacket> {
        let mut out = Vec::new();
        for (head, len) in self.rx.take_used() {
            if len == 0 {
                self.rx_dropped += 1;
                continue;
            }
            let slot = self.rx.slot(head);
            let mut hdr = VsockPacketHeader::default();
            self.mem.read_slice(hdr.as_mut_slice(), GuestAddress(slot)).unwrap();
            assert_eq!(len as usize, HDR_SIZE + hdr.len() as usize, "used length is header + data");
            let mut data = vec![0; hdr.len() as usize];
            self.mem.read_slice(&mut data, GuestAddress(slot + HDR_SIZE as u64)).unwrap();
            out.push(RxPacket { hdr, data });
        }
        out
    }

    /// Keeps `want` rx buffers posted and collects what the device sends, handling host events
    /// in between, until `done` says so or `timeout` passes.
    pub fn pump_until(
        &mut self,
        muxer: &mut VsockMuxer,
        timeout: Duration,
        mut done: impl FnMut(&[RxPacket]) -> bool,
    ) -> Vec<RxPacket> {
        let end = Instant::now() + timeout;
        let mut got = Vec::new();
        loop {
            self.post_rx(4);
            muxer.poll_host(5);
            muxer.process_tx(self.mem, &mut self.tx.queue);
            self.tx.take_used();
            got.extend(self.recv(muxer));
            if done(&got) || Instant::now() >= end {
                return got;
            }
        }
    }
}

/// A header as the guest (CID 3) would send it to host port `host_port` from `guest_port`.
pub fn guest_hdr(op: u16, guest_port: u32, host_port: u32) -> VsockPacketHeader {
    let mut hdr = VsockPacketHeader::default();
    hdr.set_src_cid(GUEST_CID)
        .set_dst_cid(HOST_CID)
        .set_src_port(guest_port)
        .set_dst_port(host_port)
        .set_type(TYPE_STREAM)
        .set_op(op)
        .set_buf_alloc(BUF_ALLOC)
        .set_fwd_cnt(0);
    hdr
}

/// Handles host events until `cond` holds (the kernel delivers Unix socket data synchronously,
/// so this takes one round in practice).
pub fn poll_until(muxer: &mut VsockMuxer, mut cond: impl FnMut(&VsockMuxer) -> bool) {
    let end = Instant::now() + Duration::from_secs(5);
    while !cond(muxer) {
        assert!(Instant::now() < end, "condition not reached in 5 s");
        muxer.poll_host(10);
    }
}

/// Reads from a blocking stream with a timeout until `n` bytes or EOF.
pub fn read_exactly(stream: &mut UnixStream, n: usize) -> Vec<u8> {
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut out = vec![0; n];
    stream.read_exact(&mut out).unwrap();
    out
}

/// Reads one line (up to and including '\n') byte by byte.
pub fn read_line(stream: &mut UnixStream) -> String {
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut line = Vec::new();
    let mut b = [0u8];
    loop {
        let n = stream.read(&mut b).unwrap();
        if n == 0 {
            break;
        }
        line.push(b[0]);
        if b[0] == b'\n' {
            break;
        }
    }
    String::from_utf8(line).unwrap()
}

/// Whether the peer closed: a read returns 0 within the timeout (data before EOF is skipped).
pub fn reads_eof(stream: &mut UnixStream) -> bool {
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

/// A host connection through `CONNECT port`, answered by the guest: returns the host stream,
/// the connection's host port, and what the device sent the guest (the REQUEST first).
pub fn connect_established(
    muxer: &mut VsockMuxer,
    driver: &mut Driver<'_>,
    port: u32,
    guest_buf_alloc: u32,
) -> (UnixStream, u32) {
    let mut host = UnixStream::connect(muxer.uds_path()).unwrap();
    host.write_all(format!("CONNECT {port}\n").as_bytes()).unwrap();
    let before = muxer.connection_count();
    poll_until(muxer, |m| m.connection_count() > before);
    driver.post_rx(1);
    let pkts = driver.recv(muxer);
    assert_eq!(pkts.len(), 1, "{pkts:?}");
    let req = &pkts[0].hdr;
    assert_eq!(req.op(), op::REQUEST);
    let local_port = req.src_port();
    let mut resp = guest_hdr(op::RESPONSE, port, local_port);
    resp.set_buf_alloc(guest_buf_alloc);
    driver.send(muxer, &resp, &[]);
    assert_eq!(read_line(&mut host), format!("OK {local_port}\n"));
    (host, local_port)
}
