//! `vmctl bench session`: what the session layer and umbrad add on top of a bare VM, each beside
//! an anchor measured in the same run.
//!
//! - **Session start → first output of `echo hi`**: a fresh session per run through the runtime
//!   (`SessionManager::start`, then `Session::spawn`, until the first `stdout` event), stopped
//!   and deleted afterwards. Three kinds of session, each beside a bare VM (`Vm::launch`, then
//!   the agent client) with the same devices: no storage of its own (what `vmctl run` boots)
//!   beside the plain VM; its storage folders (outputs and uploads shared, the outputs watcher)
//!   beside a VM with folder sharing; and those plus a new session disk (sparse file +
//!   `mkfs.ext4`, as a daemon session's first start makes) beside a VM with folder sharing and a
//!   disk made the same way. Anchor: the plain bare VM's launch → agent ready (same bundle,
//!   same backend). Each session's difference from its bare VM is the session layer's own cost;
//!   the bare VMs' differences are what the devices cost. The kinds take turns within each round
//!   (each round starting with the next one), so a machine that slows down slows them all alike.
//! - **Spawn round-trip**: spawn `true` and wait for its exit, after a warm-up, three ways in
//!   turn on VMs of the same kind (folder sharing on, a session disk when there is one):
//!   (a) the agent client on a bare VM — the floor; (b) `Session::spawn` through the runtime's
//!   session layer; (c) a private umbrad over its real socket (`process.spawn`, then the
//!   `process.event` exit notification). Medians, p90s and the ratios b/a, c/b, c/a — of the
//!   wall time, and of the host CPU time Umbra's own processes spent per round-trip (vmctl for
//!   a and b, vmctl + umbrad for c): under software emulation the guest's fork and exec
//!   dominate the wall time, and the CPU time shows what each layer costs by itself.
//!
//! The private umbrad is the one built next to vmctl, run in a scratch set of XDG directories
//! with its own configuration file, and stopped at the end (SIGTERM, then SIGKILL) — also on
//! an error or Ctrl-C.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use umbra_api::client::{Client, Notifications};
use umbra_api::methods::{AckParams, ProcessAck, ProcessSpawn, SessionDelete, SessionRef, SessionStart, SpawnParams};
use umbra_api::methods::{StartParams, Stream};
use umbra_api::rpc::NOTIFY_PROCESS;
use umbra_api::{DaemonConfig, EventKind, SessionEvent};
use umbra_proto::SpawnRequest;
use umbra_runtime::agent::ProcessEvent;
use umbra_runtime::backend::{select, BackendKind, BootImage, KvmKind, Supervised, Vm, VmSpec};
use umbra_runtime::session::{ExecRequest, ManagerOptions, Session, SessionManager};

use crate::boot::{median, ms};
use umbra_api::BackendChoice;

#[derive(Args, Debug)]
pub struct SessionBenchArgs {
    #[arg(long, default_value = "minimal")]
    bundle: String,
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendChoice,
    /// Fresh starts of each kind of session (and of the bare VM); 0 skips this part.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Starts with a VM from the warm pool, and as many without (in turn); 0 skips this part.
    #[arg(long, default_value_t = 5)]
    pool_runs: usize,
    /// Spawn round-trips per way, after the warm-up; 0 skips this part.
    #[arg(long, default_value_t = 50)]
    spawns: usize,
    /// Spawn round-trips per way before measuring.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Size of the session disk in MiB (default: umbrad's default); 0 leaves disks out.
    #[arg(long, default_value_t = default_disk_mib())]
    disk_mib: u64,
    /// Seconds a boot may take (software emulation on a loaded host needs more than 30).
    #[arg(long, default_value_t = 120, env = "UMBRA_BOOT_TIMEOUT_SECS")]
    boot_timeout: u64,
}

/// How long one spawned process (or one `echo`) may take before the bench gives up.
const PROCESS_TIMEOUT: Duration = Duration::from_secs(60);
/// How long umbrad may take to serve its socket.
const DAEMON_START: Duration = Duration::from_secs(20);
/// How long umbrad may take to stop its sessions after SIGTERM before it is killed.
const DAEMON_STOP: Duration = Duration::from_secs(30);
const SESSION: &str = "bench";

/// What the whole bench shares.
struct Setup {
    backend: BackendKind,
    choice: umbra_api::BackendChoice,
    image: BootImage,
    root: PathBuf,
    memory_mib: u32,
    cpus: u32,
    boot_timeout: Duration,
    disk_mib: u64,
}

impl Setup {
    fn vm_spec(&self) -> VmSpec {
        let mut spec = VmSpec::new(self.image.clone());
        (spec.memory_mib, spec.cpus, spec.boot_timeout) = (self.memory_mib, self.cpus, self.boot_timeout);
        spec
    }

    /// A manager's (and umbrad's) configuration: the bare VM's size, no idle stop, this
    /// bench's disk and `bundle`.
    fn config(&self, bundle: &str) -> anyhow::Result<DaemonConfig> {
        from_json(serde_json::json!({
            "memory_mib": self.memory_mib,
            "cpus": self.cpus,
            "idle_timeout_secs": 0,
            "disk_size_mib": self.disk_mib,
            "boot_timeout_secs": self.boot_timeout.as_secs().max(1),
            "bundle": bundle,
            "backend": self.choice,
        }))
    }

    /// A manager like umbrad's (records, event logs and session storage, here in the scratch
    /// directory), or with `storage` false like `vmctl run`'s (nothing kept, no storage).
    fn manager(&self, bundle: &str, storage: bool) -> anyhow::Result<SessionManager> {
        self.manager_in(storage, self.config(bundle)?, "")
    }

    /// [`Setup::manager`] with `config`, its directories' names ending in `tag`.
    fn manager_in(&self, storage: bool, config: DaemonConfig, tag: &str) -> anyhow::Result<SessionManager> {
        let bundles = umbra_bundle::Store::new(umbra_bundle::Store::default_root());
        let opts = if storage {
            ManagerOptions {
                config,
                state_dir: Some(self.root.join(format!("state{tag}"))),
                storage_root: Some(self.root.join(format!("data{tag}/sessions"))),
                bundles,
            }
        } else {
            ManagerOptions { config, state_dir: None, storage_root: None, bundles }
        };
        Ok(SessionManager::new(opts))
    }
}

/// A configuration or request from its JSON form — the file and wire format, one flat object
/// however the Rust types group their fields.
fn from_json<T: serde::de::DeserializeOwned>(value: serde_json::Value) -> anyhow::Result<T> {
    serde_json::from_value(value).context("build a configuration or request")
}

/// `session.start` params for session `name` with a disk of `disk_mib` (0: none).
fn start_params(name: &str, disk_mib: u64) -> anyhow::Result<StartParams> {
    from_json(serde_json::json!({ "name": name, "disk_size_mib": disk_mib }))
}

/// umbrad's default session disk size.
fn default_disk_mib() -> u64 {
    let config = serde_json::to_value(DaemonConfig::default()).unwrap_or_default();
    config["disk_size_mib"].as_u64().unwrap_or(8192)
}

/// A scratch directory, removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub async fn session(args: SessionBenchArgs) -> anyhow::Result<()> {
    let choice = args.backend;
    let image = crate::boot_image(&args.bundle)?;
    let (backend, why) = select::choose(choice, image.arch)?;
    // Sessions and umbrad resolve the bundle themselves: give them a packed bundle's absolute
    // path, so the private umbrad (with its own XDG dirs) finds the very same one.
    let bundle = match umbra_runtime::image::packed_dir(&args.bundle) {
        Some(dir) => dir.canonicalize()?.display().to_string(),
        None => args.bundle.clone(),
    };
    if args.spawns > 0 {
        umbrad_beside_vmctl()?; // before anything boots
    }
    let scratch = Scratch(std::env::temp_dir().join(format!("umbra-bench-session-{}", std::process::id())));
    std::fs::create_dir_all(&scratch.0)?;
    let spec = VmSpec::new(image.clone());
    let setup = Setup {
        backend,
        choice,
        image,
        root: scratch.0.clone(),
        memory_mib: spec.memory_mib,
        cpus: spec.cpus,
        boot_timeout: Duration::from_secs(args.boot_timeout.max(1)),
        disk_mib: args.disk_mib,
    };
    let accel = match (backend, KvmKind::detect()) {
        (BackendKind::Kvm, _) => "kvm",
        (BackendKind::Qemu, KvmKind::Hardware) if setup.image.arch == umbra_bundle::Arch::host() => "kvm",
        (BackendKind::Qemu, _) => "tcg",
        (BackendKind::Vz, _) => "hvf",
    };
    println!(
        "backend {} ({why}) · accel {accel} · bundle {} · {} MiB, {} cpu · disk {}",
        backend.name(),
        setup.image.version,
        setup.memory_mib,
        setup.cpus,
        if setup.disk_mib > 0 { format!("{} MiB", setup.disk_mib) } else { "none".into() }
    );
    let work = async {
        if args.runs > 0 {
            starts(&setup, &bundle, args.runs).await?;
        }
        if args.pool_runs > 0 {
            pool_starts(&setup, &bundle, args.pool_runs).await?;
        }
        if args.spawns > 0 {
            spawns(&setup, &bundle, args.spawns, args.warmup).await?;
        }
        anyhow::Ok(())
    };
    // On Ctrl-C the work is dropped: its VMs and umbrad are killed with their handles.
    let result = tokio::select! {
        r = work => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    drop(scratch);
    result
}

// ---- session start → first output ----------------------------------------------------------

/// What one start boots: a bare VM or a session, with folder sharing (for a session: its
/// storage — outputs and uploads shared, the outputs watcher) and a new disk or not.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Kind {
    session: bool,
    folders: bool,
    disk: bool,
}

impl Kind {
    fn label(self, disk_mib: u64) -> String {
        let what = match (self.session, self.folders, self.disk) {
            (false, false, _) => "bare VM (agent client)",
            (false, true, _) => "bare VM + folder sharing",
            (true, false, _) => "session, no storage (as vmctl run)",
            (true, true, false) => "session + folders (outputs, uploads)",
            (true, true, true) => "session + folders",
        };
        if self.disk {
            format!("{what} + new {disk_mib} MiB disk")
        } else {
            what.into()
        }
    }
}

/// One start: start → ready, start → first output, the part of ready that was `Vm::launch`
/// (the VM's own boot; for a session, its `VmInfo::boot_ms`), and the teardown after it.
#[derive(Clone, Copy)]
struct StartSample {
    ready: Duration,
    first: Duration,
    launch: Duration,
    teardown: Duration,
}

async fn starts(setup: &Setup, bundle: &str, runs: usize) -> anyhow::Result<()> {
    let plain = setup.manager(bundle, false)?;
    let stored = setup.manager(bundle, true)?;
    // Pairs: each kind of session beside the bare VM with the same devices.
    let mut kinds = Vec::new();
    for (folders, disk) in [(false, false), (true, false), (true, true)] {
        if disk && setup.disk_mib == 0 {
            continue;
        }
        kinds.push(Kind { session: false, folders, disk });
        kinds.push(Kind { session: true, folders, disk });
    }
    println!();
    println!("session start -> first output of `echo hi`: {runs} fresh starts of each, in turn (rotating)");
    let result = async {
        let mut samples: Vec<Vec<StartSample>> = vec![Vec::new(); kinds.len()];
        for run in 0..runs {
            // Each round starts with the next kind: none always follows the same one.
            for k in (0..kinds.len()).map(|k| (k + run) % kinds.len()) {
                let kind = kinds[k];
                let disk_mib = if kind.disk { setup.disk_mib } else { 0 };
                let sample = match (kind.session, kind.folders) {
                    (false, _) => bare_start(setup, kind, run).await?,
                    (true, false) => session_start(setup, &plain, &format!("{SESSION}-plain-{run}"), 0).await?,
                    (true, true) => {
                        let name = format!("{SESSION}-folders-{}-{run}", if kind.disk { "disk" } else { "nodisk" });
                        session_start(setup, &stored, &name, disk_mib).await?
                    }
                };
                samples[k].push(sample);
            }
        }
        print_starts(setup, &kinds, samples);
        anyhow::Ok(())
    }
    .await;
    plain.shutdown().await;
    stored.shutdown().await;
    result
}

/// A bare VM of `kind`: launch → agent ready → first output of `echo hi` through the agent
/// client. A disk is created (and formatted) within the timing, as a session's is.
async fn bare_start(setup: &Setup, kind: Kind, run: usize) -> anyhow::Result<StartSample> {
    let mut spec = setup.vm_spec();
    spec.folder_sharing = kind.folders;
    let disk = kind.disk.then(|| setup.root.join(format!("bare-start-{run}.img")));
    let t = Instant::now();
    if let Some(disk) = &disk {
        let (path, bytes) = (disk.clone(), setup.disk_mib << 20);
        tokio::task::spawn_blocking(move || umbra_runtime::backend::disk::ensure_session_disk(&path, bytes)).await??;
        spec.disk = Some(disk.clone());
    }
    let vm = Vm::launch(setup.backend, &spec).await.context("boot the bare VM")?;
    let ready = t.elapsed();
    let first = async {
        let mut p = vm.agent().spawn(SpawnRequest { argv: echo_hi(), ..Default::default() })?;
        let first = loop {
            match p.next_event().await {
                Some(ProcessEvent::Stdout(_)) => break t.elapsed(),
                Some(ProcessEvent::Spawned { .. } | ProcessEvent::Stderr(_)) => {}
                other => bail!("`echo hi` on the bare VM ended without output: {other:?}"),
            }
        };
        while let Some(ev) = p.next_event().await {
            if matches!(ev, ProcessEvent::Exit(_) | ProcessEvent::Error(_)) {
                break;
            }
        }
        anyhow::Ok(first)
    };
    let first = tokio::time::timeout(PROCESS_TIMEOUT, first).await.context("`echo hi` on the bare VM timed out");
    let launch = vm.boot_time;
    let t = Instant::now();
    vm.shutdown().await;
    if let Some(disk) = &disk {
        let _ = std::fs::remove_file(disk);
    }
    Ok(StartSample { ready, first: first??, launch, teardown: t.elapsed() })
}

/// A new session `name`: start → ready → first output of `echo hi`; then stop + delete.
async fn session_start(
    setup: &Setup,
    manager: &SessionManager,
    name: &str,
    disk_mib: u64,
) -> anyhow::Result<StartSample> {
    let params = start_params(name, disk_mib)?;
    let t = Instant::now();
    let measured = async {
        let session = manager.start(params).await.with_context(|| format!("start session {name}"))?;
        let ready = t.elapsed();
        let launch = Duration::from_millis(session.info().vm.map_or(0, |vm| vm.boot_ms));
        let mut exec = session.spawn(ExecRequest { argv: echo_hi(), ..Default::default() }).await?;
        let first = loop {
            match exec.next_event().await.map(|e| e.kind) {
                Some(EventKind::Stdout { .. }) => break t.elapsed(),
                Some(EventKind::Exit(exit)) => bail!("`echo hi` in session {name} exited without output: {exit:?}"),
                None => bail!("`echo hi` in session {name}: the event stream ended"),
                Some(_) => {}
            }
        };
        while let Some(ev) = exec.next_event().await {
            if matches!(ev.kind, EventKind::Exit(_)) {
                break;
            }
        }
        anyhow::Ok((ready, first, launch))
    };
    let measured = tokio::time::timeout(setup.boot_timeout * 2 + PROCESS_TIMEOUT, measured).await;
    let t = Instant::now();
    let deleted = manager.delete(name).await;
    let teardown = t.elapsed();
    let (ready, first, launch) = measured.with_context(|| format!("session {name} timed out"))??;
    deleted.with_context(|| format!("delete session {name}"))?;
    Ok(StartSample { ready, first, launch, teardown })
}

fn echo_hi() -> Vec<String> {
    vec!["echo".into(), "hi".into()]
}

fn print_starts(setup: &Setup, kinds: &[Kind], samples: Vec<Vec<StartSample>>) {
    let med = |s: &[StartSample], f: fn(&StartSample) -> Duration| ms(median(s.iter().map(f).collect()));
    let anchor = med(&samples[0], |s| s.ready);
    println!("{:<46} median {:>7.1} ms", "anchor: bare VM launch -> agent ready", anchor);
    println!(
        "{:<46} {:>7} {:>19} {:>7} {:>8} {:>8} {:>8} {:>6} {:>6}",
        "start -> first output (ms)", "median", "[min .. max]", "anchor", "vs bare", "ready", "launch", "other", "stop"
    );
    let mut bare_first = 0.0;
    for (kind, s) in kinds.iter().zip(&samples) {
        let first = med(s, |x| x.first);
        let lo = s.iter().map(|x| x.first).min().map_or(0.0, ms);
        let hi = s.iter().map(|x| x.first).max().map_or(0.0, ms);
        let vs_bare = if kind.session { format!("{:+.1}", first - bare_first) } else { String::new() };
        if !kind.session {
            bare_first = first;
        }
        println!(
            "{:<46} {first:>7.1} [{lo:>7.1} .. {hi:>7.1}] {:>6.2}x {vs_bare:>8} {:>8.1} {:>8.1} {:>6.1} {:>6.1}",
            kind.label(setup.disk_mib),
            first / anchor,
            med(s, |x| x.ready),
            med(s, |x| x.launch),
            med(s, |x| x.ready.saturating_sub(x.launch)),
            med(s, |x| x.teardown),
        );
    }
    println!(
        "(anchor: ratio to the anchor; vs bare: minus the bare VM row above it, with the same devices; ready: start \
         returned;\n launch: of which Vm::launch; other: ready - launch, the work around it (disk, folders, \
         records); stop: stop + delete,\n or the bare VM's shutdown)"
    );
}

// ---- the warm pool ------------------------------------------------------------------------

/// Session start → first output with a VM from the warm pool (`pool_size` 1, waited for until
/// ready before each start) beside the same start that boots, in turn; each with storage and
/// a disk as umbrad's sessions have.
async fn pool_starts(setup: &Setup, bundle: &str, runs: usize) -> anyhow::Result<()> {
    let mut config = setup.config(bundle)?;
    config.pool_size = 1;
    config.pool_memory_mib = u64::from(setup.memory_mib);
    let pooled = setup.manager_in(true, config, "-pool")?;
    let cold = setup.manager_in(true, setup.config(bundle)?, "-cold")?;
    println!();
    println!("session start -> first output of `echo hi`, warm pool vs boot: {runs} starts of each, in turn");
    let result = async {
        let (mut warm, mut boot) = (Vec::new(), Vec::new());
        for run in 0..runs {
            for from_pool in [run % 2 == 0, run % 2 != 0] {
                // Both kinds start beside a full, idle pool: the same load on the host.
                pool_ready(setup, &pooled).await?;
                let (manager, name) = match from_pool {
                    true => (&pooled, format!("{SESSION}-pool-{run}")),
                    false => (&cold, format!("{SESSION}-boot-{run}")),
                };
                let sample = session_start(setup, manager, &name, setup.disk_mib).await?;
                if from_pool {
                    warm.push(sample)
                } else {
                    boot.push(sample)
                };
            }
        }
        let taken = pooled.pool_status().taken;
        anyhow::ensure!(taken == runs as u64, "only {taken} of {runs} starts took a pooled VM");
        let first = |s: &[StartSample]| ms(median(s.iter().map(|x| x.first).collect()));
        let (w, b) = (first(&warm), first(&boot));
        println!("{:<46} median {b:>7.1} ms", "anchor: the same start, booting its VM");
        println!("{:<46} median {w:>7.1} ms   ratio {:.3} ({:.0}x faster)", "start with a pooled VM", w / b, b / w);
        anyhow::Ok(())
    }
    .await;
    pooled.shutdown().await;
    cold.shutdown().await;
    result
}

/// Waits until the pool of `manager` has a ready VM.
async fn pool_ready(setup: &Setup, manager: &SessionManager) -> anyhow::Result<()> {
    let deadline = Instant::now() + setup.boot_timeout * 2;
    loop {
        let status = manager.pool_status();
        if status.ready >= 1 {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the warm pool did not fill within {:?}: {status:?}", setup.boot_timeout * 2);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ---- spawn round-trip ----------------------------------------------------------------------

/// p-th percentile (nearest rank) of `v`; `v` must not be empty.
fn percentile(mut v: Vec<Duration>, p: f64) -> Duration {
    v.sort();
    let rank = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

async fn spawns(setup: &Setup, bundle: &str, spawns: usize, warmup: usize) -> anyhow::Result<()> {
    let umbrad = umbrad_beside_vmctl()?;
    println!();
    println!("spawn round-trip: spawn `true` -> exit, {spawns} runs after {warmup} warm-up, the three ways in turn");
    let manager = setup.manager(bundle, true)?;
    let mut daemon: Option<Daemon> = None;
    let result = async {
        // (a) a bare VM like the sessions': folder sharing on, a session disk if they have one.
        let mut spec = setup.vm_spec();
        spec.folder_sharing = true;
        if setup.disk_mib > 0 {
            let disk = setup.root.join("bare-disk.img");
            let bytes = setup.disk_mib << 20;
            let path = disk.clone();
            tokio::task::spawn_blocking(move || umbra_runtime::backend::disk::ensure_session_disk(&path, bytes))
                .await??;
            spec.disk = Some(disk);
        }
        let vm = Vm::launch(setup.backend, &spec).await.context("boot the bare VM")?;
        // (b) a session through the runtime.
        let session = manager.start(start_params(SESSION, setup.disk_mib)?).await.context("start session")?;
        // (c) a session through a private umbrad.
        let d = daemon.insert(Daemon::start(setup, &umbrad, bundle).await?);
        let (client, mut notes) = Client::connect(Some(&d.socket)).await?;
        let started = client.call::<SessionStart>(start_params(SESSION, setup.disk_mib)?).await;
        if let Err(e) = started {
            bail!("umbrad could not start a session: {e}\numbrad's log:\n{}", d.log_tail(30));
        }
        let umbrad_pid = d.process.pid();
        let (mut a, mut b, mut c) = (Samples::default(), Samples::default(), Samples::default());
        for i in 0..warmup + spawns {
            let keep = i >= warmup;
            let cpu = own_cpu();
            let wall = bare_spawn(&vm).await?;
            a.push(keep, wall, own_cpu() - cpu, None);
            let cpu = own_cpu();
            let wall = session_spawn(&session).await?;
            b.push(keep, wall, own_cpu() - cpu, None);
            let cpu = (own_cpu(), process_cpu(umbrad_pid));
            let wall = daemon_spawn(&client, &mut notes).await?;
            c.push(keep, wall, own_cpu() - cpu.0, Some(process_cpu(umbrad_pid).saturating_sub(cpu.1)));
        }
        let deleted = client.call::<SessionDelete>(SessionRef { name: SESSION.into() }).await;
        deleted.context("delete umbrad's session")?;
        vm.shutdown().await;
        print_spawns(a, b, c);
        anyhow::Ok(())
    }
    .await;
    manager.shutdown().await;
    if let Some(d) = daemon {
        d.stop().await;
    }
    result
}

async fn bare_spawn(vm: &Vm) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let p = vm.agent().spawn(SpawnRequest { argv: vec!["true".into()], ..Default::default() })?;
    let out = tokio::time::timeout(PROCESS_TIMEOUT, p.output()).await.context("`true` on the bare VM timed out")??;
    let took = t.elapsed();
    if out.status.code != Some(0) {
        bail!("`true` on the bare VM ended with {:?}", out.status);
    }
    Ok(took)
}

async fn session_spawn(session: &Arc<Session>) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let exec = session.spawn(ExecRequest { argv: vec!["true".into()], ..Default::default() }).await?;
    let out = tokio::time::timeout(PROCESS_TIMEOUT, exec.output()).await.context("`true` in the session timed out")?;
    let took = t.elapsed();
    if out.exit.code != Some(0) {
        bail!("`true` in the session ended with {:?}", out.exit);
    }
    Ok(took)
}

/// `process.spawn` of `true` and its exit notification; output (none is expected) is
/// acknowledged as a client must.
async fn daemon_spawn(client: &Client, notes: &mut Notifications) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let params = SpawnParams { session: SESSION.into(), argv: vec!["true".into()], ..Default::default() };
    let spawned = client.call::<ProcessSpawn>(params).await.context("process.spawn")?;
    let deadline = tokio::time::Instant::now() + PROCESS_TIMEOUT;
    loop {
        let note = tokio::time::timeout_at(deadline, notes.recv())
            .await
            .context("umbrad sent no exit for `true`")?
            .context("umbrad closed the connection")?;
        if note.method != NOTIFY_PROCESS {
            continue;
        }
        let event: SessionEvent = serde_json::from_value(note.params).context("a process.event umbrad sent")?;
        let (stream, data) = match event.kind {
            EventKind::Exit(exit) if exit.process == spawned.process => {
                let took = t.elapsed();
                if exit.code != Some(0) {
                    bail!("`true` through umbrad ended with {exit:?}");
                }
                return Ok(took);
            }
            EventKind::Stdout { process, data, .. } if process == spawned.process => (Stream::Stdout, data),
            EventKind::Stderr { process, data, .. } if process == spawned.process => (Stream::Stderr, data),
            _ => continue,
        };
        let ack =
            AckParams { session: SESSION.into(), process: spawned.process, stream, bytes: data.byte_len() as u64 };
        client.notify::<ProcessAck>(ack).await?;
    }
}

/// Round-trips of one way: wall time, and the host CPU time Umbra's own processes spent on
/// each (vmctl; vmctl and umbrad for the daemon) — what the layers cost apart from the guest.
#[derive(Default)]
struct Samples {
    wall: Vec<Duration>,
    /// vmctl's CPU time, plus umbrad's.
    cpu: Vec<Duration>,
    /// umbrad's part of it (empty for the ways without it).
    umbrad: Vec<Duration>,
}

impl Samples {
    fn push(&mut self, keep: bool, wall: Duration, vmctl: Duration, umbrad: Option<Duration>) {
        if keep {
            self.wall.push(wall);
            self.cpu.push(vmctl + umbrad.unwrap_or_default());
            self.umbrad.extend(umbrad);
        }
    }
}

/// CPU time (user + system) of every thread of this process so far.
fn own_cpu() -> Duration {
    // SAFETY: an all-zero rusage is a valid value (plain integers and timevals).
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes one `struct rusage` through a pointer valid for the call.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// CPU time of every thread of process `pid` so far, in nanoseconds from
/// `/proc/PID/task/*/schedstat` (zero where it cannot be read).
fn process_cpu(pid: u32) -> Duration {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten();
    let ns: u64 = tasks
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    Duration::from_nanos(ns)
}

fn print_spawns(a: Samples, b: Samples, c: Samples) {
    println!("{:<44} {:>9} {:>9}   {:>s$}", "wall time (ms)", "median", "p90", "host CPU per round-trip (ms)", s = 30);
    let mut medians = Vec::new();
    for (label, who, v) in [
        ("(a) agent client, bare VM (the floor)", "vmctl", a),
        ("(b) Session::spawn, runtime session layer", "vmctl", b),
        ("(c) umbrad over its socket (process.spawn)", "vmctl + umbrad", c),
    ] {
        let (m, p90, cpu) = (median(v.wall.clone()), percentile(v.wall, 0.9), median(v.cpu));
        let part = if v.umbrad.is_empty() { String::new() } else { format!(", umbrad's {:.3}", ms(median(v.umbrad))) };
        println!("{label:<44} {:>9.2} {:>9.2}   median {:>6.3} ({who}{part})", ms(m), ms(p90), ms(cpu));
        medians.push((m.as_secs_f64(), cpu.as_secs_f64()));
    }
    let ratios = |f: fn(&(f64, f64)) -> f64| {
        let (a, b, c) = (f(&medians[0]), f(&medians[1]), f(&medians[2]));
        format!("b/a {:.2}x   c/b {:.2}x   c/a {:.2}x", b / a, c / b, c / a)
    };
    println!("{:<44} {}", "ratios of the wall-time medians", ratios(|m| m.0));
    println!("{:<44} {}", "ratios of the host-CPU medians", ratios(|m| m.1));
}

// ---- the private umbrad --------------------------------------------------------------------

/// The umbrad in the directory of the running vmctl: the one built with it (same profile).
fn umbrad_beside_vmctl() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("find vmctl's own path")?;
    let umbrad = exe.with_file_name("umbrad");
    if !umbrad.is_file() {
        bail!(
            "umbrad not found next to {} (build it: cargo build -p umbrad, with --release for a release vmctl)",
            exe.display()
        );
    }
    Ok(umbrad)
}

/// umbrad in its own XDG directories under the scratch directory. Dropping it kills it (and,
/// through their parent-death signal, its VMs' helpers); [`Daemon::stop`] lets it stop its
/// sessions first.
struct Daemon {
    process: Supervised,
    socket: PathBuf,
    log: PathBuf,
}

impl Daemon {
    async fn start(setup: &Setup, binary: &Path, bundle: &str) -> anyhow::Result<Self> {
        let dir = setup.root.join("umbrad");
        let config_dir = dir.join("config/umbra");
        std::fs::create_dir_all(&config_dir)?;
        let config = setup.config(bundle)?;
        std::fs::write(config_dir.join("umbrad.json"), serde_json::to_vec_pretty(&config)?)?;
        if umbra_runtime::image::packed_dir(bundle).is_none() {
            // An installed version: let the private umbrad see this user's bundle store.
            let store = dir.join("data/umbra/bundles");
            std::fs::create_dir_all(store.parent().expect("has a parent"))?;
            std::os::unix::fs::symlink(umbra_bundle::Store::default_root(), &store)?;
        }
        let log = dir.join("umbrad.log");
        let socket = dir.join("run/umbra/umbrad.sock");
        let mut cmd = Command::new(binary);
        cmd.env("XDG_RUNTIME_DIR", dir.join("run"))
            .env("XDG_STATE_HOME", dir.join("state"))
            .env("XDG_DATA_HOME", dir.join("data"))
            .env("XDG_CONFIG_HOME", dir.join("config"))
            .env_remove("UMBRA_DATA_DIR")
            .env_remove("UMBRA_SOCKET")
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?);
        let process = Supervised::spawn("umbrad", cmd).with_context(|| format!("start {}", binary.display()))?;
        let mut daemon = Self { process, socket, log };
        let deadline = Instant::now() + DAEMON_START;
        while std::os::unix::net::UnixStream::connect(&daemon.socket).is_err() {
            if let Some(status) = daemon.process.try_exited() {
                bail!("umbrad exited ({status}) before serving; its log:\n{}", daemon.log_tail(30));
            }
            if Instant::now() > deadline {
                bail!("umbrad did not serve {} within {DAEMON_START:?}", daemon.socket.display());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(daemon)
    }

    fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// SIGTERM (umbrad stops its sessions), then SIGKILL if it takes too long.
    async fn stop(mut self) {
        // SAFETY: plain kill(2) on our own unreaped child.
        unsafe { libc::kill(self.process.pid() as i32, libc::SIGTERM) };
        if self.process.wait_timeout(DAEMON_STOP).await.is_none() {
            eprintln!("vmctl: umbrad did not stop within {DAEMON_STOP:?} of SIGTERM; killing it");
        }
        self.process.kill();
    }
}
