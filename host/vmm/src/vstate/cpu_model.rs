//! What each vCPU looks like to the guest: CPUID (topology, APIC IDs, the hypervisor bit), the
//! MSRs Linux expects a firmware to have set, the FPU's reset state, and the local APIC's LINT
//! pins wired as on a PC (LINT0 = ExtINT from the PIC, LINT1 = NMI).

use kvm_bindings::{kvm_fpu, kvm_lapic_state, kvm_msr_entry, CpuId, Msrs};
use kvm_ioctls::VcpuFd;

use super::VstateError;

const LEAF_FEATURES: u32 = 1;
const LEAF_CACHE_PARAMS: u32 = 4;
const LEAF_EXT_TOPOLOGY: u32 = 0xb;
const LEAF_V2_EXT_TOPOLOGY: u32 = 0x1f;
const LEAF_AMD_EXT_APIC: u32 = 0x8000_001e;
const ECX_HYPERVISOR: u32 = 1 << 31;
/// The local APIC's TSC-deadline mode. KVM emulates it where it says so
/// (KVM_CAP_TSC_DEADLINE_TIMER) but never sets the bit in its supported CPUID: without it the
/// guest drives its timer in one-shot mode and calibrates the APIC against the PIT at boot.
const ECX_TSC_DEADLINE: u32 = 1 << 24;
const EDX_HTT: u32 = 1 << 28;

/// Makes `cpuid` describe vCPU `id` of `count`; `tsc_deadline`: KVM emulates the
/// TSC-deadline timer.
pub fn patch_cpuid(cpuid: &mut CpuId, id: u8, count: u8, tsc_deadline: bool) {
    for e in cpuid.as_mut_slice() {
        match e.function {
            LEAF_FEATURES => {
                // EBX[31:24] initial APIC ID, EBX[23:16] logical processors per package.
                e.ebx = (e.ebx & 0xffff) | ((id as u32) << 24) | ((count as u32) << 16);
                e.ecx |= ECX_HYPERVISOR;
                if tsc_deadline {
                    e.ecx |= ECX_TSC_DEADLINE;
                }
                if count > 1 {
                    e.edx |= EDX_HTT;
                } else {
                    e.edx &= !EDX_HTT;
                }
            }
            // x2APIC ID in EDX of every subleaf (0x1f is preferred by Linux where present).
            LEAF_EXT_TOPOLOGY | LEAF_V2_EXT_TOPOLOGY => e.edx = id as u32,
            // EAX[31:26]: cores per package - 1, consistent with leaf 1.
            LEAF_CACHE_PARAMS => e.eax = (e.eax & 0x03ff_ffff) | (((count as u32).saturating_sub(1)) << 26),
            LEAF_AMD_EXT_APIC => e.eax = id as u32,
            _ => {}
        }
    }
}

// MSR indices (Intel SDM vol. 4; AMD uses the same for these).
const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_CSTAR: u32 = 0xc000_0083;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
const MISC_ENABLE_FAST_STRING: u64 = 1;
/// MTRRs enabled, default memory type write-back: without it guest RAM may be uncached.
const MTRR_ENABLE_WRITEBACK: u64 = (1 << 11) | 6;

pub fn set_boot_msrs(fd: &VcpuFd) -> Result<(), VstateError> {
    let entries: Vec<kvm_msr_entry> = [
        (MSR_IA32_SYSENTER_CS, 0),
        (MSR_IA32_SYSENTER_ESP, 0),
        (MSR_IA32_SYSENTER_EIP, 0),
        (MSR_STAR, 0),
        (MSR_CSTAR, 0),
        (MSR_KERNEL_GS_BASE, 0),
        (MSR_SYSCALL_MASK, 0),
        (MSR_LSTAR, 0),
        (MSR_IA32_TSC, 0),
        (MSR_IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
        (MSR_MTRR_DEF_TYPE, MTRR_ENABLE_WRITEBACK),
    ]
    .into_iter()
    .map(|(index, data)| kvm_msr_entry { index, data, ..Default::default() })
    .collect();
    let msrs = Msrs::from_entries(&entries).map_err(|e| VstateError::Setup(format!("MSR list: {e:?}")))?;
    let written = fd.set_msrs(&msrs).map_err(|source| VstateError::Ioctl { step: "set MSRs", source })?;
    if written != entries.len() {
        let failed = entries[written].index;
        return Err(VstateError::Setup(format!("KVM refused MSR {failed:#x} ({written} of {} set)", entries.len())));
    }
    Ok(())
}

pub fn set_boot_fpu(fd: &VcpuFd) -> Result<(), VstateError> {
    let fpu = kvm_fpu { fcw: 0x37f, mxcsr: 0x1f80, ..Default::default() };
    fd.set_fpu(&fpu).map_err(|source| VstateError::Ioctl { step: "set FPU", source })
}

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

fn lapic_reg(state: &kvm_lapic_state, offset: usize) -> u32 {
    let b = &state.regs[offset..offset + 4];
    u32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8])
}

fn set_lapic_reg(state: &mut kvm_lapic_state, offset: usize, value: u32) {
    for (i, byte) in value.to_le_bytes().iter().enumerate() {
        state.regs[offset + i] = *byte as _;
    }
}

/// Delivery mode is bits 8–10 of an LVT entry.
fn with_delivery_mode(reg: u32, mode: u32) -> u32 {
    (reg & !0x700) | (mode << 8)
}

pub fn set_lint(fd: &VcpuFd) -> Result<(), VstateError> {
    let mut lapic = fd.get_lapic().map_err(|source| VstateError::Ioctl { step: "get LAPIC", source })?;
    let lvt0 = lapic_reg(&lapic, APIC_LVT0);
    set_lapic_reg(&mut lapic, APIC_LVT0, with_delivery_mode(lvt0, APIC_MODE_EXTINT));
    let lvt1 = lapic_reg(&lapic, APIC_LVT1);
    set_lapic_reg(&mut lapic, APIC_LVT1, with_delivery_mode(lvt1, APIC_MODE_NMI));
    fd.set_lapic(&lapic).map_err(|source| VstateError::Ioctl { step: "set LAPIC", source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_cpuid_entry2;

    #[test]
    fn cpuid_names_the_vcpu_and_the_hypervisor() {
        let entries = [
            kvm_cpuid_entry2 { function: 1, ebx: 0xaabb_ccdd, ..Default::default() },
            kvm_cpuid_entry2 { function: 0xb, index: 1, edx: 7, ..Default::default() },
        ];
        let mut cpuid = CpuId::from_entries(&entries).unwrap();
        patch_cpuid(&mut cpuid, 3, 4, true);
        let e = cpuid.as_slice();
        assert_eq!(e[0].ebx, 0x0304_ccdd);
        assert_ne!(e[0].ecx & ECX_HYPERVISOR, 0);
        assert_ne!(e[0].edx & EDX_HTT, 0);
        assert_ne!(e[0].ecx & ECX_TSC_DEADLINE, 0);
        assert_eq!(e[1].edx, 3);
        // Only offered where KVM emulates it.
        let mut cpuid = CpuId::from_entries(&entries).unwrap();
        patch_cpuid(&mut cpuid, 0, 1, false);
        assert_eq!(cpuid.as_slice()[0].ecx & ECX_TSC_DEADLINE, 0);
    }

    #[test]
    fn lint_delivery_modes_keep_the_other_bits() {
        let mut s = kvm_lapic_state::default();
        set_lapic_reg(&mut s, APIC_LVT0, 0x1_0700);
        let v = with_delivery_mode(lapic_reg(&s, APIC_LVT0), APIC_MODE_NMI);
        assert_eq!(v, 0x1_0400);
    }
}
