//! A namespace jail for a helper the runtime execs (vhost-device-vsock): set up between fork
//! and exec, so the helper starts inside it.
//!
//! - new mount, network, ipc and uts namespaces: no network at all (it needs none — its
//!   sockets are Unix sockets, reached by path), nothing shared with the host's IPC;
//! - the root is a small tmpfs holding read-only binds of `/usr` (and the merged-/usr links
//!   `/bin`, `/lib`, `/lib64`), the helper binary's directory, and one read-write bind: the
//!   directory with its sockets, at the same path, so its arguments need no rewriting;
//! - `no_new_privs` and an empty capability bounding set: the helper, root or not, execs with
//!   no capability and can never gain one (it cannot undo the mounts).
//!
//! Only as root (the namespaces need CAP_SYS_ADMIN); as another user the helper runs as before.
//! Everything the child does is prepared here first: between fork and exec only system calls
//! run, no allocation.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::process::Command;

/// One step of the child's set-up.
enum Step {
    /// mkdir, EEXIST ignored.
    Dir(CString),
    Symlink {
        target: CString,
        link: CString,
    },
    /// A bind mount of `source` on `target`, then (`read_only`) remounted read-only.
    Bind {
        source: CString,
        target: CString,
        read_only: bool,
    },
}

pub struct HelperJail {
    root: CString,
    steps: Vec<Step>,
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

impl HelperJail {
    /// Whether helpers are jailed here: as root, unless `UMBRA_HELPER_JAIL=off` (debugging).
    pub fn enabled() -> bool {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        root && std::env::var("UMBRA_HELPER_JAIL").map_or(true, |v| v != "off")
    }

    /// A jail rooted at `root` (an empty directory the caller made; the tmpfs goes there)
    /// exposing `binary`'s directory read-only and `writable` read-write.
    pub fn new(root: &Path, binary: &Path, writable: &Path) -> io::Result<Self> {
        let mut steps = Vec::new();
        let bind = |steps: &mut Vec<Step>, source: &Path, read_only: bool| -> io::Result<()> {
            for d in dirs_under(root, source) {
                steps.push(Step::Dir(c(&d)?));
            }
            let target = root.join(source.strip_prefix("/").unwrap_or(source));
            steps.push(Step::Bind { source: c(source)?, target: c(&target)?, read_only });
            Ok(())
        };
        bind(&mut steps, Path::new("/usr"), true)?;
        for link in ["bin", "lib", "lib64", "sbin"] {
            let host = Path::new("/").join(link);
            match std::fs::read_link(&host) {
                // Merged /usr: the same link inside.
                Ok(target) => steps.push(Step::Symlink { target: c(&target)?, link: c(&root.join(link))? }),
                Err(_) if host.is_dir() => bind(&mut steps, &host, true)?,
                Err(_) => {}
            }
        }
        let bin_dir = binary.parent().unwrap_or(Path::new("/"));
        if !bin_dir.starts_with("/usr") {
            bind(&mut steps, bin_dir, true)?;
        }
        bind(&mut steps, writable, false)?;
        Ok(Self { root: c(root)?, steps })
    }

    /// Makes `cmd`'s child enter the jail before it execs.
    pub fn apply(self, cmd: &mut Command) {
        use std::os::unix::process::CommandExt;
        // SAFETY: the closure makes only system calls (unshare, mount, mkdir, symlink, chdir,
        // pivot_root, umount2, prctl) on data prepared before the fork; it allocates nothing.
        unsafe {
            cmd.pre_exec(move || self.enter());
        }
    }

    fn enter(&self) -> io::Result<()> {
        let err = |_: ()| io::Error::last_os_error();
        let check = |r: libc::c_int| if r == 0 { Ok(()) } else { Err(err(())) };
        let null = std::ptr::null::<libc::c_char>();
        // SAFETY: system calls on NUL-terminated strings owned by `self`, alive for the call.
        unsafe {
            check(libc::unshare(libc::CLONE_NEWNS | libc::CLONE_NEWNET | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS))?;
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
                            return Err(err(()));
                        }
                    }
                    Step::Symlink { target, link } => check(libc::symlink(target.as_ptr(), link.as_ptr()))?,
                    Step::Bind { source, target, read_only } => {
                        check(libc::mount(
                            source.as_ptr(),
                            target.as_ptr(),
                            null,
                            libc::MS_BIND | libc::MS_REC,
                            std::ptr::null(),
                        ))?;
                        if *read_only {
                            let flags =
                                libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV;
                            check(libc::mount(null, target.as_ptr(), null, flags, std::ptr::null()))?;
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
            for cap in 0..=63 {
                libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0);
            }
            check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
