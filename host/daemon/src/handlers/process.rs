//! `process.*` and `terminal.*`: spawning a client's processes (kept by the session with
//! `detach`), attaching to kept ones, terminals, signalling and resizing, and the ordered
//! methods (`process.stdin`, `process.close_stdin`, `process.ack`) that the connection's reader
//! applies in arrival order instead of running them concurrently like the rest.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use umbra_api::kept::{AttachParams, Attached, ProcessList, TerminalRunResult};
use umbra_api::methods::{
    AckParams, Done, Method, ProcessAck, ProcessAttach, ProcessCloseStdin, ProcessKill, ProcessKillAll,
    ProcessListMethod, ProcessRef, ProcessResize, ProcessSpawn, ProcessStdin, SpawnParams, Spawned, StdinParams,
    TerminalAttach, TerminalClose, TerminalListMethod, TerminalOpen, TerminalResize, TerminalRun,
};
use umbra_api::rpc::{decode_params, Request};
use umbra_api::ApiError;
use umbra_runtime::session::{ExecControl, ExecRequest, Kept, TerminalRequest};

use super::common::{call, owned, session, Outcome};
use crate::client::Connection;
use crate::owned::{Owned, StdinOp};

/// Handles this module's concurrent methods; `None` for any other.
pub async fn handle(conn: &Arc<Connection>, method: &str, params: Option<Value>) -> Option<Outcome> {
    Some(match method {
        ProcessSpawn::NAME => spawn(conn, params).await,
        ProcessKill::NAME => {
            call::<ProcessKill, _, _>(params, |p| async move {
                control(conn, &p.session, p.process)?.signal(p.signal).await?;
                Ok(Done {})
            })
            .await
        }
        ProcessKillAll::NAME => {
            call::<ProcessKillAll, _, _>(params, |p| async move {
                session(conn, &p.session)?.kill_all(p.signal).await?;
                Ok(Done {})
            })
            .await
        }
        ProcessResize::NAME => {
            call::<ProcessResize, _, _>(params, |p| async move {
                control(conn, &p.session, p.process)?.resize(p.rows, p.cols).await?;
                Ok(Done {})
            })
            .await
        }
        ProcessListMethod::NAME => {
            call::<ProcessListMethod, _, _>(params, |p| async move {
                Ok(ProcessList { processes: session(conn, &p.session)?.process_list() })
            })
            .await
        }
        ProcessAttach::NAME => match decode_params::<AttachParams>(params) {
            Ok(p) => match session(conn, &p.session).and_then(|s| Ok(s.kept_process(p.process)?)) {
                Ok(kept) => attach(conn, p.session, kept, p.from).await,
                Err(e) => Outcome::from(Err(e)),
            },
            Err(e) => Outcome::from(Err(e)),
        },
        TerminalOpen::NAME => open_terminal(conn, params).await,
        TerminalAttach::NAME => match decode_params::<umbra_api::kept::TerminalAttachParams>(params) {
            Ok(p) => match session(conn, &p.session).and_then(|s| Ok(s.terminal(p.terminal)?)) {
                Ok(kept) => {
                    let from = umbra_api::kept::OutputOffsets { stdout: p.from, stderr: 0 };
                    attach(conn, p.session, kept, from).await
                }
                Err(e) => Outcome::from(Err(e)),
            },
            Err(e) => Outcome::from(Err(e)),
        },
        TerminalListMethod::NAME => {
            call::<TerminalListMethod, _, _>(params, |p| async move {
                Ok(umbra_api::kept::TerminalList { terminals: session(conn, &p.session)?.terminal_list() })
            })
            .await
        }
        TerminalResize::NAME => {
            call::<TerminalResize, _, _>(params, |p| async move {
                session(conn, &p.session)?.terminal(p.terminal)?.resize(p.rows, p.cols).await?;
                Ok(Done {})
            })
            .await
        }
        TerminalClose::NAME => {
            call::<TerminalClose, _, _>(params, |p| async move {
                session(conn, &p.session)?.close_terminal(p.terminal)?;
                Ok(Done {})
            })
            .await
        }
        TerminalRun::NAME => {
            call::<TerminalRun, _, _>(params, |p| async move {
                let timeout = p.timeout_secs.map(Duration::from_secs);
                let (exit_code, cwd) = session(conn, &p.session)?.terminal_run(p.terminal, &p.command, timeout).await?;
                Ok(TerminalRunResult { exit_code, cwd })
            })
            .await
        }
        // The reader sends these to `ordered`; reaching here is a bug in the daemon.
        ProcessStdin::NAME | ProcessCloseStdin::NAME | ProcessAck::NAME => {
            Outcome::from(Err(ApiError::internal(format!("{method} is applied in order by the reader"))))
        }
        _ => return None,
    })
}

/// Methods applied in arrival order by the connection's reader.
pub fn is_ordered(method: &str) -> bool {
    matches!(method, ProcessStdin::NAME | ProcessCloseStdin::NAME | ProcessAck::NAME)
}

/// Applies an ordered method: stdin goes into the process's queue (answered once the guest
/// took it; `busy` when the queue is full, never a wait), an ack widens its window at once.
pub async fn ordered(conn: &Arc<Connection>, request: Request) {
    let Request { id, method, params, .. } = request;
    let queued = match method.as_str() {
        ProcessStdin::NAME => match decode_params::<StdinParams>(params) {
            Ok(p) => match (owned(conn, &p.session, p.process), p.data.to_bytes()) {
                (Ok(owned), Ok(bytes)) => match stdin_piece(p.writer, p.offset) {
                    Ok(at) => owned.queue_stdin(StdinOp::Data(bytes.into(), at), id.clone()),
                    Err(e) => Err(e),
                },
                (Err(e), _) | (_, Err(e)) => Err(e),
            },
            Err(e) => Err(e),
        },
        ProcessCloseStdin::NAME => match decode_params::<ProcessRef>(params) {
            Ok(p) => match owned(conn, &p.session, p.process) {
                Ok(owned) => owned.queue_stdin(StdinOp::Close, id.clone()),
                Err(e) => Err(e),
            },
            Err(e) => Err(e),
        },
        _ => {
            let result = decode_params::<AckParams>(params)
                .and_then(|p| owned(conn, &p.session, p.process).map(|o| o.ack(p.stream, p.bytes)));
            if id.is_some() {
                conn.respond(id, result.map(|()| serde_json::json!({}))).await;
            }
            return;
        }
    };
    if let Err(e) = queued {
        if id.is_some() {
            conn.respond(id, Err(e)).await;
        }
    }
}

/// `process.stdin`'s `writer` and `offset`: both or neither, the name bounded.
fn stdin_piece(writer: Option<String>, offset: Option<u64>) -> Result<Option<(String, u64)>, ApiError> {
    match (writer, offset) {
        (None, None) => Ok(None),
        (Some(w), Some(o)) if !w.is_empty() && w.len() <= umbra_api::methods::MAX_STDIN_WRITER => Ok(Some((w, o))),
        (Some(_), Some(_)) => Err(ApiError::invalid_params(format!(
            "a stdin writer's name has 1 to {} bytes",
            umbra_api::methods::MAX_STDIN_WRITER
        ))),
        _ => Err(ApiError::invalid_params("process.stdin takes `writer` and `offset` together")),
    }
}

/// Spawns a process for this client. Its events follow the response, never precede it.
async fn spawn(conn: &Arc<Connection>, params: Option<Value>) -> Outcome {
    let p = match decode_params::<SpawnParams>(params) {
        Ok(p) => p,
        Err(e) => return Outcome::from(Err(e)),
    };
    let s = match session(conn, &p.session) {
        Ok(s) => s,
        Err(e) => return Outcome::from(Err(e)),
    };
    let request = ExecRequest {
        argv: p.argv,
        cwd: p.cwd,
        env: p.env,
        tty: p.tty,
        timeout: p.timeout_secs.map(Duration::from_secs),
    };
    if p.detach {
        return match s.spawn_kept(request).await {
            Ok(kept) => {
                let result = Spawned { process: kept.id(), pid: kept.pid() };
                attached(conn, p.session, &kept, result, Default::default())
            }
            Err(e) => Outcome::from(Err(e.into())),
        };
    }
    match s.spawn(request).await {
        Ok(exec) => {
            let result = Spawned { process: exec.id(), pid: exec.pid() };
            let conn = conn.clone();
            Outcome {
                result: Ok(serde_json::to_value(result).expect("results serialize")),
                after: Some(Box::new(move || Owned::start(&conn, p.session, exec))),
            }
        }
        Err(e) => Outcome::from(Err(e.into())),
    }
}

/// The controls of a process this client owns, or of a kept process of the session (any client
/// may signal or resize those).
fn control(conn: &Connection, session_name: &str, process: u64) -> Result<ExecControl, ApiError> {
    match owned(conn, session_name, process) {
        Ok(o) => Ok(o.control.clone()),
        Err(e) => match session(conn, session_name).map(|s| s.kept_process(process)) {
            Ok(Ok(kept)) => Ok(kept.control().clone()),
            _ => Err(e),
        },
    }
}

/// Attaches this client to a kept process (ending its earlier view of it); its output follows
/// the response.
async fn attach(
    conn: &Arc<Connection>,
    session: String,
    kept: Arc<Kept>,
    from: umbra_api::kept::OutputOffsets,
) -> Outcome {
    Owned::end_view(conn, kept.id()).await;
    let (stdout, stderr) = kept.ranges();
    let result = Attached { process: kept.id(), pid: kept.pid(), stdout, stderr, exit: kept.exit() };
    attached(conn, session, &kept, result, from)
}

/// `result`, then the kept process's output from `from` to this client.
fn attached(
    conn: &Arc<Connection>,
    session: String,
    kept: &Arc<Kept>,
    result: impl serde::Serialize,
    from: umbra_api::kept::OutputOffsets,
) -> Outcome {
    let conn = conn.clone();
    let reader = kept.reader(from);
    Outcome {
        result: Ok(serde_json::to_value(result).expect("results serialize")),
        after: Some(Box::new(move || Owned::attach(&conn, session, reader))),
    }
}

/// Opens a terminal and attaches this client to it.
async fn open_terminal(conn: &Arc<Connection>, params: Option<Value>) -> Outcome {
    let p = match decode_params::<umbra_api::kept::TerminalOpenParams>(params) {
        Ok(p) => p,
        Err(e) => return Outcome::from(Err(e)),
    };
    let s = match session(conn, &p.session) {
        Ok(s) => s,
        Err(e) => return Outcome::from(Err(e)),
    };
    let request = TerminalRequest { shell: p.shell, cwd: p.cwd, env: p.env, size: p.size };
    match s.open_terminal(request).await {
        Ok(kept) => attached(conn, p.session, &kept, kept.terminal_info(), Default::default()),
        Err(e) => Outcome::from(Err(e.into())),
    }
}
