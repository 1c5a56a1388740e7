//! A process a client spawned: its output forwarded under the client's flow control, its stdin
//! applied in order.
//!
//! Each output stream has a window of [`OUTPUT_WINDOW`] bytes; the client widens it with
//! `process.ack` as it consumes output. A chunk waits until the window holds it, and while it
//! waits the process's pump stops reading from the guest, whose credit then runs out: a slow
//! reader slows only its own process, end to end, with bounded memory on the way.

use std::sync::Arc;

use tokio::sync::{mpsc, Semaphore};
use umbra_api::methods::OUTPUT_WINDOW;
use umbra_api::rpc::{Id, NOTIFY_PROCESS};
use umbra_api::{ApiError, EventKind};
use umbra_runtime::session::{Exec, ExecControl};

use crate::client::Connection;
use crate::owned::{Owned, StdinOp, STDIN_QUEUE};

impl Owned {
    /// Registers `exec` with `conn` and starts forwarding its events. Call after the spawn's
    /// response is queued, so the client hears of the process before its output.
    pub fn start(conn: &Arc<Connection>, session: String, exec: Exec) {
        let id = exec.id();
        let control = exec.control();
        let stdout_window = Arc::new(Semaphore::new(OUTPUT_WINDOW as usize));
        let stderr_window = Arc::new(Semaphore::new(OUTPUT_WINDOW as usize));
        let (stdin, stdin_rx) = mpsc::channel(STDIN_QUEUE);
        let owned = Arc::new(Owned {
            session,
            control: control.clone(),
            stdout_window: stdout_window.clone(),
            stderr_window: stderr_window.clone(),
            stdin,
            tasks: Default::default(),
        });
        // Registered before forwarding starts, so the exit's removal cannot come first.
        conn.processes.lock().unwrap().insert(id, owned.clone());
        let forward = tokio::spawn(forward(conn.clone(), exec, stdout_window, stderr_window));
        let feed = tokio::spawn(feed_stdin(conn.clone(), control, stdin_rx));
        owned.tasks.lock().unwrap().extend([forward.abort_handle(), feed.abort_handle()]);
    }
}

async fn forward(conn: Arc<Connection>, mut exec: Exec, stdout: Arc<Semaphore>, stderr: Arc<Semaphore>) {
    let id = exec.id();
    while let Some(event) = exec.next_event().await {
        let window = match &event.kind {
            EventKind::Stdout { data, .. } => Some((&stdout, data.byte_len())),
            EventKind::Stderr { data, .. } => Some((&stderr, data.byte_len())),
            _ => None,
        };
        if let Some((window, len)) = window {
            // A chunk is at most 64 KiB, far below the window: it always fits eventually.
            match window.acquire_many(len.min(OUTPUT_WINDOW as usize) as u32).await {
                Ok(permit) => permit.forget(),
                Err(_) => return,
            }
        }
        let last = matches!(event.kind, EventKind::Exit(_));
        if !conn.notify(NOTIFY_PROCESS, &event).await {
            return;
        }
        if last {
            break;
        }
    }
    conn.processes.lock().unwrap().remove(&id);
}

async fn feed_stdin(conn: Arc<Connection>, control: ExecControl, mut rx: mpsc::Receiver<(StdinOp, Option<Id>)>) {
    while let Some((op, id)) = rx.recv().await {
        let result = match op {
            StdinOp::Data(bytes) => control.write_stdin(bytes).await,
            StdinOp::Close => control.close_stdin().await,
        };
        let result = result.map(|()| serde_json::json!({})).map_err(ApiError::from);
        if id.is_some() && !conn.respond(id, result).await {
            return;
        }
    }
}
