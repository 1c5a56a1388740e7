//! Emulated devices. `legacy/` holds the PC devices a microVM keeps: the 8250 serial console and
//! the i8042 controller (only its reset line).

pub mod legacy;
