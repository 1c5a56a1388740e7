//! Emulated devices. `legacy/` holds the PC devices a microVM keeps: the 8250 serial console and
//! the i8042 controller (only its reset line). `virtio/` holds the virtio-mmio transport and the
//! paravirtual devices behind it. [`epoll_helper`] is the event loop their device threads share.

pub mod epoll_helper;
pub mod legacy;
pub mod virtio;
