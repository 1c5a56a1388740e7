//! Bare test guests: a few hand-assembled x86-64 instructions wrapped in a minimal ELF, which
//! umbra-vmm boots like a kernel without a PVH note (64-bit entry, paging on, the first 4 GiB
//! identity-mapped). Test lane (b) and `vmctl bench vmm` use them on hosts whose /dev/kvm
//! cannot run Linux; they prove the run loop, the exits, the buses and teardown.

/// Where the code is loaded and entered (the kernel's usual 1 MiB).
pub const LOAD_ADDR: u64 = 0x10_0000;
const COM1: [u8; 2] = [0xf8, 0x03];

/// A guest program under construction.
#[derive(Debug, Default, Clone)]
pub struct BareGuest {
    code: Vec<u8>,
}

impl BareGuest {
    pub fn new() -> Self {
        Self::default()
    }

    /// The raw machine code.
    pub fn code(&self) -> &[u8] {
        &self.code
    }

    /// Appends hand-assembled machine code.
    pub fn raw(mut self, code: &[u8]) -> Self {
        self.code.extend_from_slice(code);
        self
    }

    /// Writes `text` to the serial port, a byte at a time.
    pub fn print(mut self, text: &str) -> Self {
        self.code.extend([0x66, 0xba, COM1[0], COM1[1]]); // mov dx, 0x3f8
        for b in text.bytes() {
            self.code.extend([0xb0, b, 0xee]); // mov al, b ; out dx, al
        }
        self
    }

    /// `mov rbx, addr` — the address register for the MMIO accesses below.
    fn at(&mut self, addr: u64) {
        self.code.extend([0x48, 0xbb]);
        self.code.extend(addr.to_le_bytes());
    }

    /// Reads a 32-bit MMIO register and prints its four bytes raw (e.g. the virtio magic "virt").
    pub fn print_mmio_bytes(mut self, addr: u64) -> Self {
        self.at(addr);
        self.code.extend([0x8b, 0x03]); // mov eax, [rbx]
        self.code.extend([0x66, 0xba, COM1[0], COM1[1]]); // mov dx, 0x3f8
        for i in 0..4 {
            if i > 0 {
                self.code.extend([0xc1, 0xe8, 0x08]); // shr eax, 8
            }
            self.code.push(0xee); // out dx, al
        }
        self
    }

    /// Reads a 32-bit MMIO register and prints its low byte as a digit ('0' + value).
    pub fn print_mmio_digit(mut self, addr: u64) -> Self {
        self.at(addr);
        self.code.extend([0x8b, 0x03, 0x04, b'0']); // mov eax, [rbx] ; add al, '0'
        self.code.extend([0x66, 0xba, COM1[0], COM1[1], 0xee]); // mov dx, 0x3f8 ; out dx, al
        self
    }

    /// Writes a 32-bit value to an MMIO register.
    pub fn write_mmio(mut self, addr: u64, value: u32) -> Self {
        self.at(addr);
        self.code.extend([0xc7, 0x03]); // mov dword [rbx], imm32
        self.code.extend(value.to_le_bytes());
        self
    }

    /// Pulses the reset line through the i8042: a clean exit.
    pub fn reset(mut self) -> Self {
        self.code.extend([0xb0, 0xfe, 0xe6, 0x64]); // mov al, 0xfe ; out 0x64, al
        self
    }

    /// `cli; hlt`.
    pub fn halt(mut self) -> Self {
        self.code.extend([0xfa, 0xf4]);
        self
    }

    /// `ud2` with no IDT: the exception cannot be delivered, so the vCPU triple-faults.
    pub fn crash(mut self) -> Self {
        self.code.extend([0x0f, 0x0b]);
        self
    }

    /// Spins forever (`jmp $`).
    pub fn spin(mut self) -> Self {
        self.code.extend([0xeb, 0xfe]);
        self
    }

    /// An ELF64 executable with one loadable segment at [`LOAD_ADDR`], entered there.
    pub fn to_elf(&self) -> Vec<u8> {
        const EHDR: usize = 64;
        const PHDR: usize = 56;
        const CODE_OFFSET: u64 = 0x1000;
        let mut elf = Vec::with_capacity(CODE_OFFSET as usize + self.code.len());
        elf.extend([0x7f, b'E', b'L', b'F', 2, 1, 1, 0]); // 64-bit, little-endian, version 1
        elf.extend([0u8; 8]);
        elf.extend(2u16.to_le_bytes()); // ET_EXEC
        elf.extend(62u16.to_le_bytes()); // EM_X86_64
        elf.extend(1u32.to_le_bytes());
        elf.extend(LOAD_ADDR.to_le_bytes()); // e_entry
        elf.extend((EHDR as u64).to_le_bytes()); // e_phoff
        elf.extend(0u64.to_le_bytes()); // e_shoff
        elf.extend(0u32.to_le_bytes()); // e_flags
        elf.extend([EHDR as u16, PHDR as u16, 1, 0, 0, 0].iter().flat_map(|v| v.to_le_bytes()));
        let len = self.code.len() as u64;
        elf.extend(1u32.to_le_bytes()); // PT_LOAD
        elf.extend(5u32.to_le_bytes()); // R+X
        for v in [CODE_OFFSET, LOAD_ADDR, LOAD_ADDR, len, len, 0x1000] {
            elf.extend(v.to_le_bytes()); // offset, vaddr, paddr, filesz, memsz, align
        }
        elf.resize(CODE_OFFSET as usize, 0);
        elf.extend(&self.code);
        elf
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::boot::{load, BootEntry, BootSpec};
    use crate::vstate::memory::memfd_backed;
    use vm_memory::{Bytes, GuestAddress};

    #[test]
    fn the_elf_loads_through_the_kernel_loader_with_a_64_bit_entry() {
        let guest = BareGuest::new().print("hi").reset();
        let path = std::env::temp_dir().join(format!("umbra-bare-{}.elf", std::process::id()));
        std::fs::write(&path, guest.to_elf()).unwrap();
        let (mem, _f) = memfd_backed(32 << 20).unwrap();
        let spec = BootSpec { kernel: &path, initrd: None, cmdline: "", cpus: 1, devices: &[] };
        let entry = load(&mem, &spec);
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(entry.unwrap(), BootEntry::Linux64 { entry: GuestAddress(LOAD_ADDR), .. }));
        let mut code = vec![0u8; guest.code().len()];
        mem.read_slice(&mut code, GuestAddress(LOAD_ADDR)).unwrap();
        assert_eq!(code, guest.code());
    }
}
