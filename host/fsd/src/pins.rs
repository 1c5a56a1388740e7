//! Pins: entries of a share bound read-only over themselves, in this process's namespace.
//!
//! A pinned entry is a mount point, so through virtiofsd the guest can neither write it
//! (EROFS), nor rename or delete it (EBUSY), nor hard-link it elsewhere (EXDEV) — whatever the
//! guest's root does to its own mounts. Two policy fields use them:
//! - `block_git_writes`: every `.git` (directory, or the file of a worktree or submodule) of a
//!   writable share is pinned, so `git status`/`log` read it and `git commit` fails;
//! - `ignore`: every entry a pattern hides is pinned, so it stays where the [`crate::hide`]
//!   check finds it by name; the check refuses opening it.
//!
//! The walk runs before the guest is told of the share, so the guest cannot race it. It never
//! follows a symbolic link (a link named `.git` is the guest's to resolve, in the guest).

use std::path::{Path, PathBuf};

use nix::mount::{mount, MsFlags};
use umbra_policy::IgnoreSet;

/// The most entries one share's walk visits, and the most pins it makes: past either, the share
/// is refused rather than protected partly.
pub const MAX_WALK: usize = 2_000_000;
pub const MAX_PINS: usize = 4096;

/// What to pin in one share.
pub struct PinRules<'a> {
    pub git: bool,
    pub hide: Option<&'a IgnoreSet>,
}

/// Walks the share mounted at `root` and pins what `rules` name; returns every mount made.
///
/// The directories above a hidden entry are bound over themselves too (writable), so they are
/// mount points as well: renaming `config` cannot move `config/.env` out from under an anchored
/// pattern. Those are bound first, shallowest first, so each later bind lands on top of them.
pub fn pin_tree(root: &Path, rules: &PinRules) -> Result<Vec<PathBuf>, String> {
    if !rules.git && rules.hide.is_none() {
        return Ok(Vec::new());
    }
    let mut leaves = Vec::new();
    let mut ancestors = std::collections::BTreeSet::new();
    let mut stack = vec![root.to_path_buf()];
    let mut visited = 0usize;
    while let Some(dir) = stack.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|e| format!("read {}: {e}", dir.display()))?;
        for entry in entries {
            let entry = entry.map_err(|e| format!("read {}: {e}", dir.display()))?;
            visited += 1;
            if visited > MAX_WALK {
                return Err(format!(
                    "{} has more than {MAX_WALK} entries: too many to find every .git and ignored file",
                    root.display()
                ));
            }
            let kind = entry.file_type().map_err(|e| format!("stat {}: {e}", entry.path().display()))?;
            if kind.is_symlink() {
                continue;
            }
            let path = entry.path();
            let hidden = rules.hide.is_some_and(|set| set.is_ignored(&path, kind.is_dir()));
            if hidden || (rules.git && entry.file_name() == ".git") {
                if hidden {
                    ancestors.extend(path.ancestors().skip(1).take_while(|a| *a != root).map(Path::to_path_buf));
                }
                leaves.push(path);
                if leaves.len() + ancestors.len() > MAX_PINS {
                    return Err(format!(
                        "{} has more than {MAX_PINS} .git and ignored entries to protect",
                        root.display()
                    ));
                }
            } else if kind.is_dir() {
                stack.push(path);
            }
        }
    }
    let mut ancestors: Vec<PathBuf> = ancestors.into_iter().collect();
    ancestors.sort_by_key(|p| p.components().count());
    for dir in &ancestors {
        pin(dir, false)?;
    }
    for leaf in &leaves {
        pin(leaf, true)?;
    }
    ancestors.extend(leaves);
    Ok(ancestors)
}

/// Binds `path` over itself, nosuid, nodev, and read-only if `read_only`.
fn pin(path: &Path, read_only: bool) -> Result<(), String> {
    mount(Some(path), path, None::<&str>, MsFlags::MS_BIND, None::<&str>)
        .map_err(|e| format!("bind {} over itself: {e}", path.display()))?;
    let mut flags = MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    if read_only {
        flags |= MsFlags::MS_RDONLY;
    }
    mount(None::<&str>, path, None::<&str>, flags, None::<&str>).map_err(|e| format!("remount {}: {e}", path.display()))
}
