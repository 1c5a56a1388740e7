//! The one place that calls `waitpid`.
//!
//! As PID 1 the agent inherits every orphan in the guest and must reap them all, so it cannot let
//! a per-child API (tokio::process, `Child::wait`) race a global `waitpid(-1)`. Instead every
//! child is spawned through [`Reaper::spawn`], which registers its pid under the same lock the
//! reaping loop holds — an exit can never be reaped before its waiter exists. Exits of pids
//! nobody registered (orphans) are simply collected. Outside PID 1 the agent makes itself a
//! child subreaper so host-side tests exercise the same path.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

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

#[derive(Default)]
pub struct Reaper {
    waiters: Mutex<HashMap<i32, oneshot::Sender<ChildExit>>>,
}

impl Reaper {
    /// Starts the SIGCHLD-driven reaping loop. Call once, inside the tokio runtime.
    pub fn start() -> std::io::Result<Arc<Self>> {
        let reaper = Arc::new(Self::default());
        let mut sigchld = signal(SignalKind::child())?;
        let r = reaper.clone();
        tokio::spawn(async move {
            loop {
                r.reap_all();
                if sigchld.recv().await.is_none() {
                    break;
                }
            }
        });
        Ok(reaper)
    }

    /// Runs `spawn` (which forks) with reaping paused, and registers the child it returns.
    pub fn spawn<T>(
        &self,
        spawn: impl FnOnce() -> std::io::Result<(T, u32)>,
    ) -> std::io::Result<(T, u32, oneshot::Receiver<ChildExit>)> {
        let mut waiters = self.waiters.lock().expect("reaper lock poisoned");
        let (child, pid) = spawn()?;
        let (tx, rx) = oneshot::channel();
        waiters.insert(pid as i32, tx);
        Ok((child, pid, rx))
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
            if let Some(tx) = waiters.remove(&pid.as_raw()) {
                let _ = tx.send(exit);
            }
        }
    }
}
