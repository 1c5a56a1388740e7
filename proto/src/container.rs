//! An OCI container's process, as the containerd shim asks the agent to start it: the agent
//! runs itself (`/proc/1/exe container-exec <json>`) as an ordinary spawned process, which
//! enters the container (mount, UTS and IPC namespaces, the container's mounts, `chroot` into
//! its root, rlimits, groups, identity, `no_new_privs`) and execs the program. The host sends
//! nothing new over the protocol: this is argv of a normal spawn, and the guest — root in its
//! VM anyway — gains nothing it could not do itself.

use serde::{Deserialize, Serialize};

/// The subcommand of the agent binary that enters a container and execs its program.
pub const CONTAINER_EXEC: &str = "container-exec";

/// How one process of a container starts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerExec {
    /// The container's root in the guest (its shared rootfs folder).
    pub root: String,
    /// Join the namespaces of this guest process (the container's first process) instead of
    /// making new ones and mounting: `ctr task exec`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub join: Option<u32>,
    /// Mounts made inside the root before the chroot, in order (new namespaces only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<ContainerMount>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    pub args: Vec<String>,
    /// `KEY=value` entries: the whole environment (the OCI spec's `process.env`).
    #[serde(default)]
    pub env: Vec<String>,
    /// Inside the root; `/` when empty.
    #[serde(default)]
    pub cwd: String,
    #[serde(default)]
    pub uid: u32,
    #[serde(default)]
    pub gid: u32,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub additional_gids: Vec<u32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rlimits: Vec<ContainerRlimit>,
    #[serde(default)]
    pub no_new_privileges: bool,
    /// A umask for the process (OCI `process.user.umask`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub umask: Option<u32>,
}

/// One OCI mount: `proc`, `sysfs`, `tmpfs`, `devpts`, `mqueue`, `cgroup`/`cgroup2`, or a
/// `bind` of a guest path.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerMount {
    pub destination: String,
    #[serde(default, rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub source: String,
    #[serde(default)]
    pub options: Vec<String>,
}

/// `RLIMIT_NOFILE` and the like, by their OCI names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerRlimit {
    #[serde(rename = "type")]
    pub kind: String,
    pub soft: u64,
    pub hard: u64,
}
