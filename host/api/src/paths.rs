//! Where umbrad listens, and where Umbra keeps per-user state: one rule for the daemon and
//! every client.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// `$XDG_RUNTIME_DIR/umbra`, else `/tmp/umbra-<uid>`: sockets and VM run directories (private,
/// mode 0700). Where the directory is for; [`private_runtime_dir`] is the one to use, checked.
pub fn runtime_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d).join("umbra"),
        // SAFETY: getuid cannot fail and has no memory effects.
        _ => std::env::temp_dir().join(format!("umbra-{}", unsafe { libc::getuid() })),
    }
}

/// [`runtime_dir`], created 0700 if missing and refused unless it is a private directory of
/// ours ([`ensure_private_dir`]). In the `/tmp/umbra-<uid>` fallback anyone could have made
/// the directory first; using it anyway would hand them our sockets.
pub fn private_runtime_dir() -> Result<PathBuf, PrivateDirError> {
    let dir = runtime_dir();
    ensure_private_dir(&dir)?;
    Ok(dir)
}

/// Why a directory that must be private to this user (the runtime directory, the socket's
/// directory) is not used. Nothing is ever repaired: a directory someone else made or opened
/// is reported, not adopted.
#[derive(Debug, thiserror::Error)]
pub enum PrivateDirError {
    #[error("cannot create {path}: {source}")]
    Create { path: PathBuf, source: std::io::Error },
    #[error("cannot inspect {path}: {source}")]
    Stat { path: PathBuf, source: std::io::Error },
    #[error("{path} is a symlink; refusing to use it as a private directory (remove the link)")]
    Symlink { path: PathBuf },
    #[error("{path} is not a directory; refusing to use it as a private directory")]
    NotADirectory { path: PathBuf },
    #[error(
        "{path} belongs to uid {owner}, not to this user (uid {uid}): refusing to use it, as whoever made it \
         controls what is in it (remove it, or set XDG_RUNTIME_DIR to a directory of yours)"
    )]
    Owner { path: PathBuf, owner: u32, uid: u32 },
    #[error("{path} has mode {mode:04o}, not 0700: refusing to use it (if it is yours: chmod 700 {path})")]
    Mode { path: PathBuf, mode: u32 },
}

/// This process's effective uid: whom files it creates belong to, what peers see.
pub fn euid() -> u32 {
    // SAFETY: geteuid cannot fail and has no memory effects.
    unsafe { libc::geteuid() }
}

/// Creates `dir` (and missing parents) with mode 0700 if it does not exist, then checks it
/// ([`check_private_dir`]). An existing directory is used only if it passes; it is never
/// re-moded or re-owned.
pub fn ensure_private_dir(dir: &Path) -> Result<(), PrivateDirError> {
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        // Ours, just made: the umask may have taken bits from 0700, put them back.
        Ok(()) => std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|source| PrivateDirError::Create { path: dir.to_path_buf(), source })?,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .and_then(|()| std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)))
                .map_err(|source| PrivateDirError::Create { path: dir.to_path_buf(), source })?;
        }
        Err(source) => return Err(PrivateDirError::Create { path: dir.to_path_buf(), source }),
    }
    check_private_dir(dir)
}

/// `dir` is a real directory (not a symlink to one), owned by this process's effective uid,
/// with permission bits exactly 0700.
pub fn check_private_dir(dir: &Path) -> Result<(), PrivateDirError> {
    let path = dir.to_path_buf();
    let meta = std::fs::symlink_metadata(dir).map_err(|source| PrivateDirError::Stat { path: path.clone(), source })?;
    if meta.file_type().is_symlink() {
        return Err(PrivateDirError::Symlink { path });
    }
    if !meta.is_dir() {
        return Err(PrivateDirError::NotADirectory { path });
    }
    let uid = euid();
    if meta.uid() != uid {
        return Err(PrivateDirError::Owner { path, owner: meta.uid(), uid });
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o777 != 0o700 {
        return Err(PrivateDirError::Mode { path, mode });
    }
    Ok(())
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

/// The user's trusted bundle keys: every `*.pub` file here.
pub fn trusted_keys_dir() -> PathBuf {
    config_dir().join("trusted-keys")
}

/// The key `vmctl bundle build` signs with when it is given none (created on first use).
pub fn signing_key_path() -> PathBuf {
    config_dir().join("bundle-signing.key")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn set_mode(p: &Path, mode: u32) {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn a_missing_directory_is_made_private_and_a_good_one_is_used() {
        let tmp = tempfile::tempdir().unwrap();
        let tmp = tmp.path();
        let dir = tmp.join("a/b/umbra");
        ensure_private_dir(&dir).unwrap();
        let meta = std::fs::symlink_metadata(&dir).unwrap();
        assert_eq!((meta.mode() & 0o7777, meta.uid()), (0o700, euid()));
        // Again: the existing directory passes as it is.
        ensure_private_dir(&dir).unwrap();
        check_private_dir(&dir).unwrap();
    }

    #[test]
    fn a_directory_of_another_mode_is_refused_and_left_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let tmp = tmp.path();
        for mode in [0o755, 0o1777, 0o770, 0o701, 0o500] {
            let dir = tmp.join(format!("m{mode:o}"));
            std::fs::create_dir(&dir).unwrap();
            set_mode(&dir, mode);
            let e = ensure_private_dir(&dir).unwrap_err();
            assert!(matches!(e, PrivateDirError::Mode { mode: m, .. } if m == mode), "{mode:o}: {e}");
            assert!(e.to_string().contains("not 0700"), "{e}");
            assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o7777, mode, "never re-moded");
        }
    }

    #[test]
    fn a_symlink_or_a_file_is_refused_even_to_a_good_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let tmp = tmp.path();
        let good = tmp.join("good");
        ensure_private_dir(&good).unwrap();
        let link = tmp.join("link");
        std::os::unix::fs::symlink(&good, &link).unwrap();
        let e = ensure_private_dir(&link).unwrap_err();
        assert!(matches!(e, PrivateDirError::Symlink { .. }), "{e}");
        let file = tmp.join("file");
        std::fs::write(&file, "").unwrap();
        assert!(matches!(ensure_private_dir(&file).unwrap_err(), PrivateDirError::NotADirectory { .. }));
    }

    #[test]
    fn a_directory_of_another_owner_is_refused() {
        if euid() != 0 {
            eprintln!("skipped: chown to another uid needs root");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let tmp = tmp.path();
        let dir = tmp.join("theirs");
        std::fs::create_dir(&dir).unwrap();
        set_mode(&dir, 0o700);
        std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
        let e = ensure_private_dir(&dir).unwrap_err();
        assert!(matches!(e, PrivateDirError::Owner { owner: 65534, .. }), "{e}");
        assert!(e.to_string().contains("belongs to uid 65534"), "{e}");
    }
}
