//! Every method umbrad serves: its name, its params and its result, as Rust types.
//!
//! A [`Method`] ties the three together, so the daemon's dispatcher and the typed client
//! cannot disagree, and the JSON Schema in `host/api/schema/` is generated from the same
//! declarations (a test fails when the checked-in file is stale).

use std::collections::BTreeMap;
use std::path::PathBuf;

use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use umbra_proto::{DirEntry, FileStat, ShareMode, TtySize};

use crate::config::{ConfigPatch, DaemonConfig};
use crate::event::{Data, SessionEvent, ShadowApplyReport, ShadowEntry};
use crate::session::{FolderInfo, FolderSpec, SessionInfo, SettingsPatch};

/// A method: its wire name and the types of its params and result.
pub trait Method {
    const NAME: &'static str;
    type Params: Serialize + DeserializeOwned + JsonSchema + 'static;
    type Result: Serialize + DeserializeOwned + JsonSchema + 'static;
}

/// Params of methods that take none (`{}` or absent).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct NoParams {}

/// The result of methods that only succeed or fail (`{}`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Done {}

// ---- daemon, config, bundles -------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct DaemonInfo {
    /// umbrad's version.
    pub version: String,
    /// The IPC contract's version (`major.minor`): a client should refuse a daemon of another
    /// major version.
    pub api_version: String,
    pub pid: u32,
    pub uid: u32,
    pub socket: PathBuf,
    /// The machine's system policy, when it has one (`docs/policy.md`). Since API 1.8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_policy: Option<crate::system::SystemPolicyInfo>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
pub struct BundleStatus {
    /// The version sessions boot from `current`, if one is installed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current: Option<String>,
    pub installed: Vec<umbra_bundle::InstalledInfo>,
    /// Downloads in progress (the latest progress event of each).
    #[serde(default)]
    pub downloading: Vec<umbra_bundle::Progress>,
    /// The configured bundle URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Where the store lives.
    pub root: PathBuf,
}

/// The warm pool (`pool.status`): VMs booted ahead of session starts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct PoolStatus {
    /// How many VMs the pool keeps (`pool_size`, within `pool_memory_mib`).
    pub target: u32,
    /// Booted VMs waiting for a session.
    pub ready: u32,
    /// VMs booting for the pool now.
    pub booting: u32,
    /// The bundle version the pool's VMs run, once it has resolved one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bundle_version: Option<String>,
    /// The backend they run on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// Sessions that started from the pool since umbrad started.
    pub taken: u64,
    /// Why the last refill failed, until one succeeds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// The pool restores its VMs from a snapshot of one VM taken right after its agent
    /// announced itself, instead of booting each (the kvm backend).
    #[serde(default)]
    pub restores: bool,
    /// Why the pool boots its VMs although its backend could restore them: taking or restoring
    /// its snapshot failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_error: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct DownloadParams {
    /// `https://` or `file://` of a bundle's `manifest.json` (or its directory); default: the
    /// configured `bundle_url`. The bundle must be signed by a trusted key (`bundle_error`
    /// otherwise, naming the signer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Into the warm slot: the next session start promotes it.
    #[serde(default)]
    pub warm: bool,
}

/// Params of `bundle.delete_and_reinstall`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ReinstallParams {
    /// `https://` or `file://` of the bundle to download again; default: the configured
    /// `bundle_url`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Downloaded {
    pub version: String,
    pub how: umbra_bundle::PulledHow,
    /// Compressed bytes transferred.
    pub downloaded: u64,
}

// ---- sessions ----------------------------------------------------------------------------

/// Params of `session.start`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct StartParams {
    /// The session's name: `[A-Za-z0-9._-]`, at most 64 bytes.
    pub name: String,
    /// Host folders to share at `/sessions/<name>/mnt/<folder>`.
    #[serde(default)]
    pub folders: Vec<FolderSpec>,
    /// Settings that differ from the daemon's defaults (flattened: `memory_mib`, `cpus`, …).
    #[serde(flatten)]
    pub settings: SettingsPatch,
    /// Credentials the guest sees only as placeholders (`docs/network.md`, "Secrets").
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<crate::secrets::SecretSpec>,
    /// SSH keys the session's agent holds on the host, each for the servers it names.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ssh_keys: Vec<crate::secrets::SshKeySpec>,
    /// Guest ports to reach from the host from the start (`session.expose`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<crate::ports::PortSpec>,
    /// Since 1.11: boot an OCI image (`python:3.12-slim`, `ghcr.io/org/tool@sha256:…`) instead
    /// of `bundle`: pulled and converted into a bundle first unless it was before (`images.md`);
    /// its `Env`, `WorkingDir` and `User` become every process's defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SessionRef {
    pub name: String,
}

/// Params of `session.resume`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ResumeParams {
    pub name: String,
    /// Deletes the session's snapshot and boots it from its disk instead: for a snapshot this
    /// host cannot restore (another umbra version, another CPU, its bundle gone). What the
    /// snapshot's memory held (processes, shadow changes not yet applied) is lost; the disk,
    /// outputs, uploads and folders stay.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub discard_snapshot: bool,
}

/// Params of `session.fork`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ForkParams {
    /// The session to fork: its snapshot, or one taken of it as it runs on (kvm: a live fork).
    pub source: String,
    /// The new session's name.
    pub name: String,
}

/// Params of `session.set_network`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SetNetworkParams {
    pub name: String,
    pub network: crate::session::NetworkPolicy,
}

/// Params of `session.update`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct UpdateParams {
    pub name: String,
    /// The settings to change (only those given), as `session.start` takes them.
    pub settings: crate::session::SettingsPatch,
}

/// What `session.update` changed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Updated {
    pub session: SessionInfo,
    /// Fields in force at once on the running session (`approval`, `network`,
    /// `idle_timeout_secs`, `idle_action`, `auto_expose`).
    pub applied: Vec<String>,
    /// Fields recorded that take effect at its next boot (stop and resume): the VM's size,
    /// heartbeat, bundle, backend and sandbox policy (its folders' modes are set at a boot).
    pub next_boot: Vec<String>,
}

/// Params of `session.set_secret`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SetSecretParams {
    pub name: String,
    /// Replaces the secret of this name (its placeholder stays, so running processes keep
    /// working) or adds one (processes spawned from now on see it).
    pub secret: crate::secrets::SecretSpec,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SessionList {
    pub sessions: Vec<SessionInfo>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct LogsParams {
    pub name: String,
    /// Lines of each log to return (default 100, at most 10000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lines: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SessionLogs {
    /// The session's recent lifecycle events (status, restarts, folders, process starts and
    /// exits), oldest first.
    pub events: Vec<SessionEvent>,
    /// The last lines of the running (or last) VM's console.
    pub console: Vec<String>,
}

// ---- processes ---------------------------------------------------------------------------

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SpawnParams {
    pub session: String,
    /// The command; `argv[0]` is looked up in the guest's PATH.
    pub argv: Vec<String>,
    /// Working directory in the guest (absolute).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Run on a pseudo-terminal of this size (output then arrives as stdout only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tty: Option<TtySize>,
    /// SIGTERM after this many seconds, SIGKILL 3 s later; the exit says `timed_out`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
    /// Keep the process when this client goes: the session holds its output (bounded) and its
    /// exit, and any client can `process.attach` to it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub detach: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Spawned {
    /// The process's id in this daemon (events name it).
    pub process: u64,
    /// Its pid in the guest.
    pub pid: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ProcessRef {
    pub session: String,
    pub process: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct StdinParams {
    pub session: String,
    pub process: u64,
    #[serde(flatten)]
    pub data: Data,
    /// With `offset`: a name the client picks for its stream of stdin to this process (at
    /// most 64 bytes; a random one per process and client), kept across its reconnections.
    /// Since API 1.9.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writer: Option<String>,
    /// With `writer`: where this piece's first byte falls among the bytes that writer has
    /// written. umbrad writes only what lies past the bytes it already took from the writer,
    /// so a piece sent again after a lost connection is written once; a piece starting past
    /// them is refused (`invalid_params`): the bytes between are missing. Since API 1.9.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
}

/// The longest `writer` name `process.stdin` takes.
pub const MAX_STDIN_WRITER: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct KillParams {
    pub session: String,
    pub process: u64,
    /// Default 15 (SIGTERM).
    #[serde(default = "sigterm")]
    pub signal: i32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct KillAllParams {
    pub session: String,
    /// Default 9 (SIGKILL).
    #[serde(default = "sigkill")]
    pub signal: i32,
}

fn sigterm() -> i32 {
    15
}
fn sigkill() -> i32 {
    9
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ResizeParams {
    pub session: String,
    pub process: u64,
    pub rows: u16,
    pub cols: u16,
}

/// Which output stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Stream {
    Stdout,
    Stderr,
}

/// Flow control: the client has consumed `bytes` of a process's output and can take that much
/// more. Each stream starts with [`OUTPUT_WINDOW`] bytes of credit; without acks the process
/// blocks in the guest once its credit is spent. Usually sent as a notification (no id).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct AckParams {
    pub session: String,
    pub process: u64,
    pub stream: Stream,
    pub bytes: u64,
}

/// Bytes of each output stream umbrad sends a client before it waits for acks.
pub const OUTPUT_WINDOW: u64 = 1024 * 1024;

/// Params of `permission.respond`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RespondPermissionParams {
    /// The `request_id` of a `permission_request` event.
    pub request_id: String,
    /// Whether it may run (or connect); `decision`, when given, says it instead.
    #[serde(default)]
    pub approved: bool,
    /// `allow_once`, `allow_always` (its commands join the session's allow list) or `deny`:
    /// `approved` and `scope` in one word. Since API 1.8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<crate::event::PermissionDecision>,
    /// With `allow_always`: the commands also join the allow list of umbrad's configuration,
    /// so every new session allows them (the configuration must have approval settings).
    /// Since API 1.8.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub remember: bool,
    /// How far an approval reaches: `once` (the default) or `session` (a network name for the
    /// rest of the session).
    #[serde(default, skip_serializing_if = "crate::event::PermissionScope::is_once")]
    pub scope: crate::event::PermissionScope,
}

// ---- folders, files, shadow --------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct MountParams {
    pub session: String,
    #[serde(flatten)]
    pub folder: FolderSpec,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct UnmountParams {
    pub session: String,
    pub name: String,
}

/// A path in the session: a guest path (absolute, no `..`), or with `host` a host path inside
/// one of the session's shared folders, translated to its guest path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct PathParams {
    pub session: String,
    pub path: String,
    /// `path` is a host path inside a shared folder.
    #[serde(default)]
    pub host: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ReadParams {
    pub session: String,
    pub path: String,
    /// `path` is a host path inside a shared folder.
    #[serde(default)]
    pub host: bool,
    #[serde(default)]
    pub offset: u64,
    /// At most [`MAX_FILE_CHUNK`] bytes (the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub len: Option<u32>,
}

/// Largest read or write in one request.
pub const MAX_FILE_CHUNK: u32 = umbra_proto::MAX_FILE_CHUNK as u32;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct FileData {
    #[serde(flatten)]
    pub data: Data,
    /// The read reached the end of the file.
    pub eof: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct WriteParams {
    pub session: String,
    pub path: String,
    /// `path` is a host path inside a shared folder.
    #[serde(default)]
    pub host: bool,
    #[serde(flatten)]
    pub data: Data,
    /// Append instead of replacing the file.
    #[serde(default)]
    pub append: bool,
    /// Write at this offset instead (the file is not truncated).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
    #[serde(default)]
    pub create_dirs: bool,
    /// Permission bits of a file this creates (default 0644).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permissions: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Written {
    pub bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ListParams {
    pub session: String,
    pub path: String,
    /// `path` is a host path inside a shared folder.
    #[serde(default)]
    pub host: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct DirList {
    pub entries: Vec<DirEntry>,
    pub truncated: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ShadowParams {
    pub session: String,
    /// The shadow folder's name.
    pub folder: String,
}

/// A shadow folder's changes, captured on the host as change-set `changeset`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ShadowDiffResult {
    /// What `shadow.apply` takes: it applies these entries' captured bytes and nothing else.
    /// Valid until the folder's next `shadow.diff`, `shadow.reset` or unmount, or a restart.
    pub changeset: String,
    pub changes: Vec<ShadowEntry>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ShadowApplyParams {
    pub session: String,
    /// The shadow folder's name.
    pub folder: String,
    /// The change-set `shadow.diff` returned: required (an apply without one is refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub changeset: Option<String>,
    /// Apply only these paths of the change-set (each must be in it). `.git` and ignored
    /// paths are applied only when named here. Default: every entry that applies by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paths: Option<Vec<String>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ExportParams {
    pub session: String,
    pub folder: String,
    /// A host path for the tar; default: a new file in the session's storage directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dest: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Exported {
    pub path: PathBuf,
    pub bytes: u64,
}

// ---- events ------------------------------------------------------------------------------

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SubscribeParams {
    /// Only this session's events (default: every session's, and the host's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Subscribed {
    pub subscription: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct UnsubscribeParams {
    pub subscription: u64,
}

/// Declares the method marker types and the list the schema and docs are generated from.
macro_rules! methods {
    ($( $(#[doc = $doc:literal])* $ty:ident = $name:literal ($params:ty) -> $result:ty; )*) => {
        $(
            $(#[doc = $doc])*
            #[derive(Debug, Clone, Copy)]
            pub struct $ty;
            impl Method for $ty {
                const NAME: &'static str = $name;
                type Params = $params;
                type Result = $result;
            }
        )*

        /// Every method, in documentation order: name, one-line summary, params and result
        /// schemas.
        pub fn all(gen: &mut schemars::SchemaGenerator) -> Vec<MethodSchema> {
            vec![$(
                MethodSchema {
                    name: $name,
                    summary: concat!($($doc),*),
                    params: gen.subschema_for::<$params>(),
                    result: gen.subschema_for::<$result>(),
                },
            )*]
        }

        /// Every method name.
        pub const NAMES: &[&str] = &[$($name),*];
    };
}

/// A method's schemas, for the generated schema document.
pub struct MethodSchema {
    pub name: &'static str,
    pub summary: &'static str,
    pub params: schemars::Schema,
    pub result: schemars::Schema,
}

methods! {
    /// What this daemon is: versions, pid, uid and socket.
    DaemonInfoMethod = "daemon.info" (NoParams) -> DaemonInfo;
    /// The configuration (session defaults, bundle source).
    ConfigGet = "config.get" (NoParams) -> DaemonConfig;
    /// Changes some settings; returns the whole new configuration.
    ConfigSet = "config.set" (ConfigPatch) -> DaemonConfig;
    /// The warm pool: its target, its ready and booting VMs.
    PoolStatusMethod = "pool.status" (NoParams) -> PoolStatus;
    /// Installed bundles, the current one and any download in progress.
    BundleStatusMethod = "bundle.status" (NoParams) -> BundleStatus;
    /// Downloads, verifies and installs a bundle (progress as `download_progress` events).
    BundleDownload = "bundle.download" (DownloadParams) -> Downloaded;
    /// Downloads a bundle again from scratch even if it is installed; the installed copy is
    /// replaced only once the new one is verified.
    BundleDeleteAndReinstall = "bundle.delete_and_reinstall" (ReinstallParams) -> Downloaded;
    /// Creates and boots a session; returns once it is ready. Starting a session that is
    /// already starting waits for that start.
    SessionStart = "session.start" (StartParams) -> SessionInfo;
    /// Boots a stopped or failed session again, with its folders, outputs and disk; a session
    /// paused by `session.snapshot` is restored instead (with `discard_snapshot`, booted).
    SessionResume = "session.resume" (ResumeParams) -> SessionInfo;
    /// Ends a session's processes and destroys its VM; its folders, outputs and disk stay.
    SessionStop = "session.stop" (SessionRef) -> SessionInfo;
    /// Pauses a running session into a snapshot in its storage (memory, devices, disk, folder
    /// table) and stops it; `session.resume` restores it. Its processes get a `lost` exit now
    /// and are ended at the restore; detached ones run on. The kvm backend only: elsewhere the
    /// error is `unsupported`.
    SessionSnapshot = "session.snapshot" (SessionRef) -> SessionInfo;
    /// A new session restored from another's snapshot, with its own disk, outputs, uploads,
    /// entropy and hostname; a running source on kvm runs on, paused only while the fork's
    /// snapshot is captured (a live fork); on another backend it is snapshotted and resumed
    /// first (so its processes end as at a snapshot; detached ones run on).
    SessionFork = "session.fork" (ForkParams) -> SessionInfo;
    /// Stops a session and removes it with its outputs, uploads and disk.
    SessionDelete = "session.delete" (SessionRef) -> Done;
    /// Replaces a session's network policy; new connections follow it at once (open ones are
    /// not cut), and restarts and resumes keep it.
    SessionSetNetwork = "session.set_network" (SetNetworkParams) -> SessionInfo;
    /// Changes a session's settings, running or not: approval, network (within its policy's
    /// ceiling), the idle timeout and action and `auto_expose` take effect at once; the rest
    /// at its next boot, as the answer says. Since API 1.8.
    SessionUpdate = "session.update" (UpdateParams) -> Updated;
    /// Adds a secret to a session or gives one a new value (rotation), effective for the next
    /// request through the proxy; the value is never sent to the guest.
    SessionSetSecret = "session.set_secret" (SetSecretParams) -> SessionInfo;
    /// Listens on a host port and carries each connection to a port of the session's guest,
    /// while the session lives (kept across its restarts, resumes and umbrad's).
    SessionExpose = "session.expose" (crate::ports::ExposeParams) -> crate::ports::PortInfo;
    /// Stops listening for a guest port; connections already carried end.
    SessionUnexpose = "session.unexpose" (crate::ports::UnexposeParams) -> Done;
    /// A session's exposed ports.
    SessionPorts = "session.ports" (SessionRef) -> crate::ports::PortList;
    /// Every session.
    SessionListMethod = "session.list" (NoParams) -> SessionList;
    /// One session.
    SessionGet = "session.get" (SessionRef) -> SessionInfo;
    /// A session's recent lifecycle events and console lines.
    SessionLogsMethod = "session.logs" (LogsParams) -> SessionLogs;
    /// Starts a process; its output and exit arrive as `process.event` notifications.
    ProcessSpawn = "process.spawn" (SpawnParams) -> Spawned;
    /// Writes to a process's stdin (waits while the guest has no room).
    ProcessStdin = "process.stdin" (StdinParams) -> Done;
    /// Closes a process's stdin after what was written.
    ProcessCloseStdin = "process.close_stdin" (ProcessRef) -> Done;
    /// Signals a process's process group.
    ProcessKill = "process.kill" (KillParams) -> Done;
    /// Signals every process of a session.
    ProcessKillAll = "process.kill_all" (KillAllParams) -> Done;
    /// Resizes a process's pseudo-terminal.
    ProcessResize = "process.resize" (ResizeParams) -> Done;
    /// Answers a `permission_request` event: the waiting `process.spawn` runs the command, or
    /// fails with `permission_denied`.
    PermissionRespond = "permission.respond" (RespondPermissionParams) -> Done;
    /// Grants more output credit (see `OUTPUT_WINDOW`); usually a notification.
    ProcessAck = "process.ack" (AckParams) -> Done;
    /// The session's processes: running ones, and kept ones for a while after they ended.
    ProcessListMethod = "process.list" (crate::kept::InSession) -> crate::kept::ProcessList;
    /// Attaches to a kept process: its output from an offset, then as it comes, then its exit.
    ProcessAttach = "process.attach" (crate::kept::AttachParams) -> crate::kept::Attached;
    /// Opens a terminal: a login shell on a pseudo-terminal that keeps running when the client
    /// goes. Its output follows as `process.event`s to this client.
    TerminalOpen = "terminal.open" (crate::kept::TerminalOpenParams) -> crate::kept::TerminalInfo;
    /// Attaches to a terminal: its scrollback, then its output as it comes.
    TerminalAttach = "terminal.attach" (crate::kept::TerminalAttachParams) -> crate::kept::Attached;
    /// The session's terminals.
    TerminalListMethod = "terminal.list" (crate::kept::InSession) -> crate::kept::TerminalList;
    /// Changes a terminal's size.
    TerminalResize = "terminal.resize" (crate::kept::TerminalResizeParams) -> Done;
    /// Closes a terminal: its shell gets SIGHUP (SIGKILL if it has not ended 3 s later).
    TerminalClose = "terminal.close" (crate::kept::TerminalRef) -> Done;
    /// Starts a language server in the guest on a folder and initializes it; it runs until
    /// `lsp.stop` or the VM's end. Its notifications arrive as `lsp_notification` events.
    /// Since API 1.10.
    LspStart = "lsp.start" (crate::lsp::LspStartParams) -> crate::lsp::LspServerInfo;
    /// Sends a language server a request (`textDocument/definition`, ...) and returns its answer.
    LspRequest = "lsp.request" (crate::lsp::LspRequestParams) -> crate::lsp::LspResult;
    /// Sends a language server a notification (`textDocument/didOpen`, ...).
    LspNotify = "lsp.notify" (crate::lsp::LspNotifyParams) -> Done;
    /// Shuts a language server down (`shutdown`, `exit`; SIGKILL if it lingers).
    LspStop = "lsp.stop" (crate::lsp::LspRef) -> Done;
    /// A session's language servers.
    LspListMethod = "lsp.list" (crate::kept::InSession) -> crate::lsp::LspList;
    /// The diagnostics a change to a folder's files would bring and take away, from the
    /// folder's language servers, without writing the change anywhere. Since API 1.10.
    DiagnosticsForChange = "diagnostics.for_change" (crate::lsp::ForChangeParams) -> crate::lsp::ForChange;
    /// Runs a command in a terminal's shell; answers with its exit status and the shell's
    /// working directory after it.
    TerminalRun = "terminal.run" (crate::kept::TerminalRunParams) -> crate::kept::TerminalRunResult;
    /// Shares a host folder with a running session.
    FolderMount = "folder.mount" (MountParams) -> FolderInfo;
    /// Stops sharing a folder.
    FolderUnmount = "folder.unmount" (UnmountParams) -> Done;
    /// Reads part of a file.
    FileRead = "file.read" (ReadParams) -> FileData;
    /// Writes (or appends to) a file.
    FileWrite = "file.write" (WriteParams) -> Written;
    /// A file's metadata.
    FileStatMethod = "file.stat" (PathParams) -> FileStat;
    /// A directory's entries.
    FileList = "file.list" (ListParams) -> DirList;
    /// What the guest changed in a shadow folder, captured on the host as a change-set.
    ShadowDiff = "shadow.diff" (ShadowParams) -> ShadowDiffResult;
    /// Writes a change-set's captured bytes to the host folder (conflicts are left alone).
    ShadowApply = "shadow.apply" (ShadowApplyParams) -> ShadowApplyReport;
    /// Writes a shadow folder's changes to a tar on the host.
    ShadowExport = "shadow.export" (ExportParams) -> Exported;
    /// Throws away a shadow folder's changes.
    ShadowReset = "shadow.reset" (ShadowParams) -> Done;
    /// Receive lifecycle events (as `event` notifications) of one session or all.
    EventsSubscribe = "events.subscribe" (SubscribeParams) -> Subscribed;
    /// Stops a subscription.
    EventsUnsubscribe = "events.unsubscribe" (UnsubscribeParams) -> Done;
}

/// A share mode in a path-style spec (`HOST_PATH[:NAME][:MODE]`), as `vmctl` takes it.
pub fn parse_folder_spec(s: &str) -> Result<FolderSpec, String> {
    let mut parts: Vec<&str> = s.split(':').collect();
    let mut mode = ShareMode::Rw;
    if parts.len() > 1 {
        if let Ok(m) = parts[parts.len() - 1].parse::<ShareMode>() {
            mode = m;
            parts.pop();
        }
    }
    let name = match parts.len() {
        1 => None,
        2 => Some(parts[1].to_string()),
        _ => return Err(format!("{s:?}: expected HOST_PATH[:NAME][:MODE] with MODE one of ro, rw, rwd, shadow")),
    };
    if parts[0].is_empty() {
        return Err(format!("{s:?}: empty host path"));
    }
    Ok(FolderSpec { path: PathBuf::from(parts[0]), name, mode })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_names_are_unique() {
        let mut names = NAMES.to_vec();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), NAMES.len());
    }

    #[test]
    fn folder_specs() {
        let f = parse_folder_spec("/a/b").unwrap();
        assert_eq!((f.path.to_str(), f.name, f.mode), (Some("/a/b"), None, ShareMode::Rw));
        let f = parse_folder_spec("/a:shadow").unwrap();
        assert_eq!((f.name, f.mode), (None, ShareMode::Shadow));
        let f = parse_folder_spec("/a:work:ro").unwrap();
        assert_eq!((f.name.as_deref(), f.mode), (Some("work"), ShareMode::Ro));
        assert!(parse_folder_spec("/x:a:b:c").is_err());
        assert!(parse_folder_spec(":ro").is_err());
    }

    #[test]
    fn stdin_and_file_data_flatten_their_bytes() {
        let p =
            StdinParams { session: "s".into(), process: 1, data: Data::from_bytes(b"abc"), writer: None, offset: None };
        let v = serde_json::to_value(&p).unwrap();
        assert_eq!(v, serde_json::json!({"session": "s", "process": 1, "data": "abc"}));
        let back: StdinParams = serde_json::from_value(v).unwrap();
        assert_eq!(back, p);
    }
}
