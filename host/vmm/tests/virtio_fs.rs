//! The virtio-fs device in the `umbra-vmm` process (test lane (b)): `--fs TAG=SOCKET` connects to
//! a real virtiofsd when the machine is built, and a bare guest finds the device (ID 26) with its
//! tag in config space; with nobody listening, the VMM exits 1 naming the socket. The data path
//! (FUSE through the rings) is proven in the lane-(a) tests next to the device.

use std::process::Command;

use umbra_vmm::bare::BareGuest;
use umbra_vmm::boot::layout::VIRTIO_MMIO_START;

#[path = "support/process.rs"]
mod process;
#[path = "support/virtiofsd.rs"]
mod virtiofsd;
use process::vmm_bin;
use virtiofsd::Virtiofsd;

#[test]
fn a_bare_guest_finds_the_fs_device_and_its_tag() {
    let dir = process::scratch_dir("fs", "tag");
    let fs = Virtiofsd::start(dir.clone(), &[]);
    let socket = &fs.socket;

    // With --no-rng the fs device is the only one: the first MMIO window.
    let base = VIRTIO_MMIO_START;
    let guest = BareGuest::new()
        .print("id")
        .print_mmio_digit(base + 0x08) // DeviceID 26: '0' + 26 = 'J'
        .print(" tag=")
        .print_mmio_bytes(base + 0x100) // the tag's first 4 bytes
        .print_mmio_bytes(base + 0x104)
        .print("\n")
        .reset();
    let elf = dir.join("guest.elf");
    std::fs::write(&elf, guest.to_elf()).unwrap();
    let fs_arg = format!("workdir={}", socket.display());
    let out = Command::new(vmm_bin())
        .arg("--kernel")
        .arg(&elf)
        .args(["--memory", "32", "--no-rng", "--fs", &fs_arg])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "idJ tag=workdir\0\n");
    // Dropping `fs` stops virtiofsd and removes `dir`.
}

#[test]
fn a_missing_virtiofsd_is_a_setup_error_naming_the_socket() {
    let dir = process::scratch_dir("fs", "missing");
    let elf = dir.join("guest.elf");
    std::fs::write(&elf, BareGuest::new().reset().to_elf()).unwrap();
    let socket = dir.join("nobody.sock");
    let out = Command::new(vmm_bin())
        .arg("--kernel")
        .arg(&elf)
        .args(["--memory", "32", "--fs"])
        .arg(format!("share={}", socket.display()))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("shared folder \"share\"") && err.contains(&*socket.to_string_lossy()), "{err}");
    assert!(err.contains("is virtiofsd running"), "{err}");

    let out = Command::new(vmm_bin()).args(["--kernel", "k", "--fs", "no-equals-sign"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("expected TAG=SOCKET"));
    let _ = std::fs::remove_dir_all(&dir);
}
