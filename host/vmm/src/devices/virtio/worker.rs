//! A device worker: one thread that waits on a device's queue eventfds (through the
//! [`EpollHelper`], whose stop eventfd ends it) and calls the device's queue handler when a queue
//! is notified.
//!
//! The handler answers "is there more to do on this queue?": a device processes a bounded batch
//! per call (so a guest that keeps the ring full cannot keep the worker from seeing the stop
//! eventfd), and the worker calls it again after a non-blocking look at its eventfds. Stopping
//! is synchronous: [`Worker::stop`] (and drop) signal the stop eventfd and join the thread, so
//! once it returns the device's queues and guest memory are no longer touched — which is what a
//! virtio reset needs.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use virtio_queue::{Queue, QueueT};
use vm_memory::GuestAddress;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use super::{ActivateError, ActiveQueue, Interrupt};
use crate::devices::epoll_helper::{EpollHandler, EpollHelper, Flow, StopHandle};
use crate::seccomp::{Lane, Running};
use crate::vstate::memory::GuestMemory;

/// A running device worker thread.
pub struct Worker {
    stop: StopHandle,
    thread: Option<Running<()>>,
}

/// The worker's side of the loop: each queue's eventfd has its index as token.
struct Queues<H> {
    notifiers: Vec<EventFd>,
    /// Queues to hand to the handler at the end of this wake-up.
    pending: Vec<bool>,
    handler: H,
}

impl<H: FnMut(usize) -> bool> EpollHandler for Queues<H> {
    fn handle_event(&mut self, _helper: &EpollHelper, token: u64, _events: EventSet) -> Flow {
        if let Some(evt) = self.notifiers.get(token as usize) {
            // Clears the counter; EAGAIN (already cleared) is fine.
            let _ = evt.read();
            self.pending[token as usize] = true;
        }
        Flow::Continue
    }

    fn after_events(&mut self, _helper: &EpollHelper) -> Flow {
        for (i, more) in self.pending.iter_mut().enumerate() {
            if *more {
                *more = (self.handler)(i);
            }
        }
        Flow::Continue
    }

    /// A queue with more to do is looked at again without waiting.
    fn timeout_ms(&mut self) -> i32 {
        if self.pending.contains(&true) {
            0
        } else {
            -1
        }
    }
}

impl Worker {
    /// Runs on `lane` (the device's thread) a loop that calls `handler(i)` whenever `notifiers[i]` is signalled
    /// (and once for every queue at start, for buffers made available before activation), and
    /// again without waiting while `handler` returns true.
    pub fn spawn<H>(lane: &Lane, notifiers: Vec<EventFd>, handler: H) -> io::Result<Worker>
    where
        H: FnMut(usize) -> bool + Send + 'static,
    {
        // Set up epoll here, so every failure is reported to the caller rather than lost.
        let helper = EpollHelper::new()?;
        for (i, evt) in notifiers.iter().enumerate() {
            helper.add_event(evt.as_raw_fd(), i as u64)?;
        }
        let stop = helper.stop_handle();
        let mut queues = Queues { pending: vec![true; notifiers.len()], notifiers, handler };
        let thread = lane.run(move || {
            if let Err(e) = helper.run(&mut queues) {
                eprintln!("umbra-vmm: device worker: epoll_wait failed, stopping: {e}");
            }
        })?;
        Ok(Worker { stop, thread: Some(thread) })
    }

    /// Stops the thread and waits for it: afterwards the handler is never called again.
    pub fn stop(&mut self) {
        if let Some(thread) = self.thread.take() {
            self.stop.stop();
            // A panicking handler has already stopped the thread; nothing is left to undo.
            let _ = thread.join();
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Activates a device with one queue (virtio-blk, virtio-rng): runs on the device's `lane` a
/// worker that runs `process` over the queue whenever the driver kicks it, and interrupts
/// the driver when `process` says it used buffers. `worker` must not be running yet.
pub(crate) fn activate_single_queue<P>(
    worker: &mut Option<Worker>,
    lane: &Lane,
    name: &str,
    mem: GuestMemory,
    interrupt: Arc<dyn Interrupt>,
    queues: Vec<ActiveQueue>,
    mut process: P,
) -> Result<(), ActivateError>
where
    P: FnMut(&GuestMemory, &mut Queue) -> bool + Send + 'static,
{
    if worker.is_some() {
        return Err(ActivateError::Other(format!("virtio-{name} is already active")));
    }
    let got = queues.len();
    let Ok([ActiveQueue { mut queue, notify }]) = <[ActiveQueue; 1]>::try_from(queues) else {
        return Err(ActivateError::QueueCount { want: 1, got });
    };
    let started = Worker::spawn(lane, vec![notify], move |_| {
        if process(&mem, &mut queue) {
            interrupt.signal_used_queue();
        }
        queue_has_pending(&queue, &mem)
    })
    .map_err(ActivateError::Worker)?;
    *worker = Some(started);
    Ok(())
}

/// Whether the driver has made buffers available that the device has not taken yet. A ring
/// whose index claims more than a queue's worth of new buffers is broken, and reports nothing
/// (processing it would fail the same way again, so re-running would only spin).
pub fn queue_has_pending(queue: &Queue, mem: &GuestMemory) -> bool {
    if !queue.ready() {
        return false;
    }
    let Ok(avail_idx) = queue.avail_idx(mem, std::sync::atomic::Ordering::Acquire) else {
        return false;
    };
    let new = avail_idx.0.wrapping_sub(queue.next_avail());
    new != 0 && new <= queue.size() && queue.avail_ring() != GuestAddress(0).0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;
    use vmm_sys_util::eventfd::EFD_NONBLOCK;

    #[test]
    fn calls_the_handler_per_notified_queue_and_stops_when_told() {
        let notifiers = vec![EventFd::new(EFD_NONBLOCK).unwrap(), EventFd::new(EFD_NONBLOCK).unwrap()];
        let kick1 = notifiers[1].try_clone().unwrap();
        let (tx, rx) = mpsc::channel();
        let lane = Lane::start(crate::seccomp::ThreadKind::Block, "test-worker").unwrap();
        let mut worker = Worker::spawn(&lane, notifiers, move |i| {
            tx.send(i).unwrap();
            false
        })
        .unwrap();
        // One initial pass over every queue.
        let mut first =
            [rx.recv_timeout(Duration::from_secs(5)).unwrap(), rx.recv_timeout(Duration::from_secs(5)).unwrap()];
        first.sort();
        assert_eq!(first, [0, 1]);
        kick1.write(1).unwrap();
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), 1);
        worker.stop();
        kick1.write(1).unwrap();
        assert!(rx.recv_timeout(Duration::from_millis(100)).is_err(), "no calls after stop");
    }

    #[test]
    fn a_handler_with_more_work_is_called_again_and_still_stops() {
        let notifiers = vec![EventFd::new(EFD_NONBLOCK).unwrap()];
        let (tx, rx) = mpsc::channel();
        let mut calls = 0u32;
        let lane = Lane::start(crate::seccomp::ThreadKind::Block, "test-worker").unwrap();
        let mut worker = Worker::spawn(&lane, notifiers, move |_| {
            calls += 1;
            let _ = tx.send(calls);
            true // always more: the worker must still see the stop eventfd
        })
        .unwrap();
        while rx.recv_timeout(Duration::from_secs(5)).unwrap() < 100 {}
        worker.stop();
    }
}
