//! Virtio device IDs (virtio 1.2 §5).

pub const BLOCK: u32 = 2;
pub const RNG: u32 = 4;
pub const BALLOON: u32 = 5;
pub const VSOCK: u32 = 19;
pub const FS: u32 = 26;
