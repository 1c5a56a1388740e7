//! Starting a child the way `posix_spawn` does: `clone(CLONE_VM | CLONE_VFORK)` onto a small
//! stack of its own, instead of `fork`.
//!
//! std's `Command` forks whenever there is a `pre_exec` hook (ours: setsid, cgroup join,
//! credentials, landlock, the exec gate) or a PATH in the child's environment. Forking the
//! multi-threaded agent copies its page tables, write-protects its memory (every thread then
//! takes copy-on-write faults) and has exec tear the copy down again: from the spawning
//! thread's clone to the child's exec took ~310 µs that way against ~80 µs this way (perf
//! tracepoints, exec round-trip bench, 2-core host), a round trip of ~1.1 ms. Sharing the
//! agent's memory instead costs none of that; the price is that the child, until its exec, may
//! only make system calls on memory prepared for it:
//! - everything it needs (paths, argv, envp, the candidates of the PATH search) is built here,
//!   before the clone, and only read by the child;
//! - it runs on its own stack, with every signal handler reset to the default before it
//!   unblocks signals, so no handler of the agent runs on the agent's memory in it;
//! - it calls no libc function that keeps process-wide state (no malloc, no `setuid` wrapper,
//!   which would signal the agent's threads): credentials change through raw syscalls;
//! - the calling thread is suspended until the child has exec'd or exited (CLONE_VFORK), so the
//!   buffers stay alive, and a failure comes back through memory: the errno the child stores.
//!
//! The program is looked up the way glibc's `execvp` (which std calls) looks it up: in the
//! child's own PATH, EACCES remembered and reported only if nothing else is found, and a file
//! without a `#!` line run by `/bin/sh`.

use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CString};
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicI32, Ordering};

/// The child's stack. It runs only the steps above, then execs; pages it never touches cost
/// nothing.
const STACK_SIZE: usize = 256 << 10;
/// Where the lookup goes when the environment has no PATH (glibc's `_CS_PATH`).
const CS_PATH: &str = "/bin:/usr/bin";
const SHELL: &str = "/bin/sh";

/// What to start.
pub struct ChildSpec<'a> {
    /// argv[0], also the program looked up in PATH when it has no `/`.
    pub argv: &'a [String],
    pub env: &'a BTreeMap<String, String>,
    pub cwd: Option<&'a str>,
    /// Made the child's descriptors 0, 1 and 2.
    pub stdio: [RawFd; 3],
    /// Stdin is a terminal to make the child's controlling terminal (after its setsid).
    pub controlling_tty: bool,
}

/// Everything the child reads, owned by the parent's frame while the child runs.
struct Prepared {
    candidates: Vec<CString>,
    /// `ENAMETOOLONG` when the program's name is too long to look up.
    lookup_error: c_int,
    argv: Vec<*const c_char>,
    /// `/bin/sh`, a slot for the script, argv[1..]: for a candidate without a `#!` line.
    script_argv: Vec<*const c_char>,
    envp: Vec<*const c_char>,
    cwd: Option<CString>,
    stdio: [RawFd; 3],
    controlling_tty: bool,
    shell: CString,
    /// Set by the child when a step or the exec failed; 0 after a successful exec.
    errno: AtomicI32,
}

type Restrict<'a> = &'a mut dyn FnMut() -> io::Result<()>;

/// The child's argument: what it reads and the hook it runs last.
struct ChildArgs<'a, 'b> {
    prepared: &'a mut Prepared,
    restrict: Restrict<'b>,
}

fn nul_error() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, "nul byte found in provided data")
}

fn cstring(s: impl Into<Vec<u8>>) -> io::Result<CString> {
    CString::new(s).map_err(|_| nul_error())
}

/// The paths glibc's `execvpe` would try, in order, and the error it fails with before trying
/// any.
fn candidates(program: &str, env: &BTreeMap<String, String>) -> io::Result<(Vec<CString>, c_int)> {
    if program.is_empty() {
        return Ok((Vec::new(), libc::ENOENT));
    }
    if program.contains('/') {
        return Ok((vec![cstring(program)?], 0));
    }
    if program.len() > libc::NAME_MAX as usize {
        return Ok((Vec::new(), libc::ENAMETOOLONG));
    }
    let path = env.get("PATH").map_or(CS_PATH, String::as_str);
    // glibc skips an entry that would not fit its PATH_MAX-bounded buffer.
    let longest = path.len().min(libc::PATH_MAX as usize - 1) + 1;
    let mut out = Vec::new();
    for dir in path.split(':').filter(|d| d.len() < longest) {
        // An empty entry is the current directory.
        let candidate = if dir.is_empty() { program.to_string() } else { format!("{dir}/{program}") };
        out.push(cstring(candidate)?);
    }
    Ok((out, libc::ENOENT))
}

fn prepare(spec: &ChildSpec, argv: &[CString], env: &[CString]) -> io::Result<Prepared> {
    let program = spec.argv.first().map_or("", String::as_str);
    let (candidates, lookup_error) = candidates(program, spec.env)?;
    let shell = cstring(SHELL)?;
    let mut argv_ptrs: Vec<*const c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    argv_ptrs.push(std::ptr::null());
    let mut script_argv = vec![shell.as_ptr(), std::ptr::null()];
    script_argv.extend(argv.iter().skip(1).map(|a| a.as_ptr()));
    script_argv.push(std::ptr::null());
    let mut envp: Vec<*const c_char> = env.iter().map(|e| e.as_ptr()).collect();
    envp.push(std::ptr::null());
    Ok(Prepared {
        candidates,
        lookup_error,
        argv: argv_ptrs,
        script_argv,
        envp,
        cwd: spec.cwd.map(cstring).transpose()?,
        stdio: spec.stdio,
        controlling_tty: spec.controlling_tty,
        shell,
        errno: AtomicI32::new(0),
    })
}

/// An anonymous mapping for the child's stack, with a guard page below it.
struct Stack {
    base: *mut c_void,
    len: usize,
}

impl Stack {
    fn new() -> io::Result<Self> {
        // SAFETY: sysconf has no memory effects.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        let len = STACK_SIZE + page;
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let stack = Self { base, len };
        // SAFETY: the lowest page of the mapping just made: an overflow faults instead of
        // writing into whatever lies below.
        if unsafe { libc::mprotect(base, page, libc::PROT_NONE) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(stack)
    }

    /// The initial stack pointer (the stack grows down); page-aligned.
    fn top(&self) -> *mut c_void {
        // SAFETY: one past the end of the mapping, which is what clone expects.
        unsafe { self.base.cast::<u8>().add(self.len).cast() }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // SAFETY: the mapping is ours, and the child no longer runs on it (it has exec'd or
        // exited before clone returned).
        unsafe { libc::munmap(self.base, self.len) };
    }
}

/// Blocks every signal in the calling thread until dropped, then restores its mask.
struct SignalsBlocked(libc::sigset_t);

impl SignalsBlocked {
    fn new() -> io::Result<Self> {
        // SAFETY: the sets are plain data filled in by sigfillset and pthread_sigmask.
        unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            let rc = libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
            if rc != 0 {
                return Err(io::Error::from_raw_os_error(rc));
            }
            Ok(Self(old))
        }
    }
}

impl Drop for SignalsBlocked {
    fn drop(&mut self) {
        // SAFETY: restores the mask saved in `new`.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.0, std::ptr::null_mut()) };
    }
}

/// Starts the child and returns its pid once it has exec'd. `restrict` runs in the child
/// after its setsid (and controlling terminal), just before the exec; it may only make system
/// calls on memory it was given (see the module paragraph). Errors carry the OS reason of the
/// step or the exec that failed, as std's `Command::spawn` does; a child that failed is reaped
/// here (call this with reaping paused).
pub fn spawn(spec: &ChildSpec, restrict: Restrict) -> io::Result<u32> {
    let argv = spec.argv.iter().map(|a| cstring(a.as_str())).collect::<io::Result<Vec<_>>>()?;
    let env = spec.env.iter().map(|(k, v)| cstring(format!("{k}={v}"))).collect::<io::Result<Vec<_>>>()?;
    let mut prepared = prepare(spec, &argv, &env)?;
    let stack = Stack::new()?;
    let mut args = ChildArgs { prepared: &mut prepared, restrict };
    let pid = {
        // No handler of the agent may run in the child before it has reset them all.
        let _blocked = SignalsBlocked::new()?;
        // SAFETY: `child` runs on `stack`, which is ours and unused by anyone else; with
        // CLONE_VFORK this thread stays suspended until the child has exec'd or exited, so
        // `args`, `prepared` and the strings they point into outlive every read the child
        // makes, and nothing else touches them meanwhile (they are this frame's). What the
        // child does on the shared memory is limited as the module paragraph says.
        unsafe {
            libc::clone(
                child,
                stack.top(),
                libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
                (&mut args as *mut ChildArgs).cast(),
            )
        }
    };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    let errno = prepared.errno.load(Ordering::Acquire);
    if errno != 0 {
        // Never exec'd: collect it now, as nobody waits for it.
        let mut status = 0;
        // SAFETY: waits for our own child, whose exit status nobody else wants.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        return Err(io::Error::from_raw_os_error(errno));
    }
    Ok(pid as u32)
}

/// The child, until its exec. Only system calls on prepared memory; never returns into
/// the agent's code (it execs or exits).
extern "C" fn child(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `ChildArgs` spawn passed, alive while it is suspended.
    let args = unsafe { &mut *arg.cast::<ChildArgs>() };
    let p = &mut *args.prepared;
    let errno = match setup(p, &mut *args.restrict) {
        Ok(()) => exec(p),
        Err(e) => e,
    };
    p.errno.store(if errno == 0 { libc::EINVAL } else { errno }, Ordering::Release);
    // SAFETY: ends this process without running any of the agent's exit handlers.
    unsafe { libc::_exit(127) }
}

fn last_errno() -> c_int {
    io::Error::last_os_error().raw_os_error().unwrap_or(libc::EINVAL)
}

/// Everything before the exec, in std's order: signal dispositions, stdio, cwd, then the
/// session, the controlling terminal and the caller's restrictions.
fn setup(p: &Prepared, restrict: &mut dyn FnMut() -> io::Result<()>) -> Result<(), c_int> {
    // SAFETY: sigaction, dup2, chdir, setsid and ioctl are plain system calls (signals are
    // blocked); every pointer passed is to this frame or to `p`, alive for the call.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        for signal in 1..=libc::SIGRTMAX() {
            if signal == libc::SIGKILL || signal == libc::SIGSTOP {
                continue;
            }
            // glibc refuses its own internal signals (EINVAL): they have nothing to reset.
            if libc::sigaction(signal, std::ptr::null(), &mut action) != 0 {
                continue;
            }
            // std resets SIGPIPE, which Rust programs ignore, for its children too.
            let handled = action.sa_sigaction != libc::SIG_DFL && action.sa_sigaction != libc::SIG_IGN;
            if handled || signal == libc::SIGPIPE {
                action.sa_sigaction = libc::SIG_DFL;
                action.sa_flags = 0;
                libc::sigaction(signal, &action, std::ptr::null_mut());
            }
        }
        for (target, &fd) in p.stdio.iter().enumerate() {
            // Already in place (std's start-up keeps 0-2 open, so only by a caller's choice):
            // dup2 would leave its close-on-exec flag, and the exec would close it.
            let placed =
                if fd == target as c_int { libc::fcntl(fd, libc::F_SETFD, 0) } else { libc::dup2(fd, target as c_int) };
            if placed < 0 {
                return Err(last_errno());
            }
        }
        if let Some(cwd) = &p.cwd {
            if libc::chdir(cwd.as_ptr()) != 0 {
                return Err(last_errno());
            }
        }
        if libc::setsid() < 0 {
            return Err(last_errno());
        }
        if p.controlling_tty && libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
            return Err(last_errno());
        }
    }
    restrict().map_err(|e| e.raw_os_error().unwrap_or(libc::EINVAL))?;
    // SAFETY: an empty set, as std leaves its children; handlers are all default by now.
    unsafe {
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
    }
    Ok(())
}

/// glibc's `execvpe` over the prepared candidates: returns the errno it fails with.
fn exec(p: &mut Prepared) -> c_int {
    let single = p.candidates.len() == 1 && p.lookup_error == 0;
    let mut got_eacces = false;
    let mut errno = p.lookup_error;
    for candidate in &p.candidates {
        let script = p.script_argv.as_mut_ptr();
        // SAFETY: NUL-terminated strings and null-terminated pointer arrays, all prepared
        // before the clone and alive until it returns.
        unsafe {
            libc::execve(candidate.as_ptr(), p.argv.as_ptr(), p.envp.as_ptr());
            errno = last_errno();
            if errno == libc::ENOEXEC {
                // No `#!` line: run it with the shell (slot 1 of `script_argv` is the script's).
                *script.add(1) = candidate.as_ptr();
                libc::execve(p.shell.as_ptr(), script, p.envp.as_ptr());
                errno = last_errno();
            }
        }
        if single {
            return errno;
        }
        match errno {
            libc::EACCES => got_eacces = true,
            libc::ENOENT | libc::ESTALE | libc::ENOTDIR | libc::ENODEV | libc::ETIMEDOUT => {}
            _ => return errno,
        }
    }
    if got_eacces {
        libc::EACCES
    } else {
        errno
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(path: Option<&str>) -> BTreeMap<String, String> {
        path.map(|p| [("PATH".to_string(), p.to_string())].into()).unwrap_or_default()
    }

    fn names(c: &[CString]) -> Vec<&str> {
        c.iter().map(|c| c.to_str().unwrap()).collect()
    }

    #[test]
    fn candidates_follow_execvp() {
        let (c, e) = candidates("ls", &env(Some("/a::/b"))).unwrap();
        assert_eq!((names(&c), e), (vec!["/a/ls", "ls", "/b/ls"], libc::ENOENT));
        let (c, _) = candidates("ls", &env(None)).unwrap();
        assert_eq!(names(&c), vec!["/bin/ls", "/usr/bin/ls"]);
        let (c, e) = candidates("./x", &env(Some("/a"))).unwrap();
        assert_eq!((names(&c), e), (vec!["./x"], 0));
        assert_eq!(candidates("", &env(None)).unwrap().1, libc::ENOENT);
        assert_eq!(candidates(&"x".repeat(300), &env(None)).unwrap().1, libc::ENAMETOOLONG);
        assert!(candidates("a", &env(Some("/a\0b"))).is_err());
    }

    fn run(argv: &[&str], env: BTreeMap<String, String>, cwd: Option<&str>) -> io::Result<i32> {
        let argv: Vec<String> = argv.iter().map(|a| a.to_string()).collect();
        let spec = ChildSpec { argv: &argv, env: &env, cwd, stdio: [0, 1, 2], controlling_tty: false };
        let pid = spawn(&spec, &mut || Ok(()))?;
        let mut status = 0;
        // SAFETY: waits for the child just started.
        assert_eq!(unsafe { libc::waitpid(pid as i32, &mut status, 0) }, pid as i32);
        Ok(libc::WEXITSTATUS(status))
    }

    #[test]
    fn runs_a_program_found_in_path_with_its_env_and_cwd() {
        let code = run(
            &["sh", "-c", r#"[ "$FOO" = bar ] && [ "$(pwd)" = / ] && exit 7"#],
            [("PATH".into(), "/nowhere:/usr/bin:/bin".into()), ("FOO".into(), "bar".into())].into(),
            Some("/"),
        )
        .unwrap();
        assert_eq!(code, 7);
    }

    #[test]
    fn failures_carry_the_os_error() {
        let e = run(&["no-such-program-umbra"], env(Some("/usr/bin:/bin")), None).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
        let e = run(&["true"], env(Some("/usr/bin:/bin")), Some("/no/such/dir")).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
        let argv = ["true".to_string()];
        let env = env(Some("/usr/bin:/bin"));
        let spec = ChildSpec { argv: &argv, env: &env, cwd: None, stdio: [0, 1, 2], controlling_tty: false };
        let e = spawn(&spec, &mut || Err(io::Error::from_raw_os_error(libc::EPERM))).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM));
    }

    #[test]
    fn a_file_without_a_shebang_runs_with_the_shell() {
        let dir = std::env::temp_dir().join(format!("umbra-vfork-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = dir.join("script");
        std::fs::write(&script, "exit 5\n").unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let code = run(&["script"], env(Some(dir.to_str().unwrap())), None);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(code.unwrap(), 5);
    }
}
