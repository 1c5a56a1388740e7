//! Reading the system policy (`umbra_api::system`): only a file that the user could not have
//! written counts. A policy the user can edit would be a ceiling the user can raise, so such a
//! file is refused outright — the owner of the machine put something there, and running without
//! it would silently lift every ceiling it sets.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use umbra_api::system::SystemPolicy;

/// Why a system policy file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SystemPolicyError {
    #[error(
        "{path} is {what}: a system policy must be owned by root and writable by nobody else (chown root:root, chmod 644) — refusing it"
    )]
    Writable { path: String, what: String },
    #[error("cannot read the system policy {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path} is not a valid system policy: {message}")]
    Invalid { path: String, message: String },
}

/// The system policy at `path`: `None` when there is no file there; an error when there is one
/// that is not root's alone (the file or its directory owned by another user, or writable by a
/// group or everyone), not valid JSON, or not a valid policy.
pub fn load(path: &Path) -> Result<Option<SystemPolicy>, SystemPolicyError> {
    let shown = path.display().to_string();
    let io = |source| SystemPolicyError::Io { path: shown.clone(), source };
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(e)),
    };
    if !meta.is_file() {
        return Err(SystemPolicyError::Writable { path: shown, what: "not a regular file (a symlink?)".into() });
    }
    check_root_only(&shown, &meta)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        let dir_meta = std::fs::metadata(dir).map_err(io)?;
        check_root_only(&dir.display().to_string(), &dir_meta)?;
    }
    let bytes = std::fs::read(path).map_err(io)?;
    let policy: SystemPolicy = serde_json::from_slice(&bytes)
        .map_err(|e| SystemPolicyError::Invalid { path: shown.clone(), message: e.to_string() })?;
    policy.validate().map_err(|message| SystemPolicyError::Invalid { path: shown, message })?;
    Ok(Some(policy))
}

/// Owned by root, writable by nobody else.
fn check_root_only(path: &str, meta: &std::fs::Metadata) -> Result<(), SystemPolicyError> {
    let mode = meta.mode() & 0o7777;
    let what = if meta.uid() != 0 {
        format!("owned by uid {}", meta.uid())
    } else if mode & 0o022 != 0 {
        format!("writable by its group or by everyone (mode {mode:04o})")
    } else {
        return Ok(());
    };
    Err(SystemPolicyError::Writable { path: path.to_string(), what })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn only_a_file_root_alone_can_write_counts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policy.json");
        assert!(load(&path).unwrap().is_none(), "no file: no policy");
        std::fs::write(&path, br#"{"enabled": false, "max_memory_mib": 512}"#).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let root = nix::unistd::geteuid().is_root();
        match load(&path) {
            Ok(Some(p)) => assert!(root && !p.enabled && p.max_memory_mib == Some(512), "{p:?}"),
            Err(e) => assert!(!root && e.to_string().contains("owned by uid"), "{e}"),
            Ok(None) => panic!("the file is there"),
        }
        if !root {
            return;
        }
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        let e = load(&path).unwrap_err().to_string();
        assert!(e.contains("writable by its group or by everyone (mode 0666)") && e.contains("refusing"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::os::unix::fs::chown(&path, Some(65534), None).unwrap();
        assert!(load(&path).unwrap_err().to_string().contains("owned by uid 65534"));
        std::os::unix::fs::chown(&path, Some(0), None).unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(load(&path).unwrap_err().to_string().contains("mode 0777"), "its directory counts too");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(&path, br#"{"enabeld": false}"#).unwrap();
        assert!(load(&path).unwrap_err().to_string().contains("unknown field"), "a misspelt ceiling is refused");
        std::fs::write(&path, br#"{"trusted_roots": ["relative"]}"#).unwrap();
        assert!(load(&path).unwrap_err().to_string().contains("not an absolute path"));
    }
}
