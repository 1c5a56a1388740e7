//! The QEMU backend: `qemu-system-x86_64 -M microvm` with memfd-shared guest memory (so
//! vhost-user daemons can map it), the PVH `vmlinux`, and `vhost-user-vsock-device` served by
//! a `vhost-device-vsock` we start and supervise. KVM acceleration when the host has hardware
//! KVM, TCG otherwise. This is also the headless test harness.
//!
//! An arm64 bundle runs on `qemu-system-aarch64 -M virt` instead: the same memfd memory and
//! virtio devices (on the machine's virtio-mmio transports, which the device tree describes),
//! the kernel's `Image`, a PL011 console; TCG unless the host is itself arm64 with KVM.

use std::os::fd::{OwnedFd, RawFd};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use umbra_bundle::Arch;

use super::children::{Jail, Supervised};
use super::fsd::FolderServer;
#[cfg(target_os = "linux")]
use super::helper_jail::HelperJail;
use super::host::KvmKind;
use super::launch::{log_file, start_folder_server, GuestProcess, Launch};
use super::rundir::{new_vm_id, RunDir};
use super::vm::{Backend, Vm};
use super::{io, BackendKind, Capabilities, VmError, VmSpec, BASE_CMDLINE, BASE_CMDLINE_AARCH64};

/// The `-sandbox` option every QEMU VM runs with (`vmctl doctor` reports it).
pub const QEMU_SANDBOX: &str = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny";

/// QEMU: every architecture (emulating those that are not the host's), every folder policy
/// (umbra-fsd enforces them), no snapshots.
pub struct QemuBackend;

#[async_trait]
impl Backend for QemuBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Qemu
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            snapshot: false,
            live_fork: false,
            folder_protection: true,
            guest_arches: &[Arch::X86_64, Arch::Aarch64],
            emulates: true,
        }
    }

    async fn launch(&self, spec: &VmSpec) -> Result<Vm, VmError> {
        launch(spec).await
    }
}

/// Each VM has its own vsock daemon, so every guest can use the same CID.
const GUEST_CID: u32 = 3;

/// The QEMU binary for a guest architecture.
fn qemu_program(arch: Arch) -> super::host::Program {
    match arch {
        Arch::X86_64 => super::host::QEMU,
        Arch::Aarch64 => super::host::QEMU_AARCH64,
    }
}

/// What a jailed QEMU inherits instead of opening by name: its jail has neither the session
/// disk nor the vhost-user sockets, and as `nobody` it could open none of them. Unjailed
/// (`UMBRA_HELPER_JAIL=off`) every field is `None` and QEMU opens them by path.
#[derive(Default)]
pub struct Inherited {
    /// A connected socket to vhost-device-vsock.
    pub vsock: Option<RawFd>,
    /// A connected socket to virtiofsd.
    pub fs: Option<RawFd>,
    /// The session disk, opened read-write and read-only (QEMU picks from the set by mode).
    pub disk: Option<[RawFd; 2]>,
}

/// The fd set the session disk's descriptors are in (`-add-fd`).
const DISK_FD_SET: u32 = 1;

/// The QEMU command line for `spec`.
pub fn qemu_command(
    qemu: &Path,
    spec: &VmSpec,
    run: &RunDir,
    accel_kvm: bool,
    fs_socket: Option<&Path>,
    inherited: &Inherited,
) -> Command {
    let mem = spec.memory_mib;
    let arch = spec.image.arch;
    let mut cmd = Command::new(qemu);
    match arch {
        Arch::X86_64 => cmd.args(["-M", "microvm,acpi=off,memory-backend=mem"]),
        // `virt` puts each `-device …-device` on one of its virtio-mmio transports, in command
        // line order, so the rootfs is still /dev/vda. GICv3: more than 8 vCPUs.
        Arch::Aarch64 => cmd.args(["-M", "virt,gic-version=3,memory-backend=mem"]),
    };
    cmd.arg("-object")
        .arg(format!("memory-backend-memfd,id=mem,size={mem}M,share=on"))
        .args(["-m", &format!("{mem}M"), "-smp", &spec.cpus.to_string()])
        .args(["-accel", if accel_kvm { "kvm" } else { "tcg" }])
        .args(["-no-reboot", "-nographic", "-nodefaults", "-no-user-config"])
        // QEMU's own seccomp filter: no obsolete syscalls, no setuid/setgid, no fork/exec, no
        // scheduler or affinity changes — a compromised device model can do less.
        .args(["-sandbox", QEMU_SANDBOX])
        // The console goes to our pipe (see `launch`), which copies it with a size cap.
        .args(["-serial", "stdio"])
        .arg("-kernel")
        .arg(&spec.image.kernel);
    match (accel_kvm, arch) {
        (true, _) => cmd.args(["-cpu", "host"]),
        // TCG's `max` emulates pointer authentication with QARMA, which costs more than the rest
        // of the CPU; a Cortex-A72 (ARMv8.0) runs the same static aarch64 binaries faster.
        (false, Arch::Aarch64) => cmd.args(["-cpu", "cortex-a72"]),
        (false, Arch::X86_64) => &mut cmd,
    };
    if let Some(initrd) = &spec.image.initrd {
        cmd.arg("-initrd").arg(initrd);
    }
    if let Some(rootfs) = &spec.image.rootfs {
        cmd.arg("-drive")
            .arg(format!("id=rootfs,file={},format=raw,if=none,readonly=on", option_value(rootfs)))
            .args(["-device", "virtio-blk-device,drive=rootfs"]);
    }
    // The session disk comes after the rootfs, so the image's `root=/dev/vda` still names the
    // rootfs (the agent finds the session disk by its label). `cache=writeback` (QEMU's default,
    // spelled out): writes go through the host page cache and the guest's flushes (ext4 journal
    // commits) become fdatasync, so a killed VM leaves a consistent filesystem. `discard=unmap`
    // turns the guest's discards into holes in the sparse file, so deleted files give the host
    // its space back. QEMU locks the image: a second VM cannot open the same disk.
    // `werror=report,rerror=report`: a host error (ENOSPC when the host disk fills) reaches the
    // guest as an I/O error; QEMU's default for ENOSPC pauses the VM, which nothing here would
    // ever resume (the heartbeat would fail and the session restart into the same full disk).
    if let Some(disk) = &spec.disk {
        let file = match inherited.disk {
            Some(fds) => {
                for fd in fds {
                    cmd.arg("-add-fd").arg(format!("fd={fd},set={DISK_FD_SET}"));
                }
                format!("/dev/fdset/{DISK_FD_SET}")
            }
            None => option_value(disk),
        };
        cmd.arg("-drive")
            .arg(format!(
                "id=session,file={file},format=raw,if=none,cache=writeback,discard=unmap,werror=report,rerror=report"
            ))
            .args(["-device", "virtio-blk-device,drive=session"]);
    }
    let socket = |id: &str, fd: Option<RawFd>, path: &Path| match fd {
        Some(fd) => format!("socket,id={id},fd={fd}"),
        None => format!("socket,id={id},path={}", option_value(path)),
    };
    cmd.arg("-chardev")
        .arg(socket("vsock", inherited.vsock, &vhost_socket(run)))
        .args(["-device", "vhost-user-vsock-device,chardev=vsock"]);
    if let Some(sock) = fs_socket {
        cmd.arg("-chardev")
            .arg(socket("fs", inherited.fs, sock))
            .arg("-device")
            .arg(format!("vhost-user-fs-device,chardev=fs,tag={}", super::fsd::FS_TAG));
    }
    // Free page reporting: the guest tells QEMU which pages it has freed (2 MiB blocks, a
    // couple of seconds after) and QEMU discards them from the memfd, so a guest that once
    // touched its memory hands it back when idle. Last, so no other device moves.
    cmd.args(["-device", "virtio-balloon-device,free-page-reporting=on"]);
    let base = match arch {
        Arch::X86_64 => BASE_CMDLINE,
        Arch::Aarch64 => BASE_CMDLINE_AARCH64,
    };
    let cmdline = format!("{base} {}", spec.image.cmdline);
    cmd.arg("-append").arg(cmdline.trim());
    cmd
}

/// A path as a QEMU option value: commas are doubled, or QEMU would read the rest as options.
fn option_value(path: &Path) -> String {
    path.display().to_string().replace(',', ",,")
}

/// vhost-device-vsock's vhost-user socket: beside the hybrid vsock sockets, in the one
/// directory its jail lets it write.
fn vhost_socket(run: &RunDir) -> std::path::PathBuf {
    run.join(super::rundir::VSOCK_DIR).join("vhost-vsock.sock")
}

async fn launch(spec: &VmSpec) -> Result<Vm, VmError> {
    let started = Instant::now();
    let program = qemu_program(spec.image.arch);
    let qemu = program.require()?;
    let vhost = super::host::VHOST_VSOCK.require()?;
    let id = new_vm_id();
    let run = RunDir::create(&id).map_err(io("create the VM run directory"))?;
    let vhost_sock = vhost_socket(&run);
    let vsock_uds = super::rundir::vsock_socket(run.path());
    let vhost_log = run.join("vhost-vsock.log");

    let mut daemon_cmd = Command::new(&vhost);
    daemon_cmd
        .arg("--guest-cid")
        .arg(GUEST_CID.to_string())
        .arg("--socket")
        .arg(&vhost_sock)
        .arg("--uds-path")
        .arg(&vsock_uds)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log_file(&vhost_log)?);
    let daemon_jail = vhost_jail(&run, &vhost, vsock_uds.parent().expect("in a directory"))?;
    let mut daemon = Supervised::spawn_jailed("vhost-device-vsock", daemon_cmd, daemon_jail)
        .map_err(io(format!("start {}", vhost.display())))?;
    // QEMU connects to the vhost-user socket once, when it starts: the socket must listen, not
    // merely exist (the file appears at bind(), before listen()).
    let deadline = Instant::now() + Duration::from_secs(5);
    let daemon_pid = daemon.pid();
    while !umbra_sys::unix_socket_listening_in(daemon_pid, &vhost_sock) {
        if let Some(status) = daemon.try_exited() {
            return Err(VmError::HelperFailed {
                helper: "vhost-device-vsock",
                status: status.to_string(),
                log: std::fs::read_to_string(&vhost_log).unwrap_or_default(),
            });
        }
        if Instant::now() > deadline {
            return Err(VmError::HelperFailed {
                helper: "vhost-device-vsock",
                status: "did not listen on its socket within 5 s".into(),
                log: std::fs::read_to_string(&vhost_log).unwrap_or_default(),
            });
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }

    let mut children = vec![daemon];
    let folders = start_folder_server(spec, &run, &mut children).await?;
    // KVM runs only the host's architecture; another one is emulated.
    let accel_kvm = KvmKind::detect() == KvmKind::Hardware && spec.image.arch == Arch::host();
    let fs_socket = folders.as_ref().map(FolderServer::socket);
    let (inherited, held, jail) = qemu_jail(spec, &run, &qemu, accel_kvm, &vhost_sock, fs_socket)?;
    let cmd = qemu_command(&qemu, spec, &run, accel_kvm, fs_socket, &inherited);
    let guest = GuestProcess {
        name: program.name,
        binary: &qemu,
        cmd,
        log: run.join("qemu.log"),
        log_label: "qemu: ",
        jail,
        held,
        describe_exit: |_| None,
    };
    let launch = Launch {
        kind: BackendKind::Qemu,
        capabilities: QemuBackend.capabilities(),
        started,
        id,
        run,
        children,
        folders,
    };
    launch.finish(spec, guest, |helpers| Box::new(helpers)).await
}

/// vhost-device-vsock's jail, unless helpers run unjailed; `dir` is its sockets' directory, the
/// only one it writes.
#[cfg(target_os = "linux")]
fn vhost_jail(run: &RunDir, vhost: &Path, dir: &Path) -> Result<Option<Jail>, VmError> {
    if !HelperJail::enabled() {
        return Ok(None);
    }
    let mut jail =
        HelperJail::new(&jail_root(run, "vhost-root")?, vhost).map_err(io("prepare vhost-device-vsock's jail"))?;
    jail.writable(dir).map_err(io(format!("give {} to vhost-device-vsock", dir.display())))?;
    Ok(Some(jail))
}

/// QEMU's jail and what it inherits, unless helpers run unjailed.
#[cfg(target_os = "linux")]
fn qemu_jail(
    spec: &VmSpec,
    run: &RunDir,
    qemu: &Path,
    accel_kvm: bool,
    vhost_sock: &Path,
    fs_socket: Option<&Path>,
) -> Result<(Inherited, Vec<OwnedFd>, Option<Jail>), VmError> {
    use std::os::fd::AsRawFd;
    if !HelperJail::enabled() {
        return Ok((Inherited::default(), Vec::new(), None));
    }
    let (inherited, held) = open_for_jail(spec, vhost_sock, fs_socket)?;
    let mut jail = HelperJail::new(&jail_root(run, "qemu-root")?, qemu).map_err(io("prepare QEMU's jail"))?;
    let image = &spec.image;
    for file in [Some(&image.kernel), image.initrd.as_ref(), image.rootfs.as_ref()].into_iter().flatten() {
        jail.read_only(file).map_err(io(format!("show {} to QEMU", file.display())))?;
    }
    if accel_kvm {
        jail.device(Path::new("/dev/kvm")).map_err(io("show /dev/kvm to QEMU"))?;
    }
    for fd in &held {
        jail.inherit(fd.as_raw_fd());
    }
    Ok((inherited, held, Some(jail)))
}

#[cfg(not(target_os = "linux"))]
fn vhost_jail(_: &RunDir, _: &Path, _: &Path) -> Result<Option<Jail>, VmError> {
    Ok(None)
}

#[cfg(not(target_os = "linux"))]
fn qemu_jail(
    _: &VmSpec,
    _: &RunDir,
    _: &Path,
    _: bool,
    _: &Path,
    _: Option<&Path>,
) -> Result<(Inherited, Vec<OwnedFd>, Option<Jail>), VmError> {
    Ok((Inherited::default(), Vec::new(), None))
}

/// An empty directory in the run directory for a jail's root.
#[cfg(target_os = "linux")]
fn jail_root(run: &RunDir, name: &str) -> Result<std::path::PathBuf, VmError> {
    let root = run.join(name);
    std::fs::create_dir(&root).map_err(io(format!("create {}", root.display())))?;
    Ok(root)
}

#[cfg(target_os = "linux")]
/// Opens what a jailed QEMU inherits: connections to the vhost-user daemons (they accept one
/// each, so this is QEMU's) and the session disk in both access modes. The descriptors stay
/// open until QEMU has started.
fn open_for_jail(
    spec: &VmSpec,
    vhost_sock: &Path,
    fs_socket: Option<&Path>,
) -> Result<(Inherited, Vec<OwnedFd>), VmError> {
    use std::os::fd::AsRawFd;
    let connect = |path: &Path| -> Result<OwnedFd, VmError> {
        let stream =
            std::os::unix::net::UnixStream::connect(path).map_err(io(format!("connect to {}", path.display())))?;
        Ok(OwnedFd::from(stream))
    };
    let mut held = Vec::new();
    let mut inherited = Inherited::default();
    let vsock = connect(vhost_sock)?;
    inherited.vsock = Some(vsock.as_raw_fd());
    held.push(vsock);
    if let Some(path) = fs_socket {
        let fs = connect(path)?;
        inherited.fs = Some(fs.as_raw_fd());
        held.push(fs);
    }
    if let Some(disk) = &spec.disk {
        let open = |write: bool| -> Result<OwnedFd, VmError> {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(write)
                .open(disk)
                .map_err(io(format!("open {}", disk.display())))?;
            Ok(OwnedFd::from(file))
        };
        let (rw, ro) = (open(true)?, open(false)?);
        inherited.disk = Some([rw.as_raw_fd(), ro.as_raw_fd()]);
        held.extend([rw, ro]);
    }
    Ok((inherited, held))
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::backend::BootImage;

    fn spec(rootfs: Option<&str>, disk: Option<&str>) -> VmSpec {
        let mut spec = VmSpec::new(BootImage {
            version: "test".into(),
            arch: Arch::X86_64,
            kernel: PathBuf::from("/k/vmlinux"),
            initrd: None,
            rootfs: rootfs.map(PathBuf::from),
            cmdline: "root=/dev/vda".into(),
            image: None,
        });
        spec.disk = disk.map(PathBuf::from);
        spec
    }

    fn args(spec: &VmSpec) -> Vec<String> {
        let run = RunDir::create(&new_vm_id()).unwrap();
        let cmd = qemu_command(Path::new("qemu"), spec, &run, false, None, &Inherited::default());
        cmd.get_args().map(|a| a.to_string_lossy().into_owned()).collect()
    }

    #[test]
    fn the_session_disk_is_a_writable_second_block_device() {
        let a = args(&spec(Some("/b/root.erofs"), Some("/s/a,b.img")));
        let drives: Vec<_> = a.iter().enumerate().filter(|(_, x)| *x == "-drive").map(|(i, _)| &a[i + 1]).collect();
        assert_eq!(
            drives,
            [
                "id=rootfs,file=/b/root.erofs,format=raw,if=none,readonly=on",
                "id=session,file=/s/a,,b.img,format=raw,if=none,cache=writeback,discard=unmap,werror=report,rerror=report",
            ]
        );
        let devices: Vec<_> = a.iter().enumerate().filter(|(_, x)| *x == "-device").map(|(i, _)| &a[i + 1]).collect();
        assert_eq!(devices[..2], ["virtio-blk-device,drive=rootfs", "virtio-blk-device,drive=session"]);
        assert_eq!(devices.last().unwrap().as_str(), "virtio-balloon-device,free-page-reporting=on");
        let cmdline = &a[a.iter().position(|x| x == "-append").unwrap() + 1];
        assert!(cmdline.contains("no_timer_check"), "{cmdline}");
    }

    #[test]
    fn an_arm64_bundle_runs_on_the_virt_machine_with_a_pl011_console() {
        let mut s = spec(Some("/b/root.erofs"), None);
        s.image.arch = Arch::Aarch64;
        let a = args(&s);
        let value = |flag: &str| a[a.iter().position(|x| x == flag).unwrap() + 1].clone();
        assert_eq!(value("-M"), "virt,gic-version=3,memory-backend=mem");
        assert_eq!(value("-cpu"), "cortex-a72");
        assert_eq!(value("-accel"), "tcg");
        let cmdline = value("-append");
        assert!(cmdline.starts_with("console=ttyAMA0 ") && !cmdline.contains("ttyS0"), "{cmdline}");
        assert!(a.iter().any(|x| x == "vhost-user-vsock-device,chardev=vsock"), "{a:?}");
        assert_eq!(qemu_program(Arch::Aarch64).name, "qemu-system-aarch64");
    }

    #[test]
    fn no_session_disk_no_second_drive() {
        let a = args(&spec(None, None));
        assert!(!a.iter().any(|x| x == "-drive"), "{a:?}");
    }
}
