//! Hidden files (the policy's `ignore` patterns): their content never reaches the guest.
//!
//! virtiofsd reads every file through a path in this process's mount namespace. One fanotify
//! group marks each share's mount (and the pins inside it) for open-permission events: every
//! open virtiofsd makes there — for the guest's read, write, exec, or an overlay copy-up —
//! waits until [`Hider`]'s thread has matched the opened path against the share's patterns,
//! and a match is refused (the guest sees `EACCES`/`EPERM`). The check is by the path the file
//! is opened through, so it covers files the host creates after the share; ignored entries that
//! exist when the share starts are also pinned (`pins.rs`), so a guest cannot rename or link
//! them to a name no pattern matches. Permission events need `CAP_SYS_ADMIN` in the initial
//! user namespace: without root, virtiofsd's opens are checked against the same rules through
//! seccomp user notification instead (`notify.rs`), and no fanotify group is made.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use umbra_policy::IgnoreSet;

pub(crate) struct Rule {
    root: PathBuf,
    set: IgnoreSet,
}

pub(crate) type Rules = Arc<Mutex<Vec<Rule>>>;

pub struct Hider {
    /// The fanotify group; `None` when virtiofsd's opens are checked by seccomp notification
    /// (`notify.rs`), which reads the same rules.
    group: Option<Arc<OwnedFd>>,
    rules: Rules,
}

const PERM_EVENTS: u64 = libc::FAN_OPEN_PERM | libc::FAN_OPEN_EXEC_PERM;

/// The answering thread, started with umbra-fsd — before its seccomp filter, which allows no new
/// thread — and idle until the first share with patterns creates the group.
pub struct Standby {
    tx: std::sync::mpsc::Sender<(Arc<OwnedFd>, Rules)>,
}

impl Standby {
    pub fn start() -> Result<Standby, String> {
        let (tx, rx) = std::sync::mpsc::channel::<(Arc<OwnedFd>, Rules)>();
        let (running_tx, running) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("hide".into())
            .spawn(move || {
                let _ = running_tx.send(());
                if let Ok((group, rules)) = rx.recv() {
                    answer_loop(&group, &rules);
                }
            })
            .map_err(|e| format!("cannot start the hide thread: {e}"))?;
        // Wait until it runs: a thread's own start-up (robust list, rseq, its name) must happen
        // before the filter, which allows none of it.
        running.recv().map_err(|_| "the hide thread died at start".to_string())?;
        Ok(Standby { tx })
    }
}

/// The hiding machinery of one umbra-fsd: the idle thread until a share needs it, then the group.
pub enum Hiding {
    Standby(Standby),
    Active(Hider),
    /// Starting it failed once; the failure was reported to that share's request.
    Gone,
}

impl Hiding {
    /// The active group, created on first use.
    pub fn activate(&mut self) -> Result<&Hider, String> {
        if let Hiding::Standby(_) = self {
            let Hiding::Standby(standby) = std::mem::replace(self, Hiding::Gone) else { unreachable!() };
            *self = Hiding::Active(Hider::start(standby)?);
        }
        match self {
            Hiding::Active(hider) => Ok(hider),
            _ => Err("hiding files is unavailable: starting it failed before".into()),
        }
    }

    pub fn active(&self) -> Option<&Hider> {
        match self {
            Hiding::Active(hider) => Some(hider),
            _ => None,
        }
    }
}

impl Hider {
    /// Creates the fanotify group and hands it to the waiting thread.
    pub fn start(standby: Standby) -> Result<Self, String> {
        // SAFETY: fanotify_init takes flags only and returns a new fd or -1.
        let fd = unsafe {
            libc::fanotify_init(
                libc::FAN_CLASS_CONTENT | libc::FAN_CLOEXEC,
                (libc::O_RDONLY | libc::O_LARGEFILE | libc::O_CLOEXEC) as libc::c_uint,
            )
        };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            return Err(format!(
                "cannot hide ignored files: fanotify_init: {e} (permission events need umbra-fsd, and so umbrad or \
                 vmctl, to run as root)"
            ));
        }
        // SAFETY: fd is a new descriptor nothing else owns.
        let group = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
        let rules: Rules = Arc::default();
        standby.tx.send((group.clone(), rules.clone())).map_err(|_| "the hide thread has ended".to_string())?;
        Ok(Self { group: Some(group), rules })
    }

    /// Without root: the rules the open-check thread of `notify.rs` reads, which it is handed.
    pub fn notified() -> (Self, Rules) {
        let rules: Rules = Arc::default();
        (Self { group: None, rules: rules.clone() }, rules)
    }

    /// Hides what `set` matches below `root` (a share's mount point), on every mount in `mounts`
    /// (the share's and its pins').
    pub fn hide(&self, root: &Path, set: IgnoreSet, mounts: &[PathBuf]) -> Result<(), String> {
        self.rules.lock().unwrap().push(Rule { root: root.to_path_buf(), set });
        let Some(group) = &self.group else { return Ok(()) };
        for mount in mounts {
            let c = CString::new(mount.as_os_str().as_bytes()).map_err(|_| format!("{mount:?} has a NUL byte"))?;
            // SAFETY: the group fd is open, `c` is a valid NUL-terminated path.
            let rc = unsafe {
                libc::fanotify_mark(
                    group.as_raw_fd(),
                    libc::FAN_MARK_ADD | libc::FAN_MARK_MOUNT,
                    PERM_EVENTS | libc::FAN_ONDIR,
                    libc::AT_FDCWD,
                    c.as_ptr(),
                )
            };
            if rc != 0 {
                let e = std::io::Error::last_os_error();
                self.forget(root);
                return Err(format!("cannot watch opens in {}: fanotify_mark: {e}", mount.display()));
            }
        }
        Ok(())
    }

    /// Drops the rule of the share at `root` (its marks go with its mounts).
    pub fn forget(&self, root: &Path) {
        self.rules.lock().unwrap().retain(|r| r.root != root);
    }
}

/// Whether an open of `path` (a directory if `is_dir`) is refused.
pub(crate) fn refused(rules: &Rules, path: &Path, is_dir: bool) -> bool {
    let rules = rules.lock().unwrap();
    rules.iter().any(|r| path.starts_with(&r.root) && r.set.is_ignored(path, is_dir))
}

/// Reads events and answers each: allow, or deny for a hidden path — and deny whenever the
/// path cannot be told (fail closed).
fn answer_loop(group: &OwnedFd, rules: &Rules) {
    let meta_len = std::mem::size_of::<libc::fanotify_event_metadata>();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // SAFETY: buf is valid for writes of buf.len() bytes.
        let n = unsafe { libc::read(group.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            // Opens would wait forever: better to end the server (virtiofsd goes with it).
            eprintln!("umbra-fsd: reading fanotify events failed: {e}");
            std::process::abort();
        }
        let n = n as usize;
        let mut at = 0;
        while at + meta_len <= n {
            // SAFETY: at + meta_len <= n bytes were written by the kernel; read_unaligned copes
            // with any alignment.
            let meta: libc::fanotify_event_metadata = unsafe { std::ptr::read_unaligned(buf[at..].as_ptr().cast()) };
            let len = meta.event_len as usize;
            if len < meta_len || at + len > n {
                break;
            }
            at += len;
            if meta.fd < 0 {
                continue;
            }
            // SAFETY: the kernel opened this fd for us; we own and close it.
            let file = unsafe { OwnedFd::from_raw_fd(meta.fd) };
            if meta.mask & PERM_EVENTS == 0 {
                continue;
            }
            let allow = match describe(&file) {
                Some((path, is_dir)) => !refused(rules, &path, is_dir),
                None => false,
            };
            let response =
                libc::fanotify_response { fd: meta.fd, response: if allow { libc::FAN_ALLOW } else { libc::FAN_DENY } };
            // SAFETY: response is a plain struct of the size written.
            unsafe {
                libc::write(
                    group.as_raw_fd(),
                    (&response as *const libc::fanotify_response).cast(),
                    std::mem::size_of::<libc::fanotify_response>(),
                )
            };
            drop(file);
        }
    }
}

/// The path `file` was opened through, and whether it is a directory.
pub(crate) fn describe(file: &OwnedFd) -> Option<(PathBuf, bool)> {
    let link = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())).ok()?;
    let bytes = link.as_os_str().as_bytes();
    let path = match bytes.strip_suffix(b" (deleted)") {
        Some(b) => PathBuf::from(std::ffi::OsStr::from_bytes(b)),
        None => link,
    };
    // SAFETY: an all-zero stat is a valid out buffer for fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: the fd is open; st is a valid out pointer.
    if unsafe { libc::fstat(file.as_raw_fd(), &mut st) } != 0 {
        return None;
    }
    Some((path, st.st_mode & libc::S_IFMT == libc::S_IFDIR))
}
