//! `vmctl session …`: sessions through umbrad, as a desktop app uses them. vmctl is one more
//! client of the daemon's socket; when umbrad is not running, each command says how to start
//! it (`vmctl run` needs no daemon).

use std::io::Write;
use std::time::Duration;

use anyhow::bail;
use clap::{Args, Subcommand};
use tokio::signal::unix::{signal, SignalKind};
use umbra_api::client::{Client, Notifications};
use umbra_api::event::{spawn_failure_status, EXIT_UMBRA_ERROR};
use umbra_api::methods::*;
use umbra_api::rpc::{NOTIFY_EVENT, NOTIFY_LOST, NOTIFY_PROCESS};
use umbra_api::{ApiError, Data, EventKind, FolderSpec, SessionEvent, SessionInfo};
use umbra_proto::TtySize;

use crate::tty::RawTerminal;

#[derive(Subcommand, Debug)]
pub enum SessionCommand {
    /// Create and boot a session; returns once it is ready.
    Start(Box<StartArgs>),
    /// Run a command in a session and exit with its status.
    Exec(ExecArgs),
    /// List sessions.
    Ls(LsArgs),
    /// Stop a session (its folders, outputs and disk stay).
    Stop(NameArgs),
    /// Boot a stopped session again (a snapshotted one is restored).
    Resume(ResumeArgs),
    /// Pause a running session into a snapshot in its storage and stop it (kvm backend). Its
    /// processes end (detached ones run on).
    Snapshot(NameArgs),
    /// Start a new session from another's snapshot (of a running source on kvm, one taken as
    /// it runs on; elsewhere it is snapshotted and resumed first): its own disk, outputs,
    /// uploads and hostname.
    Fork(ForkArgs),
    /// Stop a session and delete it with its outputs, uploads and disk.
    Rm(NameArgs),
    /// A session's recent events and console lines.
    Logs(LogsArgs),
    /// Reach a guest port from the host: listen on a host port (127.0.0.1, a free port unless
    /// given) and carry each connection to the guest's port.
    Expose(ExposeArgs),
    /// Stop listening for a guest port.
    Unexpose(UnexposeArgs),
    /// A session's exposed ports.
    Ports(PortsArgs),
    /// Attach this terminal to a terminal of the session (a new one unless named) that keeps
    /// running when vmctl goes: Ctrl-] detaches.
    Attach(crate::attach::AttachArgs),
    /// A session's processes: running ones, and detached ones and terminals (also for a while
    /// after they ended).
    Ps(crate::attach::PsArgs),
    /// Change a session's settings, running or not: approval, network, the idle timeout and
    /// action take effect at once, the rest at its next boot (it says which).
    Update(UpdateArgs),
    /// The diagnostics a change to a folder's files would bring and take away, from language
    /// servers in the session (pylsp, clangd); nothing is written. Exits 2 if there are new ones,
    /// 3 if the servers did not finish in time.
    Lint(crate::lint::LintArgs),
}

#[derive(Args, Debug)]
pub struct UpdateArgs {
    name: String,
    /// Stop (or suspend) it after this many idle seconds (0: never).
    #[arg(long)]
    idle_timeout: Option<u64>,
    /// At the idle timeout: stop, or suspend (the kvm backend).
    #[arg(long, value_enum)]
    idle_action: Option<IdleActionArg>,
    /// Guest memory in MiB, from its next boot.
    #[arg(long)]
    memory: Option<u32>,
    /// Guest vCPUs, from its next boot.
    #[arg(long)]
    cpus: Option<u32>,
    /// Any other settings, as `session.update`'s JSON (`{"approval": {...}, "network": {...}}`);
    /// the options above win.
    #[arg(long)]
    settings: Option<String>,
}

#[derive(Args, Debug)]
pub struct ExposeArgs {
    name: String,
    /// The port a server listens on in the guest.
    guest_port: u16,
    /// The host port (default: a free one).
    #[arg(long)]
    host_port: Option<u16>,
    /// The host address (default 127.0.0.1; another needs umbrad's ports_beyond_loopback).
    #[arg(long)]
    bind: Option<std::net::IpAddr>,
}

#[derive(Args, Debug)]
pub struct UnexposeArgs {
    name: String,
    guest_port: u16,
}

#[derive(Args, Debug)]
pub struct PortsArgs {
    name: String,
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub struct StartArgs {
    name: String,
    /// Share a host folder: HOST_PATH[:NAME][:MODE], MODE = ro | rw | rwd | shadow. Repeatable.
    #[arg(long = "mount", value_name = "HOST_PATH[:NAME][:MODE]", value_parser = parse_folder_spec)]
    mounts: Vec<FolderSpec>,
    #[arg(long)]
    memory: Option<u32>,
    #[arg(long)]
    cpus: Option<u32>,
    /// Stop the session after this many idle seconds (0: never).
    #[arg(long)]
    idle_timeout: Option<u64>,
    /// At the idle timeout: stop, or suspend (a snapshot the next call naming the session
    /// restores, detached processes and terminals running on; the kvm backend, others stop).
    #[arg(long, value_enum)]
    idle_action: Option<IdleActionArg>,
    /// Size of its writable disk in MiB (0: guest writes stay in RAM).
    #[arg(long)]
    disk_size: Option<u64>,
    /// Bundle (a built flavor, a directory, or an installed version); default: the daemon's
    /// (`current`: the installed current bundle, else the flavor this machine built).
    #[arg(long)]
    bundle: Option<String>,
    /// Boot an OCI image instead of a bundle (umbrad pulls and converts it unless it did
    /// before; `vmctl image pull` does the same here): its Env, WorkingDir and User become the
    /// defaults of every process.
    #[arg(long, conflicts_with = "bundle")]
    image: Option<String>,
    #[command(flatten)]
    network: crate::network::NetworkArgs,
    #[command(flatten)]
    policy: crate::policy::PolicyArgs,
    /// Reach a guest port from the host: [[BIND:]HOST:]GUEST (repeatable; HOST omitted or 0:
    /// a free port; BIND 127.0.0.1 unless given).
    #[arg(long = "publish", short = 'p', value_name = "[[BIND:]HOST:]GUEST", value_parser = crate::network::parse_publish)]
    publish: Vec<umbra_api::ports::PortSpec>,
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub struct ExecArgs {
    name: String,
    /// Run on a pseudo-terminal (raw host terminal, window size forwarded).
    #[arg(long)]
    tty: bool,
    #[arg(long)]
    workdir: Option<String>,
    /// Environment for the command (repeatable).
    #[arg(long = "env", value_name = "K=V", value_parser = parse_env)]
    env: Vec<(String, String)>,
    /// Kill the command after this many seconds (exit status 124).
    #[arg(long)]
    timeout: Option<u64>,
    #[arg(required = true, last = true)]
    command: Vec<String>,
}

#[derive(Args, Debug)]
pub struct LsArgs {
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub struct NameArgs {
    name: String,
}

#[derive(Args, Debug)]
pub struct ResumeArgs {
    name: String,
    /// Delete the session's snapshot and boot it from its disk (a snapshot this host cannot
    /// restore): what its memory held is lost; the disk, outputs and folders stay.
    #[arg(long)]
    discard_snapshot: bool,
}

#[derive(Args, Debug)]
pub struct ForkArgs {
    /// The session to fork.
    source: String,
    /// The new session's name.
    name: String,
}

#[derive(Args, Debug)]
pub struct LogsArgs {
    name: String,
    /// Lines of each log.
    #[arg(long, short = 'n', default_value_t = 100)]
    lines: u32,
    /// Keep printing the session's events as they happen.
    #[arg(long, short = 'f')]
    follow: bool,
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    let (k, v) = s.split_once('=').ok_or_else(|| format!("{s:?} is not K=V"))?;
    if k.is_empty() {
        return Err(format!("{s:?} has an empty name"));
    }
    Ok((k.to_string(), v.to_string()))
}

pub async fn run(command: SessionCommand) -> i32 {
    let result = match command {
        SessionCommand::Exec(args) => return exec(args).await,
        SessionCommand::Attach(args) => return crate::attach::attach(args).await,
        SessionCommand::Lint(args) => return crate::lint::lint(args).await,
        SessionCommand::Ps(args) => crate::attach::ps(args).await,
        SessionCommand::Start(args) => start(*args).await,
        SessionCommand::Ls(args) => ls(args).await,
        SessionCommand::Stop(a) => simple::<SessionStop>(SessionRef { name: a.name }, "stopped").await,
        SessionCommand::Resume(a) => {
            simple::<SessionResume>(ResumeParams { name: a.name, discard_snapshot: a.discard_snapshot }, "ready").await
        }
        SessionCommand::Snapshot(a) => simple::<SessionSnapshot>(SessionRef { name: a.name }, "paused").await,
        SessionCommand::Fork(a) => simple::<SessionFork>(ForkParams { source: a.source, name: a.name }, "forked").await,
        SessionCommand::Rm(a) => rm(a).await,
        SessionCommand::Logs(args) => logs(args).await,
        SessionCommand::Expose(args) => expose(args).await,
        SessionCommand::Unexpose(a) => unexpose(a).await,
        SessionCommand::Ports(args) => ports(args).await,
        SessionCommand::Update(args) => update(args).await,
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("vmctl: error: {}", e.message);
            1
        }
    }
}

async fn connect() -> Result<Client, ApiError> {
    Client::connect(None).await.map(|(c, _)| c)
}

async fn rm(args: NameArgs) -> Result<(), ApiError> {
    let client = connect().await?;
    client.call::<SessionDelete>(SessionRef { name: args.name.clone() }).await?;
    eprintln!("vmctl: deleted session {}", args.name);
    Ok(())
}

async fn simple<M: Method<Result = SessionInfo>>(params: M::Params, word: &str) -> Result<(), ApiError> {
    let client = connect().await?;
    let info = client.call::<M>(params).await?;
    match &info.snapshot {
        Some(s) if word == "paused" => eprintln!(
            "vmctl: session {} {word} ({}): snapshot of {} MiB of memory in {}/snapshot",
            info.name,
            info.status,
            s.memory_bytes >> 20,
            info.storage_dir.display()
        ),
        Some(s) if word == "forked" => eprintln!(
            "vmctl: session {} {} ({}), forked from a snapshot of {} (which paused it {} ms)",
            info.name,
            if info.status == umbra_api::SessionStatus::Ready { "ready" } else { "started" },
            info.status,
            s.source,
            s.pause_ms
        ),
        _ => eprintln!("vmctl: session {} {word} ({})", info.name, info.status),
    }
    Ok(())
}

async fn update(args: UpdateArgs) -> Result<(), ApiError> {
    let mut settings: umbra_api::session::SettingsPatch = match &args.settings {
        Some(json) => serde_json::from_str(json).map_err(|e| ApiError::invalid_params(format!("--settings: {e}")))?,
        None => Default::default(),
    };
    settings.idle_timeout_secs = args.idle_timeout.or(settings.idle_timeout_secs);
    settings.idle_action = args.idle_action.map(IdleActionArg::into_api).or(settings.idle_action);
    settings.memory_mib = args.memory.or(settings.memory_mib);
    settings.cpus = args.cpus.or(settings.cpus);
    let client = connect().await?;
    let updated = client
        .call::<umbra_api::methods::SessionUpdate>(umbra_api::methods::UpdateParams { name: args.name, settings })
        .await?;
    let list = |l: &[String]| if l.is_empty() { "nothing".to_string() } else { l.join(", ") };
    eprintln!(
        "vmctl: session {} ({}): in force now: {}; at its next boot: {}",
        updated.session.name,
        updated.session.status,
        list(&updated.applied),
        list(&updated.next_boot)
    );
    Ok(())
}

/// `--idle-action`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum IdleActionArg {
    Stop,
    Suspend,
}

impl IdleActionArg {
    fn into_api(self) -> umbra_api::IdleAction {
        match self {
            IdleActionArg::Stop => umbra_api::IdleAction::Stop,
            IdleActionArg::Suspend => umbra_api::IdleAction::Suspend,
        }
    }
}

async fn start(args: StartArgs) -> Result<(), ApiError> {
    let (client, mut notes) = Client::connect(None).await?;
    // Show the boot's progress (queued, mounted, ready) while the start runs.
    client.call::<EventsSubscribe>(SubscribeParams { session: Some(args.name.clone()) }).await?;
    let settings = umbra_api::session::SettingsPatch {
        memory_mib: args.memory,
        cpus: args.cpus,
        idle_timeout_secs: args.idle_timeout,
        idle_action: args.idle_action.map(IdleActionArg::into_api),
        disk_size_mib: args.disk_size,
        bundle: args.bundle,
        network: args.network.policy(),
        policy: args.policy.load(args.network.given()).map_err(ApiError::invalid_params)?,
        ..Default::default()
    };
    let secrets = args.network.secrets().map_err(ApiError::invalid_params)?;
    let params = StartParams {
        name: args.name.clone(),
        folders: args.mounts,
        settings,
        secrets,
        ssh_keys: args.network.ssh_keys(),
        ports: args.publish,
        image: args.image,
    };
    let start = client.call::<SessionStart>(params);
    tokio::pin!(start);
    let info = loop {
        tokio::select! {
            r = &mut start => break r?,
            n = notes.recv() => match n {
                Some(n) if n.method == NOTIFY_EVENT => {
                    if let Ok(ev) = serde_json::from_value::<SessionEvent>(n.params) {
                        print_event(&ev, args.json, false);
                    }
                }
                _ => {}
            },
        }
    };
    if args.json {
        println!("{}", serde_json::to_string(&info).expect("info serializes"));
    } else {
        let vm = info.vm.as_ref();
        eprintln!(
            "vmctl: session {} ready ({} backend, booted in {} ms)",
            info.name,
            vm.map_or("?", |v| v.backend.as_str()),
            vm.map_or(0, |v| v.boot_ms)
        );
        for f in &info.folders {
            eprintln!("  {:<8} {} -> {}", f.mode, f.host_path.display(), f.guest_path);
        }
        for p in &info.ports {
            eprintln!("  port     {} -> guest port {}", host_address(p), p.guest_port);
        }
    }
    Ok(())
}

fn host_address(p: &umbra_api::ports::PortInfo) -> std::net::SocketAddr {
    std::net::SocketAddr::new(p.bind, p.host_port)
}

async fn expose(args: ExposeArgs) -> Result<(), ApiError> {
    let client = connect().await?;
    let port = umbra_api::ports::PortSpec { guest_port: args.guest_port, host_port: args.host_port, bind: args.bind };
    let info = client.call::<SessionExpose>(umbra_api::ports::ExposeParams { session: args.name, port }).await?;
    // The address alone on stdout, for scripts: `curl http://$(vmctl session expose dev 8000)/`.
    println!("{}", host_address(&info));
    Ok(())
}

async fn unexpose(args: UnexposeArgs) -> Result<(), ApiError> {
    let client = connect().await?;
    let params = umbra_api::ports::UnexposeParams { session: args.name, guest_port: args.guest_port };
    client.call::<SessionUnexpose>(params).await?;
    Ok(())
}

async fn ports(args: PortsArgs) -> Result<(), ApiError> {
    let client = connect().await?;
    let list = client.call::<SessionPorts>(SessionRef { name: args.name }).await?;
    if args.json {
        println!("{}", serde_json::to_string(&list).expect("ports serialize"));
        return Ok(());
    }
    println!("{:<8} {:<24} CONNECTIONS", "GUEST", "HOST");
    for p in &list.ports {
        println!("{:<8} {:<24} {}", p.guest_port, host_address(p).to_string(), p.connections);
    }
    Ok(())
}

/// Prints an event: JSON on stdout, or a line of text (on stdout for `logs`, stderr otherwise).
fn print_event(ev: &SessionEvent, json: bool, to_stdout: bool) {
    if json {
        println!("{}", serde_json::to_string(ev).expect("events serialize"));
        return;
    }
    let line = match &ev.kind {
        EventKind::Status { status, reason } => {
            format!("status {status}{}", reason.as_ref().map(|r| format!(": {r}")).unwrap_or_default())
        }
        EventKind::BootQueued { position } => format!("boot queued (position {position})"),
        EventKind::FolderMounted { name, guest_path, mode, .. } => format!("mounted {name} ({mode}) at {guest_path}"),
        EventKind::Ready { backend, boot_ms, bundle, .. } => {
            format!("ready: {backend}, bundle {bundle}, booted in {boot_ms} ms")
        }
        EventKind::HeartbeatFailure { reason } => format!("heartbeat failure: {reason}"),
        EventKind::Restarting { attempt, reason, .. } => format!("restarting (attempt {attempt}): {reason}"),
        EventKind::Failed { reason, .. } => format!("failed: {reason}"),
        EventKind::IdleStop { idle_secs } => format!("stopped after {idle_secs} s idle"),
        EventKind::IdleSuspend { idle_secs } => format!("suspending after {idle_secs} s idle"),
        EventKind::StartupError { error } => format!("start failed: {}", error.message),
        EventKind::OutputsFileCreated { path, .. } => format!("outputs: created {path}"),
        EventKind::OutputsFileDeleted { path, .. } => format!("outputs: deleted {path}"),
        EventKind::Spawned { process, argv, .. } => format!("process {process} started: {}", argv.join(" ")),
        EventKind::Exit(e) => format!("process {} exited with status {}", e.process, e.shell_status()),
        other => other.name().to_string(),
    };
    let session = ev.session.as_deref().unwrap_or("-");
    if to_stdout {
        println!("{session}: {line}");
    } else {
        eprintln!("{session}: {line}");
    }
}

async fn ls(args: LsArgs) -> Result<(), ApiError> {
    let client = connect().await?;
    let list = client.call::<SessionListMethod>(NoParams {}).await?;
    if args.json {
        println!("{}", serde_json::to_string(&list.sessions).expect("sessions serialize"));
        return Ok(());
    }
    if list.sessions.is_empty() {
        eprintln!("vmctl: no sessions");
        return Ok(());
    }
    // MEMORY is the guest's; HOST what its VM holds on the host now (PSS of its processes).
    println!("{:<24} {:<11} {:>6} {:>6} {:>5} {:>9}  FOLDERS", "NAME", "STATUS", "MEMORY", "HOST", "PROCS", "RESTARTS");
    for s in &list.sessions {
        let folders: Vec<String> = s.folders.iter().map(|f| format!("{}:{}", f.name, f.mode)).collect();
        let host = match s.vm.as_ref().and_then(|vm| vm.host_memory_kib) {
            Some(kib) => format!("{}M", kib / 1024),
            None => "-".into(),
        };
        println!(
            "{:<24} {:<11} {:>5}M {:>6} {:>5} {:>9}  {}",
            s.name,
            s.status.to_string(),
            s.settings.memory_mib,
            host,
            s.processes,
            s.restarts,
            folders.join(",")
        );
    }
    Ok(())
}

async fn logs(args: LogsArgs) -> Result<(), ApiError> {
    let (client, mut notes) = Client::connect(None).await?;
    if args.follow {
        client.call::<EventsSubscribe>(SubscribeParams { session: Some(args.name.clone()) }).await?;
    }
    let logs =
        client.call::<SessionLogsMethod>(LogsParams { name: args.name.clone(), lines: Some(args.lines) }).await?;
    println!("== console");
    for l in &logs.console {
        println!("{l}");
    }
    println!("== events");
    for ev in &logs.events {
        print_event(ev, false, true);
    }
    if args.follow {
        while let Some(n) = notes.recv().await {
            if let Ok(ev) = serde_json::from_value::<SessionEvent>(n.params) {
                print_event(&ev, false, true);
            }
        }
    }
    Ok(())
}

/// Runs one command through umbrad; returns its exit status (as `vmctl run` does).
async fn exec(args: ExecArgs) -> i32 {
    match exec_inner(args).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("vmctl: error: {e:#}");
            EXIT_UMBRA_ERROR
        }
    }
}

async fn exec_inner(args: ExecArgs) -> anyhow::Result<i32> {
    let (client, mut notes) = Client::connect(None).await?;
    // On a terminal (not a raw one), a connection the session asks about (network mode `ask`)
    // is put to the person running the command: the next line typed answers it.
    let prompts = (!args.tty && std::io::IsTerminal::is_terminal(&std::io::stdin())).then(Prompts::default);
    if prompts.is_some() {
        client.call::<EventsSubscribe>(SubscribeParams { session: Some(args.name.clone()) }).await?;
    }
    let raw = if args.tty { RawTerminal::enable().ok() } else { None };
    let params = SpawnParams {
        session: args.name.clone(),
        argv: args.command.clone(),
        cwd: args.workdir.clone(),
        env: args.env.iter().cloned().collect(),
        tty: args.tty.then(|| crate::tty::size().unwrap_or(TtySize { rows: 24, cols: 80 })),
        timeout_secs: args.timeout,
        detach: false,
    };
    // Read from the start: a line typed while a command waits for approval answers it, and
    // anything else typed meanwhile is the command's, sent once it runs.
    let mut host_stdin = crate::run::host_stdin_reader();
    let mut early_input = Vec::new();
    let mut stdin_open = true;
    let spawning = client.call::<ProcessSpawn>(params);
    tokio::pin!(spawning);
    let spawned = loop {
        let Some(prompts) = &prompts else { break spawning.await };
        // The answer first: umbrad sends the process's events after it, and a notification
        // taken here would be lost to `drive` (a quick command's output).
        tokio::select! {
            biased;
            r = &mut spawning => break r,
            n = notes.recv() => {
                let Some(n) = n else { break spawning.await };
                if n.method != NOTIFY_EVENT {
                    // Nothing of the process comes before its answer (see above).
                    continue;
                }
                if let Ok(ev) = serde_json::from_value::<SessionEvent>(n.params) {
                    prompts.on_event(&client, ev);
                }
            }
            chunk = host_stdin.recv(), if stdin_open => {
                // `None`: end of input (once), then the reader is gone.
                let chunk = chunk.flatten();
                stdin_open = chunk.is_some();
                let answer = chunk.as_ref().and_then(|_| prompts.0.lock().unwrap().take());
                match (answer, chunk) {
                    (Some(tx), Some(bytes)) => drop(tx.send(bytes.to_vec())),
                    (_, chunk) => early_input.push(chunk),
                }
            }
        }
    };
    let spawned = match spawned {
        Ok(s) => s,
        Err(e) => {
            drop(raw);
            eprintln!("vmctl: cannot run {:?}: {}", args.command[0], e.message);
            return Ok(spawn_failure_status(&e));
        }
    };
    let process = ProcessRef { session: args.name.clone(), process: spawned.process };
    let stdin_client = client.clone();
    let stdin_process = process.clone();
    let answers = prompts.clone();
    let stdin_task = tokio::spawn(async move {
        let mut early = early_input.into_iter();
        while let Some(chunk) = match early.next() {
            Some(chunk) => Some(chunk),
            None => host_stdin.recv().await,
        } {
            // A line typed while a question is open answers it, and is not the command's.
            if let (Some(bytes), Some(answers)) = (&chunk, &answers) {
                if let Some(tx) = answers.0.lock().unwrap().take() {
                    let _ = tx.send(bytes.to_vec());
                    continue;
                }
            }
            let sent = match chunk {
                Some(bytes) => {
                    let data = Data::from_bytes(&bytes);
                    let p = StdinParams {
                        session: stdin_process.session.clone(),
                        process: stdin_process.process,
                        data,
                        writer: None,
                        offset: None,
                    };
                    stdin_client.call::<ProcessStdin>(p).await
                }
                None => stdin_client.call::<ProcessCloseStdin>(stdin_process.clone()).await.map(|_| Done {}),
            };
            if sent.is_err() {
                return;
            }
        }
    });
    let code = drive(&client, &mut notes, &process, args.tty, prompts.as_ref()).await;
    stdin_task.abort();
    drop(raw);
    code
}

/// Where the next line typed goes while a question is open.
#[derive(Clone, Default)]
struct Prompts(std::sync::Arc<std::sync::Mutex<Option<tokio::sync::oneshot::Sender<Vec<u8>>>>>);

impl Prompts {
    /// Puts a `permission_request` (a command's, or a connection's) to the person.
    fn on_event(&self, client: &Client, ev: SessionEvent) {
        use umbra_api::event::PermissionKind;
        let EventKind::PermissionRequest {
            request_id, kind, command, decision, host, port, process, timeout_secs, ..
        } = ev.kind
        else {
            return;
        };
        match (kind, host, port) {
            (PermissionKind::Command, _, _) => {
                let why = decision.map(|d| d.reason.to_string()).unwrap_or_default();
                self.ask_command(client, request_id, &command, &why, timeout_secs);
            }
            (PermissionKind::Network, Some(host), Some(port)) => {
                // umbrad tidied what the guest claims; tidy it again before a terminal shows it.
                let by = process.map(|p| p.tidy()).map_or_else(String::new, |p| match p.pid {
                    Some(pid) => format!(" (process {pid}: {})", p.command),
                    None => format!(" ({})", p.command),
                });
                self.ask(client, request_id, format!("{host}:{port}{by}"), timeout_secs);
            }
            _ => {}
        }
    }

    /// Asks on the terminal whether a command that needs approval may run: `o`nce, `a`lways
    /// (its commands join the session's allow list), anything else denies.
    fn ask_command(&self, client: &Client, request_id: String, command: &str, why: &str, timeout_secs: u64) {
        use umbra_api::event::PermissionScope;
        // The command line is the client's own; the rule may quote it. Shown as text.
        let question = format!("{command:?} needs approval ({why}). Allow [o]nce, [a]lways, or [d]eny?");
        self.put(client, request_id, question, "the command is refused".into(), timeout_secs, |typed| match typed {
            "o" | "once" | "y" | "yes" => (true, PermissionScope::Once),
            "a" | "always" => (true, PermissionScope::Always),
            _ => (false, PermissionScope::Once),
        });
    }

    /// Asks about a connection: `o`nce, `s`ession, anything else denies.
    fn ask(&self, client: &Client, request_id: String, what: String, timeout_secs: u64) {
        use umbra_api::event::PermissionScope;
        let question = format!("the guest wants to connect to {what}. Allow [o]nce, for the [s]ession, or [d]eny?");
        let refused = format!("the connection to {what} is denied");
        self.put(client, request_id, question, refused, timeout_secs, |typed| match typed {
            "o" | "once" | "y" | "yes" => (true, PermissionScope::Once),
            "s" | "session" => (true, PermissionScope::Session),
            _ => (false, PermissionScope::Once),
        });
    }

    /// Puts `question` on the terminal and answers umbrad with what the next line typed means
    /// (`answer`: approved, and how far); no line before the request's timeout leaves it to time
    /// out (`refused`).
    fn put(
        &self,
        client: &Client,
        request_id: String,
        question: String,
        refused: String,
        timeout_secs: u64,
        answer: fn(&str) -> (bool, umbra_api::event::PermissionScope),
    ) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        *self.0.lock().unwrap() = Some(tx);
        eprint!("vmctl: {question} ");
        let _ = std::io::stderr().flush();
        let (client, slot) = (client.clone(), self.0.clone());
        tokio::spawn(async move {
            let typed = tokio::time::timeout(Duration::from_secs(timeout_secs), rx).await;
            slot.lock().unwrap().take();
            let Ok(Ok(line)) = typed else {
                eprintln!("\nvmctl: no answer: {refused}");
                return;
            };
            let (approved, scope) = answer(String::from_utf8_lossy(&line).trim().to_ascii_lowercase().as_str());
            let answer = RespondPermissionParams { request_id, approved, scope, decision: None, remember: false };
            if let Err(e) = client.call::<PermissionRespond>(answer).await {
                eprintln!("vmctl: cannot answer: {}", e.message);
            }
        });
    }
}

async fn drive(
    client: &Client,
    notes: &mut Notifications,
    process: &ProcessRef,
    tty: bool,
    prompts: Option<&Prompts>,
) -> anyhow::Result<i32> {
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sighup = signal(SignalKind::hangup())?;
    let mut winch = signal(SignalKind::window_change())?;
    let mut escalate: Option<tokio::time::Instant> = None;
    let mut interrupted = None;
    let kill = |signal: i32| {
        let (client, p) = (client.clone(), process.clone());
        tokio::spawn(async move {
            let _ = client.call::<ProcessKill>(KillParams { session: p.session, process: p.process, signal }).await;
        });
    };
    let far = || tokio::time::Instant::now() + Duration::from_secs(86400);
    loop {
        let sig = tokio::select! {
            n = notes.recv() => {
                let Some(n) = n else { bail!("umbrad closed the connection") };
                if n.method == NOTIFY_LOST {
                    continue;
                }
                if n.method == NOTIFY_EVENT {
                    if let (Some(prompts), Ok(ev)) = (prompts, serde_json::from_value::<SessionEvent>(n.params)) {
                        prompts.on_event(client, ev);
                    }
                    continue;
                }
                if n.method != NOTIFY_PROCESS {
                    continue;
                }
                let ev: SessionEvent = serde_json::from_value(n.params)?;
                match &ev.kind {
                    EventKind::Stdout { process: id, data, .. } | EventKind::Stderr { process: id, data, .. } if *id == process.process => {
                        let bytes = data.to_bytes()?;
                        let stream = if matches!(ev.kind, EventKind::Stdout { .. }) { Stream::Stdout } else { Stream::Stderr };
                        let written = match stream {
                            Stream::Stdout => std::io::stdout().write_all(&bytes).and_then(|()| std::io::stdout().flush()),
                            Stream::Stderr => std::io::stderr().write_all(&bytes).and_then(|()| std::io::stderr().flush()),
                        };
                        if written.is_err() {
                            kill(libc::SIGPIPE);
                        }
                        let ack = AckParams { session: process.session.clone(), process: process.process, stream, bytes: bytes.len() as u64 };
                        client.notify::<ProcessAck>(ack).await?;
                    }
                    EventKind::Exit(e) if e.process == process.process => {
                        if e.lost {
                            bail!("{}", e.reason.clone().unwrap_or_else(|| "the session's VM went away".into()));
                        }
                        let mut e = e.clone();
                        e.interrupted = e.interrupted.or(interrupted);
                        return Ok(e.shell_status());
                    }
                    _ => {}
                }
                continue;
            }
            _ = sigint.recv() => libc::SIGINT,
            _ = sigterm.recv() => libc::SIGTERM,
            _ = sighup.recv() => libc::SIGHUP,
            _ = winch.recv(), if tty => {
                if let Some(sz) = crate::tty::size() {
                    let p = ResizeParams { session: process.session.clone(), process: process.process, rows: sz.rows, cols: sz.cols };
                    let _ = client.call::<ProcessResize>(p).await;
                }
                continue;
            }
            _ = tokio::time::sleep_until(escalate.unwrap_or_else(far)), if escalate.is_some() => {
                escalate = None;
                libc::SIGKILL
            }
        };
        interrupted.get_or_insert(sig);
        kill(sig);
        if sig != libc::SIGKILL {
            escalate.get_or_insert(tokio::time::Instant::now() + umbra_runtime::session::KILL_GRACE);
        }
    }
}
