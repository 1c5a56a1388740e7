//! E2B sandboxes as Umbra sessions: the registry this endpoint keeps (the sessions it started,
//! their tokens, timeouts and processes), and the sandbox REST API over it.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use http::StatusCode;
use serde_json::Value;
use umbra_api::client::{Client, Notifications};
use umbra_api::methods::{
    PathParams, ProcessSpawn, SessionDelete, SessionGet, SessionRef, SessionResume, SessionSnapshot, SessionStart,
    SpawnParams, StartParams,
};
use umbra_api::rpc::NOTIFY_PROCESS;
use umbra_api::{ApiError, ErrorCode, EventKind, SessionEvent};

use crate::connect::ConnectError;
use crate::records::Record;
use crate::wire::{self, ProcessConfig, RestError};

/// The home of E2B's default user, and the directory relative paths and commands start in.
pub const HOME: &str = "/home/user";
/// What a sandbox lives when create does not say (E2B's default).
const DEFAULT_TIMEOUT_SECS: u64 = 300;
/// The longest timeout accepted (E2B's Pro tier: 24 h).
const MAX_TIMEOUT_SECS: u64 = 24 * 3600;
/// Sandboxes one endpoint keeps at once.
const MAX_SANDBOXES: usize = 256;
/// Connections to umbrad this endpoint holds at most for streams, watch-free commands and
/// stdin (each needs its own: process events go to one connection). umbrad serves 64 clients
/// by default; the rest stay for everyone else. Plain calls share one connection.
const DEDICATED: usize = 24;
/// `CreateWatcher`s one sandbox keeps at most.
pub const WATCHERS_PER_SANDBOX: usize = 8;

/// What umbrad serves the E2B API with.
#[derive(Debug, Clone)]
pub struct Options {
    /// umbrad's socket (`None`: the default path).
    pub socket: Option<PathBuf>,
    /// E2B's template ids and the bundle each boots; `base` boots umbrad's configured bundle
    /// unless given here.
    pub templates: BTreeMap<String, String>,
    /// Where the sandboxes are kept across restarts (`records.rs`); `None`: in memory only.
    pub records: Option<PathBuf>,
}

/// A process this endpoint started (or can find) in a sandbox, by its guest pid.
#[derive(Clone)]
pub struct Proc {
    /// umbrad's id for it.
    pub process: u64,
    pub config: ProcessConfig,
    pub tag: Option<String>,
    pub pty: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Running,
    Paused,
}

pub struct Life {
    pub state: State,
    pub end_at: SystemTime,
    pub auto_pause: bool,
}

/// A `CreateWatcher`'s events not yet taken, and its polling task.
pub type Watcher = (Arc<Mutex<Vec<wire::FilesystemEvent>>>, tokio::task::AbortHandle);

/// One sandbox: an Umbra session named by its id.
pub struct Sandbox {
    pub id: String,
    pub template: String,
    token: String,
    token_digest: [u8; 32],
    pub metadata: BTreeMap<String, String>,
    pub env: BTreeMap<String, String>,
    pub started: SystemTime,
    pub cpus: u32,
    pub memory_mib: u32,
    pub disk_mib: u32,
    pub life: Mutex<Life>,
    pub procs: Mutex<BTreeMap<u32, Proc>>,
    /// Watchers of `CreateWatcher`, by id: their events so far and their polling task.
    pub watchers: Mutex<HashMap<String, Watcher>>,
}

impl Sandbox {
    /// Whether `token` is this sandbox's envd access token (compared as digests).
    pub fn admits(&self, token: &str) -> bool {
        digest(token.as_bytes()) == self.token_digest
    }

    pub fn state(&self) -> State {
        self.life.lock().unwrap().state
    }

    fn created(&self) -> wire::SandboxCreated {
        wire::SandboxCreated {
            template_id: self.template.clone(),
            sandbox_id: self.id.clone(),
            client_id: "umbrad".into(),
            envd_version: wire::ENVD_VERSION,
            envd_access_token: self.token.clone(),
            domain: None,
        }
    }

    fn record(&self) -> Record {
        let life = self.life.lock().unwrap();
        Record {
            id: self.id.clone(),
            template: self.template.clone(),
            token: self.token.clone(),
            metadata: self.metadata.clone(),
            env: self.env.clone(),
            started_ms: millis(self.started),
            end_at_ms: millis(life.end_at),
            paused: life.state == State::Paused,
            auto_pause: life.auto_pause,
            cpus: self.cpus,
            memory_mib: self.memory_mib,
            disk_mib: self.disk_mib,
        }
    }

    /// A kept sandbox after umbrad started again: its VM did not survive, so it is paused (its
    /// disk, and a snapshot if it was paused, are its session's); connecting resumes it.
    fn restored(r: Record) -> Self {
        Self {
            token_digest: digest(r.token.as_bytes()),
            id: r.id,
            template: r.template,
            token: r.token,
            metadata: r.metadata,
            env: r.env,
            started: from_millis(r.started_ms),
            cpus: r.cpus,
            memory_mib: r.memory_mib,
            disk_mib: r.disk_mib,
            life: Mutex::new(Life { state: State::Paused, end_at: from_millis(r.end_at_ms), auto_pause: r.auto_pause }),
            procs: Mutex::default(),
            watchers: Mutex::default(),
        }
    }

    fn detail(&self, with_token: bool) -> wire::SandboxDetail {
        let life = self.life.lock().unwrap();
        wire::SandboxDetail {
            template_id: self.template.clone(),
            sandbox_id: self.id.clone(),
            client_id: "umbrad".into(),
            started_at: rfc3339(self.started),
            end_at: rfc3339(life.end_at),
            cpu_count: self.cpus,
            memory_mb: self.memory_mib,
            disk_size_mb: self.disk_mib,
            state: match life.state {
                State::Running => "running",
                State::Paused => "paused",
            },
            envd_version: wire::ENVD_VERSION,
            metadata: self.metadata.clone(),
            envd_access_token: with_token.then(|| self.token.clone()),
            domain: None,
        }
    }

    /// The process `pid` (or the one tagged `tag`).
    pub fn find(&self, pid: Option<u32>, tag: Option<&str>) -> Result<(u32, Proc), ConnectError> {
        let procs = self.procs.lock().unwrap();
        let found = match (pid, tag) {
            (Some(pid), _) => procs.get(&pid).map(|p| (pid, p.clone())),
            (None, Some(tag)) => {
                procs.iter().find(|(_, p)| p.tag.as_deref() == Some(tag)).map(|(k, p)| (*k, p.clone()))
            }
            (None, None) => return Err(ConnectError::new("invalid_argument", "no process selected (pid or tag)")),
        };
        found.ok_or_else(|| match pid {
            Some(pid) => ConnectError::new("not_found", format!("process with pid {pid} not found")),
            None => ConnectError::new("not_found", format!("process with tag {:?} not found", tag.unwrap_or_default())),
        })
    }
}

/// The endpoint's state: its options and the sandboxes it started.
pub struct E2b {
    pub options: Options,
    sandboxes: Mutex<BTreeMap<String, Arc<Sandbox>>>,
    shared: tokio::sync::Mutex<Option<Client>>,
    dedicated: Arc<tokio::sync::Semaphore>,
    /// Held while the records are written: one writer at a time, each writing what is current.
    persisting: Mutex<()>,
}

/// A connection of its own to umbrad (a stream's, a command's): its process events are its
/// own. It counts against [`DEDICATED`] until dropped.
pub struct Dedicated {
    pub client: Client,
    pub notes: Notifications,
    _slot: tokio::sync::OwnedSemaphorePermit,
}

impl E2b {
    /// The endpoint, with the sandboxes kept in `options.records` from before (paused).
    pub fn new(options: Options) -> Arc<Self> {
        let kept = options.records.as_deref().map(crate::records::load).unwrap_or_default();
        let sandboxes = kept.into_iter().take(MAX_SANDBOXES).map(|r| (r.id.clone(), Arc::new(Sandbox::restored(r))));
        let sandboxes: BTreeMap<String, Arc<Sandbox>> = sandboxes.collect();
        if !sandboxes.is_empty() {
            tracing::info!(count = sandboxes.len(), "E2B: sandboxes kept from before, paused until connected");
        }
        let e2b = Arc::new(Self {
            options,
            sandboxes: Mutex::new(sandboxes),
            shared: tokio::sync::Mutex::default(),
            dedicated: Arc::new(tokio::sync::Semaphore::new(DEDICATED)),
            persisting: Mutex::default(),
        });
        tokio::spawn(reap(Arc::downgrade(&e2b)));
        e2b
    }

    /// The connection plain calls share (file calls, lists, signals, lifecycle): made when
    /// first needed and again after it is lost.
    pub async fn shared(&self) -> Result<Client, ApiError> {
        let mut shared = self.shared.lock().await;
        if let Some(c) = shared.as_ref().filter(|c| !c.is_closed()) {
            return Ok(c.clone());
        }
        let (client, mut notes) = Client::connect(self.options.socket.as_deref()).await?;
        // Nothing it does sends events; whatever comes is read and dropped, never left to fill.
        tokio::spawn(async move { while notes.recv().await.is_some() {} });
        *shared = Some(client.clone());
        Ok(client)
    }

    /// A connection of its own, or `busy` when this endpoint holds [`DEDICATED`] already.
    pub async fn dedicated(&self) -> Result<Dedicated, ApiError> {
        let slot = self.dedicated.clone().try_acquire_owned().map_err(|_| {
            ApiError::new(
                ErrorCode::Busy,
                format!("this E2B endpoint has {DEDICATED} streams and commands open already: end some first"),
            )
        })?;
        let (client, notes) = Client::connect(self.options.socket.as_deref()).await?;
        Ok(Dedicated { client, notes, _slot: slot })
    }

    pub fn sandbox(&self, id: &str) -> Option<Arc<Sandbox>> {
        self.sandboxes.lock().unwrap().get(id).cloned()
    }

    fn remove(&self, id: &str) -> Option<Arc<Sandbox>> {
        let sb = self.sandboxes.lock().unwrap().remove(id)?;
        for (_, (_, task)) in sb.watchers.lock().unwrap().drain() {
            task.abort();
        }
        self.persist();
        Some(sb)
    }

    /// Writes the sandboxes as they are now to `options.records` (after every change). A
    /// failure is logged: the sandboxes work on, and the next change writes them again.
    fn persist(&self) {
        let Some(path) = &self.options.records else { return };
        let _one = self.persisting.lock().unwrap();
        let all: Vec<Arc<Sandbox>> = self.sandboxes.lock().unwrap().values().cloned().collect();
        let records: Vec<Record> = all.iter().map(|sb| sb.record()).collect();
        if let Err(e) = crate::records::save(path, &records) {
            tracing::warn!(path = %path.display(), "E2B: cannot keep the sandboxes on disk: {e}");
        }
    }

    fn bundle_of(&self, template: &str) -> Result<Option<String>, RestFailure> {
        match self.options.templates.get(template) {
            Some(bundle) => Ok(Some(bundle.clone())),
            None if template == "base" => Ok(None),
            None => {
                let known: Vec<&str> =
                    std::iter::once("base").chain(self.options.templates.keys().map(String::as_str)).collect();
                Err(RestFailure::new(
                    StatusCode::BAD_REQUEST,
                    format!(
                        "template {template:?} is not known here: umbrad maps E2B templates to bundles with \
                         --e2b-template NAME=BUNDLE (known: {})",
                        known.join(", ")
                    ),
                ))
            }
        }
    }

    // ---- the REST API

    pub async fn create(&self, new: wire::NewSandbox) -> Result<(StatusCode, Value), RestFailure> {
        let template = new.template_id.filter(|t| !t.is_empty()).unwrap_or_else(|| "base".into());
        let bundle = self.bundle_of(&template)?;
        let timeout = check_timeout(new.timeout.unwrap_or(DEFAULT_TIMEOUT_SECS))?;
        if self.sandboxes.lock().unwrap().len() >= MAX_SANDBOXES {
            return Err(RestFailure::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!("this endpoint keeps at most {MAX_SANDBOXES} sandboxes: kill some first"),
            ));
        }
        let id = format!("e2b-{}", random_hex(8));
        let token = random_hex(24);
        let client = self.shared().await.map_err(RestFailure::api)?;
        // The sandbox's own timeout ends it, not umbrad's idle timeout. `allow_internet_access:
        // false` is no network at all (umbrad's `none`), whatever umbrad's configuration allows;
        // `true` (E2B's default) cannot loosen that configuration, which stays the ceiling.
        let network = (new.allow_internet_access == Some(false)).then(umbra_api::session::NetworkPolicy::default);
        let settings =
            umbra_api::session::SettingsPatch { bundle, idle_timeout_secs: Some(0), network, ..Default::default() };
        let params = StartParams { name: id.clone(), settings, ..Default::default() };
        let info = client.call::<SessionStart>(params).await.map_err(RestFailure::api)?;
        // E2B's default user's home: where commands run and relative paths point.
        let made = match self.dedicated().await {
            Ok(d) => run_in_guest(d, &id, &["mkdir", "-p", HOME]).await,
            Err(e) => Err(connect_error(e)),
        };
        if let Err(e) = made {
            let _ = client.call::<SessionDelete>(SessionRef { name: id.clone() }).await;
            return Err(RestFailure::new(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot make {HOME}: {e}")));
        }
        let now = SystemTime::now();
        let sb = Arc::new(Sandbox {
            id: id.clone(),
            template,
            token_digest: digest(token.as_bytes()),
            token,
            metadata: new.metadata.unwrap_or_default(),
            env: new.env_vars.unwrap_or_default(),
            started: now,
            cpus: info.settings.cpus,
            memory_mib: info.settings.memory_mib,
            disk_mib: info.settings.disk_size_mib.try_into().unwrap_or(u32::MAX),
            life: Mutex::new(Life {
                state: State::Running,
                end_at: now + Duration::from_secs(timeout),
                auto_pause: new.auto_pause.unwrap_or(false),
            }),
            procs: Mutex::default(),
            watchers: Mutex::default(),
        });
        tracing::info!(sandbox = %id, template = %sb.template, "E2B: sandbox created");
        let created = sb.created();
        self.sandboxes.lock().unwrap().insert(id, sb);
        self.persist();
        Ok((StatusCode::CREATED, serde_json::to_value(created).expect("serializes")))
    }

    pub fn list(&self, states: &[&str], metadata: &BTreeMap<String, String>) -> Value {
        let all: Vec<Arc<Sandbox>> = self.sandboxes.lock().unwrap().values().cloned().collect();
        let listed: Vec<wire::SandboxDetail> = all
            .iter()
            .map(|sb| sb.detail(false))
            .filter(|d| states.is_empty() || states.contains(&d.state))
            .filter(|d| metadata.iter().all(|(k, v)| d.metadata.get(k) == Some(v)))
            .collect();
        serde_json::to_value(listed).expect("serializes")
    }

    pub fn get(&self, id: &str) -> Result<Value, RestFailure> {
        let sb = self.sandbox(id).ok_or_else(|| RestFailure::not_found(id))?;
        Ok(serde_json::to_value(sb.detail(true)).expect("serializes"))
    }

    /// Deletes the session, and only then forgets the sandbox: a delete that fails leaves it
    /// listed (and its timeout running), never a VM nobody can find.
    pub async fn kill(&self, id: &str) -> Result<(), RestFailure> {
        let sb = self.sandbox(id).ok_or_else(|| RestFailure::not_found(id))?;
        let client = self.shared().await.map_err(RestFailure::api)?;
        match client.call::<SessionDelete>(SessionRef { name: sb.id.clone() }).await {
            Ok(_) => {}
            // Gone already (deleted by hand): killed all the same.
            Err(e) if e.code == ErrorCode::SessionNotFound => {}
            Err(e) => return Err(RestFailure::api(e)),
        }
        self.remove(id);
        Ok(())
    }

    pub fn set_timeout(&self, id: &str, timeout: u64) -> Result<(), RestFailure> {
        let sb = self.sandbox(id).ok_or_else(|| RestFailure::not_found(id))?;
        let timeout = check_timeout(timeout)?;
        sb.life.lock().unwrap().end_at = SystemTime::now() + Duration::from_secs(timeout);
        self.persist();
        Ok(())
    }

    /// Snapshots the session (its memory and disk to the host's disk; the VM stops). `Ok(false)`:
    /// it was paused already (E2B's 409).
    pub async fn pause(&self, id: &str) -> Result<bool, RestFailure> {
        let sb = self.sandbox(id).ok_or_else(|| RestFailure::not_found(id))?;
        if sb.state() == State::Paused {
            return Ok(false);
        }
        let client = self.shared().await.map_err(RestFailure::api)?;
        client.call::<SessionSnapshot>(SessionRef { name: sb.id.clone() }).await.map_err(RestFailure::api)?;
        // Its kept processes are in the snapshot: found again by pid once it resumes.
        sb.life.lock().unwrap().state = State::Paused;
        self.persist();
        Ok(true)
    }

    /// Resumes a paused sandbox (a running one just answers), with a new timeout if given.
    pub async fn connect_sandbox(&self, id: &str, timeout: Option<u64>) -> Result<Value, RestFailure> {
        let sb = self.sandbox(id).ok_or_else(|| RestFailure::not_found(id))?;
        let timeout = timeout.map(check_timeout).transpose()?;
        if sb.state() == State::Paused {
            let client = self.shared().await.map_err(RestFailure::api)?;
            let resume = umbra_api::methods::ResumeParams { name: sb.id.clone(), discard_snapshot: false };
            match client.call::<SessionResume>(resume).await {
                Ok(_) => {}
                // Its session was deleted meanwhile (by hand, while umbrad was down): gone.
                Err(e) if e.code == ErrorCode::SessionNotFound => {
                    self.remove(id);
                    return Err(RestFailure::not_found(id));
                }
                Err(e) => return Err(RestFailure::api(e)),
            }
            sb.life.lock().unwrap().state = State::Running;
        }
        let mut life = sb.life.lock().unwrap();
        let wanted = SystemTime::now() + Duration::from_secs(timeout.unwrap_or(DEFAULT_TIMEOUT_SECS));
        // Connecting extends a sandbox's life, never shortens it.
        if timeout.is_some() || life.end_at < wanted {
            life.end_at = wanted.max(life.end_at);
        }
        drop(life);
        self.persist();
        Ok(serde_json::to_value(sb.created()).expect("serializes"))
    }

    /// Whether the session behind `sb` still runs (umbrad may have stopped it: idle, a crash).
    pub async fn check_running(&self, sb: &Sandbox) -> Result<(), ConnectError> {
        if sb.state() == State::Paused {
            return Err(ConnectError::new(
                "unavailable",
                format!("sandbox {} is paused: connect to it (Sandbox.connect) to resume it", sb.id),
            ));
        }
        let client = self.shared().await.map_err(connect_error)?;
        match client.call::<SessionGet>(SessionRef { name: sb.id.clone() }).await {
            Ok(info) if info.status.is_active() => Ok(()),
            Ok(info) => Err(ConnectError::new(
                "unavailable",
                format!("sandbox {} was not found running: its session is {:?}", sb.id, info.status),
            )),
            Err(e) if e.code == ErrorCode::SessionNotFound => {
                Err(ConnectError::new("unavailable", format!("sandbox {} was not found", sb.id)))
            }
            Err(e) => Err(connect_error(e)),
        }
    }
}

/// Kills (or pauses, with `autoPause`) sandboxes whose timeout passed.
async fn reap(e2b: std::sync::Weak<E2b>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let Some(e2b) = e2b.upgrade() else { return };
        let now = SystemTime::now();
        let due: Vec<(String, bool)> = e2b
            .sandboxes
            .lock()
            .unwrap()
            .values()
            .filter_map(|sb| {
                let life = sb.life.lock().unwrap();
                (life.state == State::Running && life.end_at <= now).then(|| (sb.id.clone(), life.auto_pause))
            })
            .collect();
        for (id, pause) in due {
            // Given more time since it was found due (a timeout set, a connect): not due.
            let still_due = e2b.sandbox(&id).is_some_and(|sb| {
                let life = sb.life.lock().unwrap();
                life.state == State::Running && life.end_at <= SystemTime::now()
            });
            if !still_due {
                continue;
            }
            let done = match pause {
                // A backend that cannot snapshot: the sandbox ends all the same.
                true => match e2b.pause(&id).await {
                    Ok(_) => Ok(()),
                    Err(e) => {
                        tracing::warn!(sandbox = %id, "E2B: cannot pause at the timeout ({}): killing it", e.message);
                        e2b.kill(&id).await
                    }
                },
                false => e2b.kill(&id).await,
            };
            match done {
                Ok(()) => tracing::info!(sandbox = %id, paused = pause, "E2B: the sandbox's timeout passed"),
                Err(e) => tracing::warn!(sandbox = %id, "E2B: ending a sandbox whose timeout passed: {}", e.message),
            }
        }
    }
}

fn check_timeout(secs: u64) -> Result<u64, RestFailure> {
    match secs {
        1..=MAX_TIMEOUT_SECS => Ok(secs),
        _ => Err(RestFailure::new(
            StatusCode::BAD_REQUEST,
            format!("a timeout of {secs} s: it must be 1 to {MAX_TIMEOUT_SECS} seconds"),
        )),
    }
}

/// A REST call's failure: its status and E2B's `{code, message}`.
#[derive(Debug, Clone)]
pub struct RestFailure {
    pub status: StatusCode,
    pub message: String,
}

impl RestFailure {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self { status, message: message.into() }
    }

    fn not_found(id: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, format!("sandbox {id:?} not found"))
    }

    pub fn api(e: ApiError) -> Self {
        let status = match e.code {
            ErrorCode::InvalidParams | ErrorCode::InvalidRequest | ErrorCode::ParseError => StatusCode::BAD_REQUEST,
            ErrorCode::SessionNotFound | ErrorCode::NotFound => StatusCode::NOT_FOUND,
            ErrorCode::SessionExists | ErrorCode::AlreadyExists | ErrorCode::InvalidState => StatusCode::CONFLICT,
            ErrorCode::PermissionDenied | ErrorCode::Unauthorized | ErrorCode::DisabledByAdmin => StatusCode::FORBIDDEN,
            ErrorCode::Busy => StatusCode::TOO_MANY_REQUESTS,
            ErrorCode::Unsupported => StatusCode::NOT_IMPLEMENTED,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        Self::new(status, format!("{}: {}", e.code.name(), e.message))
    }

    pub fn body(&self) -> RestError {
        RestError { code: self.status.as_u16(), message: self.message.clone() }
    }
}

/// umbrad's error as a Connect error.
pub fn connect_error(e: ApiError) -> ConnectError {
    let code = match e.code {
        ErrorCode::InvalidParams | ErrorCode::InvalidRequest | ErrorCode::ParseError => "invalid_argument",
        ErrorCode::NotFound => "not_found",
        ErrorCode::SessionNotFound | ErrorCode::SessionLost | ErrorCode::Unavailable => "unavailable",
        ErrorCode::AlreadyExists | ErrorCode::SessionExists => "already_exists",
        ErrorCode::PermissionDenied | ErrorCode::DisabledByAdmin => "permission_denied",
        ErrorCode::Unauthorized => "unauthenticated",
        ErrorCode::Busy | ErrorCode::TooLarge => "resource_exhausted",
        ErrorCode::Timeout => "deadline_exceeded",
        ErrorCode::InvalidState => "failed_precondition",
        ErrorCode::Unsupported | ErrorCode::MethodNotFound => "unimplemented",
        _ => "internal",
    };
    ConnectError::new(code, e.message)
}

/// Runs `argv` in the guest to its end (no shell: each argument is one word), for the
/// filesystem operations the guest agent has no call for. Its stderr, on failure.
pub async fn run_in_guest(conn: Dedicated, session: &str, argv: &[&str]) -> Result<(), ConnectError> {
    let Dedicated { client, mut notes, _slot } = conn;
    let client = &client;
    let params = SpawnParams {
        session: session.into(),
        argv: argv.iter().map(|a| a.to_string()).collect(),
        cwd: None,
        env: BTreeMap::new(),
        tty: None,
        timeout_secs: Some(60),
        detach: false,
    };
    let spawned = client.call::<ProcessSpawn>(params).await.map_err(connect_error)?;
    let mut stderr = Vec::new();
    while let Some(n) = notes.recv().await {
        if n.method != NOTIFY_PROCESS {
            continue;
        }
        let Ok(ev) = serde_json::from_value::<SessionEvent>(n.params) else { continue };
        match ev.kind {
            EventKind::Stderr { process, data, .. } if process == spawned.process => {
                let bytes = data.to_bytes().map_err(connect_error)?;
                if stderr.len() < 4096 {
                    stderr.extend_from_slice(&bytes);
                }
                ack(client, session, process, umbra_api::methods::Stream::Stderr, bytes.len()).await;
            }
            EventKind::Stdout { process, data, .. } if process == spawned.process => {
                let n = data.to_bytes().map(|b| b.len()).unwrap_or(0);
                ack(client, session, process, umbra_api::methods::Stream::Stdout, n).await;
            }
            EventKind::Exit(e) if e.process == spawned.process => {
                return match e.code {
                    Some(0) => Ok(()),
                    _ => Err(ConnectError::new(
                        "internal",
                        format!("{} failed: {}", argv[0], String::from_utf8_lossy(&stderr).trim()),
                    )),
                };
            }
            _ => {}
        }
    }
    Err(ConnectError::new("unavailable", "umbrad closed the connection before the command ended"))
}

pub async fn ack(client: &Client, session: &str, process: u64, stream: umbra_api::methods::Stream, bytes: usize) {
    if bytes > 0 {
        let params = umbra_api::methods::AckParams { session: session.into(), process, stream, bytes: bytes as u64 };
        let _ = client.notify::<umbra_api::methods::ProcessAck>(params).await;
    }
}

/// A path as envd resolves it: relative to the user's home.
pub fn resolve(path: &str) -> String {
    match path {
        "" | "~" => HOME.into(),
        p if p.starts_with('/') => p.into(),
        p => match p.strip_prefix("~/") {
            Some(rest) => format!("{HOME}/{rest}"),
            None => format!("{HOME}/{p}"),
        },
    }
}

/// `file.stat` of a guest path.
pub fn path_params(session: &str, path: &str) -> PathParams {
    PathParams { session: session.into(), path: path.into(), host: false }
}

fn millis(t: SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis().try_into().unwrap_or(u64::MAX))
}

fn from_millis(ms: u64) -> SystemTime {
    std::time::UNIX_EPOCH + Duration::from_millis(ms)
}

pub fn rfc3339(t: SystemTime) -> String {
    let ms = t.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis().try_into().unwrap_or(i64::MAX));
    rfc3339_ms(ms)
}

/// Milliseconds since the epoch as RFC 3339: any value reads as a time (the guest chooses its
/// files' times), the epoch when it is out of range.
pub fn rfc3339_ms(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms).unwrap_or_default().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

pub fn digest(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).into()
}

/// `n` random bytes as hex (from the kernel's generator).
pub fn random_hex(n: usize) -> String {
    let mut bytes = vec![0u8; n];
    std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom").expect("/dev/urandom"), &mut bytes)
        .expect("/dev/urandom gives bytes");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_resolve_against_the_users_home() {
        assert_eq!(resolve("a.txt"), "/home/user/a.txt");
        assert_eq!(resolve("~/d/a"), "/home/user/d/a");
        assert_eq!(resolve(""), "/home/user");
        assert_eq!(resolve("/etc/hosts"), "/etc/hosts");
    }

    #[test]
    fn umbrads_errors_become_e2bs() {
        let e = RestFailure::api(ApiError::new(ErrorCode::SessionNotFound, "no session x"));
        assert_eq!((e.status, e.body().code), (StatusCode::NOT_FOUND, 404));
        assert_eq!(connect_error(ApiError::new(ErrorCode::NotFound, "gone")).code, "not_found");
        assert_eq!(connect_error(ApiError::new(ErrorCode::SessionLost, "vm died")).code, "unavailable");
        assert!(check_timeout(0).is_err() && check_timeout(MAX_TIMEOUT_SECS + 1).is_err());
        assert_eq!(check_timeout(300).unwrap(), 300);
        assert_eq!(rfc3339(std::time::UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        assert_eq!(random_hex(8).len(), 16);
    }
}
