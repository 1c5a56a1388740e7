//! Lane-(a) tests against a real virtiofsd: memfd-backed guest memory, rings laid out by the test
//! driver, FUSE requests put on the request queue and kicked through the queue's eventfd, answers
//! awaited through the device's interrupt. No vCPU: this proves memory sharing, kicks and calls
//! end to end.
//!
//! virtiofsd is found through `UMBRA_VIRTIOFSD`, `~/.cargo/bin/virtiofsd` or `PATH`; where there
//! is none, the tests that need it fail (scripts/install-deps provides it).

use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use virtio_bindings::virtio_ring::VRING_DESC_F_WRITE;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::*;
use crate::devices::virtio::persist::{DeviceState, FsState};
use crate::devices::virtio::test_utils::{tempdir, TestDriver};
use crate::devices::virtio::{features, ActiveQueue, Interrupt, VirtioDevice};
use crate::vstate::memory::{memfd_backed, GuestMemory};

const W: u16 = VRING_DESC_F_WRITE as u16;
const REQUEST_QUEUE_SIZE: u16 = 128;
/// The hiprio queue's rings, above the test driver's buffers (which end at 1 MiB).
const HIPRIO_RINGS: u64 = 0x10_0000;
const HIPRIO_SIZE: u16 = 16;
const WAIT: Duration = Duration::from_secs(10);

const FUSE_LOOKUP: u32 = 1;
const FUSE_GETATTR: u32 = 3;
const FUSE_OPEN: u32 = 14;
const FUSE_READ: u32 = 15;
const FUSE_INIT: u32 = 26;
const FUSE_ROOT_ID: u64 = 1;

#[path = "../../../../tests/support/virtiofsd.rs"]
mod virtiofsd;
use virtiofsd::Virtiofsd;

/// A virtiofsd serving a fresh directory, uncached (each FUSE request reaches it).
fn start_virtiofsd() -> Virtiofsd {
    Virtiofsd::start(tempdir(), &["--cache", "never", "--no-announce-submounts"])
}

/// Counts used-buffer interrupts and lets a test wait for the next one.
#[derive(Default)]
struct CountingInterrupt {
    used: Mutex<u32>,
    changed: Condvar,
}

impl CountingInterrupt {
    fn count(&self) -> u32 {
        *self.used.lock().unwrap()
    }

    /// Waits until more than `seen` interrupts were raised.
    fn wait_beyond(&self, seen: u32) -> bool {
        let guard = self.used.lock().unwrap();
        let (guard, _) = self.changed.wait_timeout_while(guard, WAIT, |n| *n <= seen).unwrap();
        *guard > seen
    }
}

impl Interrupt for CountingInterrupt {
    fn signal_used_queue(&self) {
        *self.used.lock().unwrap() += 1;
        self.changed.notify_all();
    }
    fn signal_config_change(&self) {}
}

/// The two queues as the transport hands them over, plus a way to kick the request queue.
fn queues(mem: &GuestMemory, driver: &TestDriver) -> (Vec<ActiveQueue>, EventFd) {
    // The hiprio rings stay empty (zeroed) for these tests.
    mem.write_slice(&[0u8; 0x1000], GuestAddress(HIPRIO_RINGS)).unwrap();
    let mut hiprio = Queue::new(QUEUE_SIZE).unwrap();
    hiprio.set_size(HIPRIO_SIZE);
    hiprio.set_desc_table_address(Some(HIPRIO_RINGS as u32), Some(0));
    hiprio.set_avail_ring_address(Some(HIPRIO_RINGS as u32 + 0x100), Some(0));
    hiprio.set_used_ring_address(Some(HIPRIO_RINGS as u32 + 0x200), Some(0));
    hiprio.set_ready(true);
    assert!(hiprio.is_valid(mem));
    let request_notify = EventFd::new(EFD_NONBLOCK).unwrap();
    let kick = request_notify.try_clone().unwrap();
    let queues = vec![
        ActiveQueue { queue: hiprio, notify: EventFd::new(EFD_NONBLOCK).unwrap() },
        ActiveQueue { queue: driver.queue(), notify: request_notify },
    ];
    (queues, kick)
}

fn in_header(len: usize, opcode: u32, unique: u64, nodeid: u64) -> Vec<u8> {
    // struct fuse_in_header { u32 len, opcode; u64 unique, nodeid; u32 uid, gid, pid;
    //                         u16 total_extlen, padding; }
    let mut h = Vec::with_capacity(40);
    h.extend_from_slice(&(40 + len as u32).to_le_bytes());
    h.extend_from_slice(&opcode.to_le_bytes());
    h.extend_from_slice(&unique.to_le_bytes());
    h.extend_from_slice(&nodeid.to_le_bytes());
    h.extend_from_slice(&[0u8; 16]);
    h
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// Buffers for one request and its reply, reused for every call.
struct Buffers {
    request: u64,
    reply: u64,
}

const REQUEST_MAX: u32 = 256;
const REPLY_MAX: u32 = 4096;

fn buffers(d: &mut TestDriver) -> Buffers {
    Buffers { request: d.alloc(REQUEST_MAX), reply: d.alloc(REPLY_MAX) }
}

/// Sends one FUSE request on the request queue, kicks, waits for the interrupt, and returns the
/// reply (`fuse_out_header` + body) after checking the header's length, error 0 and unique.
fn fuse_call(
    d: &mut TestDriver,
    b: &Buffers,
    kick: &EventFd,
    irq: &CountingInterrupt,
    (opcode, unique, nodeid): (u32, u64, u64),
    body: &[u8],
) -> (Vec<u8>, Duration) {
    let (out, took) = fuse_try(d, b, kick, irq, (opcode, unique, nodeid), body);
    assert_eq!(u32_at(&out, 4) as i32, 0, "FUSE error for opcode {opcode}");
    (out, took)
}

/// [`fuse_call`] without the check for error 0: the reply's `error` is at offset 4.
fn fuse_try(
    d: &mut TestDriver,
    b: &Buffers,
    kick: &EventFd,
    irq: &CountingInterrupt,
    (opcode, unique, nodeid): (u32, u64, u64),
    body: &[u8],
) -> (Vec<u8>, Duration) {
    let request = [in_header(body.len(), opcode, unique, nodeid), body.to_vec()].concat();
    assert!(request.len() <= REQUEST_MAX as usize);
    d.write(b.request, &request);
    d.write(b.reply, &[0u8; REPLY_MAX as usize]);
    let seen = irq.count();
    let started = Instant::now();
    let head = d.add_chain(&[(b.request, request.len() as u32, 0), (b.reply, REPLY_MAX, W)]);
    kick.write(1).unwrap();
    assert!(irq.wait_beyond(seen), "no interrupt for FUSE opcode {opcode} within {WAIT:?}");
    let took = started.elapsed();
    let (id, len) = d.next_used().expect("a used entry after the interrupt");
    assert_eq!(id, u32::from(head));
    let out = d.read(b.reply, len as usize);
    // struct fuse_out_header { u32 len; i32 error; u64 unique; }
    assert!(len >= 16, "reply of {len} bytes");
    assert_eq!(u32_at(&out, 0), len, "out header length = used length");
    assert_eq!(u64_at(&out, 8), unique);
    (out, took)
}

/// FUSE_INIT at protocol 7.31: struct fuse_init_in { u32 major, minor, max_readahead, flags; }.
fn fuse_init(d: &mut TestDriver, b: &Buffers, kick: &EventFd, irq: &CountingInterrupt, unique: u64) -> Duration {
    let init_in = [7u32, 31, 128 << 10, 0].iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
    let (out, took) = fuse_call(d, b, kick, irq, (FUSE_INIT, unique, 0), &init_in);
    // struct fuse_init_out { u32 major, minor; ... }
    assert_eq!(u32_at(&out, 16), 7, "FUSE major version");
    assert!(u32_at(&out, 20) >= 31, "FUSE minor version {}", u32_at(&out, 20));
    took
}

/// FUSE_LOOKUP of `name` in the root; returns `attr.size`.
///
/// ```text
/// struct fuse_entry_out { u64 nodeid, generation, entry_valid, attr_valid;
///                         u32 entry_valid_nsec, attr_valid_nsec; struct fuse_attr attr; }
/// struct fuse_attr { u64 ino, size, ... }
/// ```
fn fuse_lookup(
    d: &mut TestDriver,
    b: &Buffers,
    kick: &EventFd,
    irq: &CountingInterrupt,
    unique: u64,
    name: &str,
) -> (u64, Duration) {
    let body = [name.as_bytes(), b"\0"].concat();
    let (out, took) = fuse_call(d, b, kick, irq, (FUSE_LOOKUP, unique, FUSE_ROOT_ID), &body);
    assert_eq!(out.len(), 16 + 128, "fuse_entry_out");
    assert_ne!(u64_at(&out, 16), 0, "a node id");
    (u64_at(&out, 16 + 40 + 8), took)
}

/// FUSE_LOOKUP of `name` in the root; returns its node id.
fn fuse_lookup_node(
    d: &mut TestDriver,
    b: &Buffers,
    kick: &EventFd,
    irq: &CountingInterrupt,
    unique: u64,
    name: &str,
) -> u64 {
    let body = [name.as_bytes(), b"\0"].concat();
    let (out, _) = fuse_call(d, b, kick, irq, (FUSE_LOOKUP, unique, FUSE_ROOT_ID), &body);
    u64_at(&out, 16)
}

/// FUSE_GETATTR of `nodeid`: the reply's error, and `attr.size` when there is none.
///
/// ```text
/// struct fuse_getattr_in { u32 getattr_flags, dummy; u64 fh; }
/// struct fuse_attr_out { u64 attr_valid; u32 attr_valid_nsec, dummy; struct fuse_attr attr; }
/// ```
fn fuse_getattr(
    d: &mut TestDriver,
    b: &Buffers,
    kick: &EventFd,
    irq: &CountingInterrupt,
    unique: u64,
    nodeid: u64,
) -> (i32, u64) {
    let (out, _) = fuse_try(d, b, kick, irq, (FUSE_GETATTR, unique, nodeid), &[0u8; 16]);
    match u32_at(&out, 4) as i32 {
        0 => (0, u64_at(&out, 16 + 16 + 8)),
        error => (error, 0),
    }
}

/// FUSE_OPEN of `nodeid` read-only (struct fuse_open_in { u32 flags, open_flags; }); returns
/// the handle (struct fuse_open_out { u64 fh; u32 open_flags, backing_id; }).
fn fuse_open(
    d: &mut TestDriver,
    b: &Buffers,
    kick: &EventFd,
    irq: &CountingInterrupt,
    unique: u64,
    nodeid: u64,
) -> u64 {
    let (out, _) = fuse_call(d, b, kick, irq, (FUSE_OPEN, unique, nodeid), &[0u8; 8]);
    u64_at(&out, 16)
}

/// FUSE_READ of up to 256 bytes at offset 0 of handle `fh`.
///
/// ```text
/// struct fuse_read_in { u64 fh, offset; u32 size, read_flags; u64 lock_owner; u32 flags, padding; }
/// ```
fn fuse_read(
    d: &mut TestDriver,
    b: &Buffers,
    kick: &EventFd,
    irq: &CountingInterrupt,
    unique: u64,
    nodeid: u64,
    fh: u64,
) -> Vec<u8> {
    let mut body = Vec::with_capacity(40);
    body.extend_from_slice(&fh.to_le_bytes());
    body.extend_from_slice(&0u64.to_le_bytes());
    body.extend_from_slice(&256u32.to_le_bytes());
    body.extend_from_slice(&[0u8; 20]);
    let (out, _) = fuse_call(d, b, kick, irq, (FUSE_READ, unique, nodeid), &body);
    out[16..].to_vec()
}

fn activate(dev: &mut FsDevice, mem: &GuestMemory, driver: &TestDriver, irq: &Arc<CountingInterrupt>) -> EventFd {
    let (queues, kick) = queues(mem, driver);
    let acked = 1 << features::VIRTIO_F_VERSION_1;
    dev.activate(mem.clone(), irq.clone(), acked, queues).unwrap();
    kick
}

/// Fresh request rings on `mem`, the device activated on them and a FUSE session started.
fn start_session<'m>(
    dev: &mut FsDevice,
    mem: &'m GuestMemory,
    irq: &Arc<CountingInterrupt>,
) -> (TestDriver<'m>, Buffers, EventFd) {
    let mut d = TestDriver::new(mem, REQUEST_QUEUE_SIZE);
    let b = buffers(&mut d);
    let kick = activate(dev, mem, &d, irq);
    fuse_init(&mut d, &b, &kick, irq, 1);
    (d, b, kick)
}

/// Kicks a FUSE_INIT request `unique` and checks that no interrupt answers it within `wait`.
fn assert_unanswered(
    d: &mut TestDriver,
    b: &Buffers,
    kick: &EventFd,
    irq: &CountingInterrupt,
    unique: u64,
    wait: Duration,
) {
    let seen = irq.count();
    d.write(b.request, &in_header(0, FUSE_INIT, unique, 0));
    d.add_chain(&[(b.request, 40, 0), (b.reply, REPLY_MAX, W)]);
    kick.write(1).unwrap();
    std::thread::sleep(wait);
    assert_eq!(irq.count(), seen, "request {unique} was answered");
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[test]
fn fuse_init_and_lookup_round_trip_through_virtiofsd() {
    let fs = start_virtiofsd();
    std::fs::write(fs.shared.join("hello.txt"), b"hello, guest\n").unwrap();
    let started = Instant::now();
    let mut dev = FsDevice::new("share", &fs.socket).unwrap();
    eprintln!("connect + negotiate: {:?}", started.elapsed());

    // What the guest driver sees.
    assert_eq!(dev.device_type(), 26);
    assert_eq!(dev.queue_max_sizes(), &[1024, 1024]);
    let offered = dev.avail_features();
    assert_ne!(offered & (1 << features::VIRTIO_F_VERSION_1), 0);
    assert_eq!(offered & (1 << 30), 0, "VHOST_USER_F_PROTOCOL_FEATURES is not for the guest");
    assert_eq!(offered & (1 << 26), 0, "VHOST_F_LOG_ALL is not for the guest");
    let mut config = [0xffu8; 40];
    dev.read_config(0, &mut config);
    assert_eq!(&config[..5], b"share");
    assert!(config[5..36].iter().all(|&b| b == 0), "NUL-padded tag");
    assert_eq!(u32_at(&config, 36), 1, "num_request_queues");

    let (mem, _memfd) = memfd_backed(2 << 20).unwrap();
    let mut d = TestDriver::new(&mem, REQUEST_QUEUE_SIZE);
    let b = buffers(&mut d);
    let irq = Arc::new(CountingInterrupt::default());
    let started = Instant::now();
    let kick = activate(&mut dev, &mem, &d, &irq);
    eprintln!("activate (features, memory table, 2 rings): {:?}", started.elapsed());

    let took = fuse_init(&mut d, &b, &kick, &irq, 1);
    eprintln!("FUSE_INIT round trip (kick -> virtiofsd -> call -> interrupt): {took:?}");
    let (size, took) = fuse_lookup(&mut d, &b, &kick, &irq, 2, "hello.txt");
    assert_eq!(size, 13, "attr.size of hello.txt");
    eprintln!("FUSE_LOOKUP round trip: {took:?}");

    // Twice the queue size in a row: the rings wrap and every request is still answered.
    let mut times = Vec::new();
    for unique in 3..3 + 2 * u64::from(REQUEST_QUEUE_SIZE) {
        times.push(fuse_lookup(&mut d, &b, &kick, &irq, unique, "hello.txt").1);
    }
    eprintln!(
        "{} more lookups: median {:?}, max {:?}",
        times.len(),
        median(times.clone()),
        times.iter().max().unwrap()
    );
    assert!(d.next_used().is_none(), "one used entry per request");
}

#[test]
fn a_reset_stops_the_rings_and_the_device_comes_back_with_a_new_session() {
    let fs = start_virtiofsd();
    std::fs::write(fs.shared.join("a"), b"12345").unwrap();
    let mut dev = FsDevice::new("share", &fs.socket).unwrap();
    let (mem, _memfd) = memfd_backed(2 << 20).unwrap();
    let irq = Arc::new(CountingInterrupt::default());

    let (mut d, b, kick) = start_session(&mut dev, &mem, &irq);
    let started = Instant::now();
    assert!(dev.reset(), "virtiofsd offers RESET_DEVICE: the reset goes through");
    eprintln!("reset (GET_VRING_BASE x2, RESET_DEVICE): {:?}", started.elapsed());

    // A stopped ring is not processed: a request kicked now gets no answer.
    assert_unanswered(&mut d, &b, &kick, &irq, 99, Duration::from_millis(200));
    assert!(d.next_used().is_none(), "no used entry after reset");

    // The driver sets the device up again, on fresh rings, and starts a new FUSE session.
    let (mut d, b, kick) = start_session(&mut dev, &mem, &irq);
    assert_eq!(fuse_lookup(&mut d, &b, &kick, &irq, 2, "a").0, 5);
}

#[test]
fn a_backend_that_dies_fails_the_device_without_hanging_the_vmm() {
    let mut fs = start_virtiofsd();
    let mut dev = FsDevice::new("share", &fs.socket).unwrap();
    let (mem, _memfd) = memfd_backed(2 << 20).unwrap();
    let irq = Arc::new(CountingInterrupt::default());
    let (mut d, b, kick) = start_session(&mut dev, &mem, &irq);
    fs.kill();

    // The guest's next request just waits; nothing on the host blocks on it.
    assert_unanswered(&mut d, &b, &kick, &irq, 2, Duration::from_millis(100));

    let started = Instant::now();
    assert!(!dev.reset(), "a dead backend cannot be reset");
    let (queues, _kick) = queues(&mem, &TestDriver::new(&mem, REQUEST_QUEUE_SIZE));
    let err = dev.activate(mem.clone(), irq.clone(), 1 << features::VIRTIO_F_VERSION_1, queues).unwrap_err();
    assert!(err.to_string().contains("broken"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(1), "failing took {:?}", started.elapsed());
}

#[test]
fn anonymous_guest_memory_is_refused_at_activation() {
    let fs = start_virtiofsd();
    let mut dev = FsDevice::new("share", &fs.socket).unwrap();
    let mem: GuestMemory = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 2 << 20)]).unwrap();
    let d = TestDriver::new(&mem, REQUEST_QUEUE_SIZE);
    let (queues, _kick) = queues(&mem, &d);
    let irq = Arc::new(CountingInterrupt::default());
    let err = dev.activate(mem.clone(), irq, 1 << features::VIRTIO_F_VERSION_1, queues).unwrap_err();
    assert!(err.to_string().contains("not file-backed"), "{err}");

    // Nothing was sent, so the connection is still good for memfd-backed memory.
    let (mem, _memfd) = memfd_backed(2 << 20).unwrap();
    let irq = Arc::new(CountingInterrupt::default());
    start_session(&mut dev, &mem, &irq);
}

#[test]
fn rings_outside_guest_memory_are_refused() {
    let fs = start_virtiofsd();
    let mut dev = FsDevice::new("share", &fs.socket).unwrap();
    let (mem, _memfd) = memfd_backed(2 << 20).unwrap();
    let d = TestDriver::new(&mem, REQUEST_QUEUE_SIZE);
    let (mut queues, _kick) = queues(&mem, &d);
    // The used ring's start is in memory, its end is not.
    queues[1].queue.set_used_ring_address(Some((2 << 20) - 8), Some(0));
    let irq = Arc::new(CountingInterrupt::default());
    let err = dev.activate(mem, irq, 1 << features::VIRTIO_F_VERSION_1, queues).unwrap_err();
    assert!(err.to_string().contains("used ring"), "{err}");
}

#[test]
fn connecting_where_nobody_listens_names_the_socket() {
    let dir = tempdir();
    let missing = dir.join("missing.sock");
    let err = FsDevice::new("share", &missing).err().expect("no socket file").to_string();
    assert!(err.contains(&*missing.to_string_lossy()) && err.contains("is virtiofsd running"), "{err}");

    // A socket file whose listener is gone: connection refused, at once.
    let stale = dir.join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let started = Instant::now();
    let err = FsDevice::new("share", &stale).err().expect("nobody listening").to_string();
    assert!(err.contains(&*stale.to_string_lossy()) && err.contains("refused"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(1));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_backend_that_never_answers_times_out_instead_of_hanging() {
    let dir = tempdir();
    let socket = dir.join("silent.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    // Accepts, then reads and says nothing.
    let silent = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut conn, &mut sink);
    });
    let timeout = Duration::from_millis(300);
    let started = Instant::now();
    let err = backend::Backend::connect_with_timeout(&socket, NUM_QUEUES, timeout).err().expect("a silent backend");
    let took = started.elapsed();
    assert!(matches!(err, FsError::Timeout { step: "GET_FEATURES", .. }), "{err}");
    assert!(err.to_string().contains("did not answer"), "{err}");
    assert!(took >= timeout && took < timeout + Duration::from_secs(2), "{took:?}");
    silent.join().unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn tags_are_checked_before_connecting() {
    for tag in ["", "a\0b", &"x".repeat(37)] {
        let err = FsDevice::new(tag, Path::new("/nonexistent.sock")).err().expect("bad tag").to_string();
        assert!(err.contains("must be 1 to 36 bytes"), "{err}");
    }
    assert!(device::tag_is_valid(&"x".repeat(36)));
}

/// The rings as a restored transport hands them over: the request queue resumes at the index
/// the driver reached (every request it made was answered before the snapshot).
fn restored_queues(mem: &GuestMemory, d: &TestDriver) -> (Vec<ActiveQueue>, EventFd) {
    let (mut queues, kick) = queues(mem, d);
    queues[1].queue.set_next_avail(d.avail_idx());
    queues[1].queue.set_next_used(d.avail_idx());
    (queues, kick)
}

#[test]
fn a_snapshot_carries_the_fuse_session_to_a_new_virtiofsd_over_another_directory() {
    let before = start_virtiofsd();
    std::fs::write(before.shared.join("f"), b"before the snapshot\n").unwrap();
    let mut dev = FsDevice::new("share", &before.socket).unwrap();
    let (mem, _memfd) = memfd_backed(2 << 20).unwrap();
    let irq = Arc::new(CountingInterrupt::default());
    let (mut d, b, kick) = start_session(&mut dev, &mem, &irq);
    let node = fuse_lookup_node(&mut d, &b, &kick, &irq, 2, "f");
    let fh = fuse_open(&mut d, &b, &kick, &irq, 3, node);
    assert_eq!(fuse_read(&mut d, &b, &kick, &irq, 4, node, fh), b"before the snapshot\n");

    let started = Instant::now();
    let state = VirtioDevice::quiesce(&mut dev).unwrap();
    let DeviceState::Fs(FsState { virtiofsd }) = &state else { panic!("virtio-fs saved {state:?}") };
    eprintln!(
        "quiesce (GET_VRING_BASE x2, SET_DEVICE_STATE_FD, CHECK): {:?}, {} bytes of state",
        started.elapsed(),
        virtiofsd.len()
    );
    assert!(!virtiofsd.is_empty(), "virtiofsd saved its FUSE session");
    drop(dev);
    drop(before);

    // A fork: a new virtiofsd over its own copy of the folder, where `f` says something else.
    let fork = start_virtiofsd();
    std::fs::write(fork.shared.join("f"), b"in the fork\n").unwrap();
    let mut dev = FsDevice::new("share", &fork.socket).unwrap();
    let started = Instant::now();
    dev.prepare_restore(&state).unwrap();
    eprintln!("load (SET_DEVICE_STATE_FD, CHECK): {:?}", started.elapsed());
    let (queues, kick) = restored_queues(&mem, &d);
    dev.activate(mem.clone(), irq.clone(), 1 << features::VIRTIO_F_VERSION_1, queues).unwrap();
    // No FUSE_INIT: the session goes on, with the node id and the open handle the guest holds,
    // found by path in the fork's folder.
    assert_eq!(fuse_getattr(&mut d, &b, &kick, &irq, 5, node), (0, 12));
    assert_eq!(fuse_read(&mut d, &b, &kick, &irq, 6, node, fh), b"in the fork\n");
    assert_eq!(fuse_lookup(&mut d, &b, &kick, &irq, 7, "f").0, 12);

    // Without the state, a new virtiofsd knows no such node: what a restore without it would
    // give the guest.
    let bare = start_virtiofsd();
    std::fs::write(bare.shared.join("f"), b"in the fork\n").unwrap();
    VirtioDevice::reset(&mut dev);
    let mut dev = FsDevice::new("share", &bare.socket).unwrap();
    let (queues, kick) = restored_queues(&mem, &d);
    dev.activate(mem.clone(), irq.clone(), 1 << features::VIRTIO_F_VERSION_1, queues).unwrap();
    let (error, _) = fuse_getattr(&mut d, &b, &kick, &irq, 8, node);
    assert!(error < 0, "an unknown node id is an error, got {error}");
}

#[test]
fn a_state_the_backend_cannot_load_fails_the_restore_by_name() {
    let fs = start_virtiofsd();
    let mut dev = FsDevice::new("share", &fs.socket).unwrap();
    let garbage = DeviceState::Fs(FsState { virtiofsd: b"not a virtiofsd state".to_vec() });
    let e = dev.prepare_restore(&garbage).unwrap_err().to_string();
    assert!(e.contains("virtio-fs \"share\"") && e.contains("CHECK_DEVICE_STATE"), "{e}");
    // Never started: a device without state stops with nothing to save.
    let mut fresh = FsDevice::new("share", &start_virtiofsd().socket).unwrap();
    assert_eq!(VirtioDevice::quiesce(&mut fresh).unwrap(), DeviceState::Stateless);
}
