//! An OCI runtime spec's process and mounts, as the guest agent's `container-exec` takes them
//! ([`umbra_proto::container::ContainerExec`]).

use oci_spec::runtime::{Process, Spec};
use umbra_proto::container::{ContainerExec, ContainerMount, ContainerRlimit};

/// The container's first process: its namespaces and mounts are made for it.
pub fn init(spec: &Spec, guest_root: &str) -> Result<ContainerExec, String> {
    let process = spec.process().as_ref().ok_or("the spec has no process")?;
    let mut exec = process_exec(process, guest_root)?;
    exec.hostname = spec.hostname().clone().filter(|h| !h.is_empty());
    exec.readonly_root = spec.root().as_ref().and_then(|r| r.readonly()).unwrap_or(false);
    exec.mounts = spec
        .mounts()
        .iter()
        .flatten()
        .map(|m| ContainerMount {
            destination: m.destination().display().to_string(),
            kind: m.typ().clone().unwrap_or_default(),
            source: m.source().as_ref().map(|s| s.display().to_string()).unwrap_or_default(),
            options: m.options().clone().unwrap_or_default(),
        })
        .collect();
    Ok(exec)
}

/// A process of the container: `ctr task exec`'s spec, or the init's.
pub fn process_exec(process: &Process, guest_root: &str) -> Result<ContainerExec, String> {
    let args = process.args().clone().unwrap_or_default();
    if args.is_empty() {
        return Err("the process has no args".into());
    }
    let user = process.user();
    Ok(ContainerExec {
        root: guest_root.to_string(),
        join: None,
        mounts: Vec::new(),
        hostname: None,
        args,
        env: process.env().clone().unwrap_or_default(),
        cwd: process.cwd().display().to_string(),
        uid: user.uid(),
        gid: user.gid(),
        additional_gids: user.additional_gids().clone().unwrap_or_default(),
        rlimits: process
            .rlimits()
            .iter()
            .flatten()
            .map(|r| ContainerRlimit { kind: rlimit_name(r.typ()), soft: r.soft(), hard: r.hard() })
            .collect(),
        no_new_privileges: process.no_new_privileges().unwrap_or(false),
        umask: user.umask(),
        cgroup: None,
        readonly_root: false,
    })
}

/// `RLIMIT_NOFILE` for the enum: its serde form is the OCI name.
fn rlimit_name(t: oci_spec::runtime::PosixRlimitType) -> String {
    serde_json::to_value(t).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ctr_spec_becomes_a_container_exec() {
        let spec: Spec = serde_json::from_value(serde_json::json!({
            "ociVersion": "1.0.2",
            "hostname": "box",
            "process": {
                "args": ["sh", "-c", "echo hi"], "env": ["PATH=/bin", "A=1"], "cwd": "/work",
                "user": {"uid": 1000, "gid": 100, "additionalGids": [10, 20], "umask": 18},
                "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 512}],
                "noNewPrivileges": true
            },
            "root": {"path": "rootfs"},
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid"]}]
        }))
        .unwrap();
        let e = init(&spec, "/sessions/pod/mnt/c1").unwrap();
        assert_eq!(e.root, "/sessions/pod/mnt/c1");
        assert_eq!(e.args, ["sh", "-c", "echo hi"]);
        assert_eq!(e.env, ["PATH=/bin", "A=1"]);
        assert_eq!((e.uid, e.gid, e.additional_gids.as_slice()), (1000, 100, &[10, 20][..]));
        assert_eq!(e.umask, Some(18));
        assert_eq!(e.rlimits, vec![ContainerRlimit { kind: "RLIMIT_NOFILE".into(), soft: 512, hard: 1024 }]);
        assert!(e.no_new_privileges);
        assert_eq!(e.hostname.as_deref(), Some("box"));
        assert_eq!(e.mounts[0].destination, "/proc");
        assert_eq!(e.mounts[0].kind, "proc");
        assert_eq!(e.cwd, "/work");
    }
}
