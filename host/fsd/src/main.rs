//! `umbra-fsd`: serves one VM's shared folders.
//!
//! It enters a private mount namespace (and, when not root, a user namespace in which the
//! caller is root — so no privileges are needed), mounts a small tmpfs as the staging
//! directory, and runs `virtiofsd` on it. Each shared folder is bind-mounted into the staging
//! directory on request, **read-only on the host** for `ro` and `shadow` shares, so no guest —
//! not even root remounting in the guest — can write through it. Mounts live only in this
//! namespace: they vanish with the process, never touch the host's mount table, and need no
//! cleanup after a crash.
//!
//! Control protocol (`umbra_contract::fsd`, the runtime's side uses the same types): one JSON
//! object per line on stdin, one reply per line on stdout. `ready` once virtiofsd listens (or
//! `error` and exit 1); `add` shares a folder — `protect_git` pins every `.git` read-only
//! (`pins.rs`), `hide` refuses opening what those gitignore patterns match (`hide.rs`) — and
//! `remove` unshares one. Closing stdin ends it (and virtiofsd with it).

mod hide;
mod mounts;
mod namespace;
mod notify;
mod pins;
mod privileges;
mod seccomp;
mod shares;

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use umbra_contract::fsd::{FsdReply, FsdRequest};

const USAGE: &str = "usage: umbra-fsd --staging DIR --socket PATH [--virtiofsd BIN] [--log FILE] [--owner UID:GID]";

struct Args {
    staging: PathBuf,
    socket: PathBuf,
    virtiofsd: PathBuf,
    log: Option<PathBuf>,
    /// Who the guest's files belong to when this runs as root for a user.
    owner: Option<privileges::Owner>,
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let (mut staging, mut socket, mut virtiofsd, mut log, mut owner) = (None, None, None, None, None);
    while let Some(flag) = it.next() {
        let mut value = || it.next().map(PathBuf::from).ok_or_else(|| format!("{flag} needs a value; {USAGE}"));
        match flag.as_str() {
            "--staging" => staging = Some(value()?),
            "--socket" => socket = Some(value()?),
            "--virtiofsd" => virtiofsd = Some(value()?),
            "--log" => log = Some(value()?),
            "--owner" => owner = Some(value()?.to_string_lossy().parse()?),
            _ => return Err(format!("unknown argument {flag:?}; {USAGE}")),
        }
    }
    Ok(Args {
        staging: staging.ok_or(USAGE)?,
        socket: socket.ok_or(USAGE)?,
        virtiofsd: virtiofsd.unwrap_or_else(|| PathBuf::from("virtiofsd")),
        log,
        owner,
    })
}

fn reply(value: &FsdReply) {
    let line = serde_json::to_string(value).unwrap_or_else(|_| r#"{"reply":"error","error":"unprintable"}"#.into());
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn fail(msg: String) -> ExitCode {
    reply(&FsdReply::Error { error: msg });
    ExitCode::from(1)
}

/// `fd` moved to a descriptor number of 10 or more (close-on-exec): clear of 3, where the
/// listening socket is handed to virtiofsd.
fn high_fd(fd: std::os::fd::OwnedFd) -> Result<std::os::fd::OwnedFd, String> {
    use std::os::fd::{AsRawFd, FromRawFd};
    // SAFETY: F_DUPFD_CLOEXEC on a valid descriptor returns a new one or -1.
    let high = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 10) };
    if high < 0 {
        return Err(format!("duplicate a descriptor: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: `high` is a new descriptor that nothing else owns.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(high) })
}

/// Starts virtiofsd; with `open_check`, under the notifying filter of `notify.rs`, answered
/// with those rules from a thread started here (virtiofsd's loader opens its libraries first).
fn start_virtiofsd(args: &Args, open_check: Option<hide::Rules>) -> Result<Child, String> {
    let stderr = match &args.log {
        Some(p) => Stdio::from(std::fs::File::create(p).map_err(|e| format!("cannot create {}: {e}", p.display()))?),
        None => Stdio::inherit(),
    };
    // As the owner, virtiofsd may not reach its own binary (root's ~/.cargo/bin is 0700): it
    // execs it through a descriptor of its directory opened here, as root. The kernel lets a
    // process follow its own /proc/self/fd links whatever its user.
    let bin_dir = match (&args.owner, args.virtiofsd.parent(), args.virtiofsd.file_name()) {
        (Some(_), Some(dir), Some(name)) if args.virtiofsd.is_absolute() => {
            let dir = std::fs::File::open(dir).map_err(|e| format!("open {}: {e}", dir.display()))?;
            Some((high_fd(dir.into())?, name.to_owned()))
        }
        _ => None,
    };
    let mut cmd = match &bin_dir {
        Some((dir, name)) => {
            use std::os::fd::AsRawFd;
            let mut cmd = Command::new(PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd())).join(name));
            std::os::unix::process::CommandExt::arg0(&mut cmd, name);
            cmd
        }
        None => Command::new(&args.virtiofsd),
    };
    // As the owner, virtiofsd cannot create its socket in the VM's run directory (root's,
    // 0700): the socket is bound here and handed over as descriptor 3.
    let listener = match args.owner {
        Some(_) => Some(high_fd(
            std::os::unix::net::UnixListener::bind(&args.socket)
                .map_err(|e| format!("bind {}: {e}", args.socket.display()))?
                .into(),
        )?),
        None => None,
    };
    let listener_fd = listener.as_ref().map(std::os::fd::AsRawFd::as_raw_fd);
    let parent = std::process::id() as libc::pid_t;
    match listener_fd {
        Some(_) => cmd.arg("--fd=3"),
        None => cmd.arg("--socket-path").arg(&args.socket),
    };
    cmd.arg("--shared-dir").arg(&args.staging);
    cmd
        // This process already isolates the mounts; virtiofsd's namespace sandbox would hide
        // the folders bound in after it starts. Its chroot into the staging directory (in this
        // namespace, so later shares appear in it) keeps every name the guest sends beneath
        // the shares, whichever call virtiofsd resolves it with.
        .args(["--sandbox", "chroot", "--inode-file-handles=never", "--announce-submounts"])
        // Without CAP_FSETID the kernel clears set-id bits on every write and chown, as for
        // any unprivileged writer: a guest rewriting a set-id file the folder already holds
        // leaves a plain file. CAP_MKNOD (device nodes) and CAP_SETFCAP (file capabilities)
        // are refused by the no-privilege filter too; without them the kernel refuses as well.
        .arg("--modcaps=-fsetid:-mknod:-setfcap")
        // A restored VM's guest may hold an inode the host has since removed or replaced (an
        // editor's atomic save, a shadow apply): it gets errors on that inode alone, and a new
        // lookup by path finds the file, rather than the whole restore failing.
        .arg("--migration-on-error=guest-error")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr);
    // Built before the fork: the child may only make async-signal-safe calls.
    let no_privileges = privileges::filter()?;
    let userns = match args.owner {
        Some(_) => Some(privileges::user_namespace().map_err(|e| format!("pipes for virtiofsd: {e}"))?),
        None => None,
    };
    let child_side = userns.as_ref().map(|(child, _)| *child);
    let notify_filter = open_check.is_some().then(notify::filter);
    let pair = match open_check {
        Some(_) => Some(std::os::unix::net::UnixStream::pair().map_err(|e| format!("socketpair: {e}"))?),
        None => None,
    };
    let notify_socket = pair.as_ref().map(|(_, child)| std::os::fd::AsRawFd::as_raw_fd(child));
    // SAFETY: the pre_exec closure only makes async-signal-safe calls (prctl, dup2, unshare,
    // read, write, close, set*id, fork, seccomp) on data prepared before the fork.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // dup2 leaves the copy without close-on-exec.
            if let Some(fd) = listener_fd {
                if libc::dup2(fd, 3) != 3 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if let Some(child) = &child_side {
                child.enter()?;
                // Changing user cleared the death signal; set it again, and make sure the
                // parent did not die meanwhile (it would never send it).
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 || libc::getppid() != parent {
                    return Err(std::io::Error::other("umbra-fsd went away while virtiofsd started"));
                }
            }
            // virtiofsd is pid 1 of its own pid namespace: no process outside it can be named
            // (signalled, traced, found in /proc by pid) from it.
            if libc::unshare(libc::CLONE_NEWPID) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            umbra_sys::pidns::split(parent)?;
            privileges::install(&no_privileges)?;
            if let (Some(filter), Some(socket)) = (&notify_filter, notify_socket) {
                // The socket is this child's end of the pair, open until exec.
                notify::install_and_send(filter, socket)?;
            }
            Ok(())
        });
    }
    let guard = match (userns, args.owner) {
        (Some((_, parent)), Some(owner)) => {
            Some(parent.map_in_background(owner).map_err(|e| format!("cannot map virtiofsd's user: {e}"))?)
        }
        _ => None,
    };
    let spawned = cmd.spawn();
    if let Some(guard) = guard {
        guard.finish();
    }
    // virtiofsd has its own copy of the listening socket now.
    drop(listener);
    let mut child = spawned.map_err(|e| format!("cannot start {}: {e}", args.virtiofsd.display()))?;
    if let (Some((ours, theirs)), Some(rules)) = (pair, open_check) {
        drop(theirs);
        if let Err(e) = notify::receive(&ours, 10_000).and_then(|listener| notify::start(listener, rules)) {
            let _ = child.kill();
            return Err(e);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while !umbra_sys::unix_socket_listening(&args.socket) {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("virtiofsd exited during start-up ({status})"));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            return Err("virtiofsd did not create its socket within 10 s".into());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(child)
}

/// Assembles a share where the guest cannot see it — the folder, read-only folders nested in
/// it, pins for `.git` and ignored entries, the open check for ignored paths — then moves it
/// into the staging directory whole. Any failure undoes it before the guest ever saw it: a
/// share is never served less protected than asked, not even for a moment.
#[allow(clippy::too_many_arguments)]
fn add(
    staging: &std::path::Path,
    shares: &mut shares::Shares,
    hiding: &mut hide::Hiding,
    name: &str,
    source: &std::path::Path,
    read_only: bool,
    protect_git: bool,
    patterns: &[String],
    expected: Option<mounts::Identity>,
) -> Result<mounts::Identity, String> {
    let prep = shares::prep_dir(staging);
    let (root, prep_root) = (staging.join(name), prep.join(name));
    // Ignored paths are matched where virtiofsd opens them (the staging directory) and, for
    // the pins, where the tree is walked now (the preparation directory).
    let sets = match patterns.is_empty() {
        true => None,
        false => Some((
            umbra_policy::IgnoreSet::new(&root, patterns).map_err(|e| e.to_string())?,
            umbra_policy::IgnoreSet::new(&prep_root, patterns).map_err(|e| e.to_string())?,
        )),
    };
    let hider = match sets {
        Some(_) => Some(hiding.activate()?),
        None => None,
    };
    let (identity, nested) = shares.prepare(&prep, name, source, read_only, expected)?;
    let protect = || -> Result<(), String> {
        // A read-only share's .git is read-only already.
        let rules = pins::PinRules { git: protect_git && !read_only, hide: sets.as_ref().map(|(_, at_prep)| at_prep) };
        let pinned = pins::pin_tree(&prep_root, &rules)?;
        if let (Some((set, _)), Some(hider)) = (sets.clone(), hider) {
            // fanotify marks belong to the mounts: they move with the share.
            let mut marked = vec![prep_root.clone()];
            marked.extend(nested.iter().cloned());
            marked.extend(pinned);
            hider.hide(&root, set, &marked)?;
        }
        Ok(())
    };
    let done = protect().and_then(|()| shares.publish(staging, &prep, name));
    if let Err(e) = done {
        if let Some(hider) = hider {
            hider.forget(&root);
        }
        shares.abandon(&prep, name);
        return Err(e);
    }
    Ok(identity)
}

fn main() -> ExitCode {
    let mut args = match parse_args() {
        Ok(a) => a,
        Err(e) => return fail(e),
    };
    // virtiofsd as the owner resolves the staging directory's path itself (its chroot), and
    // the VM's run directory is root's alone: the staging directory moves to a fresh one in
    // /tmp (an empty host directory; in this namespace a tmpfs covers it, gone at exit).
    let moved_staging = args.owner.is_some();
    // SAFETY: geteuid has no preconditions. Read before this process enters its own user
    // namespace, where it is root either way.
    let privileged = unsafe { libc::geteuid() } == 0;
    if moved_staging {
        match shares::fresh_staging() {
            Ok(dir) => args.staging = dir,
            Err(e) => return fail(e),
        }
    }
    if let Err(e) = namespace::enter_private() {
        return fail(e);
    }
    if let Err(e) = shares::mount_both(&args.staging) {
        return fail(e);
    }
    // Hidden paths are matched against the canonical path of what is opened (read back from
    // /proc/self/fd): the shares' roots must be canonical too, or a link anywhere in the
    // staging path (a runtime directory under a linked /home) would match no rule at all.
    match std::fs::canonicalize(&args.staging) {
        Ok(canonical) => args.staging = canonical,
        Err(e) => return fail(format!("resolve the staging directory {}: {e}", args.staging.display())),
    }
    // Hidden files are refused by fanotify as root; without it (or when asked, to test it) by
    // checking virtiofsd's opens through seccomp notification, set up before virtiofsd starts.
    let open_check = !privileged || std::env::var("UMBRA_FSD_OPEN_CHECK").is_ok_and(|v| v == "notify");
    let notified = open_check.then(hide::Hider::notified);
    let rules = notified.as_ref().map(|(_, rules)| rules.clone());
    let mut virtiofsd = match start_virtiofsd(&args, rules) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    let stopping = watch_virtiofsd(virtiofsd.id());
    let started = match notified {
        Some((hider, _)) => Ok(hide::Hiding::Active(hider)),
        None => hide::Standby::start().map(hide::Hiding::Standby),
    };
    let mut hiding = match started {
        Ok(h) => h,
        Err(e) => {
            let _ = virtiofsd.kill();
            return fail(e);
        }
    };
    // Every thread exists now (virtiofsd runs in its own process, under its own filter).
    if let Err(e) = seccomp::install() {
        let _ = virtiofsd.kill();
        return fail(e);
    }
    reply(&FsdReply::Ready);

    let mut shares = shares::Shares::default();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        if line.trim().is_empty() {
            continue;
        }
        let result = match serde_json::from_str::<FsdRequest>(&line) {
            Err(e) => Err(format!("bad request: {e}")),
            Ok(FsdRequest::Add { name, source, read_only, protect_git, hide, identity }) => {
                add(&args.staging, &mut shares, &mut hiding, &name, &source, read_only, protect_git, &hide, identity)
                    .map(|identity| FsdReply::Shared { identity })
            }
            Ok(FsdRequest::Remove { name }) => {
                if let Some(h) = hiding.active() {
                    h.forget(&args.staging.join(&name));
                }
                shares.remove(&args.staging, &name).map(|()| FsdReply::Removed)
            }
        };
        match result {
            Ok(answer) => reply(&answer),
            Err(error) => reply(&FsdReply::Error { error }),
        }
    }
    stopping.store(true, std::sync::atomic::Ordering::SeqCst);
    let _ = virtiofsd.kill();
    let _ = virtiofsd.wait();
    if moved_staging {
        shares::remove_staging(&args.staging);
    }
    ExitCode::SUCCESS
}

/// A thread that ends this process when virtiofsd dies on its own (killed, or failed): the
/// VM's folders are gone then, and the runtime, which watches this process, must learn it (it
/// restarts the VM). virtiofsd also exits, cleanly, when its VMM disconnects: then the VMM's
/// own end is the news, and this process stays until the runtime closes its stdin. The thread
/// waits with WNOWAIT, so the main thread still reaps virtiofsd and its pid cannot be reused
/// meanwhile. It returns once the thread is about to wait (so the seccomp filter, installed
/// next on every thread, never meets it half-started); the flag marks an exit main asked for.
fn watch_virtiofsd(pid: u32) -> std::sync::Arc<std::sync::atomic::AtomicBool> {
    use std::sync::atomic::{AtomicBool, Ordering};
    let stopping = std::sync::Arc::new(AtomicBool::new(false));
    let flag = stopping.clone();
    let (started, waiting) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = started.send(());
        // SAFETY: waitid writes into the zeroed siginfo it is given.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        loop {
            // SAFETY: as above; `info` outlives the call.
            let r = unsafe { libc::waitid(libc::P_PID, pid, &mut info, libc::WEXITED | libc::WNOWAIT) };
            if r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                break;
            }
        }
        // SAFETY: si_status is valid for a CLD_* siginfo filled by waitid.
        let clean = info.si_code == libc::CLD_EXITED && unsafe { info.si_status() } == 0;
        if !clean && !flag.load(Ordering::SeqCst) {
            eprintln!("umbra-fsd: virtiofsd died; the shared folders are gone");
            std::process::exit(1);
        }
    });
    let _ = waiting.recv();
    stopping
}
