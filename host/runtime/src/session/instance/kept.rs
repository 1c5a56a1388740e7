//! The processes a session keeps when their client goes, and its terminals: starting them,
//! finding them, listing them, and forgetting finished ones after a while (`../kept.rs` keeps
//! their output).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use umbra_api::kept::{ProcessInfo, TerminalInfo, KEEP_FINISHED_SECS, MAX_KEPT};

use super::Session;
use crate::agent::{ClientError, ProcessEvent};
use crate::session::error::SessionError;
use crate::session::exec::Adopted;
use crate::session::exec::ExecRequest;
use crate::session::incarnation::Incarnation;
use crate::session::kept::{Kept, TerminalRequest, MAX_RUN_COMMAND};

/// A terminal's shell when none is named: bash as a login shell where the image has it, else
/// the image's sh (busybox's in the minimal image).
const DEFAULT_SHELL: &[&str] =
    &["/bin/sh", "-c", "if command -v bash >/dev/null 2>&1; then exec bash -l; fi; exec sh -l"];
const SIGHUP: i32 = 1;
/// How long the guest may take to hand a parked process over.
const ADOPT_WAIT: Duration = Duration::from_secs(10);

impl Session {
    /// Starts a process the session keeps when its client goes.
    pub async fn spawn_kept(self: &Arc<Self>, req: ExecRequest) -> Result<Arc<Kept>, SessionError> {
        let slot = self.reserve_kept()?;
        let argv = req.argv.clone();
        let exec = self.spawn_with(req, true).await?;
        Ok(slot.fill(Kept::start(exec, argv, None)))
    }

    /// Opens a terminal: a login shell on a pseudo-terminal, kept like a detached process.
    pub async fn open_terminal(self: &Arc<Self>, req: TerminalRequest) -> Result<Arc<Kept>, SessionError> {
        if req.size.rows == 0 || req.size.cols == 0 {
            return Err(SessionError::InvalidArgument("a terminal needs at least one row and one column".into()));
        }
        let slot = self.reserve_kept()?;
        let argv = if req.shell.is_empty() { DEFAULT_SHELL.iter().map(|a| a.to_string()).collect() } else { req.shell };
        let mut env = req.env;
        // What a terminal emulator (xterm.js, a real one) understands; `terminal.run`'s own
        // lines stay out of the history.
        env.entry("TERM".into()).or_insert_with(|| "xterm-256color".into());
        env.entry("HISTCONTROL".into()).or_insert_with(|| "ignorespace".into());
        let exec = self
            .spawn_with(ExecRequest { argv: argv.clone(), cwd: req.cwd, env, tty: Some(req.size), timeout: None }, true)
            .await?;
        Ok(slot.fill(Kept::start(exec, argv, Some(req.size))))
    }

    /// A kept process (running, or finished less than `KEEP_FINISHED_SECS` ago).
    pub fn kept_process(&self, id: u64) -> Result<Arc<Kept>, SessionError> {
        self.touch();
        let mut state = self.state.lock().unwrap();
        forget_expired(&mut state.kept);
        match state.kept.get(&id) {
            Some(k) => Ok(k.clone()),
            None if state.processes.contains_key(&id) => Err(SessionError::InvalidArgument(format!(
                "process {id} was not spawned with detach: only its own client receives its output"
            ))),
            None => Err(SessionError::NoSuchProcess(id)),
        }
    }

    /// A terminal of the session.
    pub fn terminal(&self, id: u64) -> Result<Arc<Kept>, SessionError> {
        match self.kept_process(id) {
            Ok(k) if k.is_terminal() => Ok(k),
            _ => Err(SessionError::NoSuchTerminal(id)),
        }
    }

    /// Runs a command line in a terminal's shell (through the approval gate, when the session
    /// has one); its exit status and the shell's working directory after it. `timeout` covers
    /// the whole run (the command runs on).
    pub async fn terminal_run(
        &self,
        id: u64,
        command: &str,
        timeout: Option<Duration>,
    ) -> Result<(i32, String), SessionError> {
        let terminal = self.terminal(id)?;
        if command.len() > MAX_RUN_COMMAND {
            return Err(SessionError::InvalidArgument(format!(
                "the command is {} bytes; terminal.run takes at most {MAX_RUN_COMMAND}",
                command.len()
            )));
        }
        self.approve(command.to_string(), terminal.last_cwd().as_deref(), &BTreeMap::new()).await?;
        let _slot = terminal.begin_run()?;
        let nonce = crate::session::kept::nonce(id);
        let path = format!("/run/umbra/terminal-run-{nonce}");
        let run = async {
            let mode = umbra_proto::WriteMode::Truncate;
            self.write_file(&path, false, command.as_bytes(), mode, false, Some(0o600)).await?;
            terminal.run_script(&path, &nonce).await
        };
        match timeout {
            None => run.await,
            Some(t) => tokio::time::timeout(t, run).await.map_err(|_| {
                SessionError::Timeout(format!(
                    "the command did not finish in {}s (it may still be running in terminal {id})",
                    t.as_secs()
                ))
            })?,
        }
    }

    /// Closes a terminal: SIGHUP to its shell's process group, SIGKILL if it has not ended
    /// `KILL_GRACE` later.
    pub fn close_terminal(&self, id: u64) -> Result<(), SessionError> {
        let terminal = self.terminal(id)?;
        if terminal.exit().is_none() {
            terminal.control().interrupt(SIGHUP);
        }
        Ok(())
    }

    /// Every running process, and the kept ones that finished less than `KEEP_FINISHED_SECS`
    /// ago.
    pub fn process_list(&self) -> Vec<ProcessInfo> {
        self.touch();
        let mut state = self.state.lock().unwrap();
        forget_expired(&mut state.kept);
        let mut list: BTreeMap<u64, ProcessInfo> = state
            .processes
            .iter()
            .map(|(&process, r)| {
                let info = ProcessInfo {
                    process,
                    pid: r.pid,
                    argv: r.argv.clone(),
                    detached: false,
                    terminal: false,
                    exit: None,
                    stdout: None,
                    stderr: None,
                };
                (process, info)
            })
            .collect();
        for k in state.kept.values() {
            let (stdout, stderr) = k.ranges();
            list.insert(
                k.id(),
                ProcessInfo {
                    process: k.id(),
                    pid: k.pid(),
                    argv: k.argv().to_vec(),
                    detached: true,
                    terminal: k.is_terminal(),
                    exit: k.exit(),
                    stdout: Some(stdout),
                    stderr: Some(stderr),
                },
            );
        }
        list.into_values().collect()
    }

    /// The session's terminals, open or closed less than `KEEP_FINISHED_SECS` ago.
    pub fn terminal_list(&self) -> Vec<TerminalInfo> {
        self.touch();
        let mut state = self.state.lock().unwrap();
        forget_expired(&mut state.kept);
        state.kept.values().filter(|k| k.is_terminal()).map(|k| k.terminal_info()).collect()
    }

    /// Parks the running kept processes in the guest before a snapshot: their pumps wait for
    /// the restore to adopt them ([`Self::adopt_kept`]). An agent before protocol 1.8 cannot
    /// park: they end with the VM, as other processes do.
    pub(super) async fn park_kept(&self, inc: &Incarnation) {
        let kept: Vec<(u32, u64, super::super::exec::ExecControl)> = {
            let state = self.state.lock().unwrap();
            let kept = state.processes.iter().filter(|(_, r)| r.rebind.is_some() && r.parked.is_none());
            kept.map(|(&id, r)| (r.control.proto_id(), id, r.control.clone())).collect()
        };
        if kept.is_empty() || !inc.agent.parks() {
            return;
        }
        // Stdin stops first: the agent drops what reaches a parked process, so nothing may
        // follow the park request. What was queued and not sent goes to the adopted process.
        for (_, id, control) in &kept {
            let pending = control.detach_stdin().await;
            if let Some(r) = self.state.lock().unwrap().processes.get_mut(id) {
                r.pending_stdin = Some(pending);
            }
        }
        let ids: HashMap<u32, u64> = kept.iter().map(|(proto, id, _)| (*proto, *id)).collect();
        let asked: Vec<u32> = ids.keys().copied().collect();
        match inc.agent.park(&asked).await {
            Ok(parked) => {
                let mut state = self.state.lock().unwrap();
                for p in parked {
                    if let Some(r) = ids.get(&p.process).and_then(|id| state.processes.get_mut(id)) {
                        r.parked = Some(p.token);
                    }
                }
            }
            Err(e) => {
                tracing::warn!(session = %self.name, "cannot park its kept processes ({e}): they end with the VM")
            }
        }
        // One the agent did not park runs on where it is (the VM may too, if the snapshot
        // fails): its stdin goes on there.
        for (_, id, control) in &kept {
            let pending = {
                let mut state = self.state.lock().unwrap();
                match state.processes.get_mut(id) {
                    Some(r) if r.parked.is_none() => r.pending_stdin.take(),
                    _ => None,
                }
            };
            if let Some(pending) = pending {
                control.reattach_stdin(pending).await;
            }
        }
    }

    /// Adopts the parked kept processes on `inc`'s agent (the restored VM's; the same VM's when
    /// the snapshot failed), then has the guest kill whatever else is parked there (a fork's
    /// copies of its source's). One the guest does not give back ends as lost, saying so.
    pub(super) async fn adopt_kept(&self, inc: &Incarnation) {
        if !inc.agent.parks() {
            self.release_kept("the restored guest's agent cannot hand processes over (protocol before 1.8)");
            return;
        }
        // Exec checks of the adopted processes come on the new connection.
        self.serve_exec_checks(&inc.agent);
        let parked: Vec<(u64, u64)> = {
            let state = self.state.lock().unwrap();
            state.processes.iter().filter_map(|(&id, r)| r.parked.map(|token| (id, token))).collect()
        };
        // Every adoption asked at once, all answered within one deadline.
        let deadline = tokio::time::Instant::now() + ADOPT_WAIT;
        let asked: Vec<_> = parked.into_iter().map(|(id, token)| (id, inc.agent.adopt(token))).collect();
        for (id, asked) in asked {
            let adopted = async {
                let mut process = asked?;
                match tokio::time::timeout_at(deadline, process.next_event()).await {
                    Ok(Some(ProcessEvent::Spawned { .. })) => Ok(process),
                    Ok(Some(ProcessEvent::SpawnFailed(e))) => Err(ClientError::Agent(e)),
                    Ok(_) => Err(ClientError::ConnectionLost("no answer to the adoption".into())),
                    Err(_) => Err(ClientError::Timeout(ADOPT_WAIT)),
                }
            }
            .await;
            // What its stdin had not sent before the park goes first, ahead of any new write
            // (those wait for the rebind below).
            let pending = self.state.lock().unwrap().processes.get_mut(&id).and_then(|r| r.pending_stdin.take());
            if let (Ok(process), Some(pending)) = (&adopted, pending) {
                let bytes = pending.bytes();
                if let Err(e) = pending.requeue(&process.stdin()).await {
                    tracing::warn!(session = %self.name, "{bytes} bytes of stdin not passed on to an adopted process: {e}");
                }
            }
            let mut state = self.state.lock().unwrap();
            let Some(r) = state.processes.get_mut(&id) else { continue };
            r.parked = None;
            match adopted {
                Ok(process) => {
                    r.control.rebind(&process, inc.agent.clone());
                    if let Some(rebind) = &r.rebind {
                        let _ = rebind.send(Ok(Adopted { process, ended: inc.ended_receiver() }));
                    }
                }
                Err(e) => {
                    if let Some(rebind) = r.rebind.take() {
                        let _ = rebind.send(Err(format!("the restored guest did not give it back: {e}")));
                    }
                }
            }
        }
        if let Err(e) = inc.agent.drop_parked().await {
            tracing::warn!(session = %self.name, "cannot end the guest's other parked processes: {e}");
        }
    }

    /// Ends the kept processes parked in a snapshot that will not be restored, saying `why`.
    pub(super) fn release_kept(&self, why: &str) {
        let mut state = self.state.lock().unwrap();
        for r in state.processes.values_mut() {
            if r.parked.take().is_some() {
                if let Some(rebind) = r.rebind.take() {
                    let _ = rebind.send(Err(why.to_string()));
                }
            }
        }
    }

    /// Takes one of the session's [`MAX_KEPT`] places for a kept process (forgetting expired
    /// finished ones, then the one that finished longest ago); refuses when all are running or
    /// being started. The place is given back unless filled.
    fn reserve_kept(&self) -> Result<KeptSlot<'_>, SessionError> {
        let mut state = self.state.lock().unwrap();
        forget_expired(&mut state.kept);
        if state.kept.len() + state.kept_starting >= MAX_KEPT {
            let oldest = state.kept.iter().filter_map(|(id, k)| k.ended_for().map(|d| (d, *id))).max();
            let Some((_, id)) = oldest else {
                return Err(SessionError::Busy(format!(
                    "session {:?} keeps {MAX_KEPT} detached processes and terminals running: end one first",
                    self.name
                )));
            };
            if let Some(k) = state.kept.remove(&id) {
                k.release();
            }
        }
        state.kept_starting += 1;
        Ok(KeptSlot { session: self, filled: false })
    }
}

/// A place reserved for a kept process while it starts.
struct KeptSlot<'a> {
    session: &'a Session,
    filled: bool,
}

impl KeptSlot<'_> {
    fn fill(mut self, kept: Arc<Kept>) -> Arc<Kept> {
        let mut state = self.session.state.lock().unwrap();
        state.kept_starting -= 1;
        state.kept.insert(kept.id(), kept.clone());
        self.filled = true;
        kept
    }
}

impl Drop for KeptSlot<'_> {
    fn drop(&mut self) {
        if !self.filled {
            self.session.state.lock().unwrap().kept_starting -= 1;
        }
    }
}

/// Forgets finished kept processes older than `KEEP_FINISHED_SECS`, freeing their output even
/// while a client's view still holds them.
fn forget_expired(kept: &mut BTreeMap<u64, Arc<Kept>>) {
    let keep_for = Duration::from_secs(KEEP_FINISHED_SECS);
    kept.retain(|_, k| {
        let keep = !matches!(k.ended_for(), Some(d) if d >= keep_for);
        if !keep {
            k.release();
        }
        keep
    });
}
