//! Network egress: how the guest asks the host for a connection.
//!
//! The guest has no network interface to the outside. Each connection a guest process opens
//! (through the agent's HTTP or SOCKS5 proxy, or captured transparently) becomes a new vsock
//! stream from the guest to host port [`EGRESS_VSOCK_PORT`]. It starts with one request line —
//! an [`EgressRequest`] as JSON, ended by `\n`, at most [`MAX_EGRESS_LINE`] bytes with the
//! newline — and the host answers with one [`EgressReply`] line. After a successful `connect`
//! the stream carries the connection's bytes both ways, unchanged; after anything else the
//! host closes it. A DNS lookup in the guest is a `resolve`: the host says whether the name may
//! be used (it answers only for allowed names, so names cannot smuggle data out), and the
//! guest answers its program with an address of its own choosing.
//!
//! The host decides by the name in the request — never by anything inside the stream (SNI, a
//! Host header) — resolves it itself, and connects only to an address it checked.

use serde::{Deserialize, Serialize};

/// The host vsock port egress streams connect to (guest → host).
pub const EGRESS_VSOCK_PORT: u32 = 1026;

/// Since 1.6: the guest agent's socket for the session's SSH agent (the host sets
/// `SSH_AUTH_SOCK` to it in sessions that hold keys); each connection becomes an
/// [`EgressRequest::SshAgent`] stream.
pub const SSH_AGENT_SOCKET: &str = "/run/umbra/ssh-agent.sock";

/// Longest request or reply line, newline included.
pub const MAX_EGRESS_LINE: usize = 1024;

/// Longest host name (RFC 1035: 253 characters in text form).
pub const MAX_EGRESS_NAME: usize = 253;

/// What the guest asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum EgressRequest {
    /// Open a TCP connection to `name:port`. `name` is a host name or an IP address literal
    /// (a program that connected to an address rather than a name).
    ///
    /// Since 1.7, `who`: the agent can say which guest process opened the connection; the
    /// host may then send an [`EgressQuery`] line before its reply (network mode `ask`, to
    /// name the process in its question), which the agent answers with one [`EgressProcess`]
    /// line. Without it the host never sends one.
    Connect {
        name: String,
        port: u16,
        via: EgressVia,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        who: bool,
    },
    /// May `name` be used? (A DNS query in the guest.)
    Resolve { name: String },
    /// Since 1.6: the stream carries the SSH agent protocol to the session's agent on the host.
    SshAgent,
}

/// How the connection reached the agent (for the host's events and decisions' records).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum EgressVia {
    /// A TCP connection redirected by the guest's netfilter rule.
    Transparent,
    /// The agent's HTTP proxy (CONNECT, or a plain `http://` request).
    Http,
    /// The agent's SOCKS5 proxy.
    Socks,
    /// The agent's DNS server (`resolve` requests).
    Dns,
}

/// Since 1.7: a line the host sends before its reply to a `connect` that set `who`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "query", rename_all = "snake_case")]
pub enum EgressQuery {
    /// Which guest process holds the connection's guest end?
    Process,
}

/// Longest [`EgressProcess::command`], in bytes.
pub const MAX_PROCESS_COMMAND: usize = 256;

/// The agent's answer to [`EgressQuery::Process`]: the process holding the guest end of the
/// connection, as the guest reports it — something to show a person, never to decide on (a
/// guest's root can make any process claim anything). Empty when it cannot be known (the
/// socket is gone, or belongs to no process the agent can see).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct EgressProcess {
    /// Its process id in the guest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// Its command line, arguments joined by spaces: at most 256 bytes, every control and
    /// invisible format character shown as `?` (it is printed on people's terminals).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub command: String,
}

impl EgressProcess {
    /// The same, made safe to show: the command cut to [`MAX_PROCESS_COMMAND`] bytes (on a
    /// character boundary) with control characters (escape sequences, line breaks, bidi
    /// overrides) replaced by `?`. Whoever receives one from a guest applies this.
    pub fn tidy(self) -> Self {
        let mut command = String::with_capacity(self.command.len().min(MAX_PROCESS_COMMAND));
        for c in self.command.chars() {
            let c = if c.is_control() || is_bidi_control(c) { '?' } else { c };
            if command.len() + c.len_utf8() > MAX_PROCESS_COMMAND {
                break;
            }
            command.push(c);
        }
        Self { pid: self.pid, command }
    }

    /// The answer as one line, newline included.
    pub fn to_line(&self) -> Vec<u8> {
        line(self)
    }
}

/// Characters that reorder or hide text on a terminal: bidirectional controls, zero-width and
/// other invisible format characters, line and paragraph separators.
fn is_bidi_control(c: char) -> bool {
    matches!(
        c,
        '\u{00ad}'
            | '\u{061c}'
            | '\u{180e}'
            | '\u{200b}'..='\u{200f}'
            | '\u{2028}'..='\u{202e}'
            | '\u{2060}'..='\u{206f}'
            | '\u{feff}'
            | '\u{fff9}'..='\u{fffb}'
    )
}

impl EgressQuery {
    /// The query as one line, newline included.
    pub fn to_line(&self) -> Vec<u8> {
        line(self)
    }
}

/// The host's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressReply {
    pub ok: bool,
    /// Why not, when `ok` is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal: Option<EgressRefusal>,
    /// For people: what was refused and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Why the host refused, so the guest can answer its program in kind (a DNS NXDOMAIN or
/// REFUSED, an HTTP 403 or 502, a SOCKS5 reply code, a closed connection).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum EgressRefusal {
    /// The session's network policy does not allow it.
    Denied,
    /// The name does not resolve.
    NotFound,
    /// Connecting failed or timed out.
    Unreachable,
    /// Too many connections are open for this VM.
    Busy,
    /// The request was malformed.
    BadRequest,
}

impl EgressReply {
    pub fn ok() -> Self {
        Self { ok: true, refusal: None, reason: None }
    }

    pub fn refused(refusal: EgressRefusal, reason: impl Into<String>) -> Self {
        Self { ok: false, refusal: Some(refusal), reason: Some(reason.into()) }
    }

    /// The reply as one line, newline included.
    pub fn to_line(&self) -> Vec<u8> {
        line(self)
    }
}

impl EgressRequest {
    /// The request as one line, newline included.
    pub fn to_line(&self) -> Vec<u8> {
        line(self)
    }

    /// Parses a request line (without its newline).
    pub fn parse(line: &[u8]) -> Result<Self, String> {
        if line.len() >= MAX_EGRESS_LINE {
            return Err(format!("request line longer than {MAX_EGRESS_LINE} bytes"));
        }
        serde_json::from_slice(line).map_err(|e| format!("invalid egress request: {e}"))
    }
}

fn line<T: Serialize>(value: &T) -> Vec<u8> {
    let mut v = serde_json::to_vec(value).expect("egress messages serialize");
    v.push(b'\n');
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip_and_are_bounded() {
        let r =
            EgressRequest::Connect { name: "example.com".into(), port: 443, via: EgressVia::Transparent, who: true };
        let line = r.to_line();
        assert_eq!(line.last(), Some(&b'\n'));
        assert_eq!(
            String::from_utf8_lossy(&line),
            "{\"op\":\"connect\",\"name\":\"example.com\",\"port\":443,\"via\":\"transparent\",\"who\":true}\n"
        );
        assert_eq!(EgressRequest::parse(&line[..line.len() - 1]).unwrap(), r);
        assert!(EgressRequest::parse(&vec![b' '; MAX_EGRESS_LINE]).is_err());
        assert!(EgressRequest::parse(b"{\"op\":\"connect\",\"name\":\"x\",\"port\":70000,\"via\":\"http\"}").is_err());
        let no = EgressReply::refused(EgressRefusal::Denied, "not in the allowlist");
        assert_eq!(
            String::from_utf8_lossy(&no.to_line()),
            "{\"ok\":false,\"refusal\":\"denied\",\"reason\":\"not in the allowlist\"}\n"
        );
    }

    #[test]
    fn a_process_is_tidied_before_anyone_shows_it() {
        let p = EgressProcess {
            pid: Some(7),
            command: "curl \u{1b}[2Jhttps://x\nallow? \u{202e}txt.exe\u{200b}\u{2028}".into(),
        };
        assert_eq!(p.tidy().command, "curl ?[2Jhttps://x?allow? ?txt.exe??");
        let long = EgressProcess { pid: None, command: "é".repeat(200) }.tidy();
        assert_eq!(long.command.len(), MAX_PROCESS_COMMAND);
        assert_eq!(serde_json::to_string(&EgressQuery::Process).unwrap(), r#"{"query":"process"}"#);
        // An old agent's request (no `who`) still parses; `who: false` is not sent.
        let old = EgressRequest::parse(br#"{"op":"connect","name":"x","port":1,"via":"http"}"#).unwrap();
        assert_eq!(old, EgressRequest::Connect { name: "x".into(), port: 1, via: EgressVia::Http, who: false });
        assert!(!String::from_utf8(old.to_line()).unwrap().contains("who"));
    }
}
