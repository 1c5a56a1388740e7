//! umbra-vmm's control socket: one request per connection, one JSON line each way.
//!
//! ```text
//! → {"snapshot":{}}     with two descriptors attached (SCM_RIGHTS): the state file, then the
//!                       memory file, both open for writing and empty
//! ← {"ok":{"memory_bytes":1234,"phases_ms":{"vcpus":1,"devices":2,"memory":30,"state":1}}}
//! ← {"error":"why"}
//!
//! → {"fork":{}}         the same two files; the VM runs on (a live fork):
//! ← {"paused":{"ms":3}} the guest is paused, its state captured; the caller copies what must
//!                       match the fork point (the session disk), then
//! → {"resume":{}}       and the guest runs again (at once if the caller hangs up)
//! ← {"ok":{…}}          once the memory file is complete
//! ```

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum ControlRequest {
    /// Pause the VM, write its state and memory to the two attached files, and end it with
    /// [`crate::exit::VmmStatus::Snapshotted`].
    Snapshot {},
    /// Pause the VM, capture its state and a copy-on-write view of its memory, answer
    /// [`ControlReply::Paused`], wait for [`ControlRequest::Resume`] and run on; the two files
    /// are complete when [`ControlReply::Ok`] comes.
    Fork {},
    /// The second line of a fork: the caller has copied what had to match the pause.
    Resume {},
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum ControlReply {
    Ok(SnapshotTaken),
    /// A fork's guest is paused: what must match the fork point can be copied now.
    Paused(ForkPaused),
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkPaused {
    /// Milliseconds since the pause began.
    pub ms: u64,
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
    /// A live fork: how long the guest was paused, from the request to its vCPUs running
    /// again (the phases above then overlap the run: memory is copied in the background).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub paused: u64,
    /// A live fork: how long the devices were stopped (the guest's I/O waited), from the
    /// request on. With shared folders the guest runs on meanwhile while its memory is copied,
    /// and only `paused` of it has its vCPUs stopped; otherwise the same as `paused`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub devices_held: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl std::fmt::Display for Phases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Phases { vcpus, devices, memory, state, paused, devices_held } = self;
        if *paused > 0 && devices_held > paused {
            write!(f, "paused {paused} ms, devices held {devices_held} ms: ")?;
        } else if *paused > 0 {
            write!(f, "paused {paused} ms: ")?;
        }
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
            phases_ms: Phases { vcpus: 1, devices: 2, memory: 30, state: 1, paused: 0, devices_held: 0 },
        });
        let line = serde_json::to_string(&ok).unwrap();
        assert_eq!(line, r#"{"ok":{"memory_bytes":1234,"phases_ms":{"vcpus":1,"devices":2,"memory":30,"state":1}}}"#);
        assert_eq!(serde_json::from_str::<ControlReply>(&line).unwrap(), ok);
        let refused: ControlReply = serde_json::from_str(r#"{"error":"no files"}"#).unwrap();
        assert_eq!(refused, ControlReply::Error("no files".into()));
        assert!(serde_json::from_str::<ControlRequest>(r#"{"snapshot":{},"x":1}"#).is_err());
        assert_eq!(
            Phases { vcpus: 1, devices: 2, memory: 30, state: 1, paused: 0, devices_held: 0 }.to_string(),
            "vcpus 1 ms, devices 2 ms, memory 30 ms, state 1 ms"
        );
        assert_eq!(serde_json::to_string(&ControlRequest::Fork {}).unwrap(), r#"{"fork":{}}"#);
        assert_eq!(serde_json::to_string(&ControlRequest::Resume {}).unwrap(), r#"{"resume":{}}"#);
        let paused = serde_json::to_string(&ControlReply::Paused(ForkPaused { ms: 3 })).unwrap();
        assert_eq!(paused, r#"{"paused":{"ms":3}}"#);
        let live = Phases { vcpus: 1, devices: 2, memory: 300, state: 1, paused: 9, devices_held: 9 };
        assert_eq!(live.to_string(), "paused 9 ms: vcpus 1 ms, devices 2 ms, memory 300 ms, state 1 ms");
        let precopy = Phases { devices_held: 310, ..live };
        assert_eq!(
            precopy.to_string(),
            "paused 9 ms, devices held 310 ms: vcpus 1 ms, devices 2 ms, memory 300 ms, state 1 ms"
        );
        assert_eq!(serde_json::from_str::<Phases>(&serde_json::to_string(&live).unwrap()).unwrap(), live);
    }
}
