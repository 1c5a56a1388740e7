//! The i8042 keyboard controller, reduced to what a microVM uses: command 0xFE on port 0x64
//! pulses the CPU reset line. Linux booted with `reboot=k` writes it to reboot, and since a
//! microVM never reboots in place, the VMM treats it as "the guest is done".

/// Data port; reads return 0 (no keyboard).
pub const I8042_DATA_PORT: u16 = 0x60;
/// Ports 0x60..=0x64.
pub const I8042_PORT_RANGE: std::ops::RangeInclusive<u16> = 0x60..=0x64;
const COMMAND_PORT: u16 = 0x64;
const CMD_RESET_CPU: u8 = 0xfe;

#[derive(Debug, Default)]
pub struct I8042 {
    reset_requested: bool,
}

impl I8042 {
    pub fn write(&mut self, port: u16, data: &[u8]) {
        if port == COMMAND_PORT && data.first() == Some(&CMD_RESET_CPU) {
            self.reset_requested = true;
        }
    }

    /// Status and data reads: 0 means "no data, input buffer empty", which lets Linux's
    /// i8042 probe and reset code proceed without a keyboard.
    pub fn read(&self, _port: u16, data: &mut [u8]) {
        data.fill(0);
    }

    pub fn reset_requested(&self) -> bool {
        self.reset_requested
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_0xfe_on_the_command_port_resets() {
        let mut dev = I8042::default();
        dev.write(0x60, &[0xfe]);
        dev.write(0x64, &[0xd1]);
        assert!(!dev.reset_requested());
        dev.write(0x64, &[0xfe]);
        assert!(dev.reset_requested());
        let mut buf = [0xaa; 2];
        dev.read(0x64, &mut buf);
        assert_eq!(buf, [0, 0]);
    }
}
