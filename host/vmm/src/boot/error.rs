//! Why a kernel could not be loaded into guest memory.

use linux_loader::loader;

#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("cannot open {what} {path}: {source}")]
    Open { what: &'static str, path: String, source: std::io::Error },
    #[error("{path} is neither an ELF vmlinux nor a bzImage: {elf} / {bzimage}")]
    Kernel { path: String, elf: loader::Error, bzimage: loader::Error },
    #[error("{path} is a bzImage without a 64-bit entry point (a 32-bit-only kernel)")]
    Not64Bit { path: String },
    #[error("the initrd ({size} bytes) does not fit in guest memory above the kernel")]
    InitrdTooBig { size: u64 },
    #[error("cannot load the initrd: {0}")]
    Initrd(String),
    #[error("kernel command line: {0}")]
    Cmdline(String),
    #[error("{cpus} vCPUs requested; the MP table supports 1 to {max}")]
    TooManyCpus { cpus: u8, max: u8 },
    #[error("{what} does not fit in guest memory at {addr:#x}")]
    OutOfMemory { what: &'static str, addr: u64 },
    #[error("writing boot parameters: {0}")]
    Configure(String),
}
