//! What a session is, on disk: one JSON record per session in the state directory
//! (`$XDG_STATE_HOME/umbra/sessions/<name>.json`), so a restarted daemon knows its sessions.
//!
//! Records are replaced atomically (write a temporary file, fsync, rename), so a crash leaves
//! the old record or the new one, never half of one. The VMs themselves die with the daemon
//! that ran them; a record that says a session was running is read back as stopped.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use umbra_api::{FolderSpec, SessionSettings, SessionStatus};

/// The record format; a record of another version is skipped with a warning, not misread.
const RECORD_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionRecord {
    pub version: u32,
    pub name: String,
    pub settings: SessionSettings,
    /// The user's folders (mounted at start, or later, and not unmounted since).
    pub folders: Vec<FolderSpec>,
    pub created_ms: u64,
    pub status: SessionStatus,
    #[serde(default)]
    pub last_error: Option<String>,
}

impl SessionRecord {
    pub fn new(name: &str, settings: SessionSettings, folders: Vec<FolderSpec>) -> Self {
        Self {
            version: RECORD_VERSION,
            name: name.into(),
            settings,
            folders,
            created_ms: umbra_api::event::now_ms(),
            status: SessionStatus::Starting,
            last_error: None,
        }
    }
}

/// Where records live; `None` keeps nothing (a `vmctl run` session).
#[derive(Debug, Clone)]
pub struct RecordStore {
    dir: Option<PathBuf>,
}

impl RecordStore {
    pub fn new(dir: Option<PathBuf>) -> Self {
        Self { dir }
    }

    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    pub fn save(&self, record: &SessionRecord) -> std::io::Result<()> {
        let Some(dir) = &self.dir else { return Ok(()) };
        std::fs::create_dir_all(dir)?;
        let path = dir.join(format!("{}.json", record.name));
        let tmp = dir.join(format!(".{}.json.tmp", record.name));
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&serde_json::to_vec_pretty(record).expect("records serialize"))?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)?;
        // The rename itself must survive a crash too.
        std::fs::File::open(dir)?.sync_all()
    }

    /// Every readable record; unreadable ones are skipped with a warning (a hand-edited or
    /// truncated file must not keep the daemon from starting).
    pub fn load_all(&self) -> Vec<SessionRecord> {
        let Some(dir) = &self.dir else { return Vec::new() };
        let mut records = Vec::new();
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || !name.ends_with(".json") {
                continue;
            }
            let parsed = std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<SessionRecord>(&b).map_err(|e| e.to_string()));
            match parsed {
                Ok(r) if r.version == RECORD_VERSION && format!("{}.json", r.name) == name => records.push(r),
                Ok(r) => tracing::warn!("skipping {}: record version {} for {:?}", path.display(), r.version, r.name),
                Err(e) => tracing::warn!("skipping unreadable session record {}: {e}", path.display()),
            }
        }
        records.sort_by(|a, b| a.name.cmp(&b.name));
        records
    }

    pub fn remove(&self, name: &str) {
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_file(dir.join(format!("{name}.json")));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> SessionSettings {
        umbra_api::SessionSettings::default()
    }

    #[test]
    fn records_survive_a_reload_and_bad_files_are_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let store = RecordStore::new(Some(dir.path().to_path_buf()));
        let mut r = SessionRecord::new("a", settings(), vec![]);
        r.status = SessionStatus::Ready;
        store.save(&r).unwrap();
        store.save(&SessionRecord::new("b", settings(), vec![])).unwrap();
        std::fs::write(dir.path().join("c.json"), b"{ truncated").unwrap();
        std::fs::write(
            dir.path().join("d.json"),
            serde_json::to_vec(&SessionRecord::new("e", settings(), vec![])).unwrap(),
        )
        .unwrap();
        let loaded = store.load_all();
        assert_eq!(loaded.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(loaded[0], r);
        store.remove("a");
        assert_eq!(store.load_all().len(), 1);
        assert!(RecordStore::new(None).load_all().is_empty());
    }
}
