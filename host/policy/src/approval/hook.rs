//! Hooks (Cursor's `beforeShellExecution`): an executable the host runs before a command.
//!
//! It gets the request as one JSON object on stdin —
//! `{"command", "cwd", "workspace", "session", "env", "env_changes_what_runs", "parts",
//! "verdict", "reason"}` — `env` the command's own variables, `env_changes_what_runs` the names
//! among them that change what runs, the last three being what the rules decided — and answers on stdout with `{"permission": "allow" | "deny" |
//! "ask", "reason": "…"}` (or just the bare word), exiting 0, within its timeout. Anything else
//! — no answer in time, a non-zero exit, output that is not an answer — is a failure, which the
//! caller turns into `ask`: a broken hook never lets a command through, and never silently
//! blocks one either. The hook is killed when its time is up; its output is read up to
//! [`MAX_HOOK_OUTPUT`] bytes.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::decision::{CommandRequest, Decision, Reason, Verdict};

/// The most a hook may print.
pub const MAX_HOOK_OUTPUT: u64 = 64 * 1024;

/// An executable asked about each command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct HookSpec {
    /// Path of the executable.
    pub command: PathBuf,
    /// Its arguments.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// How long it may take to answer (default 5000).
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
}

fn default_timeout_ms() -> u64 {
    5000
}

/// A hook's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct HookAnswer {
    pub permission: Verdict,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Why a hook gave no answer.
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    #[error("cannot start it: {0}")]
    Spawn(std::io::Error),
    #[error("no answer within {0} ms")]
    Timeout(u64),
    #[error("reading its answer: {0}")]
    Io(std::io::Error),
    #[error("it exited with {0}")]
    Exit(std::process::ExitStatus),
    #[error("its answer {0:?} is not allow, deny or ask")]
    BadAnswer(String),
}

#[derive(Serialize)]
struct HookInput<'a> {
    command: &'a str,
    cwd: &'a std::path::Path,
    workspace: &'a [PathBuf],
    session: Option<&'a str>,
    env: &'a std::collections::BTreeMap<String, String>,
    env_changes_what_runs: Vec<String>,
    parts: &'a [Vec<String>],
    verdict: Verdict,
    reason: &'a Reason,
}

/// Runs one hook on a request and returns its answer.
pub async fn run(spec: &HookSpec, request: &CommandRequest, so_far: &Decision) -> Result<HookAnswer, HookError> {
    let input = HookInput {
        command: &request.command,
        cwd: &request.cwd,
        workspace: &request.workspace,
        session: request.session.as_deref(),
        env: &request.env,
        env_changes_what_runs: super::env::what_changes_what_runs(&request.env),
        parts: &so_far.parts,
        verdict: so_far.verdict,
        reason: &so_far.reason,
    };
    let mut input = serde_json::to_vec(&input).expect("the hook input serializes");
    input.push(b'\n');
    let limit = Duration::from_millis(spec.timeout_ms);
    tokio::time::timeout(limit, ask(spec, input)).await.map_err(|_| HookError::Timeout(spec.timeout_ms))?
}

async fn ask(spec: &HookSpec, input: Vec<u8>) -> Result<HookAnswer, HookError> {
    let mut child = spawn(spec).await?;
    let mut stdin = child.stdin.take().expect("stdin is piped");
    // A hook may answer without reading its input; a broken pipe is then no error.
    let writer = tokio::spawn(async move {
        let _ = stdin.write_all(&input).await;
    });
    let mut out = Vec::new();
    let stdout = child.stdout.take().expect("stdout is piped");
    stdout.take(MAX_HOOK_OUTPUT).read_to_end(&mut out).await.map_err(HookError::Io)?;
    let status = child.wait().await.map_err(HookError::Io)?;
    writer.abort();
    if !status.success() {
        return Err(HookError::Exit(status));
    }
    parse_answer(&String::from_utf8_lossy(&out))
}

/// Starts the hook, killed if the caller gives up on it. A script written just before (as in
/// tests) can be briefly busy (ETXTBSY) while another thread's fork still holds it open for
/// writing: retried a few times.
async fn spawn(spec: &HookSpec) -> Result<tokio::process::Child, HookError> {
    let mut attempts = 0;
    loop {
        let result = tokio::process::Command::new(&spec.command)
            .args(&spec.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn();
        match result {
            Err(e) if e.raw_os_error() == Some(libc_etxtbsy()) && attempts < 20 => {
                attempts += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            other => return other.map_err(HookError::Spawn),
        }
    }
}

/// ETXTBSY on Linux.
const fn libc_etxtbsy() -> i32 {
    26
}

fn parse_answer(out: &str) -> Result<HookAnswer, HookError> {
    let trimmed = out.trim();
    if let Ok(answer) = serde_json::from_str::<HookAnswer>(trimmed) {
        return Ok(answer);
    }
    let permission = match trimmed {
        "allow" => Verdict::Allow,
        "ask" => Verdict::Ask,
        "deny" => Verdict::Deny,
        _ => return Err(HookError::BadAnswer(trimmed.chars().take(200).collect())),
    };
    Ok(HookAnswer { permission, reason: None })
}
