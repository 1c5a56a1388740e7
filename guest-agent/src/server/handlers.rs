//! Request handlers: validate, call into the process model or the file/system helpers, answer.
//! Quick requests are answered inline (ping stays prompt under load because nothing here waits
//! on a process); filesystem work runs on the blocking pool as its own task.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use umbra_proto::{
    json_frame, json_frame_with_attachment, ErrorBody, ErrorCode, Event, ExitStatus, FrameKind, Request, Response,
    ResponseBody, SpawnRequest,
};

use super::connection::{Connection, ConnectionError};
use crate::process::{self, landlock, spawn, StdinMsg};
use crate::shares::ShareError;
use crate::text::shown;
use crate::{files, system};

type Reply = Result<ResponseBody, ErrorBody>;

fn no_such_process(id: u32) -> ErrorBody {
    ErrorBody::new(ErrorCode::NoSuchProcess, format!("no live process with id {id}"))
}

fn share_error(e: ShareError) -> ErrorBody {
    ErrorBody::new(e.code(), crate::text::clip(e.to_string()))
}

/// The protocol's code for a failed spawn: a missing program (or working directory) is
/// `not_found`, one the caller may not run is `permission_denied`, anything else
/// `spawn_failed`.
fn spawn_error_code(e: &std::io::Error) -> ErrorCode {
    match e.raw_os_error() {
        Some(libc::ENOENT) => ErrorCode::NotFound,
        Some(libc::EACCES | libc::EPERM) => ErrorCode::PermissionDenied,
        _ => ErrorCode::SpawnFailed,
    }
}

fn parse_signal(signal: i32) -> Result<Signal, ErrorBody> {
    Signal::try_from(signal)
        .map_err(|_| ErrorBody::new(ErrorCode::BadRequest, format!("{signal} is not a signal number")))
}

impl Connection {
    pub(super) async fn dispatch(
        &self,
        id: u32,
        request: Request,
        attachment: Option<Bytes>,
    ) -> Result<(), ConnectionError> {
        let reply = match request {
            Request::Ping => Ok(ResponseBody::Pong { uptime_ms: self.agent.started.elapsed().as_millis() as u64 }),
            Request::Spawn(req) => return self.spawn(id, req).await,
            Request::CloseStdin { process } => self.with_process(process, |p| {
                let _ = p.stdin.send(StdinMsg::Close);
                Ok(ResponseBody::Done)
            }),
            Request::Kill { process, signal } => match parse_signal(signal) {
                // Each child leads its own process group; all of it is signalled.
                Ok(sig) => self.with_process(process, |p| {
                    p.kill(sig);
                    Ok(ResponseBody::Done)
                }),
                Err(e) => Err(e),
            },
            Request::KillAll { signal } => parse_signal(signal).map(|sig| {
                for p in self.processes.lock().unwrap().values() {
                    p.kill(sig);
                }
                // Also what left its process group (setsid daemons, a fork bomb's stragglers).
                if sig == Signal::SIGKILL {
                    process::cgroup::kill_all();
                }
                ResponseBody::Done
            }),
            Request::Resize { process, size } => self.with_process(process, |p| match &p.pty {
                Some(pty) => spawn::resize(&pty.raw_fd(), size)
                    .map(|_| ResponseBody::Done)
                    .map_err(|e| ErrorBody::new(ErrorCode::Io, format!("resize of process {process}: {e}"))),
                None => Err(ErrorBody::new(ErrorCode::Unsupported, format!("process {process} has no terminal"))),
            }),
            Request::Park { processes } => return self.park(id, processes).await,
            Request::Adopt { token } => return self.adopt(id, token).await,
            Request::ExecAnswer { check, allow } => match self.agent.exec_checks.answer(check, allow) {
                true => Ok(ResponseBody::Done),
                false => Err(ErrorBody::new(ErrorCode::NotFound, format!("no exec check {check} waits"))),
            },
            Request::DropParked => {
                for p in self.agent.parked.take_all() {
                    p.kill(Signal::SIGKILL);
                    // A pump waiting for credit must stop too, or its supervisor waits forever.
                    p.close_credits();
                    p.route.close().await;
                }
                Ok(ResponseBody::Done)
            }
            Request::Shutdown => {
                self.respond(id, Ok(ResponseBody::Done)).await?;
                self.agent.shutdown.notify_one();
                return Ok(());
            }
            blocking => return self.run_blocking(id, blocking, attachment).await,
        };
        self.respond(id, reply).await
    }

    fn with_process(&self, id: u32, f: impl FnOnce(&process::ProcessHandle) -> Reply) -> Reply {
        match self.processes.lock().unwrap().get(&id) {
            Some(p) => f(p),
            None => Err(no_such_process(id)),
        }
    }

    async fn respond(&self, id: u32, reply: Reply) -> Result<(), ConnectionError> {
        let response = match reply {
            Ok(body) => Response::Ok(body),
            Err(e) => Response::Error(e),
        };
        self.send(json_frame(FrameKind::Response, id, &response)).await
    }

    /// Spawns, then confirms: the response (the spawn confirmation) is queued before the output
    /// pumps start, so no output of the process can overtake it. fork+exec blocks until the child
    /// has exec'd (long on a slow filesystem), so it runs on the blocking pool; the reader awaits
    /// it, which keeps this connection's frames in order (stdin, credit or kill for this id come
    /// after the process is in the table) and stalls nothing else.
    async fn spawn(&self, id: u32, req: SpawnRequest) -> Result<(), ConnectionError> {
        let argv0 = shown(req.argv.first().map(String::as_str).unwrap_or(""));
        let cwd = req.cwd.as_deref().map(|c| format!(" in {}", shown(c))).unwrap_or_default();
        if let Some(c) = req.cwd.as_deref().filter(|c| !Path::new(c).is_absolute()) {
            let err =
                ErrorBody::new(ErrorCode::BadRequest, format!("cannot run {argv0}: cwd {} is not absolute", shown(c)));
            return self.respond(id, Err(err)).await;
        }
        let reaper = self.agent.reaper.clone();
        // Fixed at spawn: shares added later do not restrict this process.
        let protected = self.agent.shares.protected_paths();
        let started = Instant::now();
        // The gate's server runs before the fork: the child's own exec waits on it.
        let (route_tx, route_rx) = tokio::sync::watch::channel(None);
        let handoff = match &req.exec_gate {
            None => None,
            Some(gate) => match process::gate::Handoff::new() {
                Ok(handoff) => {
                    let served = process::gate::Served {
                        gate: gate.clone(),
                        approved: req.argv.clone(),
                        route: route_rx,
                        checks: self.agent.exec_checks.clone(),
                        answered: Default::default(),
                    };
                    tokio::spawn(process::gate::serve(handoff.agent, served));
                    Some(handoff.child)
                }
                Err(e) => {
                    let err =
                        ErrorBody::new(ErrorCode::SpawnFailed, format!("cannot run {argv0}{cwd}: exec gate: {e}"));
                    return self.respond(id, Err(err)).await;
                }
            },
        };
        let spawned = tokio::task::spawn_blocking(move || {
            let ruleset = landlock::deny_removal_beneath(&protected)
                .map_err(|e| (ErrorCode::SpawnFailed, std::io::Error::other(e.to_string())))?;
            let gate = handoff.as_ref().map(|h| h.as_raw_fd());
            // `handoff` closes at the end of this closure: the child has its own copy.
            spawn::spawn(&reaper, &req, ruleset.as_ref(), gate).map_err(|e| {
                // The cwd is looked up first: a missing cwd is not a missing program (hosts
                // turn not_found into "command not found").
                let cwd_missing = req.cwd.as_deref().is_some_and(|c| std::fs::metadata(c).is_err());
                (if cwd_missing { ErrorCode::SpawnFailed } else { spawn_error_code(&e) }, e)
            })
        });
        let child = match spawned.await {
            Ok(Ok(child)) => child,
            Ok(Err((code, e))) => {
                let err = ErrorBody::new(code, format!("cannot run {argv0}{cwd}: {e}"));
                return self.respond(id, Err(err)).await;
            }
            Err(e) => {
                let err = ErrorBody::new(ErrorCode::SpawnFailed, format!("cannot run {argv0}{cwd}: spawn task: {e}"));
                return self.respond(id, Err(err)).await;
            }
        };
        let pid = child.pid;
        let kill_group = || {
            let _ = killpg(Pid::from_raw(pid as i32), Signal::SIGKILL);
        };
        if let Err(e) = self.respond(id, Ok(ResponseBody::Spawned { pid })).await {
            // Nobody will ever hear of this process: do not leave it running unsupervised.
            kill_group();
            return Err(e);
        }

        let agent = self.agent.clone();
        let on_exit = move || {
            agent.live_processes.fetch_sub(1, Ordering::AcqRel);
        };
        let supervised = {
            // Holding the table lock across supervise+insert means the exit (which removes the
            // entry) cannot happen before the entry exists, however fast the child is.
            let mut processes = self.processes.lock().unwrap();
            process::supervise(self.target(id), child, self.output_chunk, on_exit).map(|handle| {
                self.agent.live_processes.fetch_add(1, Ordering::AcqRel);
                // Its gate's checks go where its frames go from now on.
                let _ = route_tx.send(Some(handle.route.clone()));
                processes.insert(id, handle);
            })
        };
        if let Err(e) = supervised {
            // Cannot watch its stdio (fd exhaustion): do not leave it running unobserved, and
            // end the process for the host too — it was confirmed, so it expects an exit.
            kill_group();
            tracing::error!("process {id}: cannot supervise: {e}");
            let message = format!("cannot watch the stdio of process {id} (pid {pid}): {e}; killed it");
            self.send(json_frame(FrameKind::Event, id, &Event::Error { message })).await?;
            let status = ExitStatus {
                code: None,
                signal: Some(Signal::SIGKILL as i32),
                duration_ms: started.elapsed().as_millis() as u64,
            };
            self.send(json_frame(FrameKind::Event, id, &Event::Exit(status))).await?;
        }
        Ok(())
    }

    /// Where process `id` of this connection sends its frames; its exit takes it out of the
    /// table.
    fn target(&self, id: u32) -> process::Target {
        let table = Arc::downgrade(&self.processes);
        process::Target::new(self.sink.clone(), id, move || {
            if let Some(table) = table.upgrade() {
                table.lock().unwrap().remove(&id);
            }
        })
    }

    /// Parks the named processes (`route.rs`); answers once each is parked, so whatever they
    /// sent before is ahead of the answer.
    async fn park(&self, id: u32, ids: Vec<u32>) -> Result<(), ConnectionError> {
        let mut parked = Vec::new();
        for process in ids {
            let Some(handle) = self.processes.lock().unwrap().remove(&process) else { continue };
            // One whose exit already went out has nothing left to send.
            if !handle.route.park().await {
                continue;
            }
            parked.push(umbra_proto::ParkedProcess { process, token: self.agent.parked.insert(handle) });
        }
        self.respond(id, Ok(ResponseBody::Parked { processes: parked })).await
    }

    /// Takes a parked process over as process `id` of this connection.
    async fn adopt(&self, id: u32, token: u64) -> Result<(), ConnectionError> {
        let Some(handle) = self.agent.parked.take(token) else {
            let err = ErrorBody::new(ErrorCode::NotFound, format!("no process is parked with token {token}"));
            return self.respond(id, Err(err)).await;
        };
        // Answered before any frame of its can go out on this connection (it has no target yet).
        if let Err(e) = self.respond(id, Ok(ResponseBody::Spawned { pid: handle.pid })).await {
            self.agent.parked.insert_back(token, handle);
            return Err(e);
        }
        let route = handle.route.clone();
        let to = self.target(id);
        // In the table before it has a target here: its exit removes it from there.
        self.processes.lock().unwrap().insert(id, handle);
        let processes = self.processes.clone();
        route
            .adopt(to, || {
                if let Some(p) = processes.lock().unwrap().get(&id) {
                    p.reset_credits();
                }
            })
            .await;
        Ok(())
    }

    async fn run_blocking(&self, id: u32, request: Request, attachment: Option<Bytes>) -> Result<(), ConnectionError> {
        // Waiting here (in the reader) is the backpressure on a host that pipelines requests.
        let permit = self.blocking.clone().acquire_owned().await.expect("the semaphore is never closed");
        self.in_flight.lock().unwrap().insert(id);
        let sink = self.sink.clone();
        let in_flight = self.in_flight.clone();
        let live = self.agent.live_processes.load(Ordering::Acquire);
        let uptime_ms = self.agent.started.elapsed().as_millis() as u64;
        let agent = self.agent.clone();
        tokio::spawn(async move {
            let frame = tokio::task::spawn_blocking(move || {
                let reply = match request {
                    Request::Stats => Ok(ResponseBody::Stats(system::stats(live, uptime_ms))),
                    Request::Listening => Ok(ResponseBody::Listening {
                        ports: crate::net::who::listening(std::path::Path::new("/proc"), std::process::id()),
                    }),
                    Request::ReadFile { path, offset, len } => match files::read(&path, offset, len) {
                        Ok((data, eof)) => {
                            let body = ResponseBody::FileData { len: data.len() as u32, eof };
                            return json_frame_with_attachment(FrameKind::Response, id, &Response::Ok(body), &data);
                        }
                        Err(e) => Err(e),
                    },
                    Request::WriteFile(req) => files::write(&req, attachment.as_deref().unwrap_or_default())
                        .map(|bytes| ResponseBody::Written { bytes }),
                    Request::Stat { path } => files::stat(&path).map(ResponseBody::Stat),
                    Request::ListDir { path, limit } => files::list(&path, limit)
                        .map(|(entries, truncated)| ResponseBody::DirList { entries, truncated }),
                    Request::Mount(req) => system::mount_fs(&req).map(|_| ResponseBody::Done),
                    Request::Unmount { path } => system::unmount(&path).map(|_| ResponseBody::Done),
                    Request::Share(req) => agent
                        .shares
                        .share(&req.session, &req.name, req.mode)
                        .map(|path| ResponseBody::Shared { path: path.to_string_lossy().into_owned() })
                        .map_err(share_error),
                    Request::Unshare { session, name } => {
                        agent.shares.unshare(&session, &name).map(|_| ResponseBody::Done).map_err(share_error)
                    }
                    Request::ShadowDiff { session, name } => agent
                        .shares
                        .shadow_diff(&session, &name)
                        .map(|(changes, truncated)| ResponseBody::ShadowDiff { changes, truncated })
                        .map_err(share_error),
                    Request::ShadowReset { session, name } => {
                        agent.shares.shadow_reset(&session, &name).map(|_| ResponseBody::Done).map_err(share_error)
                    }
                    Request::InstallCa { pem } => {
                        crate::trust::install_ca(&pem, agent.pid1).map(|()| ResponseBody::Done)
                    }
                    Request::Reidentify(req) => {
                        crate::identity::reidentify(&req, attachment.as_deref().unwrap_or_default(), agent.pid1)
                            .map(|_| ResponseBody::Done)
                    }
                    other => Err(ErrorBody::new(
                        ErrorCode::Unsupported,
                        format!("{} is not a blocking request", other.method()),
                    )),
                };
                let response = match reply {
                    Ok(body) => Response::Ok(body),
                    Err(e) => Response::Error(e),
                };
                json_frame(FrameKind::Response, id, &response)
            })
            .await
            .unwrap_or_else(|e| {
                // The handler panicked: the host still gets an answer rather than silence.
                let err = ErrorBody::new(ErrorCode::Io, format!("request {id} failed: {e}"));
                json_frame(FrameKind::Response, id, &Response::Error(err))
            });
            let _ = sink.send(frame.into()).await;
            in_flight.lock().unwrap().remove(&id);
            drop(permit);
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spawn_errors_map_to_codes() {
        let code = |errno| spawn_error_code(&std::io::Error::from_raw_os_error(errno));
        assert_eq!(code(libc::ENOENT), ErrorCode::NotFound);
        assert_eq!(code(libc::EACCES), ErrorCode::PermissionDenied);
        assert_eq!(code(libc::EPERM), ErrorCode::PermissionDenied);
        assert_eq!(code(libc::ENOEXEC), ErrorCode::SpawnFailed);
        assert_eq!(spawn_error_code(&std::io::Error::other("landlock")), ErrorCode::SpawnFailed);
    }
}
