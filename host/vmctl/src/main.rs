//! vmctl: the operator's command line.

mod attach;
mod bundle_build;
mod bundle_pull;
mod bundle_sign;
mod bundle_store;
mod doctor;
mod image;
mod lint;
mod mcp;
mod network;
mod paths;
mod policy;
mod run;
mod session;
mod tty;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(version, about = "Umbra microVM sandboxes: build bundles, run commands, diagnose the host")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Boot a sandbox, run one command in it, and exit with its status.
    Run(Box<run::RunArgs>),
    /// Sessions through umbrad: start, exec, ls, stop, resume, rm, logs.
    Session {
        #[command(subcommand)]
        command: session::SessionCommand,
    },
    /// Explain which backend this host can use and what is missing.
    Doctor(doctor::DoctorArgs),
    /// Benchmarks with an anchor measured in the same run.
    Bench {
        #[command(subcommand)]
        command: BenchCommand,
    },
    /// Serve sessions to an MCP client (an agent) on stdin and stdout, through umbrad.
    Mcp(mcp::McpArgs),
    /// OCI images as guest bundles: pull from a registry, import an archive, list.
    Image {
        #[command(subcommand)]
        command: image::ImageCommand,
    },
    /// Guest bundles.
    Bundle {
        #[command(subcommand)]
        command: BundleCommand,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Launch -> agent ready per backend, beside QEMU's own launch -> /init.
    Boot(umbra_bench::boot::BootBenchArgs),
    /// Bundle install throughput from a local server, beside `curl | zstd -dc | openssl sha256`.
    Bundle(umbra_bench::bundle::BundleBenchArgs),
    /// A shared folder from inside the guest beside the same work natively on the host.
    Fs(umbra_bench::fs::FsBenchArgs),
    /// The Umbra VMM: bare-guest launch -> exit and RSS; Linux boot beside QEMU on hardware KVM.
    #[cfg(target_os = "linux")]
    Vmm(umbra_bench::vmm::VmmBenchArgs),
    /// Session start -> first output beside a bare VM boot; spawn round-trips: agent, runtime,
    /// umbrad.
    Session(umbra_bench::session::SessionBenchArgs),
    /// Idle sessions one host holds: N started at once, each answering, and the host memory
    /// each holds idle beside its guest size.
    Density(umbra_bench::density::DensityBenchArgs),
    /// Network egress: a download, connection set-up and 1,000 held connections from a guest,
    /// beside the same client on the host.
    Net(umbra_bench::net::NetBenchArgs),
    /// A guest server through an exposed port beside the same server on the host: connection
    /// set-up and throughput.
    Ports(umbra_bench::ports::PortsBenchArgs),
    /// `diagnostics.for_change` for a one-line change in a 1,000-module Python project, beside
    /// pyflakes run on the changed file directly in the same guest.
    Lint(umbra_bench::lint::LintBenchArgs),
    /// An OCI image pulled from a registry on 127.0.0.1 and converted, beside `skopeo copy` +
    /// `umoci unpack` + `mkfs.erofs`; a second pull; a session start beside a bundle's.
    Image(umbra_bench::image::ImageBenchArgs),
}

#[derive(Subcommand)]
enum BundleCommand {
    /// Build a bundle (kernel + image) from this source tree.
    Build(bundle_build::BuildArgs),
    /// Download, verify and install a bundle by URL, and make it current.
    Pull(bundle_pull::PullArgs),
    /// Installed bundles (* marks current) and the warm slot.
    Ls(bundle_store::LsArgs),
    /// Check a bundle's signature against the trusted keys; for an installed one, also re-hash
    /// its artifacts and name any that changed.
    Verify(bundle_store::VerifyArgs),
    /// Make a signing key pair (ed25519) for bundles.
    Keygen(bundle_sign::KeygenArgs),
    /// Sign a bundle directory's manifest (its artifact digests and boot command line).
    Sign(bundle_sign::SignArgs),
    /// Remove an installed version.
    Rm(bundle_store::RmArgs),
    /// Keep the N newest versions and current; remove the rest and leftovers.
    Gc(bundle_store::GcArgs),
    /// Install a local bundle directory (or a built flavor) into the store.
    Import(bundle_pull::ImportArgs),
}

fn main() {
    let cli = Cli::parse();
    umbra_sys::raise_nofile_limit();
    let code = match cli.command {
        Command::Image { command: image::ImageCommand::Pull(args) } => async_main(image::pull(args)),
        Command::Image { command: image::ImageCommand::Import(args) } => async_main(image::import(args)),
        Command::Image { command: image::ImageCommand::Ls(args) } => image::ls(args),
        Command::Bundle { command: BundleCommand::Build(args) } => exit_code(bundle_build::run(args)),
        Command::Bundle { command: BundleCommand::Pull(args) } => bundle_pull::pull(args),
        Command::Bundle { command: BundleCommand::Import(args) } => bundle_pull::import(args),
        Command::Bundle { command: BundleCommand::Ls(args) } => bundle_store::ls(args),
        Command::Bundle { command: BundleCommand::Verify(args) } => bundle_store::verify(args),
        Command::Bundle { command: BundleCommand::Rm(args) } => bundle_store::rm(args),
        Command::Bundle { command: BundleCommand::Keygen(args) } => exit_code(bundle_sign::keygen(args)),
        Command::Bundle { command: BundleCommand::Sign(args) } => exit_code(bundle_sign::sign(args)),
        Command::Bundle { command: BundleCommand::Gc(args) } => bundle_store::gc(args),
        Command::Bench { command: BenchCommand::Bundle(args) } => exit_code(umbra_bench::bundle::bundle(args)),
        Command::Bench { command: BenchCommand::Image(args) } => exit_code(umbra_bench::image::image(args)),
        Command::Doctor(args) => doctor::run(args),
        Command::Bench { command: BenchCommand::Fs(args) } => {
            async_main(async move { exit_code(umbra_bench::fs::fs(args).await) })
        }
        #[cfg(target_os = "linux")]
        Command::Bench { command: BenchCommand::Vmm(args) } => {
            async_main(async move { exit_code(umbra_bench::vmm::vmm(args).await) })
        }
        Command::Bench { command: BenchCommand::Session(args) } => {
            async_main(async move { exit_code(umbra_bench::session::session(args).await) })
        }
        Command::Bench { command: BenchCommand::Density(args) } => {
            async_main(async move { exit_code(umbra_bench::density::density(args).await) })
        }
        Command::Bench { command: BenchCommand::Net(args) } => {
            async_main(async move { exit_code(umbra_bench::net::net(args).await) })
        }
        Command::Bench { command: BenchCommand::Ports(args) } => {
            async_main(async move { exit_code(umbra_bench::ports::ports(args).await) })
        }
        Command::Bench { command: BenchCommand::Lint(args) } => {
            async_main(async move { exit_code(umbra_bench::lint::lint(args).await) })
        }
        Command::Bench { command: BenchCommand::Boot(args) } => {
            async_main(async move { exit_code(umbra_bench::boot::boot(args).await) })
        }
        Command::Mcp(args) => async_main(async move { exit_code(mcp::serve(args).await) }),
        Command::Run(args) => async_main(run::run(*args)),
        Command::Session { command } => async_main(session::run(command)),
    };
    std::process::exit(code);
}

/// A command's result as vmctl's exit status: 0, or 1 with the error (and its causes) on stderr.
fn exit_code(result: anyhow::Result<()>) -> i32 {
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("vmctl: error: {e:#}");
            1
        }
    }
}

/// One thread: the VM's helper processes die with the thread that spawned them
/// (PR_SET_PDEATHSIG), so that thread must live as long as vmctl does.
fn async_main(f: impl std::future::Future<Output = i32>) -> i32 {
    match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => {
            let code = rt.block_on(f);
            // Never wait for blocking-pool threads on the way out.
            rt.shutdown_background();
            code
        }
        Err(e) => {
            eprintln!("vmctl: error: cannot start the async runtime: {e}");
            umbra_api::event::EXIT_UMBRA_ERROR
        }
    }
}
