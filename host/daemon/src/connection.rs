//! One client connection: request lines in, responses and notifications out, every queue
//! bounded.
//!
//! - A request line longer than the limit gets an `invalid_request` error and is skipped to its
//!   newline; the connection carries on. So do malformed JSON, unknown methods and bad params.
//! - At most [`MAX_IN_FLIGHT`] requests run at once per client; beyond that the reader stops
//!   reading, so a client cannot queue unbounded work.
//! - Everything outgoing goes through one queue of [`OUT_QUEUE`] lines to one writer task. A
//!   client that stops reading fills its own queue and stalls only its own work: its processes
//!   stop in the guest (output credit), its subscriptions fall behind on the event bus and are
//!   told how many events they lost.
//! - `process.stdin` and `process.close_stdin` are applied in the order they arrive, per
//!   process; other requests run concurrently.
//! - Processes belong to the connection that spawned them: when it closes, they are killed.
//! - A response follows the lifecycle events that were sent before it: each subscription is
//!   waited for (a bounded time) until it has queued them, so a client that sees `delete`
//!   answered has already seen the session stop.

use std::sync::Arc;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use umbra_api::rpc::{self, Id, Incoming, Request, Response};
use umbra_api::{ApiError, ErrorCode};

use crate::client::Connection;
use crate::dispatch::{self, Outcome};
use crate::state::Daemon;

/// Requests of one client running at once.
pub const MAX_IN_FLIGHT: usize = 64;
/// Lines queued for one client's writer.
const OUT_QUEUE: usize = 256;
pub async fn run(daemon: Arc<Daemon>, stream: UnixStream, id: u64, _client_slot: OwnedSemaphorePermit) {
    tracing::debug!(connection = id, "client connected");
    let max_line = daemon.options.max_request_bytes;
    let (read, write) = stream.into_split();
    let (out, out_rx) = mpsc::channel(OUT_QUEUE);
    let writer = tokio::spawn(write_loop(write, out_rx));
    let conn = Arc::new(Connection::new(daemon, out));
    read_loop(&conn, read, max_line).await;
    conn.close();
    drop(conn);
    // The writer ends once every task holding the connection has finished with it.
    let _ = writer.await;
    tracing::debug!(connection = id, "client disconnected");
}

async fn write_loop(write: OwnedWriteHalf, mut rx: mpsc::Receiver<Vec<u8>>) {
    let mut w = BufWriter::with_capacity(64 * 1024, write);
    while let Some(line) = rx.recv().await {
        if w.write_all(&line).await.is_err() {
            return;
        }
        // Coalesce what is already queued into one write, then flush.
        while let Ok(line) = rx.try_recv() {
            if w.write_all(&line).await.is_err() {
                return;
            }
        }
        if w.flush().await.is_err() {
            return;
        }
    }
}

/// What reading one line gave.
enum Line {
    Complete,
    /// Longer than the limit: skipped to its newline.
    TooLong,
    Eof,
}

/// Reads one line (without its newline) into `buf`, never holding more than `max` bytes.
async fn read_line(reader: &mut BufReader<OwnedReadHalf>, buf: &mut Vec<u8>, max: usize) -> std::io::Result<Line> {
    buf.clear();
    let mut too_long = false;
    loop {
        let available = reader.fill_buf().await?;
        if available.is_empty() {
            return Ok(match (too_long, buf.is_empty()) {
                (true, _) => Line::TooLong,
                (false, true) => Line::Eof,
                (false, false) => Line::Complete,
            });
        }
        let (chunk, used, done) = match available.iter().position(|&b| b == b'\n') {
            Some(i) => (&available[..i], i + 1, true),
            None => (available, available.len(), false),
        };
        if !too_long {
            if buf.len() + chunk.len() > max {
                too_long = true;
                buf.clear();
            } else {
                buf.extend_from_slice(chunk);
            }
        }
        reader.consume(used);
        if done {
            return Ok(if too_long { Line::TooLong } else { Line::Complete });
        }
    }
}

async fn read_loop(conn: &Arc<Connection>, read: OwnedReadHalf, max_line: usize) {
    let mut reader = BufReader::with_capacity(64 * 1024, read);
    let in_flight = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let mut line = Vec::new();
    loop {
        match read_line(&mut reader, &mut line, max_line).await {
            Err(_) | Ok(Line::Eof) => return,
            Ok(Line::TooLong) => {
                let e = ApiError::new(
                    ErrorCode::InvalidRequest,
                    format!("request line longer than {max_line} bytes; it was skipped"),
                );
                if !conn.respond(None, Err(e)).await {
                    return;
                }
                continue;
            }
            Ok(Line::Complete) => {}
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let Ok(slot) = in_flight.clone().acquire_owned().await else { return };
        match rpc::parse_request_line(&line) {
            Incoming::Single(Err((id, e))) => {
                drop(slot);
                if !conn.respond(id, Err(e)).await {
                    return;
                }
            }
            Incoming::Single(Ok(request)) => {
                if dispatch::is_ordered(&request.method) {
                    // Applied in arrival order (stdin, acks): queued here, answered later.
                    dispatch::ordered(conn, request).await;
                    drop(slot);
                } else {
                    tokio::spawn(handle(conn.clone(), request, slot));
                }
            }
            Incoming::Batch(items) => {
                tokio::spawn(handle_batch(conn.clone(), items, slot));
            }
        }
    }
}

async fn handle(conn: Arc<Connection>, request: Request, _slot: OwnedSemaphorePermit) {
    let Request { id, method, params, .. } = request;
    let Outcome { result, after } = dispatch::dispatch(&conn, &method, params).await;
    // A notification gets no response, even when it failed.
    if id.is_some() {
        conn.respond(id, result).await;
    }
    if let Some(after) = after {
        after();
    }
}

/// A batch: each entry handled in order, one array of responses (none for notifications).
async fn handle_batch(
    conn: Arc<Connection>,
    items: Vec<Result<Request, (Option<Id>, ApiError)>>,
    _slot: OwnedSemaphorePermit,
) {
    let mut responses = Vec::new();
    let mut afters = Vec::new();
    for item in items {
        match item {
            Err((id, e)) => responses.push(Response::err(id, &e)),
            Ok(Request { id, method, params, .. }) => {
                let Outcome { result, after } = if dispatch::is_ordered(&method) {
                    let why = format!("{method} is applied in arrival order and cannot be batched");
                    Outcome::from(Err(ApiError::new(ErrorCode::InvalidRequest, why)))
                } else {
                    dispatch::dispatch(&conn, &method, params).await
                };
                afters.extend(after);
                if id.is_some() {
                    responses.push(match result {
                        Ok(v) => Response::ok(id, v),
                        Err(e) => Response::err(id, &e),
                    });
                }
            }
        }
    }
    if !responses.is_empty() {
        conn.send(&responses).await;
    }
    for after in afters {
        after();
    }
}
