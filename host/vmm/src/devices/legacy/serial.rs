//! The 8250 serial console (vm-superio's emulation) writing to a log file, with the last lines
//! kept in memory so an error can say what the guest printed last.

use std::collections::VecDeque;
use std::io::{self, Write};
use std::sync::{Arc, Mutex};

use vm_superio::serial::NoEvents;
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

pub const COM1_BASE: u16 = 0x3f8;
pub const COM1_PORT_RANGE: std::ops::Range<u16> = 0x3f8..0x400;

/// How many console lines are kept for error messages.
const KEPT_LINES: usize = 40;
/// A line longer than this is cut: a guest must not make the VMM grow a buffer without bound.
const MAX_LINE: usize = 1024;

/// Console output: appended to an optional file, last lines kept in memory.
#[derive(Clone, Default)]
pub struct ConsoleLog {
    inner: Arc<Mutex<ConsoleState>>,
}

/// The log file stops growing here (a chatty or hostile guest must not fill the disk); the last
/// lines are still kept in memory.
const MAX_FILE_BYTES: u64 = 16 << 20;

#[derive(Default)]
struct ConsoleState {
    file: Option<std::fs::File>,
    file_bytes: u64,
    lines: VecDeque<String>,
    partial: Vec<u8>,
    saw_panic: bool,
}

/// Linux prints this (at KERN_EMERG, so even with `quiet`) before rebooting on a panic; the
/// stack dump after it can push it out of the kept lines, so it is remembered separately.
const PANIC_MARKER: &str = "Kernel panic - not syncing";

impl ConsoleLog {
    pub fn to_file(file: std::fs::File) -> Self {
        let log = Self::default();
        log.inner.lock().expect("console lock").file = Some(file);
        log
    }

    /// Whether the guest kernel has announced a panic.
    pub fn saw_panic(&self) -> bool {
        self.inner.lock().expect("console lock").saw_panic
    }

    /// The last complete lines plus any unterminated one.
    pub fn last_lines(&self) -> Vec<String> {
        let s = self.inner.lock().expect("console lock");
        let mut out: Vec<String> = s.lines.iter().cloned().collect();
        if !s.partial.is_empty() {
            out.push(String::from_utf8_lossy(&s.partial).into_owned());
        }
        out
    }
}

impl Write for ConsoleLog {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut s = self.inner.lock().expect("console lock");
        if s.file.is_some() && s.file_bytes < MAX_FILE_BYTES {
            let take = buf.len().min((MAX_FILE_BYTES - s.file_bytes) as usize);
            s.file_bytes += take as u64;
            let full = s.file_bytes == MAX_FILE_BYTES;
            if let Some(f) = s.file.as_mut() {
                // A console that cannot be written (closed pipe, full disk) must not stop the
                // guest: the bytes are dropped, the last lines still kept.
                let _ = f.write_all(&buf[..take]);
                if full {
                    let _ = f.write_all(b"\n[umbra-vmm: console log truncated at 16 MiB]\n");
                }
            }
        }
        for &b in buf {
            match b {
                b'\n' => {
                    let line = String::from_utf8_lossy(&s.partial).trim_end_matches('\r').to_string();
                    s.partial.clear();
                    s.saw_panic |= line.contains(PANIC_MARKER);
                    if s.lines.len() == KEPT_LINES {
                        s.lines.pop_front();
                    }
                    s.lines.push_back(line);
                }
                _ if s.partial.len() < MAX_LINE => s.partial.push(b),
                _ => {}
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The serial IRQ line: an irqfd on IRQ 4 under Linux (its tty layer waits for the
/// transmit-empty interrupt), nothing for bare guests that only poll.
pub struct IrqLine(Option<EventFd>);

impl Trigger for IrqLine {
    type E = io::Error;
    fn trigger(&self) -> io::Result<()> {
        match &self.0 {
            Some(evt) => evt.write(1),
            None => Ok(()),
        }
    }
}

/// The 16550's state in a snapshot: DLL, DLM, IER, IIR, LCR, LSR, MCR, MSR, SCR, and the bytes
/// waiting in the receive FIFO. Linux's driver caches IER: a restored UART without it would
/// never raise the transmit interrupt the tty layer waits for.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SerialSnapshot {
    pub registers: [u8; 9],
    pub in_buffer: Vec<u8>,
}

/// Why a saved UART cannot be restored.
#[derive(Debug, thiserror::Error)]
pub enum SerialRestoreError {
    #[error("the serial port's saved receive FIFO holds {0} bytes; the UART's holds {UART_FIFO_SIZE}")]
    FifoOverflow(usize),
    #[error("the serial port's saved state: {0}")]
    Uart(vm_superio::serial::Error<io::Error>),
}

/// The 16550A's receive FIFO (vm-superio's `FIFO_SIZE`, which it does not export).
const UART_FIFO_SIZE: usize = 64;

pub struct SerialConsole {
    serial: Serial<IrqLine, NoEvents, ConsoleLog>,
}

impl SerialConsole {
    pub fn new(log: ConsoleLog) -> Self {
        Self { serial: Serial::new(IrqLine(None), log) }
    }

    /// A console whose interrupts are signalled on `irq`.
    pub fn with_interrupt(log: ConsoleLog, irq: EventFd) -> Self {
        Self { serial: Serial::new(IrqLine(Some(irq)), log) }
    }

    /// The UART's registers and receive FIFO, for a snapshot.
    pub fn save(&self) -> SerialSnapshot {
        let s = self.serial.state();
        SerialSnapshot {
            registers: [
                s.baud_divisor_low,
                s.baud_divisor_high,
                s.interrupt_enable,
                s.interrupt_identification,
                s.line_control,
                s.line_status,
                s.modem_control,
                s.modem_status,
                s.scratch,
            ],
            in_buffer: s.in_buffer,
        }
    }

    /// A console as `saved` left the UART, its interrupts signalled on `irq` (one is raised at
    /// once if the saved state had one pending). Refuses a receive FIFO over its 64 bytes.
    pub fn restore(log: ConsoleLog, irq: EventFd, saved: &SerialSnapshot) -> Result<Self, SerialRestoreError> {
        let [baud_divisor_low, baud_divisor_high, interrupt_enable, interrupt_identification, line_control, line_status, modem_control, modem_status, scratch] =
            saved.registers;
        let state = vm_superio::serial::SerialState {
            baud_divisor_low,
            baud_divisor_high,
            interrupt_enable,
            interrupt_identification,
            line_control,
            line_status,
            modem_control,
            modem_status,
            scratch,
            in_buffer: saved.in_buffer.clone(),
        };
        let serial = Serial::from_state(&state, IrqLine(Some(irq)), NoEvents, log).map_err(|e| match e {
            vm_superio::serial::Error::FullFifo => SerialRestoreError::FifoOverflow(saved.in_buffer.len()),
            // Raising the interrupt the saved state had pending failed.
            other => SerialRestoreError::Uart(other),
        })?;
        Ok(Self { serial })
    }

    /// A byte written to `port` (COM1_BASE + offset). Out-of-range offsets are ignored.
    pub fn write(&mut self, port: u16, data: &[u8]) {
        let (Some(offset), Some(&byte)) = (port.checked_sub(COM1_BASE), data.first()) else { return };
        if offset < 8 {
            let _ = self.serial.write(offset as u8, byte);
        }
    }

    pub fn read(&mut self, port: u16, data: &mut [u8]) {
        data.fill(0);
        if let (Some(offset), Some(slot)) = (port.checked_sub(COM1_BASE), data.first_mut()) {
            if offset < 8 {
                *slot = self.serial.read(offset as u8);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_last_lines_and_bounds_them() {
        let mut log = ConsoleLog::default();
        for i in 0..50 {
            writeln!(log, "line {i}\r").unwrap();
        }
        log.write_all(&[b'x'; 5000]).unwrap();
        let lines = log.last_lines();
        assert_eq!(lines.len(), KEPT_LINES + 1);
        assert_eq!(lines[0], "line 10");
        assert_eq!(lines[KEPT_LINES - 1], "line 49");
        assert_eq!(lines[KEPT_LINES].len(), MAX_LINE);
    }

    #[test]
    fn a_panic_is_remembered_after_its_line_scrolls_away() {
        let mut log = ConsoleLog::default();
        writeln!(log, "Kernel panic - not syncing: sysrq triggered crash").unwrap();
        assert!(log.saw_panic());
        for i in 0..100 {
            writeln!(log, "trace {i}").unwrap();
        }
        assert!(log.saw_panic());
        assert!(!ConsoleLog::default().saw_panic());
    }

    #[test]
    fn serial_writes_reach_the_log() {
        let log = ConsoleLog::default();
        let mut serial = SerialConsole::new(log.clone());
        for b in b"hi\n" {
            serial.write(COM1_BASE, &[*b]);
        }
        serial.write(0xffff, b"!");
        serial.write(COM1_BASE, &[]);
        assert_eq!(log.last_lines(), vec!["hi".to_string()]);
    }

    #[test]
    fn a_saved_uart_comes_back_with_its_registers_and_pending_interrupt() {
        let log = ConsoleLog::default();
        let irq = EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap();
        let mut serial = SerialConsole::with_interrupt(log.clone(), irq.try_clone().unwrap());
        serial.write(COM1_BASE + 3, &[0x03]); // LCR: 8N1
        serial.write(COM1_BASE + 7, &[0x5a]); // scratch
        serial.write(COM1_BASE + 1, &[0x02]); // IER: transmit-empty interrupt on
        let _ = irq.read();
        let saved = serial.save();
        let saved: SerialSnapshot = serde_json::from_str(&serde_json::to_string(&saved).unwrap()).unwrap();

        let irq2 = EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap();
        let mut back = SerialConsole::restore(log.clone(), irq2.try_clone().unwrap(), &saved).unwrap();
        let mut reg = [0u8];
        for (offset, want) in [(1, 0x02), (3, 0x03), (7, 0x5a)] {
            back.read(COM1_BASE + offset, &mut reg);
            assert_eq!(reg[0], want, "register {offset}");
        }
        assert_eq!(irq2.read().unwrap(), 1, "the transmit-empty interrupt the driver waits for");
        back.write(COM1_BASE, b"k");
        back.write(COM1_BASE, b"\n");
        assert_eq!(log.last_lines(), vec!["k".to_string()]);
        let mut full = saved;
        full.in_buffer = vec![0; 65];
        let err = SerialConsole::restore(log, irq2, &full).err().expect("a FIFO over 64 bytes").to_string();
        assert_eq!(err, "the serial port's saved receive FIFO holds 65 bytes; the UART's holds 64");
    }
}
