//! Processes a session keeps when their client goes (`process.spawn {detach: true}`) and the
//! terminals built on them (`terminal.*`): their output is kept on the host, bounded per
//! stream, so a client that comes back (`process.attach`, `terminal.attach`) receives it again
//! from an offset (`docs/sessions.md`, "Processes that outlive their client").

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use umbra_proto::TtySize;

use crate::event::ProcessExit;

/// Output kept on the host per stream of a kept process (a terminal's scrollback): beyond it,
/// the oldest bytes go, and a client attaching from before the kept start receives the output
/// from there (its first event's `offset` says where).
pub const KEPT_OUTPUT_BYTES: u64 = 1 << 20;
/// Kept processes and terminals a session holds at once, running or finished.
pub const MAX_KEPT: usize = 64;
/// How long a finished kept process's exit and output stay available.
pub const KEEP_FINISHED_SECS: u64 = 600;

/// Offsets into a kept process's output streams: bytes since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct OutputOffsets {
    #[serde(default)]
    pub stdout: u64,
    #[serde(default)]
    pub stderr: u64,
}

/// The output a session holds for a kept process, per stream: bytes `[start, end)`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct KeptRange {
    /// The offset of the oldest byte still kept.
    pub start: u64,
    /// Bytes written so far.
    pub end: u64,
}

/// Params of `process.list` and `terminal.list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct InSession {
    pub session: String,
}

/// A process as `process.list` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ProcessInfo {
    pub process: u64,
    /// Its pid in the guest.
    pub pid: u32,
    pub argv: Vec<String>,
    /// Kept by the session when its client goes (`detach`, or a terminal): it can be attached.
    pub detached: bool,
    /// A terminal (`terminal.open`).
    pub terminal: bool,
    /// Its exit, once it ended (kept processes only, for a while after).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit: Option<ProcessExit>,
    /// What of its output the session holds (kept processes only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout: Option<KeptRange>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr: Option<KeptRange>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ProcessList {
    pub processes: Vec<ProcessInfo>,
}

/// Params of `process.attach`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct AttachParams {
    pub session: String,
    pub process: u64,
    /// Where to start each stream (default: the start, or what is kept of it).
    #[serde(default)]
    pub from: OutputOffsets,
}

/// The result of `process.attach` and `terminal.attach`: `process.event` notifications follow,
/// output from the offsets asked for (each event's `offset` is its first byte's), then the
/// exit. Until the client detaches or goes, it owns a view of the process like a spawner:
/// `process.stdin`, `process.ack`, `process.kill` and `process.resize` act on it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Attached {
    pub process: u64,
    pub pid: u32,
    pub stdout: KeptRange,
    pub stderr: KeptRange,
    /// Its exit, if it already ended (the event follows the output too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit: Option<ProcessExit>,
}

/// Params of `terminal.open`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TerminalOpenParams {
    pub session: String,
    /// The shell's argv; default a login shell: `bash -l` where the image has bash, else `sh -l`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shell: Vec<String>,
    /// Its working directory in the guest (absolute).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// The terminal's size.
    pub size: TtySize,
}

/// A terminal: a kept process on a pseudo-terminal. Its id is a process id: write to it with
/// `process.stdin`, acknowledge its output with `process.ack`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TerminalInfo {
    pub terminal: u64,
    pub pid: u32,
    pub shell: Vec<String>,
    pub size: TtySize,
    /// Its scrollback: what the session holds of its output.
    pub output: KeptRange,
    /// The shell's exit, once it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit: Option<ProcessExit>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TerminalList {
    pub terminals: Vec<TerminalInfo>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TerminalRef {
    pub session: String,
    pub terminal: u64,
}

/// Params of `terminal.attach`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TerminalAttachParams {
    pub session: String,
    pub terminal: u64,
    /// Where to start (default: the start of the scrollback).
    #[serde(default)]
    pub from: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TerminalResizeParams {
    pub session: String,
    pub terminal: u64,
    pub rows: u16,
    pub cols: u16,
}

/// Params of `terminal.run`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TerminalRunParams {
    pub session: String,
    pub terminal: u64,
    /// A command line for the terminal's shell, run in the shell itself (so `cd` and variables
    /// stay for the next): it may hold several lines, at most 64 KiB.
    pub command: String,
    /// Give up waiting after this many seconds, counted from the call (the command keeps
    /// running); default: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
}

/// What `terminal.run`'s command left: its exit status and the shell's working directory
/// after it, reported by the shell itself through a marker with a nonce of this run (its
/// output went to the terminal, and to its attached clients, as any other).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TerminalRunResult {
    pub exit_code: i32,
    pub cwd: String,
}
