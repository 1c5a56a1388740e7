//! The vsock device's thread: waits (through the [`EpollHelper`], whose stop eventfd ends it)
//! on the three queue eventfds and the muxer's epoll fd (every host socket), and drives the
//! [`VsockMuxer`] — epoll wiring only; all protocol logic lives in the muxer, which tests drive
//! without this thread.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use virtio_queue::QueueT;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use super::muxer::VsockMuxer;
use super::{EVENT_QUEUE, RX_QUEUE, TX_QUEUE};
use crate::devices::epoll_helper::{EpollHandler, EpollHelper, Flow, StopHandle};
use crate::devices::virtio::{ActiveQueue, Interrupt};
use crate::seccomp::{Lane, Running};
use crate::vstate::memory::GuestMemory;

const RX: u64 = 0;
const TX: u64 = 1;
const EVENT: u64 = 2;
const HOST: u64 = 3;
/// Rounds of tx/rx per wake-up before going back to epoll (rx draining the control queue can
/// unblock tx, whose new packets can owe rx more).
const ROUNDS_PER_WAKE: usize = 4;

/// A running device thread; [`Worker::stop`] gives the muxer back.
#[derive(Debug)]
pub struct Worker {
    stop: StopHandle,
    handle: Running<Option<VsockMuxer>>,
}

struct Context {
    muxer: VsockMuxer,
    mem: GuestMemory,
    interrupt: Arc<dyn Interrupt>,
    queues: Vec<ActiveQueue>,
    /// A transport-reset event still to be put on the event queue (after a restore).
    reset_event: bool,
    /// Host connections wait (their sockets out of the epoll set) until the driver has handled
    /// the reset: it would reset a connection made before that too. Set at activation and
    /// again when the event is posted; cleared (the host sockets watched again) when the driver
    /// kicks the event queue after the event went out — Linux re-posts its buffer and kicks —
    /// or after [`RESET_GRACE`] without that.
    host_waits_since: Option<Instant>,
}

/// How long host connections wait for the driver to handle a transport reset, at most.
const RESET_GRACE: std::time::Duration = std::time::Duration::from_millis(500);

/// VIRTIO_VSOCK_EVENT_TRANSPORT_RESET (virtio 1.2 §5.10.6.8): every connection is gone; the
/// driver resets its connected sockets and re-reads the guest CID from the config space.
const EVENT_TRANSPORT_RESET: u32 = 0;

/// Puts a transport-reset event (`struct virtio_vsock_event { le32 id; }`) in the next buffer
/// of the event queue. Returns whether a buffer was used; false when the driver has none posted
/// (the caller tries again when it posts one). A chain without 4 writable bytes is returned
/// unused (length 0) and the next one is tried.
pub fn post_transport_reset(mem: &GuestMemory, queue: &mut virtio_queue::Queue) -> bool {
    use vm_memory::Bytes;
    while let Some(chain) = queue.pop_descriptor_chain(mem) {
        let head = chain.head_index();
        let target = chain.into_iter().find(|d| d.is_write_only() && d.len() >= 4).map(|d| d.addr());
        let written = target.is_some_and(|addr| mem.write_obj(EVENT_TRANSPORT_RESET.to_le(), addr).is_ok());
        // add_used refuses an out-of-range head index; there is nothing more to do then.
        let _ = queue.add_used(mem, head, if written { 4 } else { 0 });
        if written {
            return true;
        }
    }
    false
}

impl Worker {
    /// Starts the thread. On failure the muxer is handed back with the error (always, in
    /// practice: only a poisoned slot could lose it).
    /// With `reset_event`, the driver is first told that every connection was reset (a restored
    /// VM's connections did not survive).
    pub fn spawn(
        lane: &Lane,
        muxer: VsockMuxer,
        mem: GuestMemory,
        interrupt: Arc<dyn Interrupt>,
        queues: Vec<ActiveQueue>,
        reset_event: bool,
    ) -> Result<Worker, (Option<Box<VsockMuxer>>, io::Error)> {
        let setup = || -> io::Result<EpollHelper> {
            let helper = EpollHelper::new()?;
            helper.add_event(queues[RX_QUEUE].notify.as_raw_fd(), RX)?;
            helper.add_event(queues[TX_QUEUE].notify.as_raw_fd(), TX)?;
            helper.add_event(queues[EVENT_QUEUE].notify.as_raw_fd(), EVENT)?;
            if !reset_event {
                helper.add_event(muxer.as_raw_fd(), HOST)?;
            }
            Ok(helper)
        };
        let helper = match setup() {
            Ok(helper) => helper,
            Err(e) => return Err((Some(Box::new(muxer)), e)),
        };
        let stop = helper.stop_handle();
        // `spawn` consumes its closure even when it fails; the context goes through a slot so
        // that the muxer (and its bound socket) can be handed back in that case.
        let host_waits_since = reset_event.then(Instant::now);
        let context = Context { muxer, mem, interrupt, queues, reset_event, host_waits_since };
        let slot = Arc::new(Mutex::new(Some(context)));
        let thread_slot = Arc::clone(&slot);
        let spawned =
            lane.run(move || thread_slot.lock().ok().and_then(|mut ctx| ctx.take()).map(|ctx| run(&helper, ctx)));
        match spawned {
            Ok(handle) => Ok(Worker { stop, handle }),
            Err(e) => {
                let muxer = slot.lock().ok().and_then(|mut ctx| ctx.take()).map(|ctx| Box::new(ctx.muxer));
                Err((muxer, e))
            }
        }
    }

    /// Stops the thread and returns the muxer, or None if the thread panicked.
    pub fn stop(self) -> Option<VsockMuxer> {
        self.stop.stop();
        self.handle.join().ok().flatten()
    }
}

fn run(helper: &EpollHelper, mut ctx: Context) -> VsockMuxer {
    // Buffers the driver made available before activation announced nothing.
    process_queues(&mut ctx);
    // The epoll fd is ours and valid; nothing sensible is left to do if waiting fails.
    let _ = helper.run(&mut ctx);
    ctx.muxer
}

impl EpollHandler for Context {
    fn handle_event(&mut self, helper: &EpollHelper, token: u64, _events: EventSet) -> Flow {
        match token {
            RX => drain(&self.queues[RX_QUEUE].notify),
            TX => drain(&self.queues[TX_QUEUE].notify),
            // The only event the device sends is the transport reset after a restore;
            // otherwise buffers on the event queue simply wait there.
            EVENT => {
                drain(&self.queues[EVENT_QUEUE].notify);
                // A kick after the reset went out: the driver handled it (a kick before
                // is the driver posting buffers, which the reset is still waiting for).
                if !self.reset_event {
                    watch_host(self, helper);
                }
            }
            HOST => {
                self.muxer.handle_host_events();
            }
            _ => {}
        }
        Flow::Continue
    }

    fn after_events(&mut self, helper: &EpollHelper) -> Flow {
        if self.host_waits_since.is_some_and(|since| Instant::now() >= since + RESET_GRACE) {
            watch_host(self, helper);
        }
        self.muxer.process_timeouts(Instant::now());
        process_queues(self);
        Flow::Continue
    }

    fn timeout_ms(&mut self) -> i32 {
        if self.muxer.has_deferred_work() {
            return 0;
        }
        let grace_end = self.host_waits_since.map(|t| t + RESET_GRACE);
        self.muxer.next_deadline().into_iter().chain(grace_end).min().map_or(-1, |deadline| {
            let wait = deadline.saturating_duration_since(Instant::now());
            // Round up so we do not wake just before the deadline and spin.
            i32::try_from(wait.as_millis() + 1).unwrap_or(i32::MAX)
        })
    }
}

/// The driver has handled the transport reset (or had its time): watch the host sockets again
/// and take the connections that waited.
fn watch_host(ctx: &mut Context, helper: &EpollHelper) {
    if ctx.host_waits_since.take().is_none() {
        return;
    }
    if helper.add_event(ctx.muxer.as_raw_fd(), HOST).is_ok() {
        ctx.muxer.handle_host_events();
    }
}

fn process_queues(ctx: &mut Context) {
    let mut notify = false;
    if ctx.reset_event && post_transport_reset(&ctx.mem, &mut ctx.queues[EVENT_QUEUE].queue) {
        ctx.reset_event = false;
        ctx.host_waits_since = Some(Instant::now());
        notify = true;
    }
    for _ in 0..ROUNDS_PER_WAKE {
        let (rx_part, rest) = ctx.queues.split_at_mut(TX_QUEUE);
        let rx = &mut rx_part[RX_QUEUE].queue;
        let tx = &mut rest[0].queue;
        let tx_used = ctx.muxer.process_tx(&ctx.mem, tx);
        let rx_used = ctx.muxer.process_rx(&ctx.mem, rx);
        notify |= tx_used && tx.needs_notification(&ctx.mem).unwrap_or(true);
        notify |= rx_used && rx.needs_notification(&ctx.mem).unwrap_or(true);
        if !ctx.muxer.has_deferred_work() {
            break;
        }
    }
    if notify {
        ctx.interrupt.signal_used_queue();
    }
}

fn drain(eventfd: &EventFd) {
    // Non-blocking: nothing to read just means another wake-up already consumed it.
    let _ = eventfd.read();
}
