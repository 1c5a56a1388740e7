//! umbra-vmm: the KVM virtual machine monitor.
//!
//! Layout follows Firecracker's: `vstate/` holds the VM's own state (KVM handles, guest memory,
//! vCPUs and their boot state), `devices/` the emulated devices, and [`exit`] the distinct ways
//! a VM can end. This first layer runs a vCPU in 64-bit mode with the legacy devices a microVM
//! needs (8250 serial console, i8042 reset); the Linux loader, virtio-mmio devices and the
//! runtime's `kvm` backend build on it.

pub mod devices;
pub mod exit;
pub mod vstate;

pub use exit::VmExit;
