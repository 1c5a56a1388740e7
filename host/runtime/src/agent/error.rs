use umbra_proto::ErrorBody;

/// What went wrong talking to the agent. Each variant says which side failed and why.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to {path}: {reason}")]
    Connect { path: String, reason: String },
    #[error("hybrid vsock handshake on {path} failed: {reason}")]
    HybridVsock { path: String, reason: String },
    #[error("agent handshake failed: {0}")]
    Handshake(String),
    #[error("agent speaks an incompatible protocol: {0}")]
    IncompatibleVersion(String),
    #[error("agent refused the request: {0}")]
    Agent(ErrorBody),
    #[error("agent connection lost: {0}")]
    ConnectionLost(String),
    #[error("agent sent an unexpected reply: {0}")]
    Protocol(String),
    #[error("timed out after {0:?} waiting for the agent")]
    Timeout(std::time::Duration),
    #[error("request too large: {0}")]
    TooLarge(String),
    #[error("on this host: {0}")]
    Host(String),
}

impl ClientError {
    /// The agent's error, if the agent itself refused.
    pub fn agent_error(&self) -> Option<&ErrorBody> {
        match self {
            ClientError::Agent(e) => Some(e),
            _ => None,
        }
    }
}
