//! Snapshot and restore of vCPU and VM state on the host's real /dev/kvm (kvm_pvm on the
//! development machines): a bare guest is paused mid-program, saved to a state file and a
//! memory file, and a new VM restored from them runs the rest of the program with the
//! registers it had.

use std::path::PathBuf;
use umbra_contract::control::ControlReply;
use umbra_contract::exit::VmmStatus;

use kvm_ioctls::VcpuExit;
use umbra_vmm::bare::{BareGuest, LOAD_ADDR};
use umbra_vmm::bus::IoBus;
use umbra_vmm::devices::legacy::{ConsoleLog, LegacyBus};
use umbra_vmm::snapshot::{self, SnapshotState};
use umbra_vmm::vstate::{memory, vcpu::Vcpu, vm::Vm};
use umbra_vmm::VmExit;
use vm_memory::{Bytes, GuestAddress};

const SIZE: u64 = 16 << 20;
const COM1: u16 = 0x3f8;

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `mov cl, 'z'`, print "a" (the pause point), then print CL and a newline, and reset: the
/// restored VM prints "z" only if its RIP, RCX, RDX and paging came back.
fn program() -> Vec<u8> {
    let mut code = vec![0xb1, b'z']; // mov cl, 'z'
    code.extend(BareGuest::new().print("a").code());
    code.extend([0x88, 0xc8, 0xee]); // mov al, cl ; out dx, al
    code.extend(BareGuest::new().print("\n").reset().halt().code());
    code
}

#[test]
fn a_paused_bare_guest_resumes_in_a_restored_vm() {
    let dir = Dir(std::env::temp_dir().join(format!("umbra-snapshot-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).unwrap();
    let (state_path, memory_path) = (dir.0.join("state"), dir.0.join("memory"));

    // Run to the pause point: the guest's "a" on COM1.
    let mem = memory::anonymous(SIZE as usize).unwrap();
    mem.write_slice(&program(), GuestAddress(LOAD_ADDR)).unwrap();
    let vm = Vm::new(mem.clone()).expect("VM (is /dev/kvm usable?)");
    vm.setup_irqchip().unwrap();
    let mut vcpu = Vcpu::new(&vm, 0, 1).unwrap();
    vcpu.configure_long_mode(&vm, GuestAddress(LOAD_ADDR), 0x8_0000).unwrap();
    match vcpu.fd.run().unwrap() {
        VcpuExit::IoOut(COM1, [b'a']) => {}
        other => panic!("unexpected exit before the pause point: {other:?}"),
    }
    // KVM finishes an I/O instruction on the next KVM_RUN on some hosts (kvm_pvm has already
    // moved RIP past it): settle so the saved RIP is after the `out` everywhere.
    vcpu.settle().unwrap();
    let state = SnapshotState::capture(&vm.kvm, &vm.fd, &[(0, &vcpu.fd)], SIZE).unwrap();
    assert!(!state.vcpus[0].msrs.is_empty(), "MSRs were read");
    snapshot::file::save(&state, &state_path).unwrap();
    let touched = snapshot::memory::dump(&mem, SIZE, &memory_path).unwrap();
    eprintln!(
        "state file {} bytes, memory file {} bytes touched of {SIZE}",
        std::fs::metadata(&state_path).unwrap().len(),
        touched
    );
    drop(vcpu);
    drop(vm);

    // Restore into a new VM and run the rest.
    let state = snapshot::file::load(&state_path).unwrap();
    let mem = snapshot::memory::map_private(&memory_path, state.memory_size, true).unwrap();
    let vm = Vm::new(mem).unwrap();
    vm.setup_irqchip().unwrap();
    let mut vcpu = Vcpu::new(&vm, 0, 1).unwrap();
    state.check_vcpus(&[&vcpu.fd]).expect("the host that took the snapshot can run it");
    state.vm.restore(&vm.fd).unwrap();
    state.vcpus[0].restore(&vm.kvm, &vcpu.fd).unwrap();
    let console = ConsoleLog::default();
    let bus = IoBus::new(LegacyBus::new(console.clone()), vec![]);
    assert_eq!(vcpu.run(&bus), VmExit::Reset);
    assert_eq!(console.last_lines(), vec!["z".to_string()], "the rest of the program, with CL = 'z'");

    // The memory file is what was saved: the restored VM wrote none of it.
    let again = snapshot::memory::map_private(&memory_path, SIZE, false).unwrap();
    assert_eq!(again.read_obj::<[u8; 2]>(GuestAddress(LOAD_ADDR)).unwrap(), [0xb1, b'z']);
}

#[test]
fn a_snapshot_is_refused_on_a_host_without_its_cpu_features() {
    let vm = Vm::new(memory::anonymous(SIZE as usize).unwrap()).unwrap();
    vm.setup_irqchip().unwrap();
    let vcpu = Vcpu::new(&vm, 0, 1).unwrap();
    let mut state = SnapshotState::capture(&vm.kvm, &vm.fd, &[(0, &vcpu.fd)], SIZE).unwrap();
    let fresh = Vcpu::new(&vm, 1, 2).unwrap();
    state.check_vcpus(&[&fresh.fd]).unwrap();
    // Claim a leaf-7 feature bit that a fresh vCPU on this host is not offered.
    let offered = fresh.fd.get_cpuid2(kvm_bindings::KVM_MAX_CPUID_ENTRIES).unwrap();
    let offered = offered.as_slice().iter().find(|e| e.function == 7 && e.index == 0).map_or(0, |e| e.ebx);
    let bit = (0..32).find(|b| offered & (1 << b) == 0).expect("some leaf-7 EBX bit is not offered");
    let leaf7 = state.vcpus[0].cpuid.iter_mut().find(|e| e.function == 7 && e.index == 0);
    match leaf7 {
        Some(e) => e.ebx |= 1 << bit,
        None => state.vcpus[0].cpuid.push(kvm_bindings::kvm_cpuid_entry2 {
            function: 7,
            ebx: 1 << bit,
            ..Default::default()
        }),
    }
    let e = state.check_vcpus(&[&fresh.fd]).unwrap_err().to_string();
    assert!(
        e.contains(&format!("vCPU 0 uses CPU features this host lacks: CPUID.(EAX=0x7,ECX=0):EBX bits {bit}")),
        "{e}"
    );
    let e = state.check_vcpus(&[&fresh.fd, &vcpu.fd]).unwrap_err().to_string();
    assert!(e.contains("the snapshot has 1 vCPUs, the machine 2"), "{e}");
}

/// Where the spinning guest looks for its go-ahead.
const FLAG: u64 = 0x20_0000;

/// `mov cl, 'z'`, print "a\n", spin until the byte at FLAG is non-zero, then print CL and a
/// newline and reset: a guest that only a kick can stop, and that shows after a resume (or a
/// restore) that its registers survived.
fn spinner() -> Vec<u8> {
    let mut code = vec![0xb1, b'z']; // mov cl, 'z'
    code.extend(BareGuest::new().print("a\n").code());
    code.extend([0x48, 0xbb]); // mov rbx, FLAG
    code.extend(FLAG.to_le_bytes());
    code.extend([0x80, 0x3b, 0x00, 0x74, 0xfb]); // spin: cmp byte [rbx], 0 ; je spin
    code.extend([0x88, 0xc8, 0xee]); // mov al, cl ; out dx, al
    code.extend(BareGuest::new().print("\n").reset().halt().code());
    code
}

#[test]
fn a_spinning_guest_is_paused_by_a_kick_then_resumed_and_restored() {
    use std::os::unix::thread::JoinHandleExt;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{mpsc, Arc};
    use std::time::{Duration, Instant};
    use umbra_vmm::vstate::vcpu::{install_kick_handler, kick, Run};

    install_kick_handler().unwrap();
    let dir = Dir(std::env::temp_dir().join(format!("umbra-snapshot-kick-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).unwrap();
    let mem = memory::anonymous(SIZE as usize).unwrap();
    mem.write_slice(&spinner(), GuestAddress(LOAD_ADDR)).unwrap();
    let vm = Arc::new(Vm::new(mem.clone()).unwrap());
    vm.setup_irqchip().unwrap();
    let mut vcpu = Vcpu::new(&vm, 0, 1).unwrap();
    vcpu.configure_long_mode(&vm, GuestAddress(LOAD_ADDR), 0x8_0000).unwrap();
    let console = ConsoleLog::default();
    let bus = Arc::new(IoBus::new(LegacyBus::new(console.clone()), vec![]));
    let pause = Arc::new(AtomicBool::new(false));

    // The vCPU thread: runs until paused, hands its state over, waits for the word to resume.
    let (state_tx, state_rx) = mpsc::channel();
    let (resume_tx, resume_rx) = mpsc::channel::<()>();
    let thread = std::thread::spawn({
        let (vm, bus, pause) = (vm.clone(), bus.clone(), pause.clone());
        move || {
            assert_eq!(vcpu.run_until(&bus, &pause), Run::Paused);
            let state = SnapshotState::capture(&vm.kvm, &vm.fd, &[(0, &vcpu.fd)], SIZE).unwrap();
            state_tx.send(state).unwrap();
            resume_rx.recv().unwrap();
            vcpu.run_until(&bus, &pause)
        }
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while console.last_lines() != ["a"] {
        assert!(Instant::now() < deadline, "the guest never printed: {:?}", console.last_lines());
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(20)); // well into the spin loop
    pause.store(true, Ordering::Release);
    kick(thread.as_pthread_t()).unwrap();
    let state = state_rx.recv_timeout(Duration::from_secs(10)).expect("the kicked vCPU pauses");
    let rip = state.vcpus[0].regs.rip;
    let spin = LOAD_ADDR + 2 + BareGuest::new().print("a\n").code().len() as u64 + 10;
    assert!((spin..spin + 5).contains(&rip), "paused inside the spin loop: rip {rip:#x}, loop at {spin:#x}");

    // Saved while paused, the flag still 0.
    let (state_path, memory_path) = (dir.0.join("state"), dir.0.join("memory"));
    snapshot::file::save(&state, &state_path).unwrap();
    snapshot::memory::dump(&mem, SIZE, &memory_path).unwrap();

    // Resumed in place: the guest goes on where it was.
    vm_memory::Bytes::write_obj(&mem, 1u8, GuestAddress(FLAG)).unwrap();
    pause.store(false, Ordering::Release);
    resume_tx.send(()).unwrap();
    assert_eq!(thread.join().unwrap(), Run::Exit(VmExit::Reset));
    assert_eq!(console.last_lines(), vec!["a".to_string(), "z".to_string()]);

    // Restored elsewhere from the files, with the go-ahead written into the memory file.
    use std::os::unix::fs::FileExt;
    std::fs::File::options().write(true).open(&memory_path).unwrap().write_all_at(&[1], FLAG).unwrap();
    let state = snapshot::file::load(&state_path).unwrap();
    let vm = Vm::new(snapshot::memory::map_private(&memory_path, SIZE, false).unwrap()).unwrap();
    vm.setup_irqchip().unwrap();
    let mut vcpu = Vcpu::new(&vm, 0, 1).unwrap();
    state.check_vcpus(&[&vcpu.fd]).unwrap();
    state.vm.restore(&vm.fd).unwrap();
    state.vcpus[0].restore(&vm.kvm, &vcpu.fd).unwrap();
    let console = ConsoleLog::default();
    assert_eq!(vcpu.run(&IoBus::new(LegacyBus::new(console.clone()), vec![])), VmExit::Reset);
    assert_eq!(console.last_lines(), vec!["z".to_string()], "the restored guest left the loop with CL intact");
}

#[path = "support/process.rs"]
mod process;

/// The whole path through the `umbra-vmm` process, filtered as shipped: a spinning bare guest
/// (with a vsock device, which it never activates) is snapshotted through the control socket,
/// the VM ends with status 6, and a new `umbra-vmm --restore` of the files runs the rest of
/// the program. A refused request leaves the VM running; a damaged or mismatched snapshot is
/// refused by name.
#[test]
fn the_vmm_process_snapshots_through_its_control_socket_and_restores() {
    use std::io::{BufRead, BufReader};
    use std::os::unix::net::UnixStream;
    use std::process::Command;
    use std::time::{Duration, Instant};

    let dir = process::scratch_dir("snapshot", "process");
    let elf = dir.join("spinner.elf");
    std::fs::write(&elf, BareGuest::new().raw(&spinner()).to_elf()).unwrap();
    let snap = dir.join("snap");
    std::fs::create_dir_all(&snap).unwrap();
    let vmm_with = |console: &str, vsock: &str, memory: &str| {
        let mut c = Command::new(process::vmm_bin());
        c.arg("--kernel").arg(&elf).args(["--memory", memory, "--no-rng"]);
        c.arg("--console-log").arg(dir.join(console)).arg("--vsock-uds").arg(dir.join(vsock));
        c
    };
    let vmm = |console: &str, vsock: &str| vmm_with(console, vsock, "32");
    let control = dir.join("control.sock");
    let mut running = vmm("console", "v1.sock").arg("--control").arg(&control).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::fs::read_to_string(dir.join("console")).unwrap_or_default() != "a\n" {
        assert!(Instant::now() < deadline, "the guest never printed");
        std::thread::sleep(Duration::from_millis(5));
    }
    let ask = |request: &str, files: &[&std::fs::File]| {
        use std::os::fd::AsRawFd;
        use vmm_sys_util::sock_ctrl_msg::ScmSocket;
        let s = UnixStream::connect(&control).unwrap();
        let fds: Vec<i32> = files.iter().map(|f| f.as_raw_fd()).collect();
        s.send_with_fds(&[format!("{request}\n").as_bytes()], &fds).unwrap();
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).unwrap();
        serde_json::from_str::<ControlReply>(&line).unwrap()
    };
    let error = |reply: ControlReply| match reply {
        ControlReply::Error(e) => e,
        ok => panic!("not refused: {ok:?}"),
    };
    let (state_file, memory_file) =
        (std::fs::File::create(snap.join("state")).unwrap(), std::fs::File::create(snap.join("memory")).unwrap());
    let refused = error(ask(r#"{"snapshot": {}}"#, &[&state_file]));
    assert!(refused.contains("carries two files (state, memory), this one 1"), "{refused}");
    let refused = error(ask(r#"{"reboot": {}}"#, &[]));
    assert!(refused.contains("bad request"), "{refused}");
    match ask(r#"{"snapshot": {}}"#, &[&state_file, &memory_file]) {
        ControlReply::Ok(taken) => assert!(taken.memory_bytes > 0, "{taken:?}"),
        refused => panic!("{refused:?}"),
    }
    let status = running.wait().unwrap();
    assert_eq!(status.code(), Some(VmmStatus::Snapshotted.code()), "a snapshot ends the VM with status 6");

    // Restore with the go-ahead written into the memory file.
    use std::os::unix::fs::FileExt;
    std::fs::File::options().write(true).open(snap.join("memory")).unwrap().write_all_at(&[1], FLAG).unwrap();
    let out = vmm("console2", "v2.sock").arg("--restore").arg(&snap).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read_to_string(dir.join("console2")).unwrap(), "z\n");

    // Another machine than the snapshot's, or a damaged state file, is refused by name.
    let out = vmm_with("console3", "v3.sock", "64").arg("--restore").arg(&snap).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("the snapshot has 32 MiB"), "{out:?}");
    let mut state = std::fs::read(snap.join("state")).unwrap();
    let at = state.len() / 2;
    state[at] ^= 1;
    std::fs::write(snap.join("state"), state).unwrap();
    let out = vmm("console4", "v4.sock").arg("--restore").arg(&snap).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("the state file is corrupt"), "{out:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
