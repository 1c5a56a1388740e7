//! The Intel MultiProcessor table (MP spec 1.4): how a kernel without ACPI finds the other
//! vCPUs, the IOAPIC and how ISA IRQs are wired to it. Same shape as Firecracker's: one CPU
//! entry per vCPU, one ISA bus, one IOAPIC with every pin routed 1:1, LINT0 = ExtINT, LINT1 = NMI.

use vm_memory::{Bytes, GuestAddress};

use super::error::BootError;
use super::layout::{APIC_ADDR, IOAPIC_ADDR, IRQ_MAX, MPTABLE_START};
use crate::vstate::memory::GuestMemory;

/// The MP table lives in the last KiB of base memory, where Linux scans for it; this many CPU
/// entries fit there with the rest of the table.
pub const MAX_CPUS: u8 = 32;

const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const CPU_ENABLED: u8 = 1;
const CPU_BSP: u8 = 2;
const CPU_STEPPING: u32 = 0x600;
const CPU_FEATURE_FPU_APIC: u32 = 0x201;
const MP_INT: u8 = 0;
const MP_NMI: u8 = 1;
const MP_EXTINT: u8 = 3;

/// The table bytes for `cpus` vCPUs, with checksums, for placement at [`MPTABLE_START`].
pub fn build(cpus: u8) -> Result<Vec<u8>, BootError> {
    if cpus == 0 || cpus > MAX_CPUS {
        return Err(BootError::TooManyCpus { cpus, max: MAX_CPUS });
    }
    let ioapic_id = cpus + 1;
    let mut entries = Vec::new();
    let mut count: u16 = 0;
    for id in 0..cpus {
        let flags = CPU_ENABLED | if id == 0 { CPU_BSP } else { 0 };
        entries.extend([0, id, APIC_VERSION, flags]);
        entries.extend(CPU_STEPPING.to_le_bytes());
        entries.extend(CPU_FEATURE_FPU_APIC.to_le_bytes());
        entries.extend([0u8; 8]);
        count += 1;
    }
    entries.extend([1, 0]); // bus 0 ...
    entries.extend(b"ISA   "); // ... is ISA
    entries.extend([2, ioapic_id, IOAPIC_VERSION, 1]);
    entries.extend(IOAPIC_ADDR.to_le_bytes());
    count += 2;
    for irq in 0..=IRQ_MAX as u8 {
        entries.extend([3, MP_INT, 0, 0, 0, irq, ioapic_id, irq]);
        count += 1;
    }
    entries.extend([4, MP_EXTINT, 0, 0, 0, 0, 0, 0]); // ExtINT → LINT0 of the BSP
    entries.extend([4, MP_NMI, 0, 0, 0, 0, 0xff, 1]); // NMI → LINT1 of every CPU
    count += 2;

    let table_len = 44 + entries.len();
    let mut table = Vec::with_capacity(table_len);
    table.extend(b"PCMP");
    table.extend((table_len as u16).to_le_bytes());
    table.extend([4, 0]); // spec 1.4, checksum below
    table.extend(b"UMBRA   ");
    table.extend(b"MICROVM     ");
    table.extend([0u8; 4 + 2]); // no OEM table
    table.extend(count.to_le_bytes());
    table.extend(APIC_ADDR.to_le_bytes());
    table.extend([0u8; 4]);
    table.extend(entries);
    table[7] = checksum(&table);

    let mut floating = Vec::with_capacity(16 + table_len);
    floating.extend(b"_MP_");
    floating.extend(((MPTABLE_START + 16) as u32).to_le_bytes());
    floating.extend([1, 4, 0, 0, 0, 0, 0, 0]); // 16 bytes long, spec 1.4, no default config
    floating[10] = checksum(&floating);
    floating.extend(table);
    Ok(floating)
}

/// The byte that makes the sum of `bytes` zero mod 256.
fn checksum(bytes: &[u8]) -> u8 {
    bytes.iter().fold(0u8, |sum, b| sum.wrapping_add(*b)).wrapping_neg()
}

pub fn write(mem: &GuestMemory, cpus: u8) -> Result<(), BootError> {
    let bytes = build(cpus)?;
    mem.write_slice(&bytes, GuestAddress(MPTABLE_START))
        .map_err(|_| BootError::OutOfMemory { what: "MP table", addr: MPTABLE_START })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(bytes: &[u8]) -> u8 {
        bytes.iter().fold(0u8, |s, b| s.wrapping_add(*b))
    }

    #[test]
    fn checksums_and_lengths_are_what_linux_verifies() {
        for cpus in [1, 2, MAX_CPUS] {
            let t = build(cpus).unwrap();
            assert_eq!(&t[..4], b"_MP_");
            assert_eq!(sum(&t[..16]), 0, "floating pointer checksum");
            let table = &t[16..];
            assert_eq!(&table[..4], b"PCMP");
            let len = u16::from_le_bytes([table[4], table[5]]) as usize;
            assert_eq!(len, table.len());
            assert_eq!(sum(table), 0, "table checksum");
            let entries = u16::from_le_bytes([table[34], table[35]]) as usize;
            assert_eq!(entries, cpus as usize + 2 + 24 + 2);
            assert!(MPTABLE_START as usize + t.len() <= 0xa0000, "fits the last KiB of base memory");
        }
    }

    #[test]
    fn cpu_counts_outside_the_table_are_refused() {
        assert!(build(0).is_err());
        assert!(build(MAX_CPUS + 1).is_err());
    }
}
