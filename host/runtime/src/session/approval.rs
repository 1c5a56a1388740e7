//! The approval gate in front of every spawn of a session with approval settings.
//!
//! The rules and hooks (`umbra_policy::approval::decide`) answer allow, deny or ask. Ask
//! becomes a `permission_request` event on the session's bus with a request id; the spawn waits
//! until [`Approvals::respond`] answers it (`permission.respond` over IPC) or the settings'
//! timeout passes, which denies it: silence never runs a command. Every outcome says its rule.
//!
//! A session in network mode `ask` asks the same way before a connection to a name outside its
//! allowlist ([`Approvals::ask_network`]): the connection waits for the answer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::oneshot;
use umbra_api::event::{PermissionKind, PermissionScope};
use umbra_api::EventKind;
use umbra_policy::approval::{ApprovalSettings, CommandRequest, Verdict};

use super::SessionError;

/// Requests waiting for an answer, by id. One per manager: ids are unique across sessions.
#[derive(Default)]
pub struct Approvals {
    pending: Mutex<HashMap<String, Pending>>,
    next: AtomicU64,
}

/// A request waiting for its answer.
struct Pending {
    answer: oneshot::Sender<(bool, PermissionScope)>,
    /// The allow patterns `allow_always` would add (a command's; none for a connection).
    patterns: Vec<String>,
}

/// At most this many requests wait at once; more spawns needing approval are refused as busy
/// rather than queued without bound.
pub const MAX_PENDING: usize = 1024;

impl Approvals {
    /// Answers a pending request; returns the allow patterns of a command's (what
    /// `allow_always` adds to its session's list).
    pub fn respond(
        &self,
        request_id: &str,
        approved: bool,
        scope: PermissionScope,
    ) -> Result<Vec<String>, SessionError> {
        let pending = self.pending.lock().unwrap().remove(request_id);
        match pending {
            // The spawn may have timed out in between: then the answer is too late.
            Some(p) => p
                .answer
                .send((approved, scope))
                .map(|()| p.patterns)
                .map_err(|_| SessionError::NoPermissionRequest(request_id.to_string())),
            None => Err(SessionError::NoPermissionRequest(request_id.to_string())),
        }
    }

    /// A request id and its answer's receiver; `Busy` past [`MAX_PENDING`].
    fn open(
        &self,
        what: &str,
        patterns: Vec<String>,
    ) -> Result<(String, oneshot::Receiver<(bool, PermissionScope)>), SessionError> {
        let request_id = format!("perm-{}", self.next.fetch_add(1, Ordering::Relaxed) + 1);
        let (tx, rx) = oneshot::channel();
        let mut pending = self.pending.lock().unwrap();
        if pending.len() >= MAX_PENDING {
            return Err(SessionError::Busy(format!("{MAX_PENDING} {what} already wait for approval")));
        }
        pending.insert(request_id.clone(), Pending { answer: tx, patterns });
        Ok((request_id, rx))
    }

    /// Waits for the answer to `request_id` (silence denies after `timeout`); emits the
    /// resolution. Returns the scope of an approval, or why it was not approved.
    async fn wait(
        &self,
        request_id: String,
        rx: oneshot::Receiver<(bool, PermissionScope)>,
        timeout: Duration,
        emit: impl Fn(EventKind),
    ) -> Result<PermissionScope, String> {
        let answer = tokio::time::timeout(timeout, rx).await;
        self.pending.lock().unwrap().remove(&request_id);
        let outcome = match answer {
            Ok(Ok((true, scope))) => Ok(scope),
            Ok(Ok((false, _))) => Err("denied by the user".to_string()),
            Ok(Err(_)) => Err("the request was dropped".to_string()),
            Err(_) => Err(format!("no answer within {} s", timeout.as_secs())),
        };
        let reason = match &outcome {
            Ok(PermissionScope::Session) => "approved for the session".to_string(),
            Ok(PermissionScope::Always) => "approved, and allowed from now on".to_string(),
            Ok(PermissionScope::Once) => "approved".to_string(),
            Err(why) => why.clone(),
        };
        emit(EventKind::PermissionResolved { request_id, approved: outcome.is_ok(), reason });
        outcome
    }

    /// Asks whether the guest may connect to `host:port` (network mode `ask`): a
    /// `permission_request` of kind `network`, answered within `timeout` or denied.
    pub async fn ask_network(
        &self,
        question: crate::egress::Question,
        timeout: Duration,
        emit: impl Fn(EventKind),
    ) -> Result<PermissionScope, String> {
        let (request_id, rx) = self.open("connections", Vec::new()).map_err(|e| e.to_string())?;
        emit(EventKind::PermissionRequest {
            request_id: request_id.clone(),
            kind: PermissionKind::Network,
            command: String::new(),
            cwd: String::new(),
            env: Default::default(),
            env_changes_what_runs: Vec::new(),
            decision: None,
            host: Some(question.host),
            port: Some(question.port),
            via: Some(question.via),
            process: question.process,
            timeout_secs: timeout.as_secs(),
        });
        self.wait(request_id, rx, timeout, emit).await
    }

    /// Decides on `argv`: returns when it may run — with the allow patterns to add to the
    /// session's list when the person said `allow_always` — or the refusal naming the rule (or
    /// the person, or the timeout). `emit` publishes the request and its resolution.
    pub async fn check(
        &self,
        settings: &ApprovalSettings,
        request: CommandRequest,
        emit: impl Fn(EventKind),
    ) -> Result<Vec<String>, SessionError> {
        let decision = umbra_policy::approval::decide(settings, &request).await;
        let command = request.command.clone();
        let patterns: Vec<String> = decision.parts.iter().filter_map(|argv| allow_pattern(argv)).collect();
        match decision.verdict {
            Verdict::Allow => return Ok(Vec::new()),
            Verdict::Deny => return Err(SessionError::CommandRefused { command, reason: decision.reason.to_string() }),
            Verdict::Ask => {}
        }
        let (request_id, rx) = self.open("commands", patterns.clone())?;
        let timeout = Duration::from_secs(settings.timeout_secs);
        let rule = decision.reason.to_string();
        emit(EventKind::PermissionRequest {
            request_id: request_id.clone(),
            kind: PermissionKind::Command,
            command: command.clone(),
            cwd: request.cwd.display().to_string(),
            env: request.env.clone(),
            env_changes_what_runs: umbra_policy::approval::what_changes_what_runs(&request.env),
            decision: Some(decision),
            host: None,
            port: None,
            via: None,
            process: None,
            timeout_secs: settings.timeout_secs,
        });
        match self.wait(request_id, rx, timeout, &emit).await {
            Ok(PermissionScope::Always) => Ok(patterns),
            Ok(_) => Ok(Vec::new()),
            Err(reason) => {
                Err(SessionError::CommandRefused { command, reason: format!("{reason} (it needed approval: {rule})") })
            }
        }
    }
}

/// The allow pattern `allow_always` adds for one simple command of a line: its words, when
/// each is a plain word. A part with a word that is not (a shell's script, a quoted argument)
/// is left out: allow patterns are words, and a pattern for its program alone (`sh -c`) would
/// allow whatever it runs.
fn allow_pattern(argv: &[String]) -> Option<String> {
    let plain = |w: &String| !w.is_empty() && shlex::try_quote(w).is_ok_and(|q| q == w.as_str());
    (!argv.is_empty() && argv.iter().all(plain)).then(|| argv.join(" "))
}

/// The command line the rules see for an argv: shell-quoted words (`sh -c 'a && b'` keeps its
/// script whole, which the rules then split).
pub fn command_line(argv: &[String]) -> String {
    shlex::try_join(argv.iter().map(String::as_str)).unwrap_or_else(|_| argv.join(" "))
}
