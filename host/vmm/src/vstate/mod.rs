//! The VM's own state: guest memory, the KVM VM, its vCPUs.

pub mod cpu_model;
pub mod memory;
pub mod regs;
pub mod vcpu;
pub mod vm;

/// What can go wrong setting up or running the VM. Messages name the step and the KVM error.
#[derive(Debug, thiserror::Error)]
pub enum VstateError {
    #[error("cannot open /dev/kvm: {0} (is KVM available and are you allowed to use it?)")]
    Kvm(kvm_ioctls::Error),
    #[error("KVM {step} failed: {source}")]
    Ioctl { step: &'static str, source: kvm_ioctls::Error },
    #[error("vCPU setup: {0}")]
    Setup(String),
    #[error("guest memory: {0}")]
    Memory(String),
    #[error("{what} does not fit in guest memory at {addr:#x}")]
    OutOfGuestMemory { what: &'static str, addr: u64 },
}
