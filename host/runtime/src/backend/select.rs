//! Which backend runs a VM on this host, and why: the one rule `vmctl run`, sessions and
//! `vmctl doctor` share.

use umbra_api::BackendChoice;

use super::host::KvmKind;
use super::{kvm, BackendKind, VmError};

/// The backend for `choice` on this host, with the reason (shown by `vmctl doctor` and in the
/// `ready` event).
pub fn choose(choice: BackendChoice) -> Result<(BackendKind, String), VmError> {
    choose_for(choice, KvmKind::detect(), kvm::find_vmm().is_some())
}

fn choose_for(choice: BackendChoice, kvm: KvmKind, have_vmm: bool) -> Result<(BackendKind, String), VmError> {
    let unavailable = |why: &str| Err(VmError::BackendUnavailable(why.to_string()));
    match choice {
        BackendChoice::Qemu => Ok((BackendKind::Qemu, "requested".into())),
        BackendChoice::Kvm => {
            if kvm == KvmKind::Absent {
                return unavailable(
                    "backend kvm needs /dev/kvm, and this host has no usable one; use the qemu backend",
                );
            }
            if !have_vmm {
                return unavailable("backend kvm needs umbra-vmm next to vmctl/umbrad, on PATH or in UMBRA_VMM_BIN");
            }
            let note =
                if kvm == KvmKind::Pvm { " (warning: /dev/kvm is kvm_pvm, which cannot boot Linux)" } else { "" };
            Ok((BackendKind::Kvm, format!("requested{note}")))
        }
        BackendChoice::Auto => Ok(match (kvm, have_vmm) {
            (KvmKind::Hardware, true) => (BackendKind::Kvm, "hardware KVM (VT-x/AMD-V): the Umbra VMM".into()),
            (KvmKind::Hardware, false) => (
                BackendKind::Qemu,
                "hardware KVM found but umbra-vmm is missing (build it next to vmctl); qemu with -accel kvm".into(),
            ),
            (KvmKind::Pvm, _) => (
                BackendKind::Qemu,
                "/dev/kvm is kvm_pvm, which cannot boot a Linux guest; qemu with TCG emulation".into(),
            ),
            (KvmKind::Absent, _) => (BackendKind::Qemu, "no usable /dev/kvm; qemu with TCG emulation".into()),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_uses_the_vmm_only_on_hardware_kvm() {
        let pick = |kvm, vmm| choose_for(BackendChoice::Auto, kvm, vmm).unwrap().0;
        assert_eq!(pick(KvmKind::Hardware, true), BackendKind::Kvm);
        assert_eq!(pick(KvmKind::Hardware, false), BackendKind::Qemu);
        assert_eq!(pick(KvmKind::Pvm, true), BackendKind::Qemu);
        assert_eq!(pick(KvmKind::Absent, true), BackendKind::Qemu);
    }

    #[test]
    fn an_explicit_kvm_says_what_is_missing() {
        let e = choose_for(BackendChoice::Kvm, KvmKind::Absent, true).unwrap_err().to_string();
        assert!(e.contains("/dev/kvm"), "{e}");
        let e = choose_for(BackendChoice::Kvm, KvmKind::Hardware, false).unwrap_err().to_string();
        assert!(e.contains("umbra-vmm"), "{e}");
        let (_, why) = choose_for(BackendChoice::Kvm, KvmKind::Pvm, true).unwrap();
        assert!(why.contains("kvm_pvm"), "{why}");
    }
}
