//! virtio-balloon (virtio 1.2 §5.5) for free page reporting only (`VIRTIO_BALLOON_F_REPORTING`):
//! the guest reports blocks of memory it has freed, and the device gives their host pages back
//! (`madvise`), so a guest that once touched its memory does not keep it on the host while idle.
//!
//! The balloon itself never inflates: `num_pages` reads 0, and buffers the driver puts on the
//! inflate and deflate queues anyway are returned untouched. With only `REPORTING` negotiated
//! the driver sets up three queues — inflate, deflate, reporting — in that order (a feature it
//! does not have takes no queue index).
//!
//! A report is a chain of device-writable buffers, each a free range (at least a page block,
//! 2–4 MiB). The device discards each range that is page-aligned and wholly inside one region
//! of guest memory; anything else (a hostile guest's) is skipped. Discarding: `MADV_REMOVE`
//! where guest memory is shared (a memfd: the pages leave the file too), else `MADV_DONTNEED`
//! (anonymous memory reads back as zeroes; a snapshot's privately mapped file reverts to the
//! file's page) — either is what a free page's contents may be. The chain is then used with
//! length 0, which tells the driver the report is done.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use virtio_queue::{DescriptorChain, Queue, QueueT};

use super::worker::Worker;
use super::{device_type, ActivateError, ActiveQueue, Interrupt, VirtioDevice};
use crate::seccomp::{Lane, ThreadKind};
use crate::vstate::memory::GuestMemory;

/// `VIRTIO_BALLOON_F_REPORTING`.
pub const F_REPORTING: u32 = 5;
/// The size of each queue.
pub const QUEUE_SIZE: u16 = 256;
/// Inflate, deflate, reporting.
const QUEUES: usize = 3;
const REPORTING: usize = 2;
/// The most descriptors of one chain looked at (Linux reports 32 ranges at a time).
const MAX_DESCRIPTORS: usize = 256;
const PAGE: u64 = 4096;

/// A virtio-balloon device that takes free page reports.
pub struct Balloon {
    worker: Option<Worker>,
    lane: Lane,
}

impl Balloon {
    /// Starts its worker thread (idle until the driver activates the device).
    pub fn new() -> std::io::Result<Balloon> {
        Ok(Balloon { worker: None, lane: Lane::start(ThreadKind::Balloon, "umbra-balloon")? })
    }
}

/// Gives reported ranges back to the host.
#[derive(Default)]
pub struct Discarder {
    /// Set once `MADV_REMOVE` was refused: the memory is private, and `MADV_DONTNEED` is used.
    private: AtomicBool,
}

impl Discarder {
    /// Gives the host pages of `len` bytes at guest address `at` back, when the range is
    /// page-aligned and inside one region; returns whether it did.
    fn discard(&self, mem: &GuestMemory, at: u64, len: u64) -> bool {
        if len == 0 || at % PAGE != 0 || len % PAGE != 0 {
            return false;
        }
        let Some(host) = crate::vstate::memory::host_range(mem, at, len) else { return false };
        let advise = |how| {
            // SAFETY: [host, host + len) lies inside one mapped region of guest memory (checked
            // above); dropping its pages changes only what the guest reads there, which the
            // guest has declared free.
            unsafe { libc::madvise(host.cast(), len as usize, how) == 0 }
        };
        if !self.private.load(Ordering::Relaxed) {
            if advise(libc::MADV_REMOVE) {
                return true;
            }
            self.private.store(true, Ordering::Relaxed);
        }
        advise(libc::MADV_DONTNEED)
    }
}

/// Takes every chain the driver made available on `queue` (at most a queue's worth); on the
/// reporting queue, discards each range first. Returns whether the driver should be
/// interrupted.
fn process_queue(discarder: &Discarder, mem: &GuestMemory, queue: &mut Queue, reporting: bool) -> bool {
    if !queue.ready() {
        return false;
    }
    let mut used = false;
    let _ = queue.disable_notification(mem);
    for _ in 0..queue.size() {
        let Some(chain) = queue.pop_descriptor_chain(mem) else { break };
        let head = chain.head_index();
        if reporting {
            report(discarder, mem, chain);
        }
        used |= queue.add_used(mem, head, 0).is_ok();
    }
    let _ = queue.enable_notification(mem);
    used && queue.needs_notification(mem).unwrap_or(true)
}

fn report(discarder: &Discarder, mem: &GuestMemory, chain: DescriptorChain<&GuestMemory>) {
    for descriptor in chain.take(MAX_DESCRIPTORS).filter(|d| d.is_write_only()) {
        discarder.discard(mem, descriptor.addr().0, u64::from(descriptor.len()));
    }
}

impl VirtioDevice for Balloon {
    fn device_type(&self) -> u32 {
        device_type::BALLOON
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE; QUEUES]
    }

    fn avail_features(&self) -> u64 {
        1 << F_REPORTING
    }

    /// `struct virtio_balloon_config`: `num_pages` and `actual` (the driver's, ignored on
    /// write), then the hinting and poisoning fields, unused: all read 0.
    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn activate(
        &mut self,
        mem: GuestMemory,
        interrupt: Arc<dyn Interrupt>,
        acked_features: u64,
        queues: Vec<ActiveQueue>,
    ) -> Result<(), ActivateError> {
        if self.worker.is_some() {
            return Err(ActivateError::Other("virtio-balloon is already active".into()));
        }
        // Without reporting, the driver sets up inflate and deflate only: nothing to do then.
        let want = if acked_features & (1 << F_REPORTING) != 0 { QUEUES } else { REPORTING };
        ActivateError::check_queue_count(&queues, want)?;
        let (mut rings, notifiers): (Vec<Queue>, Vec<_>) = queues.into_iter().map(|q| (q.queue, q.notify)).unzip();
        let discarder = Discarder::default();
        let worker = Worker::spawn(&self.lane, notifiers, move |i| {
            let queue = &mut rings[i];
            if process_queue(&discarder, &mem, queue, i == REPORTING) {
                interrupt.signal_used_queue();
            }
            super::worker::queue_has_pending(queue, &mem)
        })
        .map_err(ActivateError::Worker)?;
        self.worker = Some(worker);
        Ok(())
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
    use virtio_bindings::virtio_ring::VRING_DESC_F_WRITE;
    use vm_memory::{Bytes, GuestAddress};
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    const W: u16 = VRING_DESC_F_WRITE as u16;

    #[test]
    fn reported_ranges_are_given_back_and_bad_ones_skipped() {
        let mem = guest_memory();
        let mut d = TestDriver::new(&mem, 16);
        let mut q = d.queue();
        let discarder = Discarder::default();
        // Three pages of data: the middle one is reported free.
        let base = 0x8_0000u64;
        mem.write_slice(&[0xaa; 3 * PAGE as usize], GuestAddress(base)).unwrap();
        let head = d.add_chain(&[(base + PAGE, PAGE as u32, W)]);
        assert!(process_queue(&discarder, &mem, &mut q, true));
        assert_eq!(d.next_used(), Some((u32::from(head), 0)));
        assert_eq!(d.read(base + PAGE, PAGE as usize), vec![0; PAGE as usize], "given back: reads as zeroes");
        assert_eq!(d.read(base, PAGE as usize), vec![0xaa; PAGE as usize], "the pages around it kept");
        assert_eq!(d.read(base + 2 * PAGE, PAGE as usize), vec![0xaa; PAGE as usize]);

        // Unaligned, past the end of memory, overflowing, read-only: skipped, still used.
        mem.write_slice(&[0xbb; PAGE as usize], GuestAddress(base)).unwrap();
        let end = 1u64 << 20;
        for (at, len, flags) in
            [(base + 8, PAGE as u32, W), (end - PAGE, 2 * PAGE as u32, W), (u64::MAX - 4095, 4096, W), (base, 4096, 0)]
        {
            d.add_chain(&[(at, len, flags)]);
        }
        process_queue(&discarder, &mem, &mut q, true);
        for _ in 0..4 {
            assert_eq!(d.next_used().map(|(_, len)| len), Some(0));
        }
        assert_eq!(d.read(base, PAGE as usize), vec![0xbb; PAGE as usize], "nothing discarded");
        assert_eq!(d.read(end - PAGE, 16), vec![0; 16]);
    }

    #[test]
    fn inflate_and_deflate_buffers_come_back_untouched() {
        let mem = guest_memory();
        let mut d = TestDriver::new(&mem, 16);
        let mut q = d.queue();
        let a = d.alloc(PAGE as u32);
        mem.write_slice(&[0xcc; PAGE as usize], GuestAddress(a)).unwrap();
        // A page frame number, as the inflate queue carries them (device-readable).
        let head = d.add_chain(&[(a, 4, 0)]);
        assert!(process_queue(&Discarder::default(), &mem, &mut q, false));
        assert_eq!(d.next_used(), Some((u32::from(head), 0)));
        assert_eq!(d.read(a, PAGE as usize), vec![0xcc; PAGE as usize]);
    }

    #[test]
    fn the_worker_takes_reports_on_the_third_queue() {
        let mem = guest_memory();
        let mut d = TestDriver::new(&mem, 16);
        let mut balloon = Balloon::new().unwrap();
        assert_eq!((balloon.device_type(), balloon.avail_features()), (5, 1 << 5));
        let idle = || ActiveQueue { queue: Queue::new(16).unwrap(), notify: EventFd::new(EFD_NONBLOCK).unwrap() };
        let interrupt = Arc::new(CountingInterrupt::default());
        let e = balloon.activate(mem.clone(), interrupt.clone(), 1 << F_REPORTING, vec![idle(), idle()]);
        assert!(matches!(e, Err(ActivateError::QueueCount { want: 3, got: 2 })), "{e:?}");
        // Inflate and deflate are never set up here (not ready); the driver's ring is the third.
        let reporting = ActiveQueue { queue: d.queue(), notify: EventFd::new(EFD_NONBLOCK).unwrap() };
        let kick = reporting.notify.try_clone().unwrap();
        balloon.activate(mem.clone(), interrupt.clone(), 1 << F_REPORTING, vec![idle(), idle(), reporting]).unwrap();
        let base = 0x8_0000u64;
        mem.write_slice(&[0xdd; PAGE as usize], GuestAddress(base)).unwrap();
        d.add_chain(&[(base, PAGE as u32, W)]);
        kick.write(1).unwrap();
        wait_for("an interrupt", || interrupt.count() > 0);
        assert_eq!(d.read(base, PAGE as usize), vec![0; PAGE as usize]);
        assert!(balloon.reset());
    }
}
