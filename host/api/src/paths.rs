//! Where umbrad listens, and where Umbra keeps per-user state: one rule for the daemon and
//! every client.

use std::path::PathBuf;

/// `$XDG_RUNTIME_DIR/umbra`, else `/tmp/umbra-<uid>`: sockets and VM run directories (private,
/// mode 0700).
pub fn runtime_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d).join("umbra"),
        // SAFETY: getuid cannot fail and has no memory effects.
        _ => std::env::temp_dir().join(format!("umbra-{}", unsafe { libc::getuid() })),
    }
}

/// umbrad's socket: `$UMBRA_SOCKET`, else `<runtime_dir>/umbrad.sock`.
pub fn default_socket() -> PathBuf {
    match std::env::var_os("UMBRA_SOCKET") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => runtime_dir().join("umbrad.sock"),
    }
}

fn home() -> PathBuf {
    std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| "/tmp".into())
}

/// An XDG base directory: the variable when it holds an absolute path (the spec says to
/// ignore a relative one), else its fallback under `$HOME`.
fn xdg(var: &str, fallback: &str) -> PathBuf {
    std::env::var_os(var).map(PathBuf::from).filter(|p| p.is_absolute()).unwrap_or_else(|| home().join(fallback))
}

/// `$UMBRA_DATA_DIR`, else `${XDG_DATA_HOME:-~/.local/share}/umbra`: bundles (as the bundle
/// store finds them), and each session's outputs, uploads and disk.
pub fn data_dir() -> PathBuf {
    match std::env::var_os("UMBRA_DATA_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => xdg("XDG_DATA_HOME", ".local/share").join("umbra"),
    }
}

/// `${XDG_STATE_HOME:-~/.local/state}/umbra`: what umbrad knows about its sessions.
pub fn state_dir() -> PathBuf {
    xdg("XDG_STATE_HOME", ".local/state").join("umbra")
}

/// `${XDG_CONFIG_HOME:-~/.config}/umbra`: umbrad's configuration.
pub fn config_dir() -> PathBuf {
    xdg("XDG_CONFIG_HOME", ".config").join("umbra")
}
