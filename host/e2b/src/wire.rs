//! The E2B API's messages as the SDKs send and read them: the sandbox REST API's JSON and envd's
//! process and filesystem messages in protobuf's canonical JSON (lowerCamelCase names sent;
//! the original snake_case names accepted too, as protobuf's JSON parsers do).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The envd version the sandboxes report: the SDKs turn features on by it (0.4.0 default user,
/// 0.5.7 octet-stream uploads, 0.6.x metadata and watch options).
pub const ENVD_VERSION: &str = "0.6.4";

// ---- the sandbox REST API

/// `POST /sandboxes` and `POST /v2/sandboxes`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NewSandbox {
    #[serde(rename = "templateID")]
    pub template_id: Option<String>,
    /// Seconds until the sandbox is killed (E2B's default 300).
    pub timeout: Option<u64>,
    #[serde(default)]
    pub metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub env_vars: Option<BTreeMap<String, String>>,
    /// Pause instead of kill when the timeout passes.
    #[serde(default)]
    pub auto_pause: Option<bool>,
    /// `false`: the session gets no network (`none`); absent or `true`: umbrad's policy.
    #[serde(default, rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
}

/// What create and connect answer.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxCreated {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    pub envd_version: &'static str,
    pub envd_access_token: String,
    /// Always null: envd is this endpoint (`E2B_SANDBOX_URL`), not `49983-<id>.<domain>`.
    pub domain: Option<String>,
}

/// An item of the list, and (with the token) `GET /sandboxes/{id}`.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxDetail {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    pub started_at: String,
    pub end_at: String,
    pub cpu_count: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u32,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u32,
    pub state: &'static str,
    pub envd_version: &'static str,
    pub metadata: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub envd_access_token: Option<String>,
    pub domain: Option<String>,
}

/// `POST /sandboxes/{id}/timeout`.
#[derive(Debug, Clone, Deserialize)]
pub struct SetTimeout {
    pub timeout: u64,
}

/// `POST /v2/sandboxes/{id}/connect` (and the older `/sandboxes/{id}/resume`).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ConnectSandbox {
    pub timeout: Option<u64>,
}

/// E2B's REST error body: the status again as `code`, and a message.
#[derive(Debug, Clone, Serialize)]
pub struct RestError {
    pub code: u16,
    pub message: String,
}

// ---- envd: process.Process

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ProcessConfig {
    pub cmd: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub envs: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
pub struct PtySize {
    #[serde(default)]
    pub cols: u32,
    #[serde(default)]
    pub rows: u32,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Pty {
    pub size: Option<PtySize>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct StartRequest {
    pub process: ProcessConfig,
    #[serde(default)]
    pub pty: Option<Pty>,
    #[serde(default)]
    pub tag: Option<String>,
    /// Unset: stdin is open. `false`: closed at once.
    #[serde(default)]
    pub stdin: Option<bool>,
}

/// Which process: by pid or by tag.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ProcessSelector {
    pub pid: Option<u32>,
    pub tag: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct SelectRequest {
    #[serde(default)]
    pub process: ProcessSelector,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct ProcessInput {
    /// base64.
    pub stdin: Option<String>,
    /// base64.
    pub pty: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct SendInputRequest {
    #[serde(default)]
    pub process: ProcessSelector,
    #[serde(default)]
    pub input: ProcessInput,
}

#[derive(Debug, Clone, Deserialize)]
pub struct SendSignalRequest {
    #[serde(default)]
    pub process: ProcessSelector,
    /// `"SIGNAL_SIGKILL"`, `"SIGNAL_SIGTERM"`, or the enum's number.
    #[serde(default)]
    pub signal: serde_json::Value,
}

#[derive(Debug, Clone, Deserialize)]
pub struct UpdateRequest {
    #[serde(default)]
    pub process: ProcessSelector,
    #[serde(default)]
    pub pty: Option<Pty>,
}

/// One message of `StreamInput` (a client stream).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum StreamInput {
    Start {
        #[serde(default)]
        process: ProcessSelector,
    },
    Data {
        #[serde(default)]
        input: ProcessInput,
    },
    Keepalive {},
}

#[derive(Debug, Clone, Serialize)]
pub struct ProcessInfo {
    pub config: ProcessConfig,
    pub pid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ListResponse {
    pub processes: Vec<ProcessInfo>,
}

/// `{"event": …}` of Start and Connect.
#[derive(Debug, Clone, Serialize)]
pub struct ProcessEvent {
    pub event: EventCase,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum EventCase {
    Start { pid: u32 },
    Data(DataEvent),
    End(EndEvent),
    Keepalive {},
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum DataEvent {
    /// base64.
    Stdout(String),
    Stderr(String),
    Pty(String),
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EndEvent {
    pub exit_code: i32,
    pub exited: bool,
    pub status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

// ---- envd: filesystem.Filesystem

#[derive(Debug, Clone, Deserialize)]
pub struct PathRequest {
    #[serde(default)]
    pub path: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct MoveRequest {
    pub source: String,
    pub destination: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ListDirRequest {
    #[serde(default)]
    pub path: String,
    #[serde(default)]
    pub depth: u32,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WatchRequest {
    #[serde(default)]
    pub path: String,
    #[serde(default)]
    pub recursive: bool,
    #[serde(default, alias = "include_entry")]
    pub include_entry: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WatcherRef {
    #[serde(alias = "watcher_id")]
    pub watcher_id: String,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EntryInfo {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub path: String,
    /// int64: a string in protobuf's JSON.
    pub size: String,
    pub mode: u32,
    pub permissions: String,
    pub owner: String,
    pub group: String,
    pub modified_time: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct EntryResponse {
    pub entry: EntryInfo,
}

#[derive(Debug, Clone, Serialize)]
pub struct ListDirResponse {
    pub entries: Vec<EntryInfo>,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FilesystemEvent {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entry: Option<EntryInfo>,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum WatchEvent {
    Start {},
    Filesystem(Box<FilesystemEvent>),
    Keepalive {},
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CreateWatcherResponse {
    pub watcher_id: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct WatcherEvents {
    pub events: Vec<FilesystemEvent>,
}

/// An entry of `POST /files`'s answer.
#[derive(Debug, Clone, Serialize)]
pub struct WrittenFile {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub path: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_read_and_written_as_the_sdks_do() {
        let start: StartRequest = serde_json::from_str(
            r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"A":"1"},"cwd":"/tmp"},"stdin":false}"#,
        )
        .unwrap();
        assert_eq!(
            (start.process.args.len(), start.stdin, start.process.cwd.as_deref()),
            (3, Some(false), Some("/tmp"))
        );
        let end = ProcessEvent {
            event: EventCase::End(EndEvent { exit_code: 3, exited: true, status: "exit status 3".into(), error: None }),
        };
        assert_eq!(
            serde_json::to_string(&end).unwrap(),
            r#"{"event":{"end":{"exitCode":3,"exited":true,"status":"exit status 3"}}}"#
        );
        let data = ProcessEvent { event: EventCase::Data(DataEvent::Stdout("aGkK".into())) };
        assert_eq!(serde_json::to_string(&data).unwrap(), r#"{"event":{"data":{"stdout":"aGkK"}}}"#);
        assert_eq!(serde_json::to_string(&WatchEvent::Start {}).unwrap(), r#"{"start":{}}"#);
        let w: WatcherRef = serde_json::from_str(r#"{"watcher_id":"w1"}"#).unwrap();
        assert_eq!(w.watcher_id, "w1");
        let w: WatchRequest = serde_json::from_str(r#"{"path":"/a","includeEntry":true}"#).unwrap();
        assert!(w.include_entry && !w.recursive);
        let input: StreamInput = serde_json::from_str(r#"{"data":{"input":{"stdin":"eA=="}}}"#).unwrap();
        assert!(matches!(input, StreamInput::Data { input } if input.stdin.as_deref() == Some("eA==")));
        let new: NewSandbox =
            serde_json::from_str(r#"{"templateID":"base","timeout":120,"envVars":{"A":"1"}}"#).unwrap();
        assert_eq!((new.template_id.as_deref(), new.timeout), (Some("base"), Some(120)));
    }
}
