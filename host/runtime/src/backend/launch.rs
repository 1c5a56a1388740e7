//! What the backends that run the guest in a helper process (kvm: umbra-vmm; qemu: QEMU and
//! vhost-device-vsock) share: the folder server, starting the guest process with its console
//! copied to the run directory, waiting for the agent, and [`Helpers`], the [`Machine`] made
//! of supervised processes.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use async_trait::async_trait;

use super::children::{Jail, Supervised};
use super::fsd::FolderServer;
use super::rundir::{self, RunDir};
use super::vm::{FolderShare, Machine, Vm, CONSOLE_DRAIN};
use super::{console, io, postmortem, BackendKind, Capabilities, VmError, VmSpec};
use crate::agent::AgentClient;

#[cfg(test)]
#[path = "launch_tests.rs"]
mod tests;

/// How long one connection attempt may take once the agent has announced itself.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);

pub(super) fn log_file(path: &Path) -> Result<File, VmError> {
    File::create(path).map_err(io(format!("create {}", path.display())))
}

/// Starts the VM's folder server when `spec` asks for folder sharing; its process joins
/// `children` (before the guest process, which is killed first).
pub(super) async fn start_folder_server(
    spec: &VmSpec,
    run: &RunDir,
    children: &mut Vec<Supervised>,
) -> Result<Option<FolderServer>, VmError> {
    if !spec.folder_sharing {
        return Ok(None);
    }
    let (server, child) = FolderServer::start(run).await?;
    children.push(child);
    Ok(Some(server))
}

/// What a backend has set up before it starts the process that runs the guest.
pub(super) struct Launch {
    pub kind: BackendKind,
    pub capabilities: Capabilities,
    /// When the launch began: boot time is measured from here.
    pub started: Instant,
    pub id: String,
    pub run: RunDir,
    /// The helpers already running (daemons, the folder server).
    pub children: Vec<Supervised>,
    pub folders: Option<FolderServer>,
}

/// The process that runs the guest (QEMU or umbra-vmm). Its stdout is the guest console; its
/// stderr goes to `log`, which says more than the console when the guest dies during boot.
pub(super) struct GuestProcess<'a> {
    pub name: &'static str,
    pub binary: &'a Path,
    pub cmd: Command,
    pub log: PathBuf,
    /// Put before the log's text where it joins a boot failure's console lines.
    pub log_label: &'static str,
    pub jail: Option<Jail>,
    /// Descriptors the process inherits, closed here once it has started.
    pub held: Vec<std::os::fd::OwnedFd>,
    /// What the process's exit code says about the guest, if the backend's process says more
    /// than a status (umbra-vmm's codes).
    pub describe_exit: fn(i32) -> Option<&'static str>,
}

impl Launch {
    /// Starts `guest`, copies its console to `console.log` in the run directory, waits for the
    /// agent on the run directory's vsock socket and makes the VM with the machine `machine`
    /// builds from the running helpers.
    pub async fn finish(
        self,
        spec: &VmSpec,
        guest: GuestProcess<'_>,
        machine: impl FnOnce(Helpers) -> Box<dyn Machine>,
    ) -> Result<Vm, VmError> {
        let Launch { kind, capabilities, started, id, run, children, folders } = self;
        let GuestProcess { name, binary, mut cmd, log, log_label, jail, held, describe_exit } = guest;
        let vsock = rundir::vsock_socket(run.path());
        let mut helpers = Helpers { children, folders, guest: name, describe_exit, vsock };
        let console_log = run.join("console.log");
        // Listen for the agent's readiness announcement before the guest can make it.
        let ready_path = rundir::vsock_port_socket(run.path(), umbra_proto::AGENT_READY_VSOCK_PORT);
        let ready = tokio::net::UnixListener::bind(&ready_path).map_err(io("listen for the agent's readiness"))?;
        rundir::open_to_vmm(&ready_path).map_err(io("open the readiness socket to the VMM"))?;
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(log_file(&log)?);
        let mut process =
            Supervised::spawn_jailed(name, cmd, jail).map_err(io(format!("start {}", binary.display())))?;
        drop(held);
        let console_out = process.take_stdout().unwrap_or_else(|| panic!("{name} spawned with a stdout pipe"));
        let copier =
            console::ConsoleCopier::start(console_out, console_log.clone()).map_err(io("start the console copier"))?;
        helpers.children.push(process);

        let waited = wait_for_agent(&run, ready, &mut helpers, &copier, spec.boot_timeout).await;
        let _ = std::fs::remove_file(&ready_path);
        let agent = match waited {
            Ok(a) => a,
            Err(VmError::GuestDied { reason, console }) => {
                // The VMM's own complaint (bad image, KVM refused a step) says more than the console.
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                let console =
                    if text.trim().is_empty() { console } else { format!("{console}\n{log_label}{}", text.trim()) };
                return Err(VmError::GuestDied { reason, console });
            }
            Err(e) => return Err(e),
        };
        Ok(Vm {
            id,
            backend: kind,
            capabilities,
            boot_time: started.elapsed(),
            agent,
            console_log,
            console: Some(copier),
            machine: machine(helpers),
            run_dir: run,
        })
    }
}

/// A guest run by supervised helper processes: the guest process last (killed first), the
/// daemons it uses before it, and the folder server when the VM shares folders.
pub(super) struct Helpers {
    children: Vec<Supervised>,
    folders: Option<FolderServer>,
    /// The guest process's name, and what its exit codes mean.
    guest: &'static str,
    describe_exit: fn(i32) -> Option<&'static str>,
    /// The hybrid vsock socket the guest's ports are reached through.
    vsock: PathBuf,
}

impl Helpers {
    /// The process that runs the guest.
    pub fn guest_process(&mut self) -> &mut Supervised {
        self.children.last_mut().expect("a launched VM has its guest process")
    }

    /// The first helper found exited, and why that ended the VM.
    fn exited(&mut self) -> Option<String> {
        let (name, status) = self.children.iter_mut().find_map(|c| c.try_exited().map(|s| (c.name, s)))?;
        Some(self.exit_reason(name, status))
    }

    fn exit_reason(&self, name: &str, status: ExitStatus) -> String {
        match status.code().filter(|_| name == self.guest).and_then(self.describe_exit) {
            Some(why) => format!("{why} ({name} {status})"),
            None => format!("{name} exited: {status}"),
        }
    }
}

#[async_trait]
impl Machine for Helpers {
    fn pids(&self) -> Vec<u32> {
        self.children.iter().map(Supervised::pid).collect()
    }

    fn ended(&mut self) -> Option<String> {
        self.exited()
    }

    async fn wait_stopped(&mut self, timeout: Duration) {
        self.guest_process().wait_timeout(timeout).await;
    }

    fn kill(&mut self) {
        for c in self.children.iter_mut().rev() {
            c.kill();
        }
    }

    fn folders(&mut self) -> Option<&mut dyn FolderShare> {
        self.folders.as_mut().map(|f| f as &mut dyn FolderShare)
    }

    fn shares_folders(&self) -> bool {
        self.folders.is_some()
    }

    async fn snapshot(&mut self, _: File, _: File) -> Result<(u64, String), VmError> {
        Err(VmError::Snapshot(format!("{} cannot snapshot a VM", self.guest)))
    }

    fn dialer(&self) -> super::Dialer {
        super::Dialer::hybrid(self.vsock.clone())
    }
}

/// Waits for the agent: first for its readiness announcement (a guest connection to
/// [`umbra_proto::AGENT_READY_VSOCK_PORT`]), then connects through the hybrid vsock socket,
/// retrying with exponential backoff from 2 ms, while watching that the helpers stay alive.
///
/// Connecting before the announcement is what the announcement exists to avoid: a host
/// connection that reaches vhost-device-vsock while the guest driver is still starting the
/// device finds a queue not ready, and the backend's worker thread exits for good. An agent
/// that never announces (built before protocol 1.2) is polled after half the timeout.
async fn wait_for_agent(
    run: &RunDir,
    ready: tokio::net::UnixListener,
    helpers: &mut Helpers,
    copier: &console::ConsoleCopier,
    timeout: Duration,
) -> Result<AgentClient, VmError> {
    let (vsock_uds, console_log) = (rundir::vsock_socket(run.path()), run.join("console.log"));
    let started = Instant::now();
    let mut announced = false;
    let mut delay = Duration::from_millis(2);
    let mut last_error = String::from("the agent has not announced itself yet");
    loop {
        if let Some(why) = helpers.exited() {
            copier.wait_drained(CONSOLE_DRAIN);
            let console = console::tail(&console_log, console::ERROR_CONTEXT_LINES);
            let reason = console::diagnose(&console).map(str::to_string).unwrap_or(why);
            return Err(VmError::GuestDied { reason: format!("during boot: {reason}"), console });
        }
        let elapsed = started.elapsed();
        if elapsed >= timeout {
            return Err(VmError::BootTimeout {
                timeout,
                last_error,
                processes: postmortem::report(run.path(), &mut helpers.children),
                console: console::tail(&console_log, console::ERROR_CONTEXT_LINES),
            });
        }
        if !announced {
            // Wake often enough to notice a helper that died.
            if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(50), ready.accept()).await {
                announced = true;
            } else if elapsed >= timeout / 2 {
                announced = true;
                tracing::debug!("no readiness announcement after {elapsed:?}: polling the agent");
            }
            continue;
        }
        if vsock_uds.exists() {
            let attempt = AgentClient::connect_hybrid_vsock(&vsock_uds, umbra_proto::AGENT_VSOCK_PORT);
            // Once the agent has announced itself an answer takes milliseconds, but a loaded
            // host may need seconds: be patient rather than abandon CONNECTs in flight.
            let patience = timeout.saturating_sub(started.elapsed()).clamp(Duration::from_millis(100), ATTEMPT_TIMEOUT);
            match tokio::time::timeout(patience, attempt).await {
                Ok(Ok(client)) => return Ok(client),
                Ok(Err(e)) => last_error = e.to_string(),
                Err(_) => last_error = "handshake timed out".into(),
            }
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(100));
    }
}
