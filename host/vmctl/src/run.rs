//! `vmctl run`: boot a sandbox, run one command in it, stream its output, exit with its status,
//! and tear the VM down — also on Ctrl-C, and on any error.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use tokio::signal::unix::{signal, SignalKind};
use umbra_proto::{ChangeKind, ShareMode, SpawnRequest, TtySize};
use umbra_runtime::agent::{Process, ProcessEvent};
use umbra_runtime::backend::{kvm, BackendKind, KvmKind, Vm, VmSpec};

use crate::paths;
use crate::tty::RawTerminal;

/// vmctl's own failures (boot, connection) exit with this, as `docker run` does.
pub const EXIT_UMBRA_ERROR: i32 = 125;
const EXIT_CANNOT_RUN: i32 = 126;
const EXIT_NOT_FOUND: i32 = 127;
/// How long a command may take to stop after SIGINT/SIGTERM before it is SIGKILLed.
const KILL_GRACE: Duration = Duration::from_secs(3);

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendChoice {
    Auto,
    Qemu,
    Kvm,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendChoice,
    /// Bundle: a directory holding manifest.json, a flavor built by `vmctl bundle build`, or an
    /// installed version (`current` promotes a warm download first).
    #[arg(long, default_value = "minimal")]
    bundle: String,
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
    #[arg(long = "mount", value_name = "HOST_PATH[:NAME][:MODE]", value_parser = parse_mount)]
    mounts: Vec<MountArg>,
    /// For shadow mounts: print what the command changed (added, modified, deleted) when it ends.
    #[arg(long)]
    shadow_diff: bool,
    /// For shadow mounts: apply the changes to the host folder when the command ends (files
    /// changed on the host meanwhile are reported as conflicts and left alone).
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
    /// Print one JSON event per line instead of the command's output.
    #[arg(long)]
    json: bool,
    /// The command and its arguments.
    #[arg(required = true, last = true)]
    command: Vec<String>,
}

/// The session name `vmctl run` uses for its shares: `/sessions/run/mnt/<name>`.
const SESSION: &str = "run";

#[derive(Debug, Clone)]
pub struct MountArg {
    host: PathBuf,
    name: Option<String>,
    mode: ShareMode,
}

/// `HOST_PATH[:NAME][:MODE]`: the mode is recognised by value, so `path:shadow` works too.
fn parse_mount(s: &str) -> Result<MountArg, String> {
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
    Ok(MountArg { host: PathBuf::from(parts[0]), name, mode })
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    let (k, v) = s.split_once('=').ok_or_else(|| format!("{s:?} is not K=V"))?;
    if k.is_empty() {
        return Err(format!("{s:?} has an empty name"));
    }
    Ok((k.to_string(), v.to_string()))
}

/// Which backend `auto` picks on this host, and why.
pub fn choose_backend(choice: BackendChoice) -> anyhow::Result<(BackendKind, String)> {
    let kvm = KvmKind::detect();
    let vmm = kvm::find_vmm();
    match choice {
        BackendChoice::Qemu => Ok((BackendKind::Qemu, "requested".into())),
        BackendChoice::Kvm => {
            if kvm == KvmKind::Absent {
                bail!("--backend kvm needs /dev/kvm, and this host has no usable one; use --backend qemu");
            }
            if vmm.is_none() {
                bail!("--backend kvm needs umbra-vmm next to vmctl, on PATH or in UMBRA_VMM_BIN");
            }
            let note =
                if kvm == KvmKind::Pvm { " (warning: /dev/kvm is kvm_pvm, which cannot boot Linux)" } else { "" };
            Ok((BackendKind::Kvm, format!("requested{note}")))
        }
        BackendChoice::Auto => Ok(match (kvm, vmm) {
            (KvmKind::Hardware, Some(_)) => (BackendKind::Kvm, "hardware KVM (VT-x/AMD-V): the Umbra VMM".into()),
            (KvmKind::Hardware, None) => (
                BackendKind::Qemu,
                "hardware KVM found but umbra-vmm is missing (build it next to vmctl); qemu with -accel kvm".into(),
            ),
            (KvmKind::Pvm, _) => (
                BackendKind::Qemu,
                "/dev/kvm is kvm_pvm, which cannot boot a Linux guest; qemu with TCG emulation".into(),
            ),
            (KvmKind::Absent, _) => (BackendKind::Qemu, "no usable /dev/kvm; qemu with TCG emulation".into()),
        }),
    }
}

pub fn bundle_dir(spec: &str) -> anyhow::Result<PathBuf> {
    let as_path = PathBuf::from(spec);
    let dir = if as_path.join("manifest.json").exists() { as_path } else { paths::bundles_dir().join(spec) };
    if !dir.join("manifest.json").exists() {
        bail!(
            "no bundle {spec:?} (looked in {} and {}); build one with `vmctl bundle build --flavor minimal`",
            spec,
            dir.display()
        );
    }
    Ok(dir)
}

struct Output {
    json: bool,
}

impl Output {
    fn event(&self, value: serde_json::Value) {
        if self.json {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{value}");
            let _ = out.flush();
        }
    }
}

pub async fn run(args: RunArgs) -> i32 {
    let out = Output { json: args.json };
    match run_inner(args, &out).await {
        Ok(code) => code,
        Err(e) => {
            out.event(serde_json::json!({"event": "error", "message": format!("{e:#}")}));
            eprintln!("vmctl: error: {e:#}");
            EXIT_UMBRA_ERROR
        }
    }
}

async fn run_inner(args: RunArgs, out: &Output) -> anyhow::Result<i32> {
    let (backend, why) = choose_backend(args.backend)?;
    let image = crate::bundle_store::boot_image(&args.bundle)?;
    let mut spec = VmSpec::new(image);
    spec.cpus = args.cpus;
    spec.memory_mib = args.memory;
    spec.boot_timeout = Duration::from_secs(args.boot_timeout);
    spec.folder_sharing = !args.mounts.is_empty();
    if (args.shadow_diff || args.shadow_apply) && !args.mounts.iter().any(|m| m.mode == ShareMode::Shadow) {
        bail!("--shadow-diff and --shadow-apply need a --mount with mode shadow");
    }

    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let launch = Vm::launch(backend, &spec);
    let mut vm = tokio::select! {
        vm = launch => vm.context("the sandbox did not start")?,
        _ = sigint.recv() => bail!("interrupted during boot"),
        _ = sigterm.recv() => bail!("terminated during boot"),
    };
    out.event(serde_json::json!({"event": "ready", "backend": format!("{backend:?}").to_lowercase(),
        "why": why, "boot_ms": vm.boot_time.as_millis() as u64, "bundle": spec.image.version}));

    let mut guest_paths = Vec::new();
    for m in &args.mounts {
        let path = vm.share_folder(SESSION, &m.host, m.name.as_deref(), m.mode).await?;
        out.event(serde_json::json!({"event": "mounted", "host": m.host, "guest": path, "mode": m.mode}));
        guest_paths.push(path);
    }
    let cwd = match (&args.workdir, guest_paths.as_slice()) {
        (Some(w), _) => Some(w.clone()),
        (None, [only]) => Some(only.clone()),
        _ => None,
    };

    let raw = if args.tty { RawTerminal::enable().ok() } else { None };
    let request = SpawnRequest {
        argv: args.command.clone(),
        cwd,
        env: args.env.iter().cloned().collect::<BTreeMap<_, _>>(),
        uid: None,
        gid: None,
        tty: args.tty.then(|| crate::tty::size().unwrap_or(TtySize { rows: 24, cols: 80 })),
    };
    let process = vm.agent().spawn(request)?;
    let result = drive(&mut vm, process, &args, out, &mut sigint, &mut sigterm).await;
    drop(raw);
    let shadow = if result.is_ok() { shadow_report(&vm, &args, out).await } else { Ok(()) };
    vm.shutdown().await;
    shadow?;
    result
}

/// After the command: the diff of each shadow mount and, if asked, its application.
async fn shadow_report(vm: &Vm, args: &RunArgs, out: &Output) -> anyhow::Result<()> {
    for shared in vm.shared_folders().iter().filter(|s| s.mode == ShareMode::Shadow) {
        let name = shared.name.clone();
        if args.shadow_diff {
            let changes = vm.shadow_diff(SESSION, &name).await?;
            out.event(serde_json::json!({"event": "shadow_diff", "mount": name, "changes": changes}));
            if !out.json {
                eprintln!("shadow {name}: {} change(s)", changes.len());
                for c in &changes {
                    let size = c.size.map(|s| format!(" ({s} bytes)")).unwrap_or_default();
                    let kind = match c.kind {
                        ChangeKind::Added => "added",
                        ChangeKind::Modified => "modified",
                        ChangeKind::Deleted => "deleted",
                    };
                    eprintln!("  {kind:<8} {}{}{size}", c.path, if c.is_dir { "/" } else { "" });
                }
            }
        }
        if args.shadow_apply {
            let report = vm.shadow_apply(SESSION, &name).await?;
            let conflicts: Vec<String> =
                report.conflicts.iter().map(|c| format!("{} ({:?})", c.path, c.reason)).collect();
            let errors: Vec<String> = report.errors.iter().map(|e| format!("{e:?}")).collect();
            out.event(serde_json::json!({"event": "shadow_apply", "mount": name, "applied": report.applied,
                "conflicts": conflicts, "errors": errors}));
            if !out.json {
                eprintln!(
                    "shadow {name}: applied {} change(s) to {}; {} conflict(s), {} error(s)",
                    report.applied.len(),
                    shared.host_path.display(),
                    conflicts.len(),
                    errors.len()
                );
                for c in conflicts.iter().chain(&errors) {
                    eprintln!("  not applied: {c}");
                }
            }
        }
    }
    Ok(())
}

/// Streams one process until it exits; returns vmctl's exit status.
async fn drive(
    vm: &mut Vm,
    mut process: Process,
    args: &RunArgs,
    out: &Output,
    sigint: &mut tokio::signal::unix::Signal,
    sigterm: &mut tokio::signal::unix::Signal,
) -> anyhow::Result<i32> {
    let stdin = process.stdin();
    let mut host_stdin = host_stdin_reader();
    let stdin_task = tokio::spawn(async move {
        while let Some(chunk) = host_stdin.recv().await {
            match chunk {
                Some(bytes) => {
                    if stdin.write(bytes).await.is_err() {
                        return;
                    }
                }
                None => {
                    let _ = stdin.close().await;
                    return;
                }
            }
        }
    });
    let mut winch = signal(SignalKind::window_change())?;
    let deadline = args.timeout.map(|s| Instant::now() + Duration::from_secs(s));
    let mut sighup = signal(SignalKind::hangup())?;
    let mut timed_out = false;
    let mut interrupted: Option<i32> = None;
    // After asking the command to stop, SIGKILL it if it has not ended by then; if even that
    // gets no exit event, the guest is unresponsive and vmctl gives up on it.
    let mut escalate_at: Option<Instant> = None;
    let mut give_up_at: Option<Instant> = None;
    // The agent connection normally reports a dead VM; this catches a VM that hangs instead.
    let mut alive_check = tokio::time::interval(Duration::from_millis(500));
    let code = loop {
        let until =
            |t: Option<Instant>| t.map(|d| d.saturating_duration_since(Instant::now())).unwrap_or(Duration::MAX);
        let event = tokio::select! {
            ev = process.next_event() => ev,
            sig = forwarded_signal(sigint, sigterm, &mut sighup) => {
                interrupted = Some(sig);
                send_signal(&process, sig).await;
                escalate_at.get_or_insert(Instant::now() + KILL_GRACE);
                continue
            }
            _ = alive_check.tick() => {
                if let Err(e) = vm.check_alive() {
                    stdin_task.abort();
                    bail!("{e}");
                }
                continue
            }
            _ = winch.recv(), if args.tty => {
                if let Some(sz) = crate::tty::size() { let _ = process.resize(sz.rows, sz.cols).await; }
                continue
            }
            _ = tokio::time::sleep(until(deadline)), if deadline.is_some() && !timed_out => {
                timed_out = true;
                send_signal(&process, libc::SIGTERM).await;
                escalate_at.get_or_insert(Instant::now() + KILL_GRACE);
                continue
            }
            _ = tokio::time::sleep(until(escalate_at)), if escalate_at.is_some() => {
                send_signal(&process, libc::SIGKILL).await;
                escalate_at = None;
                give_up_at = Some(Instant::now() + KILL_GRACE);
                continue
            }
            _ = tokio::time::sleep(until(give_up_at)), if give_up_at.is_some() => {
                stdin_task.abort();
                bail!("the command did not end {KILL_GRACE:?} after SIGKILL: the guest is not responding");
            }
        };
        match event {
            Some(ProcessEvent::Spawned { pid }) => out.event(serde_json::json!({"event": "spawned", "pid": pid})),
            Some(ProcessEvent::Stdout(b)) => write_stream(out, "stdout", &b, &mut std::io::stdout()),
            Some(ProcessEvent::Stderr(b)) => write_stream(out, "stderr", &b, &mut std::io::stderr()),
            Some(ProcessEvent::Exit(status)) => {
                out.event(serde_json::json!({"event": "exit", "code": status.code, "signal": status.signal,
                    "duration_ms": status.duration_ms}));
                break if timed_out { 124 } else { status.shell_code() };
            }
            Some(ProcessEvent::SpawnFailed(e)) => {
                out.event(serde_json::json!({"event": "spawn_failed", "message": e.message}));
                eprintln!("vmctl: cannot run {:?}: {}", args.command[0], e.message);
                break if e.message.contains("No such file") { EXIT_NOT_FOUND } else { EXIT_CANNOT_RUN };
            }
            Some(ProcessEvent::Error(msg)) => {
                // The connection dropped: find out from the VM why.
                let why = vm.wait(Duration::from_secs(3)).await;
                stdin_task.abort();
                match why {
                    Some(e) => bail!("{e}"),
                    None => bail!("{msg}"),
                }
            }
            None => bail!("the agent connection ended without an exit event"),
        }
    };
    stdin_task.abort();
    Ok(interrupted.map(|s| 128 + s).filter(|_| code != 0).unwrap_or(code))
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

/// Signals the command without letting an unresponsive agent stall the event loop.
async fn send_signal(process: &Process, signal: i32) {
    let _ = tokio::time::timeout(Duration::from_secs(2), process.kill(signal)).await;
}

/// Host stdin as chunks (`None` = end of input), read on a plain thread: a blocking read of a
/// terminal cannot be cancelled, and on tokio's blocking pool it would keep the runtime — and
/// so vmctl — alive after the command ended until the user pressed Enter.
fn host_stdin_reader() -> tokio::sync::mpsc::Receiver<Option<bytes::Bytes>> {
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

fn write_stream(out: &Output, name: &str, data: &[u8], sink: &mut dyn Write) {
    if out.json {
        out.event(serde_json::json!({"event": name, "data": String::from_utf8_lossy(data)}));
    } else {
        let _ = sink.write_all(data);
        let _ = sink.flush();
    }
}
