//! How a VM ended. Each outcome maps to its own process exit status so the runtime can tell a
//! clean guest shutdown from a crash without parsing text.

/// Why the VM stopped running.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmExit {
    /// The guest asked for a reset through the i8042 (Linux `reboot=k`): a clean shutdown, since
    /// a microVM never reboots in place.
    Reset,
    /// The vCPU triple-faulted (KVM_EXIT_SHUTDOWN), e.g. Linux `reboot=t`, or a crash.
    TripleFault,
    /// The vCPU halted with interrupts off: nothing can wake it.
    Halted,
    /// KVM could not run the guest, or the guest did something the VMM cannot emulate.
    Internal(String),
}

impl VmExit {
    /// The VMM process exit status for this outcome.
    pub fn status(&self) -> i32 {
        match self {
            VmExit::Reset => 0,
            VmExit::TripleFault => 2,
            VmExit::Halted => 3,
            VmExit::Internal(_) => 4,
        }
    }
}
