//! `process.*`: spawning a client's processes, signalling and resizing them, and the ordered
//! methods (`process.stdin`, `process.close_stdin`, `process.ack`) that the connection's reader
//! applies in arrival order instead of running them concurrently like the rest.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use umbra_api::methods::{
    AckParams, Done, Method, ProcessAck, ProcessCloseStdin, ProcessKill, ProcessKillAll, ProcessRef, ProcessResize,
    ProcessSpawn, ProcessStdin, SpawnParams, Spawned, StdinParams,
};
use umbra_api::rpc::{decode_params, Request};
use umbra_api::ApiError;
use umbra_runtime::session::ExecRequest;

use super::common::{call, owned, session, Outcome};
use crate::client::Connection;
use crate::owned::{Owned, StdinOp};

/// Handles this module's concurrent methods; `None` for any other.
pub async fn handle(conn: &Arc<Connection>, method: &str, params: Option<Value>) -> Option<Outcome> {
    Some(match method {
        ProcessSpawn::NAME => spawn(conn, params).await,
        ProcessKill::NAME => {
            call::<ProcessKill, _, _>(params, |p| async move {
                owned(conn, &p.session, p.process)?.control.signal(p.signal).await?;
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
                owned(conn, &p.session, p.process)?.control.resize(p.rows, p.cols).await?;
                Ok(Done {})
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
                (Ok(owned), Ok(bytes)) => owned.queue_stdin(StdinOp::Data(bytes.into()), id.clone()),
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
