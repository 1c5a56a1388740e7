//! umbra-runtime: everything the host needs to run sandboxes, above the VMM.
//!
//! Today: [`agent`], the client of the in-guest agent. Backends, sessions, mounts, policy and
//! the egress proxy grow here; KVM internals never do (they live in umbra-vmm).

pub mod agent;
