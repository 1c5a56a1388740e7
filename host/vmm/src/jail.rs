//! The jail umbra-vmm runs in, in the spirit of Firecracker's jailer, but entered by the VMM
//! itself once it has opened every host file it needs ([`crate::machine::HostFiles`]: kernel,
//! initrd, disks, console log, `/dev/kvm`, virtiofsd's sockets, its vsock listener). Nothing has
//! to be copied, linked or chowned into the jail, and nothing there can be opened again:
//! - new mount, pid, ipc, uts and network namespaces (plus a user namespace when not started
//!   as root: it is what lets an unprivileged user create the others);
//! - the root is the jail directory (`pivot_root`, the old root detached; on an initramfs
//!   root, which cannot be pivoted, the jail is moved over it and chrooted into), mounted
//!   nosuid, nodev, noexec: the VMM sees its vsock sockets and nothing else;
//! - started as root, it becomes an unprivileged uid and gid with no supplementary groups and
//!   an empty capability bounding set;
//! - rlimits: no core dumps, at most [`MAX_FDS`] descriptors;
//! - landlock where the kernel has it: no file access except removing its own socket, no TCP,
//!   no abstract Unix sockets or signals outside the jail.
//!
//! A pid namespace applies to children only, so the VMM forks once, before any thread exists:
//! the child is the VMM (pid 1 of its namespace); the parent holds nothing, waits, and exits as
//! the child did. If the parent dies (the runtime kills it), the kernel kills the child
//! (`PR_SET_PDEATHSIG`).

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::config::JailConfig;

/// File descriptors the jailed VMM may hold: the vsock device keeps at most ~1100 (1024
/// connections, its listener, handshakes in flight), the rest is a few dozen.
pub const MAX_FDS: u64 = 4096;

/// Which side of the fork [`enter`] returns on.
pub enum Side {
    /// The original process: it must [`relay`] the child's exit and do nothing else.
    Parent(libc::pid_t),
    /// The VMM, inside the jail.
    Child(Confinement),
}

/// What the jail ended up as, for the VMM's log.
#[derive(Debug, Clone, Copy)]
pub struct Confinement {
    pub uid: u32,
    pub gid: u32,
    /// Whether a user namespace was needed (not started as root).
    pub user_namespace: bool,
    /// The landlock ABI in force, if the kernel has landlock.
    pub landlock_abi: Option<i64>,
}

impl std::fmt::Display for Confinement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "jailed: mount, pid, ipc, uts and net namespaces")?;
        if self.user_namespace {
            write!(f, " in a user namespace")?;
        }
        write!(f, "; uid {} gid {}; landlock ", self.uid, self.gid)?;
        match self.landlock_abi {
            Some(abi) => write!(f, "ABI {abi}"),
            None => write!(f, "unavailable in this kernel"),
        }
    }
}

fn os_error(what: &str) -> String {
    format!("jail: {what}: {}", io::Error::last_os_error())
}

fn cstring(path: &Path) -> Result<CString, String> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| format!("jail: {} contains a NUL byte", path.display()))
}

/// Enters the jail. Must be called while the process has a single thread.
pub fn enter(jail: &JailConfig) -> Result<Side, String> {
    // SAFETY: geteuid/getegid have no preconditions.
    let (euid, egid) = unsafe { (libc::geteuid(), libc::getegid()) };
    let user_namespace = euid != 0;
    let mut flags =
        libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS | libc::CLONE_NEWNET;
    if user_namespace {
        flags |= libc::CLONE_NEWUSER;
    }
    // SAFETY: unshare takes integer flags; the process is single-threaded (CLONE_NEWUSER
    // requires it, and the new mount namespace must hold every thread to come).
    if unsafe { libc::unshare(flags) } != 0 {
        let hint = if user_namespace { " (are unprivileged user namespaces enabled?)" } else { "" };
        return Err(format!("{}{hint}", os_error("unshare")));
    }
    if user_namespace {
        // Map only ourselves: root inside is this user outside, and nobody else exists.
        std::fs::write("/proc/self/setgroups", "deny").map_err(|e| format!("jail: setgroups: {e}"))?;
        std::fs::write("/proc/self/uid_map", format!("0 {euid} 1")).map_err(|e| format!("jail: uid_map: {e}"))?;
        std::fs::write("/proc/self/gid_map", format!("0 {egid} 1")).map_err(|e| format!("jail: gid_map: {e}"))?;
    }
    // The parent holds the write end for as long as it lives: the child, once it has asked for
    // PDEATHSIG, sees from the read end (hung up) whether the parent died before that.
    let mut pipe = [0; 2];
    // SAFETY: pipe2 writes two fds into the array it is given.
    if unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(os_error("pipe"));
    }
    // SAFETY: the process is single-threaded, so the child is a complete copy of it.
    match unsafe { libc::fork() } {
        -1 => Err(os_error("fork")),
        0 => {
            // SAFETY: closing the write end this process inherited.
            unsafe { libc::close(pipe[1]) };
            let (uid, gid) = if user_namespace { (euid, egid) } else { (jail.uid, jail.gid) };
            let landlock_abi = inside(jail, user_namespace)?;
            // Only now: a change of uid or gid clears the parent-death signal.
            // SAFETY: prctl takes integers.
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
            let mut poll = libc::pollfd { fd: pipe[0], events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd, no wait; _exit ends this process at once; the read end
            // is ours and no longer needed.
            unsafe {
                if libc::poll(&mut poll, 1, 0) != 0 {
                    libc::_exit(1);
                }
                libc::close(pipe[0]);
            }
            Ok(Side::Child(Confinement { uid, gid, user_namespace, landlock_abi }))
        }
        child => {
            // SAFETY: the read end is the child's; the write end stays open until this exits.
            unsafe { libc::close(pipe[0]) };
            Ok(Side::Parent(child))
        }
    }
}

/// The child's part: mounts, root, hostname, limits, identity, landlock.
fn inside(jail: &JailConfig, user_namespace: bool) -> Result<Option<i64>, String> {
    let dir = cstring(&jail.dir)?;
    let root = c"/";
    let dot = c".";
    // SAFETY: every mount/chdir/pivot_root call gets NUL-terminated paths that outlive it and
    // null for the arguments it ignores.
    unsafe {
        // Nothing this namespace does propagates back to the host.
        if libc::mount(
            std::ptr::null(),
            root.as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ) != 0
        {
            return Err(os_error("make / private"));
        }
        if libc::mount(dir.as_ptr(), dir.as_ptr(), std::ptr::null(), libc::MS_BIND, std::ptr::null()) != 0 {
            return Err(os_error(&format!("bind {}", jail.dir.display())));
        }
        // A remount of a bind must keep the flags the kernel locked (in a user namespace):
        // start from the ones it has and add nosuid, nodev, noexec.
        let locked = umbra_sys::locked_mount_flags(&dir).map_err(|e| format!("jail: statvfs: {e}"))?;
        let flags = locked | libc::MS_REMOUNT | libc::MS_BIND | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
        if libc::mount(std::ptr::null(), dir.as_ptr(), std::ptr::null(), flags, std::ptr::null()) != 0 {
            return Err(os_error("remount the jail nosuid,nodev,noexec"));
        }
        if libc::chdir(dir.as_ptr()) != 0 {
            return Err(os_error("chdir"));
        }
        // pivot_root(".", "."): the old root ends up on top of the new one, then goes.
        if libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) == 0 {
            if libc::umount2(dot.as_ptr(), libc::MNT_DETACH) != 0 {
                return Err(os_error("detach the old root"));
            }
        } else if io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
            // The root is the initramfs (rootfs), which cannot be pivoted away: move the jail
            // over it and chroot, as switch_root does. The old root stays underneath, out of
            // reach: no descriptor to it is open, and chroot again needs a capability the
            // VMM is about to drop.
            if libc::mount(dot.as_ptr(), root.as_ptr(), std::ptr::null(), libc::MS_MOVE, std::ptr::null()) != 0 {
                return Err(os_error("move the jail over the initramfs root"));
            }
            if libc::chroot(dot.as_ptr()) != 0 {
                return Err(os_error("chroot"));
            }
        } else {
            return Err(os_error("pivot_root"));
        }
        if libc::chdir(root.as_ptr()) != 0 {
            return Err(os_error("chdir /"));
        }
        let name = b"umbra-vmm";
        if libc::sethostname(name.as_ptr().cast(), name.len()) != 0 {
            return Err(os_error("sethostname"));
        }
        for (resource, limit) in [(libc::RLIMIT_CORE, 0), (libc::RLIMIT_NOFILE, MAX_FDS)] {
            let rl = libc::rlimit { rlim_cur: limit, rlim_max: limit };
            if libc::setrlimit(resource, &rl) != 0 {
                return Err(os_error("setrlimit"));
            }
        }
        if !user_namespace {
            // While CAP_SETPCAP is still ours: nothing can ever regain a capability.
            for cap in 0..=63 {
                libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0);
            }
            if libc::setgroups(0, std::ptr::null()) != 0 {
                return Err(os_error("setgroups"));
            }
            if libc::setresgid(jail.gid, jail.gid, jail.gid) != 0 {
                return Err(os_error(&format!("setresgid {}", jail.gid)));
            }
            if libc::setresuid(jail.uid, jail.uid, jail.uid) != 0 {
                return Err(os_error(&format!("setresuid {}", jail.uid)));
            }
        }
    }
    landlock()
}

// Landlock (include/uapi/linux/landlock.h).
const LANDLOCK_CREATE_RULESET_VERSION: u32 = 1;
const LANDLOCK_RULE_PATH_BENEATH: libc::c_int = 1;
const ACCESS_FS_REMOVE_FILE: u64 = 1 << 5;

#[repr(C)]
struct RulesetAttr {
    handled_access_fs: u64,
    handled_access_net: u64,
    scoped: u64,
}

#[repr(C, packed)]
struct PathBeneathAttr {
    allowed_access: u64,
    parent_fd: i32,
}

/// The landlock ABI this kernel offers; `None` without landlock (not built, or not enabled).
pub fn landlock_abi() -> Result<Option<i64>, String> {
    // SAFETY: the version query takes a null attribute and size 0.
    let abi = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<RulesetAttr>(),
            0,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    if abi >= 1 {
        return Ok(Some(abi));
    }
    match io::Error::last_os_error().raw_os_error() {
        Some(libc::ENOSYS) | Some(libc::EOPNOTSUPP) => Ok(None),
        _ => Err(os_error("landlock version")),
    }
}

/// Restricts the process with landlock: every filesystem access the kernel's ABI knows is
/// handled and only removing a file beneath the jail's root (the VMM's own socket, at exit) is
/// allowed; from ABI 4 TCP bind and connect are handled too, from ABI 6 abstract Unix sockets
/// and signals are scoped to the jail. `None` when the kernel has no landlock.
fn landlock() -> Result<Option<i64>, String> {
    let abi = match landlock_abi() {
        Ok(Some(abi)) => abi,
        other => return other,
    };
    let fs_bits = match abi {
        1 => 13,     // EXECUTE ..= MAKE_SYM
        2 => 14,     // + REFER
        3 | 4 => 15, // + TRUNCATE
        _ => 16,     // + IOCTL_DEV
    };
    let attr = RulesetAttr {
        handled_access_fs: (1u64 << fs_bits) - 1,
        handled_access_net: if abi >= 4 { 0b11 } else { 0 },
        scoped: if abi >= 6 { 0b11 } else { 0 },
    };
    let size = match abi {
        1..=3 => 8,
        4 | 5 => 16,
        _ => std::mem::size_of::<RulesetAttr>(),
    };
    // SAFETY: `attr` is valid for `size` bytes, the size this ABI reads.
    let ruleset = unsafe { libc::syscall(libc::SYS_landlock_create_ruleset, &attr as *const RulesetAttr, size, 0) };
    if ruleset < 0 {
        return Err(os_error("landlock ruleset"));
    }
    let ruleset = ruleset as libc::c_int;
    // SAFETY: opening "/" as an O_PATH fd.
    let root = unsafe { libc::open(c"/".as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
    if root < 0 {
        return Err(os_error("open / for landlock"));
    }
    let rule = PathBeneathAttr { allowed_access: ACCESS_FS_REMOVE_FILE, parent_fd: root };
    // SAFETY: the rule is a valid path-beneath attribute for the call; the prctl takes integers;
    // restrict_self takes the ruleset fd; both fds are ours and closed after.
    unsafe {
        let added = libc::syscall(
            libc::SYS_landlock_add_rule,
            ruleset,
            LANDLOCK_RULE_PATH_BENEATH,
            &rule as *const PathBeneathAttr,
            0,
        );
        libc::close(root);
        if added != 0 {
            libc::close(ruleset);
            return Err(os_error("landlock rule"));
        }
        // restrict_self requires no_new_privs (or CAP_SYS_ADMIN); it is set again later anyway.
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            libc::close(ruleset);
            return Err(os_error("no_new_privs"));
        }
        let restricted = libc::syscall(libc::SYS_landlock_restrict_self, ruleset, 0);
        libc::close(ruleset);
        if restricted != 0 {
            return Err(os_error("landlock restrict_self"));
        }
    }
    Ok(Some(abi))
}

/// The parent's whole life after the fork: the VMM's uid and no privileges, wait for the VMM,
/// end as it ended (its exit status, or the signal that killed it).
pub fn relay(child: libc::pid_t, jail: &JailConfig) -> ! {
    // The kernel sends the child its parent-death SIGKILL with this process's credentials:
    // it must be the same user as the child (a root without capabilities may not signal it).
    // SAFETY: geteuid, setgroups with no groups, setresgid/setresuid take integers.
    unsafe {
        if libc::geteuid() == 0 {
            libc::setgroups(0, std::ptr::null());
            libc::setresgid(jail.gid, jail.gid, jail.gid);
            libc::setresuid(jail.uid, jail.uid, jail.uid);
        }
    }
    let _ = crate::seccomp::drop_privileges();
    let mut status = 0;
    loop {
        // SAFETY: waitpid writes the status into `status`.
        let r = unsafe { libc::waitpid(child, &mut status, 0) };
        if r == child {
            break;
        }
        if r < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            eprintln!("umbra-vmm: {}", os_error("wait for the VMM"));
            std::process::exit(crate::exit::VMM_ERROR_STATUS);
        }
    }
    if libc::WIFEXITED(status) {
        std::process::exit(libc::WEXITSTATUS(status));
    }
    let signal = libc::WTERMSIG(status);
    // SAFETY: no core file; the default action for the child's signal; raising it on ourselves.
    unsafe {
        let none = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        libc::setrlimit(libc::RLIMIT_CORE, &none);
        libc::signal(signal, libc::SIG_DFL);
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, signal);
        libc::sigprocmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        libc::raise(signal);
    }
    std::process::exit(128 + signal)
}
