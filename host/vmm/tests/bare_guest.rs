//! Test lane (b): small bare guests on the host's real /dev/kvm (kvm_pvm on the development
//! machines, which runs these although it cannot boot Linux). In-process tests prove the vCPU
//! boot state and the run loop's exits; the `umbra-vmm` process tests prove the whole machine
//! (irqchip, loader, devices on the MMIO bus, exit statuses, teardown) the runtime launches.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use umbra_vmm::bare::{BareGuest, LOAD_ADDR};
use umbra_vmm::bus::IoBus;
use umbra_vmm::devices::legacy::{ConsoleLog, LegacyBus};
use umbra_vmm::vstate::{memory, vcpu::Vcpu, vm::Vm};
use umbra_vmm::VmExit;
use vm_memory::{Bytes, GuestAddress};

const STACK_TOP: u64 = 0x8_0000;

fn run(guest: BareGuest) -> (VmExit, Vec<String>, std::time::Duration) {
    let started = Instant::now();
    let (mem, _memfd) = memory::memfd_backed(16 << 20).expect("guest memory");
    mem.write_slice(guest.code(), GuestAddress(LOAD_ADDR)).unwrap();
    let vm = Vm::new(mem).expect("VM (is /dev/kvm usable?)");
    let mut vcpu = Vcpu::new(&vm, 0, 1).unwrap();
    vcpu.configure_long_mode(&vm, GuestAddress(LOAD_ADDR), STACK_TOP).unwrap();
    let console = ConsoleLog::default();
    let bus = IoBus::new(LegacyBus::new(console.clone()), vec![]);
    let exit = vcpu.run(&bus);
    (exit, console.last_lines(), started.elapsed())
}

#[test]
fn prints_on_the_serial_console_and_resets_through_the_i8042() {
    let (exit, lines, took) = run(BareGuest::new().print("hello from a bare guest\n").reset().halt());
    assert_eq!(exit, VmExit::Reset);
    assert_eq!(exit.status(), 0);
    assert_eq!(lines, vec!["hello from a bare guest".to_string()]);
    eprintln!("bare guest launch -> exit: {took:?}");
}

#[test]
fn a_halt_with_interrupts_off_ends_the_vm() {
    let (exit, lines, _) = run(BareGuest::new().print("before\n").halt());
    assert_eq!(exit, VmExit::Halted);
    assert_eq!(lines, vec!["before".to_string()]);
}

#[test]
fn an_undeliverable_exception_is_a_triple_fault() {
    // No IDT: the #UD cannot be delivered, nor the #DF after it.
    let (exit, _, _) = run(BareGuest::new().crash());
    assert_eq!(exit, VmExit::TripleFault);
    assert_ne!(exit.status(), 0, "a crash is never reported as a clean exit");
}

#[test]
fn unclaimed_ports_read_as_all_ones_and_the_guest_carries_on() {
    // in al, 0x80 ; cmp al, 0xff ; jne fail ; print "ok" ; reset ; fail: ud2
    let mut code = vec![0xe4, 0x80, 0x3c, 0xff];
    let ok = BareGuest::new().print("ok\n").reset();
    code.extend([0x75, ok.code().len() as u8]);
    code.extend(ok.code());
    code.extend(BareGuest::new().crash().code());
    let (mem, _memfd) = memory::memfd_backed(16 << 20).unwrap();
    mem.write_slice(&code, GuestAddress(LOAD_ADDR)).unwrap();
    let vm = Vm::new(mem).unwrap();
    let mut vcpu = Vcpu::new(&vm, 0, 1).unwrap();
    vcpu.configure_long_mode(&vm, GuestAddress(LOAD_ADDR), STACK_TOP).unwrap();
    let console = ConsoleLog::default();
    let exit = vcpu.run(&IoBus::new(LegacyBus::new(console.clone()), vec![]));
    assert_eq!(exit, VmExit::Reset);
    assert_eq!(console.last_lines(), vec!["ok".to_string()]);
}

// ---- the umbra-vmm process ----

#[path = "support/process.rs"]
mod process;
use process::vmm_bin;

struct Elf(PathBuf);
impl Elf {
    fn new(guest: &BareGuest, tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("umbra-bare-{tag}-{}.elf", std::process::id()));
        std::fs::write(&p, guest.to_elf()).unwrap();
        Self(p)
    }
}
impl Drop for Elf {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn vmm(guest: &BareGuest, tag: &str, extra: &[&str]) -> std::process::Output {
    let elf = Elf::new(guest, tag);
    Command::new(vmm_bin()).arg("--kernel").arg(&elf.0).args(["--memory", "32"]).args(extra).output().unwrap()
}

#[test]
fn the_vmm_process_exits_0_on_reset_with_the_console_on_stdout() {
    let out = vmm(&BareGuest::new().print("hi from umbra-vmm\n").reset(), "reset", &["--no-rng"]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hi from umbra-vmm\n");
}

#[test]
fn the_vmm_process_names_a_crash_and_shows_the_last_console_lines() {
    let out = vmm(&BareGuest::new().print("about to crash\n").crash(), "crash", &["--no-rng"]);
    assert_eq!(out.status.code(), Some(3), "triple fault status");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("triple-faulted") && err.contains("about to crash"), "{err}");
}

#[test]
fn a_vmm_setup_error_exits_1_with_a_message() {
    let out = Command::new(vmm_bin()).args(["--kernel", "/nonexistent/vmlinux"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot open kernel /nonexistent/vmlinux"));
    let out = Command::new(vmm_bin()).args(["--kernel", "k", "--cpus", "0"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cpus must be 1 to 32"));
    // Usage errors too (clap's own status would be 2, "guest panicked").
    let out = Command::new(vmm_bin()).args(["--kernel", "k", "--cpus", "300"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let out = Command::new(vmm_bin()).arg("--no-such-flag").output().unwrap();
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn a_bare_guest_reads_and_writes_the_virtio_mmio_registers() {
    // With no disks and no vsock, the rng is device 0 at the first window.
    let base = umbra_vmm::boot::layout::VIRTIO_MMIO_START;
    let guest = BareGuest::new()
        .print_mmio_bytes(base) // MagicValue: "virt"
        .print(" v")
        .print_mmio_digit(base + 0x04) // Version: 2
        .print(" id")
        .print_mmio_digit(base + 0x08) // DeviceID: 4 (rng)
        .write_mmio(base + 0x70, 1) // Status: ACKNOWLEDGE
        .print(" s")
        .print_mmio_digit(base + 0x70)
        .print(" none")
        .print_mmio_digit(0xe000_0000) // nobody there: all ones, '0' + 0xff = '/'
        .print("\n")
        .reset();
    let out = vmm(&guest, "mmio", &[]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "virt v2 id4 s1 none/\n");
}
