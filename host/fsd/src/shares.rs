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

/// Where a share is assembled before the guest can see it: a second private tmpfs beside the
/// staging directory.
pub fn prep_dir(staging: &Path) -> PathBuf {
    let mut name = staging.file_name().unwrap_or_default().to_os_string();
    name.push(".prep");
    staging.with_file_name(name)
}

/// A new, empty staging directory (and its preparation directory) in `/tmp`, `0755`: one a
/// virtiofsd running as another user can resolve.
pub fn fresh_staging() -> Result<PathBuf, String> {
    sweep_stale_staging();
    let template = format!("/tmp/{STAGING_PREFIX}{}-XXXXXX", std::process::id());
    let mut template = std::ffi::CString::new(template).expect("no NUL").into_bytes_with_nul();
    // SAFETY: mkdtemp rewrites the X's of the NUL-terminated template in place.
    let made = unsafe { libc::mkdtemp(template.as_mut_ptr().cast()) };
    if made.is_null() {
        return Err(format!("create a staging directory in /tmp: {}", std::io::Error::last_os_error()));
    }
    let staging = PathBuf::from(std::str::from_utf8(&template[..template.len() - 1]).expect("ASCII"));
    use std::os::unix::fs::PermissionsExt;
    let prep = prep_dir(&staging);
    std::fs::set_permissions(&staging, std::fs::Permissions::from_mode(0o755))
        .and_then(|()| std::fs::create_dir(&prep))
        .map_err(|e| format!("prepare {}: {e}", staging.display()))?;
    Ok(staging)
}

const STAGING_PREFIX: &str = "umbra-fsd-";

/// Removes the staging directories of umbra-fsd processes that died without cleaning up
/// (`SIGKILL`): named with their pid, and empty on the host (their mounts lived only in the
/// dead process's namespace), so `rmdir` removes them and nothing else.
fn sweep_stale_staging() {
    let Ok(entries) = std::fs::read_dir("/tmp") else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(STAGING_PREFIX)) else { continue };
        let Some(Ok(pid)) = rest.split_once('-').map(|(pid, _)| pid.parse::<u32>()) else { continue };
        if pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let staging = entry.path();
        let _ = std::fs::remove_dir(prep_dir(&staging));
        let _ = std::fs::remove_dir(&staging);
    }
}

/// Removes what [`fresh_staging`] made, once its mounts are gone.
pub fn remove_staging(staging: &Path) {
    for dir in [prep_dir(staging), staging.to_path_buf()] {
        let _ = umount2(&dir, MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(&dir);
    }
}

/// Mounts the staging directory and the preparation directory beside it.
pub fn mount_both(staging: &Path) -> Result<(), String> {
    mount_staging(staging)?;
    mount_staging(&prep_dir(staging))
}

/// A mount made inside a share for a nested folder, held by its descriptor: it is unmounted
/// through that descriptor, never by a path the guest could have moved.
struct Pin {
    /// The share it lies in.
    in_share: String,
    mount: OwnedFd,
}

impl Pin {
    fn detach(self) {
        let path = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&self.mount));
        let _ = umount2(path.as_str(), MntFlags::MNT_DETACH);
    }
}

/// One folder served, kept open so nested folders can be pinned by descriptor and compared by
/// identity.
pub struct Share {
    pub name: String,
    /// The host path as the runtime gave it (absolute, no symbolic link).
    pub source: PathBuf,
    pub read_only: bool,
    pub dir: OwnedFd,
    pub identity: Identity,
    /// Where this (read-only) folder is pinned inside writable shares that contain it.
    pins: Vec<Pin>,
}

/// The folders of this server, for nesting: a read-only folder inside a writable one keeps
/// its mode on the host.
#[derive(Default)]
pub struct Shares {
    list: Vec<Share>,
    /// The share being assembled in the preparation directory.
    pending: Option<Share>,
}

impl Shares {
    /// Mounts folder `source` at `<prep>/name`, after checking it is still `expected` (when
    /// the runtime recorded it before), with every read-only share that lies inside it pinned
    /// there; returns its identity and the pins made. Nothing of it is visible to the guest
    /// until [`Self::publish`]; [`Self::abandon`] undoes it.
    ///
    /// A read-only folder inside a writable share the guest already has is refused: the guest
    /// may hold its directories open through that share, and a mount placed over them now
    /// would not take that away. A session shares its read-only folders first.
    pub fn prepare(
        &mut self,
        prep: &Path,
        name: &str,
        source: &Path,
        read_only: bool,
        expected: Option<Identity>,
    ) -> Result<(Identity, Vec<PathBuf>), String> {
        if !valid_name(name) {
            return Err(format!("invalid share name {name:?}"));
        }
        if self.list.iter().any(|s| s.name == name) || self.pending.is_some() {
            return Err(format!("share {name:?} already exists"));
        }
        if read_only {
            if let Some(outer) = self.list.iter().find(|o| !o.read_only && source.starts_with(&o.source)) {
                return Err(format!(
                    "{} lies inside the writable folder {} ({}), which the guest already has: share a \
                     read-only folder before the writable folders that contain it (a session's start \
                     does), or restart the session with both",
                    source.display(),
                    outer.name,
                    outer.source.display()
                ));
            }
        }
        let (dir, identity) = mounts::open_folder(source, expected)?;
        let target = prep.join(name);
        std::fs::create_dir(&target).map_err(|e| format!("create {}: {e}", target.display()))?;
        if let Err(e) = mounts::attach(&dir, None, &target, read_only) {
            let _ = std::fs::remove_dir(&target);
            return Err(format!("share {}: {e}", source.display()));
        }
        self.pending =
            Some(Share { name: name.into(), source: source.into(), read_only, dir, identity, pins: Vec::new() });
        let mut made = Vec::new();
        if !read_only {
            for inner in self.list.iter_mut().filter(|s| s.read_only) {
                let Ok(rel) = inner.source.strip_prefix(source) else { continue };
                if rel.as_os_str().is_empty() {
                    continue;
                }
                match pin_inside(&target, name, rel, inner) {
                    Ok(pin) => {
                        made.push(target.join(rel));
                        inner.pins.push(pin);
                    }
                    Err(e) => {
                        self.abandon(prep, name);
                        return Err(e);
                    }
                }
            }
        }
        Ok((identity, made))
    }

    /// Moves the prepared share (with every mount beneath it) into the staging directory,
    /// where the guest finds it.
    pub fn publish(&mut self, staging: &Path, prep: &Path, name: &str) -> Result<(), String> {
        let share =
            self.pending.take().filter(|s| s.name == name).ok_or_else(|| format!("no share {name:?} prepared"))?;
        let target = staging.join(name);
        let moved =
            std::fs::create_dir(&target).map_err(|e| format!("create {}: {e}", target.display())).and_then(|()| {
                mount(Some(&prep.join(name)), &target, None::<&str>, MsFlags::MS_MOVE, None::<&str>)
                    .map_err(|e| format!("move share {name} into place: {e}"))
            });
        if let Err(e) = moved {
            let _ = std::fs::remove_dir(&target);
            self.pending = Some(share);
            self.abandon(prep, name);
            return Err(e);
        }
        let _ = std::fs::remove_dir(prep.join(name));
        self.list.push(share);
        Ok(())
    }

    /// Undoes [`Self::prepare`]: nothing of it was ever visible to the guest.
    pub fn abandon(&mut self, prep: &Path, name: &str) {
        if self.pending.as_ref().is_some_and(|s| s.name == name) {
            self.pending = None;
        }
        for other in &mut self.list {
            other.pins.retain(|p| p.in_share != name);
        }
        let target = prep.join(name);
        let _ = umount2(&target, MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(&target);
    }

    pub fn remove(&mut self, staging: &Path, name: &str) -> Result<(), String> {
        if !valid_name(name) {
            return Err(format!("invalid share name {name:?}"));
        }
        let i = self.list.iter().position(|s| s.name == name).ok_or_else(|| format!("no share {name:?}"))?;
        let share = self.list.remove(i);
        for pin in share.pins {
            pin.detach();
        }
        // Pins of other folders inside this one are mounts beneath it: the detach takes them.
        for other in &mut self.list {
            other.pins.retain(|p| p.in_share != name);
        }
        let target = staging.join(name);
        umount2(&target, MntFlags::MNT_DETACH).map_err(|e| format!("unmount {name}: {e}"))?;
        std::fs::remove_dir(&target).map_err(|e| format!("remove {}: {e}", target.display()))
    }
}

/// Pins read-only folder `inner` where it appears inside the share being prepared at `root`
/// (named `outer_name`), at `rel`. The place is opened beneath the share with no link followed
/// and must be `inner` itself: anything else there is refused, never pinned elsewhere.
fn pin_inside(root: &Path, outer_name: &str, rel: &Path, inner: &Share) -> Result<Pin, String> {
    let outer_root = mounts::open_dir_nofollow(None, root).map_err(|e| format!("open share {outer_name}: {e}"))?;
    let place = mounts::open_dir_nofollow(Some(&outer_root), rel).map_err(|e| {
        format!(
            "{} is shared read-only inside {outer_name}, but {} cannot be opened there without \
             following a link ({e}): refusing to leave it writable",
            inner.source.display(),
            rel.display()
        )
    })?;
    let found = mounts::identity(&place).map_err(|e| format!("stat {}: {e}", rel.display()))?;
    if found != inner.identity {
        return Err(format!(
            "{} inside share {outer_name} is not the folder shared as {}: refusing to leave it writable",
            rel.display(),
            inner.name
        ));
    }
    let mount = mounts::attach(&inner.dir, Some(&place), &root.join(rel), true)?;
    Ok(Pin { in_share: outer_name.into(), mount })
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

#[cfg(test)]
mod sweep_tests {
    #[test]
    fn staging_of_dead_processes_is_swept_and_live_ones_kept() {
        // A pid that is certainly gone: a child that exited and was reaped.
        let dead = std::process::Command::new("true").spawn().unwrap();
        let pid = dead.id();
        let mut dead = dead;
        dead.wait().unwrap();
        let gone = std::path::PathBuf::from(format!("/tmp/umbra-fsd-{pid}-sweeptest"));
        let gone_prep = super::prep_dir(&gone);
        let live = std::path::PathBuf::from(format!("/tmp/umbra-fsd-1-sweeptest{pid}"));
        for d in [&gone, &gone_prep, &live] {
            std::fs::create_dir_all(d).unwrap();
        }
        super::sweep_stale_staging();
        let (gone_left, prep_left, live_kept) = (gone.exists(), gone_prep.exists(), live.exists());
        let _ = std::fs::remove_dir(&live);
        assert!(!gone_left && !prep_left, "a dead process's staging stayed");
        assert!(live_kept, "a live process's staging was removed");
    }
}
