//! The shim v2 task service: a pod is one Umbra session (one microVM), each container a
//! process tree in it with its rootfs shared over virtio-fs, and each of its processes an
//! agent spawn of `container-exec` (`umbra_proto::container`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use containerd_shim::asynchronous::ExitSignal;
use containerd_shim::protos::events::task::{
    TaskCreate, TaskDelete, TaskExecAdded, TaskExecStarted, TaskExit, TaskIO, TaskOOM, TaskStart,
};
use containerd_shim::protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim::protos::protobuf::MessageDyn;
use containerd_shim::protos::shim_async::Task;
use containerd_shim::protos::topics;
use containerd_shim::protos::ttrpc::{self, context::Context};
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::{api, TtrpcContext, TtrpcResult};
use oci_spec::runtime::Spec;
use tokio::sync::watch;
use umbra_api::methods::StartParams;
use umbra_api::{DaemonConfig, FolderSpec};
use umbra_proto::container::ContainerExec;
use umbra_proto::ShareMode;
use umbra_runtime::session::{ExecControl, ExecRequest, ManagerOptions, Session, SessionManager};

use crate::config::{self, ShimConfig};
use crate::io;

/// The one session of a shim: its pod's VM.
const POD: &str = "pod";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Created,
    /// Its spawn is under way: neither startable nor deletable.
    Starting,
    Running,
    Stopped,
}

#[derive(Clone, Copy, Debug)]
struct Exited {
    status: u32,
    at: SystemTime,
}

/// One process of a container: its init (`exec_id` empty) or a `ctr task exec`.
struct Proc {
    container: String,
    exec_id: String,
    stdio: io::Stdio,
    request: Mutex<Option<ContainerExec>>,
    state: Mutex<ProcState>,
    done: watch::Sender<Option<Exited>>,
}

struct ProcState {
    status: Status,
    /// Its pid in the guest (containerd is told the shim's: a pid it looks up on the host,
    /// `/proc/<pid>/ns/net` for a CRI pod's later containers, must be a host process in the
    /// pod's network namespace, as Kata reports its VMM's).
    guest_pid: u32,
    control: Option<ExecControl>,
}

impl Proc {
    fn new(container: &str, exec_id: &str, stdio: io::Stdio, request: ContainerExec) -> Arc<Self> {
        Arc::new(Self {
            container: container.to_string(),
            exec_id: exec_id.to_string(),
            stdio,
            request: Mutex::new(Some(request)),
            state: Mutex::new(ProcState { status: Status::Created, guest_pid: 0, control: None }),
            done: watch::channel(None).0,
        })
    }

    fn exited(&self) -> Option<Exited> {
        *self.done.borrow()
    }

    fn guest_pid(&self) -> u32 {
        self.state.lock().unwrap().guest_pid
    }

    fn status(&self) -> Status {
        self.state.lock().unwrap().status
    }

    /// Ends a process that never ran (killed before its start, or a start that failed).
    fn end_unstarted(&self, status: u32) -> Exited {
        self.request.lock().unwrap().take();
        self.state.lock().unwrap().status = Status::Stopped;
        let exited = Exited { status, at: SystemTime::now() };
        self.done.send_replace(Some(exited));
        exited
    }
}

/// The pid containerd is told for every process: the shim's own (see [`ProcState::guest_pid`]).
fn host_pid() -> u32 {
    std::process::id()
}

struct Container {
    bundle: String,
    /// Its cgroup in the guest (under the agent's commands group), named as its folder.
    cgroup: String,
    /// `<pod dir>/<folder>`, where we mounted its rootfs (unmounted on delete).
    rootfs: PathBuf,
    folder: String,
    init: Arc<Proc>,
    execs: HashMap<String, Arc<Proc>>,
}

pub struct Inner {
    namespace: String,
    /// containerd's socket: while it is gone longer than the grace, the shim ends its pod.
    containerd: String,
    exit: Arc<ExitSignal>,
    publisher: RemotePublisher,
    /// The handler's options; an error refuses every container until containerd passes
    /// options that load (an admin's typo must not fall back to the permissive defaults).
    config: Mutex<Result<ShimConfig, String>>,
    /// Held across a container's create and its init's delete: the pod's VM, directory and
    /// container set change together.
    lifecycle: tokio::sync::Mutex<()>,
    /// Whether this shim runs in the pod's own network namespace (a CRI pod, `ctr run
    /// --with-ns network:…`): then its ports listen on every address there.
    pod_netns: bool,
    /// Where the pod's containers' rootfs are mounted (`pod_dir.rs`).
    pod_dir: PathBuf,
    manager: tokio::sync::OnceCell<SessionManager>,
    pod: tokio::sync::Mutex<Option<Arc<Session>>>,
    containers: Mutex<HashMap<String, Container>>,
}

#[derive(Clone)]
pub struct Service(Arc<Inner>);

fn status(code: ttrpc::Code, message: impl Into<String>) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(code, message.into()))
}

fn not_found(what: &str) -> ttrpc::Error {
    status(ttrpc::Code::NOT_FOUND, format!("{what}: not found"))
}

fn timestamp(at: SystemTime) -> Timestamp {
    let d = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    Timestamp { seconds: d.as_secs() as i64, nanos: d.subsec_nanos() as i32, ..Default::default() }
}

/// A container id as a folder and cgroup name (letters, digits, `_`, `-`, at most 64 bytes):
/// the id itself when it fits, else its start and a hash of all of it (CRI ids are 64 hex).
pub fn folder_name(id: &str) -> String {
    use sha2::{Digest, Sha256};
    let clean: String =
        id.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' || c == '-' { c } else { '_' }).collect();
    if clean == id && id.len() <= 60 {
        return format!("c-{id}");
    }
    let hash: String = Sha256::digest(id.as_bytes()).iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("c-{}-{hash}", &clean[..clean.len().min(40)])
}

impl Service {
    pub fn new(
        namespace: &str,
        containerd: &str,
        exit: Arc<ExitSignal>,
        publisher: RemotePublisher,
        pod_netns: bool,
        pod_dir: PathBuf,
    ) -> Self {
        let config = ShimConfig::load(None);
        let inner = Arc::new(Inner {
            namespace: namespace.to_string(),
            containerd: containerd.to_string(),
            exit,
            publisher,
            config: Mutex::new(config),
            lifecycle: tokio::sync::Mutex::new(()),
            pod_netns,
            pod_dir,
            manager: tokio::sync::OnceCell::new(),
            pod: tokio::sync::Mutex::new(None),
            containers: Mutex::new(HashMap::new()),
        });
        tokio::spawn(watch_containerd(Arc::downgrade(&inner)));
        Self(inner)
    }

    fn config(&self) -> Result<ShimConfig, String> {
        self.0.config.lock().unwrap().clone()
    }

    async fn publish(&self, topic: &str, event: Box<dyn MessageDyn>) {
        if let Err(e) = self.0.publisher.publish(Context::default(), topic, &self.0.namespace, event).await {
            tracing::warn!("publishing {topic}: {e}");
        }
    }

    fn process(&self, id: &str, exec_id: &str) -> TtrpcResult<Arc<Proc>> {
        let containers = self.0.containers.lock().unwrap();
        let c = containers.get(id).ok_or_else(|| not_found(&format!("container {id}")))?;
        if exec_id.is_empty() {
            return Ok(c.init.clone());
        }
        c.execs.get(exec_id).cloned().ok_or_else(|| not_found(&format!("process {exec_id} of {id}")))
    }

    async fn manager(&self) -> &SessionManager {
        self.0
            .manager
            .get_or_init(|| async {
                let shim = self.config().unwrap_or_default();
                let config = DaemonConfig {
                    boot_timeout_secs: shim.boot_timeout_secs,
                    // Inside a pod's own network namespace its ports are the pod's, on every
                    // address; otherwise they stay on the host's loopback.
                    ports_beyond_loopback: self.0.pod_netns,
                    ports_privileged: self.0.pod_netns,
                    ..DaemonConfig::default()
                };
                SessionManager::new(ManagerOptions::ephemeral(config))
            })
            .await
    }

    /// Mounts the container's rootfs (containerd's snapshot mounts, or the spec's root) at
    /// `<pod dir>/<id>`: the pod directory is a shared mount made before the VM's folder
    /// server started, so what is mounted under it later reaches that server's namespace (a
    /// slave of the host's) and can be shared with the running VM.
    fn mount_rootfs(&self, req: &api::CreateTaskRequest, spec: &Spec, bundle: &Path) -> Result<PathBuf, String> {
        let pod_dir = crate::pod_dir::ensure(&self.0.pod_dir)?;
        let target = pod_dir.join(folder_name(&req.id));
        std::fs::create_dir_all(&target).map_err(|e| format!("{}: {e}", target.display()))?;
        let result = if req.rootfs.is_empty() {
            let root = spec.root().as_ref().map(|r| r.path().clone()).unwrap_or_else(|| "rootfs".into());
            let root = if root.is_absolute() { root } else { bundle.join(root) };
            use nix::mount::MsFlags;
            nix::mount::mount(Some(&root), &target, None::<&str>, MsFlags::MS_BIND | MsFlags::MS_REC, None::<&str>)
                .and_then(|()| {
                    let flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
                    nix::mount::mount(None::<&str>, &target, None::<&str>, flags, None::<&str>)
                })
                .map_err(|e| format!("binding the rootfs {}: {e}", root.display()))
        } else {
            // nosuid, nodev: a set-id binary or a device node of an image is never usable on the
            // host through this mount (containerd keeps its snapshots out of reach at 0700 for
            // the same reason; the pod directory is 0700 too).
            req.rootfs.iter().try_for_each(|m| {
                let mut options = m.options.clone();
                options.extend(["nosuid".to_string(), "nodev".to_string()]);
                containerd_shim::mount::mount_rootfs(Some(m.type_.as_str()), Some(m.source.as_str()), &options, &target)
                    .map_err(|e| format!("mounting the rootfs ({} {}): {e}", m.type_, m.source))
            })
        };
        if let Err(e) = result {
            unmount(&target);
            let _ = std::fs::remove_dir(&target);
            return Err(e);
        }
        Ok(target)
    }

    /// The pod's VM with `folder` shared: booted for the first container, the folder added
    /// to it for later ones.
    async fn pod_with(&self, spec: &Spec, folder: FolderSpec) -> Result<Arc<Session>, String> {
        let mut pod = self.0.pod.lock().await;
        if let Some(session) = pod.as_ref() {
            session.mount(folder).await.map_err(|e| e.to_string())?;
            return Ok(session.clone());
        }
        let settings = self.config()?.settings(spec)?;
        let annotations = spec.annotations().clone().unwrap_or_default();
        let bind = if self.0.pod_netns { std::net::Ipv4Addr::UNSPECIFIED } else { std::net::Ipv4Addr::LOCALHOST };
        let ports = config::ports(&annotations)?
            .into_iter()
            .map(|(pod_port, guest_port)| umbra_api::ports::PortSpec {
                guest_port,
                host_port: Some(pod_port),
                bind: Some(bind.into()),
            })
            .collect();
        let manager = self.manager().await;
        let params = StartParams { name: POD.into(), folders: vec![folder], settings, ports, ..Default::default() };
        let session = manager.start(params).await.map_err(|e| format!("the pod's VM did not start: {e}"))?;
        *pod = Some(session.clone());
        tokio::spawn(watch_oom(self.clone(), session.clone()));
        Ok(session)
    }

    async fn session(&self) -> TtrpcResult<Arc<Session>> {
        self.0.pod.lock().await.clone().ok_or_else(|| status(ttrpc::Code::FAILED_PRECONDITION, "the pod has no VM"))
    }

    /// Starts `proc` in the pod's VM and pumps its stdio and exit; a start that fails ends the
    /// process (an exit event says so) and says why.
    async fn launch(&self, proc: &Arc<Proc>, join: Option<u32>) -> TtrpcResult<()> {
        let request = {
            let mut state = proc.state.lock().unwrap();
            if state.status != Status::Created {
                return Err(status(ttrpc::Code::FAILED_PRECONDITION, format!("{} was started already", proc.exec_id)));
            }
            state.status = Status::Starting;
            proc.request.lock().unwrap().take()
        };
        let Some(mut request) = request else {
            return Err(status(ttrpc::Code::FAILED_PRECONDITION, format!("{} was started already", proc.exec_id)));
        };
        request.join = join;
        let spawned = match self.session().await {
            Ok(session) => {
                let argv = std::iter::once("/proc/1/exe".to_string()).chain(request.to_argv()).collect();
                let tty = proc.stdio.terminal.then_some(umbra_proto::TtySize { rows: 24, cols: 80 });
                session
                    .spawn(ExecRequest { argv, tty, ..Default::default() })
                    .await
                    .map_err(|e| status(ttrpc::Code::UNKNOWN, format!("starting {:?}: {e}", request.args)))
            }
            Err(e) => Err(e),
        };
        let exec = match spawned {
            Ok(exec) => exec,
            Err(e) => {
                let exited = proc.end_unstarted(umbra_api::event::EXIT_CANNOT_RUN as u32);
                self.publish_exit(proc, exited).await;
                return Err(e);
            }
        };
        {
            let mut state = proc.state.lock().unwrap();
            state.status = Status::Running;
            state.guest_pid = exec.pid();
            state.control = Some(exec.control());
        }
        let (service, proc) = (self.clone(), proc.clone());
        tokio::spawn(async move {
            let status = io::pump(exec, &proc.stdio).await;
            let exited = Exited { status, at: SystemTime::now() };
            if proc.exec_id.is_empty() {
                // The container ends with its first process, as runc's shim ends a container
                // without a pid namespace of its own: whatever it left running goes too.
                service.kill_container(&proc.container).await;
            }
            proc.state.lock().unwrap().status = Status::Stopped;
            proc.done.send_replace(Some(exited));
            service.publish_exit(&proc, exited).await;
        });
        Ok(())
    }

    async fn publish_exit(&self, proc: &Proc, exited: Exited) {
        let event = TaskExit {
            container_id: proc.container.clone(),
            id: if proc.exec_id.is_empty() { proc.container.clone() } else { proc.exec_id.clone() },
            pid: host_pid(),
            exit_status: exited.status,
            exited_at: Some(timestamp(exited.at)).into(),
            ..Default::default()
        };
        self.publish(topics::TASK_EXIT_EVENT_TOPIC, Box::new(event)).await;
    }

    /// SIGKILLs every process of a container (its guest cgroup's `cgroup.kill`); best effort.
    async fn kill_container(&self, id: &str) {
        let cgroup = self.0.containers.lock().unwrap().get(id).map(|c| c.cgroup.clone());
        let (Some(cgroup), Ok(session)) = (cgroup, self.session().await) else { return };
        let path = format!("{}/{cgroup}/cgroup.kill", crate::stats::CGROUP);
        let mode = umbra_proto::WriteMode::Truncate;
        if let Err(e) = session.write_file(&path, false, b"1", mode, false, None).await {
            tracing::debug!("killing container {id}'s processes: {e}");
        }
    }

    /// Ends the pod's VM and every helper of it; the shim exits after.
    async fn end_pod(&self) {
        if let Some(manager) = self.0.manager.get() {
            manager.shutdown().await;
        }
        *self.0.pod.lock().await = None;
    }
}

/// How often the guest's OOM kill count is read.
const OOM_EVERY: Duration = Duration::from_secs(2);

/// While the pod's VM runs, each OOM kill in it is an OOM event for the pod's running
/// containers (the guest's figure is the pod's: one cgroup holds all its containers).
async fn watch_oom(service: Service, session: Arc<Session>) {
    let mut seen = crate::stats::oom_kills(&session).await.unwrap_or(0);
    loop {
        tokio::time::sleep(OOM_EVERY).await;
        if !session.status().is_active() {
            return;
        }
        let Some(now) = crate::stats::oom_kills(&session).await else { continue };
        if now > seen {
            let running: Vec<String> = service
                .0
                .containers
                .lock()
                .unwrap()
                .iter()
                .filter(|(_, c)| c.init.state.lock().unwrap().status == Status::Running)
                .map(|(id, _)| id.clone())
                .collect();
            for id in running {
                service
                    .publish(topics::TASK_OOM_EVENT_TOPIC, Box::new(TaskOOM { container_id: id, ..Default::default() }))
                    .await;
            }
        }
        seen = now;
    }
}

/// Every second, whether containerd still listens; once it has been gone for the handler's
/// `orphan_grace_secs`, the pod's VM is stopped and the shim exits (a shim outliving its
/// containerd for good would keep a VM nobody can reach).
async fn watch_containerd(inner: std::sync::Weak<Inner>) {
    let mut gone_since: Option<std::time::Instant> = None;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let Some(inner) = inner.upgrade() else { return };
        let socket = inner.containerd.strip_prefix("unix://").unwrap_or(&inner.containerd).to_string();
        if tokio::net::UnixStream::connect(&socket).await.is_ok() {
            gone_since = None;
            continue;
        }
        let since = *gone_since.get_or_insert_with(std::time::Instant::now);
        let grace = inner.config.lock().unwrap().as_ref().map_or(60, |c| c.orphan_grace_secs);
        let grace = Duration::from_secs(grace);
        if since.elapsed() >= grace {
            tracing::warn!("containerd at {socket} has been gone for {grace:?}: stopping the pod");
            let service = Service(inner.clone());
            let rootfs: Vec<PathBuf> = inner.containers.lock().unwrap().values().map(|c| c.rootfs.clone()).collect();
            service.end_pod().await;
            for path in rootfs {
                unmount(&path);
            }
            crate::pod_dir::remove(&inner.pod_dir);
            inner.exit.signal();
            return;
        }
    }
}

/// Unmounts a container's rootfs mount point and removes it.
pub fn unmount(path: &Path) {
    if let Err(e) = nix::mount::umount2(path, nix::mount::MntFlags::MNT_DETACH) {
        if e != nix::errno::Errno::EINVAL && e != nix::errno::Errno::ENOENT {
            tracing::warn!("unmounting {}: {e}", path.display());
        }
    }
    let _ = std::fs::remove_dir(path);
}

#[async_trait]
impl Task for Service {
    async fn create(&self, _ctx: &TtrpcContext, req: api::CreateTaskRequest) -> TtrpcResult<api::CreateTaskResponse> {
        if !req.checkpoint.is_empty() {
            return Err(status(ttrpc::Code::UNIMPLEMENTED, "restoring a container from a checkpoint"));
        }
        let _lifecycle = self.0.lifecycle.lock().await;
        if self.0.containers.lock().unwrap().contains_key(&req.id) {
            return Err(status(ttrpc::Code::ALREADY_EXISTS, format!("container {}", req.id)));
        }
        if let Some(any) = req.options.as_ref() {
            let (path, body) =
                config::runtime_options(&any.value).map_err(|e| status(ttrpc::Code::INVALID_ARGUMENT, e))?;
            let loaded = match (path, body) {
                (_, Some(body)) => Some(ShimConfig::parse(&body)),
                (Some(path), None) => Some(ShimConfig::load(Some(Path::new(&path)))),
                (None, None) => None,
            };
            if let Some(config) = loaded {
                *self.0.config.lock().unwrap() = config;
            }
        }
        if let Err(e) = self.config() {
            return Err(status(ttrpc::Code::INVALID_ARGUMENT, format!("the runtime handler's options: {e}")));
        }
        let bundle = PathBuf::from(&req.bundle);
        let spec = Spec::load(bundle.join("config.json"))
            .map_err(|e| status(ttrpc::Code::INVALID_ARGUMENT, format!("{}/config.json: {e}", req.bundle)))?;
        let rootfs = self.mount_rootfs(&req, &spec, &bundle).map_err(|e| status(ttrpc::Code::INTERNAL, e))?;
        let folder = folder_name(&req.id);
        let guest_root = format!("/sessions/{POD}/mnt/{folder}");
        let request = crate::spec::init(&spec, &guest_root)
            .map(|r| ContainerExec { cgroup: Some(folder.clone()), ..r })
            .map_err(|e| status(ttrpc::Code::INVALID_ARGUMENT, e));
        let request = match request {
            Ok(r) => r,
            Err(e) => {
                unmount(&rootfs);
                return Err(e);
            }
        };
        let share = FolderSpec { path: rootfs.clone(), name: Some(folder.clone()), mode: ShareMode::Rwd };
        if let Err(e) = self.pod_with(&spec, share).await {
            unmount(&rootfs);
            return Err(status(ttrpc::Code::UNKNOWN, e));
        }
        let stdio = io::Stdio {
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            terminal: req.terminal,
        };
        let init = Proc::new(&req.id, "", stdio, request);
        let container = Container {
            bundle: req.bundle.clone(),
            cgroup: folder.clone(),
            rootfs,
            folder,
            init,
            execs: HashMap::new(),
        };
        self.0.containers.lock().unwrap().insert(req.id.clone(), container);
        let pid = host_pid();
        let event = TaskCreate {
            container_id: req.id.clone(),
            bundle: req.bundle.clone(),
            rootfs: req.rootfs.clone(),
            io: Some(TaskIO {
                stdin: req.stdin,
                stdout: req.stdout,
                stderr: req.stderr,
                terminal: req.terminal,
                ..Default::default()
            })
            .into(),
            pid,
            ..Default::default()
        };
        self.publish(topics::TASK_CREATE_EVENT_TOPIC, Box::new(event)).await;
        Ok(api::CreateTaskResponse { pid, ..Default::default() })
    }

    async fn start(&self, _ctx: &TtrpcContext, req: api::StartRequest) -> TtrpcResult<api::StartResponse> {
        let proc = self.process(&req.id, &req.exec_id)?;
        let join = if req.exec_id.is_empty() {
            None
        } else {
            let init = self.process(&req.id, "")?;
            if init.state.lock().unwrap().status != Status::Running {
                return Err(status(ttrpc::Code::FAILED_PRECONDITION, format!("container {} is not running", req.id)));
            }
            Some(init.guest_pid())
        };
        self.launch(&proc, join).await?;
        let pid = host_pid();
        if req.exec_id.is_empty() {
            self.publish(
                topics::TASK_START_EVENT_TOPIC,
                Box::new(TaskStart { container_id: req.id, pid, ..Default::default() }),
            )
            .await;
        } else {
            let event = TaskExecStarted { container_id: req.id, exec_id: req.exec_id, pid, ..Default::default() };
            self.publish(topics::TASK_EXEC_STARTED_EVENT_TOPIC, Box::new(event)).await;
        }
        Ok(api::StartResponse { pid, ..Default::default() })
    }

    async fn exec(&self, _ctx: &TtrpcContext, req: api::ExecProcessRequest) -> TtrpcResult<api::Empty> {
        let process: oci_spec::runtime::Process = serde_json::from_slice(&req.spec.value)
            .map_err(|e| status(ttrpc::Code::INVALID_ARGUMENT, format!("the exec's process spec: {e}")))?;
        let request = {
            let containers = self.0.containers.lock().unwrap();
            let c = containers.get(&req.id).ok_or_else(|| not_found(&format!("container {}", req.id)))?;
            if c.execs.contains_key(&req.exec_id) {
                return Err(status(ttrpc::Code::ALREADY_EXISTS, format!("process {} of {}", req.exec_id, req.id)));
            }
            crate::spec::process_exec(&process, &format!("/sessions/{POD}/mnt/{}", c.folder))
                .map(|r| ContainerExec { cgroup: Some(c.cgroup.clone()), ..r })
                .map_err(|e| status(ttrpc::Code::INVALID_ARGUMENT, e))?
        };
        let stdio = io::Stdio { stdin: req.stdin, stdout: req.stdout, stderr: req.stderr, terminal: req.terminal };
        let proc = Proc::new(&req.id, &req.exec_id, stdio, request);
        if let Some(c) = self.0.containers.lock().unwrap().get_mut(&req.id) {
            c.execs.insert(req.exec_id.clone(), proc);
        }
        let event = TaskExecAdded { container_id: req.id, exec_id: req.exec_id, ..Default::default() };
        self.publish(topics::TASK_EXEC_ADDED_EVENT_TOPIC, Box::new(event)).await;
        Ok(api::Empty::new())
    }

    async fn kill(&self, _ctx: &TtrpcContext, req: api::KillRequest) -> TtrpcResult<api::Empty> {
        let proc = self.process(&req.id, &req.exec_id)?;
        let control = {
            let state = proc.state.lock().unwrap();
            match state.status {
                Status::Stopped => return Err(not_found(&format!("process {} (it has exited)", req.id))),
                Status::Starting => {
                    return Err(status(ttrpc::Code::FAILED_PRECONDITION, format!("{} is starting", req.id)))
                }
                Status::Created => None,
                Status::Running => state.control.clone(),
            }
        };
        let signal = req.signal as i32;
        match control {
            Some(control) => {
                control.signal(signal).await.map_err(|e| status(ttrpc::Code::UNKNOWN, e.to_string()))?;
                if req.all && req.exec_id.is_empty() {
                    // Every process of the container: its execs too.
                    let execs: Vec<Arc<Proc>> = self
                        .0
                        .containers
                        .lock()
                        .unwrap()
                        .get(&req.id)
                        .map(|c| c.execs.values().cloned().collect())
                        .unwrap_or_default();
                    for e in execs {
                        let control = e.state.lock().unwrap().control.clone();
                        if let Some(control) = control {
                            let _ = control.signal(signal).await;
                        }
                    }
                }
            }
            None => {
                // Never started: it ends here, killed.
                let exited = proc.end_unstarted(128u32.saturating_add(req.signal.min(127)));
                self.publish_exit(&proc, exited).await;
            }
        }
        Ok(api::Empty::new())
    }

    async fn wait(&self, _ctx: &TtrpcContext, req: api::WaitRequest) -> TtrpcResult<api::WaitResponse> {
        let proc = self.process(&req.id, &req.exec_id)?;
        let mut done = proc.done.subscribe();
        let exited = loop {
            if let Some(e) = *done.borrow_and_update() {
                break e;
            }
            if done.changed().await.is_err() {
                return Err(status(ttrpc::Code::UNKNOWN, "the process was forgotten"));
            }
        };
        Ok(api::WaitResponse {
            exit_status: exited.status,
            exited_at: Some(timestamp(exited.at)).into(),
            ..Default::default()
        })
    }

    async fn state(&self, _ctx: &TtrpcContext, req: api::StateRequest) -> TtrpcResult<api::StateResponse> {
        let proc = self.process(&req.id, &req.exec_id)?;
        let bundle = self.0.containers.lock().unwrap().get(&req.id).map(|c| c.bundle.clone()).unwrap_or_default();
        let status = match proc.status() {
            Status::Created | Status::Starting => api::Status::CREATED,
            Status::Running => api::Status::RUNNING,
            Status::Stopped => api::Status::STOPPED,
        };
        let pid = if proc.status() == Status::Created { 0 } else { host_pid() };
        let exited = proc.exited();
        Ok(api::StateResponse {
            id: if req.exec_id.is_empty() { req.id } else { req.exec_id },
            bundle,
            pid,
            status: status.into(),
            stdin: proc.stdio.stdin.clone(),
            stdout: proc.stdio.stdout.clone(),
            stderr: proc.stdio.stderr.clone(),
            terminal: proc.stdio.terminal,
            exit_status: exited.map_or(0, |e| e.status),
            exited_at: exited.map(|e| timestamp(e.at)).into(),
            ..Default::default()
        })
    }

    async fn delete(&self, _ctx: &TtrpcContext, req: api::DeleteRequest) -> TtrpcResult<api::DeleteResponse> {
        let proc = self.process(&req.id, &req.exec_id)?;
        if matches!(proc.status(), Status::Running | Status::Starting) {
            return Err(status(
                ttrpc::Code::FAILED_PRECONDITION,
                format!("{} is still running: kill it first", req.id),
            ));
        }
        let exited = proc.exited().unwrap_or(Exited { status: 0, at: SystemTime::now() });
        let pid = host_pid();
        if !req.exec_id.is_empty() {
            if let Some(c) = self.0.containers.lock().unwrap().get_mut(&req.id) {
                c.execs.remove(&req.exec_id);
            }
        } else {
            let _lifecycle = self.0.lifecycle.lock().await;
            // What the container left running (its execs, what they started) goes with it.
            self.kill_container(&req.id).await;
            let container = self.0.containers.lock().unwrap().remove(&req.id);
            if let Some(c) = container {
                let last = self.0.containers.lock().unwrap().is_empty();
                if last {
                    // The pod's last container: its VM goes with it.
                    self.end_pod().await;
                } else if let Ok(session) = self.session().await {
                    if let Err(e) = session.unmount(&c.folder).await {
                        tracing::warn!("unsharing {}'s rootfs: {e}", req.id);
                    }
                }
                unmount(&c.rootfs);
                if last {
                    crate::pod_dir::remove(&self.0.pod_dir);
                }
            }
            let event = TaskDelete {
                container_id: req.id.clone(),
                pid,
                exit_status: exited.status,
                exited_at: Some(timestamp(exited.at)).into(),
                id: req.id.clone(),
                ..Default::default()
            };
            self.publish(topics::TASK_DELETE_EVENT_TOPIC, Box::new(event)).await;
        }
        Ok(api::DeleteResponse {
            pid,
            exit_status: exited.status,
            exited_at: Some(timestamp(exited.at)).into(),
            ..Default::default()
        })
    }

    async fn pids(&self, _ctx: &TtrpcContext, req: api::PidsRequest) -> TtrpcResult<api::PidsResponse> {
        let containers = self.0.containers.lock().unwrap();
        let c = containers.get(&req.id).ok_or_else(|| not_found(&format!("container {}", req.id)))?;
        let processes = std::iter::once(&c.init)
            .chain(c.execs.values())
            .filter(|p| p.status() == Status::Running)
            .map(|p| containerd_shim::protos::api::ProcessInfo { pid: p.guest_pid(), ..Default::default() })
            .collect();
        Ok(api::PidsResponse { processes, ..Default::default() })
    }

    async fn close_io(&self, _ctx: &TtrpcContext, req: api::CloseIORequest) -> TtrpcResult<api::Empty> {
        let proc = self.process(&req.id, &req.exec_id)?;
        let control = proc.state.lock().unwrap().control.clone();
        if let (true, Some(control)) = (req.stdin, control) {
            let _ = control.close_stdin().await;
        }
        Ok(api::Empty::new())
    }

    async fn resize_pty(&self, _ctx: &TtrpcContext, req: api::ResizePtyRequest) -> TtrpcResult<api::Empty> {
        let proc = self.process(&req.id, &req.exec_id)?;
        let control = proc.state.lock().unwrap().control.clone();
        if let Some(control) = control {
            control
                .resize(req.height.min(u16::MAX as u32) as u16, req.width.min(u16::MAX as u32) as u16)
                .await
                .map_err(|e| status(ttrpc::Code::UNKNOWN, e.to_string()))?;
        }
        Ok(api::Empty::new())
    }

    async fn connect(&self, _ctx: &TtrpcContext, _req: api::ConnectRequest) -> TtrpcResult<api::ConnectResponse> {
        let task_pid = host_pid();
        Ok(api::ConnectResponse {
            shim_pid: std::process::id(),
            task_pid,
            version: "umbra".into(),
            ..Default::default()
        })
    }

    async fn shutdown(&self, _ctx: &TtrpcContext, _req: api::ShutdownRequest) -> TtrpcResult<api::Empty> {
        let _lifecycle = self.0.lifecycle.lock().await;
        if self.0.containers.lock().unwrap().is_empty() {
            self.end_pod().await;
            // Also after a first container whose VM never booted: its directory goes too.
            crate::pod_dir::remove(&self.0.pod_dir);
            self.0.exit.signal();
        }
        Ok(api::Empty::new())
    }

    async fn stats(&self, _ctx: &TtrpcContext, req: api::StatsRequest) -> TtrpcResult<api::StatsResponse> {
        self.process(&req.id, "")?;
        let session = self.session().await?;
        let metrics = crate::stats::of(&session).await.map_err(|e| status(ttrpc::Code::UNKNOWN, e))?;
        Ok(api::StatsResponse { stats: Some(metrics).into(), ..Default::default() })
    }
}
