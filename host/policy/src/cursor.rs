//! Cursor's sandbox policy JSON (seed 003's `SandboxPolicy`, with its camelCase field names and
//! `TYPE_*` enum) read as an alias of ours: a team's existing policy file works as it is. What
//! it says that Umbra cannot honour is named in the error, never dropped.

use std::path::PathBuf;

use serde::Deserialize;
use serde_json::Value;

use crate::network::{NetworkMode, NetworkPolicy};
use crate::policy::{PolicyType, SandboxPolicy};

/// Cursor's field names.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CursorPolicy {
    #[serde(rename = "type", default)]
    kind: Option<Value>,
    #[serde(default)]
    network_access: Option<bool>,
    #[serde(default)]
    additional_readwrite_paths: Option<Vec<PathBuf>>,
    #[serde(default)]
    additional_readonly_paths: Option<Vec<PathBuf>>,
    #[serde(default)]
    debug_output_dir: Option<Value>,
    #[serde(default)]
    block_git_writes: Option<bool>,
    #[serde(default)]
    disable_tmp_write: Option<bool>,
    #[serde(default, rename = "ignore_mapping")]
    ignore_mapping: Option<Value>,
}

/// Keys only Cursor's shape has.
const CURSOR_KEYS: &[&str] = &[
    "networkAccess",
    "additionalReadwritePaths",
    "additionalReadonlyPaths",
    "debugOutputDir",
    "blockGitWrites",
    "disableTmpWrite",
    "ignore_mapping",
];

impl SandboxPolicy {
    /// A policy from JSON: Umbra's shape, or Cursor's (recognised by its field names or its
    /// `TYPE_*` / numeric `type`). Checked with [`SandboxPolicy::validate`].
    pub fn from_json(text: &str) -> Result<SandboxPolicy, String> {
        let value: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let cursor = value.as_object().is_some_and(|o| {
            o.keys().any(|k| CURSOR_KEYS.contains(&k.as_str()))
                || o.get("type").is_some_and(|t| t.is_number() || t.as_str().is_some_and(|s| s.starts_with("TYPE_")))
        });
        let policy = if cursor {
            from_cursor(value)?
        } else {
            serde_json::from_value(value).map_err(|e| format!("not a sandbox policy: {e}"))?
        };
        policy.validate().map_err(|e| e.to_string())?;
        Ok(policy)
    }
}

fn from_cursor(value: Value) -> Result<SandboxPolicy, String> {
    let c: CursorPolicy =
        serde_json::from_value(value).map_err(|e| format!("not a sandbox policy (Cursor's shape): {e}"))?;
    let mut cannot = Vec::new();
    if c.debug_output_dir.is_some() {
        cannot.push("debugOutputDir (Umbra writes no sandbox debug output; leave it out)".to_string());
    }
    if c.ignore_mapping.is_some() {
        cannot.push("ignore_mapping (Cursor's per-root ignore map; give `ignore` patterns instead)".to_string());
    }
    let kind = match c.kind.as_ref().map(cursor_type) {
        None => None,
        Some(Ok(kind)) => kind,
        Some(Err(e)) => {
            cannot.push(e);
            None
        }
    };
    if !cannot.is_empty() {
        return Err(format!("this Cursor policy says what Umbra cannot honour: {}", cannot.join("; ")));
    }
    let network = c.network_access.map(|any| NetworkPolicy {
        mode: if any { NetworkMode::Any } else { NetworkMode::None },
        ..Default::default()
    });
    Ok(SandboxPolicy {
        kind,
        network,
        additional_readwrite_paths: c.additional_readwrite_paths,
        additional_readonly_paths: c.additional_readonly_paths,
        block_git_writes: c.block_git_writes,
        disable_tmp_write: c.disable_tmp_write,
        ignore: None,
    })
}

/// Cursor's `type`: `TYPE_WORKSPACE_READONLY` (or without the prefix, or its number).
fn cursor_type(v: &Value) -> Result<Option<PolicyType>, String> {
    let name = match v {
        Value::Number(n) => match n.as_u64() {
            Some(1) => "INSECURE_NONE".to_string(),
            Some(2) => "WORKSPACE_READWRITE".to_string(),
            Some(3) => "WORKSPACE_READONLY".to_string(),
            _ => format!("{n}"),
        },
        Value::String(s) => s.trim_start_matches("TYPE_").to_ascii_uppercase(),
        other => other.to_string(),
    };
    match name.as_str() {
        "INSECURE_NONE" => Ok(Some(PolicyType::InsecureNone)),
        "WORKSPACE_READWRITE" => Ok(Some(PolicyType::WorkspaceReadwrite)),
        "WORKSPACE_READONLY" => Ok(Some(PolicyType::WorkspaceReadonly)),
        "UNSPECIFIED" | "0" => Err(
            "type UNSPECIFIED (Cursor runs it unsandboxed; say TYPE_INSECURE_NONE if that is meant, or leave type out)"
                .into(),
        ),
        _ => Err(format!(
            "type {name} (not one of Cursor's: TYPE_INSECURE_NONE, TYPE_WORKSPACE_READWRITE, TYPE_WORKSPACE_READONLY)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_policy_reads_as_ours_and_what_it_cannot_honour_is_named() {
        let ours = SandboxPolicy::from_json(r#"{"type": "workspace_readonly", "block_git_writes": true}"#).unwrap();
        assert_eq!((ours.kind, ours.block_git_writes), (Some(PolicyType::WorkspaceReadonly), Some(true)));
        let cursor = SandboxPolicy::from_json(
            r#"{"type": "TYPE_WORKSPACE_READWRITE", "networkAccess": false, "additionalReadonlyPaths": ["/opt/sdk"],
                "blockGitWrites": true, "disableTmpWrite": true}"#,
        )
        .unwrap();
        assert_eq!(cursor.kind, Some(PolicyType::WorkspaceReadwrite));
        assert_eq!(cursor.network.map(|n| n.mode), Some(NetworkMode::None));
        assert_eq!(cursor.additional_readonly_paths, Some(vec![PathBuf::from("/opt/sdk")]));
        assert_eq!((cursor.block_git_writes, cursor.disable_tmp_write), (Some(true), Some(true)));
        let numeric = SandboxPolicy::from_json(r#"{"type": 3, "networkAccess": true}"#).unwrap();
        assert_eq!(numeric.kind, Some(PolicyType::WorkspaceReadonly));
        assert_eq!(numeric.network.map(|n| n.mode), Some(NetworkMode::Any));
        let e = SandboxPolicy::from_json(r#"{"type": "TYPE_UNSPECIFIED", "debugOutputDir": "/tmp/x"}"#).unwrap_err();
        assert!(e.contains("debugOutputDir") && e.contains("UNSPECIFIED"), "{e}");
        let e = SandboxPolicy::from_json(r#"{"networkAccess": false, "yoloMode": true}"#).unwrap_err();
        assert!(e.contains("unknown field `yoloMode`"), "{e}");
        let e = SandboxPolicy::from_json(r#"{"additionalReadwritePaths": ["relative"]}"#).unwrap_err();
        assert!(e.contains("relative"), "checked as ours are: {e}");
    }
}
