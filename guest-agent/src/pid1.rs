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

pub fn power_off() -> ! {
    nix::unistd::sync();
    let _ = reboot(RebootMode::RB_POWER_OFF);
    // Only reachable if reboot(2) failed; exiting would panic the kernel, so wait forever.
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}
