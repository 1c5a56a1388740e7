//! What a session is, on disk: one JSON record per session in the state directory
//! (`$XDG_STATE_HOME/umbra/sessions/<name>.json`), so a restarted daemon knows its sessions.
//!
//! Records are replaced atomically (write a temporary file, fsync, rename), so a crash leaves
//! the old record or the new one, never half of one. The VMs themselves die with the daemon
//! that ran them; a record that says a session was running is read back as stopped.
//!
//! Saving is asynchronous: one background thread writes the latest record of each session
//! (several changes in a row are one write), because the fsyncs cost milliseconds each and
//! status changes happen on the runtime's threads. [`RecordStore::flush`] waits for the writes
//! (the manager's shutdown calls it; dropping the last handle does too). A daemon killed
//! outright loses at most the last few milliseconds of status changes, and statuses are read
//! back as stopped anyway.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};

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
    /// The snapshot in the session's storage (see [`super::snapshot`]), if any.
    #[serde(default)]
    pub snapshot: Option<umbra_api::session::SnapshotInfo>,
    /// What each folder the session shared was when first shared (see
    /// [`crate::share::FolderPins`]); a fork keeps its source's.
    #[serde(default)]
    pub pinned: crate::share::FolderPins,
    /// Its secrets' names, placeholders and hosts: never a value.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<crate::egress::SecretBinding>,
    /// Its SSH keys' names, hosts and host keys: never a private key.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ssh_keys: Vec<crate::egress::SshKeyBinding>,
    /// Its exposed ports, each with the host port it got (kept again after a restart).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<umbra_api::ports::PortSpec>,
    /// Which source decided each field of its policy when it started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_decided_by: Option<umbra_policy::DecidedBy>,
    /// Suspended when idle: the next call naming it resumes it (also after a daemon restart).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub suspended: bool,
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
            snapshot: None,
            pinned: Default::default(),
            secrets: Vec::new(),
            ssh_keys: Vec::new(),
            ports: Vec::new(),
            policy_decided_by: None,
            suspended: false,
        }
    }
}

/// Where records live; `None` keeps nothing (a `vmctl run` session). Clones share one writer.
#[derive(Clone)]
pub struct RecordStore {
    dir: Option<PathBuf>,
    writer: Option<Arc<RecordWriter>>,
}

impl std::fmt::Debug for RecordStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordStore").field("dir", &self.dir).finish_non_exhaustive()
    }
}

enum Pending {
    Save(Box<SessionRecord>),
    Remove,
}

#[derive(Default)]
struct Queue {
    pending: BTreeMap<String, Pending>,
    /// The writer is carrying out a batch.
    busy: bool,
    closing: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    /// Signalled when work arrives, and when a batch is done.
    changed: Condvar,
}

struct RecordWriter {
    shared: Arc<Shared>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for RecordWriter {
    fn drop(&mut self) {
        self.shared.queue.lock().unwrap().closing = true;
        self.shared.changed.notify_all();
        if let Some(t) = self.thread.lock().unwrap().take() {
            let _ = t.join();
        }
    }
}

fn write_records(dir: &Path, shared: &Shared) {
    loop {
        let batch = {
            let mut q = shared.queue.lock().unwrap();
            while q.pending.is_empty() && !q.closing {
                q = shared.changed.wait(q).unwrap();
            }
            if q.pending.is_empty() {
                return; // closing, and everything is written
            }
            q.busy = true;
            std::mem::take(&mut q.pending)
        };
        for (name, op) in batch {
            match op {
                Pending::Save(record) => {
                    if let Err(e) = save_now(dir, &record) {
                        tracing::warn!("session {name}: cannot save its record: {e}");
                    }
                }
                Pending::Remove => {
                    let _ = std::fs::remove_file(dir.join(format!("{name}.json")));
                }
            }
        }
        shared.queue.lock().unwrap().busy = false;
        shared.changed.notify_all();
    }
}

/// Replaces `record`'s file atomically and durably.
fn save_now(dir: &Path, record: &SessionRecord) -> std::io::Result<()> {
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

impl RecordStore {
    pub fn new(dir: Option<PathBuf>) -> Self {
        let writer = dir.clone().map(|dir| {
            let shared = Arc::new(Shared { queue: Mutex::default(), changed: Condvar::new() });
            let for_thread = shared.clone();
            let thread = std::thread::Builder::new()
                .name("umbra-records".into())
                .spawn(move || write_records(&dir, &for_thread))
                .expect("spawn the session record writer");
            Arc::new(RecordWriter { shared, thread: Mutex::new(Some(thread)) })
        });
        Self { dir, writer }
    }

    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    fn enqueue(&self, name: &str, op: Pending) {
        if let Some(w) = &self.writer {
            w.shared.queue.lock().unwrap().pending.insert(name.to_string(), op);
            w.shared.changed.notify_all();
        }
    }

    /// Saves `record` in the background (the latest record of a session wins).
    pub fn save(&self, record: &SessionRecord) {
        self.enqueue(&record.name, Pending::Save(Box::new(record.clone())));
    }

    /// Waits until every save and removal asked for so far is on disk.
    pub fn flush(&self) {
        if let Some(w) = &self.writer {
            let mut q = w.shared.queue.lock().unwrap();
            while !q.pending.is_empty() || q.busy {
                q = w.shared.changed.wait(q).unwrap();
            }
        }
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
        self.enqueue(name, Pending::Remove);
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
        store.save(&r);
        store.save(&SessionRecord::new("b", settings(), vec![]));
        store.flush();
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
        store.flush();
        assert_eq!(store.load_all().len(), 1);
        // Saves in a row coalesce, and the last one wins; dropping the store writes it.
        let mut c = SessionRecord::new("f", settings(), vec![]);
        for status in [SessionStatus::Ready, SessionStatus::Stopping, SessionStatus::Stopped] {
            c.status = status;
            store.save(&c);
        }
        drop(store);
        let again = RecordStore::new(Some(dir.path().to_path_buf()));
        let c_loaded = again.load_all().into_iter().find(|r| r.name == "f").unwrap();
        assert_eq!(c_loaded.status, SessionStatus::Stopped);
        assert!(RecordStore::new(None).load_all().is_empty());
    }
}
