//! umbra-vmm: the KVM virtual machine monitor.
//!
//! Layout follows Firecracker's: `vstate/` holds the VM's own state (KVM handles, guest memory,
//! vCPUs and their boot state), `boot/` loads Linux and describes the machine to it, `devices/`
//! holds the emulated devices (legacy PC devices and virtio-mmio), `bus` routes vCPU exits to
//! them, `machine` assembles a microVM from a [`config::VmConfig`] and runs it, and [`exit`]
//! names the distinct ways a VM can end; [`jail`] confines the process before the machine is
//! assembled and [`seccomp`] each of its threads; [`snapshot`] saves a paused VM's state to a
//! checked, versioned file and restores it.

pub mod bare;
pub mod boot;
pub mod bus;
pub mod config;
pub mod control;
pub mod devices;
pub mod exit;
pub mod jail;
pub mod machine;
pub mod seccomp;
pub mod snapshot;
pub mod vstate;

pub use exit::VmExit;
