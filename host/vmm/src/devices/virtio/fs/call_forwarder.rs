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

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::super::Interrupt;
use crate::seccomp::{Lane, Running};

const EXIT_TOKEN: u64 = u64::MAX;
const SOCKET_TOKEN: u64 = u64::MAX - 1;

/// A running interrupt thread.
pub struct CallForwarder {
    exit: EventFd,
    hung_up: Arc<AtomicBool>,
    thread: Option<Running<()>>,
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
        let exit = EventFd::new(EFD_NONBLOCK)?;
        let epoll = Epoll::new()?;
        epoll.ctl(ControlOperation::Add, exit.as_raw_fd(), EpollEvent::new(EventSet::IN, EXIT_TOKEN))?;
        // The registration refers to the socket's open file, which the device keeps open for
        // longer than this thread runs (it stops the thread before dropping the connection).
        epoll.ctl(ControlOperation::Add, socket, EpollEvent::new(EventSet::READ_HANG_UP, SOCKET_TOKEN))?;
        for (i, call) in calls.iter().enumerate() {
            epoll.ctl(ControlOperation::Add, call.as_raw_fd(), EpollEvent::new(EventSet::IN, i as u64))?;
        }
        let hung_up = Arc::new(AtomicBool::new(false));
        let seen_hangup = hung_up.clone();
        let thread = lane.run(move || {
            let mut events = [EpollEvent::default(); 8];
            loop {
                let count = match epoll.wait(-1, &mut events) {
                    Ok(count) => count,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        eprintln!("umbra-vmm: virtio-fs interrupt thread: epoll_wait failed, stopping: {e}");
                        return;
                    }
                };
                let (mut used, mut exit, mut hangup) = (false, false, false);
                for event in &events[..count] {
                    match event.data() {
                        EXIT_TOKEN => exit = true,
                        SOCKET_TOKEN => hangup = true,
                        // Reading clears the counter; EAGAIN means another wake-up took it.
                        i => used |= calls.get(i as usize).is_some_and(|call| call.read().is_ok()),
                    }
                }
                if used {
                    interrupt.signal_used_queue();
                }
                if hangup {
                    seen_hangup.store(true, Ordering::SeqCst);
                    eprintln!("umbra-vmm: {hangup_message}");
                    return;
                }
                if exit {
                    return;
                }
            }
        })?;
        Ok(CallForwarder { exit, hung_up, thread: Some(thread) })
    }

    /// Whether the backend hung up (the thread has then ended by itself).
    pub fn hung_up(&self) -> bool {
        self.hung_up.load(Ordering::SeqCst)
    }

    /// Stops the thread and waits for it.
    pub fn stop(&mut self) {
        if let Some(thread) = self.thread.take() {
            // Only fails when the counter would overflow, and it is then readable anyway.
            let _ = self.exit.write(1);
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
