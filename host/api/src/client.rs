//! An async client over umbrad's socket: typed calls, and the notifications the daemon sends.
//!
//! One reader task routes responses to their callers and notifications into a bounded queue;
//! when nobody reads notifications the queue fills, the reader stops reading the socket, and
//! the daemon's flow control takes over (it never buffers without bound for a slow client).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot};

use crate::error::{ApiError, ErrorCode};
use crate::methods::Method;
use crate::rpc::{Id, Notification, Request, Response, ServerMessage, VERSION};

/// Notifications buffered ahead of the reader.
const NOTIFICATION_QUEUE: usize = 1024;
/// Longest line accepted from the daemon (a 1 MiB file read is about 1.4 MiB of base64).
const MAX_LINE: usize = 8 << 20;

type Pending = Arc<Mutex<Option<HashMap<i64, oneshot::Sender<Result<Value, ApiError>>>>>>;

/// A connection to umbrad. Calls may run concurrently from clones.
#[derive(Clone)]
pub struct Client {
    writer: Arc<tokio::sync::Mutex<OwnedWriteHalf>>,
    pending: Pending,
    next_id: Arc<AtomicI64>,
    socket: PathBuf,
}

/// The notifications of one connection.
pub struct Notifications {
    rx: mpsc::Receiver<Notification>,
}

impl Notifications {
    /// The next notification; `None` once the connection is gone.
    pub async fn recv(&mut self) -> Option<Notification> {
        self.rx.recv().await
    }
}

fn unavailable(socket: &Path, e: impl std::fmt::Display) -> ApiError {
    ApiError::new(
        ErrorCode::Unavailable,
        format!(
            "umbrad is not reachable at {} ({e}); start it with `umbrad` (or `systemctl --user start umbrad`)",
            socket.display()
        ),
    )
}

impl Client {
    /// Connects to umbrad at `socket` (default: [`crate::paths::default_socket`]).
    pub async fn connect(socket: Option<&Path>) -> Result<(Self, Notifications), ApiError> {
        let socket = socket.map(Path::to_path_buf).unwrap_or_else(crate::paths::default_socket);
        let stream = UnixStream::connect(&socket).await.map_err(|e| unavailable(&socket, e))?;
        let (read, write) = stream.into_split();
        let pending: Pending = Arc::new(Mutex::new(Some(HashMap::new())));
        let (tx, rx) = mpsc::channel(NOTIFICATION_QUEUE);
        tokio::spawn(read_loop(BufReader::new(read), pending.clone(), tx, socket.clone()));
        let client = Self {
            writer: Arc::new(tokio::sync::Mutex::new(write)),
            pending,
            next_id: Arc::new(AtomicI64::new(1)),
            socket,
        };
        Ok((client, Notifications { rx }))
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Calls method `M` and waits for its result.
    pub async fn call<M: Method>(&self, params: M::Params) -> Result<M::Result, ApiError> {
        let value = self.call_raw(M::NAME, serde_json::to_value(params).expect("params serialize")).await?;
        serde_json::from_value(value)
            .map_err(|e| ApiError::internal(format!("umbrad answered {} with an unexpected result: {e}", M::NAME)))
    }

    /// Calls `method` with raw params.
    pub async fn call_raw(&self, method: &str, params: Value) -> Result<Value, ApiError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        match self.pending.lock().unwrap().as_mut() {
            Some(p) => p.insert(id, tx),
            None => return Err(unavailable(&self.socket, "the connection was closed")),
        };
        let request =
            Request { jsonrpc: VERSION.into(), id: Some(Id::Number(id)), method: method.into(), params: Some(params) };
        if let Err(e) = self.send_line(&request).await {
            if let Some(p) = self.pending.lock().unwrap().as_mut() {
                p.remove(&id);
            }
            return Err(e);
        }
        rx.await.unwrap_or_else(|_| Err(unavailable(&self.socket, "the connection was closed")))
    }

    /// Sends method `M` as a notification: no response comes.
    pub async fn notify<M: Method>(&self, params: M::Params) -> Result<(), ApiError> {
        let request = Request {
            jsonrpc: VERSION.into(),
            id: None,
            method: M::NAME.into(),
            params: Some(serde_json::to_value(params).expect("params serialize")),
        };
        self.send_line(&request).await
    }

    async fn send_line(&self, request: &Request) -> Result<(), ApiError> {
        let mut line = serde_json::to_vec(request).expect("requests serialize");
        line.push(b'\n');
        let mut w = self.writer.lock().await;
        w.write_all(&line).await.map_err(|e| unavailable(&self.socket, e))
    }
}

async fn read_loop(
    mut read: BufReader<tokio::net::unix::OwnedReadHalf>,
    pending: Pending,
    notifications: mpsc::Sender<Notification>,
    socket: PathBuf,
) {
    let mut line = Vec::new();
    let why = loop {
        line.clear();
        match tokio::io::AsyncReadExt::take(&mut read, MAX_LINE as u64 + 1).read_until(b'\n', &mut line).await {
            Ok(0) => break "umbrad closed the connection".to_string(),
            Ok(_) if line.len() > MAX_LINE => break format!("umbrad sent a line over {MAX_LINE} bytes"),
            Ok(_) => {}
            Err(e) => break e.to_string(),
        }
        let responses = match crate::rpc::parse_server_line(&line) {
            Ok(ServerMessage::Response(r)) => vec![r],
            Ok(ServerMessage::Batch(rs)) => rs,
            Ok(ServerMessage::Notification(n)) => {
                if notifications.send(n).await.is_err() {
                    // Nobody listens: drop notifications, keep serving responses.
                }
                continue;
            }
            Err(e) => break e.message,
        };
        for r in responses {
            deliver(&pending, r);
        }
    };
    let waiting = pending.lock().unwrap().take().unwrap_or_default();
    for (_, tx) in waiting {
        let _ = tx.send(Err(unavailable(&socket, &why)));
    }
}

fn deliver(pending: &Pending, r: Response) {
    let Some(Id::Number(id)) = r.id else { return };
    let Some(tx) = pending.lock().unwrap().as_mut().and_then(|p| p.remove(&id)) else { return };
    let result = match (r.result, r.error) {
        (_, Some(e)) => Err(ApiError::from(e)),
        (Some(v), None) => Ok(v),
        (None, None) => Ok(Value::Null),
    };
    let _ = tx.send(result);
}
