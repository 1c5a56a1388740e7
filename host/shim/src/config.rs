//! What a pod's VM is made of: the runtime handler's options (a TOML file named by
//! containerd's runtime options, `UMBRA_SHIM_CONFIG`, or `/etc/umbra/containerd-shim.toml`),
//! then the container's own limits and the pod's `io.umbra.*` annotations.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use umbra_api::session::{BackendChoice, SettingsPatch};
use umbra_policy::{NetworkPolicy, SandboxPolicy};

/// Where the handler's options live when containerd names none.
pub const DEFAULT_CONFIG: &str = "/etc/umbra/containerd-shim.toml";
/// A pod's network policy, as JSON (`docs/network.md`'s `NetworkPolicy`).
pub const NETWORK_ANNOTATION: &str = "io.umbra.network";
/// Container ports reached from the pod's network namespace: `80,8080` or `8080:80` (pod
/// port : guest port).
pub const PORTS_ANNOTATION: &str = "io.umbra.ports";
/// The CRI's pod id: containers of one pod share one shim and one VM.
pub const SANDBOX_ID_ANNOTATION: &str = "io.kubernetes.cri.sandbox-id";
/// The pod's resources, which the CRI puts on the sandbox (pause) container's spec, the one
/// that boots the VM: its own limits are the pause process's.
const SANDBOX_MEMORY_ANNOTATION: &str = "io.kubernetes.cri.sandbox-memory";
const SANDBOX_CPU_QUOTA_ANNOTATION: &str = "io.kubernetes.cri.sandbox-cpu-quota";
const SANDBOX_CPU_PERIOD_ANNOTATION: &str = "io.kubernetes.cri.sandbox-cpu-period";

/// The runtime handler's options (`[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.umbra.options]`
/// points at this file with `ConfigPath`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ShimConfig {
    /// A bundle name, version or directory (default: the store's current bundle).
    pub bundle: Option<String>,
    pub memory_mib: u32,
    /// The most a container's memory limit may raise the VM to.
    pub max_memory_mib: u32,
    pub cpus: u32,
    pub backend: BackendChoice,
    pub boot_timeout_secs: u64,
    /// A sandbox policy file (`docs/policy.md`) every pod gets.
    pub policy: Option<PathBuf>,
    /// The network a pod gets when its annotations name none.
    pub network: NetworkPolicy,
    /// Whether pods may set their own network with `io.umbra.network`.
    pub network_annotations: bool,
    /// The most a pod's `io.umbra.network` may allow (`mode = "any"` by default: no ceiling);
    /// a pod asking for more is refused, saying what exceeds it.
    pub network_ceiling: Option<NetworkPolicy>,
    /// How long the shim waits for containerd to come back before it stops its VM and exits.
    pub orphan_grace_secs: u64,
}

impl Default for ShimConfig {
    fn default() -> Self {
        Self {
            bundle: None,
            memory_mib: 512,
            max_memory_mib: 8192,
            cpus: 1,
            backend: BackendChoice::default(),
            boot_timeout_secs: 120,
            policy: None,
            network: NetworkPolicy::default(),
            network_annotations: true,
            network_ceiling: None,
            orphan_grace_secs: 60,
        }
    }
}

impl ShimConfig {
    pub fn load(path: Option<&Path>) -> Result<Self, String> {
        let env = std::env::var_os("UMBRA_SHIM_CONFIG").map(PathBuf::from);
        let path = match (path, env) {
            (Some(p), _) => p.to_path_buf(),
            (None, Some(p)) => p,
            (None, None) if Path::new(DEFAULT_CONFIG).exists() => PathBuf::from(DEFAULT_CONFIG),
            (None, None) => return Ok(Self::default()),
        };
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn parse(text: &str) -> Result<Self, String> {
        let config: Self = toml::from_str(text).map_err(|e| e.to_string())?;
        config.network.validate()?;
        if let Some(ceiling) = &config.network_ceiling {
            ceiling.validate().map_err(|e| format!("network_ceiling: {e}"))?;
        }
        if config.memory_mib < 64 || config.cpus == 0 {
            return Err("memory_mib must be at least 64 and cpus at least 1".into());
        }
        Ok(config)
    }

    /// The pod VM's settings: these options, the first container's limits, its annotations.
    pub fn settings(&self, spec: &oci_spec::runtime::Spec) -> Result<SettingsPatch, String> {
        let annotations = spec.annotations().clone().unwrap_or_default();
        let mut network = self.network.clone();
        if let Some(json) = annotations.get(NETWORK_ANNOTATION) {
            if !self.network_annotations {
                return Err(format!("{NETWORK_ANNOTATION}: this runtime handler does not let pods set their network"));
            }
            network = serde_json::from_str(json).map_err(|e| format!("{NETWORK_ANNOTATION}: {e}"))?;
            network.validate().map_err(|e| format!("{NETWORK_ANNOTATION}: {e}"))?;
            if let Some(excess) = self.network_ceiling.as_ref().and_then(|c| umbra_policy::network_excess(&network, c))
            {
                return Err(format!("{NETWORK_ANNOTATION}: beyond this runtime handler's network_ceiling: {excess}"));
            }
        }
        let policy = match &self.policy {
            None => None,
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| format!("policy {}: {e}", path.display()))?;
                Some(SandboxPolicy::from_json(&text).map_err(|e| format!("policy {}: {e}", path.display()))?)
            }
        };
        let resources = spec.linux().as_ref().and_then(|l| l.resources().clone());
        let number = |key: &str| annotations.get(key).and_then(|v| v.trim().parse::<i64>().ok());
        // A memory limit (a pod's, `ctr run --memory-limit`) sizes the VM, with room for the
        // guest kernel and agent; within the handler's maximum.
        let limit = number(SANDBOX_MEMORY_ANNOTATION)
            .or_else(|| resources.as_ref().and_then(|r| r.memory().as_ref().and_then(|m| m.limit())));
        let limit_mib = limit.filter(|&l| l > 0).map(|l| (l as u64 / (1 << 20)).min(u32::MAX as u64 - 64) as u32 + 64);
        let memory_mib = limit_mib.map_or(self.memory_mib, |l| l.clamp(self.memory_mib, self.max_memory_mib));
        let quota = match (number(SANDBOX_CPU_QUOTA_ANNOTATION), number(SANDBOX_CPU_PERIOD_ANNOTATION)) {
            (Some(q), Some(p)) => Some((q, p as u64)),
            _ => resources.as_ref().and_then(|r| r.cpu().as_ref().and_then(|c| Some((c.quota()?, c.period()?)))),
        };
        let cpus = quota
            .filter(|&(q, p)| q > 0 && p > 0)
            .map_or(self.cpus, |(q, p)| (q as u64).div_ceil(p).clamp(1, 64) as u32);
        Ok(SettingsPatch {
            memory_mib: Some(memory_mib),
            cpus: Some(cpus),
            bundle: self.bundle.clone(),
            backend: Some(self.backend),
            disk_size_mib: Some(0),
            idle_timeout_secs: Some(0),
            heartbeat_timeout_secs: Some(30),
            network: Some(network),
            policy,
            ..Default::default()
        })
    }
}

/// The most ports one pod forwards (each is a listener in the shim).
pub const MAX_PORTS: usize = 64;

/// `io.umbra.ports`: (pod port, guest port) pairs, at most [`MAX_PORTS`].
pub fn ports(annotations: &HashMap<String, String>) -> Result<Vec<(u16, u16)>, String> {
    let Some(list) = annotations.get(PORTS_ANNOTATION) else { return Ok(Vec::new()) };
    if list.split(',').filter(|s| !s.trim().is_empty()).count() > MAX_PORTS {
        return Err(format!("{PORTS_ANNOTATION}: more than {MAX_PORTS} ports"));
    }
    let port = |s: &str| {
        s.trim()
            .parse::<u16>()
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| format!("{PORTS_ANNOTATION}: {s:?} is not a port"))
    };
    list.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|item| match item.split_once(':') {
            Some((pod, guest)) => Ok((port(pod)?, port(guest)?)),
            None => port(item).map(|p| (p, p)),
        })
        .collect()
}

/// containerd's `runtimeoptions.v1.Options` (`ctr run --runtime-config-path`, a CRI runtime
/// handler's `ConfigPath`): field 2 is the config path, field 3 a config body.
pub fn runtime_options(value: &[u8]) -> Result<(Option<String>, Option<String>), String> {
    let mut input = protobuf::CodedInputStream::from_bytes(value);
    let (mut path, mut body) = (None, None);
    while let Some(tag) = input.read_raw_tag_or_eof().map_err(|e| e.to_string())? {
        match tag {
            18 => path = Some(input.read_string().map_err(|e| e.to_string())?),
            26 => body = Some(input.read_string().map_err(|e| e.to_string())?),
            t => input
                .skip_field(protobuf::rt::WireType::new(t & 7).ok_or("a bad wire type")?)
                .map_err(|e| e.to_string())?,
        }
    }
    Ok((path.filter(|p| !p.is_empty()), body.filter(|b| !b.is_empty())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_parse_and_refuse() {
        let a = |v: &str| HashMap::from([(PORTS_ANNOTATION.to_string(), v.to_string())]);
        assert_eq!(ports(&a("80, 8080:81")).unwrap(), vec![(80, 80), (8080, 81)]);
        assert!(ports(&a("0")).is_err());
        assert!(ports(&a("http")).is_err());
        assert!(ports(&HashMap::new()).unwrap().is_empty());
        let many = (1..=65).map(|p| p.to_string()).collect::<Vec<_>>().join(",");
        assert!(ports(&a(&many)).unwrap_err().contains("more than 64"));
    }

    #[test]
    fn config_parses_and_checks() {
        let c = ShimConfig::parse(
            "memory_mib = 256\ncpus = 2\n[network]\nmode = \"allowlist\"\nallow_domains = [\"example.com\"]\n",
        )
        .unwrap();
        assert_eq!((c.memory_mib, c.cpus), (256, 2));
        assert_eq!(c.network.allow_domains, vec!["example.com"]);
        assert!(ShimConfig::parse("memroy_mib = 1").unwrap_err().contains("memroy_mib"));
        assert!(ShimConfig::parse("[network]\nallow_domains = [\"bad name!\"]").is_err());
    }

    #[test]
    fn a_pods_limits_size_its_vm() {
        let spec = |annotations: serde_json::Value, resources: serde_json::Value| -> oci_spec::runtime::Spec {
            serde_json::from_value(serde_json::json!({
                "ociVersion": "1.0.2", "root": {"path": "rootfs"},
                "annotations": annotations, "linux": {"resources": resources}
            }))
            .unwrap()
        };
        let c = ShimConfig::default();
        // No limits: the handler's defaults.
        let s = c.settings(&spec(serde_json::json!({}), serde_json::json!({}))).unwrap();
        assert_eq!((s.memory_mib, s.cpus), (Some(512), Some(1)));
        // The container's own (ctr run --memory-limit): 1 GiB + 64 MiB; 1.5 CPUs -> 2.
        let r = serde_json::json!({"memory": {"limit": 1i64 << 30}, "cpu": {"quota": 150000, "period": 100000}});
        let s = c.settings(&spec(serde_json::json!({}), r)).unwrap();
        assert_eq!((s.memory_mib, s.cpus), (Some(1088), Some(2)));
        // A CRI pod's, from the sandbox's annotations; capped by the handler's maximum.
        let a = serde_json::json!({
            "io.kubernetes.cri.sandbox-memory": (64i64 << 30).to_string(),
            "io.kubernetes.cri.sandbox-cpu-quota": "400000", "io.kubernetes.cri.sandbox-cpu-period": "100000"
        });
        let s = c.settings(&spec(a, serde_json::json!({}))).unwrap();
        assert_eq!((s.memory_mib, s.cpus), (Some(8192), Some(4)));
        // A pod's network, and a bad one named.
        let a = serde_json::json!({"io.umbra.network": "{\"mode\": \"any\"}"});
        assert_eq!(
            c.settings(&spec(a, serde_json::json!({}))).unwrap().network.unwrap().mode,
            umbra_policy::NetworkMode::Any
        );
        let a = serde_json::json!({"io.umbra.network": "{\"mode\": \"sometimes\"}"});
        assert!(c.settings(&spec(a, serde_json::json!({}))).unwrap_err().contains("io.umbra.network"));
        let closed = ShimConfig { network_annotations: false, ..ShimConfig::default() };
        let a = serde_json::json!({"io.umbra.network": "{\"mode\": \"any\"}"});
        assert!(closed.settings(&spec(a.clone(), serde_json::json!({}))).unwrap_err().contains("does not let pods"));
        let ceiling =
            ShimConfig::parse("[network_ceiling]\nmode = \"allowlist\"\nallow_domains = [\"*.example.com\"]\n")
                .unwrap();
        assert!(ceiling.settings(&spec(a, serde_json::json!({}))).unwrap_err().contains("network_ceiling"));
        let a = serde_json::json!({"io.umbra.network": "{\"mode\": \"allowlist\", \"allow_domains\": [\"api.example.com\"]}"});
        assert!(ceiling.settings(&spec(a, serde_json::json!({}))).is_ok());
    }

    #[test]
    fn runtime_options_give_the_config_path() {
        // type_url "x", config_path "/etc/u.toml"
        let mut bytes = vec![10, 1, b'x', 18, 11];
        bytes.extend_from_slice(b"/etc/u.toml");
        assert_eq!(runtime_options(&bytes).unwrap(), (Some("/etc/u.toml".into()), None));
        assert!(runtime_options(&[18, 40, b'a']).is_err());
    }
}
