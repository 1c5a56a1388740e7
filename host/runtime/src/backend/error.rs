//! What can go wrong launching and running a VM.

use std::time::Duration;

use umbra_bundle::Arch;

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("{what} not found: {fix}")]
    Missing { what: &'static str, fix: &'static str },
    /// The requested backend cannot run on this host.
    #[error("{0}")]
    BackendUnavailable(String),
    /// The bundle is for an architecture the backend cannot run.
    #[error("bundle {version} is an {guest} guest; the {backend} backend runs only {host} guests on this host (use the qemu backend, which emulates {guest})")]
    WrongArch { version: String, guest: Arch, host: Arch, backend: &'static str },
    #[error("cannot {what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error("{helper} exited during start-up ({status}); its log:\n{log}")]
    HelperFailed { helper: &'static str, status: String, log: String },
    #[error("the guest did not answer within {timeout:?} (agent not reachable: {last_error}); its processes:\n{processes}last console lines:\n{console}")]
    BootTimeout { timeout: Duration, last_error: String, processes: String, console: String },
    /// The folder server (umbra-fsd) refused a request.
    #[error("the folder server refused: {0}")]
    FolderServer(String),
    #[error("the VM was launched without folder sharing")]
    NoFolderSharing,
    #[error("the VM ended ({reason}); last console lines:\n{console}")]
    GuestDied { reason: String, console: String },
    #[error("cannot snapshot the VM: {0}")]
    Snapshot(String),
    #[error("cannot restore the snapshot: {0}")]
    Restore(String),
}

pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> VmError {
    let what = what.into();
    move |source| VmError::Io { what, source }
}
