//! `umbra-vmm`: runs one microVM and exits with a status that says how it ended (see
//! [`umbra_vmm::exit`]): 0 guest shutdown, 1 VMM error (message on stderr), 2 guest panic,
//! 3 triple fault, 4 halted, 5 KVM internal error.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use umbra_vmm::config::{DiskConfig, FsConfig, VmConfig, VsockConfig};
use umbra_vmm::exit::VMM_ERROR_STATUS;
use umbra_vmm::machine::Machine;
use umbra_vmm::VmExit;

#[derive(Parser, Debug)]
#[command(name = "umbra-vmm", version, about = "Run one Umbra microVM on KVM")]
struct Args {
    /// VM description as JSON; flags given as well override its fields.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Kernel: ELF vmlinux (PVH or 64-bit entry) or bzImage.
    #[arg(long)]
    kernel: Option<PathBuf>,
    #[arg(long)]
    initrd: Option<PathBuf>,
    #[arg(long)]
    cmdline: Option<String>,
    #[arg(long)]
    cpus: Option<u8>,
    /// Guest memory in MiB.
    #[arg(long)]
    memory: Option<u32>,
    /// A disk image: PATH or PATH,ro (repeatable).
    #[arg(long = "disk")]
    disks: Vec<String>,
    /// Hybrid vsock Unix socket path (with --guest-cid, default 3).
    #[arg(long)]
    vsock_uds: Option<PathBuf>,
    #[arg(long, default_value_t = 3)]
    guest_cid: u64,
    /// A shared folder: TAG=SOCKET, the guest's mount tag and virtiofsd's vhost-user socket
    /// (repeatable).
    #[arg(long = "fs", value_name = "TAG=SOCKET")]
    fs: Vec<String>,
    /// Serial console log file (default: standard output).
    #[arg(long)]
    console_log: Option<PathBuf>,
    /// Leave out the virtio-rng device.
    #[arg(long)]
    no_rng: bool,
    /// Seccomp filters, one per thread kind: `kill` (a syscall a filter does not list kills
    /// the VMM), `log` (allowed and logged to the kernel's audit log: for finding what a filter
    /// lacks), or `off`.
    #[arg(long, value_enum, default_value_t = SeccompArg::Kill, env = "UMBRA_VMM_SECCOMP")]
    seccomp: SeccompArg,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum SeccompArg {
    Kill,
    Log,
    Off,
}

fn config(args: Args) -> Result<VmConfig, String> {
    let mut cfg = match &args.config {
        Some(path) => VmConfig::from_file(path).map_err(|e| e.to_string())?,
        None => {
            let kernel = args.kernel.clone().ok_or("either --config or --kernel is required")?;
            serde_json::from_value(serde_json::json!({ "kernel": kernel })).map_err(|e| e.to_string())?
        }
    };
    if let Some(k) = args.kernel {
        cfg.kernel = k;
    }
    if args.initrd.is_some() {
        cfg.initrd = args.initrd;
    }
    if let Some(c) = args.cmdline {
        cfg.cmdline = c;
    }
    if let Some(c) = args.cpus {
        cfg.cpus = c;
    }
    if let Some(m) = args.memory {
        cfg.memory_mib = m;
    }
    for d in args.disks {
        let (path, read_only) = match d.strip_suffix(",ro") {
            Some(p) => (p, true),
            None => (d.as_str(), false),
        };
        cfg.disks.push(DiskConfig { path: path.into(), read_only });
    }
    if let Some(uds_path) = args.vsock_uds {
        cfg.vsock = Some(VsockConfig { guest_cid: args.guest_cid, uds_path });
    }
    for f in args.fs {
        let (tag, socket) = f.split_once('=').ok_or_else(|| format!("--fs {f:?}: expected TAG=SOCKET"))?;
        cfg.fs.push(FsConfig { tag: tag.to_string(), socket: socket.into() });
    }
    if args.console_log.is_some() {
        cfg.console_log = args.console_log;
    }
    if args.no_rng {
        cfg.rng = false;
    }
    Ok(cfg)
}

/// No privileges (no_new_privs, no capabilities), and the filters each thread installs as it
/// starts (`umbra_vmm::seccomp`).
fn confine(seccomp: SeccompArg) -> Result<(), String> {
    umbra_vmm::seccomp::drop_privileges()?;
    match seccomp {
        SeccompArg::Kill => umbra_vmm::seccomp::enable(umbra_vmm::seccomp::Mode::Kill),
        SeccompArg::Log => umbra_vmm::seccomp::enable(umbra_vmm::seccomp::Mode::Log),
        SeccompArg::Off => Ok(()),
    }
}

fn main() -> ExitCode {
    // The vsock device alone may hold ~1100 sockets (1024 connections, the listener, CONNECT
    // handshakes in flight).
    umbra_sys::raise_nofile_limit();
    // clap's own usage errors exit 2, which here means "guest panicked": map them to 1.
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) if !e.use_stderr() => {
            let _ = e.print(); // --help, --version
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(VMM_ERROR_STATUS as u8);
        }
    };
    let seccomp = args.seccomp;
    let cfg = match config(args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("umbra-vmm: {e}");
            return ExitCode::from(VMM_ERROR_STATUS as u8);
        }
    };
    // Before any thread starts, so every thread inherits both.
    if let Err(e) = confine(seccomp) {
        eprintln!("umbra-vmm: {e}");
        return ExitCode::from(VMM_ERROR_STATUS as u8);
    }
    let machine = match Machine::build(&cfg) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("umbra-vmm: {e}");
            return ExitCode::from(VMM_ERROR_STATUS as u8);
        }
    };
    let console = machine.console().clone();
    let exit = match machine.run() {
        Ok(exit) => exit,
        Err(e) => {
            eprintln!("umbra-vmm: {e}");
            return ExitCode::from(VMM_ERROR_STATUS as u8);
        }
    };
    if exit != VmExit::Reset {
        eprintln!("umbra-vmm: {}", exit.describe());
        if !matches!(exit, VmExit::Halted) {
            eprintln!("umbra-vmm: last console lines:");
            for line in console.last_lines().iter().rev().take(20).rev() {
                eprintln!("  {line}");
            }
        }
    }
    // Exit without unwinding: vCPU threads are still inside KVM_RUN.
    std::process::exit(exit.status())
}
