//! Duties of PID 1 in the guest: the mounts every process expects, hostname, loopback, and a
//! clean power-off that tells the host why when something fatal happens. PID 1 must never exit:
//! the kernel panics if it does, and the host would see a panic instead of the real reason.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::anyhow;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::reboot::{reboot, RebootMode};
use umbra_proto::SESSION_DISK_LABEL;

pub fn is_pid1() -> bool {
    std::process::id() == 1
}

struct Mount {
    source: &'static str,
    target: &'static str,
    fstype: &'static str,
    flags: MsFlags,
    data: Option<&'static str>,
    required: bool,
}

const MOUNTS: &[Mount] = &[
    Mount {
        source: "proc",
        target: "/proc",
        fstype: "proc",
        flags: MsFlags::MS_NOSUID.union(MsFlags::MS_NODEV).union(MsFlags::MS_NOEXEC),
        data: None,
        required: true,
    },
    Mount {
        source: "sysfs",
        target: "/sys",
        fstype: "sysfs",
        flags: MsFlags::MS_NOSUID.union(MsFlags::MS_NODEV).union(MsFlags::MS_NOEXEC),
        data: None,
        required: true,
    },
    Mount {
        source: "devtmpfs",
        target: "/dev",
        fstype: "devtmpfs",
        flags: MsFlags::MS_NOSUID,
        data: Some("mode=0755"),
        required: true,
    },
    Mount {
        source: "devpts",
        target: "/dev/pts",
        fstype: "devpts",
        flags: MsFlags::MS_NOSUID.union(MsFlags::MS_NOEXEC),
        data: Some("mode=0620,ptmxmode=0666"),
        required: true,
    },
    Mount {
        source: "tmpfs",
        target: "/dev/shm",
        fstype: "tmpfs",
        flags: MsFlags::MS_NOSUID.union(MsFlags::MS_NODEV),
        data: Some("mode=1777"),
        required: false,
    },
    Mount {
        source: "tmpfs",
        target: "/tmp",
        fstype: "tmpfs",
        flags: MsFlags::MS_NOSUID.union(MsFlags::MS_NODEV),
        data: Some("mode=1777"),
        required: true,
    },
    Mount {
        source: "tmpfs",
        target: "/run",
        fstype: "tmpfs",
        flags: MsFlags::MS_NOSUID.union(MsFlags::MS_NODEV),
        data: Some("mode=0755"),
        required: false,
    },
    Mount {
        source: "cgroup2",
        target: "/sys/fs/cgroup",
        fstype: "cgroup2",
        flags: MsFlags::MS_NOSUID.union(MsFlags::MS_NODEV).union(MsFlags::MS_NOEXEC),
        data: None,
        required: false,
    },
];

/// Prepares the guest. Errors name the step that failed.
pub fn init(hostname: &str) -> anyhow::Result<()> {
    overlay_root().map_err(|e| anyhow!("cannot set up the writable root: {e}"))?;
    for m in MOUNTS {
        let _ = std::fs::create_dir_all(m.target);
        match mount(Some(m.source), m.target, Some(m.fstype), m.flags, m.data) {
            Ok(()) | Err(nix::errno::Errno::EBUSY) => {}
            Err(e) if m.required => anyhow::bail!("cannot mount {} on {}: {e}", m.fstype, m.target),
            Err(e) => tracing::warn!("optional mount {} on {} failed: {e}", m.fstype, m.target),
        }
    }
    // Programs expect these links (the kernel's devtmpfs does not create them).
    for (link, target) in [
        ("/dev/fd", "/proc/self/fd"),
        ("/dev/stdin", "/proc/self/fd/0"),
        ("/dev/stdout", "/proc/self/fd/1"),
        ("/dev/stderr", "/proc/self/fd/2"),
    ] {
        let _ = std::os::unix::fs::symlink(target, link);
    }
    nix::unistd::sethostname(hostname).map_err(|e| anyhow::anyhow!("cannot set hostname: {e}"))?;
    loopback_up().map_err(|e| anyhow::anyhow!("cannot bring up loopback: {e}"))?;
    Ok(())
}

/// Where the agent assembles the root's writable layer, on a tmpfs mounted over it; images
/// ship the directory empty.
const OVERLAY_DIR: &str = "/umbra";

/// `statfs` magic of ramfs (libc has no constant for it); the initramfs root is ramfs or tmpfs.
const RAMFS_MAGIC: u64 = 0x8584_58f6;

/// Bytes read from each candidate disk to recognise the session disk: the ext4 superblock
/// starts at byte 1024 and is 1024 bytes long.
const DISK_PROBE_LEN: usize = 2048;

/// The guest's writable root, an overlayfs over the image's root:
/// - a read-only root (the `standard` image, an erofs disk booted with `ro`) always gets one;
/// - with a session disk (an ext4 disk labelled [`SESSION_DISK_LABEL`], attached by the host),
///   any root gets one, with its upper and work directories on that disk, so writes survive a
///   restart of the VM and do not take guest RAM;
/// - without a disk the upper layer is a tmpfs (writes live in memory), and a writable root
///   (the `minimal` initramfs) is left alone.
///
/// Layout while assembling (all on a tmpfs at [`OVERLAY_DIR`], hidden once the overlay is the
/// root): `lower` (a bind of the old `/`), `disk` (the session disk) or `upper` + `work`,
/// `root` (the overlay). The overlay replaces a root on a block device with pivot_root; the
/// initramfs cannot be pivoted away (EINVAL), so there the overlay is moved over `/` and
/// chrooted into, as switch_root does. Either way every later mount (proc, sys, dev, /tmp, shares) lands in the
/// overlay.
///
/// The host asked for a disk when it attached one: every failure from finding it on is fatal,
/// never a silent fallback to RAM.
fn overlay_root() -> anyhow::Result<()> {
    use nix::sys::statfs::{statfs, TMPFS_MAGIC};
    use nix::sys::statvfs::{statvfs, FsFlags};
    let read_only = statvfs("/").map_err(|e| anyhow!("cannot statvfs /: {e}"))?.flags().contains(FsFlags::ST_RDONLY);
    let fs_type = statfs("/").map_err(|e| anyhow!("cannot statfs /: {e}"))?.filesystem_type();
    let initramfs = fs_type == TMPFS_MAGIC || fs_type.0 as u64 == RAMFS_MAGIC;

    let dir = Path::new(OVERLAY_DIR);
    // An initramfs built before images shipped /umbra: it is writable, make the directory.
    let created = !read_only && !dir.exists() && {
        std::fs::create_dir(dir).map_err(|e| anyhow!("cannot create {OVERLAY_DIR}: {e}"))?;
        true
    };
    mount(Some("tmpfs"), dir, Some("tmpfs"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some("mode=0755"))
        .map_err(|e| anyhow!("cannot mount a tmpfs on {OVERLAY_DIR}: {e}"))?;
    let disk = mount_session_disk(dir)?;
    if disk.is_none() && !read_only {
        // No disk and a writable root: nothing to do, leave no trace.
        umount2(dir, MntFlags::empty()).map_err(|e| anyhow!("cannot unmount {OVERLAY_DIR}: {e}"))?;
        if created {
            let _ = std::fs::remove_dir(dir);
        }
        return Ok(());
    }
    let layer = disk.unwrap_or_else(|| dir.to_path_buf());
    for sub in [layer.join("upper"), layer.join("work"), dir.join("lower"), dir.join("root")] {
        // The disk's upper and work directories exist from an earlier boot.
        std::fs::create_dir_all(&sub).map_err(|e| anyhow!("cannot create {}: {e}", sub.display()))?;
    }
    // A bind of "/" gives overlayfs a lower layer that does not contain its own upper.
    mount(Some("/"), &dir.join("lower"), None::<&str>, MsFlags::MS_BIND, None::<&str>)
        .map_err(|e| anyhow!("cannot bind / on {OVERLAY_DIR}/lower: {e}"))?;
    let opts = format!("lowerdir={OVERLAY_DIR}/lower,upperdir={0}/upper,workdir={0}/work", layer.display());
    mount(Some("overlay"), &dir.join("root"), Some("overlay"), MsFlags::empty(), Some(opts.as_str()))
        .map_err(|e| anyhow!("cannot mount the root overlay ({opts}): {e}"))?;
    nix::unistd::chdir(&dir.join("root")).map_err(|e| anyhow!("cannot chdir to {OVERLAY_DIR}/root: {e}"))?;
    if initramfs {
        // switch_root: the overlay covers the initramfs, which stays underneath as its lower
        // layer (and keeps the tmpfs at /umbra, now out of reach of the chroot).
        mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)
            .map_err(|e| anyhow!("cannot move the root overlay onto /: {e}"))?;
        nix::unistd::chroot(".").map_err(|e| anyhow!("cannot chroot into the root overlay: {e}"))?;
    } else {
        // pivot_root(".", ".") stacks the old root on the new one; detaching it leaves the
        // overlay (which holds its own references to its layers).
        nix::unistd::pivot_root(".", ".").map_err(|e| anyhow!("cannot pivot_root into the root overlay: {e}"))?;
        umount2(".", MntFlags::MNT_DETACH).map_err(|e| anyhow!("cannot detach the old root: {e}"))?;
    }
    nix::unistd::chdir("/").map_err(|e| anyhow!("cannot chdir to the new /: {e}"))?;
    Ok(())
}

/// Finds the session disk among the virtio disks and mounts it at `<dir>/disk`; None if there
/// is none. sysfs and /dev are not mounted yet (and the `minimal` image has no devtmpfs at
/// all), so the disks are listed from a sysfs mounted at `<dir>/sys`, and each candidate gets a
/// device node made from its `dev` number in a private tmpfs at `<dir>/dev` (the tmpfs at `dir`
/// is nodev). Both are gone when this returns: the mounted filesystem holds the device itself.
fn mount_session_disk(dir: &Path) -> anyhow::Result<Option<PathBuf>> {
    let sys = dir.join("sys");
    let dev = dir.join("dev");
    scratch_mount("sysfs", &sys, MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC, None)?;
    let tmpfs_flags = MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC;
    let found =
        scratch_mount("tmpfs", &dev, tmpfs_flags, Some("mode=0700")).and_then(|()| find_session_disk(&sys, &dev));
    scratch_unmount(&sys)?;
    let found = match found {
        Ok(found) => found,
        Err(e) => {
            let _ = scratch_unmount(&dev);
            return Err(e);
        }
    };
    let Some((name, node)) = found else {
        scratch_unmount(&dev)?;
        return Ok(None);
    };
    let target = dir.join("disk");
    std::fs::create_dir(&target).map_err(|e| anyhow!("cannot create {}: {e}", target.display()))?;
    // Default ext4 options (journalled, data=ordered: the VM may be killed at any moment) plus
    // `discard`, so files deleted in the guest become holes in the host's sparse file again
    // (ignored when the device cannot discard). No `lazytime`: a killed VM would lose timestamp
    // updates that build tools rely on. The host marks the inode tables as zeroed when it
    // formats, so the kernel has no background initialisation to do (no `noinit_itable`).
    let mounted = mount(Some(&node), &target, Some("ext4"), MsFlags::empty(), Some("discard"));
    scratch_unmount(&dev)?;
    mounted.map_err(|e| {
        anyhow!("cannot mount the session disk {name} (ext4, label {SESSION_DISK_LABEL}) on {}: {e}", target.display())
    })?;
    Ok(Some(target))
}

/// The one virtio disk (`vd*` in `<sys>/block`) whose ext4 label is [`SESSION_DISK_LABEL`],
/// with a device node for it in `dev`. Device order means nothing: every disk is looked at, and
/// two disks with the label are an error.
fn find_session_disk(sys: &Path, dev: &Path) -> anyhow::Result<Option<(String, PathBuf)>> {
    use nix::sys::stat::{makedev, mknod, Mode, SFlag};
    let block = sys.join("block");
    let entries = std::fs::read_dir(&block).map_err(|e| anyhow!("cannot list {}: {e}", block.display()))?;
    let mut names: Vec<String> =
        entries.flatten().filter_map(|e| e.file_name().into_string().ok()).filter(|n| n.starts_with("vd")).collect();
    names.sort();
    let mut found = Vec::new();
    for name in names {
        let dev_file = block.join(&name).join("dev");
        let number =
            std::fs::read_to_string(&dev_file).map_err(|e| anyhow!("cannot read {}: {e}", dev_file.display()))?;
        let (major, minor) = parse_dev_number(&number)
            .ok_or_else(|| anyhow!("{} holds {:?}, not MAJOR:MINOR", dev_file.display(), number.trim()))?;
        let node = dev.join(&name);
        mknod(&node, SFlag::S_IFBLK, Mode::S_IRUSR | Mode::S_IWUSR, makedev(major, minor))
            .map_err(|e| anyhow!("cannot make a device node for {name} ({major}:{minor}): {e}"))?;
        let mut head = [0u8; DISK_PROBE_LEN];
        match std::fs::File::open(&node).and_then(|mut f| f.read_exact(&mut head)) {
            Ok(()) if is_session_disk(&head) => found.push((name, node)),
            Ok(()) => {}
            // Smaller than the probe: not an ext4 disk.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {}
            Err(e) => anyhow::bail!("cannot read the first {DISK_PROBE_LEN} bytes of disk {name}: {e}"),
        }
    }
    match found.len() {
        0 | 1 => Ok(found.pop()),
        _ => {
            let names: Vec<&str> = found.iter().map(|(n, _)| n.as_str()).collect();
            anyhow::bail!("several disks carry the session disk label {SESSION_DISK_LABEL}: {}", names.join(", "))
        }
    }
}

/// `/sys/block/<disk>/dev`: "MAJOR:MINOR\n".
fn parse_dev_number(s: &str) -> Option<(u64, u64)> {
    let (major, minor) = s.trim().split_once(':')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// Whether the first bytes of a disk are an ext4 superblock (magic 0xEF53, little-endian, at
/// 1024 + 56) whose volume label (16 bytes at 1024 + 120, NUL-padded) is [`SESSION_DISK_LABEL`].
fn is_session_disk(head: &[u8]) -> bool {
    const SUPERBLOCK: usize = 1024;
    let Some(sb) = head.get(SUPERBLOCK..SUPERBLOCK + 1024) else { return false };
    let magic = u16::from_le_bytes([sb[56], sb[57]]);
    let label = &sb[120..136];
    let wanted = SESSION_DISK_LABEL.as_bytes();
    magic == 0xEF53 && label[..wanted.len()] == *wanted && label[wanted.len()..].iter().all(|&b| b == 0)
}

/// Mounts a scratch filesystem on a new directory `target` (on the tmpfs at [`OVERLAY_DIR`]).
fn scratch_mount(fstype: &str, target: &Path, flags: MsFlags, data: Option<&str>) -> anyhow::Result<()> {
    std::fs::create_dir(target).map_err(|e| anyhow!("cannot create {}: {e}", target.display()))?;
    mount(Some(fstype), target, Some(fstype), flags, data)
        .map_err(|e| anyhow!("cannot mount {fstype} on {}: {e}", target.display()))
}

fn scratch_unmount(target: &Path) -> anyhow::Result<()> {
    umount2(target, MntFlags::empty()).map_err(|e| anyhow!("cannot unmount {}: {e}", target.display()))?;
    std::fs::remove_dir(target).map_err(|e| anyhow!("cannot remove {}: {e}", target.display()))
}

pub(crate) fn loopback_up() -> std::io::Result<()> {
    // SAFETY: a plain socket(2) call; the fd is owned and closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket(2) and is owned by nobody else.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    use std::os::fd::AsRawFd;
    // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS read and write one `struct ifreq`, valid for both calls.
    unsafe {
        if libc::ioctl(fd.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        if libc::ioctl(fd.as_raw_fd(), libc::SIOCSIFFLAGS, &req) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Tells the console why, then powers the guest off. Never returns.
pub fn fatal(message: &str) -> ! {
    let line = format!("umbra-agent: fatal: {message}\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
    if let Ok(mut console) = std::fs::OpenOptions::new().write(true).open("/dev/console") {
        let _ = console.write_all(line.as_bytes());
    }
    power_off()
}

/// Ends the VM. A microVM has no ACPI, so RB_POWER_OFF would only halt the CPU and leave the
/// VM running; a reboot request is what ends it (QEMU with `-no-reboot` and `reboot=t` exits,
/// the Umbra VMM treats the i8042 reset as a clean exit).
pub fn power_off() -> ! {
    nix::unistd::sync();
    let _ = reboot(RebootMode::RB_AUTOBOOT);
    // Only reachable if reboot(2) failed; exiting would panic the kernel, so wait forever.
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn superblock(magic: u16, label: &[u8]) -> Vec<u8> {
        let mut head = vec![0u8; DISK_PROBE_LEN];
        head[1024 + 56..1024 + 58].copy_from_slice(&magic.to_le_bytes());
        head[1024 + 120..1024 + 120 + label.len()].copy_from_slice(label);
        head
    }

    #[test]
    fn recognises_the_session_disk_by_magic_and_label() {
        assert!(is_session_disk(&superblock(0xEF53, SESSION_DISK_LABEL.as_bytes())));
        assert!(!is_session_disk(&superblock(0xEF53, b"umbra-session2")), "a longer label");
        assert!(!is_session_disk(&superblock(0xEF53, b"umbra-sessio")), "a prefix");
        assert!(!is_session_disk(&superblock(0xEF53, b"")), "no label");
        assert!(!is_session_disk(&superblock(0x1234, SESSION_DISK_LABEL.as_bytes())), "not ext4");
        assert!(!is_session_disk(&superblock(0xEF53, SESSION_DISK_LABEL.as_bytes())[..2000]), "too short");
        // An erofs image (magic 0xE0F5E1E2 at 1024) is not it.
        let mut erofs = vec![0u8; DISK_PROBE_LEN];
        erofs[1024..1028].copy_from_slice(&0xE0F5_E1E2u32.to_le_bytes());
        assert!(!is_session_disk(&erofs));
    }

    /// The host formats with mkfs.ext4 (umbra-runtime's backend::disk); the agent must read
    /// what it writes. Skipped where e2fsprogs is missing.
    #[test]
    fn recognises_a_disk_made_by_mkfs_ext4() {
        let mkfs = ["/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4"].into_iter().find(|p| Path::new(p).is_file());
        let Some(mkfs) = mkfs else {
            eprintln!("skipped: no mkfs.ext4");
            return;
        };
        let image = std::env::temp_dir().join(format!("umbra-agent-disk-test-{}.img", std::process::id()));
        std::fs::File::create(&image).unwrap().set_len(64 << 20).unwrap();
        let status = std::process::Command::new(mkfs)
            .args(["-q", "-F", "-L", SESSION_DISK_LABEL, &image.to_string_lossy()])
            .status()
            .unwrap();
        let mut head = [0u8; DISK_PROBE_LEN];
        std::fs::File::open(&image).unwrap().read_exact(&mut head).unwrap();
        let _ = std::fs::remove_file(&image);
        assert!(status.success());
        assert!(is_session_disk(&head));
    }

    #[test]
    fn parses_sysfs_dev_numbers() {
        assert_eq!(parse_dev_number("254:16\n"), Some((254, 16)));
        assert_eq!(parse_dev_number("254"), None);
        assert_eq!(parse_dev_number("a:b"), None);
    }
}
