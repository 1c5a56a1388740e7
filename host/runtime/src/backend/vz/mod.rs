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

#[cfg(target_os = "macos")]
pub use launch::{add_folder, ended, launch, remove_folder};

/// Booting a [`VzMachine`] into a [`super::Vm`]: the same readiness rule as the other
/// backends (the agent's announcement on its ready port, then the handshake on its port).
#[cfg(target_os = "macos")]
mod launch {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::{vz_config, VzMachine, VzState};
    use crate::agent::AgentClient;
    use crate::backend::rundir::{new_vm_id, RunDir};
    use std::path::Path;

    use super::VzShare;
    use crate::backend::fsd::{Protection, FS_TAG};
    use crate::backend::{console, io, BackendKind, Vm, VmError, VmSpec};

    /// Why the VM ended, if it has.
    pub fn ended(machine: &VzMachine) -> Option<String> {
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

    pub async fn launch(spec: &VmSpec) -> Result<Vm, VmError> {
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
        Ok(Vm {
            id,
            backend: BackendKind::Vz,
            agent,
            children: Vec::new(),
            console_log,
            console: copier,
            boot_time: started.elapsed(),
            run_dir: run,
            folders: None,
            vz: Some(machine),
            vz_shares: spec.folder_sharing.then(Vec::new),
        })
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
    pub async fn add_folder(
        machine: &Arc<VzMachine>,
        shares: &mut Vec<VzShare>,
        name: &str,
        source: &Path,
        read_only: bool,
        protection: &Protection,
        expected: Option<crate::backend::FolderIdentity>,
    ) -> Result<crate::backend::FolderIdentity, VmError> {
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
        if shares.iter().any(|s| s.name == name) {
            return Err(VmError::FolderServer(format!("folder {name} is already in the share")));
        }
        let mut next = shares.clone();
        next.push(VzShare { name: name.into(), path: source.to_path_buf(), read_only });
        set(machine, &next).await?;
        *shares = next;
        Ok(found)
    }

    pub async fn remove_folder(machine: &Arc<VzMachine>, shares: &mut Vec<VzShare>, name: &str) -> Result<(), VmError> {
        let next: Vec<VzShare> = shares.iter().filter(|s| s.name != name).cloned().collect();
        if next.len() == shares.len() {
            return Err(VmError::FolderServer(format!("folder {name} is not in the share")));
        }
        set(machine, &next).await?;
        *shares = next;
        Ok(())
    }

    async fn set(machine: &Arc<VzMachine>, shares: &[VzShare]) -> Result<(), VmError> {
        let (m, shares) = (machine.clone(), shares.to_vec());
        blocking(move || m.set_shares(FS_TAG, &shares)).await?.map_err(VmError::FolderServer)
    }
}
