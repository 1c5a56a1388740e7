//! An OCI container's process, as the containerd shim asks the agent to start it: the agent
//! runs itself (`/proc/1/exe container-exec …`, [`ContainerExec::to_argv`]) as an ordinary spawned process, which
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
    /// The container's cgroup, under the agent's commands group (`umbra-commands/<name>`):
    /// the first process makes it and moves in, later ones join it; the host kills the
    /// container's every process through it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
    /// The root is read-only (OCI `root.readonly`).
    #[serde(default)]
    pub readonly_root: bool,
}

impl ContainerExec {
    /// The agent's argv for this process: `container-exec`, the spec without its environment
    /// and args as JSON, the number of environment entries, the entries, then the args. Each
    /// is an argument of its own: Linux bounds one argument to 128 KiB, and a Kubernetes
    /// pod's environment alone can pass that.
    pub fn to_argv(&self) -> Vec<String> {
        let head = ContainerExec { env: Vec::new(), args: Vec::new(), ..self.clone() };
        let mut argv = vec![CONTAINER_EXEC.to_string(), serde_json::to_string(&head).unwrap_or_default()];
        argv.push(self.env.len().to_string());
        argv.extend(self.env.iter().cloned());
        argv.extend(self.args.iter().cloned());
        argv
    }

    /// The spec [`Self::to_argv`] wrote, from the arguments after `container-exec`.
    pub fn from_argv(args: &[String]) -> Result<Self, String> {
        let [head, count, rest @ ..] = args else { return Err("container-exec needs its spec".into()) };
        let mut spec: ContainerExec = serde_json::from_str(head).map_err(|e| format!("the container's spec: {e}"))?;
        let count: usize = count.parse().map_err(|_| format!("{count:?} is not a number of environment entries"))?;
        if count > rest.len() {
            return Err(format!("{count} environment entries, {} arguments", rest.len()));
        }
        spec.env = rest[..count].to_vec();
        spec.args = rest[count..].to_vec();
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argv_round_trips_with_large_environments() {
        let spec = ContainerExec {
            root: "/r".into(),
            args: vec!["sh".into(), "-c".into(), "echo \"$A\"".into()],
            env: (0..5000).map(|i| format!("SERVICE_{i}_PORT=tcp://10.0.0.{}:80", i % 250)).collect(),
            cgroup: Some("c-x".into()),
            ..Default::default()
        };
        let argv = spec.to_argv();
        assert_eq!(argv[0], CONTAINER_EXEC);
        assert!(argv.iter().all(|a| a.len() < 128 * 1024));
        assert_eq!(ContainerExec::from_argv(&argv[1..]).unwrap(), spec);
        // Cut short: fewer arguments than the environment it announces.
        assert!(ContainerExec::from_argv(&argv[1..3]).is_err());
        assert!(ContainerExec::from_argv(&["{}".into(), "9".into()]).is_err());
        assert!(ContainerExec::from_argv(&[]).is_err());
    }
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
