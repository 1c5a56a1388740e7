//! The event loop of every device thread (Cloud Hypervisor's `EpollHelper`): an epoll set with
//! a stop eventfd built in, and [`EpollHelper::run`], which waits, retries an interrupted wait,
//! hands each ready registration's token to an [`EpollHandler`], and returns when the stop
//! eventfd fires or the handler says so.
//!
//! The set is built by the thread that starts the device (on a vCPU thread, at activation), so a
//! registration that fails is reported to it; the loop then moves to the device's thread. Tokens
//! are the handler's own (a queue index, a socket); [`STOP_TOKEN`] is reserved.
//!
//! The stop eventfd ends the run at once: events epoll reported after it in the same wake-up
//! (ones that became ready after the stop was asked for) are not handed to the handler, and
//! neither is the end of that wake-up. Whoever asked for the stop then joins the thread, after
//! which nothing the handler owns is touched again.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// The stop eventfd's token; a handler's registrations use any other.
pub const STOP_TOKEN: u64 = u64::MAX;
/// Ready registrations taken per wait; more stay ready for the next one.
const EVENTS_PER_WAIT: usize = 8;

/// Whether the loop goes on after a handler call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Stop,
}

/// What a device thread does with what its epoll set reports.
pub trait EpollHandler {
    /// Called for each ready registration of a wake-up, in the order epoll reports them, with
    /// the token it was added with. [`Flow::Stop`] ends the run without handling the rest.
    fn handle_event(&mut self, helper: &EpollHelper, token: u64, events: EventSet) -> Flow;

    /// Called once a wake-up's events are handled, and when a wait times out: the place for
    /// work that a batch of events makes due (processing notified queues, timers).
    fn after_events(&mut self, _helper: &EpollHelper) -> Flow {
        Flow::Continue
    }

    /// How long the next wait may block, in milliseconds: -1 until an event, 0 to only look.
    /// Asked before every wait.
    fn timeout_ms(&mut self) -> i32 {
        -1
    }
}

/// An epoll set with a stop eventfd in it.
#[derive(Debug)]
pub struct EpollHelper {
    epoll: Epoll,
    stop: Arc<EventFd>,
}

/// Stops an [`EpollHelper::run`] from another thread.
#[derive(Debug, Clone)]
pub struct StopHandle(Arc<EventFd>);

impl StopHandle {
    /// Makes the run return at its next wake-up (or at once, if it is waiting). Idempotent.
    pub fn stop(&self) {
        // An eventfd write only fails when the counter would overflow: it is then readable.
        let _ = self.0.write(1);
    }
}

impl EpollHelper {
    /// A new epoll set holding only the stop eventfd.
    pub fn new() -> io::Result<EpollHelper> {
        let stop = EventFd::new(EFD_NONBLOCK)?;
        let epoll = Epoll::new()?;
        epoll.ctl(ControlOperation::Add, stop.as_raw_fd(), EpollEvent::new(EventSet::IN, STOP_TOKEN))?;
        Ok(EpollHelper { epoll, stop: Arc::new(stop) })
    }

    /// What stops the run; keep it where the thread is stopped from.
    pub fn stop_handle(&self) -> StopHandle {
        StopHandle(Arc::clone(&self.stop))
    }

    /// Watches `fd` for input, reported with `token`.
    pub fn add_event(&self, fd: RawFd, token: u64) -> io::Result<()> {
        self.add_event_with(fd, token, EventSet::IN)
    }

    /// Watches `fd` for `events`, reported with `token`. The registration refers to `fd`'s open
    /// file: it lasts until that is closed (or the set is dropped), so the caller keeps `fd` open
    /// while the loop runs.
    pub fn add_event_with(&self, fd: RawFd, token: u64, events: EventSet) -> io::Result<()> {
        if token == STOP_TOKEN {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "the stop eventfd's token is reserved"));
        }
        self.epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(events, token))
    }

    /// Waits and dispatches until the stop eventfd fires or `handler` returns [`Flow::Stop`]
    /// (then `Ok`). A wait interrupted by a signal is retried; any other failure of the wait
    /// ends the run with that error, for the caller to report as it sees fit.
    pub fn run<H: EpollHandler + ?Sized>(&self, handler: &mut H) -> io::Result<()> {
        let mut events = [EpollEvent::default(); EVENTS_PER_WAIT];
        loop {
            let count = match self.epoll.wait(handler.timeout_ms(), &mut events) {
                Ok(count) => count,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            for event in &events[..count] {
                let token = event.data();
                if token == STOP_TOKEN || handler.handle_event(self, token, event.event_set()) == Flow::Stop {
                    return Ok(());
                }
            }
            if handler.after_events(self) == Flow::Stop {
                return Ok(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    /// Records every call; stops after `stop_after` events, if set.
    #[derive(Default)]
    struct Recorder {
        seen: Vec<u64>,
        wakeups: usize,
        stop_after: Option<usize>,
        timeout_ms: i32,
        fds: Vec<EventFd>,
    }

    impl EpollHandler for Recorder {
        fn handle_event(&mut self, _helper: &EpollHelper, token: u64, events: EventSet) -> Flow {
            assert!(events.contains(EventSet::IN));
            let _ = self.fds[token as usize].read();
            self.seen.push(token);
            match self.stop_after {
                Some(n) if self.seen.len() >= n => Flow::Stop,
                _ => Flow::Continue,
            }
        }
        fn after_events(&mut self, _helper: &EpollHelper) -> Flow {
            self.wakeups += 1;
            if self.timeout_ms == 0 && self.wakeups == 3 {
                Flow::Stop
            } else {
                Flow::Continue
            }
        }
        fn timeout_ms(&mut self) -> i32 {
            self.timeout_ms
        }
    }

    fn helper_with(n: usize) -> (EpollHelper, Recorder) {
        let helper = EpollHelper::new().unwrap();
        let fds: Vec<EventFd> = (0..n).map(|_| EventFd::new(EFD_NONBLOCK).unwrap()).collect();
        for (i, fd) in fds.iter().enumerate() {
            helper.add_event(fd.as_raw_fd(), i as u64).unwrap();
        }
        (helper, Recorder { fds, timeout_ms: -1, ..Default::default() })
    }

    #[test]
    fn dispatches_a_token_and_stops_from_another_thread() {
        let (helper, mut recorder) = helper_with(2);
        let kick: Vec<EventFd> = recorder.fds.iter().map(|fd| fd.try_clone().unwrap()).collect();
        let stop = helper.stop_handle();
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            let result = helper.run(&mut recorder);
            tx.send(()).unwrap();
            result.map(|()| recorder)
        });
        kick[1].write(1).unwrap();
        assert!(rx.recv_timeout(Duration::from_millis(50)).is_err(), "still running");
        stop.stop();
        rx.recv_timeout(Duration::from_secs(5)).expect("the stop eventfd ends the run");
        let recorder = thread.join().unwrap().unwrap();
        assert_eq!(recorder.seen, vec![1], "the kick, and nothing for the stop");
    }

    #[test]
    fn the_stop_ends_the_run_before_what_became_ready_after_it() {
        let (helper, mut recorder) = helper_with(2);
        recorder.fds[0].write(1).unwrap();
        helper.stop_handle().stop();
        recorder.fds[1].write(1).unwrap();
        helper.run(&mut recorder).unwrap();
        assert_eq!(recorder.seen, vec![0], "the event before the stop, not the one after");
        assert_eq!(recorder.wakeups, 0);
    }

    #[test]
    fn a_handler_stops_the_run_and_a_timeout_is_a_wakeup_without_events() {
        let (helper, mut recorder) = helper_with(3);
        for fd in &recorder.fds {
            fd.write(1).unwrap();
        }
        recorder.stop_after = Some(2);
        helper.run(&mut recorder).unwrap();
        assert_eq!(recorder.seen.len(), 2, "the rest of the wake-up is not handled");
        assert_eq!(recorder.wakeups, 0);

        let (helper, mut recorder) = helper_with(1);
        recorder.timeout_ms = 0;
        helper.run(&mut recorder).unwrap();
        assert_eq!((recorder.seen.len(), recorder.wakeups), (0, 3), "each empty wait ends a wake-up");
    }

    #[test]
    fn the_stop_token_is_reserved() {
        let helper = EpollHelper::new().unwrap();
        let fd = EventFd::new(EFD_NONBLOCK).unwrap();
        let err = helper.add_event(fd.as_raw_fd(), STOP_TOKEN).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }
}
