//! The approval gate in front of every spawn of a session with approval settings.
//!
//! The rules and hooks (`umbra_policy::approval::decide`) answer allow, deny or ask. Ask
//! becomes a `permission_request` event on the session's bus with a request id; the spawn waits
//! until [`Approvals::respond`] answers it (`permission.respond` over IPC) or the settings'
//! timeout passes, which denies it: silence never runs a command. Every outcome says its rule.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::oneshot;
use umbra_api::EventKind;
use umbra_policy::approval::{ApprovalSettings, CommandRequest, Verdict};

use super::SessionError;

/// Requests waiting for an answer, by id. One per manager: ids are unique across sessions.
#[derive(Default)]
pub struct Approvals {
    pending: Mutex<HashMap<String, oneshot::Sender<bool>>>,
    next: AtomicU64,
}

/// At most this many requests wait at once; more spawns needing approval are refused as busy
/// rather than queued without bound.
pub const MAX_PENDING: usize = 1024;

impl Approvals {
    /// Answers a pending request.
    pub fn respond(&self, request_id: &str, approved: bool) -> Result<(), SessionError> {
        let sender = self.pending.lock().unwrap().remove(request_id);
        match sender {
            Some(tx) => {
                // The spawn may have timed out in between: then the answer is too late.
                tx.send(approved).map_err(|_| SessionError::NoPermissionRequest(request_id.to_string()))
            }
            None => Err(SessionError::NoPermissionRequest(request_id.to_string())),
        }
    }

    /// Decides on `argv`: returns when it may run, or the refusal naming the rule (or the
    /// person, or the timeout). `emit` publishes the request and its resolution.
    pub async fn check(
        &self,
        settings: &ApprovalSettings,
        request: CommandRequest,
        emit: impl Fn(EventKind),
    ) -> Result<(), SessionError> {
        let decision = umbra_policy::approval::decide(settings, &request).await;
        let command = request.command.clone();
        match decision.verdict {
            Verdict::Allow => return Ok(()),
            Verdict::Deny => return Err(SessionError::CommandRefused { command, reason: decision.reason.to_string() }),
            Verdict::Ask => {}
        }
        let request_id = format!("perm-{}", self.next.fetch_add(1, Ordering::Relaxed) + 1);
        let (tx, rx) = oneshot::channel();
        {
            let mut pending = self.pending.lock().unwrap();
            if pending.len() >= MAX_PENDING {
                return Err(SessionError::Busy(format!("{MAX_PENDING} commands already wait for approval")));
            }
            pending.insert(request_id.clone(), tx);
        }
        let timeout = Duration::from_secs(settings.timeout_secs);
        let rule = decision.reason.to_string();
        emit(EventKind::PermissionRequest {
            request_id: request_id.clone(),
            command: command.clone(),
            cwd: request.cwd.display().to_string(),
            env: request.env.clone(),
            env_changes_what_runs: umbra_policy::approval::what_changes_what_runs(&request.env),
            decision,
            timeout_secs: settings.timeout_secs,
        });
        let answer = tokio::time::timeout(timeout, rx).await;
        self.pending.lock().unwrap().remove(&request_id);
        let (approved, reason) = match answer {
            Ok(Ok(true)) => (true, "approved".to_string()),
            Ok(Ok(false)) => (false, "denied by the user".to_string()),
            Ok(Err(_)) => (false, "the request was dropped".to_string()),
            Err(_) => (false, format!("no answer within {} s", settings.timeout_secs)),
        };
        emit(EventKind::PermissionResolved { request_id, approved, reason: reason.clone() });
        if approved {
            Ok(())
        } else {
            Err(SessionError::CommandRefused { command, reason: format!("{reason} (it needed approval: {rule})") })
        }
    }
}

/// The command line the rules see for an argv: shell-quoted words (`sh -c 'a && b'` keeps its
/// script whole, which the rules then split).
pub fn command_line(argv: &[String]) -> String {
    shlex::try_join(argv.iter().map(String::as_str)).unwrap_or_else(|_| argv.join(" "))
}
