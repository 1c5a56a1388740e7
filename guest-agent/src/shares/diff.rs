//! What a shadow share changed: a walk of the overlay's upper layer, compared entry by entry
//! with the lower layer (the host folder).
//!
//! How overlayfs records changes in the upper layer, and what each becomes:
//! - a regular file, symlink or other non-directory → `added` if the lower has nothing there,
//!   `modified` if it has a non-directory, `deleted` (the directory) + `added` if it has a
//!   directory;
//! - a whiteout (a character device 0:0) → `deleted`, one entry even for a whole directory;
//! - a directory that exists below too → not listed itself, its contents compared; if it is
//!   *opaque* (xattr `trusted.overlay.opaque` = `y`: it replaced the lower one), every lower
//!   entry is `deleted` and every upper entry `added`;
//! - a directory the lower lacks → `added`, with all its contents.
//!
//! The upper layer is the guest's, so it is hostile input: the walk never follows a symlink
//! (every open is `O_NOFOLLOW` relative to an open parent), keeps one frame per depth with at
//! most [`MAX_DEPTH`] levels, reads at most [`MAX_CHANGES`] + 1 names per directory, and stops
//! at [`MAX_CHANGES`] changes or once their encoding would outgrow a response frame.

use std::ffi::{CStr, OsStr};
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::dir::Dir;
use nix::fcntl::{open, openat, OFlag};
use nix::sys::stat::{fstatat, FileStat, Mode, SFlag};
use nix::unistd::dup;
use umbra_proto::{ChangeKind, ShadowChange, MAX_BODY_LEN};

/// Most changes in one answer.
pub const MAX_CHANGES: usize = 100_000;
/// Deepest directory level walked; deeper changes make the answer `truncated`.
pub const MAX_DEPTH: usize = 256;
/// Encoded bytes the changes may take, leaving room for the response's envelope.
const BUDGET: usize = MAX_BODY_LEN - 64 * 1024;

const DIR_FLAGS: OFlag = OFlag::O_RDONLY.union(OFlag::O_DIRECTORY).union(OFlag::O_NOFOLLOW).union(OFlag::O_CLOEXEC);

/// The changes of the overlay whose layers are `lower` and `upper`, and whether the list is
/// truncated.
pub fn shadow_changes(lower: &Path, upper: &Path) -> io::Result<(Vec<ShadowChange>, bool)> {
    changes_within(lower, upper, MAX_CHANGES, BUDGET)
}

fn changes_within(lower: &Path, upper: &Path, cap: usize, budget: usize) -> io::Result<(Vec<ShadowChange>, bool)> {
    let upper = open(upper, DIR_FLAGS, Mode::empty())?;
    // A lower that vanished (the host removed the folder) leaves everything added.
    let lower = open(lower, DIR_FLAGS, Mode::empty()).ok();
    let mut out = Changes { list: Vec::new(), truncated: false, cap, budget, encoded: 0 };
    walk(&mut out, Frame::new(upper, lower, String::new(), false)?)?;
    Ok((out.list, out.truncated))
}

struct Changes {
    list: Vec<ShadowChange>,
    truncated: bool,
    cap: usize,
    budget: usize,
    encoded: usize,
}

impl Changes {
    /// Records a change; false once the list is full (and marked truncated).
    fn push(&mut self, path: &str, kind: ChangeKind, st: Option<&FileStat>) -> bool {
        if self.truncated {
            return false;
        }
        let dir = st.is_some_and(is_dir);
        let size = match (kind, st) {
            (ChangeKind::Deleted, _) | (_, None) => None,
            _ if dir => None,
            (_, Some(st)) => Some(st.st_size as u64),
        };
        let change = ShadowChange { path: path.to_string(), kind, size, is_dir: dir };
        // Its JSON plus the separating comma.
        let len = serde_json::to_vec(&change).expect("protocol types serialize").len() + 1;
        if self.list.len() == self.cap || self.encoded + len > self.budget {
            self.truncated = true;
            return false;
        }
        self.encoded += len;
        self.list.push(change);
        true
    }
}

/// One directory being walked: its upper fd, the lower directory at the same path (when the
/// lower has a directory there and this is not an all-added subtree), and the names left.
struct Frame {
    upper: OwnedFd,
    lower: Option<OwnedFd>,
    rel: String,
    /// Everything beneath is new: list it all as added.
    all_added: bool,
    /// Sorted, reversed: `pop` yields them in order.
    names: Vec<Vec<u8>>,
}

impl Frame {
    fn new(upper: OwnedFd, lower: Option<OwnedFd>, rel: String, all_added: bool) -> io::Result<Self> {
        let mut names = list_names(&upper)?;
        names.reverse();
        Ok(Self { upper, lower, rel, all_added, names })
    }
}

fn walk(out: &mut Changes, root: Frame) -> io::Result<()> {
    let mut stack = vec![root];
    while let Some(frame) = stack.last_mut() {
        let Some(name) = frame.names.pop() else {
            stack.pop();
            continue;
        };
        let name = OsStr::from_bytes(&name);
        let path = join(&frame.rel, name);
        // Gone since the listing (the guest is busy in there): nothing to report.
        let Ok(upper_st) = fstatat(&frame.upper, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) else { continue };
        let lower_st = match (&frame.lower, frame.all_added) {
            (Some(lower), false) => fstatat(lower, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW).ok(),
            _ => None,
        };
        let mut descend = None;
        let full = if is_whiteout(&upper_st) {
            // In a new or opaque directory a whiteout hides nothing.
            match &lower_st {
                Some(l) => !out.push(&path, ChangeKind::Deleted, Some(l)),
                None => false,
            }
        } else if is_dir(&upper_st) {
            let Ok(upper_dir) = openat(&frame.upper, name, DIR_FLAGS, Mode::empty()) else { continue };
            match &lower_st {
                Some(l) if is_dir(l) => {
                    let lower_dir =
                        openat(frame.lower.as_ref().expect("lower_st came from it"), name, DIR_FLAGS, Mode::empty())
                            .ok();
                    if is_opaque(&upper_dir) {
                        let mut full = false;
                        if let Some(lower_dir) = &lower_dir {
                            for n in list_names(lower_dir)? {
                                let n = OsStr::from_bytes(&n);
                                let Ok(st) = fstatat(lower_dir, n, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) else {
                                    continue;
                                };
                                if !out.push(&join(&path, n), ChangeKind::Deleted, Some(&st)) {
                                    full = true;
                                    break;
                                }
                            }
                        }
                        descend = Some((upper_dir, None, true));
                        full
                    } else {
                        descend = Some((upper_dir, lower_dir, false));
                        false
                    }
                }
                Some(l) => {
                    let full = !out.push(&path, ChangeKind::Deleted, Some(l))
                        || !out.push(&path, ChangeKind::Added, Some(&upper_st));
                    descend = Some((upper_dir, None, true));
                    full
                }
                None => {
                    descend = Some((upper_dir, None, true));
                    !out.push(&path, ChangeKind::Added, Some(&upper_st))
                }
            }
        } else {
            match &lower_st {
                None => !out.push(&path, ChangeKind::Added, Some(&upper_st)),
                Some(l) if is_dir(l) => {
                    !out.push(&path, ChangeKind::Deleted, Some(l))
                        || !out.push(&path, ChangeKind::Added, Some(&upper_st))
                }
                Some(_) => !out.push(&path, ChangeKind::Modified, Some(&upper_st)),
            }
        };
        if full {
            return Ok(());
        }
        if let Some((upper, lower, all_added)) = descend {
            if stack.len() >= MAX_DEPTH {
                out.truncated = true;
                continue;
            }
            stack.push(Frame::new(upper, lower, path, all_added)?);
        }
    }
    Ok(())
}

fn join(rel: &str, name: &OsStr) -> String {
    let name = name.to_string_lossy();
    if rel.is_empty() {
        name.into_owned()
    } else {
        format!("{rel}/{name}")
    }
}

fn is_dir(st: &FileStat) -> bool {
    SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) == SFlag::S_IFDIR
}

/// overlayfs marks a deleted lower entry with a character device 0:0 in the upper layer.
fn is_whiteout(st: &FileStat) -> bool {
    SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) == SFlag::S_IFCHR && st.st_rdev == 0
}

/// An upper directory that replaced the lower one (`rm -rf d; mkdir d`) carries this xattr.
fn is_opaque(dir: &OwnedFd) -> bool {
    const NAME: &CStr = c"trusted.overlay.opaque";
    let mut value = [0u8; 2];
    // SAFETY: fgetxattr writes at most `value.len()` bytes into `value`, valid for the call.
    let n = unsafe { libc::fgetxattr(dir.as_raw_fd(), NAME.as_ptr(), value.as_mut_ptr().cast(), value.len()) };
    n == 1 && value[0] == b'y'
}

/// The names in a directory, sorted, without `.` and `..`; at most [`MAX_CHANGES`] + 1 (more
/// could not be reported anyway, and the walk notices the cap).
fn list_names(dir: &impl AsFd) -> io::Result<Vec<Vec<u8>>> {
    // Iterating consumes the descriptor's offset; a duplicate keeps the caller's fd reusable.
    let mut d = Dir::from_fd(dup(dir)?)?;
    let mut names = Vec::new();
    for entry in d.iter() {
        let name = entry?.file_name().to_bytes().to_vec();
        if name == b"." || name == b".." {
            continue;
        }
        names.push(name);
        if names.len() > MAX_CHANGES {
            break;
        }
    }
    names.sort();
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::path::PathBuf;

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("umbra-diff-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(d.join("lower")).unwrap();
        fs::create_dir_all(d.join("upper")).unwrap();
        d
    }

    fn whiteout(p: &Path) -> bool {
        nix::sys::stat::mknod(p, SFlag::S_IFCHR, Mode::from_bits_truncate(0o600), 0).is_ok()
    }

    fn summary(changes: &[ShadowChange]) -> Vec<String> {
        changes
            .iter()
            .map(|c| format!("{:?} {}{} {:?}", c.kind, c.path, if c.is_dir { "/" } else { "" }, c.size))
            .collect()
    }

    /// Without overlayfs: the upper layer is made by hand the way overlayfs would make it.
    /// (Whiteouts need CAP_MKNOD; the agent's tests run as root, elsewhere that part is skipped.)
    #[test]
    fn upper_entries_map_to_added_modified_and_deleted() {
        let d = tmp("map");
        let (lower, upper) = (d.join("lower"), d.join("upper"));
        for dir in ["keep/sub", "gone", "replaced", "was_dir"] {
            fs::create_dir_all(lower.join(dir)).unwrap();
        }
        fs::write(lower.join("keep/sub/changed.txt"), b"old").unwrap();
        fs::write(lower.join("gone/x"), b"").unwrap();
        fs::write(lower.join("was_file"), b"").unwrap();
        fs::write(lower.join("deleted.txt"), b"").unwrap();
        fs::create_dir_all(upper.join("keep/sub")).unwrap();
        fs::write(upper.join("keep/sub/changed.txt"), b"newer").unwrap();
        fs::create_dir_all(upper.join("new/deeper")).unwrap();
        fs::write(upper.join("new/deeper/f"), b"12").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", upper.join("link")).unwrap();
        fs::create_dir_all(upper.join("was_file")).unwrap();
        fs::write(upper.join("was_dir"), b"1").unwrap();
        let can_mknod = whiteout(&upper.join("deleted.txt")) && whiteout(&upper.join("gone"));
        let (changes, truncated) = shadow_changes(&lower, &upper).unwrap();
        assert!(!truncated);
        let mut want = vec![
            "Modified keep/sub/changed.txt Some(5)",
            "Added link Some(11)",
            "Added new/ None",
            "Added new/deeper/ None",
            "Added new/deeper/f Some(2)",
            "Deleted was_dir/ None",
            "Added was_dir Some(1)",
            "Deleted was_file None",
            "Added was_file/ None",
        ];
        if can_mknod {
            want.insert(0, "Deleted deleted.txt None");
            want.insert(1, "Deleted gone/ None");
        }
        assert_eq!(summary(&changes), want);
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn lists_are_capped_and_never_follow_symlinks() {
        let d = tmp("cap");
        let (lower, upper) = (d.join("lower"), d.join("upper"));
        for i in 0..10 {
            fs::write(upper.join(format!("f{i}")), b"").unwrap();
        }
        // A symlink to a directory is one added entry, not the directory's contents.
        std::os::unix::fs::symlink("/", upper.join("zz")).unwrap();
        let (changes, truncated) = changes_within(&lower, &upper, 100, BUDGET).unwrap();
        assert_eq!((changes.len(), truncated), (11, false));
        let (changes, truncated) = changes_within(&lower, &upper, 4, BUDGET).unwrap();
        assert_eq!((changes.len(), truncated), (4, true));
        let (changes, truncated) = changes_within(&lower, &upper, 100, 200).unwrap();
        assert!(truncated && !changes.is_empty() && serde_json::to_vec(&changes).unwrap().len() <= 200);
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn deep_trees_end_in_truncation_not_a_stack_overflow() {
        let d = tmp("deep");
        // Relative steps: the whole path may pass PATH_MAX.
        let mut dir = open(&d.join("upper"), DIR_FLAGS, Mode::empty()).unwrap();
        for _ in 0..MAX_DEPTH + 10 {
            nix::sys::stat::mkdirat(&dir, "d", Mode::from_bits_truncate(0o755)).unwrap();
            dir = openat(&dir, "d", DIR_FLAGS, Mode::empty()).unwrap();
        }
        let (changes, truncated) = shadow_changes(&d.join("lower"), &d.join("upper")).unwrap();
        assert!(truncated);
        assert_eq!(changes.len(), MAX_DEPTH);
        let _ = std::process::Command::new("rm").arg("-rf").arg(&d).status();
    }
}
