//! VM backends: launch a guest from a bundle, wait until its agent answers, tear it down.
//!
//! Every backend gives the same [`Vm`]: an agent connection over the backend's hybrid vsock
//! socket, a console log, and supervised helper processes that die with the VM — or with us.
//! Readiness is the agent handshake, not "the process started".

mod children;
pub mod confinement;
pub mod console;
mod dial;
pub mod disk;
mod error;
pub mod fsd;
#[cfg(target_os = "linux")]
mod helper_jail;
pub mod host;
pub mod kvm;
mod launch;
mod postmortem;
pub mod qemu;
pub use qemu::QEMU_SANDBOX;
mod rundir;
pub mod select;
mod spec;
mod vm;
pub mod vz;

pub use children::Supervised;
pub use dial::Dialer;
pub(crate) use error::io;
pub use error::VmError;
pub use host::KvmKind;
pub use rundir::{open_to_vmm, vsock_port_socket, vsock_socket, RunDir};
pub use spec::*;
pub use umbra_sys::FolderIdentity;
pub use vm::{host_memory_kib, Backend, DuringPause, FolderShare, Machine, Vm};

#[cfg(test)]
mod arch_tests {
    use super::*;
    use std::path::PathBuf;
    use umbra_bundle::Arch;

    #[tokio::test]
    async fn a_backend_that_runs_only_the_hosts_architecture_refuses_another_by_name() {
        let other = if Arch::host() == Arch::X86_64 { Arch::Aarch64 } else { Arch::X86_64 };
        let image = BootImage {
            version: "minimal-test".into(),
            arch: other,
            kernel: PathBuf::from("/nonexistent/Image"),
            initrd: None,
            rootfs: None,
            cmdline: String::new(),
            image: None,
        };
        for backend in [BackendKind::Kvm, BackendKind::Vz] {
            let e = Vm::launch(backend, &VmSpec::new(image.clone())).await.err().expect("refused");
            let text = e.to_string();
            assert!(matches!(e, VmError::WrongArch { .. }), "{backend:?}: {text}");
            assert!(text.contains(other.as_str()) && text.contains(Arch::host().as_str()), "{text}");
            assert!(text.contains("minimal-test") && text.contains("qemu"), "{text}");
        }
        let qemu = BackendKind::Qemu;
        assert!(qemu.capabilities().check_arch(qemu, &image).is_ok(), "QEMU emulates it");
    }

    #[test]
    fn vz_boots_only_arm64_guests() {
        let mut image = BootImage {
            version: "minimal-test".into(),
            arch: Arch::X86_64,
            kernel: PathBuf::from("/nonexistent/vmlinux"),
            initrd: None,
            rootfs: None,
            cmdline: String::new(),
            image: None,
        };
        let vz = BackendKind::Vz;
        let e = vz.capabilities().check_arch(vz, &image).unwrap_err().to_string();
        assert!(e.contains("aarch64 guests only") || e.contains("x86_64"), "{e}");
        image.arch = Arch::Aarch64;
        assert_eq!(vz.capabilities().check_arch(vz, &image).is_ok(), Arch::host() == Arch::Aarch64);
    }
}
