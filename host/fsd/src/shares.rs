//! The staging directory and the folders bound into it.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};

use crate::mounts::{self, Identity};

/// The staging directory holds only mount points: a tiny tmpfs, so nothing is written to the
/// host's disk and a guest cannot fill anything there.
pub fn mount_staging(staging: &Path) -> Result<(), String> {
    std::fs::create_dir_all(staging).map_err(|e| format!("create {}: {e}", staging.display()))?;
    mount(
        Some("umbra-shares"),
        staging,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("size=1m,mode=0755"),
    )
    .map_err(|e| format!("mount a tmpfs on {}: {e}", staging.display()))
}

/// A share name becomes one directory entry: a single safe path component.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name != "."
        && name != ".."
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// One folder bound into the staging directory, kept open so nested folders can be pinned by
/// descriptor and compared by identity.
pub struct Share {
    pub name: String,
    /// The host path as the runtime gave it (absolute, no symbolic link).
    pub source: PathBuf,
    pub read_only: bool,
    pub dir: OwnedFd,
    pub identity: Identity,
    /// Mount points this share's folder was pinned at inside other shares (nesting).
    pins: Vec<PathBuf>,
}

/// The folders of this server, for nesting: a folder shared inside another keeps the stricter
/// mode on the host, however the two are nested and in whichever order they were added.
#[derive(Default)]
pub struct Shares {
    list: Vec<Share>,
}

impl Shares {
    /// Binds folder `source` into the staging directory as `name`, after checking it is still
    /// `expected` (when the runtime recorded it before); returns its identity.
    pub fn add(
        &mut self,
        staging: &Path,
        name: &str,
        source: &Path,
        read_only: bool,
        expected: Option<Identity>,
    ) -> Result<Identity, String> {
        if !valid_name(name) {
            return Err(format!("invalid share name {name:?}"));
        }
        if self.list.iter().any(|s| s.name == name) {
            return Err(format!("share {name:?} already exists"));
        }
        let (dir, identity) = mounts::open_folder(source, expected)?;
        let target = staging.join(name);
        std::fs::create_dir(&target).map_err(|e| format!("create {}: {e}", target.display()))?;
        if let Err(e) = mounts::attach(&dir, None, &target, read_only) {
            let _ = std::fs::remove_dir(&target);
            return Err(format!("share {}: {e}", source.display()));
        }
        let mut share = Share { name: name.into(), source: source.into(), read_only, dir, identity, pins: Vec::new() };
        if let Err(e) = self.pin_nested(staging, &mut share) {
            self.unpin(staging, &mut share);
            let _ = umount2(&target, MntFlags::MNT_DETACH);
            let _ = std::fs::remove_dir(&target);
            return Err(e);
        }
        self.list.push(share);
        Ok(identity)
    }

    /// Pins, read-only, every place where a read-only folder is reachable through a writable
    /// one: the new share inside the others, and the others inside the new share.
    fn pin_nested(&mut self, staging: &Path, new: &mut Share) -> Result<(), String> {
        for other in &mut self.list {
            if new.read_only && !other.read_only {
                if let Ok(rel) = new.source.strip_prefix(&other.source) {
                    if !rel.as_os_str().is_empty() {
                        let at = pin_inside(staging, &other.name, rel, new)?;
                        new.pins.push(at);
                    }
                }
            }
            if other.read_only && !new.read_only {
                if let Ok(rel) = other.source.strip_prefix(&new.source) {
                    if !rel.as_os_str().is_empty() {
                        let at = pin_inside(staging, &new.name, rel, other)?;
                        other.pins.push(at);
                    }
                }
            }
        }
        Ok(())
    }

    /// Takes away the pins `share` made inside other shares, and forgets the pins others made
    /// inside it (those are mounts beneath its own, which its detach takes with it).
    fn unpin(&mut self, staging: &Path, share: &mut Share) {
        for at in share.pins.drain(..) {
            let _ = umount2(&at, MntFlags::MNT_DETACH);
        }
        let target = staging.join(&share.name);
        for other in &mut self.list {
            other.pins.retain(|at| !at.starts_with(&target));
        }
    }

    pub fn remove(&mut self, staging: &Path, name: &str) -> Result<(), String> {
        if !valid_name(name) {
            return Err(format!("invalid share name {name:?}"));
        }
        let i = self.list.iter().position(|s| s.name == name).ok_or_else(|| format!("no share {name:?}"))?;
        let mut share = self.list.remove(i);
        self.unpin(staging, &mut share);
        let target = staging.join(name);
        umount2(&target, MntFlags::MNT_DETACH).map_err(|e| format!("unmount {name}: {e}"))?;
        std::fs::remove_dir(&target).map_err(|e| format!("remove {}: {e}", target.display()))
    }
}

/// Pins folder `inner` read-only where it appears inside share `outer_name`, at `rel`. The
/// place is opened beneath the share with no link followed and must be `inner` itself: a guest
/// that replaced it (through the writable share) gets the share refused, not a pin elsewhere.
fn pin_inside(staging: &Path, outer_name: &str, rel: &Path, inner: &Share) -> Result<PathBuf, String> {
    let outer_root = mounts::open_dir_nofollow(None, &staging.join(outer_name))
        .map_err(|e| format!("open share {outer_name}: {e}"))?;
    let at = staging.join(outer_name).join(rel);
    let place = mounts::open_dir_nofollow(Some(&outer_root), rel).map_err(|e| {
        format!(
            "{} is shared read-only inside {outer_name}, but {} cannot be opened there without \
             following a link ({e}): refusing to leave it writable",
            inner.source.display(),
            rel.display()
        )
    })?;
    let found = mounts::identity(&place).map_err(|e| format!("stat {}: {e}", at.display()))?;
    if found != inner.identity {
        return Err(format!(
            "{} inside share {outer_name} is not the folder shared as {}: refusing to leave it writable",
            rel.display(),
            inner.name
        ));
    }
    mounts::attach(&inner.dir, Some(&place), &at, true)?;
    Ok(at)
}

#[cfg(test)]
mod tests {
    use super::valid_name;

    #[test]
    fn share_names_are_single_safe_components() {
        for ok in ["proj", "my-app_2", "a.b"] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in ["", ".", "..", "a/b", "../x", "a b", "x\0", &"y".repeat(65)] {
            assert!(!valid_name(bad), "{bad:?}");
        }
    }
}
