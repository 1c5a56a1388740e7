//! Test lane (b): small bare guests on the host's real /dev/kvm (kvm_pvm on the development
//! machines, which runs these although it cannot boot Linux). Each guest is a few hand-assembled
//! 64-bit instructions; together they prove the vCPU boot state, the run loop, the serial
//! console, the i8042 reset exit and the other exits.

use std::time::Instant;

use umbra_vmm::devices::legacy::{ConsoleLog, LegacyBus};
use umbra_vmm::vstate::{memory, vcpu::Vcpu, vm::Vm};
use umbra_vmm::VmExit;
use vm_memory::{Bytes, GuestAddress};

const LOAD_ADDR: u64 = 0x10_0000;
const STACK_TOP: u64 = 0x8_0000;

/// x86-64 machine code builders for the few instructions these guests use.
fn print(text: &str) -> Vec<u8> {
    let mut code = vec![0x66, 0xba, 0xf8, 0x03]; // mov dx, 0x3f8
    for b in text.bytes() {
        code.extend([0xb0, b, 0xee]); // mov al, b ; out dx, al
    }
    code
}
const I8042_RESET: [u8; 4] = [0xb0, 0xfe, 0xe6, 0x64]; // mov al, 0xfe ; out 0x64, al
const CLI_HLT: [u8; 2] = [0xfa, 0xf4];
const UD2: [u8; 2] = [0x0f, 0x0b];

fn run(code: &[u8]) -> (VmExit, Vec<String>, std::time::Duration) {
    let started = Instant::now();
    let (mem, _memfd) = memory::memfd_backed(16 << 20).expect("guest memory");
    mem.write_slice(code, GuestAddress(LOAD_ADDR)).unwrap();
    let vm = Vm::new(mem).expect("VM (is /dev/kvm usable?)");
    let mut vcpu = Vcpu::new(&vm, 0).unwrap();
    vcpu.configure_long_mode(&vm, GuestAddress(LOAD_ADDR), STACK_TOP).unwrap();
    let console = ConsoleLog::default();
    let mut bus = LegacyBus::new(console.clone());
    let exit = vcpu.run(&mut bus);
    (exit, console.last_lines(), started.elapsed())
}

#[test]
fn prints_on_the_serial_console_and_resets_through_the_i8042() {
    let mut code = print("hello from a bare guest\n");
    code.extend(I8042_RESET);
    code.extend(CLI_HLT); // never reached
    let (exit, lines, took) = run(&code);
    eprintln!("bare guest launch -> exit in {took:?}");
    assert_eq!(exit, VmExit::Reset);
    assert_eq!(exit.status(), 0);
    assert_eq!(lines, vec!["hello from a bare guest".to_string()]);
}

#[test]
fn a_halt_with_interrupts_off_ends_the_vm() {
    let mut code = print("going to sleep\n");
    code.extend(CLI_HLT);
    let (exit, lines, _) = run(&code);
    assert_eq!(exit, VmExit::Halted);
    assert_eq!(lines, vec!["going to sleep".to_string()]);
}

#[test]
fn an_undeliverable_exception_is_a_triple_fault() {
    // No IDT: #UD cannot be delivered, which escalates to a triple fault.
    let mut code = print("about to fault\n");
    code.extend(UD2);
    let (exit, lines, _) = run(&code);
    eprintln!("ud2 without an IDT ended the VM with {exit:?}");
    assert!(matches!(exit, VmExit::TripleFault | VmExit::Internal(_)), "{exit:?}");
    assert_ne!(exit.status(), 0, "a crash is never reported as a clean exit");
    assert_eq!(lines, vec!["about to fault".to_string()]);
}

#[test]
fn unclaimed_ports_read_as_all_ones_and_the_guest_carries_on() {
    // in al, 0x80 ; cmp al, 0xff ; jne fail ; print ok ; reset ; fail: hlt
    let ok = print("ok\n");
    let mut code = vec![0xe4, 0x80, 0x3c, 0xff];
    let tail_len = (ok.len() + I8042_RESET.len()) as u8;
    code.extend([0x75, tail_len]); // jne +tail_len
    code.extend(ok);
    code.extend(I8042_RESET);
    code.extend(CLI_HLT);
    let (exit, lines, _) = run(&code);
    assert_eq!((exit, lines), (VmExit::Reset, vec!["ok".to_string()]));
}
