//! Which backend runs a VM on this host, and why: the one rule `vmctl run`, sessions and
//! `vmctl doctor` share. Also the registry from a [`BackendKind`] to its [`Backend`], and so
//! [`Vm::launch`], the one entry that checks a spec against the backend's capabilities.

use umbra_api::BackendChoice;
use umbra_bundle::Arch;

use super::host::KvmKind;
use super::vm::{Backend, Vm};
use super::{kvm, qemu, vz, BackendKind, Capabilities, VmError, VmSpec};

impl BackendKind {
    /// The backend of this kind.
    pub fn backend(self) -> &'static dyn Backend {
        match self {
            BackendKind::Kvm => &kvm::KvmBackend,
            BackendKind::Qemu => &qemu::QemuBackend,
            BackendKind::Vz => &vz::VzBackend,
        }
    }

    pub fn capabilities(self) -> Capabilities {
        self.backend().capabilities()
    }
}

impl Vm {
    /// Boots `spec` on `backend` and waits for the agent; refuses first what the backend
    /// cannot do (another architecture, a restore without snapshots).
    pub async fn launch(backend: BackendKind, spec: &VmSpec) -> Result<Self, VmError> {
        let backend = backend.backend();
        backend.capabilities().check(backend.kind(), spec)?;
        backend.launch(spec).await
    }
}

/// The backend for `choice` on this host and a guest of `arch`, with the reason (shown by
/// `vmctl doctor` and in the `ready` event).
pub fn choose(choice: BackendChoice, arch: Arch) -> Result<(BackendKind, String), VmError> {
    if cfg!(target_os = "macos") {
        return choose_on_macos(choice, arch);
    }
    if arch != Arch::host() {
        return foreign(choice, arch);
    }
    choose_for(choice, KvmKind::detect(), kvm::find_vmm().is_some())
}

/// [`choose`] for a VM that resumes a snapshot: `auto` takes the first backend here whose
/// capabilities include snapshots; a backend asked for by name is checked by [`Vm::launch`].
pub fn choose_snapshot_capable(choice: BackendChoice, arch: Arch) -> Result<(BackendKind, String), VmError> {
    if choice != BackendChoice::Auto {
        return choose(choice, arch);
    }
    let mut refused = Vec::new();
    for kind in BackendKind::ALL.into_iter().filter(|k| k.capabilities().snapshot) {
        match choose(kind.choice(), arch) {
            Ok((kind, why)) => return Ok((kind, format!("the snapshot needs it ({why})"))),
            Err(e) => refused.push(format!("{}: {e}", kind.name())),
        }
    }
    Err(VmError::BackendUnavailable(format!("no backend here can restore a snapshot ({})", refused.join("; "))))
}

/// macOS: Virtualization.framework runs arm64 guests on Apple silicon; there is no KVM, and
/// QEMU here lacks the vhost-user daemons (Linux-only) the qemu backend needs, so nothing
/// runs another architecture.
fn choose_on_macos(choice: BackendChoice, arch: Arch) -> Result<(BackendKind, String), VmError> {
    if arch != Arch::Aarch64 || Arch::host() != Arch::Aarch64 {
        return Err(VmError::BackendUnavailable(format!(
            "on macOS Umbra runs aarch64 guests on Apple silicon (the vz backend); this bundle is {arch} on an {} host",
            Arch::host()
        )));
    }
    match choice {
        BackendChoice::Auto => Ok((BackendKind::Vz, "macOS: Virtualization.framework".into())),
        BackendChoice::Vz => Ok((BackendKind::Vz, "requested".into())),
        BackendChoice::Kvm | BackendChoice::Qemu => Err(VmError::BackendUnavailable(
            "on macOS only the vz backend (Virtualization.framework) runs the host's architecture".into(),
        )),
    }
}

/// A guest of another architecture: only QEMU, which emulates it, runs it.
fn foreign(choice: BackendChoice, arch: Arch) -> Result<(BackendKind, String), VmError> {
    let host = Arch::host();
    match choice {
        BackendChoice::Qemu | BackendChoice::Auto => {
            Ok((BackendKind::Qemu, format!("an {arch} guest on an {host} host: QEMU with TCG emulation")))
        }
        BackendChoice::Kvm | BackendChoice::Vz => Err(VmError::BackendUnavailable(format!(
            "backends kvm and vz run only {host} guests on this host; this bundle is {arch} (use the qemu backend)"
        ))),
    }
}

fn choose_for(choice: BackendChoice, kvm: KvmKind, have_vmm: bool) -> Result<(BackendKind, String), VmError> {
    let unavailable = |why: &str| Err(VmError::BackendUnavailable(why.to_string()));
    match choice {
        BackendChoice::Qemu => Ok((BackendKind::Qemu, "requested".into())),
        BackendChoice::Vz => unavailable("backend vz is Apple's Virtualization.framework: it runs only on macOS"),
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
    fn a_foreign_guest_is_emulated_and_never_given_to_kvm() {
        let other = if Arch::host() == Arch::X86_64 { Arch::Aarch64 } else { Arch::X86_64 };
        let (backend, why) = choose(BackendChoice::Auto, other).unwrap();
        assert_eq!(backend, BackendKind::Qemu);
        assert!(why.contains("TCG"), "{why}");
        let e = choose(BackendChoice::Kvm, other).unwrap_err().to_string();
        assert!(e.contains(other.as_str()) && e.contains("qemu"), "{e}");
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
