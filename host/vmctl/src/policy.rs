//! `--policy FILE`, which `vmctl run` and `vmctl session start` share: a sandbox policy as JSON
//! (the schema in `docs/policy.md`).

use std::path::PathBuf;

use clap::Args;
use umbra_policy::SandboxPolicy;

/// A policy file larger than this is not a policy.
const MAX_POLICY_FILE: u64 = 1 << 20;

#[derive(Args, Debug, Clone, Default)]
pub struct PolicyArgs {
    /// Sandbox policy, a JSON file: {"type": "workspace_readonly", "block_git_writes": true,
    /// "disable_tmp_write": true, "ignore": [".env"], "network": {"mode": "none"}} (docs/policy.md)
    #[arg(long, value_name = "FILE")]
    policy: Option<PathBuf>,
}

impl PolicyArgs {
    /// The policy the file holds, checked; `None` without `--policy`. A policy that sets the
    /// network together with network flags is refused: which should win would be a guess.
    pub fn load(&self, network_flags: bool) -> Result<Option<SandboxPolicy>, String> {
        let Some(path) = &self.policy else { return Ok(None) };
        let shown = path.display();
        let meta = std::fs::metadata(path).map_err(|e| format!("--policy {shown}: {e}"))?;
        if meta.len() > MAX_POLICY_FILE {
            return Err(format!("--policy {shown}: {} bytes is too large for a policy", meta.len()));
        }
        let text = std::fs::read_to_string(path).map_err(|e| format!("--policy {shown}: {e}"))?;
        // Umbra's shape, or Cursor's (its field names), checked either way.
        let policy = SandboxPolicy::from_json(&text).map_err(|e| format!("--policy {shown}: {e}"))?;
        if network_flags && policy.network.is_some() {
            return Err(format!(
                "--policy {shown} sets the network and so do --network/--allow-* flags: give it in one place"
            ));
        }
        Ok(Some(policy))
    }
}
