//! umbrad: Umbra's sessions, served to desktop apps (and `vmctl session`) over JSON-RPC 2.0 on a
//! Unix socket. A foreground process with tracing logs on stderr; run it under a supervisor
//! (`host/daemon/umbrad.service` is a systemd user unit). Protocol: `docs/ipc.md`.
//!
//! - [`server`]: the socket, its lock, who may connect and how many;
//! - [`connection`]: one client, with bounded queues everywhere;
//! - [`dispatch`]: routes a method, by its namespace, to its module in [`handlers`]: thin
//!   handlers over the runtime's session layer;
//! - [`processes`]: a client's processes, their output credit and ordered stdin;
//! - [`bundles`]: downloads with progress; [`settings`]: the configuration file.

mod bundles;
mod client;
mod connection;
mod dispatch;
mod handlers;
mod images;
mod owned;
mod processes;
mod server;
mod settings;
mod state;
mod watch;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use tokio::signal::unix::{signal, SignalKind};
use umbra_runtime::session::{ManagerOptions, SessionManager};

use crate::state::{Daemon, ServerOptions};

/// How long a shutdown may spend stopping sessions before it lets their VMs be killed.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(20);

#[derive(Parser, Debug)]
#[command(version, about = "Umbra's daemon: microVM sessions over JSON-RPC 2.0 on a Unix socket (docs/ipc.md)")]
struct Args {
    /// The socket [default: $UMBRA_SOCKET, else $XDG_RUNTIME_DIR/umbra/umbrad.sock]
    #[arg(long)]
    socket: Option<PathBuf>,
    /// The configuration file [default: $XDG_CONFIG_HOME/umbra/umbrad.json]
    #[arg(long)]
    config: Option<PathBuf>,
    /// Also serve root (uid 0), not only this daemon's own uid.
    #[arg(long)]
    allow_root: bool,
    /// Clients connected at once; more are refused with `busy`.
    #[arg(long, default_value_t = 64)]
    max_clients: usize,
    /// Longest request line in bytes (a 1 MiB file write is about 1.4 MiB of base64).
    #[arg(long, default_value_t = 4 << 20)]
    max_request_bytes: usize,
    /// The machine's system policy: ceilings no client can loosen (docs/policy.md). Refused,
    /// and umbrad does not start, unless root alone can write it.
    #[arg(long, default_value = umbra_api::system::SYSTEM_POLICY_PATH)]
    system_policy: PathBuf,
    /// Also serve MCP on streamable HTTP at this loopback address (`127.0.0.1:PORT`; port 0: a
    /// free one), for agents (docs/mcp.md). Every request needs `Authorization: Bearer` the
    /// token in `$UMBRA_MCP_TOKEN`, else one umbrad makes; the URL and token are written to
    /// `mcp.json` (0600) beside the socket.
    #[arg(long, value_name = "ADDR")]
    mcp_listen: Option<std::net::SocketAddr>,
    /// A host folder MCP sessions may share, `HOST_PATH[:NAME][:MODE]` (default mode shadow).
    /// Repeatable; no other folder is offered to MCP clients.
    #[arg(long = "mcp-folder", value_name = "SPEC")]
    mcp_folders: Vec<String>,
    /// Also serve the E2B API (sandboxes, and envd's process and filesystem services) at this
    /// loopback address, for the unmodified `e2b` SDKs (docs/e2b.md). Requests need the key in
    /// `$UMBRA_E2B_API_KEY`, else one umbrad makes and keeps (`e2b/api-key` in the state
    /// directory, 0600); the URL and key are written to `e2b.json` (0600) beside the socket.
    /// Sandboxes are kept there too: after a restart they are paused, and connecting resumes them.
    #[arg(long, value_name = "ADDR")]
    e2b_listen: Option<std::net::SocketAddr>,
    /// An E2B template and the bundle it boots, `NAME=BUNDLE` (a version, directory or URL as
    /// `bundle` takes); `base` boots the configured bundle unless given. Repeatable.
    #[arg(long = "e2b-template", value_name = "NAME=BUNDLE")]
    e2b_templates: Vec<String>,
    /// Let `bundle.download` fetch over plain `http://` from a loopback address (127.0.0.1,
    /// [::1]): for tests against a local server. Every other `http://` is refused regardless.
    #[arg(long)]
    allow_http_loopback: bool,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    umbra_sys::raise_nofile_limit();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("umbrad").build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("umbrad: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    };
    let code = match runtime.block_on(run(args)) {
        Ok(()) => 0,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("umbrad: error: {e:#}");
            1
        }
    };
    runtime.shutdown_timeout(Duration::from_secs(2));
    std::process::exit(code);
}

async fn run(args: Args) -> anyhow::Result<()> {
    let options = ServerOptions {
        socket: args.socket.unwrap_or_else(umbra_api::paths::default_socket),
        allow_root: args.allow_root,
        max_clients: args.max_clients.max(1),
        max_request_bytes: args.max_request_bytes.max(1024),
        config_path: args.config.unwrap_or_else(settings::default_path),
        allow_http_loopback: args.allow_http_loopback,
    };
    let config = settings::load(&options.config_path)?;
    // Before anything listens: a policy that cannot be trusted stops the daemon here.
    let system = umbra_runtime::system_policy::load(&args.system_policy)?;
    let listening = server::bind(&options.socket)?;
    let manager = SessionManager::new(ManagerOptions::persistent(config));
    if let Some(policy) = system {
        tracing::info!(path = %args.system_policy.display(), "system policy in force");
        manager
            .set_system_policy(Some(umbra_api::system::SystemPolicyInfo { path: args.system_policy.clone(), policy }));
    }
    let known = manager.list().len();
    tracing::info!(
        socket = %options.socket.display(),
        config = %options.config_path.display(),
        sessions = known,
        "umbrad {} listening",
        env!("CARGO_PKG_VERSION")
    );
    let socket = options.socket.clone();
    // Removed on every way out of here (and by the next umbrad if this one is killed).
    let _mcp_info = match args.mcp_listen {
        Some(addr) => Some(serve_mcp(addr, &args.mcp_folders, &socket).await?),
        None => None,
    };
    let _e2b_info = match args.e2b_listen {
        Some(addr) => Some(serve_e2b(addr, &args.e2b_templates, &socket).await?),
        None => None,
    };
    let daemon = Arc::new(Daemon::new(manager, options));
    bundles::warm_in_background(daemon.clone());
    watch::start(daemon.clone(), args.system_policy.clone());

    let mut sigterm = signal(SignalKind::terminate()).context("cannot watch SIGTERM")?;
    let mut sigint = signal(SignalKind::interrupt()).context("cannot watch SIGINT")?;
    let stop = async move {
        tokio::select! {
            _ = sigterm.recv() => tracing::info!("SIGTERM: stopping"),
            _ = sigint.recv() => tracing::info!("SIGINT: stopping"),
        }
    };
    server::serve(daemon.clone(), listening, stop).await;
    let _ = std::fs::remove_file(&socket);
    // Sessions are stopped, not deleted: their records say stopped, and a new umbrad can
    // resume them.
    if tokio::time::timeout(SHUTDOWN_GRACE, daemon.manager.shutdown()).await.is_err() {
        tracing::warn!("sessions did not stop within {SHUTDOWN_GRACE:?}; their VMs are killed");
    }
    Ok(())
}

/// Starts the MCP endpoint (`--mcp-listen`): umbra-mcp's server on streamable HTTP, a client of
/// this daemon's own socket like any other, and `mcp.json` beside the socket saying where it is
/// and its token.
async fn serve_mcp(
    addr: std::net::SocketAddr,
    folders: &[String],
    socket: &std::path::Path,
) -> anyhow::Result<InfoFile> {
    umbra_mcp::http::check_address(&addr).map_err(anyhow::Error::msg)?;
    let folders = umbra_mcp::server::offered_folders(folders).map_err(|e| anyhow::anyhow!("--mcp-folder {e}"))?;
    let token = endpoint_secret("UMBRA_MCP_TOKEN", None)?;
    let listener =
        tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot listen for MCP on {addr}"))?;
    let bound = listener.local_addr()?;
    let url = format!("http://{bound}/mcp");
    let info =
        write_private_json(socket.with_file_name("mcp.json"), serde_json::json!({ "url": url, "token": token }))?;
    tracing::info!(%url, info = %info.0.display(), folders = folders.len(), "serving MCP");
    let socket = socket.to_path_buf();
    // One agent behind the token: every MCP session of the endpoint reaches the sessions any of
    // them started, and no others.
    let (folders, owned) = (Arc::new(folders), umbra_mcp::server::Owned::default());
    tokio::spawn(async move {
        let make = move || umbra_mcp::server::UmbraMcp::sharing(Some(socket.clone()), folders.clone(), owned.clone());
        if let Err(e) = umbra_mcp::http::serve(listener, token, make).await {
            tracing::error!("the MCP endpoint stopped: {e}");
        }
    });
    Ok(info)
}

/// Starts the E2B endpoint (`--e2b-listen`): umbra-e2b's server, a client of this daemon's own
/// socket like any other, and `e2b.json` beside the socket saying where it is and its key.
async fn serve_e2b(
    addr: std::net::SocketAddr,
    templates: &[String],
    socket: &std::path::Path,
) -> anyhow::Result<InfoFile> {
    umbra_e2b::http::check_address(&addr).map_err(anyhow::Error::msg)?;
    let mut mapped = std::collections::BTreeMap::new();
    for t in templates {
        match t.split_once('=') {
            Some((name, bundle)) if !name.is_empty() && !bundle.is_empty() => {
                mapped.insert(name.to_string(), bundle.to_string());
            }
            _ => anyhow::bail!("--e2b-template {t:?}: NAME=BUNDLE"),
        }
    }
    // The key and the sandboxes are kept in the state directory: an E2B client's sandboxes,
    // ids and tokens survive an umbrad restart (docs/e2b.md).
    let kept = umbra_api::paths::state_dir().join("e2b");
    let key = endpoint_secret("UMBRA_E2B_API_KEY", Some(&kept.join("api-key")))?;
    let listener =
        tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot listen for E2B on {addr}"))?;
    let url = format!("http://{}", listener.local_addr()?);
    let info =
        write_private_json(socket.with_file_name("e2b.json"), serde_json::json!({ "url": url, "api_key": key }))?;
    tracing::info!(%url, info = %info.0.display(), templates = mapped.len(), "serving the E2B API");
    let options = umbra_e2b::sandboxes::Options {
        socket: Some(socket.to_path_buf()),
        templates: mapped,
        records: Some(kept.join("sandboxes.json")),
    };
    tokio::spawn(async move {
        let e2b = umbra_e2b::sandboxes::E2b::new(options);
        if let Err(e) = umbra_e2b::http::serve(listener, e2b, key).await {
            tracing::error!("the E2B endpoint stopped: {e}");
        }
    });
    Ok(info)
}

/// An endpoint's secret: `$VAR` (at least 16 characters), else 32 random bytes in hex.
/// With `kept`, the one made is kept there (mode 0600) and used again by the next umbrad, so
/// clients holding it go on working across a restart.
fn endpoint_secret(var: &str, kept: Option<&std::path::Path>) -> anyhow::Result<String> {
    match std::env::var(var) {
        Ok(t) if t.len() >= 16 => return Ok(t),
        Ok(_) => anyhow::bail!("{var} must have at least 16 characters"),
        Err(_) => {}
    }
    if let Some(path) = kept {
        match std::fs::read_to_string(path) {
            Ok(t) if t.trim().len() >= 16 => return Ok(t.trim().to_string()),
            Ok(_) => tracing::warn!(path = %path.display(), "a kept endpoint key too short to use: making another"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => anyhow::bail!("cannot read {}: {e}", path.display()),
        }
    }
    let mut bytes = [0u8; 32];
    std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom")?, &mut bytes)
        .with_context(|| format!("cannot read /dev/urandom for {var}"))?;
    let secret: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    if let Some(path) = kept {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        }
        write_private(path, secret.as_bytes())?;
    }
    Ok(secret)
}

/// Writes `value` to `path`, readable by this user only (it holds a secret).
fn write_private_json(path: PathBuf, value: serde_json::Value) -> anyhow::Result<InfoFile> {
    write_private(&path, &serde_json::to_vec_pretty(&value)?)?;
    Ok(InfoFile(path))
}

/// Replaces `path` with `bytes`, mode 0600 from its creation.
fn write_private(path: &std::path::Path, bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    f.write_all(bytes)?;
    Ok(())
}

/// An endpoint's `*.json` beside the socket, removed when dropped.
struct InfoFile(PathBuf);

impl Drop for InfoFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
