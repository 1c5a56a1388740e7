//! `vmctl bench density`: how many idle sessions one host holds. `--sessions` sessions of
//! `--memory` MiB are started at once (through the admission queue, as umbrad would start
//! them), each answers `echo`, and once they have sat idle for `--settle` seconds the host
//! memory each VM holds is read (`VmInfo::host_memory_kib`: the PSS of its VMM and helpers,
//! guest memory free page reporting gave back not counted). Printed: started / ready /
//! answered, the wall time until every one answered, host memory per idle session (median and
//! largest) beside the guest size it was given (the anchor), and the drop of the host's
//! `MemAvailable` per session as a second view that also counts the kernel's own costs.
//! Everything is stopped and deleted at the end, also on an error.

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use umbra_api::methods::StartParams;
use umbra_api::{BackendChoice, DaemonConfig};
use umbra_runtime::session::{ExecRequest, ManagerOptions, SessionManager};

#[derive(Args, Debug)]
pub struct DensityBenchArgs {
    /// Sessions to hold at once.
    #[arg(long, default_value_t = 100)]
    sessions: usize,
    /// Guest memory of each, in MiB.
    #[arg(long = "memory", default_value_t = 128)]
    memory_mib: u32,
    #[arg(long, default_value = "minimal")]
    bundle: String,
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendChoice,
    /// Seconds the sessions sit idle before their memory is read.
    #[arg(long, default_value_t = 15)]
    settle: u64,
    /// Seconds a boot may take once it has its slot (many at once under emulation need more).
    #[arg(long, default_value_t = 600, env = "UMBRA_BOOT_TIMEOUT_SECS")]
    boot_timeout: u64,
}

/// How long the whole start (queue included) and one `echo` may take.
const START_LIMIT: Duration = Duration::from_secs(1800);
const ECHO_LIMIT: Duration = Duration::from_secs(120);

pub async fn density(args: DensityBenchArgs) -> anyhow::Result<()> {
    let bundle = match umbra_runtime::image::packed_dir(&args.bundle) {
        Some(dir) => dir.canonicalize()?.display().to_string(),
        None => args.bundle.clone(),
    };
    let config: DaemonConfig = serde_json::from_value(serde_json::json!({
        "memory_mib": args.memory_mib,
        "cpus": 1,
        "idle_timeout_secs": 0,
        "disk_size_mib": 0,
        "boot_timeout_secs": args.boot_timeout.max(1),
        "bundle": bundle,
        "backend": args.backend,
    }))
    .context("build the configuration")?;
    let bundles = umbra_bundle::Store::new(umbra_bundle::Store::default_root());
    let m = SessionManager::new(ManagerOptions { config, state_dir: None, storage_root: None, bundles });
    let names: Vec<String> = (0..args.sessions).map(|i| format!("density-{i}")).collect();
    println!(
        "{} sessions of {} MiB, bundle {}, backend {:?}; {} cores, {} MiB available before",
        args.sessions,
        args.memory_mib,
        args.bundle,
        args.backend,
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        mem_available_mib()
    );
    let available_before = mem_available_mib();
    let outcome = hold(&m, &names, &args).await;
    let available_held = mem_available_mib();
    for name in &names {
        let _ = m.delete(name).await;
    }
    let (started, answered, wall, memory) = outcome?;
    println!(
        "started (ready) {started}/{n} · answered {answered}/{n} · all answered {:.1} s after the first start",
        wall.as_secs_f64(),
        n = args.sessions
    );
    if memory.is_empty() {
        anyhow::bail!("no session reported its host memory");
    }
    let mut mib: Vec<u64> = memory.iter().map(|kib| kib / 1024).collect();
    mib.sort();
    let median = mib[mib.len() / 2];
    let total: u64 = mib.iter().sum();
    println!(
        "host memory per idle session: median {median} MiB, largest {} MiB, all {total} MiB · guest memory {} MiB each (ratio {:.2})",
        mib[mib.len() - 1],
        args.memory_mib,
        median as f64 / f64::from(args.memory_mib)
    );
    let drop = available_before.saturating_sub(available_held);
    // Page cache comes and goes with whatever else runs: a rough view, 0 when it grew.
    println!(
        "MemAvailable fell by {drop} MiB with them held: {:.0} MiB per session",
        drop as f64 / started.max(1) as f64
    );
    if started < args.sessions || answered < args.sessions {
        anyhow::bail!(
            "{} of {} sessions did not start or answer",
            args.sessions - answered.min(started),
            args.sessions
        );
    }
    Ok(())
}

/// Starts every session at once, runs `echo` in each, lets them settle and reads their host
/// memory: (started, answered, first start → last answer, host memory in KiB of each).
async fn hold(
    m: &SessionManager,
    names: &[String],
    args: &DensityBenchArgs,
) -> anyhow::Result<(usize, usize, Duration, Vec<u64>)> {
    let began = Instant::now();
    let runs = names.iter().map(|name| async move {
        let params = StartParams { name: name.clone(), ..Default::default() };
        let s = match tokio::time::timeout(START_LIMIT, m.start(params)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                eprintln!("{name}: start failed: {e}");
                return (false, false);
            }
            Err(_) => {
                eprintln!("{name}: not started within {START_LIMIT:?}");
                return (false, false);
            }
        };
        let echo = ExecRequest { argv: vec!["echo".into(), "hi".into()], ..Default::default() };
        let answered = match tokio::time::timeout(ECHO_LIMIT, async { s.spawn(echo).await.map(|p| p.output()) }).await {
            Ok(Ok(output)) => output.await.stdout == b"hi\n",
            _ => false,
        };
        if !answered {
            eprintln!("{name}: no answer to echo");
        }
        (true, answered)
    });
    let results = futures_util::future::join_all(runs).await;
    let wall = began.elapsed();
    let started = results.iter().filter(|(s, _)| *s).count();
    let answered = results.iter().filter(|(_, a)| *a).count();
    tokio::time::sleep(Duration::from_secs(args.settle)).await;
    let memory = names
        .iter()
        .filter_map(|name| m.get(name).ok())
        .filter_map(|s| s.info().vm.and_then(|vm| vm.host_memory_kib))
        .collect();
    Ok((started, answered, wall, memory))
}

/// The host's `MemAvailable`, in MiB.
fn mem_available_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib / 1024)
}
