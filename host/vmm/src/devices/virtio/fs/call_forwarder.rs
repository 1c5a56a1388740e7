//! The interrupt thread of a virtio-fs device: virtiofsd signals a "call" eventfd per queue when
//! it has put buffers on a used ring, and this thread turns that into
//! [`Interrupt::signal_used_queue`] (which sets the MMIO transport's interrupt-status bit, then
//! writes the irqfd — the backend cannot do the first part, so it cannot have the irqfd).
//!
//! The thread also watches the vhost-user socket for a hang-up (EPOLLRDHUP only: it never reads
//! the socket, whose replies belong to the thread doing setup or reset). When virtiofsd goes away
//! it says so once on stderr and ends; the guest's outstanding requests then wait forever inside
//! the guest, and the VMM carries on. Stopping is synchronous like [`super::super::worker::Worker`]:
//! after [`CallForwarder::stop`] returns, the interrupt is never raised again.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use super::super::Interrupt;
use crate::devices::epoll_helper::{EpollHandler, EpollHelper, Flow, StopHandle};
use crate::seccomp::{Lane, Running};

/// The socket's token; each call eventfd has its queue index.
const SOCKET_TOKEN: u64 = u64::MAX - 1;

/// A running interrupt thread.
pub struct CallForwarder {
    stop: StopHandle,
    hung_up: Arc<AtomicBool>,
    thread: Option<Running<()>>,
}

/// The thread's side of the loop.
struct Forward {
    calls: Vec<EventFd>,
    interrupt: Arc<dyn Interrupt>,
    /// The interrupt was raised in this wake-up: one covers every call in it (each ring was
    /// written before its call was signalled, so the driver sees them all).
    raised: bool,
    hung_up: Arc<AtomicBool>,
    hangup_message: String,
}

impl EpollHandler for Forward {
    fn handle_event(&mut self, _helper: &EpollHelper, token: u64, _events: EventSet) -> Flow {
        if token == SOCKET_TOKEN {
            self.hung_up.store(true, Ordering::SeqCst);
            eprintln!("umbra-vmm: {}", self.hangup_message);
            return Flow::Stop;
        }
        // Reading clears the counter; EAGAIN means another wake-up took it.
        let used = self.calls.get(token as usize).is_some_and(|call| call.read().is_ok());
        if used && !self.raised {
            self.interrupt.signal_used_queue();
            self.raised = true;
        }
        Flow::Continue
    }

    fn after_events(&mut self, _helper: &EpollHelper) -> Flow {
        self.raised = false;
        Flow::Continue
    }
}

impl CallForwarder {
    /// Starts a thread that raises `interrupt` whenever one of `calls` is signalled, until
    /// stopped or until `socket` hangs up (then it prints `hangup_message` and ends).
    pub fn spawn(
        lane: &Lane,
        calls: Vec<EventFd>,
        socket: RawFd,
        interrupt: Arc<dyn Interrupt>,
        hangup_message: String,
    ) -> io::Result<CallForwarder> {
        let helper = EpollHelper::new()?;
        // The registration refers to the socket's open file, which the device keeps open for
        // longer than this thread runs (it stops the thread before dropping the connection).
        helper.add_event_with(socket, SOCKET_TOKEN, EventSet::READ_HANG_UP)?;
        for (i, call) in calls.iter().enumerate() {
            helper.add_event(call.as_raw_fd(), i as u64)?;
        }
        let hung_up = Arc::new(AtomicBool::new(false));
        let stop = helper.stop_handle();
        let mut forward = Forward { calls, interrupt, raised: false, hung_up: hung_up.clone(), hangup_message };
        let thread = lane.run(move || {
            if let Err(e) = helper.run(&mut forward) {
                eprintln!("umbra-vmm: virtio-fs interrupt thread: epoll_wait failed, stopping: {e}");
            }
        })?;
        Ok(CallForwarder { stop, hung_up, thread: Some(thread) })
    }

    /// Whether the backend hung up (the thread has then ended by itself).
    pub fn hung_up(&self) -> bool {
        self.hung_up.load(Ordering::SeqCst)
    }

    /// Stops the thread and waits for it.
    pub fn stop(&mut self) {
        if let Some(thread) = self.thread.take() {
            self.stop.stop();
            // The thread does not panic; if it somehow did, there is nothing left to undo.
            let _ = thread.join();
        }
    }
}

impl Drop for CallForwarder {
    fn drop(&mut self) {
        self.stop();
    }
}
