//! [`SessionEvent`]: everything that happens to sessions and their processes, in one type.
//!
//! The runtime emits these; `vmctl --json` prints them one per line, umbrad sends them as
//! JSON-RPC notifications, and the tests assert on them. Lifecycle events go to every
//! subscriber; a process's output goes only to whoever spawned it (with flow control), so a
//! fast process never floods an observer.

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use umbra_proto::{ChangeKind, FileKind, ShareMode};

use crate::error::ApiError;
use crate::session::SessionStatus;

/// One event. `session` is absent for events about the host (bundle downloads).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SessionEvent {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// Milliseconds since the epoch.
    pub time_ms: u64,
    #[serde(flatten)]
    pub kind: EventKind,
}

impl SessionEvent {
    pub fn new(session: Option<&str>, kind: EventKind) -> Self {
        Self { session: session.map(str::to_string), time_ms: now_ms(), kind }
    }

    /// The event's name, as it appears in its `event` field.
    pub fn name(&self) -> &'static str {
        self.kind.name()
    }

    /// Whether it belongs to a process's own stream (its owner gets it), rather than to the
    /// lifecycle events every subscriber gets.
    pub fn is_process_output(&self) -> bool {
        matches!(self.kind, EventKind::Stdout { .. } | EventKind::Stderr { .. })
    }
}

/// Milliseconds since the epoch.
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// What happened. The tag is the `event` field.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum EventKind {
    /// The session's status changed.
    Status {
        status: SessionStatus,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    /// The boot waits for a slot: `position` boots are ahead of it (1 = next).
    BootQueued {
        position: u32,
    },
    /// The VM is up and its agent answers.
    Ready {
        backend: String,
        /// Why this backend (what `auto` saw).
        why: String,
        boot_ms: u64,
        bundle: String,
    },
    /// Starting (or restarting) failed.
    StartupError {
        error: ApiError,
    },
    /// The VM stopped answering or went away; a restart follows unless the session gives up.
    HeartbeatFailure {
        reason: String,
    },
    /// The VM is being booted again after a failure.
    Restarting {
        /// 1 for the first restart in the current window.
        attempt: u32,
        reason: String,
        /// Back-off before this boot.
        delay_ms: u64,
    },
    /// The session gave up after too many failures.
    Failed {
        reason: String,
        /// The last console lines of the VM that failed.
        console: String,
    },
    /// Stopped after `idle_secs` with no running process and no client activity.
    IdleStop {
        idle_secs: u64,
    },
    /// Suspended into a snapshot after `idle_secs` idle (`idle_action: suspend`); the next call
    /// naming the session restores it. Since API 1.8.
    IdleSuspend {
        idle_secs: u64,
    },
    /// umbrad's configuration or the machine's system policy changed: `what` is
    /// `configuration` (by `config.set`, or its file edited) or `system_policy` (its file
    /// edited); `path` is the file. Host event. Since API 1.8.
    ConfigChanged {
        what: String,
        path: PathBuf,
    },
    /// A folder is shared (at start, after a restart or resume, or by `folder.mount`).
    FolderMounted {
        name: String,
        host_path: PathBuf,
        guest_path: String,
        mode: ShareMode,
    },
    FolderUnmounted {
        name: String,
    },
    /// Unapplied shadow changes saved before the VM was replaced.
    ShadowExported {
        folder: String,
        /// A tar with the changed files and a list of deletions.
        path: PathBuf,
    },
    /// Unapplied shadow changes could not be saved (the agent did not answer): they are lost.
    ShadowLost {
        folder: String,
        reason: String,
    },
    /// What a shadow folder's guest side changed (`vmctl run --shadow-diff`), as captured in
    /// change-set `changeset`.
    ShadowDiff {
        folder: String,
        changeset: String,
        changes: Vec<ShadowEntry>,
    },
    /// A shadow folder's changes were written to the host folder (`vmctl run --shadow-apply`).
    ShadowApplied {
        folder: String,
        report: ShadowApplyReport,
    },
    /// A file appeared in the session's outputs folder. `path` is relative to it.
    OutputsFileCreated {
        path: String,
        host_path: PathBuf,
    },
    OutputsFileDeleted {
        path: String,
        host_path: PathBuf,
    },
    /// A process started.
    Spawned {
        process: u64,
        /// Its pid in the guest.
        pid: u32,
        argv: Vec<String>,
    },
    /// A process could not be started.
    SpawnFailed {
        process: u64,
        error: ApiError,
    },
    /// Output of a process (to its owner only).
    Stdout {
        process: u64,
        #[serde(flatten)]
        data: Data,
        /// Where in the stream `data` starts, for a kept process (`process.attach`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        offset: Option<u64>,
    },
    /// Error output of a process (to its owner only).
    Stderr {
        process: u64,
        #[serde(flatten)]
        data: Data,
        /// Where in the stream `data` starts, for a kept process (`process.attach`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        offset: Option<u64>,
    },
    /// A process ended. Its output all came before this; nothing about it follows.
    Exit(ProcessExit),
    /// The host decided on a connection (or a DNS lookup) the guest asked for.
    Egress {
        /// The name asked for (or an address literal).
        name: String,
        /// 0 for a DNS lookup.
        port: u16,
        /// How it reached the guest agent.
        via: umbra_proto::egress::EgressVia,
        allowed: bool,
        /// Why it was refused (or failed), when it was.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
        /// The address the host connected to (or that the name resolved to).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        address: Option<String>,
    },
    /// An allowed connection closed.
    EgressClosed {
        name: String,
        port: u16,
        /// Bytes from the guest to the destination.
        bytes_sent: u64,
        /// Bytes from the destination to the guest.
        bytes_received: u64,
        duration_ms: u64,
    },
    /// A command needs a person's approval before it runs (the session's approval settings,
    /// or a hook, said `ask`): answer with `permission.respond`. No answer within
    /// `timeout_secs` denies it.
    PermissionRequest {
        request_id: String,
        /// What is asked for: a command to run (`process.spawn` under approval settings), or a
        /// connection to a name outside a session's allowlist (network mode `ask`).
        #[serde(default)]
        kind: PermissionKind,
        /// The command line as the rules saw it (argv, shell-quoted). Commands only.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        command: String,
        /// Its working directory in the guest. Commands only.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        cwd: String,
        /// The variables it would run with on top of the guest's defaults (the spawn's `env`).
        #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
        env: std::collections::BTreeMap<String, String>,
        /// The names in `env` that change what runs (`PATH`, `LD_PRELOAD`, `BASH_ENV`, `GIT_*`,
        /// `PYTHONPATH`, `NODE_OPTIONS`, …): worth a person's look before approving.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        env_changes_what_runs: Vec<String>,
        /// What the rules decided and why; `parts` are the simple commands it runs (the
        /// candidates for an allow list). Commands only.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        decision: Option<umbra_policy::approval::Decision>,
        /// The name (or address) the guest wants to connect to. Network only.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        host: Option<String>,
        /// Its port. Network only.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        port: Option<u16>,
        /// How the connection reached the agent (`http`, `socks`, `transparent`). Network only.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        via: Option<umbra_proto::egress::EgressVia>,
        /// The guest process that opened the connection, where the guest's agent could tell
        /// (`pid`, `command`): what the guest reports, so something to show, not to trust.
        /// Network only.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        process: Option<umbra_proto::egress::EgressProcess>,
        /// Seconds until silence counts as denied.
        timeout_secs: u64,
    },
    /// A guest program started listening on a TCP port an exposed port reaches (loopback or
    /// wildcard). `exposed`: where the host listens for it, when it is exposed (at once, with
    /// the session's `auto_expose`).
    PortOpened {
        port: u16,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        process: Option<umbra_proto::egress::EgressProcess>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        exposed: Option<crate::ports::PortInfo>,
    },
    /// Nothing in the guest listens on `port` any more (an automatic exposure of it ends).
    PortClosed {
        port: u16,
    },
    /// The proxy put a secret's value in place of its placeholder, in a request to a host the
    /// secret is bound to. Never the value.
    SecretUsed {
        name: String,
        host: String,
    },
    /// A secret's placeholder went to a host it is not bound to: it was passed on as the
    /// placeholder, never the value.
    SecretWithheld {
        name: String,
        host: String,
    },
    /// The session's SSH agent signed a login with key `key` to `host`.
    SshSigned {
        key: String,
        host: String,
    },
    /// The session's SSH agent refused to sign with key `key`, saying why (another server, no
    /// session binding, a forwarded agent).
    SshRefused {
        key: String,
        reason: String,
    },
    /// The proxy terminated the guest's TLS to `host` (a host a secret is bound to) and made
    /// its own verified connection upstream; `error` when that failed (the guest got a 502).
    TlsIntercepted {
        host: String,
        port: u16,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
    /// A permission request was answered (or timed out).
    PermissionResolved {
        request_id: String,
        approved: bool,
        /// `approved`, `denied by the user`, or `no answer within N s`.
        reason: String,
    },
    /// A language server started with `lsp.start` sent a notification (`window/logMessage`,
    /// `textDocument/publishDiagnostics`, `$/progress`, ...), as it sent it.
    LspNotification {
        /// The server's id (`lsp.start`).
        server: u64,
        method: String,
        #[serde(default)]
        params: serde_json::Value,
    },
    /// A bundle download made progress.
    DownloadProgress(umbra_bundle::Progress),
    /// Something failed outside any one request (`vmctl run` reports its own errors so).
    Error {
        error: ApiError,
    },
}

impl EventKind {
    pub fn name(&self) -> &'static str {
        match self {
            EventKind::Status { .. } => "status",
            EventKind::BootQueued { .. } => "boot_queued",
            EventKind::Ready { .. } => "ready",
            EventKind::StartupError { .. } => "startup_error",
            EventKind::HeartbeatFailure { .. } => "heartbeat_failure",
            EventKind::Restarting { .. } => "restarting",
            EventKind::Failed { .. } => "failed",
            EventKind::IdleStop { .. } => "idle_stop",
            EventKind::IdleSuspend { .. } => "idle_suspend",
            EventKind::ConfigChanged { .. } => "config_changed",
            EventKind::FolderMounted { .. } => "folder_mounted",
            EventKind::LspNotification { .. } => "lsp_notification",
            EventKind::FolderUnmounted { .. } => "folder_unmounted",
            EventKind::ShadowExported { .. } => "shadow_exported",
            EventKind::ShadowLost { .. } => "shadow_lost",
            EventKind::ShadowDiff { .. } => "shadow_diff",
            EventKind::ShadowApplied { .. } => "shadow_applied",
            EventKind::OutputsFileCreated { .. } => "outputs_file_created",
            EventKind::OutputsFileDeleted { .. } => "outputs_file_deleted",
            EventKind::Spawned { .. } => "spawned",
            EventKind::SpawnFailed { .. } => "spawn_failed",
            EventKind::Stdout { .. } => "stdout",
            EventKind::Stderr { .. } => "stderr",
            EventKind::Exit(_) => "exit",
            EventKind::Egress { .. } => "egress",
            EventKind::EgressClosed { .. } => "egress_closed",
            EventKind::PermissionRequest { .. } => "permission_request",
            EventKind::PermissionResolved { .. } => "permission_resolved",
            EventKind::PortOpened { .. } => "port_opened",
            EventKind::PortClosed { .. } => "port_closed",
            EventKind::SecretUsed { .. } => "secret_used",
            EventKind::SecretWithheld { .. } => "secret_withheld",
            EventKind::TlsIntercepted { .. } => "tls_intercepted",
            EventKind::SshSigned { .. } => "ssh_signed",
            EventKind::SshRefused { .. } => "ssh_refused",
            EventKind::DownloadProgress(_) => "download_progress",
            EventKind::Error { .. } => "error",
        }
    }
}

/// What a `permission_request` asks for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PermissionKind {
    /// A command, before it runs.
    #[default]
    Command,
    /// A connection to a name outside the session's allowlist, held while the user decides.
    Network,
}

/// How far a `permission.respond` approval reaches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PermissionScope {
    /// This request only (every connection waiting on it).
    #[default]
    Once,
    /// A network request: the name for the rest of the session in this umbrad; later
    /// connections to it are not asked again. (For a command, the same as `once`.)
    Session,
    /// A command: it runs, and its commands (the request's `decision.parts`) join the
    /// session's allow list, so they run without asking from now on. A network request: as
    /// `session`. Since API 1.8.
    Always,
}

/// An answer to a `permission_request`, as one word (`permission.respond`'s `decision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PermissionDecision {
    /// Approved, this request only.
    AllowOnce,
    /// Approved, and allowed from now on (scope `always`).
    AllowAlways,
    Deny,
}

impl PermissionDecision {
    /// As `approved` and `scope`.
    pub fn answer(self) -> (bool, PermissionScope) {
        match self {
            PermissionDecision::AllowOnce => (true, PermissionScope::Once),
            PermissionDecision::AllowAlways => (true, PermissionScope::Always),
            PermissionDecision::Deny => (false, PermissionScope::Once),
        }
    }
}

impl PermissionScope {
    pub fn is_once(&self) -> bool {
        *self == PermissionScope::Once
    }
}

/// How a process ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ProcessExit {
    pub process: u64,
    /// The exit code, when it exited by itself.
    pub code: Option<i32>,
    /// The signal that ended it. A process whose VM went away is reported killed by SIGKILL (9)
    /// with `lost` set.
    pub signal: Option<i32>,
    pub duration_ms: u64,
    /// It was stopped because its timeout passed.
    #[serde(default)]
    pub timed_out: bool,
    /// The first signal the host forwarded to it (Ctrl-C in `vmctl`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interrupted: Option<i32>,
    /// Its end was not reported by the guest: the VM failed, restarted or stopped. `reason`
    /// says which.
    #[serde(default)]
    pub lost: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Exit status for a command whose process vanished with its VM (Docker's "the daemon failed").
pub const EXIT_UMBRA_ERROR: i32 = 125;
/// Exit status for a command that could not be executed.
pub const EXIT_CANNOT_RUN: i32 = 126;
/// Exit status for a command that was not found.
pub const EXIT_NOT_FOUND: i32 = 127;
/// Exit status after a timeout, as coreutils `timeout` gives.
pub const EXIT_TIMED_OUT: i32 = 124;

impl ProcessExit {
    /// The status a shell would give: the code, or 128 + signal; 124 after a timeout; 128 +
    /// the forwarded signal when the command failed after being interrupted (as a shell
    /// reports Ctrl-C); 125 when the process was lost with its VM.
    pub fn shell_status(&self) -> i32 {
        if self.lost {
            return EXIT_UMBRA_ERROR;
        }
        if self.timed_out {
            return EXIT_TIMED_OUT;
        }
        let own = match (self.code, self.signal) {
            (Some(c), _) => c,
            (None, Some(s)) => s.saturating_add(128),
            (None, None) => EXIT_UMBRA_ERROR,
        };
        match self.interrupted {
            Some(s) if own != 0 => s.saturating_add(128),
            _ => own,
        }
    }
}

/// The status a shell gives for a command that could not be started with this error.
pub fn spawn_failure_status(error: &ApiError) -> i32 {
    match error.code {
        crate::ErrorCode::NotFound => EXIT_NOT_FOUND,
        crate::ErrorCode::PermissionDenied | crate::ErrorCode::SpawnFailed => EXIT_CANNOT_RUN,
        _ => EXIT_UMBRA_ERROR,
    }
}

/// Bytes in JSON: `data` holds UTF-8 text as it is (`encoding` absent or `utf8`) or base64
/// (`encoding: base64`). Output uses text where it is valid UTF-8 without many control
/// characters; a chunk boundary can split a character, so one stream may mix both, and
/// decoding each chunk and concatenating gives the exact bytes. File contents are base64.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Data {
    pub data: String,
    #[serde(default, skip_serializing_if = "Encoding::is_utf8")]
    pub encoding: Encoding,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Encoding {
    #[default]
    Utf8,
    Base64,
}

impl Encoding {
    fn is_utf8(&self) -> bool {
        *self == Encoding::Utf8
    }
}

impl Data {
    /// Text when the bytes are UTF-8 that JSON carries without bloat; base64 otherwise (JSON
    /// escapes each control character as six bytes, so mostly-binary text is smaller in base64).
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let controls = bytes.iter().filter(|&&b| b < 0x20 && !matches!(b, b'\n' | b'\r' | b'\t')).count();
        match std::str::from_utf8(bytes) {
            Ok(text) if controls * 16 <= bytes.len() => Self { data: text.to_string(), encoding: Encoding::Utf8 },
            _ => Self::base64(bytes),
        }
    }

    /// Always base64 (for file contents, where text-or-not guessing buys nothing).
    pub fn base64(bytes: &[u8]) -> Self {
        Self { data: base64::engine::general_purpose::STANDARD.encode(bytes), encoding: Encoding::Base64 }
    }

    pub fn to_bytes(&self) -> Result<Vec<u8>, ApiError> {
        match self.encoding {
            Encoding::Utf8 => Ok(self.data.clone().into_bytes()),
            Encoding::Base64 => base64::engine::general_purpose::STANDARD
                .decode(&self.data)
                .map_err(|e| ApiError::invalid_params(format!("data is not valid base64: {e}"))),
        }
    }

    /// How many bytes the data decodes to, without decoding (exact for well-formed base64).
    pub fn byte_len(&self) -> usize {
        match self.encoding {
            Encoding::Utf8 => self.data.len(),
            Encoding::Base64 => {
                let padding = self.data.bytes().rev().take(2).filter(|&b| b == b'=').count();
                (self.data.len() / 4 * 3).saturating_sub(padding)
            }
        }
    }
}

/// One entry of a shadow folder's change-set: what the guest changed, as captured on the host
/// when the diff was taken. `shadow.apply` writes exactly these bytes (the `sha256`), never
/// what the guest holds by then.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ShadowEntry {
    /// Relative to the folder, `/`-separated.
    pub path: String,
    pub kind: ChangeKind,
    /// The entry is (for a deletion: was) a directory.
    #[serde(default)]
    pub is_dir: bool,
    /// What the guest has at `path`: absent for a deletion.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_kind: Option<FileKind>,
    /// Bytes captured, for an added or modified file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// Lowercase hex SHA-256 of the captured bytes, for an added or modified file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// Why a reviewer should look twice (empty: nothing special).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub risks: Vec<ShadowRisk>,
    /// Whether `shadow.apply` writes it without being told to.
    pub applies: ShadowApplies,
}

/// What makes a shadow change worth a second look.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ShadowRisk {
    /// In a `.git` directory (any depth): git runs what its config and hooks name.
    Git,
    /// A git hook (`.git/hooks/...`).
    GitHook,
    /// A path component starts with `.` (shell, editor and tool configuration).
    Dotfile,
    /// An executable file: new and executable, made executable, or replacing the contents of
    /// a host file that is executable (an apply keeps the host file's permissions).
    Executable,
    /// A symlink in the guest (never applied).
    Symlink,
    /// Neither a regular file, a directory nor a symlink in the guest (never applied).
    Special,
    /// Matched by the policy's `ignore` patterns: hidden from the guest, so a guest's version
    /// would replace a host file it never saw. For a deleted directory: one below it matches.
    Ignored,
}

/// When `shadow.apply` writes an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ShadowApplies {
    /// Applied unless `paths` leaves it out.
    ByDefault,
    /// Applied only when `paths` names it (`.git` and ignored paths).
    WhenNamed,
    /// Never: a symlink or special file, or `.git` under the policy's `block_git_writes`.
    Never,
}

/// What applying a shadow folder's changes did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ShadowApplyReport {
    /// Paths written to (or deleted from) the host folder.
    pub applied: Vec<String>,
    /// Paths the host changed since the share started: left alone.
    pub conflicts: Vec<ShadowConflict>,
    pub errors: Vec<ShadowApplyError>,
    /// Entries of the change-set not applied: not named although they must be, or never
    /// applied (see [`ShadowApplies`]).
    #[serde(default)]
    pub skipped: Vec<ShadowSkipped>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ShadowSkipped {
    pub path: String,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ShadowConflict {
    pub path: String,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ShadowApplyError {
    pub path: String,
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_have_their_name_as_tag_and_round_trip() {
        let ev = SessionEvent::new(
            Some("s1"),
            EventKind::Stdout { process: 3, data: Data::from_bytes(b"hi\n"), offset: None },
        );
        let json = serde_json::to_string(&ev).unwrap();
        assert!(json.contains("\"event\":\"stdout\""), "{json}");
        assert!(json.contains("\"data\":\"hi\\n\""), "{json}");
        assert!(!json.contains("encoding"), "utf-8 is the default: {json}");
        assert_eq!(serde_json::from_str::<SessionEvent>(&json).unwrap(), ev);

        let exit = SessionEvent::new(
            None,
            EventKind::Exit(ProcessExit {
                process: 1,
                code: Some(7),
                signal: None,
                duration_ms: 5,
                timed_out: false,
                interrupted: None,
                lost: false,
                reason: None,
            }),
        );
        let json = serde_json::to_string(&exit).unwrap();
        assert!(json.contains("\"event\":\"exit\"") && json.contains("\"code\":7"), "{json}");
        assert!(!json.contains("session"), "{json}");
        assert_eq!(serde_json::from_str::<SessionEvent>(&json).unwrap(), exit);
    }

    #[test]
    fn binary_output_survives_as_base64_even_split_mid_character() {
        let text = "héllo".as_bytes();
        let (a, b) = text.split_at(2); // inside the two-byte é
        let chunks = [Data::from_bytes(a), Data::from_bytes(b)];
        assert!(chunks.iter().all(|c| c.encoding == Encoding::Base64));
        assert_eq!(Data::from_bytes(&[0u8; 64]).encoding, Encoding::Base64, "NULs would cost six bytes each");
        assert_eq!(Data::from_bytes(b"\x1b[1mbold\x1b[0m, then a line of plain text\n").encoding, Encoding::Utf8);
        let joined: Vec<u8> = chunks.iter().flat_map(|c| c.to_bytes().unwrap()).collect();
        assert_eq!(joined, text);
        assert!(Data { data: "!!".into(), encoding: Encoding::Base64 }.to_bytes().is_err());
        for n in 0..7 {
            let bytes = vec![0xffu8; n];
            assert_eq!(Data::base64(&bytes).byte_len(), n);
        }
    }

    #[test]
    fn shell_status_mapping() {
        let base = ProcessExit {
            process: 1,
            code: None,
            signal: None,
            duration_ms: 0,
            timed_out: false,
            interrupted: None,
            lost: false,
            reason: None,
        };
        let with = |f: &dyn Fn(&mut ProcessExit)| {
            let mut e = base.clone();
            f(&mut e);
            e.shell_status()
        };
        assert_eq!(with(&|e| e.code = Some(3)), 3);
        assert_eq!(with(&|e| e.signal = Some(15)), 143);
        assert_eq!(with(&|e| (e.signal, e.timed_out) = (Some(15), true)), 124);
        assert_eq!(with(&|e| (e.code, e.interrupted) = (Some(1), Some(2))), 130);
        assert_eq!(with(&|e| (e.code, e.interrupted) = (Some(0), Some(2))), 0, "a clean exit after Ctrl-C is clean");
        assert_eq!(with(&|e| (e.signal, e.lost) = (Some(9), true)), 125);
        assert_eq!(with(&|e| e.signal = Some(i32::MAX)), i32::MAX, "a hostile signal number saturates");
        assert_eq!(spawn_failure_status(&ApiError::new(crate::ErrorCode::NotFound, "x")), 127);
    }
}
