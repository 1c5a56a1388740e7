//! The host terminal for `vmctl run --tty`: raw mode while the guest owns the screen, and the
//! window size to forward.

use std::os::fd::AsFd;

use nix::sys::termios::{cfmakeraw, tcgetattr, tcsetattr, SetArg, Termios};
use umbra_proto::TtySize;

/// Puts stdin's terminal in raw mode; restores it on drop (also on error paths).
pub struct RawTerminal {
    saved: Termios,
}

impl RawTerminal {
    pub fn enable() -> nix::Result<Self> {
        let stdin = std::io::stdin();
        let saved = tcgetattr(stdin.as_fd())?;
        let mut raw = saved.clone();
        cfmakeraw(&mut raw);
        tcsetattr(stdin.as_fd(), SetArg::TCSANOW, &raw)?;
        Ok(Self { saved })
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        let _ = tcsetattr(std::io::stdin().as_fd(), SetArg::TCSANOW, &self.saved);
    }
}

/// The window size of the terminal on stdout, if it is one.
pub fn size() -> Option<TtySize> {
    // SAFETY: winsize is plain old data; all-zero is valid.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: TIOCGWINSZ writes one `struct winsize` through the pointer, valid for the call.
    let rc = unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut ws) };
    (rc == 0 && ws.ws_row > 0).then_some(TtySize { rows: ws.ws_row, cols: ws.ws_col })
}
