//! umbra-runtime: everything the host needs to run sandboxes, above the VMM.
//!
//! [`session`] is the spine: a [`session::SessionManager`] owns named sessions, each one VM
//! with its folders, processes, disk and settings, restarted when it fails and stopped when
//! idle; `vmctl`, `umbrad` and the tests all drive it. Below it, [`agent`] is the client of the
//! in-guest agent, [`backend`] launches VMs (`kvm`: umbra-vmm; `qemu`), [`share`] shares host
//! folders with them and [`image`] finds what to boot. Policy and the egress proxy grow here;
//! KVM internals never do (they live in umbra-vmm).

pub mod agent;
pub mod backend;
pub mod bundle_trust;
pub mod egress;
pub mod image;
pub mod oci;
pub mod paths;
pub mod session;
pub mod share;
pub mod system_policy;
