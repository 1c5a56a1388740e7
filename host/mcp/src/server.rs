//! The MCP server itself: [`UmbraMcp`], its tools and the session-logs resource, over any
//! transport (`vmctl mcp`: stdio; umbrad's `--mcp-listen`: streamable HTTP, [`crate::http`]).
//!
//! A front end with no logic of its own: every tool is one or two calls to umbrad over its IPC
//! socket, as `vmctl session …` makes them, and its input schema is generated from the types
//! below, which are the IPC's own params (`umbra_api`) narrowed to what an agent may choose.
//!
//! The MCP client is an agent, not the person who started the server, so it gets less than an
//! IPC client: it shares only the folders the operator offered, by name and in the mode given
//! there; it reads and writes files inside the guest only (never `host: true`); it applies a
//! shadow folder's changes only with the change-set `shadow_diff` returned; it exposes ports on
//! 127.0.0.1 only; session settings beyond memory and vCPUs (network, policy, approval) are the
//! daemon's. A command that needs approval is put to the client as an elicitation when it
//! supports one; otherwise it is refused and the error says why.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    ListResourcesResult, PaginatedRequestParams, ProgressNotificationParam, ReadResourceRequestParams,
    ReadResourceResponse, ReadResourceResult, RequestMetaObject, Resource, ResourceContents, ServerCapabilities,
    ServerConfig,
};
use rmcp::service::RequestContext;
use rmcp::{tool, tool_handler, tool_router, ErrorData, Json, Peer, RoleServer, ServerHandler};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use umbra_api::client::{Client, Notifications};
use umbra_api::event::{PermissionKind, PermissionScope, ShadowApplyReport};
use umbra_api::methods::*;
use umbra_api::rpc::{NOTIFY_EVENT, NOTIFY_PROCESS};
use umbra_api::{ApiError, Data, EventKind, FolderSpec, SessionEvent, SessionInfo};

/// The folders an operator offers (`HOST_PATH[:NAME][:MODE]` each, shadow unless a mode is
/// given), their paths resolved now.
pub fn offered_folders(specs: &[String]) -> Result<Vec<FolderSpec>, String> {
    let mut folders = Vec::new();
    for spec in specs {
        // Shadow unless the operator said otherwise: the agent's edits wait for review.
        let has_mode =
            spec.contains(':') && spec.rsplit(':').next().is_some_and(|m| m.parse::<umbra_proto::ShareMode>().is_ok());
        let spec = if has_mode { spec.clone() } else { format!("{spec}:shadow") };
        let mut folder = parse_folder_spec(&spec)?;
        folder.path = std::fs::canonicalize(&folder.path).map_err(|e| format!("{}: {e}", folder.path.display()))?;
        folders.push(folder);
    }
    Ok(folders)
}

/// The server: where umbrad is, and the folders the operator allowed.
#[derive(Clone)]
pub struct UmbraMcp {
    socket: Option<PathBuf>,
    folders: Arc<Vec<FolderSpec>>,
    /// The sessions this server started: the only ones its tools reach (the operator's own,
    /// and other servers', have folders, secrets and settings this agent was not given).
    owned: Owned,
    /// Approval requests already put to the client (two `run`s in a session both see each).
    asked: Arc<Mutex<std::collections::HashSet<String>>>,
    tool_router: ToolRouter<Self>,
}

/// The session names a server (or every MCP session of umbrad's endpoint) started.
pub type Owned = Arc<Mutex<std::collections::BTreeSet<String>>>;

/// `session_start`'s input.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
pub struct McpStart {
    /// The session's name: `[A-Za-z0-9._-]`, at most 64 bytes.
    pub name: String,
    /// Folders to share, by the names `vmctl mcp --folder` gave them; each is mounted at
    /// `/sessions/<session>/mnt/<name>` in the mode given there.
    #[serde(default)]
    pub folders: Vec<String>,
    /// Guest memory in MiB (64 to 65536; default: the daemon's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u32>,
    /// Guest vCPUs (1 to 64; default: the daemon's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<u32>,
}

/// `run`'s input: `process.spawn` without a terminal, kept or detached processes.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
pub struct McpRun {
    pub session: String,
    /// The command; `argv[0]` is looked up in the guest's PATH (`["sh", "-c", "…"]` for a
    /// shell line).
    pub argv: Vec<String>,
    /// Working directory in the guest (absolute).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// SIGTERM after this many seconds, SIGKILL 3 s later; the result says `timed_out`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
}

/// `run`'s result. Output beyond [`OUTPUT_KEPT`] bytes per stream is dropped (`truncated`);
/// all of it went out as progress.
#[derive(Debug, Clone, Default, Deserialize, Serialize, JsonSchema)]
pub struct McpRunResult {
    /// The exit code, when it exited by itself.
    pub exit_code: Option<i32>,
    /// The signal that ended it, if one did.
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub stdout: String,
    pub stderr: String,
    pub truncated: bool,
    pub duration_ms: u64,
}

/// Output of a `run` kept for its result, per stream.
pub const OUTPUT_KEPT: usize = 1 << 20;

/// `file_read`'s input.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
pub struct McpRead {
    pub session: String,
    /// An absolute path in the guest.
    pub path: String,
    #[serde(default)]
    pub offset: u64,
    /// At most this many bytes (default and limit: 1 MiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub len: Option<u32>,
}

/// `file_write`'s input.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
pub struct McpWrite {
    pub session: String,
    /// An absolute path in the guest.
    pub path: String,
    /// The bytes: `data`, as UTF-8 text or (`encoding: "base64"`) base64.
    #[serde(flatten)]
    pub data: Data,
    /// Append instead of replacing the file.
    #[serde(default)]
    pub append: bool,
    /// Create missing parent directories.
    #[serde(default)]
    pub create_dirs: bool,
}

/// `file_list`'s input.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
pub struct McpList {
    pub session: String,
    /// An absolute path in the guest.
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

/// `shadow_apply`'s input: the change-set is required.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
pub struct McpApply {
    pub session: String,
    /// The shadow folder's name.
    pub folder: String,
    /// The change-set `shadow_diff` returned: its captured bytes are what is applied (the
    /// entries that apply by default: never `.git`, git hooks or ignored files).
    pub changeset: String,
}

/// `port_expose`'s input.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
pub struct McpExpose {
    pub session: String,
    /// The port a server listens on in the guest.
    pub guest_port: u16,
}

/// What an approval question asks of the person behind the MCP client.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
pub struct Approval {
    /// Run it.
    pub allow: bool,
}
rmcp::elicit_safe!(Approval);

fn api(e: ApiError) -> String {
    format!("{}: {}", e.code.name(), e.message)
}

impl UmbraMcp {
    pub fn new(socket: Option<PathBuf>, folders: Vec<FolderSpec>) -> Self {
        Self::sharing(socket, Arc::new(folders), Owned::default())
    }

    /// A server whose started sessions are `owned`, shared with others (umbrad's endpoint:
    /// one server per MCP session, one agent's set of sessions).
    pub fn sharing(socket: Option<PathBuf>, folders: Arc<Vec<FolderSpec>>, owned: Owned) -> Self {
        Self { socket, folders, owned, asked: Arc::default(), tool_router: Self::tool_router() }
    }

    /// Refuses a session this server did not start.
    fn check_owned(&self, session: &str) -> Result<(), String> {
        match self.owned.lock().unwrap().contains(session) {
            true => Ok(()),
            false => Err(format!(
                "not_found: no session {session:?} was started through this MCP server (its tools reach only \
                 those; start one with session_start)"
            )),
        }
    }

    /// One connection per tool call: calls are independent, and a `run`'s process events go to
    /// the connection that spawned it.
    async fn connect(&self) -> Result<(Client, Notifications), String> {
        Client::connect(self.socket.as_deref()).await.map_err(api)
    }

    async fn call<M: Method>(&self, params: M::Params) -> Result<Json<M::Result>, String> {
        let (client, _notes) = self.connect().await?;
        client.call::<M>(params).await.map(Json).map_err(api)
    }

    /// The start params for `req`: only the operator's folders, by name.
    fn start_params(&self, req: McpStart) -> Result<StartParams, String> {
        let mut folders = Vec::new();
        for name in &req.folders {
            let folder = self.folders.iter().find(|f| folder_name(f) == *name).ok_or_else(|| {
                let known: Vec<String> = self.folders.iter().map(folder_name).collect();
                format!(
                    "invalid_params: no folder {name:?} was offered to this MCP server (offered: {known:?}; `vmctl \
                     mcp --folder PATH[:NAME][:MODE]` offers one)"
                )
            })?;
            folders.push(folder.clone());
        }
        let settings =
            umbra_api::session::SettingsPatch { memory_mib: req.memory_mib, cpus: req.cpus, ..Default::default() };
        Ok(StartParams { name: req.name, folders, settings, ..Default::default() })
    }
}

/// The name a folder goes by: its own, else its directory's.
fn folder_name(f: &FolderSpec) -> String {
    f.name.clone().unwrap_or_else(|| f.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default())
}

#[tool_router]
impl UmbraMcp {
    /// Creates and boots a sandbox session (a Linux VM); returns once it is ready.
    #[tool(
        description = "Create and boot a sandbox session (its own Linux VM); returns once it is ready. Folders are \
                          shared by the names the server was given."
    )]
    async fn session_start(&self, Parameters(req): Parameters<McpStart>) -> Result<Json<SessionInfo>, String> {
        let params = self.start_params(req)?;
        let name = params.name.clone();
        let (client, _notes) = self.connect().await?;
        // A start naming an existing session would hand that session over, with whatever it has.
        let exists = client.call::<SessionGet>(SessionRef { name: name.clone() }).await.is_ok();
        if exists && !self.owned.lock().unwrap().contains(&name) {
            return Err(format!("session_exists: a session {name:?} exists already and was not started here"));
        }
        self.owned.lock().unwrap().insert(name);
        client.call::<SessionStart>(params).await.map(Json).map_err(api)
    }

    #[tool(description = "Stop a session: its processes end and its VM is destroyed; its folders and disk stay.")]
    async fn session_stop(&self, Parameters(req): Parameters<SessionRef>) -> Result<Json<SessionInfo>, String> {
        self.check_owned(&req.name)?;
        self.call::<SessionStop>(req).await
    }

    #[tool(description = "List the sessions started through this server, with their status.")]
    async fn session_list(&self) -> Result<Json<SessionList>, String> {
        let Json(mut list) = self.call::<SessionListMethod>(NoParams {}).await?;
        let owned = self.owned.lock().unwrap().clone();
        list.sessions.retain(|s| owned.contains(&s.name));
        Ok(Json(list))
    }

    #[tool(description = "Run a command in a session and wait for it: its output streams as progress, the result \
                          has its exit code, stdout and stderr. A command the session's approval rules ask about is \
                          put to you.")]
    async fn run(
        &self,
        Parameters(req): Parameters<McpRun>,
        meta: RequestMetaObject,
        peer: Peer<RoleServer>,
        cancel: tokio_util::sync::CancellationToken,
    ) -> Result<Json<McpRunResult>, String> {
        self.check_owned(&req.session)?;
        let (client, notes) = self.connect().await?;
        let session = req.session.clone();
        let process: Arc<Mutex<Option<u64>>> = Arc::default();
        let asking = Asking { peer: &peer, asked: &self.asked, tasks: Mutex::default() };
        tokio::select! {
            r = run(&client, notes, req, meta.get_progress_token(), &asking, &process) => r.map(Json),
            _ = cancel.cancelled() => {
                // The client gave up on the call: the command goes with it.
                let id = *process.lock().unwrap();
                if let Some(process) = id {
                    let kill = KillParams { session, process, signal: libc::SIGKILL };
                    let _ = client.call::<ProcessKill>(kill).await;
                }
                Err("cancelled by the client; the command was killed".into())
            }
        }
    }

    #[tool(description = "Read a file in a session's guest (at most 1 MiB at a time, from `offset`): text as it is, \
                          anything else base64 (`encoding` says which).")]
    async fn file_read(&self, Parameters(req): Parameters<McpRead>) -> Result<Json<FileData>, String> {
        self.check_owned(&req.session)?;
        let params = ReadParams { session: req.session, path: req.path, host: false, offset: req.offset, len: req.len };
        let Json(mut read) = self.call::<FileRead>(params).await?;
        // umbrad sends file contents as base64; a model reads text.
        let bytes = read.data.to_bytes().map_err(|e| format!("umbrad sent a file that is not base64: {e}"))?;
        read.data = Data::from_bytes(&bytes);
        Ok(Json(read))
    }

    #[tool(description = "Write (or append to) a file in a session's guest.")]
    async fn file_write(&self, Parameters(req): Parameters<McpWrite>) -> Result<Json<Written>, String> {
        self.check_owned(&req.session)?;
        let params = WriteParams {
            session: req.session,
            path: req.path,
            host: false,
            data: req.data,
            append: req.append,
            offset: None,
            create_dirs: req.create_dirs,
            permissions: None,
        };
        self.call::<FileWrite>(params).await
    }

    #[tool(description = "List a directory in a session's guest.")]
    async fn file_list(&self, Parameters(req): Parameters<McpList>) -> Result<Json<DirList>, String> {
        self.check_owned(&req.session)?;
        let params = ListParams { session: req.session, path: req.path, host: false, limit: req.limit };
        self.call::<FileList>(params).await
    }

    #[tool(description = "What the session changed in a shadow folder, captured as a change-set: review it, then \
                          `shadow_apply` it.")]
    async fn shadow_diff(&self, Parameters(req): Parameters<ShadowParams>) -> Result<Json<ShadowDiffResult>, String> {
        self.check_owned(&req.session)?;
        self.call::<ShadowDiff>(req).await
    }

    #[tool(description = "Write a reviewed change-set of a shadow folder to the host folder (the bytes `shadow_diff` \
                          captured; conflicts are left alone and reported).")]
    async fn shadow_apply(&self, Parameters(req): Parameters<McpApply>) -> Result<Json<ShadowApplyReport>, String> {
        self.check_owned(&req.session)?;
        // No `paths`: the entries that apply by default, never `.git`, hooks or ignored files
        // (those need a person naming them, `folders.md`).
        let params =
            ShadowApplyParams { session: req.session, folder: req.folder, changeset: Some(req.changeset), paths: None };
        self.call::<ShadowApply>(params).await
    }

    #[tool(description = "Reach a port of the session's guest from the host: a free port on 127.0.0.1 carries each \
                          connection to it.")]
    async fn port_expose(
        &self,
        Parameters(req): Parameters<McpExpose>,
    ) -> Result<Json<umbra_api::ports::PortInfo>, String> {
        self.check_owned(&req.session)?;
        let port = umbra_api::ports::PortSpec { guest_port: req.guest_port, host_port: None, bind: None };
        self.call::<SessionExpose>(umbra_api::ports::ExposeParams { session: req.session, port }).await
    }
}

/// The URI of a session's logs resource.
fn logs_uri(session: &str) -> String {
    format!("umbra://sessions/{session}/logs")
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for UmbraMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().enable_resources().build())
            .with_server_info(rmcp::model::Implementation::new("umbra", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Umbra runs each session in its own Linux VM. Start one with session_start, run commands with run, \
                 move files with file_read/file_write/file_list; changes to shadow folders reach the host only \
                 through shadow_diff then shadow_apply. Each session's logs are a resource.",
            )
    }

    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        let Json(list) = self.call::<SessionListMethod>(NoParams {}).await.map_err(internal)?;
        let owned = self.owned.lock().unwrap().clone();
        let resources = list
            .sessions
            .iter()
            .filter(|s| owned.contains(&s.name))
            .map(|s| {
                Resource::new(logs_uri(&s.name), format!("{} logs", s.name))
                    .with_description(format!("Session {}'s recent events and console lines", s.name))
                    .with_mime_type("text/plain")
            })
            .collect();
        Ok(ListResourcesResult::with_all_items(resources))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        let uri = request.uri.clone();
        let Some(name) = uri.strip_prefix("umbra://sessions/").and_then(|r| r.strip_suffix("/logs")) else {
            return Err(ErrorData::resource_not_found(format!("no resource {uri}"), None));
        };
        self.check_owned(name).map_err(|e| ErrorData::resource_not_found(e, None))?;
        let logs = self
            .call::<SessionLogsMethod>(LogsParams { name: name.into(), lines: Some(200) })
            .await
            .map_err(|e| ErrorData::resource_not_found(e, None))?
            .0;
        Ok(ReadResourceResult::new(vec![ResourceContents::text(logs_text(&logs), uri)]).into())
    }
}

fn internal(e: String) -> ErrorData {
    ErrorData::internal_error(e, None)
}

/// A session's logs as text: one line per event (its kind and JSON), then the console's lines.
fn logs_text(logs: &SessionLogs) -> String {
    let mut text = String::new();
    for ev in &logs.events {
        text.push_str(&serde_json::to_string(ev).unwrap_or_default());
        text.push('\n');
    }
    text.push_str("--- console\n");
    for line in &logs.console {
        text.push_str(line);
        text.push('\n');
    }
    text
}

/// Where a `run` puts approval questions: the client, the requests already asked (by any
/// call of this server), and the questions this call has open (aborted when it ends).
struct Asking<'a> {
    peer: &'a Peer<RoleServer>,
    asked: &'a Mutex<std::collections::HashSet<String>>,
    tasks: Mutex<tokio::task::JoinSet<()>>,
}

/// Runs `req` on `client`'s connection: spawns it (putting approval questions to the client),
/// streams its output as progress when the call carries a progress token, and collects it
/// until the exit. `started` gets the process's id once it runs.
async fn run(
    client: &Client,
    mut notes: Notifications,
    req: McpRun,
    progress: Option<rmcp::model::ProgressToken>,
    asking: &Asking<'_>,
    started: &Mutex<Option<u64>>,
) -> Result<McpRunResult, String> {
    // Approval questions come as events of the session, while the spawn waits for them.
    client.call::<EventsSubscribe>(SubscribeParams { session: Some(req.session.clone()) }).await.map_err(api)?;
    let refused: Arc<Mutex<Option<String>>> = Arc::default();
    let params = SpawnParams {
        session: req.session.clone(),
        argv: req.argv,
        cwd: req.cwd,
        env: req.env,
        tty: None,
        timeout_secs: req.timeout_secs,
        detach: false,
    };
    let spawning = client.call::<ProcessSpawn>(params);
    tokio::pin!(spawning);
    let spawned = loop {
        tokio::select! {
            // The answer first: the process's events follow it, and are read below.
            biased;
            r = &mut spawning => break r,
            n = notes.recv() => {
                let Some(n) = n else { break spawning.await };
                if n.method == NOTIFY_EVENT {
                    if let Ok(ev) = serde_json::from_value::<SessionEvent>(n.params) {
                        ask(client, asking, ev, &refused);
                    }
                }
            }
        }
    };
    let spawned = spawned.map_err(|e| match refused.lock().unwrap().take() {
        Some(why) => format!("{}: {} ({why})", e.code.name(), e.message),
        None => api(e),
    })?;
    *started.lock().unwrap() = Some(spawned.process);
    // Bytes, made text once at the end: a character split between two chunks stays whole.
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let mut truncated = false;
    let mut sent = 0u64;
    while let Some(n) = notes.recv().await {
        if n.method == NOTIFY_EVENT {
            if let Ok(ev) = serde_json::from_value::<SessionEvent>(n.params) {
                ask(client, asking, ev, &refused);
            }
            continue;
        }
        if n.method != NOTIFY_PROCESS {
            continue;
        }
        let Ok(ev) = serde_json::from_value::<SessionEvent>(n.params) else { continue };
        let is_stdout = matches!(ev.kind, EventKind::Stdout { .. });
        match ev.kind {
            EventKind::Stdout { process, data, .. } | EventKind::Stderr { process, data, .. }
                if process == spawned.process =>
            {
                let bytes = data.to_bytes().map_err(|e| format!("umbrad sent output that is not base64: {e}"))?;
                let kept = if is_stdout { &mut stdout } else { &mut stderr };
                let room = OUTPUT_KEPT.saturating_sub(kept.len());
                truncated |= bytes.len() > room;
                kept.extend_from_slice(&bytes[..bytes.len().min(room)]);
                sent += bytes.len() as u64;
                if let Some(token) = &progress {
                    let text = String::from_utf8_lossy(&bytes).into_owned();
                    let note = ProgressNotificationParam::new(token.clone(), sent as f64).with_message(text);
                    let _ = asking.peer.notify_progress(note).await;
                }
                let stream = if is_stdout { Stream::Stdout } else { Stream::Stderr };
                let ack = AckParams { session: req.session.clone(), process, stream, bytes: bytes.len() as u64 };
                client.notify::<ProcessAck>(ack).await.map_err(api)?;
            }
            EventKind::Exit(e) if e.process == spawned.process => {
                if e.lost {
                    return Err(format!("the command's VM went away: {}", e.reason.unwrap_or_default()));
                }
                return Ok(McpRunResult {
                    exit_code: e.code,
                    signal: e.signal,
                    timed_out: e.timed_out,
                    stdout: String::from_utf8_lossy(&stdout).into_owned(),
                    stderr: String::from_utf8_lossy(&stderr).into_owned(),
                    truncated,
                    duration_ms: e.duration_ms,
                });
            }
            _ => {}
        }
    }
    Err("umbrad closed the connection before the command ended".into())
}

/// Puts a command's `permission_request` to the person behind the MCP client (an elicitation,
/// until the request's own timeout) and answers umbrad; a client that cannot be asked gets it
/// refused, and `refused` says why for the tool's error. Each request is asked once, however
/// many calls of this server see it. The session is this server's (see `check_owned`), so the
/// commands asked about are its agent's.
fn ask(client: &Client, asking: &Asking<'_>, ev: SessionEvent, refused: &Arc<Mutex<Option<String>>>) {
    let EventKind::PermissionRequest {
        request_id,
        kind: PermissionKind::Command,
        command,
        cwd,
        env,
        env_changes_what_runs,
        decision,
        timeout_secs,
        ..
    } = ev.kind
    else {
        return;
    };
    if !asking.asked.lock().unwrap().insert(request_id.clone()) {
        return;
    }
    let why = decision.map(|d| d.reason.to_string()).unwrap_or_default();
    let mut question = format!("Umbra: the agent wants to run {command:?}, which needs approval ({why}).");
    if !cwd.is_empty() {
        question.push_str(&format!(" In {cwd:?}."));
    }
    if !env.is_empty() {
        let vars: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v:?}")).collect();
        question.push_str(&format!(" With {}.", vars.join(" ")));
    }
    if !env_changes_what_runs.is_empty() {
        question.push_str(&format!(" Note: {} change what actually runs.", env_changes_what_runs.join(", ")));
    }
    question.push_str(" Allow it?");
    let (client, peer, refused) = (client.clone(), asking.peer.clone(), refused.clone());
    let patience = std::time::Duration::from_secs(timeout_secs.max(1));
    asking.tasks.lock().unwrap().spawn(async move {
        let asked = peer.elicit_with_timeout::<Approval>(question, Some(patience)).await;
        let approved = match asked {
            Ok(Some(Approval { allow })) => allow,
            Ok(None) | Err(rmcp::service::ElicitationError::UserDeclined) => false,
            Err(rmcp::service::ElicitationError::UserCancelled) => false,
            Err(e) => {
                *refused.lock().unwrap() = Some(format!(
                    "it needs approval ({why}) and this MCP client could not be asked ({e}); allow it in the \
                     session's approval settings, or run it where a person can answer"
                ));
                false
            }
        };
        let answer = RespondPermissionParams {
            request_id,
            approved,
            scope: PermissionScope::Once,
            decision: None,
            remember: false,
        };
        let _ = client.call::<PermissionRespond>(answer).await;
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server() -> UmbraMcp {
        let folder = |path: &str, name: Option<&str>, mode| FolderSpec {
            path: PathBuf::from(path),
            name: name.map(String::from),
            mode,
        };
        UmbraMcp::new(
            None,
            vec![
                folder("/home/u/proj", None, umbra_proto::ShareMode::Shadow),
                folder("/home/u/data", Some("inputs"), umbra_proto::ShareMode::Ro),
            ],
        )
    }

    #[test]
    fn a_start_shares_only_the_offered_folders_by_name_and_no_other_setting() {
        let mcp = server();
        let req = |folders: &[&str]| McpStart {
            name: "s".into(),
            folders: folders.iter().map(|f| f.to_string()).collect(),
            memory_mib: Some(512),
            cpus: None,
        };
        let params = mcp.start_params(req(&["proj", "inputs"])).unwrap();
        let shared: Vec<_> = params.folders.iter().map(|f| (f.path.display().to_string(), f.mode)).collect();
        assert_eq!(
            shared,
            [
                ("/home/u/proj".into(), umbra_proto::ShareMode::Shadow),
                ("/home/u/data".into(), umbra_proto::ShareMode::Ro)
            ]
        );
        assert_eq!(params.settings.memory_mib, Some(512));
        assert!(params.secrets.is_empty() && params.ports.is_empty() && params.settings.network.is_none());
        let e = mcp.start_params(req(&["/etc"])).unwrap_err();
        assert!(e.contains("no folder \"/etc\" was offered") && e.contains("[\"proj\", \"inputs\"]"), "{e}");
        // A host path is not a name, even of an offered folder.
        assert!(mcp.start_params(req(&["/home/u/proj"])).is_err());
    }

    #[test]
    fn the_input_schemas_leave_out_host_paths_and_require_a_changeset() {
        let schema = |s: schemars::Schema| serde_json::to_value(s).unwrap();
        for s in [
            schema(schemars::schema_for!(McpRead)),
            schema(schemars::schema_for!(McpWrite)),
            schema(schemars::schema_for!(McpList)),
        ] {
            assert!(s["properties"].get("host").is_none(), "{s}");
        }
        let apply = schema(schemars::schema_for!(McpApply));
        assert!(apply["required"].as_array().unwrap().contains(&"changeset".into()), "{apply}");
        let start = schema(schemars::schema_for!(McpStart));
        let props: Vec<&String> = start["properties"].as_object().unwrap().keys().collect();
        assert_eq!(props, ["cpus", "folders", "memory_mib", "name"]);
    }
}
