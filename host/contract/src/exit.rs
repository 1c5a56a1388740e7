//! umbra-vmm's exit status: how its VM ended, so the runtime tells a clean guest shutdown from
//! a crash without parsing text. umbra-vmm maps each outcome to a code; the runtime maps the
//! code back.

/// One outcome per exit status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmmStatus {
    /// The guest shut down (an i8042 reset with `reboot=k`: a microVM never reboots in place).
    Shutdown,
    /// umbra-vmm itself failed (bad configuration, KVM refused a setup step); stderr says why.
    VmmFailed,
    /// The guest kernel panicked (it then resets; the console says why).
    GuestPanic,
    /// The vCPU triple-faulted (KVM_EXIT_SHUTDOWN): a guest crash.
    TripleFault,
    /// The vCPU halted with interrupts off and no irqchip to wake it (bare guests only).
    Halted,
    /// KVM could not run the guest, or the guest did something the VMM cannot emulate.
    Internal,
    /// A snapshot was taken through the control socket; the VM stopped there.
    Snapshotted,
}

impl VmmStatus {
    pub const ALL: [VmmStatus; 7] = [
        VmmStatus::Shutdown,
        VmmStatus::VmmFailed,
        VmmStatus::GuestPanic,
        VmmStatus::TripleFault,
        VmmStatus::Halted,
        VmmStatus::Internal,
        VmmStatus::Snapshotted,
    ];

    /// The process exit status.
    pub const fn code(self) -> i32 {
        match self {
            VmmStatus::Shutdown => 0,
            VmmStatus::VmmFailed => 1,
            VmmStatus::GuestPanic => 2,
            VmmStatus::TripleFault => 3,
            VmmStatus::Halted => 4,
            VmmStatus::Internal => 5,
            VmmStatus::Snapshotted => 6,
        }
    }

    /// The outcome an exit status names; `None` for any other (a signal, a foreign code).
    pub fn from_code(code: i32) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.code() == code)
    }

    /// For the runtime's errors and logs.
    pub fn describe(self) -> &'static str {
        match self {
            VmmStatus::Shutdown => "the guest shut down",
            VmmStatus::VmmFailed => "umbra-vmm failed (see its log)",
            VmmStatus::GuestPanic => "the guest kernel panicked",
            VmmStatus::TripleFault => "the guest triple-faulted (crashed)",
            VmmStatus::Halted => "the guest vCPU halted for good",
            VmmStatus::Internal => "KVM could not run the guest (internal error)",
            VmmStatus::Snapshotted => "a snapshot was taken and the VM stopped",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::VmmStatus;

    #[test]
    fn every_status_maps_to_a_distinct_code_and_back() {
        for s in VmmStatus::ALL {
            assert_eq!(VmmStatus::from_code(s.code()), Some(s));
        }
        let mut codes: Vec<i32> = VmmStatus::ALL.iter().map(|s| s.code()).collect();
        codes.dedup();
        assert_eq!(codes.len(), VmmStatus::ALL.len());
        assert_eq!(VmmStatus::from_code(7), None);
        assert_eq!(VmmStatus::from_code(-1), None);
    }
}
