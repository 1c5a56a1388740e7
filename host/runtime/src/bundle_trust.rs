//! Whom a bundle download trusts, assembled from where the keys are configured: the system
//! policy's `trusted_keys` when it sets them (and nothing else then: an administrator's list is
//! a ceiling, not a suggestion), else the user's — umbrad's `trusted_keys`, the `*.pub` files in
//! the trusted-keys directory, and keys named on the command line.

use std::path::{Path, PathBuf};

use umbra_api::system::SystemPolicy;
use umbra_bundle::{BundleError, PublicKey, SecretKey, SourceCheck, Trust};

/// Where a download may come from: the system policy's `bundle_sources` (if it sets them), to
/// hold every redirect to as the URL itself is held.
pub fn sources(system: Option<&SystemPolicy>) -> Option<SourceCheck> {
    let policy = system.filter(|s| s.bundle_sources.is_some())?.clone();
    Some(SourceCheck(std::sync::Arc::new(move |url| policy.check_bundle_source(url))))
}

/// The keys a download trusts. `configured` are umbrad's `trusted_keys`; `key_files` are
/// `vmctl --trusted-key` files; `dir` is the trusted-keys directory.
pub fn trust(
    system: Option<&SystemPolicy>,
    configured: &[String],
    key_files: &[PathBuf],
    dir: &Path,
    allow_http_loopback: bool,
) -> Result<Trust, BundleError> {
    let mut trust = Trust { allow_http_loopback, ..Default::default() };
    if let Some(keys) = system.and_then(|s| s.trusted_keys.as_ref()) {
        for key in keys {
            // Validated when the policy was loaded; a key that fails here is skipped, not trusted.
            if let Ok(k) = PublicKey::parse(key) {
                trust = trust.key(k, "the system policy");
            }
        }
        return Ok(trust);
    }
    for (i, key) in configured.iter().enumerate() {
        let k =
            PublicKey::parse(key).map_err(|reason| BundleError::Key { path: format!("trusted_keys[{i}]"), reason })?;
        trust = trust.key(k, "umbrad's trusted_keys");
    }
    for path in key_files {
        trust = trust.key(PublicKey::read(path)?, path.display().to_string());
    }
    trust.keys_in_dir(dir)
}

/// Signs a bundle this machine made with the user's build key (`given`, else
/// `$UMBRA_BUNDLE_SIGNING_KEY`, else `~/.config/umbra/bundle-signing.key`). The default key is
/// made on first use and then trusted by this user (a `.pub` in the trusted-keys directory), so
/// what this machine builds installs here and nowhere else by default. Returns the key's id
/// and, when the key was made now, the trusted public key file.
pub fn sign_local(dir: &Path, given: Option<PathBuf>) -> Result<(String, Option<PathBuf>), BundleError> {
    let (path, default) = match given.or_else(|| std::env::var_os("UMBRA_BUNDLE_SIGNING_KEY").map(PathBuf::from)) {
        Some(p) => (p, false),
        None => (umbra_api::paths::signing_key_path(), true),
    };
    let mut made = None;
    if default && !path.exists() {
        let key = SecretKey::generate()?;
        match key.write_new(&path, "umbra local builds") {
            Ok(public) => {
                let trusted = umbra_api::paths::trusted_keys_dir().join("local-build.pub");
                let io = |what| {
                    let path = trusted.display().to_string();
                    move |source| BundleError::Io { what, path, source }
                };
                std::fs::create_dir_all(trusted.parent().expect("a directory")).map_err(io("cannot create"))?;
                std::fs::copy(&public, &trusted).map_err(io("cannot write"))?;
                made = Some(trusted);
            }
            // Another build made it first: sign with that one.
            Err(BundleError::Io { source, .. }) if source.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    let key = SecretKey::read(&path)?;
    umbra_bundle::sign_dir(dir, &key)?;
    Ok((key.public().id(), made))
}

#[cfg(test)]
mod tests {
    use super::*;
    use umbra_bundle::SecretKey;

    #[test]
    fn the_system_policy_replaces_every_user_key() {
        let dir = tempfile::tempdir().unwrap();
        let (admin, user, file) =
            (SecretKey::from_seed([1; 32]), SecretKey::from_seed([2; 32]), SecretKey::from_seed([3; 32]));
        let in_dir = SecretKey::from_seed([4; 32]);
        in_dir.write_new(&dir.path().join("keys").join("local.key"), "local").unwrap();
        let extra = file.write_new(&dir.path().join("extra.key"), "").unwrap();
        let configured = vec![user.public().to_line("")];
        let keys = dir.path().join("keys");

        let t = trust(None, &configured, std::slice::from_ref(&extra), &keys, false).unwrap();
        assert!(t.trusts(&user.public()) && t.trusts(&file.public()) && t.trusts(&in_dir.public()));
        assert!(!t.trusts(&admin.public()));

        let system = SystemPolicy { trusted_keys: Some(vec![admin.public().to_line("")]), ..Default::default() };
        let t = trust(Some(&system), &configured, &[extra], &keys, true).unwrap();
        assert!(t.trusts(&admin.public()) && t.allow_http_loopback);
        assert!(!t.trusts(&user.public()) && !t.trusts(&file.public()) && !t.trusts(&in_dir.public()));

        let e = trust(None, &["nonsense".into()], &[], &keys, false).unwrap_err().to_string();
        assert!(e.contains("trusted_keys[0]"), "{e}");
        let missing = trust(None, &[], &[], &dir.path().join("none"), false).unwrap();
        assert!(missing.keys.is_empty(), "no directory: no keys, no error");
    }
}
