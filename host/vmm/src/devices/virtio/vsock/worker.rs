//! The vsock device's thread: waits on the three queue eventfds, the muxer's epoll fd (every
//! host socket) and an exit eventfd, and drives the [`VsockMuxer`] — epoll wiring only; all
//! protocol logic lives in the muxer, which tests drive without this thread.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use virtio_queue::QueueT;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::device::{EVENT_QUEUE, RX_QUEUE, TX_QUEUE};
use super::muxer::VsockMuxer;
use crate::devices::virtio::{ActiveQueue, Interrupt};
use crate::seccomp::{Lane, Running};
use crate::vstate::memory::GuestMemory;

const EXIT: u64 = 0;
const RX: u64 = 1;
const TX: u64 = 2;
const EVENT: u64 = 3;
const HOST: u64 = 4;
/// Rounds of tx/rx per wake-up before going back to epoll (rx draining the control queue can
/// unblock tx, whose new packets can owe rx more).
const ROUNDS_PER_WAKE: usize = 4;

/// A running device thread; [`Worker::stop`] gives the muxer back.
#[derive(Debug)]
pub struct Worker {
    exit: EventFd,
    handle: Running<Option<VsockMuxer>>,
}

struct Context {
    muxer: VsockMuxer,
    mem: GuestMemory,
    interrupt: Arc<dyn Interrupt>,
    queues: Vec<ActiveQueue>,
    epoll: Epoll,
}

impl Worker {
    /// Starts the thread. On failure the muxer is handed back with the error (always, in
    /// practice: only a poisoned slot could lose it).
    pub fn spawn(
        lane: &Lane,
        muxer: VsockMuxer,
        mem: GuestMemory,
        interrupt: Arc<dyn Interrupt>,
        queues: Vec<ActiveQueue>,
    ) -> Result<Worker, (Option<Box<VsockMuxer>>, io::Error)> {
        let setup = || -> io::Result<(EventFd, Epoll)> {
            let exit = EventFd::new(EFD_NONBLOCK)?;
            let epoll = Epoll::new()?;
            let add = |fd, token| epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, token));
            add(exit.as_raw_fd(), EXIT)?;
            add(queues[RX_QUEUE].notify.as_raw_fd(), RX)?;
            add(queues[TX_QUEUE].notify.as_raw_fd(), TX)?;
            add(queues[EVENT_QUEUE].notify.as_raw_fd(), EVENT)?;
            add(muxer.as_raw_fd(), HOST)?;
            Ok((exit, epoll))
        };
        let (exit, epoll) = match setup() {
            Ok(s) => s,
            Err(e) => return Err((Some(Box::new(muxer)), e)),
        };
        // `spawn` consumes its closure even when it fails; the context goes through a slot so
        // that the muxer (and its bound socket) can be handed back in that case.
        let slot = Arc::new(Mutex::new(Some(Context { muxer, mem, interrupt, queues, epoll })));
        let thread_slot = Arc::clone(&slot);
        let spawned = lane.run(move || thread_slot.lock().ok().and_then(|mut ctx| ctx.take()).map(run));
        match spawned {
            Ok(handle) => Ok(Worker { exit, handle }),
            Err(e) => {
                let muxer = slot.lock().ok().and_then(|mut ctx| ctx.take()).map(|ctx| Box::new(ctx.muxer));
                Err((muxer, e))
            }
        }
    }

    /// Stops the thread and returns the muxer, or None if the thread panicked.
    pub fn stop(self) -> Option<VsockMuxer> {
        let _ = self.exit.write(1);
        self.handle.join().ok().flatten()
    }
}

fn run(mut ctx: Context) -> VsockMuxer {
    let mut events = [EpollEvent::default(); 8];
    // Buffers the driver made available before activation announced nothing.
    process_queues(&mut ctx);
    loop {
        let timeout_ms = if ctx.muxer.has_deferred_work() {
            0
        } else {
            ctx.muxer.next_deadline().map_or(-1, |deadline| {
                let wait = deadline.saturating_duration_since(Instant::now());
                // Round up so we do not wake just before the deadline and spin.
                i32::try_from(wait.as_millis() + 1).unwrap_or(i32::MAX)
            })
        };
        let n = match ctx.epoll.wait(timeout_ms, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            // The epoll fd is ours and valid; nothing sensible is left to do if waiting fails.
            Err(_) => return ctx.muxer,
        };
        for ev in &events[..n] {
            match ev.data() {
                EXIT => return ctx.muxer,
                RX => drain(&ctx.queues[RX_QUEUE].notify),
                TX => drain(&ctx.queues[TX_QUEUE].notify),
                // The device never sends events (they are for live migration), so buffers on
                // the event queue simply wait there.
                EVENT => drain(&ctx.queues[EVENT_QUEUE].notify),
                HOST => {
                    ctx.muxer.handle_host_events();
                }
                _ => {}
            }
        }
        ctx.muxer.process_timeouts(Instant::now());
        process_queues(&mut ctx);
    }
}

fn process_queues(ctx: &mut Context) {
    let mut notify = false;
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
