//! Ports forwarded into the guest (since 1.7). For each TCP connection to an exposed port, the
//! host opens a stream to the agent's [`FORWARD_VSOCK_PORT`], sends one [`ForwardRequest`] line
//! (JSON, ended by `\n`, at most [`MAX_FORWARD_LINE`] bytes) naming the guest port, and reads
//! one [`ForwardReply`] line. On `ok` the stream carries the connection's bytes both ways: the
//! agent has connected to that port on the guest's loopback.

use serde::{Deserialize, Serialize};

/// The vsock port the agent accepts forwarded connections on.
pub const FORWARD_VSOCK_PORT: u32 = 1027;

/// Longest request or reply line, newline included.
pub const MAX_FORWARD_LINE: usize = 512;

/// What the host asks for: a connection to `port` on the guest's loopback.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForwardRequest {
    pub port: u16,
}

/// The agent's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForwardReply {
    pub ok: bool,
    /// Why not, for people (`connection refused: nothing listens on port 8000`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl ForwardRequest {
    pub fn to_line(&self) -> Vec<u8> {
        line(self)
    }
}

impl ForwardReply {
    pub fn ok() -> Self {
        Self { ok: true, reason: None }
    }

    pub fn refused(reason: impl Into<String>) -> Self {
        Self { ok: false, reason: Some(reason.into()) }
    }

    pub fn to_line(&self) -> Vec<u8> {
        line(self)
    }
}

fn line<T: Serialize>(value: &T) -> Vec<u8> {
    let mut v = serde_json::to_vec(value).expect("forward messages serialize");
    v.push(b'\n');
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip_and_stay_short() {
        let r = ForwardRequest { port: 8000 };
        assert_eq!(r.to_line(), b"{\"port\":8000}\n");
        assert!(serde_json::from_slice::<ForwardRequest>(b"{\"port\":70000}").is_err());
        let reply = ForwardReply::refused("x".repeat(100));
        assert!(reply.to_line().len() < MAX_FORWARD_LINE);
        assert_eq!(serde_json::from_slice::<ForwardReply>(b"{\"ok\":true}").unwrap(), ForwardReply::ok());
    }
}
