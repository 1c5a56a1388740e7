//! The KVM state of a paused VM and its vCPUs: captured from one VM, restored into another.

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state, kvm_msr_entry,
    kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, CpuId, Msrs, KVM_CLOCK_TSC_STABLE,
    KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, KVM_MAX_CPUID_ENTRIES, KVM_MAX_MSR_ENTRIES,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};
use serde::{Deserialize, Serialize};

use super::SnapshotError;

/// Everything a state file holds.
#[derive(Debug, Serialize, Deserialize)]
pub struct SnapshotState {
    /// The umbra-vmm that wrote it (for people; the format version decides what is read).
    pub vmm: String,
    /// Guest memory size in bytes: the memory file's length.
    pub memory_size: u64,
    pub vm: VmState,
    pub vcpus: Vec<VcpuState>,
    /// Each virtio device's transport, in the order of their MMIO windows.
    #[serde(default)]
    pub devices: Vec<crate::devices::virtio::mmio::TransportState>,
    /// The serial port (absent in snapshots of a bare vCPU taken without a machine).
    #[serde(default)]
    pub serial: Option<crate::devices::legacy::SerialSnapshot>,
}

/// The VM-wide in-kernel devices and clock.
#[derive(Debug, Serialize, Deserialize)]
pub struct VmState {
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
    pub pit: kvm_pit_state2,
    pub clock: kvm_clock_data,
}

/// One vCPU's architectural and KVM state.
#[derive(Debug, Serialize, Deserialize)]
pub struct VcpuState {
    pub id: u8,
    pub cpuid: Vec<kvm_cpuid_entry2>,
    pub msrs: Vec<kvm_msr_entry>,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    pub xsave: kvm_xsave,
    pub xcrs: kvm_xcrs,
    pub debugregs: kvm_debugregs,
    pub lapic: kvm_lapic_state,
    pub mp_state: kvm_mp_state,
    pub events: kvm_vcpu_events,
    /// The guest TSC's frequency, where KVM reports it.
    pub tsc_khz: Option<u32>,
}

impl VmState {
    /// Reads the irqchip, PIT and clock of a VM whose vCPUs are all out of KVM_RUN.
    pub fn capture(vm: &VmFd) -> Result<Self, SnapshotError> {
        let chip = |chip_id| -> Result<kvm_irqchip, SnapshotError> {
            let mut c = kvm_irqchip { chip_id, ..Default::default() };
            vm.get_irqchip(&mut c).map_err(SnapshotError::ioctl("get irqchip"))?;
            Ok(c)
        };
        let mut clock = vm.get_clock().map_err(SnapshotError::ioctl("get clock"))?;
        // KVM_SET_CLOCK refuses this flag: it describes the host, not the guest.
        clock.flags &= !KVM_CLOCK_TSC_STABLE;
        Ok(Self {
            pic_master: chip(KVM_IRQCHIP_PIC_MASTER)?,
            pic_slave: chip(KVM_IRQCHIP_PIC_SLAVE)?,
            ioapic: chip(KVM_IRQCHIP_IOAPIC)?,
            pit: vm.get_pit2().map_err(SnapshotError::ioctl("get PIT"))?,
            clock,
        })
    }

    /// Restores into a VM whose irqchip and PIT exist, before its vCPUs' LAPICs are restored.
    pub fn restore(&self, vm: &VmFd) -> Result<(), SnapshotError> {
        vm.set_pit2(&self.pit).map_err(SnapshotError::ioctl("set PIT"))?;
        vm.set_clock(&self.clock).map_err(SnapshotError::ioctl("set clock"))?;
        for chip in [&self.pic_master, &self.pic_slave, &self.ioapic] {
            vm.set_irqchip(chip).map_err(SnapshotError::ioctl("set irqchip"))?;
        }
        Ok(())
    }
}

impl VcpuState {
    /// Reads vCPU `id`'s state; the vCPU must be out of KVM_RUN.
    pub fn capture(kvm: &Kvm, fd: &VcpuFd, id: u8) -> Result<Self, SnapshotError> {
        let cpuid = fd.get_cpuid2(KVM_MAX_CPUID_ENTRIES).map_err(SnapshotError::ioctl("get CPUID"))?;
        // First: KVM_GET_MP_STATE processes pending INIT/SIPI, which can change the registers
        // and the LAPIC read below (Firecracker's order; the events come last).
        let mp_state = fd.get_mp_state().map_err(SnapshotError::ioctl("get MP state"))?;
        Ok(Self {
            id,
            cpuid: cpuid.as_slice().to_vec(),
            msrs: read_msrs(kvm, fd)?,
            regs: fd.get_regs().map_err(SnapshotError::ioctl("get regs"))?,
            sregs: fd.get_sregs().map_err(SnapshotError::ioctl("get sregs"))?,
            xsave: fd.get_xsave().map_err(SnapshotError::ioctl("get XSAVE"))?,
            xcrs: fd.get_xcrs().map_err(SnapshotError::ioctl("get XCRs"))?,
            debugregs: fd.get_debug_regs().map_err(SnapshotError::ioctl("get debug registers"))?,
            lapic: fd.get_lapic().map_err(SnapshotError::ioctl("get LAPIC"))?,
            mp_state,
            events: fd.get_vcpu_events().map_err(SnapshotError::ioctl("get vCPU events"))?,
            tsc_khz: kvm.check_extension(Cap::GetTscKhz).then(|| fd.get_tsc_khz().ok()).flatten(),
        })
    }

    /// Restores into a new vCPU that has not run, in the order KVM needs: CPUID first (it
    /// decides which MSRs and XSAVE features exist), the LAPIC after the special registers
    /// (its base MSR lives there), MSRs after the LAPIC (the TSC deadline needs it), pending
    /// events last.
    pub fn restore(&self, kvm: &Kvm, fd: &VcpuFd) -> Result<(), SnapshotError> {
        let cpuid = CpuId::from_entries(&self.cpuid).map_err(|e| {
            SnapshotError::Mismatch(format!("vCPU {}: {} CPUID entries: {e:?}", self.id, self.cpuid.len()))
        })?;
        fd.set_cpuid2(&cpuid).map_err(SnapshotError::ioctl("set CPUID"))?;
        if let Some(khz) = self.tsc_khz {
            let here = fd.get_tsc_khz().ok();
            if here != Some(khz) && fd.set_tsc_khz(khz).is_err() {
                return Err(SnapshotError::Mismatch(format!(
                    "the snapshot's TSC ran at {khz} kHz, this host's at {} kHz, and KVM cannot scale it",
                    here.map_or("an unknown".into(), |k| k.to_string())
                )));
            }
        }
        fd.set_mp_state(self.mp_state).map_err(SnapshotError::ioctl("set MP state"))?;
        fd.set_regs(&self.regs).map_err(SnapshotError::ioctl("set regs"))?;
        fd.set_sregs(&self.sregs).map_err(SnapshotError::ioctl("set sregs"))?;
        // KVM_SET_XSAVE reads as much as the host's XSAVE area is; beyond 4 KiB (AMX) the
        // fixed-size struct would be read past its end.
        let area = kvm.check_extension_int(Cap::Xsave2);
        if area > std::mem::size_of::<kvm_xsave>() as i32 {
            return Err(SnapshotError::Mismatch(format!(
                "this host's XSAVE area is {area} bytes; snapshots cover 4096-byte areas only"
            )));
        }
        // SAFETY: checked just above: the kernel reads at most size_of::<kvm_xsave>() bytes.
        unsafe { fd.set_xsave(&self.xsave) }.map_err(SnapshotError::ioctl("set XSAVE"))?;
        fd.set_xcrs(&self.xcrs).map_err(SnapshotError::ioctl("set XCRs"))?;
        fd.set_debug_regs(&self.debugregs).map_err(SnapshotError::ioctl("set debug registers"))?;
        fd.set_lapic(&self.lapic).map_err(SnapshotError::ioctl("set LAPIC"))?;
        for chunk in self.msrs.chunks(KVM_MAX_MSR_ENTRIES) {
            let msrs = Msrs::from_entries(chunk).expect("a chunk fits KVM_MAX_MSR_ENTRIES");
            let set = fd.set_msrs(&msrs).map_err(SnapshotError::ioctl("set MSRs"))?;
            if set < chunk.len() {
                return Err(SnapshotError::Mismatch(format!(
                    "vCPU {}: KVM refused MSR {:#x}",
                    self.id, chunk[set].index
                )));
            }
        }
        fd.set_vcpu_events(&self.events).map_err(SnapshotError::ioctl("set vCPU events"))
    }
}

/// Every MSR KVM lists that reads back; one that does not (KVM lists a few a given CPU lacks)
/// is left out, as the guest could not have used it either.
fn read_msrs(kvm: &Kvm, fd: &VcpuFd) -> Result<Vec<kvm_msr_entry>, SnapshotError> {
    let list = kvm.get_msr_index_list().map_err(SnapshotError::ioctl("get MSR index list"))?;
    let mut rest: &[u32] = list.as_slice();
    let mut out = Vec::with_capacity(rest.len());
    while !rest.is_empty() {
        let chunk = &rest[..rest.len().min(KVM_MAX_MSR_ENTRIES)];
        let entries: Vec<kvm_msr_entry> =
            chunk.iter().map(|&index| kvm_msr_entry { index, ..Default::default() }).collect();
        let mut msrs = Msrs::from_entries(&entries).expect("a chunk fits KVM_MAX_MSR_ENTRIES");
        let read = fd.get_msrs(&mut msrs).map_err(SnapshotError::ioctl("get MSRs"))?;
        out.extend_from_slice(&msrs.as_slice()[..read]);
        // KVM stops at the first MSR it cannot read: skip it and go on after it.
        rest = &rest[(read + usize::from(read < chunk.len())).min(rest.len())..];
    }
    Ok(out)
}

/// The CPUID feature registers compared on restore: (leaf, subleaf, register).
const FEATURE_REGISTERS: [(u32, u32, Register); 9] = [
    (0x1, 0, Register::Ecx),
    (0x1, 0, Register::Edx),
    (0x7, 0, Register::Ebx),
    (0x7, 0, Register::Ecx),
    (0x7, 0, Register::Edx),
    (0xd, 0, Register::Eax),
    (0xd, 1, Register::Eax),
    (0x8000_0001, 0, Register::Ecx),
    (0x8000_0001, 0, Register::Edx),
];

/// Bits KVM changes at run time from the guest's own settings, not the CPU's: OSXSAVE
/// (CR4.OSXSAVE), APIC (the APIC base MSR's enable) and OSPKE (CR4.PKE).
fn dynamic_bits(leaf: u32, register: Register) -> u32 {
    match (leaf, register) {
        (0x1, Register::Ecx) => 1 << 27,
        (0x1, Register::Edx) => 1 << 9,
        (0x7, Register::Ecx) => 1 << 4,
        _ => 0,
    }
}

#[derive(Debug, Clone, Copy)]
enum Register {
    Eax,
    Ebx,
    Ecx,
    Edx,
}

impl Register {
    fn name(self) -> &'static str {
        match self {
            Self::Eax => "EAX",
            Self::Ebx => "EBX",
            Self::Ecx => "ECX",
            Self::Edx => "EDX",
        }
    }

    fn of(self, e: &kvm_cpuid_entry2) -> u32 {
        match self {
            Self::Eax => e.eax,
            Self::Ebx => e.ebx,
            Self::Ecx => e.ecx,
            Self::Edx => e.edx,
        }
    }
}

/// The feature bits `saved` uses that `host` does not offer, as "CPUID.(EAX=7,ECX=0):EBX bits
/// 5, 8"; empty when the host offers them all.
pub fn missing_features(saved: &[kvm_cpuid_entry2], host: &[kvm_cpuid_entry2]) -> Vec<String> {
    let find = |entries: &[kvm_cpuid_entry2], leaf: u32, index: u32| {
        entries.iter().find(|e| e.function == leaf && e.index == index).copied()
    };
    let mut missing = Vec::new();
    for (leaf, index, register) in FEATURE_REGISTERS {
        let Some(s) = find(saved, leaf, index) else { continue };
        let offered = find(host, leaf, index).map_or(0, |h| register.of(&h));
        let lacking = register.of(&s) & !offered & !dynamic_bits(leaf, register);
        if lacking != 0 {
            let bits: Vec<String> = (0..32).filter(|b| lacking & (1 << b) != 0).map(|b| b.to_string()).collect();
            missing.push(format!("CPUID.(EAX={leaf:#x},ECX={index}):{} bits {}", register.name(), bits.join(", ")));
        }
    }
    missing
}

impl SnapshotState {
    /// Captures a paused VM: `vcpus` with their ids, all out of KVM_RUN.
    pub fn capture(kvm: &Kvm, vm: &VmFd, vcpus: &[(u8, &VcpuFd)], memory_size: u64) -> Result<Self, SnapshotError> {
        let vcpus = vcpus.iter().map(|(id, fd)| VcpuState::capture(kvm, fd, *id)).collect::<Result<_, _>>()?;
        Ok(Self {
            vmm: env!("CARGO_PKG_VERSION").into(),
            memory_size,
            vm: VmState::capture(vm)?,
            vcpus,
            devices: vec![],
            serial: None,
        })
    }

    /// Refuses a snapshot these new vCPUs cannot run: a count or ids that differ, or CPU
    /// features a saved vCPU used that the same fresh vCPU here does not offer. `fresh` are
    /// the restoring VM's vCPUs, created (with umbra-vmm's CPU model) but not yet restored:
    /// what KVM reports for them is what this host gives a guest, which on some hypervisors
    /// differs from the CPUID umbra-vmm sets.
    pub fn check_vcpus(&self, fresh: &[&VcpuFd]) -> Result<(), SnapshotError> {
        if fresh.len() != self.vcpus.len() {
            return Err(SnapshotError::Mismatch(format!(
                "the snapshot has {} vCPUs, the machine {}",
                self.vcpus.len(),
                fresh.len()
            )));
        }
        for (i, (v, fd)) in self.vcpus.iter().zip(fresh).enumerate() {
            if v.id as usize != i {
                return Err(SnapshotError::Mismatch(format!("vCPU {i} is recorded as vCPU {}", v.id)));
            }
            let here = fd.get_cpuid2(KVM_MAX_CPUID_ENTRIES).map_err(SnapshotError::ioctl("get CPUID"))?;
            let missing = missing_features(&v.cpuid, here.as_slice());
            if !missing.is_empty() {
                return Err(SnapshotError::CpuFeatures { vcpu: v.id, missing: missing.join("; ") });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::devices::legacy::SerialSnapshot;
    use crate::devices::virtio::mmio::{QueueConfig, TransportState};
    use crate::devices::virtio::persist::{DeviceState, FsState};

    fn entry(function: u32, index: u32, ebx: u32, ecx: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 { function, index, ebx, ecx, ..Default::default() }
    }

    /// A state with made-up registers and devices, for the file format's tests.
    pub fn sample_state() -> SnapshotState {
        let vcpu = VcpuState {
            id: 0,
            cpuid: vec![entry(7, 0, 1 << 5, 0)],
            msrs: vec![kvm_msr_entry { index: 0x10, data: 12345, ..Default::default() }],
            regs: kvm_regs { rip: 0x10_0000, rax: 7, ..Default::default() },
            sregs: Default::default(),
            xsave: Default::default(),
            xcrs: Default::default(),
            debugregs: Default::default(),
            lapic: Default::default(),
            mp_state: Default::default(),
            events: Default::default(),
            tsc_khz: Some(2_000_000),
        };
        SnapshotState {
            vmm: "test".into(),
            memory_size: 16 << 20,
            vm: VmState {
                pic_master: Default::default(),
                pic_slave: Default::default(),
                ioapic: Default::default(),
                pit: Default::default(),
                clock: kvm_clock_data { clock: 99, ..Default::default() },
            },
            vcpus: vec![vcpu],
            devices: vec![TransportState {
                device_type: 26,
                status: 15,
                acked_features: 1 << 32,
                device_features_sel: 1,
                driver_features_sel: 1,
                queue_sel: 1,
                config_generation: 0,
                interrupt_status: 1,
                activated: true,
                queues: vec![QueueConfig {
                    size: 1024,
                    ready: true,
                    desc_table: 0x1000,
                    avail_ring: 0x5000,
                    used_ring: 0x6000,
                }],
                device: DeviceState::Fs(FsState { virtiofsd: b"session".to_vec() }),
                legacy_device_state: None,
            }],
            serial: Some(SerialSnapshot { registers: [1, 0, 2, 1, 3, 0x60, 8, 0xb0, 0], in_buffer: vec![b'x'] }),
        }
    }

    #[test]
    fn missing_features_name_leaf_register_and_bits() {
        // The snapshot's vCPU had AVX2 (leaf 7 EBX bit 5) and BMI2 (bit 8); this host offers BMI2 only.
        let saved = [entry(7, 0, (1 << 5) | (1 << 8), 0), entry(1, 0, 0, 1 << 27)];
        let host = [entry(7, 0, 1 << 8, 0), entry(1, 0, 0, 0)];
        assert_eq!(missing_features(&saved, &host), vec!["CPUID.(EAX=0x7,ECX=0):EBX bits 5".to_string()]);
        // OSXSAVE (leaf 1 ECX bit 27) follows the guest's CR4: never a missing feature.
        assert!(missing_features(&saved[1..], &host).is_empty());
        // A leaf the host lacks entirely offers nothing.
        let m = missing_features(&[entry(0x8000_0001, 0, 0, 1)], &host);
        assert_eq!(m, vec!["CPUID.(EAX=0x80000001,ECX=0):ECX bits 0".to_string()]);
    }
}
