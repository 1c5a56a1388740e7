//! Session snapshots: a running session paused into its storage directory, and restored from
//! there — resumed where it was, or forked into new sessions.
//!
//! `<storage>/snapshot/` holds:
//! - `vm/`: umbra-vmm's `state` and `memory` files ([`crate::backend::Vm::snapshot`]);
//! - `disk.img`: a sparse copy of the session disk as the snapshot's memory expects it (every
//!   restore copies it again, so the snapshot stays valid after the session writes on);
//! - `session.json`: [`SnapshotMeta`], what the restore needs beyond the VM: the bundle, the
//!   machine's size, and the folder table (names, guest paths, shadow baselines).
//!
//! A new snapshot is written beside the old one (`.snapshot.part`) and replaces it only when
//! complete, so a failure leaves the earlier snapshot whole. A fork hard-links the source's
//! files into its own `snapshot/` (same filesystem: the sessions' storage root), holding the
//! source's lifecycle lock meanwhile, so a later snapshot of the source never changes the
//! fork's.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use umbra_api::session::SnapshotInfo;

use super::error::SessionError;
use crate::share::folders::SavedFolder;

/// The snapshot's directory in a session's storage.
pub const SNAPSHOT_DIR: &str = "snapshot";
const PART_DIR: &str = ".snapshot.part";
const OLD_DIR: &str = ".snapshot.old";
const META_FILE: &str = "session.json";
const VM_DIR: &str = "vm";
const DISK_FILE: &str = "disk.img";
/// The meta file's format; another version is refused by name, never misread.
pub(super) const META_VERSION: u32 = 1;

/// What a restore needs beyond umbra-vmm's own files.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct SnapshotMeta {
    pub version: u32,
    /// The session that took it (a fork's guest paths keep this name).
    pub session: String,
    /// The guest's hostname then: what a resume keeps (a fork is given its own name).
    pub hostname: String,
    pub taken_ms: u64,
    /// The bundle spec and the version it resolved to when the VM booted.
    pub bundle: String,
    pub bundle_version: String,
    pub cpus: u32,
    pub memory_mib: u32,
    pub folder_sharing: bool,
    /// Whether `disk.img` is there (the session had a disk).
    pub disk: bool,
    pub memory_bytes: u64,
    pub pause_ms: u64,
    /// Where the pause went, as umbra-vmm measured it.
    #[serde(default)]
    pub pause_phases: String,
    pub folders: Vec<SavedFolder>,
}

impl SnapshotMeta {
    pub fn info(&self, resumes: bool) -> SnapshotInfo {
        SnapshotInfo {
            taken_ms: self.taken_ms,
            source: self.session.clone(),
            bundle_version: self.bundle_version.clone(),
            memory_bytes: self.memory_bytes,
            pause_ms: self.pause_ms,
            resumes,
        }
    }
}

/// A snapshot on disk.
pub(super) struct SessionSnapshot {
    pub dir: PathBuf,
    pub meta: SnapshotMeta,
}

impl SessionSnapshot {
    /// The snapshot in `storage`, checked: its meta file readable and of this version, its VM
    /// files present.
    pub fn load(storage: &Path) -> Result<Self, SessionError> {
        let dir = storage.join(SNAPSHOT_DIR);
        // A commit cut off between its two renames left the earlier snapshot aside: it is
        // still the session's snapshot.
        let old = storage.join(OLD_DIR);
        if !dir.exists() && old.join(META_FILE).is_file() {
            std::fs::rename(&old, &dir).map_err(SessionError::io(format!("put {} back", old.display())))?;
        }
        let path = dir.join(META_FILE);
        let bytes = std::fs::read(&path).map_err(SessionError::io(format!("read {}", path.display())))?;
        let meta: SnapshotMeta = serde_json::from_slice(&bytes)
            .map_err(|e| SessionError::InvalidArgument(format!("{} is not a session snapshot: {e}", path.display())))?;
        if meta.version != META_VERSION {
            return Err(SessionError::InvalidArgument(format!(
                "{} is a version {} snapshot; this umbra reads version {META_VERSION}",
                path.display(),
                meta.version
            )));
        }
        let snapshot = Self { dir, meta };
        for f in [snapshot.vm_dir().join("state"), snapshot.vm_dir().join("memory")] {
            if !f.is_file() {
                return Err(SessionError::InvalidArgument(format!("the snapshot lacks {}", f.display())));
            }
        }
        if snapshot.meta.disk && !snapshot.disk().is_file() {
            return Err(SessionError::InvalidArgument(format!("the snapshot lacks {}", snapshot.disk().display())));
        }
        Ok(snapshot)
    }

    pub fn vm_dir(&self) -> PathBuf {
        self.dir.join(VM_DIR)
    }

    pub fn disk(&self) -> PathBuf {
        self.dir.join(DISK_FILE)
    }
}

/// A snapshot being written: `<storage>/.snapshot.part`, made `snapshot/` by [`Self::commit`];
/// removed if dropped before.
pub(super) struct PendingSnapshot {
    storage: PathBuf,
    committed: bool,
}

impl PendingSnapshot {
    pub fn begin(storage: &Path) -> Result<Self, SessionError> {
        let part = storage.join(PART_DIR);
        let _ = std::fs::remove_dir_all(&part);
        std::fs::create_dir_all(&part).map_err(SessionError::io(format!("create {}", part.display())))?;
        Ok(Self { storage: storage.to_path_buf(), committed: false })
    }

    fn dir(&self) -> PathBuf {
        self.storage.join(PART_DIR)
    }

    /// Where the VM's files go (a directory [`crate::backend::Vm::snapshot`] creates).
    pub fn vm_dir(&self) -> PathBuf {
        self.dir().join(VM_DIR)
    }

    pub fn disk(&self) -> PathBuf {
        self.dir().join(DISK_FILE)
    }

    /// Writes `meta` and puts the snapshot in place of the earlier one.
    pub fn commit(mut self, meta: &SnapshotMeta) -> Result<(), SessionError> {
        let dir = self.dir();
        write_durably(
            &dir.join(META_FILE),
            &serde_json::to_vec_pretty(meta)
                .map_err(|e| SessionError::InvalidArgument(format!("the folder table cannot be saved: {e}")))?,
        )?;
        // Its files are durable before its name is: a crash never leaves a `snapshot/` whose
        // directory entries were lost.
        for d in [dir.join(VM_DIR), dir.clone()] {
            sync_dir(&d)?;
        }
        let (current, old) = (self.storage.join(SNAPSHOT_DIR), self.storage.join(OLD_DIR));
        let _ = std::fs::remove_dir_all(&old);
        if current.exists() {
            std::fs::rename(&current, &old).map_err(SessionError::io(format!("move {} aside", current.display())))?;
        }
        if let Err(e) = std::fs::rename(&dir, &current) {
            // The earlier snapshot goes back: the session's record still names it.
            let _ = std::fs::rename(&old, &current);
            return Err(SessionError::io(format!("rename {}", dir.display()))(e));
        }
        // In place: from here on it is the session's snapshot, so a failed sync of the new name
        // (which a crash could only turn back into the earlier snapshot) is not an error.
        self.committed = true;
        let _ = sync_dir(&self.storage);
        let _ = std::fs::remove_dir_all(&old);
        Ok(())
    }
}

impl Drop for PendingSnapshot {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(self.dir());
        }
    }
}

fn sync_dir(dir: &Path) -> Result<(), SessionError> {
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(SessionError::io(format!("sync {}", dir.display())))
}

fn write_durably(path: &Path, bytes: &[u8]) -> Result<(), SessionError> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(SessionError::io(format!("create {}", path.display())))?;
    f.write_all(bytes).and_then(|_| f.sync_all()).map_err(SessionError::io(format!("write {}", path.display())))
}

/// Gives `dest_storage` its own `snapshot/`: hard links to the files of the snapshot in
/// `source_storage` (nothing is copied; the memory file is only ever mapped privately and the
/// disk copied, so the links are never written through). Replaces nothing: `dest_storage` must
/// have no snapshot.
pub(super) fn link(source_storage: &Path, dest_storage: &Path) -> Result<SnapshotMeta, SessionError> {
    let source = SessionSnapshot::load(source_storage)?;
    let dest = dest_storage.join(SNAPSHOT_DIR);
    if dest.exists() {
        return Err(SessionError::InvalidArgument(format!("{} exists already", dest.display())));
    }
    let linked = link_files(&source, &dest);
    if let Err(e) = linked {
        let _ = std::fs::remove_dir_all(&dest);
        return Err(SessionError::io(format!("link the snapshot of {} into {}", source.meta.session, dest.display()))(
            e,
        ));
    }
    Ok(source.meta)
}

fn link_files(source: &SessionSnapshot, dest: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dest.join(VM_DIR))?;
    for name in ["state", "memory"] {
        std::fs::hard_link(source.vm_dir().join(name), dest.join(VM_DIR).join(name))?;
    }
    if source.meta.disk {
        std::fs::hard_link(source.disk(), dest.join(DISK_FILE))?;
    }
    std::fs::hard_link(source.dir.join(META_FILE), dest.join(META_FILE))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> SnapshotMeta {
        SnapshotMeta {
            version: META_VERSION,
            session: "a".into(),
            hostname: "umbra".into(),
            taken_ms: 1,
            bundle: "current".into(),
            bundle_version: "1".into(),
            cpus: 1,
            memory_mib: 256,
            folder_sharing: true,
            disk: true,
            memory_bytes: 4096,
            pause_ms: 1,
            pause_phases: String::new(),
            folders: Vec::new(),
        }
    }

    fn fake_vm_files(pending: &PendingSnapshot, tag: &str) {
        std::fs::create_dir_all(pending.vm_dir()).unwrap();
        for f in ["state", "memory"] {
            std::fs::write(pending.vm_dir().join(f), tag).unwrap();
        }
        std::fs::write(pending.disk(), tag).unwrap();
    }

    #[test]
    fn a_snapshot_replaces_the_last_only_when_whole_and_forks_keep_theirs() {
        let root = tempfile::tempdir().unwrap();
        let (a, b) = (root.path().join("a"), root.path().join("b"));
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        assert!(SessionSnapshot::load(&a).is_err(), "no snapshot yet");

        let first = PendingSnapshot::begin(&a).unwrap();
        fake_vm_files(&first, "one");
        first.commit(&meta()).unwrap();
        assert_eq!(SessionSnapshot::load(&a).unwrap().meta, meta());

        // A snapshot abandoned half-way leaves the first whole, and no debris.
        let second = PendingSnapshot::begin(&a).unwrap();
        fake_vm_files(&second, "two");
        drop(second);
        assert!(!a.join(PART_DIR).exists());
        let s = SessionSnapshot::load(&a).unwrap();
        assert_eq!(std::fs::read_to_string(s.vm_dir().join("memory")).unwrap(), "one");

        // A fork links the files; the source's next snapshot does not change the fork's.
        assert_eq!(link(&a, &b).unwrap().session, "a");
        let third = PendingSnapshot::begin(&a).unwrap();
        fake_vm_files(&third, "three");
        third.commit(&SnapshotMeta { taken_ms: 3, ..meta() }).unwrap();
        let forked = SessionSnapshot::load(&b).unwrap();
        assert_eq!(std::fs::read_to_string(forked.vm_dir().join("memory")).unwrap(), "one");
        assert_eq!(std::fs::read_to_string(forked.disk()).unwrap(), "one");
        assert_eq!(SessionSnapshot::load(&a).unwrap().meta.taken_ms, 3);
        assert!(link(&a, &b).is_err(), "a fork's snapshot is never replaced by a link");

        // A commit cut off between its renames: the earlier snapshot, set aside, is found.
        std::fs::rename(a.join(SNAPSHOT_DIR), a.join(OLD_DIR)).unwrap();
        assert_eq!(SessionSnapshot::load(&a).unwrap().meta.taken_ms, 3);
        assert!(!a.join(OLD_DIR).exists());
        assert_eq!(SessionSnapshot::load(&b).unwrap().meta.taken_ms, 1);

        // A meta file of another version, or missing VM files, is refused by name.
        let m = a.join(SNAPSHOT_DIR).join(META_FILE);
        std::fs::write(&m, serde_json::to_vec(&SnapshotMeta { version: 9, ..meta() }).unwrap()).unwrap();
        let e = SessionSnapshot::load(&a).err().unwrap().to_string();
        assert!(e.contains("version 9"), "{e}");
        std::fs::write(&m, serde_json::to_vec(&meta()).unwrap()).unwrap();
        std::fs::remove_file(a.join(SNAPSHOT_DIR).join(VM_DIR).join("state")).unwrap();
        let e = SessionSnapshot::load(&a).err().unwrap().to_string();
        assert!(e.contains("lacks") && e.contains("state"), "{e}");
    }
}
