//! Per-stream send credit: the host grants bytes, the output pump spends them.
//!
//! When a stream has no credit its pump stops reading the child's pipe, the pipe fills, and the
//! child blocks in write(2). That is the whole flow-control story: one flooding process stalls
//! only itself, and the agent never buffers more than one chunk per stream.

use std::sync::Mutex;

use tokio::sync::Notify;

pub struct Credit {
    state: Mutex<State>,
    notify: Notify,
}

struct State {
    available: u64,
    closed: bool,
}

impl Credit {
    pub fn new(initial: u32) -> Self {
        Self { state: Mutex::new(State { available: initial as u64, closed: false }), notify: Notify::new() }
    }

    pub fn grant(&self, bytes: u32) {
        let mut s = self.state.lock().expect("credit lock poisoned");
        s.available = s.available.saturating_add(bytes as u64);
        drop(s);
        self.notify.notify_one();
    }

    /// Waits until some credit is available and returns how much (capped at `max`), without
    /// spending it. `None` once closed.
    pub async fn available(&self, max: usize) -> Option<usize> {
        loop {
            {
                let s = self.state.lock().expect("credit lock poisoned");
                if s.closed {
                    return None;
                }
                if s.available > 0 {
                    return Some(s.available.min(max as u64) as usize);
                }
            }
            // notify_one stores a permit, so a grant between the check and this await is kept.
            self.notify.notified().await;
        }
    }

    pub fn spend(&self, bytes: usize) {
        let mut s = self.state.lock().expect("credit lock poisoned");
        s.available = s.available.saturating_sub(bytes as u64);
    }

    /// Starts afresh with `initial` bytes (a new connection adopted the process).
    pub fn reset(&self, initial: u32) {
        let mut s = self.state.lock().expect("credit lock poisoned");
        s.available = initial as u64;
        s.closed = false;
        drop(s);
        self.notify.notify_one();
    }

    /// Wakes the pump for good (the connection is gone).
    pub fn close(&self) {
        self.state.lock().expect("credit lock poisoned").closed = true;
        self.notify.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[tokio::test]
    async fn waits_for_a_grant_and_caps_at_max() {
        let c = Arc::new(Credit::new(0));
        let c2 = c.clone();
        let waiter = tokio::spawn(async move { c2.available(10).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "no credit: the pump must wait");
        c.grant(100);
        assert_eq!(waiter.await.unwrap(), Some(10));
        c.spend(95);
        assert_eq!(c.available(10).await, Some(5));
        c.close();
        assert_eq!(c.available(10).await, None);
    }
}
