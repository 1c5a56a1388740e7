//! Watches a session's `outputs` folder on the host and reports files the guest creates or
//! deletes there, so an app can show them as they appear.
//!
//! The guest writes through virtio-fs into the host folder, so the host's own file
//! notifications (inotify; FSEvents on macOS, through the `notify` crate) see every change.
//! Like the app users know, it reports files, not directories, skips hidden names (editor and
//! download temporaries), and reports each file once until it is deleted.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use notify::event::{ModifyKind, RenameMode};
use notify::{EventKind as FsEvent, RecommendedWatcher, RecursiveMode, Watcher};

/// A file appeared or went away; the path is relative to the outputs folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputsChange {
    Created { path: String, host_path: PathBuf },
    Deleted { path: String, host_path: PathBuf },
}

/// Stops watching when dropped.
pub struct OutputsWatcher {
    _watcher: RecommendedWatcher,
}

impl OutputsWatcher {
    /// Watches `root` (recursively); `report` is called on the watcher's thread.
    pub fn start(root: &Path, report: impl Fn(OutputsChange) + Send + 'static) -> notify::Result<Self> {
        let root = root.canonicalize()?;
        let known = Arc::new(Mutex::new(initial_files(&root)));
        let watch_root = root.clone();
        let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            let Ok(event) = res else { return };
            for change in classify(&watch_root, &known, &event) {
                report(change);
            }
        })?;
        watcher.watch(&root, RecursiveMode::Recursive)?;
        Ok(Self { _watcher: watcher })
    }
}

fn visible(rel: &Path) -> bool {
    !rel.components().any(|c| c.as_os_str().to_string_lossy().starts_with('.'))
}

fn initial_files(root: &Path) -> HashSet<PathBuf> {
    let mut files = HashSet::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            match entry.file_type() {
                Ok(t) if t.is_dir() => dirs.push(path),
                Ok(_) => {
                    files.insert(path);
                }
                Err(_) => {}
            }
        }
    }
    files
}

fn classify(root: &Path, known: &Mutex<HashSet<PathBuf>>, event: &notify::Event) -> Vec<OutputsChange> {
    let appeared = matches!(event.kind, FsEvent::Create(_) | FsEvent::Modify(ModifyKind::Name(RenameMode::To)));
    let vanished = matches!(event.kind, FsEvent::Remove(_) | FsEvent::Modify(ModifyKind::Name(RenameMode::From)));
    let renamed = matches!(event.kind, FsEvent::Modify(ModifyKind::Name(RenameMode::Both)));
    let mut changes = Vec::new();
    let mut known = known.lock().unwrap();
    for (i, path) in event.paths.iter().enumerate() {
        let Ok(rel) = path.strip_prefix(root) else { continue };
        if rel.as_os_str().is_empty() || !visible(rel) {
            continue;
        }
        // A rename's paths are [from, to].
        let is_new = appeared || (renamed && i == 1);
        let is_gone = vanished || (renamed && i == 0);
        let rel_text = rel.to_string_lossy().into_owned();
        if is_new && path.is_file() && known.insert(path.clone()) {
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
}
