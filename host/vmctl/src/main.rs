//! vmctl: the operator's command line.

mod bundle_build;
mod doctor;
mod paths;
mod run;
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
    Run(run::RunArgs),
    /// Explain which backend this host can use and what is missing.
    Doctor(doctor::DoctorArgs),
    /// Guest bundles.
    Bundle {
        #[command(subcommand)]
        command: BundleCommand,
    },
}

#[derive(Subcommand)]
enum BundleCommand {
    /// Build a bundle (kernel + image) from this source tree.
    Build(bundle_build::BuildArgs),
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Bundle { command: BundleCommand::Build(args) } => match bundle_build::run(args) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("vmctl: error: {e:#}");
                1
            }
        },
        Command::Doctor(args) => doctor::run(args),
        // One thread: the VM's helper processes die with the thread that spawned them
        // (PR_SET_PDEATHSIG), so that thread must live as long as vmctl does.
        Command::Run(args) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map(|rt| rt.block_on(run::run(args)))
            .unwrap_or_else(|e| {
                eprintln!("vmctl: error: cannot start the async runtime: {e}");
                run::EXIT_UMBRA_ERROR
            }),
    };
    std::process::exit(code);
}
