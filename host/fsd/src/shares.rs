//! The staging directory and the folders bound into it.

use std::path::Path;

use nix::mount::{mount, umount2, MntFlags, MsFlags};

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

pub fn add(staging: &Path, name: &str, source: &Path, read_only: bool) -> Result<(), String> {
    if !valid_name(name) {
        return Err(format!("invalid share name {name:?}"));
    }
    let meta = std::fs::metadata(source).map_err(|e| format!("{}: {e}", source.display()))?;
    if !meta.is_dir() {
        return Err(format!("{} is not a directory", source.display()));
    }
    let target = staging.join(name);
    if target.exists() {
        return Err(format!("share {name:?} already exists"));
    }
    std::fs::create_dir(&target).map_err(|e| format!("create {}: {e}", target.display()))?;
    // Non-recursive: mounts beneath the folder are not exposed through it.
    if let Err(e) = mount(Some(source), &target, None::<&str>, MsFlags::MS_BIND, None::<&str>) {
        let _ = std::fs::remove_dir(&target);
        return Err(format!("bind {} : {e}", source.display()));
    }
    let mut flags = MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    if read_only {
        flags |= MsFlags::MS_RDONLY;
    }
    if let Err(e) = mount(None::<&str>, &target, None::<&str>, flags, None::<&str>) {
        let _ = umount2(&target, MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(&target);
        return Err(format!("make {} {}: {e}", source.display(), if read_only { "read-only" } else { "nosuid" }));
    }
    Ok(())
}

pub fn remove(staging: &Path, name: &str) -> Result<(), String> {
    if !valid_name(name) {
        return Err(format!("invalid share name {name:?}"));
    }
    let target = staging.join(name);
    umount2(&target, MntFlags::MNT_DETACH).map_err(|e| format!("unmount {name}: {e}"))?;
    std::fs::remove_dir(&target).map_err(|e| format!("remove {}: {e}", target.display()))
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
