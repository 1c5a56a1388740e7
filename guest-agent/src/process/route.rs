//! Where a process's frames go: the connection that spawned it, or — parked (`park`) — nowhere
//! until another connection adopts it (`adopt`).
//!
//! Every frame of a process goes out holding its route's lock, and parking takes that lock: once
//! `park` has parked a process, none of its frames is sent on the old connection any more, and
//! the ones sent before are in that connection's outbox ahead of the `parked` answer. Output read
//! while parked waits in the pump (one chunk), the rest in the child's pipe. The credits a route
//! spends are the current connection's: adoption starts them afresh, under the same lock, and a
//! stdin credit owed to the old connection is never sent on the new one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::{MappedMutexGuard, MutexGuard, Notify};
use umbra_proto::Frame;

use super::outgoing::FrameSink;

/// A connection a process's frames go to, and its id there.
pub struct Target {
    pub sink: FrameSink,
    pub id: u32,
    /// Takes the process out of that connection's table (at its exit).
    forget: Box<dyn Fn() + Send + Sync>,
}

impl Target {
    pub fn new(sink: FrameSink, id: u32, forget: impl Fn() + Send + Sync + 'static) -> Self {
        Self { sink, id, forget: Box::new(forget) }
    }

    /// Takes the process out of its connection's table.
    pub fn forget(&self) {
        (self.forget)()
    }
}

pub struct Route {
    state: tokio::sync::Mutex<State>,
    changed: Notify,
    /// Bumped at each adoption: stdin received on an older connection is not credited back.
    epoch: AtomicU64,
}

struct State {
    /// `None` while parked.
    to: Option<Target>,
    /// No connection will adopt it (dropped, or its connection went): senders give up.
    closed: bool,
}

impl Route {
    pub fn new(to: Target) -> Arc<Self> {
        Arc::new(Self {
            state: tokio::sync::Mutex::new(State { to: Some(to), closed: false }),
            changed: Notify::new(),
            epoch: AtomicU64::new(0),
        })
    }

    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// The current target, held until the guard drops; waits while parked. `None` once closed.
    pub async fn current(&self) -> Option<MappedMutexGuard<'_, Target>> {
        let state = self.targeted().await?;
        Some(MutexGuard::map(state, |s| s.to.as_mut().expect("targeted")))
    }

    /// The state once it has a target (waiting while parked); `None` once closed.
    async fn targeted(&self) -> Option<MutexGuard<'_, State>> {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let state = self.state.lock().await;
            if state.closed {
                return None;
            }
            if state.to.is_some() {
                return Some(state);
            }
            drop(state);
            notified.await;
        }
    }

    /// Sends the process's last frame (its exit, made for its id) and closes the route, at
    /// once: a `park` either comes before (and the exit waits for the adoption) or finds the
    /// route closed.
    pub async fn send_last(&self, frame: impl FnOnce(u32) -> Frame) {
        let Some(mut state) = self.targeted().await else { return };
        let to = state.to.as_ref().expect("targeted");
        let _ = to.sink.send(frame(to.id).into()).await;
        to.forget();
        state.closed = true;
    }

    /// The current target if it is the one of `epoch` (no waiting).
    pub async fn current_at(&self, epoch: u64) -> Option<MappedMutexGuard<'_, Target>> {
        let state = self.state.lock().await;
        if state.closed || self.epoch() != epoch {
            return None;
        }
        MutexGuard::try_map(state, |s| s.to.as_mut()).ok()
    }

    /// Stops sending; returns once a frame being sent is queued. False when the process has
    /// already sent its exit (nothing to park).
    pub async fn park(&self) -> bool {
        let mut state = self.state.lock().await;
        if state.closed {
            return false;
        }
        state.to = None;
        true
    }

    /// Sends to `to` from now on; `reset` runs first, under the lock (credits start afresh).
    pub async fn adopt(&self, to: Target, reset: impl FnOnce()) {
        let mut state = self.state.lock().await;
        reset();
        self.epoch.fetch_add(1, Ordering::AcqRel);
        state.to = Some(to);
        drop(state);
        self.changed.notify_waiters();
    }

    /// Nobody will adopt it: whatever waits to send gives up.
    pub async fn close(&self) {
        self.state.lock().await.closed = true;
        self.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::super::outgoing::Outgoing;
    use super::*;
    use std::time::Duration;

    fn target(id: u32) -> (Target, tokio::sync::mpsc::Receiver<Outgoing>, Arc<AtomicU64>) {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let forgotten = Arc::new(AtomicU64::new(0));
        let count = forgotten.clone();
        let forget = move || {
            count.fetch_add(1, Ordering::Relaxed);
        };
        (Target::new(tx, id, forget), rx, forgotten)
    }

    #[tokio::test]
    async fn a_parked_route_waits_for_its_adoption_and_a_closed_one_gives_up() {
        let (first, _rx, _t) = target(1);
        let route = Route::new(first);
        assert_eq!(route.current().await.map(|t| t.id), Some(1));
        assert!(route.park().await);
        let waiting = {
            let route = route.clone();
            tokio::spawn(async move { route.current().await.map(|t| t.id) })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "parked: nothing may be sent");
        assert!(route.current_at(0).await.is_none(), "no target while parked");
        let (second, _rx2, _t2) = target(7);
        let mut reset = false;
        route.adopt(second, || reset = true).await;
        assert!(reset);
        assert_eq!(waiting.await.unwrap(), Some(7));
        assert!(route.current_at(0).await.is_none(), "stdin of the old connection is not credited on the new");
        assert_eq!(route.current_at(1).await.map(|t| t.id), Some(7));
        assert!(route.park().await);
        let waiting = {
            let route = route.clone();
            tokio::spawn(async move { route.current().await.is_none() })
        };
        route.close().await;
        assert!(waiting.await.unwrap(), "closed: the sender gives up");

        // After its exit went out there is nothing to park.
        let (third, mut rx, forgotten) = target(9);
        let route = Route::new(third);
        route.send_last(|id| Frame::new(umbra_proto::FrameKind::Event, id, &b"{}"[..])).await;
        assert!(matches!(rx.recv().await, Some(Outgoing::Frame(f)) if f.id == 9));
        assert_eq!(forgotten.load(Ordering::Relaxed), 1, "its exit takes it out of its table");
        assert!(!route.park().await, "exited: not parked");
    }
}
