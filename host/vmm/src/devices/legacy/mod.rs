mod i8042;
mod serial;

pub use i8042::{I8042, I8042_DATA_PORT, I8042_PORT_RANGE};
pub use serial::{ConsoleLog, SerialConsole, SerialRestoreError, SerialSnapshot, COM1_BASE, COM1_PORT_RANGE};

/// The port-I/O bus of the legacy devices. Unclaimed ports read as all ones and ignore writes,
/// as on real hardware, so a probing guest carries on.
pub struct LegacyBus {
    pub serial: SerialConsole,
    pub i8042: I8042,
}

impl LegacyBus {
    pub fn new(console: ConsoleLog) -> Self {
        Self { serial: SerialConsole::new(console), i8042: I8042::default() }
    }

    pub fn with_serial(serial: SerialConsole) -> Self {
        Self { serial, i8042: I8042::default() }
    }

    pub fn write(&mut self, port: u16, data: &[u8]) {
        if COM1_PORT_RANGE.contains(&port) {
            self.serial.write(port, data);
        } else if I8042_PORT_RANGE.contains(&port) {
            self.i8042.write(port, data);
        }
    }

    pub fn read(&mut self, port: u16, data: &mut [u8]) {
        if COM1_PORT_RANGE.contains(&port) {
            self.serial.read(port, data);
        } else if I8042_PORT_RANGE.contains(&port) {
            self.i8042.read(port, data);
        } else {
            data.fill(0xff);
        }
    }
}
