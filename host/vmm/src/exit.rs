//! How a VM ended. Each outcome maps to its own process exit status so the runtime can tell a
//! clean guest shutdown from a crash without parsing text.

use umbra_contract::exit::VmmStatus;

/// The `umbra-vmm` exit status when the VMM itself failed (bad configuration, KVM refused a
/// setup step); the message is on stderr.
pub const VMM_ERROR_STATUS: i32 = VmmStatus::VmmFailed.code();

/// Why the VM stopped running.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmExit {
    /// The guest asked for a reset through the i8042 (Linux `reboot=k`): a clean shutdown, since
    /// a microVM never reboots in place.
    Reset,
    /// The guest kernel panicked (it then resets; the console says why).
    GuestPanic,
    /// The vCPU triple-faulted (KVM_EXIT_SHUTDOWN): a guest crash.
    TripleFault,
    /// The vCPU halted with interrupts off and no irqchip to wake it (bare guests only).
    Halted,
    /// KVM could not run the guest, or the guest did something the VMM cannot emulate.
    Internal(String),
    /// A snapshot was taken through the control socket; the VM stopped there.
    Snapshotted,
}

impl VmExit {
    /// The VMM process exit status for this outcome (the runtime's contract).
    pub fn status(&self) -> i32 {
        match self {
            VmExit::Reset => VmmStatus::Shutdown,
            VmExit::GuestPanic => VmmStatus::GuestPanic,
            VmExit::TripleFault => VmmStatus::TripleFault,
            VmExit::Halted => VmmStatus::Halted,
            VmExit::Internal(_) => VmmStatus::Internal,
            VmExit::Snapshotted => VmmStatus::Snapshotted,
        }
        .code()
    }

    /// A one-line description for logs and error messages.
    pub fn describe(&self) -> String {
        match self {
            VmExit::Reset => "the guest shut down".into(),
            VmExit::GuestPanic => "the guest kernel panicked".into(),
            VmExit::TripleFault => "the guest triple-faulted (crashed)".into(),
            VmExit::Halted => "the vCPU halted with interrupts off".into(),
            VmExit::Internal(why) => format!("VMM internal error: {why}"),
            VmExit::Snapshotted => "a snapshot was taken; the VM stopped".into(),
        }
    }
}
