//! The QEMU backend: `qemu-system-x86_64 -M microvm` with memfd-shared guest memory (so
//! vhost-user daemons can map it), the PVH `vmlinux`, and `vhost-user-vsock-device` served by
//! a `vhost-device-vsock` we start and supervise. KVM acceleration when the host has hardware
//! KVM, TCG otherwise. This is also the headless test harness.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::fsd::FolderServer;
use super::host::{find_binary, KvmKind};
use super::rundir::{new_vm_id, RunDir};
use super::{
    io, log_file, start_folder_server, BackendKind, GuestProcess, Launch, Supervised, Vm, VmError, VmSpec, BASE_CMDLINE,
};

/// Each VM has its own vsock daemon, so every guest can use the same CID.
const GUEST_CID: u32 = 3;

/// The QEMU command line for `spec`.
pub fn qemu_command(qemu: &Path, spec: &VmSpec, run: &RunDir, accel_kvm: bool, fs_socket: Option<&Path>) -> Command {
    let mem = spec.memory_mib;
    let mut cmd = Command::new(qemu);
    cmd.args(["-M", "microvm,acpi=off,memory-backend=mem"])
        .arg("-object")
        .arg(format!("memory-backend-memfd,id=mem,size={mem}M,share=on"))
        .args(["-m", &format!("{mem}M"), "-smp", &spec.cpus.to_string()])
        .args(["-accel", if accel_kvm { "kvm" } else { "tcg" }])
        .args(["-no-reboot", "-nographic", "-nodefaults", "-no-user-config"])
        // The console goes to our pipe (see `launch`), which copies it with a size cap.
        .args(["-serial", "stdio"])
        .arg("-kernel")
        .arg(&spec.image.kernel);
    if accel_kvm {
        cmd.args(["-cpu", "host"]);
    }
    if let Some(initrd) = &spec.image.initrd {
        cmd.arg("-initrd").arg(initrd);
    }
    if let Some(rootfs) = &spec.image.rootfs {
        cmd.arg("-drive")
            .arg(format!("id=rootfs,file={},format=raw,if=none,readonly=on", rootfs.display()))
            .args(["-device", "virtio-blk-device,drive=rootfs"]);
    }
    cmd.arg("-chardev")
        .arg(format!("socket,id=vsock,path={}", run.join("vhost-vsock.sock").display()))
        .args(["-device", "vhost-user-vsock-device,chardev=vsock"]);
    if let Some(sock) = fs_socket {
        cmd.arg("-chardev")
            .arg(format!("socket,id=fs,path={}", sock.display()))
            .arg("-device")
            .arg(format!("vhost-user-fs-device,chardev=fs,tag={}", super::fsd::FS_TAG));
    }
    let cmdline = format!("{BASE_CMDLINE} {}", spec.image.cmdline);
    cmd.arg("-append").arg(cmdline.trim());
    cmd
}

pub async fn launch(spec: &VmSpec) -> Result<Vm, VmError> {
    let started = Instant::now();
    let qemu = find_binary("qemu-system-x86_64", "UMBRA_QEMU").ok_or(VmError::Missing {
        what: "qemu-system-x86_64",
        fix: "run scripts/install-deps (apt-get install qemu-system-x86)",
    })?;
    let vhost = find_binary("vhost-device-vsock", "UMBRA_VHOST_VSOCK").ok_or(VmError::Missing {
        what: "vhost-device-vsock",
        fix: "run scripts/install-deps (cargo install --locked vhost-device-vsock@0.3.0)",
    })?;
    let id = new_vm_id();
    let run = RunDir::create(&id).map_err(io("create the VM run directory"))?;
    let vhost_sock = run.join("vhost-vsock.sock");
    let vsock_uds = run.join("vsock.sock");
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
    let mut daemon =
        Supervised::spawn("vhost-device-vsock", daemon_cmd).map_err(io(format!("start {}", vhost.display())))?;
    // QEMU connects to the vhost-user socket once, when it starts: the socket must listen, not
    // merely exist (the file appears at bind(), before listen()).
    let deadline = Instant::now() + Duration::from_secs(5);
    while !umbra_sys::unix_socket_listening(&vhost_sock) {
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
    let accel_kvm = KvmKind::detect() == KvmKind::Hardware;
    let cmd = qemu_command(&qemu, spec, &run, accel_kvm, folders.as_ref().map(FolderServer::socket));
    let guest =
        GuestProcess { name: "qemu-system-x86_64", binary: &qemu, cmd, log: run.join("qemu.log"), log_label: "qemu: " };
    Launch { backend: BackendKind::Qemu, started, id, run, children, folders }.finish(spec, guest).await
}
