//! A process a client spawned or attached to: its output forwarded under the client's flow
//! control, its stdin applied in order.
//!
//! Each output stream has a window of [`OUTPUT_WINDOW`] bytes; the client widens it with
//! `process.ack` as it consumes output. A chunk waits until the window holds it, and while it
//! waits the process's pump stops reading from the guest, whose credit then runs out: a slow
//! reader slows only its own process, end to end, with bounded memory on the way. A kept
//! process (`detach`, a terminal) is read by its session, never stopped by a client: an
//! attached client's window only paces its own reading of what the session keeps.

use std::sync::Arc;

use tokio::sync::{mpsc, Semaphore};
use umbra_api::methods::{Stream, OUTPUT_WINDOW};
use umbra_api::rpc::{Id, NOTIFY_PROCESS};
use umbra_api::{ApiError, Data, EventKind, SessionEvent};
use umbra_runtime::session::{Exec, ExecControl, KeptEvent, KeptReader};

use crate::client::Connection;
use crate::owned::{Owned, StdinOp, STDIN_QUEUE};

impl Owned {
    /// Registers `exec` with `conn` and starts forwarding its events. Call after the spawn's
    /// response is queued, so the client hears of the process before its output. A client gone
    /// meanwhile never had it: dropping `exec` kills the process.
    pub fn start(conn: &Arc<Connection>, session: String, exec: Exec) {
        let Some((owned, stdout, stderr)) = Owned::register(conn, session, exec.id(), exec.control()) else {
            return;
        };
        let forward = tokio::spawn(forward(conn.clone(), exec, stdout, stderr));
        owned.tasks.lock().unwrap().push(forward.abort_handle());
    }

    /// Attaches `conn` to a kept process: what `reader` reads, under the client's windows. Call
    /// after the response is queued, and after [`Owned::end_view`] of an earlier attach.
    pub fn attach(conn: &Arc<Connection>, session: String, reader: KeptReader) {
        let kept = reader.kept();
        let Some((owned, stdout, stderr)) = Owned::register(conn, session, kept.id(), kept.control().clone()) else {
            return;
        };
        let forward = tokio::spawn(forward_kept(conn.clone(), owned.clone(), reader, stdout, stderr));
        owned.tasks.lock().unwrap().push(forward.abort_handle());
    }

    /// Ends `conn`'s view of process `id`, if it has one, before a new attach answers: once
    /// this returns, the old view sends nothing more, so every event after the new attach's
    /// response is the new view's.
    pub async fn end_view(conn: &Connection, id: u64) {
        let old = conn.processes.lock().unwrap().remove(&id);
        if let Some(old) = old {
            *old.live.lock().await = false;
            old.abandon();
        }
    }

    /// The client's view of process `id`: windows, a stdin queue and its feeder; `None` when
    /// the client has gone. Registered before forwarding starts, so the exit's removal cannot
    /// come first.
    fn register(
        conn: &Arc<Connection>,
        session: String,
        id: u64,
        control: ExecControl,
    ) -> Option<(Arc<Owned>, Arc<Semaphore>, Arc<Semaphore>)> {
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
            live: tokio::sync::Mutex::new(true),
        });
        {
            let mut processes = conn.processes.lock().unwrap();
            // Checked under the lock `close` drains under: nothing registers after it.
            if conn.is_closed() {
                return None;
            }
            if let Some(old) = processes.insert(id, owned.clone()) {
                old.abandon();
            }
        }
        let feed = tokio::spawn(feed_stdin(conn.clone(), control, stdin_rx));
        owned.tasks.lock().unwrap().push(feed.abort_handle());
        Some((owned, stdout_window, stderr_window))
    }
}

/// Forwards a kept process's output from the session's log, then its exit; the view is gone
/// from the client's state when this ends, however it ends.
async fn forward_kept(
    conn: Arc<Connection>,
    me: Arc<Owned>,
    reader: KeptReader,
    stdout: Arc<Semaphore>,
    stderr: Arc<Semaphore>,
) {
    let id = reader.kept().id();
    forward_kept_events(&conn, &me, reader, stdout, stderr).await;
    let mut processes = conn.processes.lock().unwrap();
    // Only this view: a later attach of the same client has its own.
    if processes.get(&id).is_some_and(|o| Arc::ptr_eq(o, &me)) {
        processes.remove(&id);
    }
}

async fn forward_kept_events(
    conn: &Connection,
    me: &Owned,
    mut reader: KeptReader,
    stdout: Arc<Semaphore>,
    stderr: Arc<Semaphore>,
) {
    let id = reader.kept().id();
    while let Some(event) = reader.next().await {
        let kind = match event {
            KeptEvent::Output { stream, offset, data } => {
                let window = if stream == Stream::Stdout { &stdout } else { &stderr };
                // A chunk is at most 64 KiB, far below the window: it always fits eventually.
                match window.acquire_many(data.len().min(OUTPUT_WINDOW as usize) as u32).await {
                    Ok(permit) => permit.forget(),
                    Err(_) => return,
                }
                let (data, offset) = (Data::from_bytes(&data), Some(offset));
                match stream {
                    Stream::Stdout => EventKind::Stdout { process: id, data, offset },
                    Stream::Stderr => EventKind::Stderr { process: id, data, offset },
                }
            }
            KeptEvent::Exit(exit) => EventKind::Exit(exit),
        };
        let last = matches!(kind, EventKind::Exit(_));
        {
            // Sent only while the view lives (`end_view` waits for a send in progress).
            let live = me.live.lock().await;
            if !*live || !conn.notify(NOTIFY_PROCESS, &SessionEvent::new(Some(&me.session), kind)).await {
                return;
            }
        }
        if last {
            return;
        }
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
            StdinOp::Data(bytes, offset) => control.write_client_stdin(offset, bytes).await,
            StdinOp::Close => control.close_stdin().await,
        };
        let result = result.map(|()| serde_json::json!({})).map_err(ApiError::from);
        if id.is_some() && !conn.respond(id, result).await {
            return;
        }
    }
}
