//! No host privilege through a share: what virtiofsd may create on the guest's behalf.
//!
//! virtiofsd writes the host folder with whatever rights it runs with. A guest that is root in
//! its VM asks it for a setuid binary, a block device or a file capability; on the host such a
//! file belongs to whoever can reach the folder, so no local user may find one there. The
//! kernel enforces it, not a filter of ours in virtiofsd's request path:
//!
//! - **A seccomp filter installed between fork and exec** (kept across exec, stacked under
//!   virtiofsd's own) answers `EPERM` to every call that would make a privilege: `mknod` of a
//!   block or character device; `chmod`, `fchmod`, `fchmodat`, `fchmodat2`, and `open`/`creat`
//!   with `O_CREAT` or `O_TMPFILE`, whose mode has the setuid or setgid bit; and every
//!   `*setxattr` (file capabilities are `security.capability`; virtiofsd runs without
//!   `--xattr` anyway). `openat2` is refused as well, so virtiofsd falls back to `openat`,
//!   whose mode argument a filter can read (`openat2` keeps it in a struct it cannot).
//! - **Ownership** (when the runtime runs as root on a user's behalf, `--owner`): virtiofsd
//!   runs in a user namespace whose root is that user, so a file the guest creates belongs to
//!   the user, a `chown` to root fails, and the kernel refuses device nodes outright.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition as Cond, SeccompFilter,
    SeccompRule,
};

const SETID: [u64; 2] = [libc::S_ISUID as u64, libc::S_ISGID as u64];
/// `fchmodat2` (Linux 6.6); the same number on every architecture.
const SYS_FCHMODAT2: i64 = 452;
/// `setxattrat` (Linux 6.13).
const SYS_SETXATTRAT: i64 = 463;

fn masked(arg: u8, mask: u64, value: u64) -> Cond {
    Cond::new(arg, Len::Dword, Op::MaskedEq(mask), value).expect("argument index below 6")
}

/// Rules matching a set-id bit in argument `mode_arg`, ANDed with `also`.
fn setid_in(mode_arg: u8, also: &[Cond]) -> Vec<SeccompRule> {
    SETID
        .iter()
        .map(|bit| {
            let mut conds = also.to_vec();
            conds.push(masked(mode_arg, *bit, *bit));
            SeccompRule::new(conds).expect("conditions")
        })
        .collect()
}

/// The filter, as BPF for this architecture: `EPERM` for what would make a privilege.
pub fn filter() -> Result<BpfProgram, String> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    let creating = [libc::O_CREAT as u64, libc::O_TMPFILE as u64 & !(libc::O_DIRECTORY as u64)];
    let mut open_rules = Vec::new();
    for flag in creating {
        open_rules.extend(setid_in(3, &[masked(2, flag, flag)]));
    }
    rules.insert(libc::SYS_openat, open_rules);
    rules.insert(libc::SYS_openat2, vec![]);
    rules.insert(libc::SYS_fchmod, setid_in(1, &[]));
    rules.insert(libc::SYS_fchmodat, setid_in(2, &[]));
    rules.insert(SYS_FCHMODAT2, setid_in(2, &[]));
    let mut mknod_rules = setid_in(2, &[]);
    for kind in [libc::S_IFCHR, libc::S_IFBLK] {
        mknod_rules.push(SeccompRule::new(vec![masked(2, libc::S_IFMT as u64, kind as u64)]).expect("conditions"));
    }
    rules.insert(libc::SYS_mknodat, mknod_rules);
    #[cfg(target_arch = "x86_64")]
    {
        let mut open_rules = Vec::new();
        for flag in creating {
            open_rules.extend(setid_in(2, &[masked(1, flag, flag)]));
        }
        rules.insert(libc::SYS_open, open_rules);
        rules.insert(libc::SYS_creat, setid_in(1, &[]));
        rules.insert(libc::SYS_chmod, setid_in(1, &[]));
        let mut mknod_rules = setid_in(1, &[]);
        for kind in [libc::S_IFCHR, libc::S_IFBLK] {
            mknod_rules.push(SeccompRule::new(vec![masked(1, libc::S_IFMT as u64, kind as u64)]).expect("conditions"));
        }
        rules.insert(libc::SYS_mknod, mknod_rules);
        rules.insert(libc::SYS_setxattr, vec![]);
        rules.insert(libc::SYS_lsetxattr, vec![]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        rules.insert(libc::SYS_setxattr, vec![]);
        rules.insert(libc::SYS_lsetxattr, vec![]);
    }
    // A rename that leaves a whiteout behind makes a character device (0:0) in the folder,
    // with no CAP_MKNOD needed; a guest's overlay never asks it of a share (shares are lower
    // layers only).
    let whiteout = libc::RENAME_WHITEOUT as u64;
    rules.insert(libc::SYS_renameat2, vec![SeccompRule::new(vec![masked(4, whiteout, whiteout)]).expect("conditions")]);
    rules.insert(libc::SYS_fsetxattr, vec![]);
    rules.insert(SYS_SETXATTRAT, vec![]);
    let arch = std::env::consts::ARCH.try_into().map_err(|e| format!("seccomp: {e:?}"))?;
    let filter = SeccompFilter::new(rules, SeccompAction::Allow, SeccompAction::Errno(libc::EPERM as u32), arch)
        .map_err(|e| format!("the no-privilege filter: {e}"))?;
    filter.try_into().map_err(|e| format!("the no-privilege filter: {e}"))
}

/// Installs `program` on the calling thread, after `no_new_privs`. Only async-signal-safe
/// calls: it runs between fork and exec.
///
/// # Safety
/// `program` must be a valid BPF program (from [`filter`]) that outlives the call.
pub unsafe fn install(program: &BpfProgram) -> std::io::Result<()> {
    // SAFETY: prctl with constant arguments.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let prog = libc::sock_fprog { len: program.len() as u16, filter: program.as_ptr() as *mut libc::sock_filter };
    // SAFETY: `prog` points at `program`, whose layout seccompiler defines as the kernel's
    // sock_filter; the kernel copies it during the call.
    if unsafe { libc::syscall(libc::SYS_seccomp, libc::SECCOMP_SET_MODE_FILTER, 0, &prog as *const libc::sock_fprog) }
        != 0
    {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The user a root runtime acts for (`--owner UID:GID`): what the guest creates is theirs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

impl std::str::FromStr for Owner {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("--owner takes UID:GID, not {s:?}");
        let (uid, gid) = s.split_once(':').ok_or_else(bad)?;
        let owner = Owner { uid: uid.parse().map_err(|_| bad())?, gid: gid.parse().map_err(|_| bad())? };
        if owner.uid == 0 || owner.gid == 0 {
            return Err("--owner must not be root: it is who the guest's files belong to".into());
        }
        Ok(owner)
    }
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into `fds`.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors are new and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Puts a child into a user namespace whose root is `owner`: the child makes the namespace
/// between fork and exec ([`ChildSide::enter`]) and waits; a thread of the parent writes its
/// uid and gid maps (only a process privileged outside may map another user) and lets it go
/// on. The child execs as root in the namespace, which is `owner` on the host.
pub fn user_namespace() -> std::io::Result<(ChildSide, ParentSide)> {
    let (ready_r, ready_w) = pipe()?;
    let (go_r, go_w) = pipe()?;
    let child = ChildSide { ready_w: ready_w.as_raw_fd(), go_r: go_r.as_raw_fd(), go_w: go_w.as_raw_fd() };
    Ok((child, ParentSide { ready_r, ready_w, go_r, go_w }))
}

/// The descriptors the child uses (owned by [`ParentSide`], inherited across fork).
#[derive(Clone, Copy)]
pub struct ChildSide {
    ready_w: i32,
    go_r: i32,
    go_w: i32,
}

impl ChildSide {
    /// Only async-signal-safe calls: it runs between fork and exec.
    pub fn enter(&self) -> std::io::Result<()> {
        // SAFETY: unshare, getpid, close, write and read of inherited descriptors on local
        // buffers, and set*id calls.
        unsafe {
            if libc::unshare(libc::CLONE_NEWUSER) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Our copy of the parent's end would keep the read below from ever seeing EOF.
            libc::close(self.go_w);
            let pid = libc::getpid().to_ne_bytes();
            if libc::write(self.ready_w, pid.as_ptr().cast(), pid.len()) != pid.len() as isize {
                return Err(std::io::Error::last_os_error());
            }
            let mut byte = 0u8;
            if libc::read(self.go_r, (&mut byte as *mut u8).cast(), 1) != 1 {
                return Err(std::io::Error::other("the parent did not map the user namespace"));
            }
            // unshare kept our host credentials (root's, with root's groups): become the
            // namespace's root, which the map makes the owner on the host, with no other group.
            if libc::setgroups(0, std::ptr::null()) != 0
                || libc::setresgid(0, 0, 0) != 0
                || libc::setresuid(0, 0, 0) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(())
    }
}

pub struct ParentSide {
    ready_r: OwnedFd,
    ready_w: OwnedFd,
    go_r: OwnedFd,
    go_w: OwnedFd,
}

impl ParentSide {
    /// Starts the thread that maps the child once it has made its namespace. Call before
    /// spawning; drop the returned guard once the spawn returned.
    pub fn map_in_background(self, owner: Owner) -> std::io::Result<MapGuard> {
        let ParentSide { ready_r, ready_w, go_r, go_w } = self;
        let thread = std::thread::Builder::new().name("userns-map".into()).spawn(move || {
            let mut pid = [0u8; 4];
            let mut file = std::fs::File::from(ready_r);
            if std::io::Read::read_exact(&mut file, &mut pid).is_err() {
                return; // the child failed before its namespace existed
            }
            let pid = i32::from_ne_bytes(pid);
            let mapped = std::fs::write(format!("/proc/{pid}/uid_map"), format!("0 {} 1", owner.uid))
                .and_then(|_| std::fs::write(format!("/proc/{pid}/gid_map"), format!("0 {} 1", owner.gid)));
            match mapped {
                Ok(()) => {
                    let _ = std::io::Write::write_all(&mut std::fs::File::from(go_w), &[1]);
                }
                Err(e) => {
                    eprintln!("umbra-fsd: cannot map virtiofsd's user namespace to {owner:?}: {e}");
                    drop(go_w);
                }
            }
        })?;
        Ok(MapGuard { ready_w, go_r, thread })
    }
}

/// The parent's copies of the child's ends, and the mapping thread.
pub struct MapGuard {
    ready_w: OwnedFd,
    go_r: OwnedFd,
    thread: std::thread::JoinHandle<()>,
}

impl MapGuard {
    /// Once the spawn returned: drops the parent's copies (so a child that died early ends the
    /// thread's wait) and waits for the thread, which must be gone before umbra-fsd's own
    /// seccomp filter (a thread's exit makes calls the filter does not allow).
    pub fn finish(self) {
        drop(self.ready_w);
        drop(self.go_r);
        let _ = self.thread.join();
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    /// Runs `f` in a forked child under the filter; returns the child's exit code.
    fn in_filtered_child(f: impl FnOnce() -> i32) -> i32 {
        let program = super::filter().unwrap();
        // SAFETY: the child only makes system calls and exits; the parent waits for it.
        match unsafe { libc::fork() } {
            0 => {
                // SAFETY: `program` came from `filter` and lives until the child exits.
                if unsafe { super::install(&program) }.is_err() {
                    // SAFETY: _exit in the forked child.
                    unsafe { libc::_exit(99) };
                }
                let code = f();
                // SAFETY: as above.
                unsafe { libc::_exit(code) }
            }
            pid => {
                let mut status = 0;
                // SAFETY: waits for our own child.
                unsafe { libc::waitpid(pid, &mut status, 0) };
                libc::WEXITSTATUS(status)
            }
        }
    }

    fn errno() -> i32 {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }

    #[test]
    fn set_id_bits_devices_and_xattrs_are_refused_and_plain_files_are_not() {
        let dir = std::env::temp_dir().join(format!("umbra-fsd-priv-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let c = |name: &str| std::ffi::CString::new(dir.join(name).to_str().unwrap()).unwrap();
        let (plain, suid, dev, fifo) = (c("plain"), c("suid"), c("dev"), c("fifo"));
        let code = in_filtered_child(|| {
            // SAFETY: plain system calls on NUL-terminated paths.
            unsafe {
                let fd = libc::open(plain.as_ptr(), libc::O_CREAT | libc::O_WRONLY, 0o755);
                if fd < 0 {
                    return 1;
                }
                if libc::fchmod(fd, 0o4755) == 0 || errno() != libc::EPERM {
                    return 2;
                }
                if libc::chmod(plain.as_ptr(), 0o2755) == 0 || errno() != libc::EPERM {
                    return 3;
                }
                if libc::chmod(plain.as_ptr(), 0o700) != 0 {
                    return 4;
                }
                if libc::open(suid.as_ptr(), libc::O_CREAT | libc::O_WRONLY, 0o4755) >= 0 || errno() != libc::EPERM {
                    return 5;
                }
                if libc::mknod(dev.as_ptr(), libc::S_IFBLK | 0o666, libc::makedev(7, 0)) == 0 || errno() != libc::EPERM
                {
                    return 6;
                }
                if libc::mknod(dev.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) == 0 || errno() != libc::EPERM
                {
                    return 7;
                }
                if libc::mknod(fifo.as_ptr(), libc::S_IFIFO | 0o644, 0) != 0 {
                    return 8;
                }
                let (from, to) = (c("from"), c("to"));
                libc::close(libc::open(from.as_ptr(), libc::O_CREAT | libc::O_WRONLY, 0o644));
                let renamed = |flags: libc::c_uint| {
                    libc::syscall(
                        libc::SYS_renameat2,
                        libc::AT_FDCWD,
                        from.as_ptr(),
                        libc::AT_FDCWD,
                        to.as_ptr(),
                        flags,
                    )
                };
                if renamed(libc::RENAME_WHITEOUT) == 0 || errno() != libc::EPERM {
                    return 10;
                }
                if renamed(libc::RENAME_NOREPLACE) != 0 {
                    return 11;
                }
                let name = c"security.capability";
                if libc::setxattr(plain.as_ptr(), name.as_ptr(), [1u8].as_ptr().cast(), 1, 0) == 0
                    || errno() != libc::EPERM
                {
                    return 9;
                }
            }
            0
        });
        let plain_mode = std::fs::metadata(dir.join("plain")).map(|m| m.permissions().mode() & 0o7777);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(code, 0, "step {code} of the child failed");
        assert_eq!(plain_mode.unwrap(), 0o700);
    }
}
