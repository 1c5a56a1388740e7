//! Snapshots of a paused VM: a versioned state file beside a memory file.
//!
//! - [`file`]: the state file — magic, format version, a SHA-256 of the body, then the body
//!   (JSON). Anything else (another format version, a flipped byte, a truncated copy) is refused
//!   with an error naming the problem, before any state reaches KVM.
//! - [`cpu`]: the KVM state of the VM (in-kernel PIC, IOAPIC, PIT, KVM clock) and of each vCPU
//!   (registers, special registers, XSAVE, XCRs, LAPIC, MSRs, MP state, pending events, debug
//!   registers, TSC frequency, CPUID), captured from a paused VM and restored into a new one in
//!   the order KVM needs. A snapshot whose vCPUs use CPU features this host cannot offer is
//!   refused, naming the CPUID leaf, register and bits.
//! - [`memory`]: guest memory written out sparsely (zero pages are holes), and mapped back
//!   `MAP_PRIVATE`, so VMs restored from one memory file share every page none of them wrote.
//! - Devices, kept by the devices' own modules: each virtio transport's registers and queue layout
//!   ([`crate::devices::virtio::mmio::TransportState`]) with the device's own typed state
//!   ([`crate::devices::virtio::persist::DeviceState`]: virtiofsd's FUSE session for virtio-fs),
//!   and the serial port's registers ([`crate::devices::legacy::SerialSnapshot`]).
//!
//! Pausing a running umbra-vmm and writing these files is [`crate::control`]'s; restoring is
//! [`crate::machine::Machine::restore`].

pub mod cpu;
pub mod file;
pub mod memory;

pub use cpu::{SnapshotState, VcpuState, VmState};

/// Why a snapshot could not be taken or restored. Each names the problem and, for a refused
/// file, what would have to change.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("{path}: not an umbra snapshot state file (bad magic)")]
    NotASnapshot { path: String },
    #[error(
        "{path}: state file format version {found}; this umbra-vmm reads version {supported} \
         (take the snapshot again with this version)"
    )]
    Version { path: String, found: u32, supported: u32 },
    #[error("{path}: the state file is truncated: {found} of {expected} bytes")]
    Truncated { path: String, expected: u64, found: u64 },
    #[error("{path}: the state file is corrupt: its SHA-256 does not match its contents")]
    Checksum { path: String },
    #[error("{path}: the state file does not parse: {reason}")]
    Parse { path: String, reason: String },
    #[error("the snapshot's vCPU {vcpu} uses CPU features this host lacks: {missing}")]
    CpuFeatures { vcpu: u8, missing: String },
    #[error("the snapshot does not fit this machine: {0}")]
    Mismatch(String),
    #[error("KVM {step} failed: {source}")]
    Ioctl { step: &'static str, source: kvm_ioctls::Error },
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
}

impl SnapshotError {
    pub(crate) fn ioctl(step: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> Self {
        move |source| Self::Ioctl { step, source }
    }

    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let what = what.into();
        move |source| Self::Io { what, source }
    }
}
