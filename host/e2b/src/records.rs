//! The sandboxes this endpoint started, kept on disk so an umbrad restart loses none of them:
//! their ids, access tokens, templates, metadata and environment. One JSON file in umbrad's
//! state directory, mode 0600 (it holds the tokens), replaced whole on every change (a temp
//! file renamed over it: a crash leaves the old or the new one, never half of either). A
//! sandbox's processes are not kept: they end with the VM.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// What this file holds; another version is set aside, not misread.
const VERSION: u32 = 1;
/// Far above the endpoint's own bound on sandboxes: a file bigger than this is not ours.
const MAX_FILE: u64 = 16 << 20;

/// One sandbox, as it is kept.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub id: String,
    pub template: String,
    pub token: String,
    pub metadata: BTreeMap<String, String>,
    pub env: BTreeMap<String, String>,
    pub started_ms: u64,
    pub end_at_ms: u64,
    pub paused: bool,
    pub auto_pause: bool,
    pub cpus: u32,
    pub memory_mib: u32,
    pub disk_mib: u32,
}

#[derive(Serialize, Deserialize)]
struct Kept {
    version: u32,
    sandboxes: Vec<Record>,
}

/// The records at `path`: none when there is no file. A file that cannot be read as ours is
/// renamed aside (`<path>.unreadable`) with a warning, and nothing is loaded from it: the
/// endpoint starts, and the bytes stay for whoever looks.
pub fn load(path: &Path) -> Vec<Record> {
    let read = std::fs::File::open(path).and_then(|f| {
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut std::io::Read::take(f, MAX_FILE + 1), &mut bytes)?;
        Ok(bytes)
    });
    let bytes = match read {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            tracing::warn!(path = %path.display(), "E2B: cannot read the kept sandboxes: {e}");
            return Vec::new();
        }
    };
    let parsed = match bytes.len() as u64 > MAX_FILE {
        true => Err(format!("over {MAX_FILE} bytes")),
        false => serde_json::from_slice::<Kept>(&bytes).map_err(|e| e.to_string()).and_then(|k| match k.version {
            VERSION => Ok(k.sandboxes),
            v => Err(format!("version {v}, not {VERSION}")),
        }),
    };
    match parsed {
        Ok(records) => records,
        Err(why) => {
            let aside = path.with_extension("unreadable");
            let _ = std::fs::rename(path, &aside);
            tracing::warn!(path = %path.display(), aside = %aside.display(), "E2B: the kept sandboxes are unreadable ({why}): set aside");
            Vec::new()
        }
    }
}

/// Writes `records` to `path` in place of what was there.
pub fn save(path: &Path, records: &[Record]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
    let kept = Kept { version: VERSION, sandboxes: records.to_vec() };
    f.write_all(&serde_json::to_vec_pretty(&kept).expect("records serialize"))?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str) -> Record {
        Record {
            id: id.into(),
            template: "base".into(),
            token: "secret".into(),
            metadata: [("k".to_string(), "v".to_string())].into(),
            env: BTreeMap::new(),
            started_ms: 1,
            end_at_ms: 2,
            paused: false,
            auto_pause: true,
            cpus: 1,
            memory_mib: 512,
            disk_mib: 1024,
        }
    }

    #[test]
    fn records_round_trip_privately_and_an_unreadable_file_is_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e2b/sandboxes.json");
        assert!(load(&path).is_empty(), "no file: no sandboxes");
        save(&path, &[record("a"), record("b")]).unwrap();
        assert_eq!(load(&path), vec![record("a"), record("b")]);
        let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&path).unwrap().permissions());
        assert_eq!(mode & 0o777, 0o600, "the tokens are this user's only");
        save(&path, &[record("b")]).unwrap();
        assert_eq!(load(&path), vec![record("b")], "replaced whole");

        std::fs::write(&path, b"{\"version\": 1, \"sandboxes\": [tru").unwrap();
        assert!(load(&path).is_empty());
        assert!(!path.exists() && path.with_extension("unreadable").exists(), "set aside, not deleted");
        std::fs::write(&path, b"{\"version\": 7, \"sandboxes\": []}").unwrap();
        assert!(load(&path).is_empty() && !path.exists(), "another version is not misread");
    }
}
