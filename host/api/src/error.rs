//! Error codes with a stable meaning, shared by the runtime, umbrad and every client.
//!
//! A client decides what to do from [`ErrorCode`], never from a message: messages are for
//! people and may change. On the wire an error is a JSON-RPC error object whose `code` is the
//! number from [`ErrorCode::rpc_code`] and whose `data.code` is the stable name.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// What kind of failure an error is. The snake_case names are stable; new codes may be added,
/// and a client that does not know one sees [`ErrorCode::Unknown`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The request line was not valid JSON.
    ParseError,
    /// Valid JSON, but not a JSON-RPC 2.0 request (or a line longer than the limit).
    InvalidRequest,
    /// No method of that name (see `daemon.info`'s `api_version`).
    MethodNotFound,
    /// The parameters do not match the method's schema, or a value is out of range.
    InvalidParams,
    /// A bug or an unexpected condition in umbrad.
    Internal,
    /// No session of that name.
    SessionNotFound,
    /// A session of that name exists already (and is not running: resume or delete it).
    SessionExists,
    /// The session is not in a state that allows this (for example, not running).
    InvalidState,
    /// A file, folder, process or command does not exist. Spawning a command that is not
    /// found is this code (a shell would exit 127).
    NotFound,
    /// The guest or the host refused access (a shell would exit 126 for a command).
    PermissionDenied,
    /// Something of that name exists already (a shared folder, for example).
    AlreadyExists,
    /// The command could not be started for another reason.
    SpawnFailed,
    /// The VM did not boot: the message carries the reason and the last console lines.
    BootFailed,
    /// The VM or its agent went away during the call (the session restarts or has failed).
    SessionLost,
    /// The guest agent refused the request for a reason not covered above.
    GuestError,
    /// The guest did not answer in time.
    Timeout,
    /// A request, a file or an output exceeds a limit.
    TooLarge,
    /// A limit on clients, sessions or concurrent work was reached; try again later.
    Busy,
    /// A bundle could not be downloaded, verified or found.
    BundleError,
    /// A host I/O error (disk full, permissions on the host's own directories).
    Io,
    /// Not possible with this session, host or build (for example, a session without storage).
    Unsupported,
    /// The connecting user is not allowed to use this daemon.
    Unauthorized,
    /// umbrad is not running, or the connection to it dropped (clients report this; the
    /// daemon never sends it).
    Unavailable,
    /// The machine's system policy turns sessions off (`enabled: false`). Since API 1.8.
    DisabledByAdmin,
    /// A code from a newer daemon.
    #[serde(other)]
    Unknown,
}

impl ErrorCode {
    /// The JSON-RPC `error.code`: the reserved values for protocol errors, `-32000` and below for
    /// Umbra's own.
    pub fn rpc_code(self) -> i64 {
        match self {
            ErrorCode::ParseError => -32700,
            ErrorCode::InvalidRequest => -32600,
            ErrorCode::MethodNotFound => -32601,
            ErrorCode::InvalidParams => -32602,
            ErrorCode::Internal => -32603,
            ErrorCode::SessionNotFound => -32001,
            ErrorCode::SessionExists => -32002,
            ErrorCode::InvalidState => -32003,
            ErrorCode::NotFound => -32004,
            ErrorCode::PermissionDenied => -32005,
            ErrorCode::AlreadyExists => -32006,
            ErrorCode::SpawnFailed => -32007,
            ErrorCode::BootFailed => -32010,
            ErrorCode::SessionLost => -32011,
            ErrorCode::GuestError => -32012,
            ErrorCode::Timeout => -32013,
            ErrorCode::TooLarge => -32014,
            ErrorCode::Busy => -32015,
            ErrorCode::BundleError => -32016,
            ErrorCode::Io => -32017,
            ErrorCode::Unsupported => -32018,
            ErrorCode::Unauthorized => -32019,
            ErrorCode::Unavailable => -32020,
            ErrorCode::DisabledByAdmin => -32021,
            ErrorCode::Unknown => -32099,
        }
    }

    /// Every code, for documentation and tests.
    pub const ALL: [ErrorCode; 25] = [
        ErrorCode::ParseError,
        ErrorCode::InvalidRequest,
        ErrorCode::MethodNotFound,
        ErrorCode::InvalidParams,
        ErrorCode::Internal,
        ErrorCode::SessionNotFound,
        ErrorCode::SessionExists,
        ErrorCode::InvalidState,
        ErrorCode::NotFound,
        ErrorCode::PermissionDenied,
        ErrorCode::AlreadyExists,
        ErrorCode::SpawnFailed,
        ErrorCode::BootFailed,
        ErrorCode::SessionLost,
        ErrorCode::GuestError,
        ErrorCode::Timeout,
        ErrorCode::TooLarge,
        ErrorCode::Busy,
        ErrorCode::BundleError,
        ErrorCode::Io,
        ErrorCode::Unsupported,
        ErrorCode::Unauthorized,
        ErrorCode::Unavailable,
        ErrorCode::DisabledByAdmin,
        ErrorCode::Unknown,
    ];

    /// The stable name (`session_not_found`).
    pub fn name(self) -> &'static str {
        match self {
            ErrorCode::ParseError => "parse_error",
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::MethodNotFound => "method_not_found",
            ErrorCode::InvalidParams => "invalid_params",
            ErrorCode::Internal => "internal",
            ErrorCode::SessionNotFound => "session_not_found",
            ErrorCode::SessionExists => "session_exists",
            ErrorCode::InvalidState => "invalid_state",
            ErrorCode::NotFound => "not_found",
            ErrorCode::PermissionDenied => "permission_denied",
            ErrorCode::AlreadyExists => "already_exists",
            ErrorCode::SpawnFailed => "spawn_failed",
            ErrorCode::BootFailed => "boot_failed",
            ErrorCode::SessionLost => "session_lost",
            ErrorCode::GuestError => "guest_error",
            ErrorCode::Timeout => "timeout",
            ErrorCode::TooLarge => "too_large",
            ErrorCode::Busy => "busy",
            ErrorCode::BundleError => "bundle_error",
            ErrorCode::Io => "io",
            ErrorCode::Unsupported => "unsupported",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::DisabledByAdmin => "disabled_by_admin",
            ErrorCode::Unknown => "unknown",
        }
    }

    /// The code of an agent's refusal.
    pub fn from_agent(code: umbra_proto::ErrorCode) -> Self {
        use umbra_proto::ErrorCode as A;
        match code {
            A::NotFound => ErrorCode::NotFound,
            A::PermissionDenied => ErrorCode::PermissionDenied,
            A::SpawnFailed => ErrorCode::SpawnFailed,
            A::TooLarge => ErrorCode::TooLarge,
            A::BadRequest => ErrorCode::InvalidParams,
            A::NoSuchProcess => ErrorCode::NotFound,
            A::Unsupported => ErrorCode::Unsupported,
            A::Io | A::Protocol | A::IncompatibleVersion | A::DuplicateId | A::Other => ErrorCode::GuestError,
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// An error as a client sees it: a stable code and a message for people.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }

    pub fn invalid_params(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidParams, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Internal, message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_distinct_and_round_trip_by_name() {
        let mut seen = std::collections::HashSet::new();
        for code in ErrorCode::ALL {
            assert!(seen.insert(code.rpc_code()), "{code} reuses {}", code.rpc_code());
            let json = serde_json::to_string(&code).unwrap();
            assert_eq!(json, format!("\"{}\"", code.name()));
            assert_eq!(serde_json::from_str::<ErrorCode>(&json).unwrap(), code);
        }
        assert_eq!(serde_json::from_str::<ErrorCode>("\"from_the_future\"").unwrap(), ErrorCode::Unknown);
    }

    #[test]
    fn agent_not_found_is_not_found() {
        assert_eq!(ErrorCode::from_agent(umbra_proto::ErrorCode::NotFound), ErrorCode::NotFound);
        assert_eq!(ErrorCode::from_agent(umbra_proto::ErrorCode::PermissionDenied), ErrorCode::PermissionDenied);
    }
}
