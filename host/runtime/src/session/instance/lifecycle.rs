//! A session's lifecycle: boot (or restore) and supervision of each VM — heartbeats, liveness,
//! the idle stop — restarts with back-off, waiting for `ready`, and stop.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use umbra_api::{ApiError, EventKind, SessionStatus};

use super::{Session, StopReason};
use crate::session::error::SessionError;
use crate::session::incarnation::{BootPlan, Failure, Incarnation};
use crate::session::snapshot::SessionSnapshot;

/// How often the supervisor checks that the VM's processes are alive.
const ALIVE_EVERY: Duration = Duration::from_millis(500);
/// How often the guest is asked which ports its programs listen on (`port_opened` events,
/// `auto_expose`).
const PORTS_EVERY: Duration = Duration::from_secs(1);
/// How long one such poll may take.
const PORTS_POLL_TIMEOUT: Duration = Duration::from_secs(2);
/// Back-off before restart attempt n is `RESTART_BASE * 2^(n-1)`, at most `RESTART_MAX`.
const RESTART_BASE: Duration = Duration::from_secs(1);
const RESTART_MAX: Duration = Duration::from_secs(30);

impl Session {
    /// Boots the session (it must be `starting`: the caller set it so, holding the registry)
    /// and supervises it. A failure leaves it `failed` with the reason.
    pub(in crate::session) async fn boot(self: &Arc<Self>) -> Result<(), SessionError> {
        let _lifecycle = self.lifecycle.lock().await;
        if self.status() != SessionStatus::Starting {
            return Err(self.invalid_state("start"));
        }
        let cancel = {
            let mut state = self.state.lock().unwrap();
            state.cancel = CancellationToken::new();
            state.restarts = 0;
            state.failures.clear();
            state.cancel.clone()
        };
        self.emit(EventKind::Status { status: SessionStatus::Starting, reason: None });
        let booted = tokio::select! {
            r = self.boot_incarnation() => r,
            _ = cancel.cancelled() => Err(SessionError::Failed { name: self.name.clone(), reason: "stopped while starting".into() }),
        };
        match booted {
            Ok(inc) => {
                self.install(inc, cancel);
                Ok(())
            }
            Err(e) => {
                if !cancel.is_cancelled() {
                    self.emit(EventKind::StartupError { error: ApiError::new(e.code(), e.to_string()) });
                    self.set_status(SessionStatus::Failed, Some(e.to_string()));
                }
                Err(e)
            }
        }
    }

    /// Makes a stopped or failed session `starting` again; false if it already is active.
    pub(in crate::session) fn begin_resume(&self) -> Result<bool, SessionError> {
        // Checked and set in one step: of two concurrent resumes, one boots and one waits.
        let mut seen = self.status();
        let resumed = self.status.send_if_modified(|status| {
            seen = *status;
            if matches!(*status, SessionStatus::Stopped | SessionStatus::Failed) {
                *status = SessionStatus::Starting;
                true
            } else {
                false
            }
        });
        if resumed {
            let mut state = self.state.lock().unwrap();
            state.record.status = SessionStatus::Starting;
            // Resumed, by a call naming it or by a client's resume: no longer waiting for one.
            state.record.suspended = false;
            return Ok(true);
        }
        match seen {
            SessionStatus::Stopping => Err(self.invalid_state("resume while it is stopping")),
            _ => Ok(false),
        }
    }

    /// Resumes a suspended session (`idle_action: suspend`), as the call naming it needs it
    /// running; nothing for any other. A call that races the suspension waits for it first.
    pub(super) async fn wake(self: &Arc<Self>) -> Result<(), SessionError> {
        if self.status() == SessionStatus::Stopping {
            drop(self.lifecycle.lock().await);
        }
        if !self.state.lock().unwrap().record.suspended {
            // Another call's resume may be under way (it cleared the flag): its boot adopts the
            // kept processes, which this caller may be about to use.
            if matches!(self.status(), SessionStatus::Starting | SessionStatus::Restarting) {
                return self.wait_ready().await;
            }
            return Ok(());
        }
        self.ctx.check_enabled()?;
        tracing::info!(session = %self.name, "resuming the suspended session for a call naming it");
        if self.begin_resume()? {
            self.boot().await
        } else {
            self.wait_ready().await
        }
    }

    /// Boots the session's next VM, or restores its snapshot if it was paused by one (or is a
    /// fork not yet started): the restore is used once, and later VMs of the session boot.
    pub(super) async fn boot_incarnation(self: &Arc<Self>) -> Result<Arc<Incarnation>, SessionError> {
        let (mut settings, folders, resumes, pins) = {
            let state = self.state.lock().unwrap();
            let resumes = state.record.snapshot.as_ref().is_some_and(|s| s.resumes);
            (state.record.settings.clone(), state.record.folders.clone(), resumes, state.record.pinned.clone())
        };
        // Within the system policy, whatever the record says (a restore takes its memory and
        // vCPUs from the snapshot, which was taken within it).
        self.ctx.cap(&mut settings);
        for f in &folders {
            self.ctx.check_folder(&f.path)?;
        }
        let plan = BootPlan {
            session: self.name.clone(),
            settings,
            folders,
            storage_dir: self.storage_dir(),
            boot_timeout: Duration::from_secs(self.ctx.config().boot_timeout_secs),
            network: self.network.clone(),
            pins,
            broker: self.broker()?,
        };
        if !resumes {
            // Processes parked in a snapshot this VM does not come from end here.
            self.release_kept("its session booted a new VM instead of restoring the snapshot it was parked in");
            let inc = Arc::new(Incarnation::boot(&plan, &self.ctx, self.report()).await?);
            self.keep_pins(&inc).await;
            inc.trust(&plan.broker.ca).await?;
            return Ok(inc);
        }
        let storage = self.storage_dir().ok_or_else(|| SessionError::Unsupported("no storage".into()))?;
        let snapshot = tokio::task::spawn_blocking(move || SessionSnapshot::load(&storage))
            .await
            .map_err(SessionError::task("reading the snapshot"))??;
        // A resume keeps the guest's name; a fork's first start gives it the fork's.
        let hostname = match snapshot.meta.session == self.name {
            true => snapshot.meta.hostname.clone(),
            false => self.name.clone(),
        };
        let inc = match Incarnation::restore(&plan, &self.ctx, self.report(), &snapshot, &hostname).await {
            Ok(inc) => inc,
            Err(e) => {
                self.release_kept(&format!("the restore of its session's snapshot failed: {e}"));
                return Err(e);
            }
        };
        self.keep_pins(&inc).await;
        // The kept processes parked at the snapshot run on here.
        self.adopt_kept(&inc).await;
        // This process's CA, which may not be the one the snapshotted guest trusted.
        inc.trust(&plan.broker.ca).await?;
        {
            // From now on the disk moves on from the snapshot's: a later VM boots.
            let mut state = self.state.lock().unwrap();
            if let Some(s) = &mut state.record.snapshot {
                s.resumes = false;
            }
        }
        self.persist();
        Ok(Arc::new(inc))
    }

    /// Records what the folders the VM shares are, for the session's next VM.
    pub(super) async fn keep_pins(&self, inc: &Incarnation) {
        let pins = inc.machine.lock().await.folders.pins().clone();
        let changed = {
            let mut state = self.state.lock().unwrap();
            let changed = state.record.pinned != pins;
            state.record.pinned = pins;
            changed
        };
        if changed {
            self.persist();
        }
    }

    /// Makes `inc` the running VM, announces it, and starts its supervisor.
    pub(super) fn install(self: &Arc<Self>, inc: Arc<Incarnation>, cancel: CancellationToken) {
        self.state.lock().unwrap().current = Some(inc.clone());
        self.touch();
        self.emit(EventKind::Ready {
            backend: inc.info.backend.clone(),
            why: inc.info.backend_reason.clone(),
            boot_ms: inc.info.boot_ms,
            bundle: inc.info.bundle_version.clone(),
        });
        self.set_status(SessionStatus::Ready, None);
        tokio::spawn(self.clone().supervise(inc, cancel));
    }

    /// Watches one VM until it fails, the session idles out, or a stop cancels it.
    pub(super) async fn supervise(self: Arc<Self>, inc: Arc<Incarnation>, cancel: CancellationToken) {
        let settings = self.settings();
        let heartbeat_timeout = Duration::from_secs(settings.heartbeat_timeout_secs);
        // Whether this VM could be suspended; the idle settings themselves are read at each
        // check (`session.update` changes them live).
        let can_suspend = self.can_suspend(&inc).await;
        let mut alive = tokio::time::interval(ALIVE_EVERY);
        let mut heartbeat = tokio::time::interval(Duration::from_secs(settings.heartbeat_interval_secs));
        // The first tick is immediate; the boot just proved the agent.
        heartbeat.tick().await;
        // Ports exposed by the last VM's programs go; those recorded before umbrad restarted
        // listen again (a failure is logged).
        self.drop_auto_exposed().await;
        let _ = self.open_recorded_ports().await;
        // What the guest listens on, polled (an agent before protocol 1.7 cannot tell: `None`).
        let mut listening = Some(std::collections::BTreeMap::new());
        let mut ports_poll = tokio::time::interval(PORTS_EVERY);
        ports_poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let failure = loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = ports_poll.tick(), if listening.is_some() => {
                    // Briefly: the alive and idle checks wait meanwhile (a silent agent is the
                    // heartbeat's to judge), and a stop ends the wait.
                    let polled = tokio::select! {
                        r = tokio::time::timeout(PORTS_POLL_TIMEOUT, inc.agent.listening()) => r,
                        _ = cancel.cancelled() => return,
                    };
                    match polled {
                        Ok(Ok(now)) => {
                            let seen = listening.as_mut().expect("polled only when Some");
                            self.ports_changed(seen, now).await;
                        }
                        Ok(Err(crate::agent::ClientError::Agent(e)))
                            if matches!(e.code, umbra_proto::ErrorCode::BadRequest | umbra_proto::ErrorCode::Unsupported) =>
                        {
                            listening = None;
                        }
                        // The heartbeat judges whether the VM is alive.
                        _ => {}
                    }
                }
                _ = alive.tick() => {
                    if let Err(f) = inc.check_alive() {
                        break f;
                    }
                    let idle = self.settings();
                    let idle_timeout = Duration::from_secs(idle.idle_timeout_secs);
                    // Suspending (a snapshot), kept processes and terminals do not keep it
                    // awake: they run on after the restore.
                    let suspends = can_suspend && idle.idle_action == umbra_api::IdleAction::Suspend;
                    if !idle_timeout.is_zero() && self.idle_for(suspends) >= idle_timeout {
                        let idle_secs = idle_timeout.as_secs();
                        let me = self.clone();
                        // A separate task: the stop (or snapshot) cancels this one.
                        tokio::spawn(async move {
                            if suspends {
                                if let Err(e) = me.suspend(idle_secs).await {
                                    tracing::warn!(session = %me.name, "the idle suspension failed: {e}");
                                }
                            } else {
                                me.emit(EventKind::IdleStop { idle_secs });
                                let _ = me.stop(StopReason::Idle).await;
                            }
                        });
                        return;
                    }
                }
                _ = heartbeat.tick() => {
                    if let Err(f) = inc.heartbeat(heartbeat_timeout).await {
                        break f;
                    }
                }
            }
        };
        if !cancel.is_cancelled() {
            self.recover(inc, failure, cancel).await;
        }
    }

    /// How long the session has been idle: zero while a process runs (`suspending`: a process
    /// a client waits for; kept ones run on after the restore).
    pub(super) fn idle_for(&self, suspending: bool) -> Duration {
        // A client waiting for a stdin write (a process that has not read what came before)
        // is activity, kept process or not: suspending would only resume it again.
        let busy = (self.state.lock().unwrap().processes.values())
            .any(|r| !suspending || r.rebind.is_none() || r.control.writing_stdin());
        // A connection through an exposed port (a dev server in use) is activity too.
        if busy || self.ports.connections() > 0 {
            return Duration::ZERO;
        }
        self.last_activity.lock().unwrap().elapsed()
    }

    /// After a failure: ends the VM (its processes learn why), saves unapplied shadow changes if
    /// the agent still answers, and boots again with back-off, until the restart budget is
    /// spent and the session is `failed`.
    pub(super) async fn recover(
        self: Arc<Self>,
        failed: Arc<Incarnation>,
        failure: Failure,
        cancel: CancellationToken,
    ) {
        let _lifecycle = tokio::select! {
            guard = self.lifecycle.lock() => guard,
            _ = cancel.cancelled() => return,
        };
        if cancel.is_cancelled() || self.status() != SessionStatus::Ready {
            return;
        }
        let Failure { mut reason, mut console } = failure;
        tracing::warn!(session = %self.name, "the VM failed: {reason}");
        self.emit(EventKind::HeartbeatFailure { reason: reason.clone() });
        self.set_status(SessionStatus::Restarting, Some(reason.clone()));
        if let Some(dir) = self.storage_dir() {
            failed.export_shadows(&dir, &self.report(), None).await;
        }
        let tail = failed.end(&format!("the session's VM failed ({reason}) and was restarted"), false).await;
        if console.is_empty() {
            console = tail;
        }
        {
            let mut state = self.state.lock().unwrap();
            state.current = None;
            state.last_console = console.clone();
        }
        drop(failed);
        let config = self.ctx.config();
        let window = Duration::from_secs(config.restart_window_secs);
        loop {
            let attempt = count_failure(&mut self.state.lock().unwrap().failures, Instant::now(), window);
            if attempt > config.max_restarts {
                let why = format!(
                    "{reason} ({} failure(s) within {}s; giving up after {} restart(s))",
                    attempt,
                    window.as_secs(),
                    config.max_restarts
                );
                self.emit(EventKind::Failed { reason: why.clone(), console });
                self.set_status(SessionStatus::Failed, Some(why));
                return;
            }
            let delay = restart_delay(attempt);
            self.emit(EventKind::Restarting { attempt, reason: reason.clone(), delay_ms: delay.as_millis() as u64 });
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = cancel.cancelled() => return,
            }
            let booted = tokio::select! {
                r = self.boot_incarnation() => r,
                _ = cancel.cancelled() => return,
            };
            match booted {
                Ok(inc) => {
                    self.state.lock().unwrap().restarts += 1;
                    self.install(inc, cancel);
                    return;
                }
                Err(e) => {
                    self.emit(EventKind::StartupError { error: ApiError::new(e.code(), e.to_string()) });
                    reason = e.to_string();
                    console = String::new();
                }
            }
        }
    }

    /// Waits until the session is ready; an error if it fails or stops instead.
    pub async fn wait_ready(&self) -> Result<(), SessionError> {
        let mut rx = self.status.subscribe();
        loop {
            let status = *rx.borrow_and_update();
            match status {
                SessionStatus::Ready => return Ok(()),
                SessionStatus::Failed | SessionStatus::Stopped | SessionStatus::Stopping => {
                    let reason = self.state.lock().unwrap().record.last_error.clone();
                    return Err(SessionError::Failed {
                        name: self.name.clone(),
                        reason: reason.unwrap_or_else(|| format!("it is {status}")),
                    });
                }
                SessionStatus::Starting | SessionStatus::Restarting => {}
            }
            if rx.changed().await.is_err() {
                return Err(self.invalid_state("wait for it"));
            }
        }
    }

    /// Ends every process and the VM; folders, outputs and the disk stay. Idempotent.
    pub async fn stop(self: &Arc<Self>, why: StopReason) -> Result<(), SessionError> {
        let cancel = self.state.lock().unwrap().cancel.clone();
        cancel.cancel();
        let _lifecycle = self.lifecycle.lock().await;
        if matches!(self.status(), SessionStatus::Stopped | SessionStatus::Failed) {
            // A suspended session a client stops: no call resumes it now, and a resume restores
            // its snapshot with none of its kept processes. (Its owner shutting down keeps it
            // suspended: the next owner's first call naming it resumes it.)
            let was_suspended =
                why != StopReason::Shutdown && std::mem::take(&mut self.state.lock().unwrap().record.suspended);
            if was_suspended {
                self.release_kept("the suspended session was stopped");
                self.persist();
            }
            return Ok(());
        }
        let text = match why {
            StopReason::Requested => "the session was stopped".to_string(),
            StopReason::Idle => format!("the session stopped after {} s idle", self.settings().idle_timeout_secs),
            StopReason::Shutdown => "the session was stopped because its owner shut down".to_string(),
        };
        self.set_status(SessionStatus::Stopping, Some(text.clone()));
        let current = self.state.lock().unwrap().current.take();
        if let Some(inc) = current {
            // Shadow changes live in the guest: save them before the VM goes.
            if let Some(dir) = self.storage_dir() {
                inc.export_shadows(&dir, &self.report(), None).await;
            }
            let console = inc.end(&text, true).await;
            self.state.lock().unwrap().last_console = console;
        }
        // What the guest's programs listened on went with the VM, as did its language servers.
        self.drop_auto_exposed().await;
        self.lsp.clear();
        self.set_status(SessionStatus::Stopped, Some(text));
        Ok(())
    }
}

/// Records a failure at `now` and forgets those older than `window`: how many are left is the
/// restart attempt this failure starts.
fn count_failure(failures: &mut std::collections::VecDeque<Instant>, now: Instant, window: Duration) -> u32 {
    failures.push_back(now);
    while failures.front().is_some_and(|t| now.duration_since(*t) > window) {
        failures.pop_front();
    }
    failures.len() as u32
}

/// The back-off before restart attempt `attempt` (1 = the first).
fn restart_delay(attempt: u32) -> Duration {
    RESTART_BASE.saturating_mul(1 << attempt.saturating_sub(1).min(5)).min(RESTART_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::instance::test_support::stopped_session;

    #[test]
    fn restarts_back_off_doubling_up_to_a_ceiling() {
        let secs: Vec<u64> = [1, 2, 3, 4, 5, 6, 7, 100].map(|n| restart_delay(n).as_secs()).to_vec();
        assert_eq!(secs, [1, 2, 4, 8, 16, 30, 30, 30]);
    }

    #[test]
    fn only_failures_within_the_window_count() {
        let window = Duration::from_secs(60);
        let mut failures = std::collections::VecDeque::new();
        let Some(start) = Instant::now().checked_sub(Duration::from_secs(300)) else { return };
        assert_eq!(count_failure(&mut failures, start, window), 1);
        assert_eq!(count_failure(&mut failures, start + Duration::from_secs(30), window), 2);
        // Ninety seconds after the first: it has left the window, the second has not.
        assert_eq!(count_failure(&mut failures, start + Duration::from_secs(90), window), 2);
        assert_eq!(count_failure(&mut failures, start + Duration::from_secs(300), window), 1);
    }

    #[tokio::test]
    async fn a_stopped_session_is_not_waited_for_and_stops_again_as_a_no_op() {
        let dir = tempfile::tempdir().unwrap();
        let session = stopped_session(dir.path(), "s", Default::default(), Vec::new());
        let e = session.wait_ready().await.unwrap_err();
        assert!(matches!(e, SessionError::Failed { .. }), "{e}");
        session.stop(StopReason::Requested).await.unwrap();
        assert_eq!(session.status(), SessionStatus::Stopped);
        assert!(session.begin_resume().unwrap(), "a stopped session can be resumed");
        assert_eq!(session.status(), SessionStatus::Starting);
        assert!(!session.begin_resume().unwrap(), "a second resume waits for the first");
    }
}
