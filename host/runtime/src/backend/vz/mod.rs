//! The `vz` backend: Apple's Virtualization.framework on macOS (docs/macos.md). The VM runs in
//! this process on its own dispatch queue: no VMM process, no helper daemons. Virtio-fs, vsock,
//! block, entropy and the console are the framework's own devices.
//!
//! [`config`] maps a [`super::VmSpec`] onto plain data (unit-tested everywhere); `machine`, built
//! only for macOS, turns that into Virtualization.framework objects through objc2.

mod config;
pub use config::{vz_config, VzConfig, VzDevice, VzShare, MIN_MEMORY_MIB, VZ_CMDLINE};

#[cfg(target_os = "macos")]
mod machine;
#[cfg(target_os = "macos")]
pub use machine::{VzMachine, VzState};

use async_trait::async_trait;
use umbra_bundle::Arch;

use super::vm::{Backend, Vm};
use super::{BackendKind, Capabilities, VmError, VmSpec};

/// Virtualization.framework: arm64 guests on Apple silicon; no snapshots; folders shared whole
/// (no `.git` protection, no hidden files).
pub struct VzBackend;

#[async_trait]
impl Backend for VzBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Vz
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            snapshot: false,
            live_fork: false,
            folder_protection: false,
            guest_arches: &[Arch::Aarch64],
            emulates: false,
        }
    }

    #[cfg(target_os = "macos")]
    async fn launch(&self, spec: &VmSpec) -> Result<Vm, VmError> {
        launch::launch(spec, self.capabilities()).await
    }

    #[cfg(not(target_os = "macos"))]
    async fn launch(&self, _: &VmSpec) -> Result<Vm, VmError> {
        Err(VmError::BackendUnavailable("backend vz is Apple's Virtualization.framework: it runs only on macOS".into()))
    }
}

/// Booting a [`VzMachine`] into a [`super::Vm`]: the same readiness rule as the other
/// backends (the agent's announcement on its ready port, then the handshake on its port).
#[cfg(target_os = "macos")]
mod launch {
    use std::path::Path;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use async_trait::async_trait;

    use super::{vz_config, VzMachine, VzShare, VzState};
    use crate::agent::AgentClient;
    use crate::backend::fsd::FS_TAG;
    use crate::backend::rundir::{new_vm_id, RunDir};
    use crate::backend::vm::{FolderShare, Machine, Vm};
    use crate::backend::{console, io, BackendKind, Capabilities, FolderIdentity, SharedFolder, VmError, VmSpec};

    /// Why the VM ended, if it has.
    fn ended(machine: &VzMachine) -> Option<String> {
        match machine.state() {
            VzState::Starting | VzState::Running => None,
            VzState::Stopped => Some("the guest shut down".into()),
            VzState::Failed(e) => Some(format!("Virtualization.framework stopped the VM: {e}")),
        }
    }

    async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, VmError> {
        tokio::task::spawn_blocking(f)
            .await
            .map_err(|e| VmError::BackendUnavailable(format!("a Virtualization.framework call panicked: {e}")))
    }

    pub async fn launch(spec: &VmSpec, capabilities: Capabilities) -> Result<Vm, VmError> {
        let started = Instant::now();
        let id = new_vm_id();
        let run = RunDir::create(&id).map_err(io("create the VM run directory"))?;
        let console_log = run.join("console.log");
        let cfg = vz_config(spec, &console_log)?;
        let machine = blocking(move || VzMachine::create(&cfg))
            .await?
            .map_err(|e| VmError::BackendUnavailable(format!("Virtualization.framework refused the VM: {e}")))?;
        let machine = Arc::new(machine);
        // The console pipe is drained from before the guest starts, so it never blocks the guest.
        let copier = match machine.take_console() {
            Some(read) => Some(
                console::ConsoleCopier::start(std::fs::File::from(read), console_log.clone())
                    .map_err(io("start the console copier"))?,
            ),
            None => None,
        };
        // Whatever fails once the VM may run stops it before the failure is reported: a start that
        // timed out may still complete.
        let agent = match boot(&machine, spec, started, &console_log).await {
            Ok(agent) => agent,
            Err(e) => {
                let m = machine.clone();
                let _ = blocking(move || m.stop(Duration::ZERO)).await;
                return Err(e);
            }
        };
        let shares = spec.folder_sharing.then(|| VzShares { machine: machine.clone(), shares: Vec::new() });
        Ok(Vm {
            id,
            backend: BackendKind::Vz,
            capabilities,
            boot_time: started.elapsed(),
            agent,
            console_log,
            console: copier,
            machine: Box::new(VzRunning { machine, shares }),
            run_dir: run,
        })
    }

    /// The in-process VM and, when it was launched with folder sharing, its share set.
    struct VzRunning {
        machine: Arc<VzMachine>,
        shares: Option<VzShares>,
    }

    #[async_trait]
    impl Machine for VzRunning {
        fn pids(&self) -> Vec<u32> {
            Vec::new()
        }

        fn ended(&mut self) -> Option<String> {
            ended(&self.machine)
        }

        async fn wait_stopped(&mut self, timeout: Duration) {
            let deadline = Instant::now() + timeout;
            while ended(&self.machine).is_none() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }

        fn kill(&mut self) {
            self.machine.kill();
        }

        fn folders(&mut self) -> Option<&mut dyn FolderShare> {
            self.shares.as_mut().map(|s| s as &mut dyn FolderShare)
        }

        fn shares_folders(&self) -> bool {
            self.shares.is_some()
        }

        async fn snapshot(&mut self, _: std::fs::File, _: std::fs::File) -> Result<(u64, String), VmError> {
            Err(VmError::BackendUnavailable("the vz backend cannot snapshot a VM".into()))
        }

        fn dialer(&self) -> crate::backend::Dialer {
            // The framework's socket device: a connect gives a descriptor, made async here.
            let machine = self.machine.clone();
            crate::backend::Dialer::new(move |port| {
                let m = machine.clone();
                Box::pin(async move {
                    let fd = tokio::task::spawn_blocking(move || m.connect(port, Duration::from_secs(10)))
                        .await
                        .map_err(|e| e.to_string())??;
                    let stream = std::os::unix::net::UnixStream::from(fd);
                    stream.set_nonblocking(true).map_err(|e| e.to_string())?;
                    tokio::net::UnixStream::from_std(stream).map_err(|e| e.to_string())
                })
            })
        }
    }

    /// The framework's share set: replaced whole on every change.
    struct VzShares {
        machine: Arc<VzMachine>,
        shares: Vec<VzShare>,
    }

    /// Starts the VM and waits for the agent's announcement, then shakes hands on its port.
    async fn boot(
        machine: &Arc<VzMachine>,
        spec: &VmSpec,
        started: Instant,
        console_log: &Path,
    ) -> Result<AgentClient, VmError> {
        let died = |reason: String| {
            let console = console::tail(console_log, console::ERROR_CONTEXT_LINES);
            let reason = console::diagnose(&console).map(str::to_string).unwrap_or(reason);
            VmError::GuestDied { reason: format!("during boot: {reason}"), console }
        };
        let (m, timeout) = (machine.clone(), spec.boot_timeout);
        blocking(move || m.start(timeout)).await?.map_err(|e| died(format!("the VM did not start: {e}")))?;
        let deadline = started + spec.boot_timeout;
        while !machine.announced() {
            if let Some(reason) = ended(machine) {
                return Err(died(reason));
            }
            if Instant::now() >= deadline {
                return Err(VmError::BootTimeout {
                    timeout: spec.boot_timeout,
                    last_error: "the agent has not announced itself".into(),
                    processes: "(in-process VM: no helper processes)\n".into(),
                    console: console::tail(console_log, console::ERROR_CONTEXT_LINES),
                });
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let m = machine.clone();
        let fd = blocking(move || m.connect(umbra_proto::AGENT_VSOCK_PORT, Duration::from_secs(10)))
            .await?
            .map_err(|e| died(format!("cannot connect to the agent: {e}")))?;
        let stream = std::os::unix::net::UnixStream::from(fd);
        stream.set_nonblocking(true).map_err(io("make the agent connection non-blocking"))?;
        let stream = tokio::net::UnixStream::from_std(stream).map_err(io("register the agent connection"))?;
        AgentClient::handshake(stream).await.map_err(|e| died(format!("agent handshake: {e}")))
    }

    /// Adds `name` to the share set. The framework shares a directory read-only or read-write
    /// and nothing finer: a share that asks for `.git` protection or hidden files is refused
    /// rather than given without them.
    #[async_trait]
    impl FolderShare for VzShares {
        async fn add(&mut self, folder: &SharedFolder) -> Result<FolderIdentity, VmError> {
            let SharedFolder { name, source, read_only, protection, identity: expected } = folder;
            let (name, read_only, expected) = (name.as_str(), *read_only, *expected);
            let found = crate::backend::folder_identity(source)
                .map_err(|e| VmError::FolderServer(format!("folder {name}: {e}")))?;
            if expected.is_some_and(|e| e != found) {
                return Err(VmError::FolderServer(format!(
                    "folder {name}: {} is no longer the folder that was shared; refusing to share what replaced it",
                    source.display()
                )));
            }
            // umbra-fsd pins .git only in shares the host lets the guest write.
            if (protection.protect_git && !read_only) || !protection.hide.is_empty() {
                return Err(VmError::FolderServer(format!(
                "folder {name}: the vz backend cannot protect .git or hide files on the host (Virtualization.framework \
                 shares whole directories); share it without that policy"
            )));
            }
            if self.shares.iter().any(|s| s.name == name) {
                return Err(VmError::FolderServer(format!("folder {name} is already in the share")));
            }
            let mut next = self.shares.clone();
            next.push(VzShare { name: name.into(), path: source.clone(), read_only });
            set(&self.machine, &next).await?;
            self.shares = next;
            Ok(found)
        }

        async fn remove(&mut self, name: &str) -> Result<(), VmError> {
            let next: Vec<VzShare> = self.shares.iter().filter(|s| s.name != name).cloned().collect();
            if next.len() == self.shares.len() {
                return Err(VmError::FolderServer(format!("folder {name} is not in the share")));
            }
            set(&self.machine, &next).await?;
            self.shares = next;
            Ok(())
        }
    }

    async fn set(machine: &Arc<VzMachine>, shares: &[VzShare]) -> Result<(), VmError> {
        let (m, shares) = (machine.clone(), shares.to_vec());
        blocking(move || m.set_shares(FS_TAG, &shares)).await?.map_err(VmError::FolderServer)
    }
}
