//! virtio-rng (virtio 1.2 §5.4): one queue of device-writable buffers, filled from the host's
//! `getrandom(2)`, so the guest kernel's entropy pool is seeded at boot.
//!
//! The guest decides how much it asks for; the device decides how much it gives: at most
//! [`MAX_BYTES_PER_REQUEST`] per chain (the spec lets the device fill less than offered) and a
//! queue's worth of chains per worker pass, so a guest cannot make one pass arbitrarily long.
//! Device-readable descriptors are skipped (the device must not write them); a chain with no
//! writable space comes back with used length 0.

use std::io;
use std::sync::Arc;

use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

use super::worker::{activate_single_queue, Worker};
use super::{device_type, ActivateError, ActiveQueue, Interrupt, VirtioDevice};
use crate::seccomp::{Lane, ThreadKind};
use crate::vstate::memory::GuestMemory;

/// The size of the one request queue.
pub const QUEUE_SIZE: u16 = 256;
/// The most random bytes given per descriptor chain (Linux asks for at most a page or so).
pub const MAX_BYTES_PER_REQUEST: u32 = 64 << 10;
/// The most descriptors of one chain looked at; the rest of a longer chain gets nothing.
const MAX_DESCRIPTORS: usize = 256;
/// Random bytes are produced in chunks of this size and copied into guest memory.
const CHUNK: usize = 4096;

/// A virtio-rng device.
pub struct Rng {
    worker: Option<Worker>,
    lane: Lane,
}

impl Rng {
    /// Starts its worker thread (idle until the driver activates the device).
    pub fn new() -> std::io::Result<Rng> {
        Ok(Rng { worker: None, lane: Lane::start(ThreadKind::Rng, "umbra-rng")? })
    }

    /// Fills the chains the driver made available (at most a queue's worth) and returns whether
    /// the driver should be interrupted. The worker calls this; lane-(a) tests call it directly.
    pub fn process_queue(&mut self, mem: &GuestMemory, queue: &mut Queue) -> bool {
        process_queue(mem, queue)
    }
}

fn process_queue(mem: &GuestMemory, queue: &mut Queue) -> bool {
    let mut used = false;
    let _ = queue.disable_notification(mem);
    for _ in 0..queue.size() {
        let Some(chain) = queue.pop_descriptor_chain(mem) else { break };
        let head = chain.head_index();
        let len = fill_chain(mem, chain);
        // Fails only for a head index outside the table: there is no chain to return.
        used |= queue.add_used(mem, head, len).is_ok();
    }
    let _ = queue.enable_notification(mem);
    used && queue.needs_notification(mem).unwrap_or(true)
}

/// Writes random bytes into the chain's writable buffers, in order, up to the per-request cap;
/// returns how many were written. Stops at the first buffer outside guest memory.
fn fill_chain(mem: &GuestMemory, chain: DescriptorChain<&GuestMemory>) -> u32 {
    let mut written: u32 = 0;
    let mut chunk = [0u8; CHUNK];
    for descriptor in chain.take(MAX_DESCRIPTORS).filter(|d| d.is_write_only()) {
        let mut offset: u32 = 0;
        let want = descriptor.len().min(MAX_BYTES_PER_REQUEST - written);
        while offset < want {
            let n = (want - offset).min(CHUNK as u32) as usize;
            let Some(addr) = descriptor.addr().0.checked_add(u64::from(offset)) else { return written };
            if getrandom(&mut chunk[..n]).is_err() || mem.write_slice(&chunk[..n], GuestAddress(addr)).is_err() {
                return written;
            }
            offset += n as u32;
            written += n as u32;
        }
        if written == MAX_BYTES_PER_REQUEST {
            break;
        }
    }
    written
}

/// Fills `buf` from the kernel's CSPRNG.
fn getrandom(buf: &mut [u8]) -> io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = &mut buf[filled..];
        // SAFETY: the kernel writes at most `rest.len()` bytes into `rest`, which is valid,
        // writable memory we own for the duration of the call.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        filled += n as usize;
    }
    Ok(())
}

impl VirtioDevice for Rng {
    fn device_type(&self) -> u32 {
        device_type::RNG
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn avail_features(&self) -> u64 {
        0
    }

    /// virtio-rng has no configuration space.
    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        interrupt: Arc<dyn Interrupt>,
        _acked_features: u64,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError> {
        activate_single_queue(&mut self.worker, &self.lane, "rng", mem, interrupt, queues, process_queue)
    }

    fn reset(&mut self) -> bool {
        self.worker = None;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::test_utils::{guest_memory, wait_for, CountingInterrupt, TestDriver};
    use std::time::{Duration, Instant};
    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::split::Descriptor;
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    const W: u16 = VRING_DESC_F_WRITE as u16;

    #[test]
    fn writable_buffers_are_filled_with_random_bytes() {
        let mem = guest_memory();
        let mut d = TestDriver::new(&mem, 16);
        let mut q = d.queue();
        let mut rng = Rng::new().unwrap();
        let (a, b) = (d.alloc(64), d.alloc(4000));
        let head = d.add_chain(&[(a, 64, W), (b, 4000, W)]);
        assert!(rng.process_queue(&mem, &mut q));
        assert_eq!(d.next_used(), Some((u32::from(head), 4064)));
        let bytes = [d.read(a, 64), d.read(b, 4000)].concat();
        assert!(bytes.iter().any(|&x| x != 0), "not all zero");
        // Two fills differ (a 2^-512 chance of a false failure).
        let c = d.alloc(64);
        d.add_chain(&[(c, 64, W)]);
        rng.process_queue(&mem, &mut q);
        assert_ne!(d.read(a, 64), d.read(c, 64));
    }

    #[test]
    fn readable_buffers_get_nothing() {
        let mem = guest_memory();
        let mut d = TestDriver::new(&mem, 16);
        let mut q = d.queue();
        let mut rng = Rng::new().unwrap();
        let a = d.alloc(64);
        let head = d.add_chain(&[(a, 64, 0)]);
        rng.process_queue(&mem, &mut q);
        assert_eq!(d.next_used(), Some((u32::from(head), 0)));
        assert_eq!(d.read(a, 64), vec![0; 64]);
        // Mixed: only the writable part is filled and counted.
        let (r, w) = (d.alloc(32), d.alloc(32));
        d.add_chain(&[(r, 32, 0), (w, 32, W)]);
        rng.process_queue(&mem, &mut q);
        assert_eq!(d.next_used().unwrap().1, 32);
        assert_eq!(d.read(r, 32), vec![0; 32]);
    }

    #[test]
    fn requests_are_capped_and_bad_buffers_stop_the_fill() {
        let mem = guest_memory();
        let mut d = TestDriver::new(&mem, 16);
        let mut q = d.queue();
        let mut rng = Rng::new().unwrap();
        let big = d.alloc(MAX_BYTES_PER_REQUEST + 4096);
        d.add_chain(&[(big, MAX_BYTES_PER_REQUEST + 4096, W)]);
        rng.process_queue(&mem, &mut q);
        assert_eq!(d.next_used().unwrap().1, MAX_BYTES_PER_REQUEST);
        assert_eq!(d.read(big + u64::from(MAX_BYTES_PER_REQUEST), 4096), vec![0; 4096]);

        // Outside guest memory: nothing, or what fit before it.
        let end = 1u64 << 20;
        d.add_chain(&[(end - 16, 64, W)]);
        d.add_chain(&[(u64::MAX - 8, 64, W)]);
        rng.process_queue(&mem, &mut q);
        assert_eq!(d.next_used().unwrap().1, 0);
        assert_eq!(d.next_used().unwrap().1, 0);
    }

    #[test]
    fn loops_and_bad_heads_end() {
        let mem = guest_memory();
        let mut d = TestDriver::new(&mem, 16);
        let mut q = d.queue();
        let mut rng = Rng::new().unwrap();
        let a = d.alloc(8);
        d.write_descriptor(0, Descriptor::new(a, 8, W | VRING_DESC_F_NEXT as u16, 0));
        d.make_available(0);
        d.make_available(500);
        d.skip_descriptors(1);
        let started = Instant::now();
        rng.process_queue(&mem, &mut q);
        assert!(started.elapsed() < Duration::from_secs(1));
        // The self-loop yields descriptor 0 sixteen times: 8 bytes each.
        assert_eq!(d.next_used(), Some((0, 16 * 8)));
        assert_eq!(d.next_used(), None, "head 500 names no chain");
        let b = d.alloc(8);
        d.add_chain(&[(b, 8, W)]);
        rng.process_queue(&mem, &mut q);
        assert_eq!(d.next_used().unwrap().1, 8);
    }

    #[test]
    fn the_worker_fills_on_notification() {
        let mem = guest_memory();
        let mut d = TestDriver::new(&mem, 16);
        let notify = EventFd::new(EFD_NONBLOCK).unwrap();
        let kick = notify.try_clone().unwrap();
        let interrupt = Arc::new(CountingInterrupt::default());
        let mut rng = Rng::new().unwrap();
        assert_eq!(rng.device_type(), 4);
        rng.activate(mem.clone(), interrupt.clone(), 0, vec![ActiveQueue { queue: d.queue(), notify }]).unwrap();
        let a = d.alloc(32);
        d.add_chain(&[(a, 32, W)]);
        kick.write(1).unwrap();
        wait_for("an interrupt", || interrupt.count() > 0);
        assert_eq!(d.next_used().unwrap().1, 32);
        assert!(rng.reset());
    }
}
