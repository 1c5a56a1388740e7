//! The processes a session keeps when their client goes, and its terminals: starting them,
//! finding them, listing them, and forgetting finished ones after a while (`../kept.rs` keeps
//! their output).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use umbra_api::kept::{ProcessInfo, TerminalInfo, KEEP_FINISHED_SECS, MAX_KEPT};

use super::Session;
use crate::session::error::SessionError;
use crate::session::exec::ExecRequest;
use crate::session::kept::{Kept, TerminalRequest, MAX_RUN_COMMAND};

/// A terminal's shell when none is named: bash as a login shell where the image has it, else
/// the image's sh (busybox's in the minimal image).
const DEFAULT_SHELL: &[&str] =
    &["/bin/sh", "-c", "if command -v bash >/dev/null 2>&1; then exec bash -l; fi; exec sh -l"];
const SIGHUP: i32 = 1;

impl Session {
    /// Starts a process the session keeps when its client goes.
    pub async fn spawn_kept(self: &Arc<Self>, req: ExecRequest) -> Result<Arc<Kept>, SessionError> {
        let slot = self.reserve_kept()?;
        let argv = req.argv.clone();
        let exec = self.spawn(req).await?;
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
            .spawn(ExecRequest { argv: argv.clone(), cwd: req.cwd, env, tty: Some(req.size), timeout: None })
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
