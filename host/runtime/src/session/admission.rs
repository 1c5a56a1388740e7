//! Boot admission: at most N VMs boot at once, the rest wait their turn in order.
//!
//! A burst of starts on a small host otherwise ends in errors, not sessions: measured here, 64
//! guests booting at once on 2 cores under emulation all missed a 30 s boot timeout (and some
//! kernels panicked in their timer check). Queued, each boot gets the CPU it needs, and its
//! boot deadline counts from when it is admitted.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub struct Admission {
    slots: Arc<Semaphore>,
    /// How many slots there are meant to be (see [`Admission::resize`]).
    size: std::sync::Mutex<usize>,
    /// Boots waiting for a slot.
    waiting: AtomicU32,
}

/// Held while a VM boots; dropping it admits the next boot.
pub struct Slot {
    _permit: OwnedSemaphorePermit,
}

impl Admission {
    /// `slots` boots at once; 0 picks twice the host's CPU count.
    pub fn new(slots: usize) -> Self {
        let slots = if slots == 0 { default_slots() } else { slots };
        Self { slots: Arc::new(Semaphore::new(slots)), size: std::sync::Mutex::new(slots), waiting: AtomicU32::new(0) }
    }

    /// Changes how many boots run at once (0: the default). More slots admit waiting boots at
    /// once; fewer take effect as running boots finish (their slots are retired, not returned).
    pub fn resize(&self, slots: usize) {
        let slots = if slots == 0 { default_slots() } else { slots };
        let mut size = self.size.lock().unwrap();
        if slots > *size {
            self.slots.add_permits(slots - *size);
        } else if slots < *size {
            let (semaphore, retire) = (self.slots.clone(), (*size - slots) as u32);
            tokio::spawn(async move {
                if let Ok(permits) = semaphore.acquire_many_owned(retire).await {
                    permits.forget();
                }
            });
        }
        *size = slots;
    }

    /// Waits for a boot slot. When none is free, `queued` is called first with the boot's
    /// place in the queue (1 = next). Tokio's semaphore is fair, so places hold.
    pub async fn enter(&self, queued: impl FnOnce(u32)) -> Slot {
        if let Ok(permit) = self.slots.clone().try_acquire_owned() {
            return Slot { _permit: permit };
        }
        let position = self.waiting.fetch_add(1, Ordering::SeqCst) + 1;
        queued(position);
        let permit = self.slots.clone().acquire_owned().await.expect("the semaphore is never closed");
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        Slot { _permit: permit }
    }
}

fn default_slots() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get() * 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn boots_beyond_the_limit_wait_in_order_and_are_told_their_place() {
        let admission = Arc::new(Admission::new(2));
        let a = admission.enter(|_| panic!("a free slot")).await;
        let _b = admission.enter(|_| panic!("a free slot")).await;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut waiters = Vec::new();
        for i in 0..3u32 {
            let (admission, tx) = (admission.clone(), tx.clone());
            waiters.push(tokio::spawn(async move {
                let slot = admission.enter(|pos| tx.send(("queued", i, pos)).unwrap()).await;
                tx.send(("admitted", i, 0)).unwrap();
                slot
            }));
            // Let each enqueue before the next, so the places are deterministic.
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        for i in 0..3 {
            assert_eq!(rx.recv().await.unwrap(), ("queued", i, i + 1));
        }
        drop(a);
        assert_eq!(rx.recv().await.unwrap(), ("admitted", 0, 0), "the first in line goes first");
        assert!(rx.try_recv().is_err(), "one slot freed, one boot admitted");
        drop(waiters);
    }

    #[tokio::test]
    async fn resizing_admits_more_at_once_or_retires_slots() {
        let admission = Admission::new(1);
        let _a = admission.enter(|_| panic!("a free slot")).await;
        admission.resize(2);
        let b = admission.enter(|_| panic!("the new slot is free")).await;
        admission.resize(1);
        drop(b);
        tokio::task::yield_now().await;
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        let queued = std::sync::atomic::AtomicBool::new(false);
        let wait = tokio::time::timeout(
            std::time::Duration::from_millis(100),
            admission.enter(|_| queued.store(true, std::sync::atomic::Ordering::SeqCst)),
        )
        .await;
        assert!(wait.is_err() && queued.load(std::sync::atomic::Ordering::SeqCst), "the freed slot was retired");
    }
}
