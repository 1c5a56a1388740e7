//! Feature bits shared by every device (virtio 1.2 §6).

/// The device is modern (virtio 1.x); the only kind Umbra offers.
pub const VIRTIO_F_VERSION_1: u32 = 32;
