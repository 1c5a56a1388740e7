//! `containerd-shim-umbra-v2`: containerd's runtime `io.containerd.umbra.v2`. containerd runs it
//! with `start` (it starts the shim server and prints its address), then speaks the task
//! service to the server; `delete` cleans up after a server that died. See
//! `docs/kubernetes.md`.

mod config;
mod io;
mod pod_dir;
mod service;
mod spec;
mod stats;

use std::sync::Arc;

use async_trait::async_trait;
use containerd_shim::asynchronous::{run, ExitSignal, Shim};
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::{api, Config, Error, Flags, StartOpts};

const RUNTIME_ID: &str = "io.containerd.umbra.v2";

struct UmbraShim {
    id: String,
    namespace: String,
    containerd: String,
    pod_dir: std::path::PathBuf,
    exit: Arc<ExitSignal>,
    pod_netns: bool,
}

#[async_trait]
impl Shim for UmbraShim {
    type T = service::Service;

    async fn new(_runtime_id: &str, args: &Flags, _config: &mut Config) -> Self {
        UmbraShim {
            id: args.id.clone(),
            namespace: args.namespace.clone(),
            containerd: args.address.clone(),
            pod_dir: pod_dir::path(&args.address, &args.namespace, &grouping(&args.id)),
            exit: Arc::new(ExitSignal::default()),
            pod_netns: POD_NETNS.load(std::sync::atomic::Ordering::Relaxed),
        }
    }

    async fn start_shim(&mut self, opts: StartOpts) -> Result<String, Error> {
        spawn_server(&opts, &grouping(&opts.id)).await
    }

    async fn delete_shim(&mut self) -> Result<api::DeleteResponse, Error> {
        // After a server that died (its VM went with it: every runtime child has PDEATHSIG),
        // what may be left is the rootfs it mounted.
        // This container's alone: containerd also runs `delete` for a pod's container whose
        // connection closed while its pod's shim lives on.
        service::unmount(&self.pod_dir.join(service::folder_name(&self.id)));
        pod_dir::remove_if_empty(&self.pod_dir);
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let exited_at = containerd_shim::protos::protobuf::well_known_types::timestamp::Timestamp {
            seconds: now.as_secs() as i64,
            nanos: now.subsec_nanos() as i32,
            ..Default::default()
        };
        Ok(api::DeleteResponse { exit_status: 128 + 9, exited_at: Some(exited_at).into(), ..Default::default() })
    }

    async fn wait(&mut self) {
        self.exit.wait().await;
    }

    async fn create_task_service(&self, publisher: RemotePublisher) -> Self::T {
        init_logging();
        service::Service::new(
            &self.namespace,
            &self.containerd,
            self.exit.clone(),
            publisher,
            self.pod_netns,
            self.pod_dir.clone(),
        )
    }
}

/// Starts the shim's server for a pod (or finds it running: the server, on a socket in use,
/// checks it answers and exits) and returns its address once it serves (it closes its stdout
/// then). The crate's own `spawn` reads containerd's runtime options from stdin as runc's,
/// which ours (`runtimeoptions.v1.Options`, a config path or body) are not.
async fn spawn_server(opts: &StartOpts, grouping: &str) -> Result<String, Error> {
    let address = containerd_shim::socket_address(&opts.address, &opts.namespace, grouping);
    let failed = |what: &str, e: std::io::Error| Error::Other(format!("{what}: {e}"));
    let exe = std::env::current_exe().map_err(|e| failed("the shim's own path", e))?;
    let cwd = std::env::current_dir().map_err(|e| failed("the bundle directory", e))?;
    let mut command = tokio::process::Command::new(exe);
    command
        .current_dir(cwd)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .args(["-namespace", &opts.namespace, "-id", &opts.id, "-address", &opts.address, "-socket", &address]);
    if opts.debug {
        command.arg("-debug");
    }
    let mut child = command.spawn().map_err(|e| failed("starting the shim's server", e))?;
    if let Some(mut out) = child.stdout.take() {
        tokio::io::copy(&mut out, &mut tokio::io::stderr()).await.map_err(|e| failed("the server's output", e))?;
    }
    Ok(address)
}

/// The pod a container belongs to, from the spec in the working directory (its bundle): a CRI
/// pod's containers share one shim, so one VM, grouped by the pod's id; any other container is
/// a pod of its own.
fn grouping(id: &str) -> String {
    oci_spec::runtime::Spec::load("config.json")
        .ok()
        .and_then(|s| s.annotations().clone())
        .and_then(|a| a.get(config::SANDBOX_ID_ANNOTATION).cloned())
        .unwrap_or_else(|| id.to_string())
}

static POD_NETNS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The server's logs: `$UMBRA_SHIM_LOG_DIR/<pid>.log` when set (containerd gives a shim no
/// stderr); nothing otherwise.
fn init_logging() {
    let Some(dir) = std::env::var_os("UMBRA_SHIM_LOG_DIR") else { return };
    let path = std::path::Path::new(&dir).join(format!("{}.log", std::process::id()));
    if let Ok(file) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_new(
                    std::env::var("UMBRA_SHIM_LOG").unwrap_or_else(|_| "info".into()),
                )
                .unwrap_or_else(|_| "info".into()),
            )
            .with_writer(std::sync::Mutex::new(file))
            .with_ansi(false)
            .try_init();
    }
}

/// The shim server runs in the pod's network namespace when the spec names one (a CRI pod;
/// `ctr run --with-ns network:PATH`): the egress proxy's connections leave from it and the
/// pod's ports listen in it. Entered before any thread exists, so every thread is in it.
fn enter_pod_netns() -> Result<bool, String> {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let flags = containerd_shim::parse(&args[1..]).map_err(|e| e.to_string())?;
    if !flags.action.is_empty() || flags.info || flags.version || flags.socket.is_empty() {
        return Ok(false);
    }
    let Ok(spec) = oci_spec::runtime::Spec::load("config.json") else { return Ok(false) };
    let path = spec
        .linux()
        .as_ref()
        .and_then(|l| l.namespaces().clone())
        .unwrap_or_default()
        .into_iter()
        .find(|n| n.typ() == oci_spec::runtime::LinuxNamespaceType::Network)
        .and_then(|n| n.path().clone());
    let Some(path) = path else { return Ok(false) };
    let file =
        std::fs::File::open(&path).map_err(|e| format!("the pod's network namespace {}: {e}", path.display()))?;
    nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET)
        .map_err(|e| format!("entering the pod's network namespace {}: {e}", path.display()))?;
    Ok(true)
}

fn main() {
    match enter_pod_netns() {
        Ok(entered) => POD_NETNS.store(entered, std::sync::atomic::Ordering::Relaxed),
        Err(e) => {
            eprintln!("{RUNTIME_ID}: {e}");
            std::process::exit(1);
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("a tokio runtime");
    // The runtime's own children (QEMU, virtiofsd, vsock helpers) are waited for by it: a
    // shim-wide reaper would take their exits (and a VM would look alive until a timeout).
    let config = Config { no_reaper: true, no_sub_reaper: true, ..Default::default() };
    runtime.block_on(run::<UmbraShim>(RUNTIME_ID, Some(config)));
}
