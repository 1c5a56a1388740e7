//! A vCPU: its boot state and its run loop. The run loop turns every exit into device emulation
//! or a [`VmExit`]; nothing the guest does can make it panic.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};

use kvm_bindings::KVM_MAX_CPUID_ENTRIES;
use kvm_ioctls::{VcpuExit, VcpuFd};
use vm_memory::GuestAddress;

use super::vm::Vm;
use super::{cpu_model, regs, VstateError};
use crate::boot::layout::BOOT_STACK_POINTER;
use crate::boot::BootEntry;
use crate::bus::{IoBus, PioOutcome};
use crate::exit::VmExit;

pub struct Vcpu {
    pub fd: VcpuFd,
    id: u8,
}

impl Vcpu {
    /// Creates vCPU `id` of `count` with its CPUID. With an in-kernel irqchip, vCPU 0 is the
    /// boot processor and the others wait for the guest's INIT/SIPI.
    pub fn new(vm: &Vm, id: u8, count: u8) -> Result<Self, VstateError> {
        let fd = vm.fd.create_vcpu(id as u64).map_err(|source| VstateError::Ioctl { step: "create vCPU", source })?;
        let mut cpuid = vm
            .kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(|source| VstateError::Ioctl { step: "get supported CPUID", source })?;
        let tsc_deadline = vm.kvm.check_extension(kvm_ioctls::Cap::TscDeadlineTimer);
        cpu_model::patch_cpuid(&mut cpuid, id, count, tsc_deadline);
        fd.set_cpuid2(&cpuid).map_err(|source| VstateError::Ioctl { step: "set CPUID", source })?;
        Ok(Self { fd, id })
    }

    pub fn id(&self) -> u8 {
        self.id
    }

    /// Everything a Linux guest expects of a vCPU at boot: MSRs, FPU, LAPIC pins, and for the
    /// boot vCPU the entry state of the boot protocol.
    pub fn configure_linux(&self, vm: &Vm, entry: BootEntry) -> Result<(), VstateError> {
        cpu_model::set_boot_msrs(&self.fd)?;
        cpu_model::set_boot_fpu(&self.fd)?;
        cpu_model::set_lint(&self.fd)?;
        let mut sregs = self.fd.get_sregs().map_err(|source| VstateError::Ioctl { step: "get sregs", source })?;
        let r = match entry {
            BootEntry::Pvh { entry, start_info } => {
                regs::protected_mode(&vm.memory, &mut sregs)?;
                regs::entry_regs(entry.0, 0, 0, start_info.0)
            }
            BootEntry::Linux64 { entry, zero_page } => {
                regs::long_mode(&vm.memory, &mut sregs)?;
                regs::entry_regs(entry.0, BOOT_STACK_POINTER, zero_page.0, 0)
            }
        };
        self.fd.set_sregs(&sregs).map_err(|source| VstateError::Ioctl { step: "set sregs", source })?;
        self.fd.set_regs(&r).map_err(|source| VstateError::Ioctl { step: "set regs", source })
    }

    /// Puts the vCPU in 64-bit mode at `entry` with stack `rsp` (bare test guests).
    pub fn configure_long_mode(&self, vm: &Vm, entry: GuestAddress, rsp: u64) -> Result<(), VstateError> {
        let mut sregs = self.fd.get_sregs().map_err(|source| VstateError::Ioctl { step: "get sregs", source })?;
        regs::long_mode(&vm.memory, &mut sregs)?;
        self.fd.set_sregs(&sregs).map_err(|source| VstateError::Ioctl { step: "set sregs", source })?;
        self.fd
            .set_regs(&regs::entry_regs(entry.0, rsp, 0, 0))
            .map_err(|source| VstateError::Ioctl { step: "set regs", source })
    }

    /// Completes what the last exit left pending in KVM (an I/O or MMIO instruction finishes
    /// only on the next KVM_RUN) without running guest code, so the state read next is that
    /// of an instruction boundary. Call on a vCPU out of KVM_RUN before saving its state.
    pub fn settle(&mut self) -> Result<(), VstateError> {
        self.fd.set_kvm_immediate_exit(1);
        let r = self.fd.run().map(drop);
        self.fd.set_kvm_immediate_exit(0);
        match r {
            Err(e) if e.errno() == libc::EINTR => Ok(()),
            Ok(()) => Err(VstateError::Setup("KVM_RUN with immediate_exit entered the guest".into())),
            Err(source) => Err(VstateError::Ioctl { step: "complete the pending exit", source }),
        }
    }

    /// Runs until the guest ends; every exit is handled or turned into a [`VmExit`].
    pub fn run(&mut self, bus: &IoBus) -> VmExit {
        loop {
            if let Run::Exit(exit) = self.run_until(bus, &AtomicBool::new(false)) {
                return exit;
            }
        }
    }

    /// Runs until the guest ends or, once `pause` is set and the thread kicked
    /// ([`kick`]), until it leaves KVM_RUN at an instruction boundary (what the last exit
    /// left pending completed): [`Run::Paused`], after which the state can be read and the
    /// vCPU run again. Call [`install_kick_handler`] once per process first.
    pub fn run_until(&mut self, bus: &IoBus, pause: &AtomicBool) -> Run {
        let kvm_run: *mut kvm_bindings::kvm_run = self.fd.get_kvm_run();
        KVM_RUN.with(|p| p.set(kvm_run));
        let outcome = self.run_loop(bus, pause);
        KVM_RUN.with(|p| p.set(std::ptr::null_mut()));
        outcome
    }

    fn run_loop(&mut self, bus: &IoBus, pause: &AtomicBool) -> Run {
        loop {
            if pause.load(Ordering::Acquire) {
                // Set before the kick or found here: either way leave at a boundary. The flag
                // makes the KVM_RUN below finish any pending exit and return at once.
                self.fd.set_kvm_immediate_exit(1);
            }
            let r = self.fd.run();
            if matches!(&r, Err(e) if e.errno() == libc::EINTR) {
                self.fd.set_kvm_immediate_exit(0);
                if pause.load(Ordering::Acquire) {
                    return Run::Paused;
                }
                continue;
            }
            let exit = match r {
                Ok(VcpuExit::IoOut(port, data)) => {
                    if bus.pio_write(port, data) != PioOutcome::Reset {
                        continue;
                    }
                    VmExit::Reset
                }
                Ok(VcpuExit::IoIn(port, data)) => {
                    bus.pio_read(port, data);
                    continue;
                }
                Ok(VcpuExit::MmioRead(addr, data)) => {
                    bus.mmio_read(addr, data);
                    continue;
                }
                Ok(VcpuExit::MmioWrite(addr, data)) => {
                    bus.mmio_write(addr, data);
                    continue;
                }
                Ok(VcpuExit::Hlt) => VmExit::Halted,
                Ok(VcpuExit::Shutdown) => VmExit::TripleFault,
                Ok(VcpuExit::SystemEvent(kind, _)) => VmExit::Internal(format!("system event {kind}")),
                Ok(VcpuExit::FailEntry(reason, cpu)) => {
                    VmExit::Internal(format!("KVM could not enter the guest (reason {reason:#x}, cpu {cpu})"))
                }
                Ok(VcpuExit::InternalError) => VmExit::Internal("KVM internal error".into()),
                Ok(other) => VmExit::Internal(format!("unhandled vCPU exit {other:?}")),
                Err(e) if e.errno() == libc::EAGAIN => continue,
                Err(e) => VmExit::Internal(format!("KVM_RUN failed: {e}")),
            };
            return Run::Exit(exit);
        }
    }
}

/// How [`Vcpu::run_until`] returned.
#[derive(Debug, PartialEq, Eq)]
pub enum Run {
    /// The guest ended.
    Exit(VmExit),
    /// Paused as asked, at an instruction boundary.
    Paused,
}

thread_local! {
    /// This thread's vCPU `kvm_run` while it runs one, for the kick handler.
    static KVM_RUN: Cell<*mut kvm_bindings::kvm_run> = const { Cell::new(std::ptr::null_mut()) };
}

/// The signal that kicks a vCPU thread out of KVM_RUN.
pub fn kick_signal() -> libc::c_int {
    libc::SIGRTMIN()
}

extern "C" fn on_kick(_: libc::c_int) {
    // Only a thread-local read and a byte store: async-signal-safe. A KVM_RUN in progress
    // returns EINTR because a signal arrived; one about to start returns at once because of
    // the flag, so a kick is never lost between the pause check and KVM_RUN.
    KVM_RUN.with(|p| {
        let run = p.get();
        if !run.is_null() {
            // SAFETY: set by run_until on this thread to its vCPU's kvm_run mapping, which
            // lives as long as the VcpuFd that run_until borrows; cleared before it returns.
            unsafe { (*run).immediate_exit = 1 };
        }
    });
}

/// Installs the kick handler for [`kick_signal`], process-wide. Without SA_RESTART, so
/// KVM_RUN returns EINTR.
pub fn install_kick_handler() -> Result<(), VstateError> {
    // SAFETY: a zeroed sigaction is valid; sa_sigaction gets a handler of the right type and
    // the mask is emptied with sigemptyset before the call.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_kick as *const () as usize;
        libc::sigemptyset(&mut action.sa_mask);
        if libc::sigaction(kick_signal(), &action, std::ptr::null_mut()) != 0 {
            return Err(VstateError::Setup(format!(
                "install the vCPU kick handler: {}",
                std::io::Error::last_os_error()
            )));
        }
    }
    Ok(())
}

/// Kicks the vCPU thread `thread` (see [`Vcpu::run_until`]).
pub fn kick(thread: libc::pthread_t) -> Result<(), VstateError> {
    // SAFETY: pthread_kill only sends a signal; `thread` is a live thread the caller started.
    match unsafe { libc::pthread_kill(thread, kick_signal()) } {
        0 => Ok(()),
        e => Err(VstateError::Setup(format!("kick a vCPU thread: {}", std::io::Error::from_raw_os_error(e)))),
    }
}
