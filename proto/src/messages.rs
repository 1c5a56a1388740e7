//! Message bodies carried by control frames, as serde types.
//!
//! Control bodies are JSON. A Request or Response may carry a raw *attachment* (file contents)
//! after the JSON, separated by one NUL byte: a JSON text never contains a raw NUL, so the split
//! is unambiguous and file bytes need no base64. Stdio never goes through JSON (Data frames).

use std::collections::BTreeMap;

use bytes::{BufMut, Bytes, BytesMut};
use serde::{de::DeserializeOwned, Deserialize, Serialize};

use crate::frame::{Frame, FrameKind};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProtocolVersion {
    pub major: u16,
    pub minor: u16,
}

impl ProtocolVersion {
    /// Peers interoperate when their majors match.
    pub fn compatible_with(&self, other: &ProtocolVersion) -> bool {
        self.major == other.major
    }
}

impl std::fmt::Display for ProtocolVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// The first frame each side sends. The host speaks first; the agent answers with its own
/// Hello, or with an Error frame (`incompatible_version`) and closes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub protocol: ProtocolVersion,
    /// "umbra-agent 0.1.0", "umbra-runtime 0.1.0".
    pub software: String,
    /// Agent only: the guest's hostname.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// Agent only: whether it runs as PID 1 (inside a VM) or as an ordinary process (tests).
    #[serde(default)]
    pub pid1: bool,
    /// Optional features the sender supports, e.g. "pty", "files", "mount".
    #[serde(default)]
    pub capabilities: Vec<String>,
}

/// A request from the host; the frame id is the request id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "method", content = "params", rename_all = "snake_case")]
pub enum Request {
    Ping,
    /// Starts a process whose id is this request's id. The response is the spawn confirmation;
    /// no Data or Event frame of the process precedes it.
    Spawn(SpawnRequest),
    /// Ends the process's stdin after the stdin data already sent.
    CloseStdin {
        process: u32,
    },
    /// Sends `signal` to the process group of the process.
    Kill {
        process: u32,
        signal: i32,
    },
    /// Sends `signal` to every process of this connection.
    KillAll {
        signal: i32,
    },
    /// Sets the window size of a process spawned with a tty.
    Resize {
        process: u32,
        size: TtySize,
    },
    Stats,
    /// Reads at most `len` (≤ MAX_FILE_CHUNK) bytes at `offset`; data in the attachment.
    ReadFile {
        path: String,
        #[serde(default)]
        offset: u64,
        len: u32,
    },
    /// Writes the attachment (≤ MAX_FILE_CHUNK bytes) to `path`.
    WriteFile(WriteFileRequest),
    Stat {
        path: String,
    },
    ListDir {
        path: String,
        #[serde(default)]
        limit: Option<u32>,
    },
    /// Mounts a filesystem, e.g. a virtio-fs share by its tag.
    Mount(MountRequest),
    Unmount {
        path: String,
    },
    /// Since 1.1. Mounts the host folder `name` (a subdirectory of the virtio-fs tag
    /// [`SHARES_TAG`]) at `/sessions/<session>/mnt/<name>`; answers `shared {path}`.
    Share(ShareRequest),
    /// Since 1.1. Unmounts a shared folder (a shadow's changes are discarded).
    Unshare {
        session: String,
        name: String,
    },
    /// Since 1.1. What a `shadow` share's overlay changed relative to the host folder.
    ShadowDiff {
        session: String,
        name: String,
    },
    /// Since 1.1. Discards a `shadow` share's changes: the folder shows the host's again.
    ShadowReset {
        session: String,
        name: String,
    },
    /// Powers the guest off (as PID 1) or stops the agent (as an ordinary process).
    Shutdown,
    /// Since 1.5. Gives a guest restored from a snapshot its own identity: the attachment
    /// (32–512 bytes of host entropy) is credited to the kernel's pool and the CRNG reseeded,
    /// the clock is set, the hostname (and `/etc/machine-id`, where the image has one) changed.
    /// Only a PID-1 agent does this; any other answers `unsupported`.
    Reidentify(ReidentifyRequest),
    /// Since 1.6. Makes the guest trust `pem` (one CA certificate, the session's: the host's
    /// egress proxy signs with it for the hosts whose requests it reads): in the system store,
    /// in a bundle under `/run/umbra`, and in the variables every spawn gets from now on
    /// (`SSL_CERT_FILE`, `NODE_EXTRA_CA_CERTS`, …). A later call replaces the CA. Only a PID-1
    /// agent does this; any other answers `unsupported`.
    InstallCa {
        pem: String,
    },
    /// Since 1.7. The TCP ports guest programs listen on where an exposed port reaches them
    /// (a loopback or wildcard address), each with the process holding it where the agent can
    /// tell; the agent's own listeners are left out.
    Listening,
    /// Since 1.8. Parks the named processes of this connection: nothing more of theirs is sent
    /// on it (their output waits in their pipes, their exit with it) and they outlive it. The
    /// answer, `parked`, follows every frame of theirs sent before, and gives each a token;
    /// names that are not running processes of this connection are left out. The host parks
    /// what it keeps before a snapshot: the restore resets every vsock connection.
    Park {
        processes: Vec<u32>,
    },
    /// Since 1.8. Takes a parked process over: this request's id becomes its id on this
    /// connection, as a spawn's does, and the answer is `spawned {pid}`; its output and exit
    /// follow, within the initial credits. `not_found` when no process is parked with `token`.
    Adopt {
        token: u64,
    },
    /// Since 1.8. Kills every parked process nobody adopted (SIGKILL to its group).
    DropParked,
    /// Since 1.9. Answers an [`Event::ExecCheck`]: the exec goes on, or fails with EACCES.
    /// `not_found` when no check `check` waits (it was answered, or its caller died).
    ExecAnswer {
        check: u64,
        allow: bool,
    },
}

/// The capability an agent lists in its Hello when it knows `park`, `adopt` and `drop_parked`.
pub const CAP_PARK: &str = "park";

/// The longest CA certificate `InstallCa` takes.
pub const MAX_CA_PEM: usize = 16 * 1024;

/// See [`Request::Reidentify`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReidentifyRequest {
    /// 1–64 characters of letters, digits, '-' and '.'.
    pub hostname: String,
    /// The host's wall clock, in milliseconds since the Unix epoch.
    pub unix_time_ms: u64,
}

impl Request {
    pub fn method(&self) -> &'static str {
        match self {
            Request::Ping => "ping",
            Request::Spawn(_) => "spawn",
            Request::CloseStdin { .. } => "close_stdin",
            Request::Kill { .. } => "kill",
            Request::KillAll { .. } => "kill_all",
            Request::Resize { .. } => "resize",
            Request::Stats => "stats",
            Request::ReadFile { .. } => "read_file",
            Request::WriteFile(_) => "write_file",
            Request::Stat { .. } => "stat",
            Request::ListDir { .. } => "list_dir",
            Request::Mount(_) => "mount",
            Request::Unmount { .. } => "unmount",
            Request::Share(_) => "share",
            Request::Unshare { .. } => "unshare",
            Request::ShadowDiff { .. } => "shadow_diff",
            Request::ShadowReset { .. } => "shadow_reset",
            Request::Shutdown => "shutdown",
            Request::Reidentify(_) => "reidentify",
            Request::InstallCa { .. } => "install_ca",
            Request::Listening => "listening",
            Request::Park { .. } => "park",
            Request::Adopt { .. } => "adopt",
            Request::DropParked => "drop_parked",
            Request::ExecAnswer { .. } => "exec_answer",
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpawnRequest {
    /// argv[0] is looked up in PATH when it has no slash.
    pub argv: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Added to the agent's base environment (PATH, HOME, TERM); entries here win.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
    /// Run on a pseudo-terminal of this size; its output arrives on the stdout channel.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tty: Option<TtySize>,
    /// Since 1.9, with [`crate::CAP_EXEC_GATE`]: check every exec of the process and its
    /// descendants (after the first exec of `argv` itself, which the host already decided on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exec_gate: Option<crate::ExecGate>,
}

#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TtySize {
    pub rows: u16,
    pub cols: u16,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteFileRequest {
    pub path: String,
    #[serde(default)]
    pub mode: WriteMode,
    /// Permission bits for a file this request creates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permissions: Option<u32>,
    /// Create missing parent directories.
    #[serde(default)]
    pub create_dirs: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "offset")]
pub enum WriteMode {
    #[default]
    Truncate,
    Append,
    At(u64),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountRequest {
    /// virtio-fs tag, or a device/source path for other filesystem types.
    pub source: String,
    pub target: String,
    #[serde(default = "default_fs_type")]
    pub fs_type: String,
    #[serde(default)]
    pub read_only: bool,
    /// Bind the guest directory `source` at `target` instead (`fs_type` is ignored); with
    /// `read_only`, the bind is read-only. Since protocol 1.3.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub bind: bool,
}

fn default_fs_type() -> String {
    "virtiofs".into()
}

/// The virtio-fs tag under which the host serves every shared folder of a VM, each as a
/// subdirectory named like the share.
pub const SHARES_TAG: &str = "umbra";

/// Longest session or share name, in bytes.
pub const MAX_SHARE_NAME: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShareRequest {
    /// Session name: one path component of `[A-Za-z0-9._-]`, not `.` or `..`, at most
    /// [`MAX_SHARE_NAME`] bytes.
    pub session: String,
    /// Share name, the host folder's subdirectory under the tag; same rules as `session`.
    pub name: String,
    pub mode: ShareMode,
}

/// How a shared folder is mounted in the guest.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ShareMode {
    /// Read-only (enforced by the host, and by a read-only bind in the guest).
    Ro,
    /// Create and modify; spawned processes may not unlink, rmdir or rename (landlock).
    Rw,
    /// Read, write and delete.
    Rwd,
    /// The host folder read-only under an overlay whose writable layer lives in the guest.
    Shadow,
}

impl ShareMode {
    pub fn as_str(self) -> &'static str {
        match self {
            ShareMode::Ro => "ro",
            ShareMode::Rw => "rw",
            ShareMode::Rwd => "rwd",
            ShareMode::Shadow => "shadow",
        }
    }

    /// Whether guest activity may change the host folder directly (a shadow share's host
    /// folder only changes through an explicit apply). The host binds the others read-only.
    pub fn host_writable(self) -> bool {
        matches!(self, ShareMode::Rw | ShareMode::Rwd)
    }
}

impl std::fmt::Display for ShareMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseShareModeError(pub String);

impl std::fmt::Display for ParseShareModeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "unknown share mode {:?} (expected ro, rw, rwd or shadow)", self.0)
    }
}

impl std::error::Error for ParseShareModeError {}

impl std::str::FromStr for ShareMode {
    type Err = ParseShareModeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "ro" => Ok(ShareMode::Ro),
            "rw" => Ok(ShareMode::Rw),
            "rwd" => Ok(ShareMode::Rwd),
            "shadow" => Ok(ShareMode::Shadow),
            _ => Err(ParseShareModeError(s.to_owned())),
        }
    }
}

/// One change of a shadow share, relative to the host folder.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShadowChange {
    /// Relative to the share's root, `/`-separated; never empty, never `..`. Names that are not
    /// UTF-8 are shown lossily (U+FFFD).
    pub path: String,
    pub kind: ChangeKind,
    /// Size in the guest of an added or modified file or symlink; absent for directories and
    /// deletions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// The entry is (for a deletion: was) a directory. A deleted directory is one entry.
    #[serde(default)]
    pub is_dir: bool,
}

#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChangeKind {
    Added,
    Modified,
    Deleted,
}

/// The answer to one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Response {
    Ok(ResponseBody),
    Error(ErrorBody),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseBody {
    Done,
    Pong {
        uptime_ms: u64,
    },
    Spawned {
        pid: u32,
    },
    Stats(Stats),
    /// File bytes are the attachment; `eof` is true when the read reached the end of the file.
    FileData {
        len: u32,
        eof: bool,
    },
    Written {
        bytes: u64,
    },
    Stat(FileStat),
    DirList {
        entries: Vec<DirEntry>,
        truncated: bool,
    },
    /// A share is mounted at `path` in the guest.
    Shared {
        path: String,
    },
    /// `truncated`: more changes exist than were listed (entry cap or frame budget).
    ShadowDiff {
        changes: Vec<ShadowChange>,
        truncated: bool,
    },
    Listening {
        ports: Vec<ListeningPort>,
    },
    Parked {
        processes: Vec<ParkedProcess>,
    },
}

/// A process `park` parked: its id on the connection that parked it, and the token that
/// adopts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParkedProcess {
    pub process: u32,
    pub token: u64,
}

/// A TCP port a guest program listens on (`Request::Listening`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListeningPort {
    pub port: u16,
    /// The process holding it, as the guest reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process: Option<crate::egress::EgressProcess>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    pub mem_total_kib: u64,
    pub mem_available_kib: u64,
    /// Load averages ×100 (integers keep the type `Eq` and the JSON exact).
    pub load_x100: [u32; 3],
    /// Every process the kernel knows in this guest (or host, in tests).
    pub processes: u32,
    /// Processes this agent is tracking across all connections.
    pub agent_processes: u32,
    pub uptime_ms: u64,
}

#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

impl From<std::fs::FileType> for FileKind {
    /// The kind of what `lstat` found (a symlink is a symlink, not its target).
    fn from(ft: std::fs::FileType) -> Self {
        if ft.is_symlink() {
            FileKind::Symlink
        } else if ft.is_dir() {
            FileKind::Dir
        } else if ft.is_file() {
            FileKind::File
        } else {
            FileKind::Other
        }
    }
}

#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStat {
    pub kind: FileKind,
    pub size: u64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime_ms: i64,
}

#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    pub name: String,
    pub kind: FileKind,
    pub size: u64,
}

/// What went wrong, for a Response error or an Error frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct ErrorBody {
    pub code: ErrorCode,
    pub message: String,
}

impl ErrorBody {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The frame could not be decoded or violated the protocol.
    Protocol,
    IncompatibleVersion,
    /// The request was well-framed JSON but not a valid request.
    BadRequest,
    /// A request id that is already in use (in flight, or a live process).
    DuplicateId,
    NoSuchProcess,
    SpawnFailed,
    NotFound,
    PermissionDenied,
    TooLarge,
    Io,
    Unsupported,
    /// A code from a newer peer.
    #[serde(other)]
    Other,
}

/// Something that happened to a process; the frame id is the process id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// The process ended. Sent after all of its stdout and stderr.
    Exit(ExitStatus),
    /// Something failed around the process (its stdin pipe, its output), not the process itself.
    Error { message: String },
    /// Since 1.9. A process of a spawn with an exec gate (`pid`, in the guest) is about to
    /// execute `path` with `argv`, which the gate does not let through: it waits until the host
    /// answers `exec_answer {check}`. `cwd` is the caller's working directory, where readable.
    ExecCheck {
        check: u64,
        pid: u32,
        path: String,
        argv: Vec<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cwd: Option<String>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitStatus {
    /// Exit code when the process exited normally.
    pub code: Option<i32>,
    /// Signal number when the process was killed by a signal.
    pub signal: Option<i32>,
    pub duration_ms: u64,
}

impl ExitStatus {
    /// Shell convention: the code, or 128 + signal. Saturates: the signal number comes from
    /// the peer, and a bogus one must not overflow.
    pub fn shell_code(&self) -> i32 {
        match (self.code, self.signal) {
            (Some(c), _) => c,
            (None, Some(s)) => s.saturating_add(128),
            (None, None) => 255,
        }
    }
}

/// Why a control body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("invalid JSON body: {0}")]
    Json(#[from] serde_json::Error),
}

/// Encodes a JSON control frame.
pub fn json_frame<T: Serialize>(kind: FrameKind, id: u32, body: &T) -> Frame {
    Frame::new(kind, id, serde_json::to_vec(body).expect("protocol types serialize"))
}

/// Encodes a JSON control frame with a raw attachment after a NUL separator.
pub fn json_frame_with_attachment<T: Serialize>(kind: FrameKind, id: u32, body: &T, attachment: &[u8]) -> Frame {
    let json = serde_json::to_vec(body).expect("protocol types serialize");
    let mut buf = BytesMut::with_capacity(json.len() + 1 + attachment.len());
    buf.put_slice(&json);
    buf.put_u8(0);
    buf.put_slice(attachment);
    Frame::new(kind, id, buf.freeze())
}

/// Splits a control body into its JSON value and its attachment, if any.
pub fn parse_body<T: DeserializeOwned>(body: &Bytes) -> Result<(T, Option<Bytes>), BodyError> {
    let (json, attachment) = match body.iter().position(|&b| b == 0) {
        Some(nul) => (body.slice(..nul), Some(body.slice(nul + 1..))),
        None => (body.clone(), None),
    };
    Ok((serde_json::from_slice(&json)?, attachment))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn wire_shapes_are_stable() {
        let ping = serde_json::to_string(&Request::Ping).unwrap();
        assert_eq!(ping, r#"{"method":"ping"}"#);
        let kill = serde_json::to_string(&Request::Kill { process: 7, signal: 15 }).unwrap();
        assert_eq!(kill, r#"{"method":"kill","params":{"process":7,"signal":15}}"#);
        let ok = serde_json::to_string(&Response::Ok(ResponseBody::Spawned { pid: 42 })).unwrap();
        assert_eq!(ok, r#"{"ok":{"type":"spawned","pid":42}}"#);
        let exit = Event::Exit(ExitStatus { code: None, signal: Some(15), duration_ms: 3 });
        assert_eq!(
            serde_json::to_string(&exit).unwrap(),
            r#"{"event":"exit","code":null,"signal":15,"duration_ms":3}"#
        );
    }

    #[test]
    fn share_wire_shapes_are_stable() {
        let share = Request::Share(ShareRequest { session: "s1".into(), name: "src".into(), mode: ShareMode::Rwd });
        assert_eq!(
            serde_json::to_string(&share).unwrap(),
            r#"{"method":"share","params":{"session":"s1","name":"src","mode":"rwd"}}"#
        );
        let diff = Request::ShadowDiff { session: "s1".into(), name: "src".into() };
        assert_eq!(
            serde_json::to_string(&diff).unwrap(),
            r#"{"method":"shadow_diff","params":{"session":"s1","name":"src"}}"#
        );
        let changes = ResponseBody::ShadowDiff {
            changes: vec![
                ShadowChange { path: "a/b.txt".into(), kind: ChangeKind::Added, size: Some(3), is_dir: false },
                ShadowChange { path: "old".into(), kind: ChangeKind::Deleted, size: None, is_dir: true },
            ],
            truncated: false,
        };
        assert_eq!(
            serde_json::to_string(&Response::Ok(changes)).unwrap(),
            r#"{"ok":{"type":"shadow_diff","changes":[{"path":"a/b.txt","kind":"added","size":3,"is_dir":false},{"path":"old","kind":"deleted","is_dir":true}],"truncated":false}}"#
        );
        for (mode, text) in
            [(ShareMode::Ro, "ro"), (ShareMode::Rw, "rw"), (ShareMode::Rwd, "rwd"), (ShareMode::Shadow, "shadow")]
        {
            assert_eq!(serde_json::to_string(&mode).unwrap(), format!("\"{text}\""));
            assert_eq!(mode.to_string(), text);
        }
        assert!(serde_json::from_str::<ShareMode>(r#""RW""#).is_err());
    }

    #[test]
    fn shell_code_of_a_bogus_signal_saturates() {
        let status = |signal| ExitStatus { code: None, signal: Some(signal), duration_ms: 0 };
        assert_eq!(status(15).shell_code(), 143);
        assert_eq!(status(i32::MAX).shell_code(), i32::MAX);
        assert_eq!(status(i32::MIN).shell_code(), i32::MIN + 128);
    }

    #[test]
    fn unknown_error_codes_from_newer_peers_decode_as_other() {
        let e: ErrorBody = serde_json::from_str(r#"{"code":"quota_exceeded","message":"m"}"#).unwrap();
        assert_eq!(e.code, ErrorCode::Other);
    }

    #[test]
    fn unknown_methods_are_errors_not_panics() {
        let body = Bytes::from_static(br#"{"method":"format_disk","params":{}}"#);
        assert!(parse_body::<Request>(&body).is_err());
    }

    #[test]
    fn attachment_survives_nul_bytes_inside_it() {
        let req = Request::WriteFile(WriteFileRequest {
            path: "/tmp/a".into(),
            mode: WriteMode::At(5),
            permissions: Some(0o600),
            create_dirs: true,
        });
        let data = b"\0\x01\0binary\0";
        let frame = json_frame_with_attachment(FrameKind::Request, 3, &req, data);
        let (back, att): (Request, _) = parse_body(&frame.body).unwrap();
        assert_eq!(back, req);
        assert_eq!(att.as_deref(), Some(&data[..]));
    }

    fn arb_spawn() -> impl Strategy<Value = SpawnRequest> {
        (
            proptest::collection::vec(".*", 1..4),
            proptest::option::of(".*"),
            proptest::collection::btree_map("[A-Z_]{1,8}", ".*", 0..4),
            proptest::option::of(any::<u32>()),
            proptest::option::of((any::<u16>(), any::<u16>()).prop_map(|(rows, cols)| TtySize { rows, cols })),
        )
            .prop_map(|(argv, cwd, env, uid, tty)| SpawnRequest {
                argv,
                cwd,
                env,
                uid,
                gid: uid,
                tty,
                exec_gate: None,
            })
    }

    proptest! {
        #[test]
        fn requests_round_trip(spawn in arb_spawn(), path in ".*", n in any::<u32>(), sig in any::<i32>()) {
            for req in [
                Request::Spawn(spawn.clone()),
                Request::Kill { process: n, signal: sig },
                Request::ReadFile { path: path.clone(), offset: n as u64, len: n },
                Request::ListDir { path: path.clone(), limit: Some(n) },
                Request::Stats,
            ] {
                let frame = json_frame(FrameKind::Request, n, &req);
                let (back, att): (Request, _) = parse_body(&frame.body).unwrap();
                prop_assert_eq!(back, req);
                prop_assert!(att.is_none());
            }
        }

        #[test]
        fn arbitrary_bodies_never_panic(body in proptest::collection::vec(any::<u8>(), 0..256)) {
            let b = Bytes::from(body);
            let _ = parse_body::<Request>(&b);
            let _ = parse_body::<Response>(&b);
            let _ = parse_body::<Event>(&b);
            let _ = parse_body::<Hello>(&b);
        }
    }
}
