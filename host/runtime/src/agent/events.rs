//! What a guest process reports to the host, as the connection's reader routes it.

use bytes::Bytes;
use umbra_proto::{ErrorBody, ExitStatus};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcessEvent {
    /// The agent started the process. Always the first event unless the spawn failed.
    Spawned {
        pid: u32,
    },
    /// The agent could not start it; no further events follow.
    SpawnFailed(ErrorBody),
    Stdout(Bytes),
    Stderr(Bytes),
    /// The process ended; all of its output came before this. No further events follow.
    Exit(ExitStatus),
    /// Something failed around the process. After a lost connection this is the last event.
    Error(String),
    /// Parked ([`super::AgentClient::park`]): nothing more comes here; another connection (or
    /// this one) adopts it with `token`. All of its output sent before came first.
    Parked {
        token: u64,
    },
}

/// Everything a process printed, and how it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessOutput {
    pub pid: u32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub status: ExitStatus,
}
