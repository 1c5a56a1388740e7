//! A process a client spawned, as the client's state holds it: its output windows, its stdin
//! queue and the tasks that serve it (started by `processes.rs`).

use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::{mpsc, Semaphore};
use umbra_api::methods::{Stream, OUTPUT_WINDOW};
use umbra_api::rpc::Id;
use umbra_api::ApiError;
use umbra_runtime::session::ExecControl;

/// Stdin writes queued per process ahead of the guest.
pub const STDIN_QUEUE: usize = 16;
/// The most credit a client may hold per stream: acks beyond it are clamped (a client cannot
/// make the daemon buffer more for it by acknowledging bytes it never received).
const MAX_WINDOW: usize = 16 * OUTPUT_WINDOW as usize;

pub enum StdinOp {
    /// Bytes, and the writer and where the first falls in its stream when the client said.
    Data(Bytes, Option<(String, u64)>),
    Close,
}

/// A client's process.
pub struct Owned {
    pub session: String,
    pub control: ExecControl,
    pub(crate) stdout_window: Arc<Semaphore>,
    pub(crate) stderr_window: Arc<Semaphore>,
    pub(crate) stdin: mpsc::Sender<(StdinOp, Option<Id>)>,
    pub(crate) tasks: std::sync::Mutex<Vec<tokio::task::AbortHandle>>,
    /// False once another attach of the same client replaced this view of a kept process.
    pub(crate) live: tokio::sync::Mutex<bool>,
}

impl Owned {
    /// Widens a stream's window by what the client consumed.
    pub fn ack(&self, stream: Stream, bytes: u64) {
        let window = match stream {
            Stream::Stdout => &self.stdout_window,
            Stream::Stderr => &self.stderr_window,
        };
        let room = MAX_WINDOW.saturating_sub(window.available_permits());
        window.add_permits((bytes as usize).min(room));
    }

    /// Queues stdin (or its end) in order; the response comes when the guest took it. Never
    /// waits: a full queue is `busy` (a client should keep at most [`STDIN_QUEUE`] writes
    /// unanswered), so a process that does not read its stdin cannot stall the connection.
    pub fn queue_stdin(&self, op: StdinOp, id: Option<Id>) -> Result<(), ApiError> {
        self.stdin.try_send((op, id)).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => ApiError::new(
                umbra_api::ErrorCode::Busy,
                format!(
                    "{STDIN_QUEUE} stdin writes of this process are still waiting for the guest to read them; \
                     wait for their responses before sending more"
                ),
            ),
            mpsc::error::TrySendError::Closed(_) => {
                ApiError::new(umbra_api::ErrorCode::NotFound, "the process has ended")
            }
        })
    }

    /// The client went away: stop forwarding (dropping the process kills it).
    pub fn abandon(&self) {
        for t in self.tasks.lock().unwrap().drain(..) {
            t.abort();
        }
    }
}
