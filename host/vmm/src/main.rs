//! `umbra-vmm`: runs one microVM and exits with a status that says how it ended (see
//! [`umbra_vmm::exit`]): 0 guest shutdown, 1 VMM error (message on stderr), 2 guest panic,
//! 3 triple fault, 4 halted, 5 KVM internal error, 6 a snapshot was taken (the VM stopped).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Parser;
use umbra_vmm::config::{DiskConfig, FsConfig, JailConfig, VmConfig, VsockConfig, NOBODY};
use umbra_vmm::exit::VMM_ERROR_STATUS;
use umbra_vmm::jail::{self, Side};
use umbra_vmm::machine::HostFiles;
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
    /// Add a virtio-balloon taking the guest's free page reports (the pages go back to the host).
    #[arg(long)]
    balloon: bool,
    /// Seccomp filters, one per thread kind: `kill` (a syscall a filter does not list kills
    /// the VMM), `log` (allowed and logged to the kernel's audit log: for finding what a filter
    /// lacks), or `off`.
    #[arg(long, value_enum, default_value_t = SeccompArg::Kill, env = "UMBRA_VMM_SECCOMP")]
    seccomp: SeccompArg,
    /// Run jailed with this directory as the root (it must hold the vsock socket): new
    /// namespaces, no other files, an unprivileged uid (see umbra_vmm::jail).
    #[arg(long, value_name = "DIR")]
    jail: Option<PathBuf>,
    /// A Unix socket for requests while the guest runs (a snapshot; see umbra_vmm::control).
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
    /// Resume the snapshot in DIR (its `state` and `memory` files) instead of booting; the
    /// other settings must describe the same machine (memory, vCPUs, devices in order).
    #[arg(long, value_name = "DIR")]
    restore: Option<PathBuf>,
    /// With --restore: let the guest fault each page of the memory file in as it touches it
    /// (`none`, as Firecracker does), or map all its data in before the guest runs (`data`).
    /// `none` reached the agent ~45 ms sooner in the nested lane (docs/benchmarks.md).
    #[arg(long, value_enum, default_value_t = PrefaultArg::None, requires = "restore")]
    prefault: PrefaultArg,
    /// The uid and gid a jailed VMM started as root runs as (default 65534, nobody).
    #[arg(long, requires = "jail")]
    jail_uid: Option<u32>,
    #[arg(long, requires = "jail")]
    jail_gid: Option<u32>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum PrefaultArg {
    Data,
    None,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum SeccompArg {
    Kill,
    Log,
    Off,
}

fn config(args: Args) -> Result<VmConfig, String> {
    let mut cfg = match &args.config {
        Some(path) => umbra_vmm::config::from_file(path).map_err(|e| e.to_string())?,
        None => {
            let kernel = args.kernel.clone().ok_or("either --config or --kernel is required")?;
            VmConfig::new(kernel)
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
    if args.balloon {
        cfg.balloon = true;
    }
    if args.control.is_some() {
        cfg.control = args.control;
    }
    if let Some(dir) = args.jail {
        cfg.jail = Some(JailConfig { dir, uid: NOBODY, gid: NOBODY });
    }
    if let Some(jail) = &mut cfg.jail {
        jail.uid = args.jail_uid.unwrap_or(jail.uid);
        jail.gid = args.jail_gid.unwrap_or(jail.gid);
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

/// Opens every host file the VM uses, enters the jail if asked (only the jailed child returns
/// from here; the parent relays its exit), drops privileges, enables the filters, and
/// assembles the machine. Everything up to the jail runs on the only thread.
fn open_jail_and_build(
    cfg: &VmConfig,
    seccomp: SeccompArg,
    restore: Option<(&Path, PrefaultArg)>,
) -> Result<Machine, String> {
    let mut files = HostFiles::open(cfg).map_err(|e| e.to_string())?;
    if let Some((dir, prefault)) = restore {
        files = files.with_snapshot(dir, prefault == PrefaultArg::Data).map_err(|e| e.to_string())?;
    }
    let mut confinement = None;
    if let Some(jail) = &cfg.jail {
        files.rebase(&jail.dir).map_err(|e| e.to_string())?;
        match jail::enter(jail)? {
            Side::Parent(child) => {
                drop(files);
                jail::relay(child, jail)
            }
            Side::Child(c) => confinement = Some(c),
        }
    }
    // Before any thread starts, so every thread inherits both.
    confine(seccomp)?;
    if let Some(c) = confinement {
        eprintln!("umbra-vmm: {c}");
    }
    match restore {
        Some(_) => Machine::restore(cfg, files),
        None => Machine::assemble(cfg, files),
    }
    .map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let launched = std::time::Instant::now();
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
    let (restore, prefault) = (args.restore.clone(), args.prefault);
    let cfg = match config(args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("umbra-vmm: {e}");
            return ExitCode::from(VMM_ERROR_STATUS as u8);
        }
    };
    let machine = match open_jail_and_build(&cfg, seccomp, restore.as_deref().map(|dir| (dir, prefault))) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("umbra-vmm: {e}");
            return ExitCode::from(VMM_ERROR_STATUS as u8);
        }
    };
    let machine = machine.launched_at(launched);
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
        if !matches!(exit, VmExit::Halted | VmExit::Snapshotted) {
            eprintln!("umbra-vmm: last console lines:");
            for line in console.last_lines().iter().rev().take(20).rev() {
                eprintln!("  {line}");
            }
        }
    }
    // Exit without unwinding: vCPU threads are still inside KVM_RUN.
    std::process::exit(exit.status())
}
