//! The jail of a helper the runtime execs (QEMU, vhost-device-vsock), entered between fork and
//! exec so the helper starts inside it — umbra-vmm's jail, for programs that are not ours:
//!
//! - new mount, pid, network, ipc and uts namespaces, plus a user namespace when the runtime is
//!   not root (it is what lets a user make the others; only the user itself is mapped, so the
//!   helper stays that user, not root inside);
//! - the root is a small tmpfs holding read-only binds of `/usr` (and the merged-/usr links),
//!   the helper binary's directory, the files it reads by name (kernel, initrd, rootfs), device
//!   nodes it needs (`/dev/kvm`), and at most one writable directory (vhost-device-vsock's
//!   sockets), each at its host path so no argument needs rewriting. Everything else it uses
//!   (the session disk, vhost-user sockets) it inherits as a descriptor;
//! - started as root it becomes [`HELPER_ID`] (`nobody`), with no supplementary group but the
//!   device's; in every case an empty capability bounding set, `no_new_privs`, no core dumps;
//! - a seccomp filter answering `EPERM` to what a device model never needs and a kernel exploit
//!   usually does (mounts, namespaces, ptrace, module and kexec loading, bpf, keyrings,
//!   io_uring, handle-based opens), `ENOSYS` to `clone3` (so libc falls back to `clone`, whose
//!   namespace flags the filter can see), and `EPERM` to the x32 system-call numbers.
//!
//! A pid namespace applies to children only, so the forked process splits once more
//! ([`umbra_sys::pidns::split`]): the helper execs as pid 1 of its namespace; the relay waits
//! and exits as it did. Both are in the process group [`super::Supervised`] kills.
//!
//! Everything the child does is prepared here first: between fork and exec only system calls
//! run, no allocation.

use std::ffi::CString;
use std::io;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition as Cond, SeccompFilter,
    SeccompRule,
};

/// The uid and gid a helper started by a root runtime runs as (`nobody`), as umbra-vmm's.
pub const HELPER_ID: u32 = umbra_contract::vm::NOBODY;

/// One step of the child's set-up.
enum Step {
    /// mkdir, EEXIST ignored.
    Dir(CString),
    /// An empty file to bind a file or device onto.
    File(CString),
    Symlink {
        target: CString,
        link: CString,
    },
    /// A bind of `source` on `target`; then, unless `remount` is 0, remounted with those flags
    /// (read-only binds: the source's locked flags plus ro, nosuid, nodev).
    Bind {
        source: CString,
        target: CString,
        remount: libc::c_ulong,
    },
}

/// Who the helper runs as.
enum Identity {
    /// The runtime is root: become `uid`/`gid` with `groups` only.
    Drop { uid: u32, gid: u32, groups: Vec<libc::gid_t> },
    /// The runtime is a user: a user namespace mapping that user (and no one else) to itself.
    Namespace { uid_map: CString, gid_map: CString },
}

/// Whether a helper running as `uid`, in the node's group, may open a device node for reading
/// and writing.
fn device_open_to(mode: u32, owner: u32, uid: u32) -> bool {
    (owner == uid && mode & 0o600 == 0o600) || mode & 0o060 == 0o060 || mode & 0o006 == 0o006
}

pub struct HelperJail {
    root: CString,
    steps: Vec<Step>,
    identity: Identity,
    /// Descriptors the helper inherits (their close-on-exec flag is cleared in the child).
    keep: Vec<RawFd>,
    filters: Vec<BpfProgram>,
}

fn c(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, format!("{} contains a NUL byte", path.display())))
}

/// Every directory from `/` down to `path` (itself included), as paths under `root`.
fn dirs_under(root: &Path, path: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut at = root.to_path_buf();
    for part in path.components() {
        if let Component::Normal(p) = part {
            at.push(p);
            out.push(at.clone());
        }
    }
    out
}

/// Why an unprivileged user cannot make a user namespace here, if a known switch says so.
fn user_namespaces_off() -> Option<String> {
    let read = |knob: &str| std::fs::read_to_string(format!("/proc/sys/{knob}")).ok().map(|v| v.trim().to_string());
    for (knob, off) in [("kernel/unprivileged_userns_clone", "0"), ("user/max_user_namespaces", "0")] {
        if read(knob).as_deref() == Some(off) {
            return Some(format!("sysctl {} is {off}", knob.replace('/', ".")));
        }
    }
    None
}

/// The flags a read-only remount of a bind of `path` needs: the ones the kernel locks on its
/// mount plus read-only, nosuid, nodev.
fn read_only_flags(path: &Path) -> io::Result<libc::c_ulong> {
    let locked = umbra_sys::locked_mount_flags(&c(path)?)?;
    Ok(locked | libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV)
}

impl HelperJail {
    /// Whether helpers are jailed: yes unless `UMBRA_HELPER_JAIL=off`, a switch for debugging
    /// (and for hosts without user namespaces), not for use.
    pub fn enabled() -> bool {
        std::env::var("UMBRA_HELPER_JAIL").map_or(true, |v| v != "off")
    }

    /// Whether the runtime is root, so helpers drop to [`HELPER_ID`].
    pub fn as_root() -> bool {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() == 0 }
    }

    /// A jail rooted at `root` (an empty directory the caller made; the tmpfs goes there)
    /// exposing `binary`'s directory read-only.
    pub fn new(root: &Path, binary: &Path) -> io::Result<Self> {
        // SAFETY: these calls have no preconditions.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        let identity = if uid == 0 {
            Identity::Drop { uid: HELPER_ID, gid: HELPER_ID, groups: Vec::new() }
        } else {
            // Between fork and exec only an errno gets back: say here what a refusal would mean.
            if let Some(why) = user_namespaces_off() {
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!(
                        "the helpers' jail needs a user namespace and {why}: allow them, run as root, or set \
                         UMBRA_HELPER_JAIL=off to start QEMU and vhost-device-vsock unjailed"
                    ),
                ));
            }
            Identity::Namespace {
                uid_map: CString::new(format!("{uid} {uid} 1")).expect("digits"),
                gid_map: CString::new(format!("{gid} {gid} 1")).expect("digits"),
            }
        };
        let mut jail = Self { root: c(root)?, steps: Vec::new(), identity, keep: Vec::new(), filters: filters()? };
        jail.read_only(Path::new("/usr"))?;
        for link in ["bin", "lib", "lib64", "sbin"] {
            let host = Path::new("/").join(link);
            match std::fs::read_link(&host) {
                // Merged /usr: the same link inside.
                Ok(target) => jail.steps.push(Step::Symlink { target: c(&target)?, link: c(&root.join(link))? }),
                Err(_) if host.is_dir() => jail.read_only(&host)?,
                Err(_) => {}
            }
        }
        let bin_dir = binary.parent().unwrap_or(Path::new("/"));
        if !bin_dir.starts_with("/usr") {
            jail.read_only(bin_dir)?;
        }
        Ok(jail)
    }

    fn root_path(&self) -> PathBuf {
        PathBuf::from(std::ffi::OsStr::from_bytes(self.root.as_bytes()))
    }

    fn bind(&mut self, source: &Path, remount: libc::c_ulong) -> io::Result<()> {
        let root = self.root_path();
        let is_dir = std::fs::metadata(source)?.is_dir();
        let mut dirs = dirs_under(&root, source);
        let target = if is_dir { dirs.last().cloned() } else { dirs.pop() }
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "cannot bind the root into a jail"))?;
        for d in dirs {
            self.steps.push(Step::Dir(c(&d)?));
        }
        if !is_dir {
            self.steps.push(Step::File(c(&target)?));
        }
        self.steps.push(Step::Bind { source: c(source)?, target: c(&target)?, remount });
        Ok(())
    }

    /// Shows `path` (a file or directory) read-only at the same path.
    pub fn read_only(&mut self, path: &Path) -> io::Result<()> {
        let flags = read_only_flags(path)?;
        self.bind(path, flags)
    }

    /// Shows directory `path` writable at the same path; as root, it is given to the helper's
    /// user (it must be a directory made for this helper alone).
    pub fn writable(&mut self, path: &Path) -> io::Result<()> {
        if let Identity::Drop { uid, gid, .. } = &self.identity {
            std::os::unix::fs::chown(path, Some(*uid), Some(*gid))?;
        }
        self.bind(path, 0)
    }

    /// Shows device node `path` (`/dev/kvm`) as it is; as root, the helper joins the node's
    /// group so that it may open it. A node only its owner may open (0600 root, as devtmpfs
    /// makes it where no udev rule ran) is refused here, saying so, rather than by the helper.
    pub fn device(&mut self, path: &Path) -> io::Result<()> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path)?;
        if let Identity::Drop { uid, groups, .. } = &mut self.identity {
            if !device_open_to(meta.mode(), meta.uid(), *uid) {
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!(
                        "{} is mode {:04o}, owner {}: the helper, run as uid {uid}, could open it only through \
                         its group; give the group read and write (udev's rule: GROUP=\"kvm\", MODE=\"0660\")",
                        path.display(),
                        meta.mode() & 0o7777,
                        meta.uid()
                    ),
                ));
            }
            groups.push(meta.gid());
        }
        self.bind(path, 0)
    }

    /// Lets the helper inherit `fd` under the same number (the caller keeps it open until the
    /// helper has started).
    pub fn inherit(&mut self, fd: RawFd) {
        self.keep.push(fd);
    }

    /// The child's part, after the fork: everything up to exec. Returns in the helper (pid 1 of
    /// its namespace); the relay never returns. `runtime` is the pid of the process that forked.
    ///
    /// # Safety
    /// Only between fork and exec: it makes system calls on data prepared by [`Self::new`].
    pub unsafe fn enter(&self, runtime: libc::pid_t) -> io::Result<()> {
        let err = || io::Error::last_os_error();
        let check = |r: libc::c_int| if r == 0 { Ok(()) } else { Err(err()) };
        let null = std::ptr::null::<libc::c_char>();
        // SAFETY: system calls on NUL-terminated strings and buffers owned by `self`, alive for
        // each call; fork in a child of a multi-threaded process, after which both sides make
        // only async-signal-safe calls.
        unsafe {
            let mut flags = libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWNET | libc::CLONE_NEWIPC;
            flags |= libc::CLONE_NEWUTS;
            if let Identity::Namespace { uid_map, gid_map } = &self.identity {
                check(libc::unshare(flags | libc::CLONE_NEWUSER))?;
                write_file(c"/proc/self/setgroups", b"deny")?;
                write_file(c"/proc/self/uid_map", uid_map.as_bytes())?;
                write_file(c"/proc/self/gid_map", gid_map.as_bytes())?;
            } else {
                check(libc::unshare(flags))?;
            }
            check(libc::mount(null, c"/".as_ptr(), null, libc::MS_REC | libc::MS_PRIVATE, std::ptr::null()))?;
            check(libc::mount(
                c"tmpfs".as_ptr(),
                self.root.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                c"mode=0755,size=1m".as_ptr().cast(),
            ))?;
            for step in &self.steps {
                match step {
                    Step::Dir(d) => {
                        if libc::mkdir(d.as_ptr(), 0o755) != 0 && *libc::__errno_location() != libc::EEXIST {
                            return Err(err());
                        }
                    }
                    Step::File(f) => {
                        let fd = libc::open(f.as_ptr(), libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC, 0o644);
                        if fd < 0 {
                            return Err(err());
                        }
                        libc::close(fd);
                    }
                    Step::Symlink { target, link } => check(libc::symlink(target.as_ptr(), link.as_ptr()))?,
                    Step::Bind { source, target, remount } => {
                        check(libc::mount(
                            source.as_ptr(),
                            target.as_ptr(),
                            null,
                            libc::MS_BIND | libc::MS_REC,
                            std::ptr::null(),
                        ))?;
                        if *remount != 0 {
                            check(libc::mount(null, target.as_ptr(), null, *remount, std::ptr::null()))?;
                        }
                    }
                }
            }
            check(libc::chdir(self.root.as_ptr()))?;
            if libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) == 0 {
                check(libc::umount2(c".".as_ptr(), libc::MNT_DETACH))?;
            } else {
                // An initramfs root cannot be pivoted: move the new root over it (switch_root).
                check(libc::mount(c".".as_ptr(), c"/".as_ptr(), null, libc::MS_MOVE, std::ptr::null()))?;
                check(libc::chroot(c".".as_ptr()))?;
            }
            check(libc::chdir(c"/".as_ptr()))?;
            let name = b"umbra-helper";
            check(libc::sethostname(name.as_ptr().cast(), name.len()))?;
            check(libc::setrlimit(libc::RLIMIT_CORE, &libc::rlimit { rlim_cur: 0, rlim_max: 0 }))?;
            // While CAP_SETPCAP is still ours: nothing can ever regain a capability.
            for cap in 0..=63 {
                libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0);
            }
            if let Identity::Drop { uid, gid, groups } = &self.identity {
                check(libc::setgroups(groups.len(), groups.as_ptr()))?;
                check(libc::setresgid(*gid, *gid, *gid))?;
                // Clears every capability: the relay is unprivileged too.
                check(libc::setresuid(*uid, *uid, *uid))?;
            }
            umbra_sys::pidns::split(runtime)?;
            for fd in &self.keep {
                check(libc::fcntl(*fd, libc::F_SETFD, 0))?;
            }
            check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
            for filter in &self.filters {
                let prog =
                    libc::sock_fprog { len: filter.len() as u16, filter: filter.as_ptr() as *mut libc::sock_filter };
                if libc::syscall(libc::SYS_seccomp, libc::SECCOMP_SET_MODE_FILTER, 0, &prog) != 0 {
                    return Err(err());
                }
            }
            Ok(())
        }
    }
}

/// Writes `data` to `path` with system calls only.
///
/// # Safety
/// Only raw system calls; safe between fork and exec.
unsafe fn write_file(path: &std::ffi::CStr, data: &[u8]) -> io::Result<()> {
    // SAFETY: a NUL-terminated path and a buffer alive for the calls.
    unsafe {
        let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let n = libc::write(fd, data.as_ptr().cast(), data.len());
        libc::close(fd);
        if n != data.len() as isize {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The system calls a helper never makes, by number.
fn denied() -> Vec<i64> {
    let mut nrs = vec![
        libc::SYS_mount,
        libc::SYS_umount2,
        libc::SYS_pivot_root,
        libc::SYS_chroot,
        libc::SYS_unshare,
        libc::SYS_setns,
        libc::SYS_ptrace,
        libc::SYS_process_vm_readv,
        libc::SYS_process_vm_writev,
        libc::SYS_kexec_load,
        libc::SYS_kexec_file_load,
        libc::SYS_init_module,
        libc::SYS_finit_module,
        libc::SYS_delete_module,
        libc::SYS_bpf,
        libc::SYS_perf_event_open,
        libc::SYS_userfaultfd,
        libc::SYS_keyctl,
        libc::SYS_add_key,
        libc::SYS_request_key,
        libc::SYS_swapon,
        libc::SYS_swapoff,
        libc::SYS_reboot,
        libc::SYS_acct,
        libc::SYS_open_by_handle_at,
        libc::SYS_name_to_handle_at,
        libc::SYS_io_uring_setup,
        libc::SYS_io_uring_enter,
        libc::SYS_io_uring_register,
        libc::SYS_fsopen,
        libc::SYS_fsconfig,
        libc::SYS_fsmount,
        libc::SYS_fspick,
        libc::SYS_move_mount,
        libc::SYS_open_tree,
        libc::SYS_mount_setattr,
    ];
    #[cfg(target_arch = "x86_64")]
    nrs.extend([libc::SYS_iopl, libc::SYS_ioperm]);
    nrs
}

/// The namespace flags a `clone` may not carry.
const NEW_NAMESPACES: [libc::c_int; 7] = [
    libc::CLONE_NEWNS,
    libc::CLONE_NEWUSER,
    libc::CLONE_NEWPID,
    libc::CLONE_NEWNET,
    libc::CLONE_NEWIPC,
    libc::CLONE_NEWUTS,
    libc::CLONE_NEWCGROUP,
];

/// The helper's filters, in the order they are installed.
fn filters() -> io::Result<Vec<BpfProgram>> {
    let bad = |e: String| io::Error::other(format!("the helper's seccomp filter: {e}"));
    let arch: seccompiler::TargetArch = std::env::consts::ARCH.try_into().map_err(|e| bad(format!("{e:?}")))?;
    let mut rules: std::collections::BTreeMap<i64, Vec<SeccompRule>> =
        denied().into_iter().map(|nr| (nr, Vec::new())).collect();
    let clone_flags = NEW_NAMESPACES
        .iter()
        .map(|flag| {
            let flag = *flag as u64;
            // x86_64 and arm64 both take the flags first.
            let cond = Cond::new(0, Len::Qword, Op::MaskedEq(flag), flag).expect("argument 0");
            SeccompRule::new(vec![cond]).expect("one condition")
        })
        .collect();
    rules.insert(libc::SYS_clone, clone_flags);
    let deny = SeccompFilter::new(rules, SeccompAction::Allow, SeccompAction::Errno(libc::EPERM as u32), arch)
        .map_err(|e| bad(e.to_string()))?;
    let clone3 = SeccompFilter::new(
        [(libc::SYS_clone3, Vec::new())].into_iter().collect(),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )
    .map_err(|e| bad(e.to_string()))?;
    let mut out: Vec<BpfProgram> = vec![
        deny.try_into().map_err(|e: seccompiler::BackendError| bad(e.to_string()))?,
        clone3.try_into().map_err(|e: seccompiler::BackendError| bad(e.to_string()))?,
    ];
    #[cfg(target_arch = "x86_64")]
    out.push(no_x32());
    Ok(out)
}

/// x32 system calls are x86_64 numbers with bit 30 set: a filter matching numbers alone would
/// let them through.
#[cfg(target_arch = "x86_64")]
fn no_x32() -> BpfProgram {
    const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
    const X32_SYSCALL_BIT: u32 = 0x4000_0000;
    let stmt = |code: u32, k: u32| seccompiler::sock_filter { code: code as u16, jt: 0, jf: 0, k };
    let jump = |code: u32, k: u32, jt: u8, jf: u8| seccompiler::sock_filter { code: code as u16, jt, jf, k };
    vec![
        // seccomp_data.arch
        stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 4),
        jump(libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K, AUDIT_ARCH_X86_64, 0, 3),
        // seccomp_data.nr
        stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0),
        jump(libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K, X32_SYSCALL_BIT, 0, 1),
        stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ERRNO | libc::EPERM as u32),
        stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ALLOW),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_only_its_owner_opens_is_not_shown_to_another_uid() {
        // devtmpfs's /dev/kvm where no udev rule ran, Debian's, systemd's default.
        assert!(!device_open_to(0o600, 0, 65534));
        assert!(device_open_to(0o660, 0, 65534));
        assert!(device_open_to(0o666, 0, 65534));
        assert!(device_open_to(0o600, 65534, 65534));
        assert!(!device_open_to(0o640, 0, 65534), "read alone is not enough for KVM");
    }

    #[test]
    fn every_directory_down_to_a_path_is_made_under_the_root() {
        let dirs = dirs_under(Path::new("/j"), Path::new("/tmp/umbra-0/vms/x/vsock"));
        let want: Vec<PathBuf> =
            ["/j/tmp", "/j/tmp/umbra-0", "/j/tmp/umbra-0/vms", "/j/tmp/umbra-0/vms/x", "/j/tmp/umbra-0/vms/x/vsock"]
                .iter()
                .map(PathBuf::from)
                .collect();
        assert_eq!(dirs, want);
    }

    /// Runs `probe` jailed (as the helper would run) and returns its output and exit status.
    fn jailed(script: &str) -> (String, std::process::ExitStatus) {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir(&root).unwrap();
        let shared = dir.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        let sh = Path::new("/bin/sh");
        let mut jail = HelperJail::new(&root, sh).unwrap();
        jail.writable(&shared).unwrap();
        let mut cmd = std::process::Command::new(sh);
        cmd.arg("-c").arg(script.replace("SHARED", &shared.display().to_string()));
        cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
        // SAFETY: `enter` is made for this place.
        unsafe {
            let me = libc::getpid();
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || jail.enter(me));
        }
        let out = cmd.output().unwrap();
        (String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr), out.status)
    }

    #[test]
    fn a_jailed_helper_sees_only_its_files_as_pid_one_without_privilege() {
        let (out, status) = jailed(
            "echo pid=$$; id -u; ls /; echo hi > SHARED/f && cat SHARED/f; \
             grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status 2>&1 || echo noproc; \
             hostname; exit 7",
        );
        assert_eq!(status.code(), Some(7), "{out}");
        assert!(out.contains("pid=1\n"), "{out}");
        // SAFETY: geteuid has no preconditions.
        let uid = if HelperJail::as_root() { HELPER_ID } else { unsafe { libc::geteuid() } };
        assert!(out.contains(&format!("\n{uid}\n")), "{out}");
        assert!(out.contains("hi\n"), "{out}");
        // No /proc, /etc or /home: only what the jail binds.
        assert!(!out.contains("etc") && !out.contains("home"), "{out}");
        assert!(out.contains("noproc"), "{out}");
        assert!(out.contains("umbra-helper"), "{out}");
    }

    #[test]
    fn a_jailed_helper_cannot_mount_or_make_a_namespace() {
        // util-linux's `unshare` and `mount`: the filter refuses both.
        let (out, status) = jailed("unshare -U true && echo UNSHARED; mount -t tmpfs t SHARED && echo MOUNTED; exit 3");
        assert!(!out.contains("UNSHARED") && !out.contains("MOUNTED"), "{out}");
        assert!(out.contains("Operation not permitted"), "{out}");
        assert_eq!(status.code(), Some(3), "{out}");
    }
}
