//! Method name → handler. Each handler decodes its params into the method's type, calls the
//! runtime, and returns the method's result type: thin, like kata-agent's RPC layer over its
//! sandbox model. The model (sessions, processes, folders) is umbra-runtime's.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use umbra_api::methods::*;
use umbra_api::rpc::{decode_params, Request, NOTIFY_EVENT, NOTIFY_LOST};
use umbra_api::{ApiError, Data, ErrorCode, SessionEvent};
use umbra_proto::WriteMode;
use umbra_runtime::session::{ExecRequest, Session};

use crate::client::{Connection, Subscription};
use crate::owned::{Owned, StdinOp};

/// A handler's result, and work to do once the response is queued.
pub struct Outcome {
    pub result: Result<Value, ApiError>,
    pub after: Option<Box<dyn FnOnce() + Send>>,
}

impl From<Result<Value, ApiError>> for Outcome {
    fn from(result: Result<Value, ApiError>) -> Self {
        Self { result, after: None }
    }
}

/// Decodes `params` for method `M`, runs `f`, encodes its result.
async fn call<M, F, Fut>(params: Option<Value>, f: F) -> Outcome
where
    M: Method,
    F: FnOnce(M::Params) -> Fut,
    Fut: Future<Output = Result<M::Result, ApiError>>,
{
    let result = match decode_params::<M::Params>(params) {
        Ok(p) => f(p).await.map(|r| serde_json::to_value(r).expect("results serialize")),
        Err(e) => Err(e),
    };
    result.into()
}

fn session(conn: &Connection, name: &str) -> Result<Arc<Session>, ApiError> {
    let s = conn.daemon.manager.get(name)?;
    s.touch();
    Ok(s)
}

fn owned(conn: &Connection, session: &str, process: u64) -> Result<Arc<Owned>, ApiError> {
    let p = conn.processes.lock().unwrap().get(&process).cloned();
    match p {
        Some(p) if p.session == session => Ok(p),
        _ => Err(ApiError::new(
            ErrorCode::NotFound,
            format!("process {process} of session {session:?} is not running (or was not spawned by this client)"),
        )),
    }
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

pub async fn dispatch(conn: &Arc<Connection>, method: &str, params: Option<Value>) -> Outcome {
    let daemon = &conn.daemon;
    let manager = &daemon.manager;
    match method {
        DaemonInfoMethod::NAME => {
            call::<DaemonInfoMethod, _, _>(params, |_| async {
                Ok(DaemonInfo {
                    version: env!("CARGO_PKG_VERSION").into(),
                    api_version: umbra_api::API_VERSION.into(),
                    pid: std::process::id(),
                    uid: daemon.uid,
                    socket: daemon.options.socket.clone(),
                })
            })
            .await
        }
        ConfigGet::NAME => call::<ConfigGet, _, _>(params, |_| async { Ok(manager.config()) }).await,
        ConfigSet::NAME => {
            call::<ConfigSet, _, _>(params, |patch| async move {
                let path = &daemon.options.config_path;
                // Saved first: settings that took effect but vanish at the next start would lie.
                let config = manager.set_config(&patch, |next| {
                    crate::settings::save(path, next).map_err(|e| {
                        ApiError::new(ErrorCode::Io, format!("cannot save the settings to {}: {e}", path.display()))
                    })
                })?;
                if patch.auto_download == Some(true) || (patch.bundle_url.is_some() && config.auto_download) {
                    crate::bundles::warm_in_background(daemon.clone());
                }
                Ok(config)
            })
            .await
        }
        PoolStatusMethod::NAME => call::<PoolStatusMethod, _, _>(params, |_| async { Ok(manager.pool_status()) }).await,
        BundleStatusMethod::NAME => {
            call::<BundleStatusMethod, _, _>(params, |_| async { Ok(crate::bundles::status(daemon)) }).await
        }
        BundleDownload::NAME => {
            call::<BundleDownload, _, _>(params, |p| crate::bundles::download(daemon.clone(), p.url, p.warm, false))
                .await
        }
        BundleDeleteAndReinstall::NAME => {
            call::<BundleDeleteAndReinstall, _, _>(params, |p| {
                crate::bundles::download(daemon.clone(), p.url, false, true)
            })
            .await
        }
        SessionStart::NAME => {
            call::<SessionStart, _, _>(params, |p| async move { Ok(manager.start(p).await?.info()) }).await
        }
        SessionResume::NAME => {
            call::<SessionResume, _, _>(params, |p| async move {
                Ok(manager.resume_with(&p.name, p.discard_snapshot).await?.info())
            })
            .await
        }
        SessionSnapshot::NAME => {
            call::<SessionSnapshot, _, _>(params, |p| async move { Ok(manager.snapshot(&p.name).await?.info()) }).await
        }
        SessionFork::NAME => {
            call::<SessionFork, _, _>(params, |p| async move { Ok(manager.fork(&p.source, &p.name).await?.info()) })
                .await
        }
        SessionStop::NAME => {
            call::<SessionStop, _, _>(params, |p| async move { Ok(manager.stop(&p.name).await?.info()) }).await
        }
        SessionDelete::NAME => {
            call::<SessionDelete, _, _>(params, |p| async move {
                manager.delete(&p.name).await?;
                Ok(Done {})
            })
            .await
        }
        SessionSetNetwork::NAME => {
            call::<SessionSetNetwork, _, _>(params, |p| async move {
                let s = manager.get(&p.name)?;
                s.set_network(p.network)?;
                Ok(s.info())
            })
            .await
        }
        PermissionRespond::NAME => {
            call::<PermissionRespond, _, _>(params, |p| async move {
                manager.respond_permission(&p.request_id, p.approved)?;
                Ok(Done {})
            })
            .await
        }
        SessionListMethod::NAME => {
            call::<SessionListMethod, _, _>(params, |_| async { Ok(SessionList { sessions: manager.list() }) }).await
        }
        SessionGet::NAME => call::<SessionGet, _, _>(params, |p| async move { Ok(manager.get(&p.name)?.info()) }).await,
        SessionLogsMethod::NAME => {
            call::<SessionLogsMethod, _, _>(params, |p| async move {
                let n = p.lines.unwrap_or(100).clamp(1, 10_000) as usize;
                let s = manager.get(&p.name)?;
                let console = s.console_tail(n).await.lines().map(str::to_string).collect();
                Ok(SessionLogs { events: manager.recent_events(&p.name, n), console })
            })
            .await
        }
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
        FolderMount::NAME => {
            call::<FolderMount, _, _>(params, |p| async move { Ok(session(conn, &p.session)?.mount(p.folder).await?) })
                .await
        }
        FolderUnmount::NAME => {
            call::<FolderUnmount, _, _>(params, |p| async move {
                session(conn, &p.session)?.unmount(&p.name).await?;
                Ok(Done {})
            })
            .await
        }
        FileRead::NAME => {
            call::<FileRead, _, _>(params, |p| async move {
                let len = p.len.unwrap_or(MAX_FILE_CHUNK).min(MAX_FILE_CHUNK);
                let (bytes, eof) = session(conn, &p.session)?.read_file(&p.path, p.host, p.offset, len).await?;
                Ok(FileData { data: Data::base64(&bytes), eof })
            })
            .await
        }
        FileWrite::NAME => {
            call::<FileWrite, _, _>(params, |p| async move {
                let bytes = p.data.to_bytes()?;
                if bytes.len() > MAX_FILE_CHUNK as usize {
                    return Err(ApiError::new(
                        ErrorCode::TooLarge,
                        format!(
                            "{} bytes in one write; at most {MAX_FILE_CHUNK} (write in chunks with offset)",
                            bytes.len()
                        ),
                    ));
                }
                let mode = match (p.offset, p.append) {
                    (Some(at), _) => WriteMode::At(at),
                    (None, true) => WriteMode::Append,
                    (None, false) => WriteMode::Truncate,
                };
                let s = session(conn, &p.session)?;
                let bytes = s.write_file(&p.path, p.host, &bytes, mode, p.create_dirs, p.permissions).await?;
                Ok(Written { bytes })
            })
            .await
        }
        FileStatMethod::NAME => {
            call::<FileStatMethod, _, _>(params, |p| async move {
                Ok(session(conn, &p.session)?.stat(&p.path, p.host).await?)
            })
            .await
        }
        FileList::NAME => {
            call::<FileList, _, _>(params, |p| async move {
                let (entries, truncated) = session(conn, &p.session)?.list_dir(&p.path, p.host, p.limit).await?;
                Ok(DirList { entries, truncated })
            })
            .await
        }
        ShadowDiff::NAME => {
            call::<ShadowDiff, _, _>(
                params,
                |p| async move { Ok(session(conn, &p.session)?.shadow_diff(&p.folder).await?) },
            )
            .await
        }
        ShadowApply::NAME => {
            call::<ShadowApply, _, _>(params, |p| async move {
                let s = session(conn, &p.session)?;
                Ok(s.shadow_apply(&p.folder, p.changeset.as_deref(), p.paths.as_deref()).await?)
            })
            .await
        }
        ShadowExport::NAME => {
            call::<ShadowExport, _, _>(params, |p| async move {
                let s = session(conn, &p.session)?;
                let dest = match p.dest {
                    Some(d) if d.is_absolute() => d,
                    Some(d) => return Err(ApiError::invalid_params(format!("dest {} is not absolute", d.display()))),
                    None => default_export_path(&s, &p.folder)?,
                };
                let bytes = s.shadow_export(&p.folder, &dest).await?;
                Ok(Exported { path: dest, bytes })
            })
            .await
        }
        ShadowReset::NAME => {
            call::<ShadowReset, _, _>(params, |p| async move {
                session(conn, &p.session)?.shadow_reset(&p.folder).await?;
                Ok(Done {})
            })
            .await
        }
        EventsSubscribe::NAME => call::<EventsSubscribe, _, _>(params, |p| async move { Ok(subscribe(conn, p)) }).await,
        EventsUnsubscribe::NAME => {
            call::<EventsUnsubscribe, _, _>(params, |p| async move {
                match conn.subscriptions.lock().unwrap().remove(&p.subscription) {
                    Some(subscription) => {
                        subscription.task.abort();
                        Ok(Done {})
                    }
                    None => Err(ApiError::new(ErrorCode::NotFound, format!("no subscription {}", p.subscription))),
                }
            })
            .await
        }
        ProcessStdin::NAME | ProcessCloseStdin::NAME | ProcessAck::NAME => {
            Outcome::from(Err(ApiError::internal(format!("{method} is applied in order by the reader"))))
        }
        other => Outcome::from(Err(ApiError::new(
            ErrorCode::MethodNotFound,
            format!("no method {other:?} (see `daemon.info`'s api_version and docs/ipc.md)"),
        ))),
    }
}

fn default_export_path(s: &Session, folder: &str) -> Result<PathBuf, ApiError> {
    let dir = s
        .storage_dir()
        .ok_or_else(|| ApiError::new(ErrorCode::Unsupported, "this session has no storage; pass dest"))?
        .join("shadow-exports");
    std::fs::create_dir_all(&dir)
        .map_err(|e| ApiError::new(ErrorCode::Io, format!("cannot create {}: {e}", dir.display())))?;
    Ok(dir.join(format!("{folder}-{}.tar", umbra_api::event::now_ms())))
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

/// Forwards lifecycle events (of one session, or all) to this client until it unsubscribes or
/// goes away. A client that reads too slowly loses the oldest events and is told how many.
fn subscribe(conn: &Arc<Connection>, p: SubscribeParams) -> Subscribed {
    let id = conn.new_subscription_id();
    let (mut rx, start) = conn.daemon.manager.subscribe_counted();
    // How far it has got: responses to this client wait for it (`Connection::respond`).
    let (position, position_rx) = tokio::sync::watch::channel(start);
    let weak = Arc::downgrade(conn);
    let task = tokio::spawn(async move {
        let mut at = start;
        loop {
            let event: SessionEvent = match rx.recv().await {
                Ok(e) => e,
                Err(tokio::sync::broadcast::error::RecvError::Lagged(count)) => {
                    let Some(conn) = weak.upgrade() else { return };
                    if !conn.notify(NOTIFY_LOST, umbra_api::rpc::EventsLost { count }).await {
                        return;
                    }
                    at += count;
                    position.send_replace(at);
                    continue;
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            };
            at += 1;
            if p.session.as_ref().is_none_or(|s| event.session.as_ref() == Some(s)) {
                let Some(conn) = weak.upgrade() else { return };
                if !conn.notify(NOTIFY_EVENT, &event).await {
                    return;
                }
            }
            position.send_replace(at);
        }
    });
    let subscription = Subscription { task: task.abort_handle(), position: position_rx };
    conn.subscriptions.lock().unwrap().insert(id, subscription);
    Subscribed { subscription: id }
}
