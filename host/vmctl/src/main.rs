//! vmctl: the operator's command line.

mod bundle_build;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(version, about = "Umbra microVM sandboxes: build bundles, run commands, diagnose the host")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
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
    let result = match cli.command {
        Command::Bundle { command: BundleCommand::Build(args) } => bundle_build::run(args),
    };
    if let Err(e) = result {
        eprintln!("vmctl: error: {e:#}");
        std::process::exit(1);
    }
}
