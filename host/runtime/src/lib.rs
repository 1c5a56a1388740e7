//! umbra-runtime: everything the host needs to run sandboxes, above the VMM.
//!
//! [`agent`] is the client of the in-guest agent; [`backend`] launches VMs (QEMU today). Backends, sessions, mounts, policy and
//! the egress proxy grow here; KVM internals never do (they live in umbra-vmm).

pub mod agent;
pub mod backend;
pub mod paths;
pub mod share;
