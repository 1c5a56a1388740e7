//! A deadline for exchanges with the vhost-user backend.
//!
//! The `vhost` crate's socket reads and writes retry on EAGAIN, so a socket timeout
//! (SO_RCVTIMEO) would only make a stuck exchange spin; and a backend that is alive but never
//! answers would otherwise hang the vCPU thread that activates or resets the device. Instead, a
//! phase of the conversation is armed with a deadline, and if it passes, this thread shuts the
//! socket down: the blocked read returns end-of-file, the exchange fails, and the connection is
//! treated as broken (virtiofsd, seeing the shutdown, exits).

use std::io;
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::seccomp::ThreadKind;
use std::time::{Duration, Instant};

#[derive(Default)]
struct State {
    deadline: Option<Instant>,
    fired: bool,
    exit: bool,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    // The lock only guards plain values that are valid whatever happened to a holder.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The watchdog of one connection.
pub struct Watchdog {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// While alive, the deadline it was armed with stands; dropping it disarms the watchdog.
pub struct Armed {
    shared: Arc<Shared>,
}

impl Watchdog {
    /// Starts the thread that shuts `socket` (a clone of the connection) down when an armed
    /// deadline passes.
    pub fn spawn(socket: UnixStream) -> io::Result<Watchdog> {
        let shared = Arc::new(Shared::default());
        let watched = shared.clone();
        let thread = crate::seccomp::spawn_filtered(ThreadKind::FsWatchdog, "umbra-fs-watchdog", move || {
            let mut state = watched.lock();
            loop {
                if state.exit {
                    return;
                }
                state = match state.deadline {
                    None => watched.changed.wait(state).unwrap_or_else(|p| p.into_inner()),
                    Some(deadline) if Instant::now() >= deadline => {
                        // Fails only if the socket is already shut down or closed: fine either way.
                        let _ = socket.shutdown(Shutdown::Both);
                        state.fired = true;
                        state.deadline = None;
                        state
                    }
                    Some(deadline) => {
                        let left = deadline.saturating_duration_since(Instant::now());
                        watched.changed.wait_timeout(state, left).unwrap_or_else(|p| p.into_inner()).0
                    }
                };
            }
        })?;
        Ok(Watchdog { shared, thread: Some(thread) })
    }

    /// Arms the watchdog: if the returned guard is still alive after `timeout`, the socket is
    /// shut down.
    pub fn arm(&self, timeout: Duration) -> Armed {
        self.shared.lock().deadline = Some(Instant::now() + timeout);
        self.shared.changed.notify_all();
        Armed { shared: self.shared.clone() }
    }

    /// Whether a deadline ever passed (the socket is then shut down for good).
    pub fn fired(&self) -> bool {
        self.shared.lock().fired
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        self.shared.lock().deadline = None;
        self.shared.changed.notify_all();
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.lock().exit = true;
        self.shared.changed.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn a_deadline_that_passes_shuts_the_socket_down_and_one_that_is_met_does_not() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let watchdog = Watchdog::spawn(ours.try_clone().unwrap()).unwrap();
        {
            let _armed = watchdog.arm(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(100));
        assert!(!watchdog.fired(), "disarmed in time");

        let started = Instant::now();
        let _armed = watchdog.arm(Duration::from_millis(50));
        let mut buf = [0u8; 1];
        // Blocks until the watchdog shuts the socket down; then reads end-of-file.
        assert_eq!((&ours).read(&mut buf).unwrap(), 0);
        assert!(started.elapsed() >= Duration::from_millis(50));
        assert!(watchdog.fired());
        assert_eq!(theirs.read(&mut buf).unwrap(), 0, "the peer sees the shutdown too");
    }
}
