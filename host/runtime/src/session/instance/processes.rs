//! A session's processes: spawn (through the approval gate when the session has one), signals,
//! and the network policy their connections follow.

use std::sync::Arc;

use umbra_api::{ApiError, EventKind};

use super::Session;
use crate::session::error::SessionError;
use crate::session::exec::{self, Exec, ExecControl, ExecRequest, PumpContext};

impl Session {
    /// Starts a process; returns once the guest confirmed it (or refused: a missing command is
    /// [`umbra_api::ErrorCode::NotFound`]).
    pub async fn spawn(self: &Arc<Self>, req: ExecRequest) -> Result<Exec, SessionError> {
        self.spawn_with(req, false).await
    }

    /// [`Self::spawn`]; `kept`: a process the session keeps (`kept.rs`), which a suspension
    /// parks in the guest and the restore adopts again.
    pub(super) async fn spawn_with(self: &Arc<Self>, req: ExecRequest, kept: bool) -> Result<Exec, SessionError> {
        self.touch();
        if req.argv.is_empty() || req.argv[0].is_empty() {
            return Err(SessionError::InvalidArgument("argv must name a command".into()));
        }
        self.approve(crate::session::approval::command_line(&req.argv), req.cwd.as_deref(), &req.env).await?;
        let inc = self.running("run a process").await?;
        // An OCI image's config sets defaults, as `docker exec` applies them: its `Env` under
        // everything else, its `WorkingDir` and `User` unless the request names its own cwd.
        let image = inc.image.as_ref();
        let mut env: std::collections::BTreeMap<String, String> = image
            .map(|i| i.env.iter().filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.into(), v.into())).collect())
            .unwrap_or_default();
        // Each secret as its placeholder; the request's own variables win.
        env.extend(self.secrets.read().unwrap().env());
        if !self.ssh_keys.read().unwrap().is_empty() {
            // The guest agent's socket, which carries each connection to the keys on the host.
            env.insert("SSH_AUTH_SOCK".into(), umbra_proto::egress::SSH_AGENT_SOCKET.into());
        }
        env.extend(req.env.clone());
        let spawn = umbra_proto::SpawnRequest {
            argv: req.argv.clone(),
            cwd: req.cwd.clone().or_else(|| image.and_then(|i| i.working_dir.clone())),
            env,
            uid: image.map(|i| i.uid).filter(|uid| *uid != 0),
            gid: image.map(|i| i.gid).filter(|_| image.is_some_and(|i| i.uid != 0 || i.gid != 0)),
            tty: req.tty,
            exec_gate: self.exec_gate(&inc.agent)?,
        };
        let mut process = inc.agent.spawn(spawn)?;
        let id = self.ctx.next_process_id();
        let pid = match process.next_event().await {
            Some(crate::agent::ProcessEvent::Spawned { pid }) => pid,
            Some(crate::agent::ProcessEvent::SpawnFailed(e)) => {
                let error = SessionError::Agent(crate::agent::ClientError::Agent(e));
                self.emit(EventKind::SpawnFailed {
                    process: id,
                    error: ApiError::new(error.code(), error.to_string()),
                });
                return Err(error);
            }
            Some(crate::agent::ProcessEvent::Error(msg)) => {
                return Err(SessionError::Agent(crate::agent::ClientError::ConnectionLost(msg)))
            }
            _ => return Err(SessionError::Agent(crate::agent::ClientError::ConnectionLost("no spawn reply".into()))),
        };
        let weak = Arc::downgrade(self);
        let ctx = PumpContext {
            session: self.name.clone(),
            bus: self.ctx.bus.clone(),
            ended: inc.ended_receiver(),
            on_exit: Box::new(move || {
                if let Some(me) = weak.upgrade() {
                    me.state.lock().unwrap().processes.remove(&id);
                    me.touch();
                }
            }),
        };
        let argv = req.argv.clone();
        let (rebind, rebound) = match kept {
            true => {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                (Some(tx), Some(rx))
            }
            false => (None, None),
        };
        let mut exec = exec::start(id, pid, req.argv, process, inc.agent.clone(), req.timeout, ctx, rebound);
        if kept {
            let weak = Arc::downgrade(self);
            exec = exec.waking(Arc::new(move || {
                let weak = weak.clone();
                Box::pin(async move {
                    match weak.upgrade() {
                        Some(session) => session.wake().await,
                        None => Ok(()),
                    }
                })
            }));
        }
        let running = super::Running { control: exec.control(), pid, argv, rebind, parked: None, pending_stdin: None };
        self.state.lock().unwrap().processes.insert(id, running);
        Ok(exec)
    }

    /// Asks the session's approval gate, when it has one, about `command` (a shell command line).
    pub(super) async fn approve(
        &self,
        command: String,
        cwd: Option<&str>,
        env: &std::collections::BTreeMap<String, String>,
    ) -> Result<(), SessionError> {
        let approval = self.state.lock().unwrap().record.settings.approval.clone();
        let Some(settings) = approval else { return Ok(()) };
        let inc = self.running("run a process").await?;
        let (workspace, writable, contained) = {
            let folders = inc.folder_infos.lock().unwrap();
            let workspace = folders
                .iter()
                .filter(|f| f.name != crate::share::paths::UPLOADS)
                .map(|f| std::path::PathBuf::from(&f.guest_path))
                .collect();
            // Folders whose changes reach the host at once (shadow ones wait for a review).
            let writable = folders
                .iter()
                .filter(|f| matches!(f.mode, umbra_proto::ShareMode::Rw | umbra_proto::ShareMode::Rwd))
                .map(|f| std::path::PathBuf::from(&f.guest_path))
                .collect();
            (workspace, writable, self.contained(&folders))
        };
        let request = umbra_policy::approval::CommandRequest {
            command,
            cwd: cwd.unwrap_or("/").into(),
            workspace,
            session: Some(self.name.clone()),
            env: env.clone(),
            writable,
            contained,
        };
        let allow_from_now = self.ctx.approvals.check(&settings, request, |kind| self.emit(kind)).await?;
        if !allow_from_now.is_empty() {
            // `allow_always`: the session's allow list grows (kept in its record).
            let mut state = self.state.lock().unwrap();
            if let Some(approval) = &mut state.record.settings.approval {
                for pattern in allow_from_now {
                    if !approval.allow.contains(&pattern) && approval.allow.len() < umbra_policy::approval::MAX_RULES {
                        approval.allow.push(pattern);
                    }
                }
            }
            drop(state);
            self.persist();
        }
        Ok(())
    }

    /// The exec gate a spawn gets with approval scope `guest`: what the guest agent lets
    /// through without asking (the allow list, when the rules alone would allow what it
    /// matches: not in mode ask-every-time, nor with hooks) and the deny list; the checks it
    /// sends are answered by [`Self::serve_exec_checks`].
    fn exec_gate(&self, agent: &crate::agent::AgentClient) -> Result<Option<umbra_proto::ExecGate>, SessionError> {
        use umbra_policy::approval::{ApprovalMode, ApprovalScope};
        let approval = self.state.lock().unwrap().record.settings.approval.clone();
        let Some(settings) = approval.filter(|a| a.scope == ApprovalScope::Guest) else { return Ok(None) };
        if !agent.gates_execs() {
            return Err(SessionError::Unsupported(
                "approval scope guest: this guest's agent cannot check execs (protocol before 1.9)".into(),
            ));
        }
        self.serve_exec_checks(agent);
        let local = settings.mode != ApprovalMode::AskEveryTime && settings.hooks.is_empty();
        let allow = if local { settings.allow } else { Vec::new() };
        Ok(Some(umbra_proto::ExecGate { allow, deny: settings.deny }))
    }

    /// Answers the exec checks of `agent`'s processes (once per connection: later calls find
    /// the checks taken): each is a command for the approval gate, as the guest asked it —
    /// the program by [`umbra_proto::exec_gate::exec_words`], the caller's cwd, no variables.
    pub(super) fn serve_exec_checks(&self, agent: &crate::agent::AgentClient) {
        let Some(mut checks) = agent.exec_checks() else { return };
        let (me, agent) = (self.me.clone(), agent.clone());
        tokio::spawn(async move {
            while let Some(check) = checks.recv().await {
                let Some(session) = me.upgrade() else { return };
                let agent = agent.clone();
                tokio::spawn(async move {
                    let words = umbra_proto::exec_gate::exec_words(&check.path, &check.argv);
                    let command = crate::session::approval::command_line(&words);
                    let verdict = session.approve(command, check.cwd.as_deref(), &Default::default()).await;
                    if let Err(e) = &verdict {
                        tracing::info!("session {}: exec of {} refused: {e}", session.name, check.path);
                    }
                    // The guest may be gone meanwhile; its exec then needs no answer.
                    let _ = agent.exec_answer(check.check, verdict.is_ok()).await;
                });
            }
        });
    }

    /// How the session's sandbox contains any command, if it does (approval mode `auto`): no
    /// network, `.git` read-only, and every folder of the user's read-only or shadow (a host
    /// folder a command can change directly is not contained).
    fn contained(&self, folders: &[umbra_api::FolderInfo]) -> Option<String> {
        use umbra_proto::ShareMode;
        let settings = self.settings();
        let user =
            folders.iter().filter(|f| f.name != crate::share::paths::UPLOADS && f.name != crate::share::paths::OUTPUTS);
        let contained = settings.network.mode == umbra_api::session::NetworkMode::None
            && settings.policy.effective().block_git_writes
            && user.clone().all(|f| matches!(f.mode, ShareMode::Ro | ShareMode::Shadow));
        contained.then(|| "no network, .git read-only, every workspace folder read-only or shadow".to_string())
    }

    /// A running process of this session.
    pub fn process(&self, id: u64) -> Result<ExecControl, SessionError> {
        self.touch();
        self.state.lock().unwrap().processes.get(&id).map(|r| r.control.clone()).ok_or(SessionError::NoSuchProcess(id))
    }

    /// Signals every process of the session.
    pub async fn kill_all(&self, signal: i32) -> Result<(), SessionError> {
        self.touch();
        let inc = self.running("signal its processes").await?;
        Ok(inc.agent.kill_all(signal).await?)
    }

    /// Holds the recorded settings (and the network policy in force) to the system policy.
    pub(in crate::session) fn hold_to_system_policy(&self) {
        let mut state = self.state.lock().unwrap();
        let before = state.record.settings.clone();
        self.ctx.cap(&mut state.record.settings);
        if state.record.settings == before {
            return;
        }
        *self.network.write().unwrap() = crate::egress::Policy::new(&state.record.settings.network);
        drop(state);
        self.persist();
    }

    /// Replaces the network policy: new connections of the running VM follow it at once (open
    /// ones are not cut), and it is kept for restarts and resumes. It can only move within the
    /// session's merged policy (the daemon's configuration merged with the start's): when that
    /// policy says something about the network, a policy allowing more — a wider mode, a domain
    /// or range it does not allow — is refused, naming the ceiling, and nothing changes.
    pub fn set_network(&self, policy: umbra_api::session::NetworkPolicy) -> Result<(), SessionError> {
        self.touch();
        policy.validate().map_err(SessionError::InvalidArgument)?;
        let mut state = self.state.lock().unwrap();
        if let Some(ceiling) = &state.record.settings.policy.network {
            if let Some(excess) = umbra_policy::network_excess(&policy, ceiling) {
                return Err(SessionError::BeyondPolicy {
                    name: self.name.clone(),
                    wanted: format!("network {}", umbra_policy::describe_network(&policy)),
                    ceiling: format!("network {}", umbra_policy::describe_network(ceiling)),
                    excess,
                });
            }
        }
        // Under the state lock: two concurrent changes land in one order, record and proxy alike.
        *self.network.write().unwrap() = crate::egress::Policy::new(&policy);
        state.record.settings.network = policy;
        drop(state);
        self.persist();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::instance::test_support::stopped_session;
    use umbra_api::session::{NetworkMode, NetworkPolicy};

    fn exec(argv: &[&str]) -> ExecRequest {
        ExecRequest { argv: argv.iter().map(|a| a.to_string()).collect(), ..Default::default() }
    }

    #[tokio::test]
    async fn a_spawn_needs_a_command_and_a_running_session() {
        let dir = tempfile::tempdir().unwrap();
        let session = stopped_session(dir.path(), "s", Default::default(), Vec::new());
        for argv in [&[][..], &[""][..]] {
            let e = session.spawn(exec(argv)).await.unwrap_err();
            assert!(matches!(e, SessionError::InvalidArgument(_)), "{argv:?}: {e}");
        }
        let e = session.spawn(exec(&["true"])).await.unwrap_err();
        assert!(matches!(e, SessionError::InvalidState { .. }), "{e}");
        assert!(matches!(session.process(7), Err(SessionError::NoSuchProcess(7))));
        assert!(matches!(session.kill_all(9).await.unwrap_err(), SessionError::InvalidState { .. }));
    }

    #[test]
    fn the_network_moves_only_within_the_policys_ceiling() {
        let dir = tempfile::tempdir().unwrap();
        let (settings, ceiling) = crate::session::instance::test_support::example_com_ceiling();
        let session = stopped_session(dir.path(), "s", settings, Vec::new());

        let wider = NetworkPolicy { mode: NetworkMode::Any, ..Default::default() };
        let e = session.set_network(wider).unwrap_err();
        assert!(matches!(e, SessionError::BeyondPolicy { .. }), "{e}");
        assert_eq!(session.settings().network, NetworkPolicy::default(), "nothing changed");

        let bad = NetworkPolicy { allow_domains: vec!["not a domain".into()], ..ceiling.clone() };
        assert!(matches!(session.set_network(bad).unwrap_err(), SessionError::InvalidArgument(_)));

        session.set_network(ceiling.clone()).unwrap();
        assert_eq!(session.settings().network, ceiling);
        assert!(
            session.network.read().unwrap().decide_name("example.com").is_ok(),
            "the proxy's policy follows at once"
        );
    }
}
