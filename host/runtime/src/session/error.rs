//! What can go wrong with a session, each case with the stable [`ErrorCode`] a client acts on.

use umbra_api::{ApiError, ErrorCode, SessionStatus};

use super::launch::LaunchError;
use crate::agent::ClientError;
use crate::backend::VmError;
use crate::image::ImageError;
use crate::share::paths::PathError;
use crate::share::shadow::ShadowError;
use crate::share::tree::TreeError;
use crate::share::ShareError;

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("no session {0:?}")]
    NotFound(String),
    #[error("session {name:?} already exists and is {status}; resume it or delete it first")]
    Exists { name: String, status: SessionStatus },
    #[error("session {name:?} is {status}: cannot {what}{}", resume_hint(*status))]
    InvalidState { name: String, status: SessionStatus, what: &'static str },
    #[error("{0}")]
    InvalidArgument(String),
    #[error("command {command:?} refused: {reason}")]
    CommandRefused { command: String, reason: String },
    /// A live change would loosen what the session's merged policy allows.
    #[error("session {name:?}: {wanted} is beyond the session's policy ceiling ({ceiling}): {excess}")]
    BeyondPolicy { name: String, wanted: String, ceiling: String, excess: String },
    #[error("no permission request {0:?} is waiting (answered, timed out, or never made)")]
    NoPermissionRequest(String),
    #[error("{0}")]
    Busy(String),
    #[error("{0}")]
    Image(#[from] ImageError),
    /// The VM did not start (the message carries the console's last lines).
    #[error("session {name:?} did not start: {source}")]
    Boot { name: String, source: VmError },
    /// The session failed while starting (or restarting) and gave up.
    #[error("session {name:?} failed: {reason}")]
    Failed { name: String, reason: String },
    #[error(transparent)]
    Share(#[from] ShareError),
    #[error("{}", agent_message(.0))]
    Agent(#[from] ClientError),
    /// Not possible with this session or host (a snapshot on qemu, a session without storage).
    #[error("{0}")]
    Unsupported(String),
    #[error("cannot snapshot session {name:?}: {source}")]
    Snapshot { name: String, source: VmError },
    #[error("process {0} is not running in this session")]
    NoSuchProcess(u64),
    #[error("no terminal {0} in this session (closed more than 10 minutes ago, or never opened)")]
    NoSuchTerminal(u64),
    #[error("no language server {0} in this session (stopped, or never started)")]
    NoSuchLspServer(u64),
    /// A language server failed or went away; the message says how.
    #[error("{0}")]
    Lsp(String),
    #[error("{0}")]
    Timeout(String),
    #[error("cannot {what}: {source}")]
    Io { what: String, source: std::io::Error },
    /// A walk or copy of a tree the guest writes (outputs, uploads) failed or hit a bound.
    #[error("cannot {what}: {source}")]
    Tree { what: String, source: TreeError },
    /// The runtime's own fault (a blocking task that panicked): nothing the caller sent.
    #[error("{0}")]
    Internal(String),
    /// The machine's system policy turns sessions off.
    #[error("sessions are turned off on this machine by its administrator (the system policy {0}: enabled false)")]
    DisabledByAdmin(String),
    /// The system policy does not allow it (a folder outside its trusted roots, a bundle
    /// source it does not list).
    #[error("{0}")]
    SystemPolicy(String),
}

impl SessionError {
    pub fn code(&self) -> ErrorCode {
        match self {
            SessionError::NotFound(_) => ErrorCode::SessionNotFound,
            SessionError::Exists { .. } => ErrorCode::SessionExists,
            SessionError::InvalidState { .. } => ErrorCode::InvalidState,
            SessionError::InvalidArgument(_) => ErrorCode::InvalidParams,
            SessionError::CommandRefused { .. } => ErrorCode::PermissionDenied,
            SessionError::BeyondPolicy { .. } => ErrorCode::PermissionDenied,
            SessionError::NoPermissionRequest(_) => ErrorCode::NotFound,
            SessionError::Busy(_) => ErrorCode::Busy,
            SessionError::Image(_) => ErrorCode::BundleError,
            SessionError::Boot { source, .. } => match source {
                VmError::Io { .. } => ErrorCode::Io,
                _ => ErrorCode::BootFailed,
            },
            SessionError::Failed { .. } => ErrorCode::BootFailed,
            SessionError::Share(e) => share_code(e),
            SessionError::Agent(e) => client_code(e),
            SessionError::Unsupported(_) => ErrorCode::Unsupported,
            SessionError::Snapshot { source, .. } => match source {
                VmError::Io { .. } => ErrorCode::Io,
                _ => ErrorCode::Internal,
            },
            SessionError::NoSuchProcess(_) | SessionError::NoSuchTerminal(_) | SessionError::NoSuchLspServer(_) => {
                ErrorCode::NotFound
            }
            SessionError::Lsp(_) => ErrorCode::GuestError,
            SessionError::Timeout(_) => ErrorCode::Timeout,
            SessionError::Io { source, .. } => io_code(source),
            SessionError::Tree { source, .. } => match source {
                TreeError::TooManyEntries { .. } | TreeError::TooLarge { .. } | TreeError::TooDeep { .. } => {
                    ErrorCode::TooLarge
                }
                // The guest changed the tree while it was read: trying again may well succeed.
                TreeError::Changed { .. } | TreeError::Vanished { .. } => ErrorCode::Busy,
                TreeError::Io { source, .. } => io_code(source),
            },
            SessionError::Internal(_) => ErrorCode::Internal,
            SessionError::DisabledByAdmin(_) => ErrorCode::DisabledByAdmin,
            SessionError::SystemPolicy(_) => ErrorCode::PermissionDenied,
        }
    }

    /// For a blocking task's `JoinError`: `what` panicked (or was cancelled) — the runtime's
    /// fault, reported as `internal`, never as the caller's bad params.
    pub(crate) fn task(what: impl Into<String>) -> impl FnOnce(tokio::task::JoinError) -> SessionError {
        let what = what.into();
        move |e| SessionError::Internal(format!("{what} failed inside umbrad: {e}"))
    }

    /// A launch's failure, for session `name`: what could not boot is the session's.
    pub(super) fn launch(name: &str) -> impl FnOnce(LaunchError) -> SessionError + '_ {
        move |e| match e {
            LaunchError::Image(e) => SessionError::Image(e),
            LaunchError::BundleGone(why) => SessionError::InvalidArgument(why),
            LaunchError::Vm(source) => SessionError::Boot { name: name.to_string(), source },
            e @ LaunchError::Task { .. } => SessionError::Internal(e.to_string()),
        }
    }

    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> SessionError {
        let what = what.into();
        move |source| SessionError::Io { what, source }
    }
}

impl From<SessionError> for ApiError {
    fn from(e: SessionError) -> Self {
        ApiError::new(e.code(), e.to_string())
    }
}

impl From<PathError> for SessionError {
    fn from(e: PathError) -> Self {
        SessionError::Share(ShareError::Path(e))
    }
}

fn resume_hint(status: SessionStatus) -> &'static str {
    match status {
        SessionStatus::Stopped | SessionStatus::Failed => " (resume it first)",
        _ => "",
    }
}

/// What the agent said, without the client's framing when the agent itself refused.
fn agent_message(e: &ClientError) -> String {
    match e {
        ClientError::Agent(body) => body.message.clone(),
        other => other.to_string(),
    }
}

/// The code of an agent-client failure.
pub fn client_code(e: &ClientError) -> ErrorCode {
    match e {
        ClientError::Agent(body) => ErrorCode::from_agent(body.code),
        ClientError::ConnectionLost(_) | ClientError::Connect { .. } | ClientError::HybridVsock { .. } => {
            ErrorCode::SessionLost
        }
        ClientError::Timeout(_) => ErrorCode::Timeout,
        ClientError::TooLarge(_) => ErrorCode::TooLarge,
        ClientError::Host(_) => ErrorCode::Io,
        ClientError::Handshake(_) | ClientError::IncompatibleVersion(_) | ClientError::Protocol(_) => {
            ErrorCode::GuestError
        }
    }
}

fn io_code(e: &std::io::Error) -> ErrorCode {
    match e.kind() {
        std::io::ErrorKind::NotFound => ErrorCode::NotFound,
        std::io::ErrorKind::PermissionDenied => ErrorCode::PermissionDenied,
        _ => ErrorCode::Io,
    }
}

fn share_code(e: &ShareError) -> ErrorCode {
    match e {
        ShareError::Path(p) => match p {
            PathError::Io { source, .. } => io_code(source),
            PathError::NotShared(_) => ErrorCode::NotFound,
            PathError::BlockedExtension { .. } | PathError::ReadOnly { .. } => ErrorCode::PermissionDenied,
            _ => ErrorCode::InvalidParams,
        },
        ShareError::HostPath { source, .. } => io_code(source),
        ShareError::AlreadyShared(_) => ErrorCode::AlreadyExists,
        ShareError::NotShared(_) => ErrorCode::NotFound,
        ShareError::NotShadow(_) => ErrorCode::InvalidParams,
        ShareError::NoFolderServer => ErrorCode::Unsupported,
        ShareError::Server(_) => ErrorCode::Io,
        ShareError::GuestMount { source, .. } | ShareError::Guest(source) => client_code(source),
        ShareError::Shadow(e) => match e {
            ShadowError::NotInChangeSet(_) | ShadowError::InvalidPath { .. } => ErrorCode::InvalidParams,
            ShadowError::NeverApplied { .. } => ErrorCode::PermissionDenied,
            ShadowError::CaptureTooLarge { .. } => ErrorCode::TooLarge,
            _ => ErrorCode::Io,
        },
        ShareError::DiffTooLarge { .. } => ErrorCode::TooLarge,
        ShareError::NoChangeSet { .. } => ErrorCode::InvalidParams,
        ShareError::UnknownChangeSet { .. } => ErrorCode::NotFound,
        ShareError::Io { source, .. } => io_code(source),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_follow_the_cause_not_the_message() {
        let not_found = ClientError::Agent(umbra_proto::ErrorBody::new(umbra_proto::ErrorCode::NotFound, "whatever"));
        assert_eq!(SessionError::Agent(not_found).code(), ErrorCode::NotFound);
        let lost = ClientError::ConnectionLost("eof".into());
        assert_eq!(SessionError::Agent(lost).code(), ErrorCode::SessionLost);
        let missing = std::io::Error::from(std::io::ErrorKind::NotFound);
        let e = SessionError::Share(ShareError::HostPath { path: "/nope".into(), source: missing });
        assert_eq!(e.code(), ErrorCode::NotFound);
        assert_eq!(SessionError::Share(ShareError::AlreadyShared("a".into())).code(), ErrorCode::AlreadyExists);
        // A panicked blocking task is the runtime's fault, never the caller's params.
        let panicked = tokio::runtime::Runtime::new()
            .unwrap()
            .block_on(async { tokio::task::spawn_blocking(|| -> () { panic!("boom") }).await.unwrap_err() });
        let e = SessionError::task("the disk copy")(panicked);
        assert_eq!(e.code(), ErrorCode::Internal);
        assert!(e.to_string().starts_with("the disk copy failed inside umbrad: task"), "{e}");
        let api: ApiError = SessionError::NotFound("x".into()).into();
        assert_eq!((api.code, api.message.as_str()), (ErrorCode::SessionNotFound, "no session \"x\""));
    }
}
