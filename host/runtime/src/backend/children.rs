//! Helper processes of a VM (QEMU, vhost daemons) that can never outlive it.
//!
//! Three layers, because each covers a way the others fail: the child asks the kernel to
//! SIGKILL it when its parent dies (PR_SET_PDEATHSIG — covers our SIGKILL), it runs in its own
//! process group (so a kill reaches anything it forked), and dropping the handle kills and
//! reaps it (covers normal teardown and errors).
//!
//! PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process. In a
//! multi-threaded daemon a helper spawned from a pool thread that is later retired would be
//! killed with it, so every helper is forked by one keeper thread that lives as long as the
//! process.

use std::io;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus};
use std::sync::{mpsc, Mutex, OnceLock};
use std::time::{Duration, Instant};

#[cfg(target_os = "linux")]
pub type Jail = super::helper_jail::HelperJail;
/// No helper jail off Linux.
#[cfg(not(target_os = "linux"))]
pub enum Jail {}

type SpawnJob = (Command, mpsc::SyncSender<io::Result<Child>>);

/// Forks `cmd` on the keeper thread (see the module docs) and returns the child.
fn spawn_on_keeper(cmd: Command) -> io::Result<Child> {
    static KEEPER: OnceLock<Mutex<mpsc::Sender<SpawnJob>>> = OnceLock::new();
    let keeper = KEEPER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnJob>();
        std::thread::Builder::new()
            .name("umbra-spawner".into())
            .spawn(move || {
                // Never returns while the process lives: senders are kept in the static.
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("start the helper-spawning thread");
        Mutex::new(tx)
    });
    let (reply, result) = mpsc::sync_channel(1);
    let gone = || io::Error::other("the helper-spawning thread is gone");
    keeper.lock().unwrap_or_else(|e| e.into_inner()).send((cmd, reply)).map_err(|_| gone())?;
    result.recv().map_err(|_| gone())?
}

pub struct Supervised {
    pub name: &'static str,
    child: Child,
    exited: Option<ExitStatus>,
}

impl Supervised {
    pub fn spawn(name: &'static str, cmd: Command) -> io::Result<Self> {
        Self::spawn_jailed(name, cmd, None)
    }

    /// Spawns `cmd` inside `jail` (see [`super::helper_jail`]); then [`Self::pid`] is the
    /// jail's relay, which ends as the helper does.
    pub fn spawn_jailed(name: &'static str, mut cmd: Command, jail: Option<Jail>) -> io::Result<Self> {
        let parent = std::process::id() as libc::pid_t;
        // No jail off Linux (the type has no value).
        #[cfg(not(target_os = "linux"))]
        let _: Option<Jail> = jail;
        // SAFETY: between fork and exec we call only async-signal-safe functions (prctl,
        // getppid, setpgid, _exit, and the jail's system calls) and touch no heap state.
        unsafe {
            cmd.pre_exec(move || {
                // macOS has no parent-death signal; there the VM runs in-process (vz) and
                // helpers are killed when their `Supervised` drops.
                #[cfg(target_os = "linux")]
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
                // The parent may have died before prctl took effect; then we were reparented
                // (to init or to a subreaper).
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                if libc::setpgid(0, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
                #[cfg(target_os = "linux")]
                if let Some(jail) = &jail {
                    jail.enter(parent)?;
                }
                Ok(())
            });
        }
        Ok(Self { name, child: spawn_on_keeper(cmd)?, exited: None })
    }

    /// The child's stdout pipe, if it was spawned with one.
    pub fn take_stdout(&mut self) -> Option<std::process::ChildStdout> {
        self.child.stdout.take()
    }

    /// The child's stdin pipe, if it was spawned with one.
    pub fn take_stdin(&mut self) -> Option<std::process::ChildStdin> {
        self.child.stdin.take()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status if the process has ended (reaping it).
    pub fn try_exited(&mut self) -> Option<ExitStatus> {
        if self.exited.is_none() {
            self.exited = self.child.try_wait().ok().flatten();
        }
        self.exited
    }

    /// Waits up to `timeout` for the process to end by itself.
    pub async fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        let mut delay = Duration::from_millis(1);
        loop {
            if let Some(s) = self.try_exited() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(50));
        }
    }

    /// SIGKILLs the process group and reaps the leader.
    pub fn kill(&mut self) {
        if self.try_exited().is_some() {
            return;
        }
        // SAFETY: plain syscall; the pid is our unreaped child, so it cannot have been reused.
        unsafe { libc::kill(-(self.child.id() as i32), libc::SIGKILL) };
        let _ = self.child.kill();
        self.exited = self.child.wait().ok();
    }
}

impl Drop for Supervised {
    fn drop(&mut self) {
        self.kill();
    }
}
