//! `vmctl run`: one session, one command — a thin front end over the runtime's session layer.
//! It boots a session named `run`, streams the command's output, passes on the user's signals,
//! exits with the command's status, and tears the VM down — also on Ctrl-C, and on any error.
//! The exec lifecycle (timeout, SIGTERM→SIGKILL escalation, the exit status) and the events
//! are the runtime's; this file renders them.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use tokio::signal::unix::{signal, SignalKind};
use umbra_api::event::{spawn_failure_status, EXIT_UMBRA_ERROR};
use umbra_api::methods::StartParams;
use umbra_api::session::SettingsPatch;
use umbra_api::{ApiError, DaemonConfig, EventKind, FolderSpec, SessionEvent};
use umbra_proto::{ShareMode, TtySize};
use umbra_runtime::session::{Exec, ExecRequest, ManagerOptions, Session, SessionManager};

use crate::tty::RawTerminal;

/// The session name `vmctl run` uses: its folders appear at `/sessions/run/mnt/<name>`.
const SESSION: &str = "run";

#[derive(Args, Debug)]
pub struct RunArgs {
    #[arg(long, value_enum, default_value = "auto")]
    backend: umbra_api::BackendChoice,
    /// Bundle: a directory holding manifest.json, a flavor built by `vmctl bundle build`, or an
    /// installed version. The default, `current`, is the installed current bundle (a warm
    /// download promoted first), else the flavor this machine built (`minimal` first): the
    /// same default as sessions and the clients.
    #[arg(long, default_value = "current")]
    bundle: String,
    /// Boot an OCI image instead (`vmctl image pull` first when it was not converted before):
    /// the command runs after its `Entrypoint`, or its `Cmd` runs when none is given, with its
    /// `Env`, `WorkingDir` and `User`, as `docker run` does.
    #[arg(long, conflicts_with = "bundle")]
    image: Option<String>,
    #[command(flatten)]
    image_args: crate::image::ImageArgs,
    /// Reach a guest port from the host while the command runs: [[BIND:]HOST:]GUEST
    /// (repeatable; HOST omitted: a free port, printed on stderr).
    #[arg(long = "publish", short = 'p', value_name = "[[BIND:]HOST:]GUEST", value_parser = crate::network::parse_publish)]
    publish: Vec<umbra_api::ports::PortSpec>,
    #[arg(long, default_value_t = 1)]
    cpus: u32,
    #[arg(long, default_value_t = 512)]
    memory: u32,
    /// Environment for the command (repeatable).
    #[arg(long = "env", value_name = "K=V", value_parser = parse_env)]
    env: Vec<(String, String)>,
    /// Working directory in the guest (default: the shared folder, when exactly one is mounted).
    #[arg(long)]
    workdir: Option<String>,
    /// Share a host folder: HOST_PATH[:NAME][:MODE], MODE = ro | rw | rwd | shadow (default rw).
    /// It appears at /sessions/run/mnt/NAME (NAME defaults to the folder's name). Repeatable.
    #[arg(long = "mount", value_name = "HOST_PATH[:NAME][:MODE]", value_parser = umbra_api::methods::parse_folder_spec)]
    mounts: Vec<FolderSpec>,
    /// For shadow mounts: print what the command changed (added, modified, deleted, with sizes,
    /// hashes and risks) when it ends.
    #[arg(long)]
    shadow_diff: bool,
    /// For shadow mounts: apply the changes to the host folder when the command ends. The diff
    /// is taken (and shown) first and exactly the bytes it captured are applied; `.git` and
    /// ignored paths, symlinks and special files are not; files changed on the host meanwhile
    /// are reported as conflicts and left alone.
    #[arg(long)]
    shadow_apply: bool,
    /// Kill the command after this many seconds (exit status 124).
    #[arg(long)]
    timeout: Option<u64>,
    /// Seconds to wait for the guest agent.
    #[arg(long, default_value_t = 30, env = "UMBRA_BOOT_TIMEOUT_SECS")]
    boot_timeout: u64,
    /// Run on a pseudo-terminal (raw host terminal, window size forwarded).
    #[arg(long)]
    tty: bool,
    #[command(flatten)]
    network: crate::network::NetworkArgs,
    /// A CA certificate (PEM file) the egress proxy trusts, besides the host's store, when it
    /// connects to a host a --secret is bound to (repeatable): a company's TLS proxy.
    #[arg(long = "trust-ca", value_name = "FILE")]
    trust_ca: Vec<std::path::PathBuf>,
    #[command(flatten)]
    policy: crate::policy::PolicyArgs,
    /// Print the session's events, one JSON object per line, instead of the command's output.
    #[arg(long)]
    json: bool,
    /// The command and its arguments.
    #[arg(required_unless_present = "image", last = true)]
    command: Vec<String>,
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    let (k, v) = s.split_once('=').ok_or_else(|| format!("{s:?} is not K=V"))?;
    if k.is_empty() {
        return Err(format!("{s:?} has an empty name"));
    }
    Ok((k.to_string(), v.to_string()))
}

/// Prints events (`--json`) or the command's output.
pub struct Output {
    pub json: bool,
}

impl Output {
    pub fn event(&self, event: &SessionEvent) {
        if self.json {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{}", serde_json::to_string(event).expect("events serialize"));
            let _ = out.flush();
        }
    }

    fn bytes(&self, event: &SessionEvent, data: &umbra_api::Data, sink: &mut dyn Write) {
        if self.json {
            self.event(event);
        } else {
            let _ = sink.write_all(&data.to_bytes().unwrap_or_default());
            let _ = sink.flush();
        }
    }

    /// Prints a bus event that `--json` shows: not status changes (the `ready` event says
    /// more), not process events (the command's own stream has them).
    fn lifecycle(&self, event: &SessionEvent) {
        match event.kind {
            EventKind::Status { .. }
            | EventKind::Spawned { .. }
            | EventKind::SpawnFailed { .. }
            | EventKind::Exit(_)
            | EventKind::Stdout { .. }
            | EventKind::Stderr { .. } => {}
            _ => self.event(event),
        }
    }

    fn error(&self, e: &anyhow::Error) {
        let error = ApiError::new(umbra_api::ErrorCode::Internal, format!("{e:#}"));
        self.event(&SessionEvent::new(Some(SESSION), EventKind::Error { error }));
        eprintln!("vmctl: error: {e:#}");
    }
}

pub async fn run(args: RunArgs) -> i32 {
    let out = Output { json: args.json };
    let config = DaemonConfig {
        boot_timeout_secs: args.boot_timeout.max(1),
        trust_ca: args.trust_ca.clone(),
        ..DaemonConfig::default()
    };
    let manager = SessionManager::new(ManagerOptions::ephemeral(config));
    let result = run_in(&manager, &args, &out).await;
    manager.shutdown().await;
    match result {
        Ok(code) => code,
        Err(e) => {
            out.error(&e);
            EXIT_UMBRA_ERROR
        }
    }
}

async fn run_in(manager: &SessionManager, args: &RunArgs, out: &Output) -> anyhow::Result<i32> {
    if (args.shadow_diff || args.shadow_apply) && !args.mounts.iter().any(|m| m.mode == ShareMode::Shadow) {
        bail!("--shadow-diff and --shadow-apply need a --mount with mode shadow");
    }
    let mut bus = manager.subscribe();
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let (bundle, argv) = match &args.image {
        None => (args.bundle.clone(), args.command.clone()),
        Some(reference) => {
            let (bundle, info) = crate::image::for_run(reference, &args.image_args).await?;
            let rest = if args.command.is_empty() { info.cmd.clone() } else { args.command.clone() };
            let argv: Vec<String> = info.entrypoint.iter().cloned().chain(rest).collect();
            if argv.is_empty() {
                bail!("the image {reference} has no Entrypoint or Cmd: give a command after --");
            }
            (bundle, argv)
        }
    };
    let settings = SettingsPatch {
        memory_mib: Some(args.memory),
        cpus: Some(args.cpus),
        bundle: Some(bundle),
        backend: Some(args.backend),
        // The daemon's defaults keep a session alive and watched; one command needs neither.
        disk_size_mib: Some(0),
        idle_timeout_secs: Some(0),
        // Interactive and often on slow hosts (emulation, nested KVM): only a guest silent
        // this long counts as hung. A VMM that dies is noticed within half a second anyway.
        heartbeat_timeout_secs: Some(30),
        // No network unless asked for: a one-off command gets none by default.
        network: Some(args.network.policy().unwrap_or_default()),
        policy: args.policy.load(args.network.given()).map_err(anyhow::Error::msg)?,
        ..Default::default()
    };
    let secrets = args.network.secrets().map_err(anyhow::Error::msg)?;
    let start = manager.start(StartParams {
        name: SESSION.into(),
        folders: args.mounts.clone(),
        settings,
        secrets,
        ssh_keys: args.network.ssh_keys(),
        ports: args.publish.clone(),
        image: None,
    });
    let session = tokio::select! {
        s = start => s.context("the sandbox did not start")?,
        _ = sigint.recv() => bail!("interrupted during boot"),
        _ = sigterm.recv() => bail!("terminated during boot"),
    };
    while let Ok(ev) = bus.try_recv() {
        out.lifecycle(&ev);
    }
    let info = session.info();
    for p in &info.ports {
        eprintln!("vmctl: guest port {} on {}", p.guest_port, std::net::SocketAddr::new(p.bind, p.host_port));
    }
    let folders = info.folders;
    let cwd = match (&args.workdir, folders.as_slice()) {
        (Some(w), _) => Some(w.clone()),
        (None, [only]) => Some(only.guest_path.clone()),
        _ => None,
    };

    let raw = if args.tty { RawTerminal::enable().ok() } else { None };
    let request = ExecRequest {
        argv: argv.clone(),
        cwd,
        env: args.env.iter().cloned().collect::<BTreeMap<_, _>>(),
        tty: args.tty.then(|| crate::tty::size().unwrap_or(TtySize { rows: 24, cols: 80 })),
        timeout: args.timeout.map(Duration::from_secs),
    };
    let exec = match session.spawn(request).await {
        Ok(exec) => exec,
        Err(e) => {
            let error = ApiError::from(e);
            let failed = SessionEvent::new(Some(SESSION), EventKind::SpawnFailed { process: 0, error: error.clone() });
            out.event(&failed);
            eprintln!("vmctl: cannot run {:?}: {}", argv[0], error.message);
            return Ok(spawn_failure_status(&error));
        }
    };
    let result = drive(&session, exec, args, out, &mut bus, &mut sigint, &mut sigterm).await;
    drop(raw);
    if result.is_ok() {
        shadow_report(&session, args, out).await?;
    }
    result
}

/// After the command: the diff of each shadow mount and, if asked, its application. An apply
/// writes exactly what the diff captured (one capture, shown first): a process the command
/// left running cannot slip in a change after it. `.git` and ignored paths, symlinks and
/// special files are listed but not applied (`vmctl` names no path explicitly).
async fn shadow_report(session: &Arc<Session>, args: &RunArgs, out: &Output) -> anyhow::Result<()> {
    let shadows = session.info().folders.into_iter().filter(|f| f.mode == ShareMode::Shadow);
    for folder in shadows {
        let name = folder.name.clone();
        let diff = session.shadow_diff(&name).await?;
        if !out.json {
            eprintln!("shadow {name}: {} change(s) (changeset {})", diff.changes.len(), diff.changeset);
            for c in &diff.changes {
                eprintln!("  {}", describe_entry(c));
            }
        }
        let event =
            EventKind::ShadowDiff { folder: name.clone(), changeset: diff.changeset.clone(), changes: diff.changes };
        out.event(&SessionEvent::new(Some(SESSION), event));
        if args.shadow_apply {
            let report = session.shadow_apply(&name, Some(&diff.changeset), None).await?;
            if !out.json {
                eprintln!(
                    "shadow {name}: applied {} change(s) to {}; {} conflict(s), {} error(s), {} skipped",
                    report.applied.len(),
                    folder.host_path.display(),
                    report.conflicts.len(),
                    report.errors.len(),
                    report.skipped.len()
                );
                for c in &report.conflicts {
                    eprintln!("  not applied: {} ({})", c.path, c.reason);
                }
                for e in &report.errors {
                    eprintln!("  not applied: {} ({})", e.path, e.message);
                }
                for s in &report.skipped {
                    eprintln!("  skipped: {} ({})", s.path, s.reason);
                }
            }
            out.event(&SessionEvent::new(Some(SESSION), EventKind::ShadowApplied { folder: name, report }));
        }
    }
    Ok(())
}

/// One diff line: kind, path, size and hash, and what makes it risky.
fn describe_entry(c: &umbra_api::event::ShadowEntry) -> String {
    use umbra_api::event::ShadowApplies;
    let kind = match c.kind {
        umbra_proto::ChangeKind::Added => "added",
        umbra_proto::ChangeKind::Modified => "modified",
        umbra_proto::ChangeKind::Deleted => "deleted",
    };
    let mut line = format!("{kind:<8} {}{}", c.path, if c.is_dir { "/" } else { "" });
    if let (Some(size), Some(sha)) = (c.size, &c.sha256) {
        line.push_str(&format!(" ({size} bytes, sha256 {})", &sha[..sha.len().min(12)]));
    }
    if !c.risks.is_empty() {
        let risks: Vec<String> = c
            .risks
            .iter()
            .map(|r| serde_json::to_value(r).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default())
            .collect();
        line.push_str(&format!(" [risk: {}]", risks.join(", ")));
    }
    match c.applies {
        ShadowApplies::ByDefault => {}
        ShadowApplies::WhenNamed => line.push_str(" [applied only when named]"),
        ShadowApplies::Never => line.push_str(" [never applied]"),
    }
    line
}

/// Streams one process until it exits; returns vmctl's exit status.
async fn drive(
    session: &Arc<Session>,
    mut exec: Exec,
    args: &RunArgs,
    out: &Output,
    bus: &mut tokio::sync::broadcast::Receiver<SessionEvent>,
    sigint: &mut tokio::signal::unix::Signal,
    sigterm: &mut tokio::signal::unix::Signal,
) -> anyhow::Result<i32> {
    let control = exec.control();
    let stdin_control = control.clone();
    let mut host_stdin = host_stdin_reader();
    let stdin_task = tokio::spawn(async move {
        while let Some(chunk) = host_stdin.recv().await {
            let sent = match chunk {
                Some(bytes) => stdin_control.write_stdin(bytes).await,
                None => {
                    let _ = stdin_control.close_stdin().await;
                    return;
                }
            };
            if sent.is_err() {
                return;
            }
        }
    });
    let mut winch = signal(SignalKind::window_change())?;
    let mut sighup = signal(SignalKind::hangup())?;
    let mut bus_open = true;
    let code = loop {
        let event = tokio::select! {
            ev = exec.next_event() => ev,
            sig = forwarded_signal(sigint, sigterm, &mut sighup) => {
                control.interrupt(sig);
                continue
            }
            _ = winch.recv(), if args.tty => {
                if let Some(sz) = crate::tty::size() {
                    let _ = control.resize(sz.rows, sz.cols).await;
                }
                continue
            }
            ev = bus.recv(), if bus_open => {
                match ev {
                    Ok(ev) => out.lifecycle(&ev),
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => bus_open = false,
                }
                continue
            }
        };
        let Some(event) = event else { bail!("the process's event stream ended without an exit") };
        match &event.kind {
            EventKind::Spawned { .. } => out.event(&event),
            EventKind::Stdout { data, .. } => out.bytes(&event, data, &mut std::io::stdout()),
            EventKind::Stderr { data, .. } => out.bytes(&event, data, &mut std::io::stderr()),
            EventKind::Exit(exit) => {
                out.event(&event);
                if exit.lost {
                    stdin_task.abort();
                    let reason = exit.reason.clone().unwrap_or_else(|| "the VM went away".into());
                    let console = session.console_tail(Session::CONSOLE_LINES).await;
                    bail!("{reason}; last console lines:\n{console}");
                }
                break exit.shell_status();
            }
            _ => {}
        }
    };
    stdin_task.abort();
    Ok(code)
}

/// The next of SIGINT, SIGTERM or SIGHUP delivered to vmctl: each is passed on to the command.
async fn forwarded_signal(
    sigint: &mut tokio::signal::unix::Signal,
    sigterm: &mut tokio::signal::unix::Signal,
    sighup: &mut tokio::signal::unix::Signal,
) -> i32 {
    tokio::select! {
        _ = sigint.recv() => libc::SIGINT,
        _ = sigterm.recv() => libc::SIGTERM,
        _ = sighup.recv() => libc::SIGHUP,
    }
}

/// Host stdin as chunks (`None` = end of input), read on a plain thread: a blocking read of a
/// terminal cannot be cancelled, and on tokio's blocking pool it would keep the runtime — and
/// so vmctl — alive after the command ended until the user pressed Enter.
pub fn host_stdin_reader() -> tokio::sync::mpsc::Receiver<Option<bytes::Bytes>> {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match std::io::Read::read(&mut stdin, &mut buf) {
                Ok(0) | Err(_) => {
                    let _ = tx.blocking_send(None);
                    return;
                }
                Ok(n) => {
                    if tx.blocking_send(Some(bytes::Bytes::copy_from_slice(&buf[..n]))).is_err() {
                        return;
                    }
                }
            }
        }
    });
    rx
}
