//! umbra-agent: PID 1 of every Umbra guest and the server of the host↔guest protocol.
//!
//! In a guest it mounts the basics, reaps every orphan, and serves the protocol on vsock port
//! 1024. On the host (`--listen unix:PATH`) the same server runs as an ordinary process, which
//! is how the test suite drives it with real processes and no VM.

mod container;
mod fdio;
mod files;
mod forward;
mod identity;
mod net;
mod pid1;
mod process;
mod reaper;
mod server;
mod shares;
mod system;
mod text;
mod trust;

use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use server::{Agent, ListenAddr};

#[derive(Parser, Debug)]
#[command(version, about = "Umbra guest agent (PID 1 and protocol server)")]
struct Args {
    /// Where to serve the protocol: vsock:PORT or unix:PATH.
    #[arg(long, default_value = "vsock:1024")]
    listen: ListenAddr,
    /// Hostname to set when running as PID 1.
    #[arg(long, default_value = "umbra")]
    hostname: String,
    /// Log filter (tracing-subscriber syntax). Logs go to stderr — the console in a guest,
    /// where every byte is slow, so the default is quiet.
    #[arg(long, env = "UMBRA_AGENT_LOG", default_value = "warn")]
    log: String,
    /// Host-side only (ignored as PID 1): the directory standing in for `/` for shares, so
    /// `/sessions/...` and `/umbra/...` become `DIR/sessions/...` and `DIR/umbra/...`.
    /// Without it a host-side agent refuses share requests.
    #[arg(long, value_name = "DIR")]
    root: Option<std::path::PathBuf>,
    /// Host-side only (ignored as PID 1): shared folders are already here, one subdirectory
    /// per share; no virtio-fs tag is mounted.
    #[arg(long, value_name = "DIR")]
    shares_dir: Option<std::path::PathBuf>,
    /// Host-side only (a guest always uses vsock): serve network egress, sending each
    /// connection to this endpoint (unix:PATH, or vsock / vsock:PORT for the host CID).
    /// Needs --net-ports.
    #[arg(long, value_name = "TARGET", requires = "net_ports")]
    egress: Option<net::EgressTarget>,
    /// Host-side only: the loopback ports of the HTTP proxy, SOCKS5 proxy, DNS server and
    /// transparent listener, all on 127.0.0.1 (0 = not started).
    #[arg(long, value_name = "HTTP,SOCKS,DNS,TRANSPARENT", requires = "egress")]
    net_ports: Option<net::NetPorts>,
    /// Host-side only: also program the current network namespace as in a guest (lo's fake
    /// range, the local default route, the nftables redirect). Needs CAP_NET_ADMIN; meant for
    /// a private namespace (`unshare -n`). /etc/resolv.conf is never written on the host.
    #[arg(long, requires = "egress")]
    net_kernel: bool,
    /// Where to accept the host's connections to exposed ports (vsock:PORT or unix:PATH). A
    /// guest always uses vsock:1027; a host-side agent serves them only when given.
    #[arg(long, value_name = "ADDR")]
    forward: Option<ListenAddr>,
}

fn main() {
    let pid1 = pid1::is_pid1();
    // `/proc/1/exe container-exec <json>`: a container's process being started (`container.rs`).
    if !pid1 && std::env::args().nth(1).as_deref() == Some(umbra_proto::container::CONTAINER_EXEC) {
        container::main(&std::env::args().skip(2).collect::<Vec<_>>());
    }
    // As PID 1 the kernel passes unknown `key=value` boot arguments as environment and
    // anything else as argv; only our own flags are meaningful, so ignore parse errors there.
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) if !pid1 => e.exit(),
        Err(_) => Args::parse_from(["umbra-agent"]),
    };
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&args.log).unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
    if pid1 {
        std::panic::set_hook(Box::new(|info| pid1::fatal(&format!("panic: {info}"))));
    }
    if let Err(e) = run(args, pid1) {
        if pid1 {
            pid1::fatal(&format!("{e:#}"));
        }
        eprintln!("umbra-agent: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: Args, pid1: bool) -> anyhow::Result<()> {
    if pid1 {
        pid1::init(&args.hostname)?;
        if let Err(e) = process::cgroup::create() {
            tracing::warn!("commands run without a cgroup (no pid or memory limit): {e}");
        }
        system::raise_fd_limit();
    } else {
        // Orphans of our children are reparented to us, as they would be to PID 1 in a guest.
        // SAFETY: prctl with an integer argument has no memory effects.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    }
    // A host-side agent shares folders only below an explicit --root: mounting on the host's
    // own /sessions and /umbra would be a surprise.
    let layout = match (pid1, &args.root) {
        (true, _) => Some(shares::Layout::new(std::path::Path::new("/"), None)),
        (false, Some(root)) => Some(shares::Layout::new(root, args.shares_dir.as_deref())),
        (false, None) => None,
    }
    .transpose()
    .context("cannot prepare the share layout")?;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let net = match (pid1, &args.egress, args.net_ports) {
        (true, _, _) => Some(net::NetConfig::guest()),
        (false, Some(target), Some(ports)) => Some(net::NetConfig::host(target.clone(), ports, args.net_kernel)),
        _ => None,
    };
    runtime.block_on(async {
        // Before the host's connection is accepted, so spawned processes find the proxies. A
        // failure is logged (the console, in a guest) and the agent carries on without egress.
        if let Some(config) = net {
            if let Err(e) = net::start(config).await {
                tracing::error!("network egress is unavailable: {e:#}");
            }
        }
        let forward = match (pid1, &args.forward) {
            (true, _) => Some(ListenAddr::Vsock(umbra_proto::forward::FORWARD_VSOCK_PORT)),
            (false, addr) => addr.clone(),
        };
        if let Some(addr) = forward {
            tokio::spawn(async move {
                if let Err(e) = forward::serve(addr).await {
                    tracing::error!("exposed ports are unavailable: {e:#}");
                }
            });
        }
        let agent = Arc::new(Agent {
            reaper: reaper::Reaper::start()?,
            started: Instant::now(),
            pid1,
            live_processes: AtomicU32::new(0),
            shutdown: tokio::sync::Notify::new(),
            shares: shares::Shares::new(layout),
            parked: Default::default(),
            exec_checks: Default::default(),
        });
        tokio::select! {
            r = server::serve(agent.clone(), &args.listen) => r,
            _ = agent.shutdown.notified() => {
                // Let the shutdown response reach the host first.
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                if pid1 {
                    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(-1), nix::sys::signal::SIGKILL);
                    pid1::power_off();
                }
                // A host-side agent exits, but its processes must not outlive it (in a guest
                // the power-off takes care of that).
                agent.reaper.kill_all(nix::sys::signal::SIGKILL);
                Ok(())
            }
        }
    })
}
