//! Duties of PID 1 in the guest: the mounts every process expects, hostname, loopback, and a
//! clean power-off that tells the host why when something fatal happens. PID 1 must never exit:
//! the kernel panics if it does, and the host would see a panic instead of the real reason.

use std::io::Write;

use nix::mount::{mount, MsFlags};
use nix::sys::reboot::{reboot, RebootMode};

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
    overlay_root().map_err(|e| anyhow::anyhow!("cannot set up the writable overlay over the read-only root: {e}"))?;
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

/// Where an image's read-only root gets its writable layer; the image ships it empty.
const OVERLAY_DIR: &str = "/umbra";

/// A read-only root (the `standard` image, an erofs disk booted with `ro`) gets an overlayfs
/// whose upper layer is a tmpfs, and becomes the new root: every session starts from the same
/// immutable image and its writes live in memory. An initramfs root is already writable.
fn overlay_root() -> nix::Result<()> {
    use nix::sys::statvfs::{statvfs, FsFlags};
    if !statvfs("/")?.flags().contains(FsFlags::ST_RDONLY) {
        return Ok(());
    }
    let dir = std::path::Path::new(OVERLAY_DIR);
    mount(Some("tmpfs"), dir, Some("tmpfs"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some("mode=0755"))?;
    for sub in ["lower", "upper", "work", "root"] {
        std::fs::create_dir(dir.join(sub))
            .map_err(|e| nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)))?;
    }
    // A bind of "/" gives overlayfs a lower layer that does not contain its own upper.
    mount(Some("/"), &dir.join("lower"), None::<&str>, MsFlags::MS_BIND, None::<&str>)?;
    let opts = format!("lowerdir={0}/lower,upperdir={0}/upper,workdir={0}/work", OVERLAY_DIR);
    mount(Some("overlay"), &dir.join("root"), Some("overlay"), MsFlags::empty(), Some(opts.as_str()))?;
    // pivot_root(".", ".") stacks the old root on the new one; detaching it leaves the overlay.
    nix::unistd::chdir(&dir.join("root"))?;
    nix::unistd::pivot_root(".", ".")?;
    nix::mount::umount2(".", nix::mount::MntFlags::MNT_DETACH)?;
    nix::unistd::chdir("/")?;
    Ok(())
}

fn loopback_up() -> std::io::Result<()> {
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
