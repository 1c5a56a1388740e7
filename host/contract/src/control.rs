//! umbra-vmm's control socket: one request per connection, one JSON line each way.
//!
//! ```text
//! → {"snapshot":{}}     with two descriptors attached (SCM_RIGHTS): the state file, then the
//!                       memory file, both open for writing and empty
//! ← {"ok":{"memory_bytes":1234,"phases_ms":{"vcpus":1,"devices":2,"memory":30,"state":1}}}
//! ← {"error":"why"}
//! ```

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum ControlRequest {
    /// Pause the VM, write its state and memory to the two attached files, and end it with
    /// [`crate::exit::VmmStatus::Snapshotted`].
    Snapshot {},
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum ControlReply {
    Ok(SnapshotTaken),
    /// Refused before the pause (the VM runs on), or failed after it (the VM ends with an
    /// internal error saying the same).
    Error(String),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotTaken {
    /// Bytes of guest memory written (a sparse file: untouched pages take no room).
    pub memory_bytes: u64,
    pub phases_ms: Phases,
}

/// Where a snapshot's pause went, in milliseconds, in the order the phases run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Phases {
    /// Every vCPU out of KVM_RUN, its registers read.
    pub vcpus: u64,
    /// Every device stopped between batches, its state read.
    pub devices: u64,
    /// The memory file written.
    pub memory: u64,
    /// The state file written.
    pub state: u64,
}

impl std::fmt::Display for Phases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Phases { vcpus, devices, memory, state } = self;
        write!(f, "vcpus {vcpus} ms, devices {devices} ms, memory {memory} ms, state {state} ms")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wire_form_is_one_short_json_line_each_way() {
        assert_eq!(serde_json::to_string(&ControlRequest::Snapshot {}).unwrap(), r#"{"snapshot":{}}"#);
        let ok = ControlReply::Ok(SnapshotTaken {
            memory_bytes: 1234,
            phases_ms: Phases { vcpus: 1, devices: 2, memory: 30, state: 1 },
        });
        let line = serde_json::to_string(&ok).unwrap();
        assert_eq!(line, r#"{"ok":{"memory_bytes":1234,"phases_ms":{"vcpus":1,"devices":2,"memory":30,"state":1}}}"#);
        assert_eq!(serde_json::from_str::<ControlReply>(&line).unwrap(), ok);
        let refused: ControlReply = serde_json::from_str(r#"{"error":"no files"}"#).unwrap();
        assert_eq!(refused, ControlReply::Error("no files".into()));
        assert!(serde_json::from_str::<ControlRequest>(r#"{"snapshot":{},"x":1}"#).is_err());
        assert_eq!(
            Phases { vcpus: 1, devices: 2, memory: 30, state: 1 }.to_string(),
            "vcpus 1 ms, devices 2 ms, memory 30 ms, state 1 ms"
        );
    }
}
