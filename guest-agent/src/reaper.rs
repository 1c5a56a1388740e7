//! The one place that calls `waitpid`.
//!
//! As PID 1 the agent inherits every orphan in the guest and must reap them all, so it cannot let
//! a per-child API (tokio::process, `Child::wait`) race a global `waitpid(-1)`. Instead every
//! child is spawned through [`Reaper::spawn`], which registers its pid under the same lock the
//! reaping loop holds — an exit can never be reaped before its waiter exists. Exits of pids
//! nobody registered (orphans) are simply collected. Outside PID 1 the agent makes itself a
//! child subreaper so host-side tests exercise the same path.
//!
//! The reaping loop runs on its own OS thread, never on a tokio worker: a fork+exec holds the
//! lock until the child has exec'd (which can take long, e.g. on a slow filesystem), and a worker
//! blocked on that lock would stall every connection.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use nix::sys::signal::{killpg, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::oneshot;

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildExit {
    Code(i32),
    Signal(i32),
}

/// What the spawner of a registered child gets to follow it.
pub struct Registration {
    /// Receives the exit status once the child is reaped.
    pub exit: oneshot::Receiver<ChildExit>,
    /// Set just before the exit is sent: from then on the pid may be reused, so nobody may
    /// signal it (or its group) by number any more.
    pub reaped: Arc<AtomicBool>,
}

struct Waiter {
    exit: oneshot::Sender<ChildExit>,
    reaped: Arc<AtomicBool>,
}

#[derive(Default)]
pub struct Reaper {
    waiters: Mutex<HashMap<i32, Waiter>>,
}

impl Reaper {
    /// Starts the SIGCHLD-driven reaping thread. Call once, inside the tokio runtime (the
    /// SIGCHLD handler is tokio's; a small task forwards each signal to the thread).
    pub fn start() -> std::io::Result<Arc<Self>> {
        let reaper = Arc::new(Self::default());
        let mut sigchld = signal(SignalKind::child())?;
        // Capacity 1 coalesces wake-ups: one pending pass covers any number of SIGCHLDs.
        let (wake, woken) = std::sync::mpsc::sync_channel::<()>(1);
        let r = reaper.clone();
        std::thread::Builder::new().name("umbra-reaper".into()).spawn(move || {
            while woken.recv().is_ok() {
                r.reap_all();
            }
        })?;
        // Children that exited before the handler was installed.
        let _ = wake.try_send(());
        tokio::spawn(async move {
            while sigchld.recv().await.is_some() {
                let _ = wake.try_send(());
            }
        });
        Ok(reaper)
    }

    /// Runs `spawn` (which forks) with reaping paused, and registers the child it returns.
    /// Blocks until the child has exec'd: call it from a blocking thread.
    pub fn spawn<T>(
        &self,
        spawn: impl FnOnce() -> std::io::Result<(T, u32)>,
    ) -> std::io::Result<(T, u32, Registration)> {
        let mut waiters = self.waiters.lock().expect("reaper lock poisoned");
        let (child, pid) = spawn()?;
        let (tx, rx) = oneshot::channel();
        let reaped = Arc::new(AtomicBool::new(false));
        waiters.insert(pid as i32, Waiter { exit: tx, reaped: reaped.clone() });
        Ok((child, pid, Registration { exit: rx, reaped }))
    }

    /// Signals the process group of every registered child that has not been reaped yet.
    /// Under the lock no registered pid can be reaped, so none can have been reused.
    pub fn kill_all(&self, signal: Signal) {
        let waiters = self.waiters.lock().expect("reaper lock poisoned");
        for &pid in waiters.keys() {
            let _ = killpg(Pid::from_raw(pid), signal);
        }
    }

    fn reap_all(&self) {
        let mut waiters = self.waiters.lock().expect("reaper lock poisoned");
        loop {
            let (pid, exit) = match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) => (pid, ChildExit::Code(code)),
                Ok(WaitStatus::Signaled(pid, sig, _core)) => (pid, ChildExit::Signal(sig as i32)),
                Ok(WaitStatus::StillAlive) | Err(_) => break, // Err is ECHILD: no children left.
                Ok(_) => continue,
            };
            if let Some(w) = waiters.remove(&pid.as_raw()) {
                w.reaped.store(true, Ordering::Release);
                let _ = w.exit.send(exit);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// A fork+exec that takes long holds the reaper lock; a SIGCHLD arriving meanwhile must not
    /// park a tokio worker on that lock (with one worker, that would freeze every task).
    #[test]
    fn a_slow_spawn_does_not_stall_the_async_runtime() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        rt.block_on(async {
            let reaper = Reaper::start().unwrap();
            // A timer task on the single worker (block_on's own thread does not run tasks).
            let ticker = tokio::spawn(async {
                let mut worst = Duration::ZERO;
                for _ in 0..50 {
                    let t = Instant::now();
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    worst = worst.max(t.elapsed());
                }
                worst
            });
            tokio::time::sleep(Duration::from_millis(20)).await;
            let r = reaper.clone();
            let slow = tokio::task::spawn_blocking(move || {
                r.spawn(|| {
                    let child = std::process::Command::new("true").spawn()?;
                    // `true` exits (SIGCHLD) while the lock is still held.
                    std::thread::sleep(Duration::from_millis(600));
                    Ok(((), child.id()))
                })
            });
            let worst = ticker.await.unwrap();
            let (_, _, reg) = slow.await.unwrap().unwrap();
            assert_eq!(tokio::time::timeout(Duration::from_secs(5), reg.exit).await.unwrap(), Ok(ChildExit::Code(0)));
            assert!(reg.reaped.load(Ordering::Acquire));
            assert!(worst < Duration::from_millis(200), "a timer on the worker was late by {worst:?}");
        });
    }
}
