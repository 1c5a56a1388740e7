//! One client of the daemon, whatever its transport: its outgoing queue, the processes it
//! spawned and its event subscriptions. The socket loops (`connection.rs`), the handlers
//! (`handlers/`) and the process tasks (`processes.rs`) all act through it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::Serialize;
use serde_json::Value;
use tokio::sync::{mpsc, watch};
use umbra_api::rpc::{Id, Notification, Response};
use umbra_api::ApiError;

use crate::owned::Owned;
use crate::state::Daemon;

/// Longest a response waits for this client's subscriptions to queue the events sent before
/// it (they wait only on this client's own queue, or on an event flood).
const EVENTS_FIRST: std::time::Duration = std::time::Duration::from_secs(2);

/// One `events.subscribe`: its forwarding task, and how far it has got on the event bus.
pub struct Subscription {
    pub task: tokio::task::AbortHandle,
    /// Events of the bus it has queued for the client or passed over (filtered out, lost).
    pub position: watch::Receiver<u64>,
}

/// One client: what it is sent goes through `out`, in order.
pub struct Connection {
    pub daemon: Arc<Daemon>,
    out: mpsc::Sender<Vec<u8>>,
    /// Processes this client spawned, by process id.
    pub processes: Mutex<HashMap<u64, Arc<Owned>>>,
    /// Event subscriptions, by id.
    pub subscriptions: Mutex<HashMap<u64, Subscription>>,
    next_subscription: AtomicU64,
    /// Set by `close` (under the `processes` lock): nothing registers a process after it.
    closed: std::sync::atomic::AtomicBool,
}

impl Connection {
    /// A client whose outgoing lines go to `out` (the socket's writer task).
    pub fn new(daemon: Arc<Daemon>, out: mpsc::Sender<Vec<u8>>) -> Self {
        Self {
            daemon,
            out,
            processes: Mutex::new(HashMap::new()),
            subscriptions: Mutex::new(HashMap::new()),
            next_subscription: AtomicU64::new(1),
            closed: Default::default(),
        }
    }

    /// Queues a line; false once the client is gone.
    pub async fn send<T: Serialize>(&self, message: &T) -> bool {
        let mut line = serde_json::to_vec(message).expect("messages serialize");
        line.push(b'\n');
        self.out.send(line).await.is_ok()
    }

    pub async fn respond(&self, id: Option<Id>, result: Result<Value, ApiError>) -> bool {
        self.events_first().await;
        let response = match result {
            Ok(v) => Response::ok(id, v),
            Err(e) => Response::err(id, &e),
        };
        self.send(&response).await
    }

    pub async fn notify(&self, method: &str, params: impl Serialize) -> bool {
        self.send(&Notification::new(method, params)).await
    }

    /// Waits until every subscription has queued the events sent so far (or [`EVENTS_FIRST`]).
    async fn events_first(&self) {
        let positions: Vec<watch::Receiver<u64>> =
            self.subscriptions.lock().unwrap().values().map(|s| s.position.clone()).collect();
        if positions.is_empty() {
            return;
        }
        let sent = self.daemon.manager.events_sent();
        let caught_up = async {
            for mut p in positions {
                // An error is a subscription that ended: nothing to wait for.
                let _ = p.wait_for(|&n| n >= sent).await;
            }
        };
        let _ = tokio::time::timeout(EVENTS_FIRST, caught_up).await;
    }

    pub fn new_subscription_id(&self) -> u64 {
        self.next_subscription.fetch_add(1, Ordering::Relaxed)
    }

    /// Whether `close` ran.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Stops everything this client started: subscriptions end, processes are killed.
    pub fn close(&self) {
        for (_, subscription) in self.subscriptions.lock().unwrap().drain() {
            subscription.task.abort();
        }
        let owned: Vec<Arc<Owned>> = {
            let mut processes = self.processes.lock().unwrap();
            self.closed.store(true, Ordering::SeqCst);
            processes.drain().map(|(_, p)| p).collect()
        };
        for p in owned {
            p.abandon();
        }
    }
}
