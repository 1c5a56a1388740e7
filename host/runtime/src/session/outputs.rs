//! Watches a session's `outputs` folder on the host and reports files the guest creates or
//! deletes there, so an app can show them as they appear.
//!
//! The guest writes through virtio-fs into the host folder, so the host's own file
//! notifications (inotify; FSEvents on macOS, through the `notify` crate) see every change.
//! Like the app users know, it reports files, not directories, skips hidden names (editor and
//! download temporaries), and reports each file once until it is deleted.
//!
//! The folder is the guest's: nothing here follows a symlink in it. The watcher is told not
//! to, the first index is a beneath-only walk ([`crate::share::tree`], bounded), and a path is
//! reported as created only if it resolves beneath the folder with no symlink on the way
//! (`RESOLVE_NO_SYMLINKS`) to a regular file — so a link the guest plants to a host file, or
//! a directory it swaps for a link to a host directory, is never announced as an output.
//! At most [`TreeLimits::GUEST_TREE`]'s entry bound of files are tracked.

use std::collections::HashSet;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use notify::event::{ModifyKind, RenameMode};
use notify::{EventKind as FsEvent, RecommendedWatcher, RecursiveMode, Watcher};

use crate::share::tree::{self, EntryKind, Step, TreeError, TreeLimits};

/// A file appeared or went away; the path is relative to the outputs folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputsChange {
    Created { path: String, host_path: PathBuf },
    Deleted { path: String, host_path: PathBuf },
}

/// Why the outputs folder cannot be watched.
#[derive(Debug, thiserror::Error)]
pub enum OutputsError {
    #[error("cannot resolve {path}: {source}")]
    Root { path: PathBuf, source: std::io::Error },
    #[error("cannot index the folder: {0}")]
    Index(#[from] TreeError),
    #[error("cannot watch the folder: {0}")]
    Watch(#[from] notify::Error),
}

/// Stops watching when dropped.
pub struct OutputsWatcher {
    _watcher: RecommendedWatcher,
}

impl OutputsWatcher {
    /// Watches `root` (recursively); `report` is called on the watcher's thread.
    pub fn start(root: &Path, report: impl Fn(OutputsChange) + Send + 'static) -> Result<Self, OutputsError> {
        Self::start_with(root, TreeLimits::GUEST_TREE, report)
    }

    fn start_with(
        root: &Path,
        limits: TreeLimits,
        report: impl Fn(OutputsChange) + Send + 'static,
    ) -> Result<Self, OutputsError> {
        // The folder itself is the host's (the session's storage); below it is the guest's.
        let root = root.canonicalize().map_err(|source| OutputsError::Root { path: root.to_path_buf(), source })?;
        let dir = tree::open_root(&root)?;
        let known = initial_files(&dir, &root, limits)?;
        let state = Mutex::new(Known { files: known, limit: limits.max_entries as usize, full_logged: false });
        let watch_root = root.clone();
        let handler = move |res: notify::Result<notify::Event>| {
            let Ok(event) = res else { return };
            for change in classify(&watch_root, &dir, &state, &event) {
                report(change);
            }
        };
        // Not following symlinks keeps the watches inside the folder when it is first walked.
        // (A directory created later is watched by path, as `notify` does; events from a link
        // swapped in for it are dropped by `classify`, which never follows one.)
        let config = notify::Config::default().with_follow_symlinks(false);
        let mut watcher = RecommendedWatcher::new(handler, config)?;
        watcher.watch(&root, RecursiveMode::Recursive)?;
        Ok(Self { _watcher: watcher })
    }
}

/// The files reported and not yet deleted, bounded.
struct Known {
    files: HashSet<PathBuf>,
    limit: usize,
    full_logged: bool,
}

fn visible(rel: &Path) -> bool {
    !rel.components().any(|c| c.as_os_str().to_string_lossy().starts_with('.'))
}

/// The regular files below `root` now (symlinks are not files here), by a bounded walk.
fn initial_files(dir: &File, root: &Path, limits: TreeLimits) -> Result<HashSet<PathBuf>, TreeError> {
    let mut files = HashSet::new();
    tree::walk(dir, root, limits, |entry| {
        if entry.kind == EntryKind::File {
            files.insert(root.join(entry.rel));
        }
        Ok(Step::Descend)
    })?;
    Ok(files)
}

/// Whether `rel` is, right now, a regular file beneath `dir` reached through no symlink.
fn regular_file_beneath(dir: &File, rel: &Path) -> bool {
    crate::share::beneath::open_strict(dir, rel, crate::share::beneath::O_PATH)
        .and_then(|f| f.metadata())
        .is_ok_and(|m| m.is_file())
}

fn classify(root: &Path, dir: &File, known: &Mutex<Known>, event: &notify::Event) -> Vec<OutputsChange> {
    let appeared = matches!(event.kind, FsEvent::Create(_) | FsEvent::Modify(ModifyKind::Name(RenameMode::To)));
    let vanished = matches!(event.kind, FsEvent::Remove(_) | FsEvent::Modify(ModifyKind::Name(RenameMode::From)));
    let renamed = matches!(event.kind, FsEvent::Modify(ModifyKind::Name(RenameMode::Both)));
    let mut changes = Vec::new();
    let mut guard = known.lock().unwrap();
    let state = &mut *guard;
    let known = &mut state.files;
    for (i, path) in event.paths.iter().enumerate() {
        let Ok(rel) = path.strip_prefix(root) else { continue };
        if rel.as_os_str().is_empty() || !visible(rel) {
            continue;
        }
        // A rename's paths are [from, to].
        let is_new = appeared || (renamed && i == 1);
        let is_gone = vanished || (renamed && i == 0);
        let rel_text = rel.to_string_lossy().into_owned();
        if is_new && !known.contains(path) && regular_file_beneath(dir, rel) {
            if known.len() >= state.limit {
                if !state.full_logged {
                    tracing::warn!("{}: over {} files; new ones are not reported", root.display(), state.limit);
                    state.full_logged = true;
                }
                continue;
            }
            known.insert(path.clone());
            changes.push(OutputsChange::Created { path: rel_text, host_path: path.clone() });
        } else if is_gone && known.remove(path) {
            changes.push(OutputsChange::Deleted { path: rel_text, host_path: path.clone() });
        } else if is_gone {
            // A directory went away: every known file beneath it went with it.
            let beneath: Vec<PathBuf> = known.iter().filter(|k| k.starts_with(path)).cloned().collect();
            for k in beneath {
                known.remove(&k);
                let rel = k.strip_prefix(root).unwrap_or(&k).to_string_lossy().into_owned();
                changes.push(OutputsChange::Deleted { path: rel, host_path: k });
            }
        }
    }
    changes
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn next(rx: &std::sync::mpsc::Receiver<OutputsChange>) -> OutputsChange {
        rx.recv_timeout(Duration::from_secs(5)).expect("a change within 5 s")
    }

    #[test]
    fn files_created_moved_in_and_deleted_are_reported_once_and_hidden_ones_not_at_all() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        std::fs::write(root.join("old.txt"), b"x").unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let tx = Mutex::new(tx);
        let _w = OutputsWatcher::start(&root, move |c| tx.lock().unwrap().send(c).unwrap()).unwrap();

        std::fs::write(root.join(".partial"), b"x").unwrap();
        std::fs::write(root.join("report.md"), b"hello").unwrap();
        std::fs::write(root.join("report.md"), b"hello again").unwrap(); // no second "created"
        assert_eq!(next(&rx), OutputsChange::Created { path: "report.md".into(), host_path: root.join("report.md") });
        std::fs::create_dir(root.join("sub")).unwrap();
        std::thread::sleep(Duration::from_millis(100)); // the watch on sub/ is added as it appears
        std::fs::write(root.join("sub/deep.bin"), b"x").unwrap();
        assert_eq!(
            next(&rx),
            OutputsChange::Created { path: "sub/deep.bin".into(), host_path: root.join("sub/deep.bin") }
        );
        std::fs::rename(root.join(".partial"), root.join("final.csv")).unwrap();
        assert_eq!(next(&rx), OutputsChange::Created { path: "final.csv".into(), host_path: root.join("final.csv") });
        std::fs::remove_file(root.join("old.txt")).unwrap();
        assert_eq!(next(&rx), OutputsChange::Deleted { path: "old.txt".into(), host_path: root.join("old.txt") });
        std::fs::remove_dir_all(root.join("sub")).unwrap();
        assert_eq!(
            next(&rx),
            OutputsChange::Deleted { path: "sub/deep.bin".into(), host_path: root.join("sub/deep.bin") }
        );
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "nothing else: {:?}", rx.try_recv());
    }

    #[test]
    fn links_the_guest_plants_are_never_reported_nor_followed() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().canonicalize().unwrap();
        let (root, host) = (base.join("outputs"), base.join("host"));
        std::fs::create_dir_all(root.join("real")).unwrap();
        std::fs::create_dir_all(&host).unwrap();
        std::fs::write(host.join("secret"), "HOST").unwrap();
        // Planted before the watch starts: the first index follows none of them.
        std::os::unix::fs::symlink(host.join("secret"), root.join("early-link")).unwrap();
        std::os::unix::fs::symlink(&host, root.join("early-dir")).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let tx = Mutex::new(tx);
        let _w = OutputsWatcher::start(&root, move |c| tx.lock().unwrap().send(c).unwrap()).unwrap();

        // Planted while watched: a link to a host file, a link to a host directory, and a
        // directory swapped for a link to a host directory.
        std::os::unix::fs::symlink(host.join("secret"), root.join("link.txt")).unwrap();
        std::os::unix::fs::symlink(&host, root.join("dir-link")).unwrap();
        std::fs::rename(root.join("real"), base.join("real-moved")).unwrap();
        std::os::unix::fs::symlink(&host, root.join("real")).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        // Host files appearing behind those links are not the session's outputs.
        std::fs::write(host.join("new-on-host"), "HOST").unwrap();
        std::fs::write(root.join("dir-link/through-link"), "x").unwrap();
        std::fs::write(root.join("early-dir/through-early"), "x").unwrap();
        // A real output, as the marker that everything before it was seen.
        std::fs::write(root.join("marker.txt"), "ok").unwrap();
        assert_eq!(next(&rx), OutputsChange::Created { path: "marker.txt".into(), host_path: root.join("marker.txt") });
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "nothing else: {:?}", rx.try_recv());
    }

    #[test]
    fn an_index_past_the_bound_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        for i in 0..5 {
            std::fs::write(dir.path().join(format!("f{i}")), "x").unwrap();
        }
        let limits = TreeLimits { max_entries: 4, ..TreeLimits::GUEST_TREE };
        let e = OutputsWatcher::start_with(dir.path(), limits, |_| {}).err().expect("refused").to_string();
        assert!(e.contains("more than 4 entries"), "{e}");
    }
}
