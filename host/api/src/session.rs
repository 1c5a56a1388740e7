//! What a session is, as clients see it: its status, settings, folders and identity.

use std::path::PathBuf;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use umbra_proto::ShareMode;

/// Where a session is in its life. `starting → ready → (restarting → ready)* → stopping →
/// stopped | failed`; a stopped or failed session can be resumed (back to `starting`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SessionStatus {
    /// Waiting for a boot slot, booting, or mounting its folders.
    Starting,
    /// The agent answers and every folder is mounted: commands can run.
    Ready,
    /// The VM failed (missed heartbeat, lost agent, VMM exit) and is being booted again.
    Restarting,
    /// Its processes and VM are being ended.
    Stopping,
    /// No VM; the session's folders, outputs and disk are kept, and it can be resumed.
    Stopped,
    /// It could not be (re)started; the last error says why. It can be resumed.
    Failed,
}

impl SessionStatus {
    /// Whether the session has (or is getting) a VM.
    pub fn is_active(self) -> bool {
        matches!(self, SessionStatus::Starting | SessionStatus::Ready | SessionStatus::Restarting)
    }

    pub fn name(self) -> &'static str {
        match self {
            SessionStatus::Starting => "starting",
            SessionStatus::Ready => "ready",
            SessionStatus::Restarting => "restarting",
            SessionStatus::Stopping => "stopping",
            SessionStatus::Stopped => "stopped",
            SessionStatus::Failed => "failed",
        }
    }
}

impl std::fmt::Display for SessionStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Which VM backend to use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "snake_case")]
pub enum BackendChoice {
    /// Linux: the Umbra VMM where the CPU has VT-x/AMD-V, QEMU elsewhere. macOS: `vz`. A bundle
    /// for another architecture than the host's: QEMU, emulated.
    #[default]
    Auto,
    /// Umbra's own VMM on KVM (Linux).
    Kvm,
    /// QEMU (KVM acceleration where the host has it, emulation otherwise).
    Qemu,
    /// Apple's Virtualization.framework (macOS). Since API 1.1.
    Vz,
}

/// What an idle session's VM does at its idle timeout.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum IdleAction {
    /// Stops: its processes end; resuming boots it again (or restores its snapshot).
    #[default]
    Stop,
    /// Snapshots the VM and stops it (the kvm backend; others stop): the next call naming the
    /// session restores it, with its detached processes and terminals running on. Detached
    /// processes and terminals do not keep it awake. Since API 1.8.
    Suspend,
}

impl IdleAction {
    fn is_stop(&self) -> bool {
        *self == IdleAction::Stop
    }
}

/// A host folder to share with a session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct FolderSpec {
    /// Absolute host path of a directory.
    pub path: PathBuf,
    /// The name under `/sessions/<session>/mnt/` (default: the folder's own name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `ro`, `rw` (no deletes), `rwd` or `shadow` (copy-on-write in the guest). Default `rw`.
    #[serde(default = "default_mode")]
    pub mode: ShareMode,
}

fn default_mode() -> ShareMode {
    ShareMode::Rw
}

/// A folder shared with a session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct FolderInfo {
    pub name: String,
    pub host_path: PathBuf,
    pub mode: ShareMode,
    /// `/sessions/<session>/mnt/<name>`.
    pub guest_path: String,
}

/// How a session's VM is sized and watched. A session keeps the values it was started with;
/// what a start does not set comes from the daemon's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct SessionSettings {
    /// Guest memory.
    pub memory_mib: u32,
    /// Guest vCPUs.
    pub cpus: u32,
    /// Stop the session after this long with no running process and no client activity; 0
    /// never stops it.
    pub idle_timeout_secs: u64,
    /// What the idle timeout does: `stop`, or `suspend` (a snapshot the next call restores;
    /// the kvm backend only, others stop).
    #[serde(skip_serializing_if = "IdleAction::is_stop")]
    pub idle_action: IdleAction,
    /// Size of the writable session disk (sparse: only what the guest writes takes space); 0
    /// keeps the guest's writes in its RAM, lost when the VM ends.
    pub disk_size_mib: u64,
    /// How often the agent is pinged.
    pub heartbeat_interval_secs: u64,
    /// How long a ping may take before the VM counts as failed and is restarted.
    pub heartbeat_timeout_secs: u64,
    /// Which bundle boots it: an installed version, `current`, or a built flavor (`minimal`,
    /// `standard`) or bundle directory. `current` with nothing installed is the flavor this
    /// machine built (`minimal` first).
    pub bundle: String,
    /// Which VM backend runs it.
    pub backend: BackendChoice,
    /// What the guest may connect to (through the host's egress proxy; the guest has no
    /// network interface of its own).
    pub network: NetworkPolicy,
    /// The sandbox policy, enforced on the host when the VM boots: the workspace folders' mode,
    /// extra paths, read-only `.git` and `/tmp`, hidden files and (when it has one) the
    /// network. `session.start` merges its policy with the daemon's default, field by field,
    /// the most restrictive winning.
    #[serde(skip_serializing_if = "umbra_policy::SandboxPolicy::is_empty")]
    pub policy: umbra_policy::SandboxPolicy,
    /// Command approval for `process.spawn`; absent, every command runs. `session.start`
    /// merges its settings with the daemon's (the stricter mode, both deny lists, both hooks).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub approval: Option<umbra_policy::approval::ApprovalSettings>,
    /// Expose every port a guest program starts listening on (loopback or wildcard) on a free
    /// host port of 127.0.0.1, and take it away when the program stops listening.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub auto_expose: bool,
}

pub use umbra_policy::network::{is_host_name, NetworkMode, NetworkPolicy};

impl Default for SessionSettings {
    fn default() -> Self {
        Self {
            memory_mib: 512,
            cpus: 1,
            idle_timeout_secs: 15 * 60,
            idle_action: IdleAction::Stop,
            disk_size_mib: 8 * 1024,
            heartbeat_interval_secs: 5,
            heartbeat_timeout_secs: 15,
            bundle: "current".into(),
            backend: BackendChoice::Auto,
            network: NetworkPolicy::default(),
            policy: umbra_policy::SandboxPolicy::default(),
            approval: None,
            auto_expose: false,
        }
    }
}

/// Session settings to change: only the fields given. `session.start` takes one (over the
/// daemon's defaults), and so does `config.set` (the defaults themselves).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SettingsPatch {
    /// Guest memory (64 to 65536).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u32>,
    /// Guest vCPUs (1 to 64).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<u32>,
    /// Idle seconds before the session stops; 0 never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_secs: Option<u64>,
    /// What the idle timeout does: `stop` or `suspend`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_action: Option<IdleAction>,
    /// Size of the session disk; 0 for none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_size_mib: Option<u64>,
    /// Seconds between heartbeats.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_interval_secs: Option<u64>,
    /// Seconds a heartbeat may take.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_timeout_secs: Option<u64>,
    /// The bundle to boot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bundle: Option<String>,
    /// The VM backend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<BackendChoice>,
    /// The network policy (replaces the whole policy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkPolicy>,
    /// The sandbox policy, as JSON: `{"type": "workspace_readonly", "ignore": [".env"]}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<umbra_policy::SandboxPolicy>,
    /// Command approval settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<umbra_policy::approval::ApprovalSettings>,
    /// Whether ports guest programs listen on are exposed as they appear.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_expose: Option<bool>,
}

impl SettingsPatch {
    /// `base` with the fields this patch sets; checked whole.
    pub fn applied_to(&self, base: &SessionSettings) -> Result<SessionSettings, crate::ApiError> {
        let mut s = base.clone();
        macro_rules! set {
            ($($field:ident),*) => { $( if let Some(v) = &self.$field { s.$field = v.clone(); } )* };
        }
        set!(
            memory_mib,
            cpus,
            idle_timeout_secs,
            idle_action,
            disk_size_mib,
            heartbeat_interval_secs,
            heartbeat_timeout_secs,
            bundle,
            backend,
            network,
            policy,
            auto_expose
        );
        if let Some(approval) = &self.approval {
            s.approval = Some(approval.clone());
        }
        s.validate()?;
        Ok(s)
    }
}

/// A session as `session.get` and `session.list` report it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SessionInfo {
    pub name: String,
    pub status: SessionStatus,
    pub settings: SessionSettings,
    /// The user's folders, then `outputs` and `uploads`.
    pub folders: Vec<FolderInfo>,
    /// `$XDG_DATA_HOME/umbra/sessions/<name>`: holds `outputs/`, `uploads/` and `disk.img`.
    pub storage_dir: PathBuf,
    /// The running VM, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm: Option<VmInfo>,
    /// Processes running in the session now.
    pub processes: u32,
    /// VM restarts since the session was last started or resumed.
    pub restarts: u32,
    /// Milliseconds since the epoch.
    pub created_ms: u64,
    /// Why the session last stopped or failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// The session's snapshot (`session.snapshot`, or the one it was forked from), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<SnapshotInfo>,
    /// Which source decided each field of its sandbox policy at its start: `system` (the
    /// machine's system policy), `admin` (umbrad's configuration), `session` (the start's).
    /// Since API 1.8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_decided_by: Option<umbra_policy::DecidedBy>,
    /// Stopped by `idle_action: suspend`: the next call naming it restores its snapshot, with
    /// its detached processes and terminals. Since API 1.8.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub suspended: bool,
    /// Its secrets: names, placeholders and hosts, never a value.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<crate::secrets::SecretInfo>,
    /// Its SSH keys: names, fingerprints and hosts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ssh_keys: Vec<crate::secrets::SshKeyInfo>,
    /// Its exposed ports.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<crate::ports::PortInfo>,
}

/// A session's snapshot: its VM paused into the session's storage (memory, devices, disk,
/// folder table), which `session.resume` restores and `session.fork` copies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SnapshotInfo {
    /// Milliseconds since the epoch.
    pub taken_ms: u64,
    /// The session that took it (a fork's snapshot names its source).
    pub source: String,
    pub bundle_version: String,
    /// Bytes of guest memory the snapshot holds (a sparse file: untouched pages take no room).
    pub memory_bytes: u64,
    /// How long the guest was paused while its state and memory were written.
    pub pause_ms: u64,
    /// Whether the next `session.resume` restores it (memory, detached processes, disk) rather
    /// than booting: true from the snapshot until a resume restored it.
    pub resumes: bool,
}

/// The VM behind a running session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct VmInfo {
    /// `kvm` or `qemu`.
    pub backend: String,
    /// Why `auto` chose it.
    pub backend_reason: String,
    pub bundle_version: String,
    /// Launch → agent ready.
    pub boot_ms: u64,
    /// Host pids of the VMM and its helper processes.
    pub pids: Vec<u32>,
    /// The VM's private run directory on the host (sockets, console log).
    pub run_dir: PathBuf,
    /// The VM came booted from the warm pool (`boot_ms` is then its boot there).
    #[serde(default)]
    pub from_pool: bool,
    /// Host memory the VM holds now, in KiB: the proportional set size (PSS) of the VMM and
    /// its helpers, so guest memory they all map counts once. Absent for an in-process VM or
    /// where `/proc` cannot tell. Since API 1.9.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_memory_kib: Option<u64>,
}
