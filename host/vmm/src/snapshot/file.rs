//! The state file: a fixed header, then a JSON body.
//!
//! ```text
//! offset  size  field
//!      0     8  magic     "UMBRASNP"
//!      8     4  version   u32 LE, FORMAT_VERSION of the writer
//!     12     8  len       u64 LE, body length
//!     20    32  sha256    of the body
//!     52   len  body      JSON of SnapshotState
//! ```
//!
//! The header is checked in that order, so a file from another format version is named as such
//! even when its body would not parse, and no byte of a body whose digest does not match is
//! parsed at all.

use std::path::Path;

use sha2::{Digest, Sha256};

use super::cpu::SnapshotState;
use super::SnapshotError;

pub const MAGIC: [u8; 8] = *b"UMBRASNP";
/// Bumped whenever the body's meaning changes; a reader refuses every other version.
/// 2: a virtio device's own state, base64 bytes beside its transport. 3: that state typed
/// ([`crate::devices::virtio::persist::DeviceState`]). Version 2 is still read (the transport
/// state takes either form), so a session paused before an upgrade resumes after it.
pub const FORMAT_VERSION: u32 = 3;
/// The oldest version this reader understands.
pub const OLDEST_READ: u32 = 2;
const HEADER_LEN: usize = 52;
/// Bounds what a reader allocates for a body: far above any real state (a few hundred KiB for
/// the largest vCPU count), far below what a hostile length could ask for.
const MAX_BODY: u64 = 64 << 20;

/// Encodes `state` as a state file.
pub fn encode(state: &SnapshotState) -> Vec<u8> {
    let body = serde_json::to_vec(state).expect("snapshot state serialises");
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend(MAGIC);
    out.extend(FORMAT_VERSION.to_le_bytes());
    out.extend((body.len() as u64).to_le_bytes());
    out.extend(Sha256::digest(&body));
    out.extend(body);
    out
}

/// Decodes a state file's bytes; `path` names it in errors.
pub fn decode(bytes: &[u8], path: &str) -> Result<SnapshotState, SnapshotError> {
    let path = path.to_string();
    if bytes.len() < MAGIC.len() || bytes[..MAGIC.len()] != MAGIC {
        return Err(SnapshotError::NotASnapshot { path });
    }
    if bytes.len() < HEADER_LEN {
        return Err(SnapshotError::Truncated { path, expected: HEADER_LEN as u64, found: bytes.len() as u64 });
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if !(OLDEST_READ..=FORMAT_VERSION).contains(&version) {
        return Err(SnapshotError::Version { path, found: version, supported: FORMAT_VERSION });
    }
    let len = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes"));
    if len > MAX_BODY {
        return Err(SnapshotError::Parse { path, reason: format!("a body of {len} bytes exceeds {MAX_BODY}") });
    }
    let expected = HEADER_LEN as u64 + len;
    if (bytes.len() as u64) < expected {
        return Err(SnapshotError::Truncated { path, expected, found: bytes.len() as u64 });
    }
    if bytes.len() as u64 > expected {
        return Err(SnapshotError::Parse {
            path,
            reason: format!("{} bytes follow the {expected}-byte state", bytes.len() as u64 - expected),
        });
    }
    let body = &bytes[HEADER_LEN..];
    if Sha256::digest(body)[..] != bytes[20..52] {
        return Err(SnapshotError::Checksum { path });
    }
    serde_json::from_slice(body).map_err(|e| SnapshotError::Parse { path, reason: e.to_string() })
}

/// Writes `state` to `path` atomically (a temporary file renamed over it).
pub fn save(state: &SnapshotState, path: &Path) -> Result<(), SnapshotError> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, encode(state)).map_err(SnapshotError::io(format!("write {}", tmp.display())))?;
    std::fs::rename(&tmp, path).map_err(SnapshotError::io(format!("rename into {}", path.display())))
}

/// Writes `state` into `file` (empty, opened by the caller) and makes it durable.
pub fn write_to(state: &SnapshotState, mut file: &std::fs::File) -> Result<(), SnapshotError> {
    use std::io::Write;
    file.write_all(&encode(state)).map_err(SnapshotError::io("write the state file"))?;
    file.sync_all().map_err(SnapshotError::io("write the state file"))
}

/// Reads and checks the state file at `path`.
pub fn load(path: &Path) -> Result<SnapshotState, SnapshotError> {
    let len = std::fs::metadata(path).map_err(SnapshotError::io(format!("read {}", path.display())))?.len();
    if len > HEADER_LEN as u64 + MAX_BODY {
        return Err(SnapshotError::Parse {
            path: path.display().to_string(),
            reason: format!("{len} bytes is not a state file's size"),
        });
    }
    let bytes = std::fs::read(path).map_err(SnapshotError::io(format!("read {}", path.display())))?;
    decode(&bytes, &path.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::cpu::tests::sample_state;

    #[test]
    fn a_state_file_round_trips() {
        let state = sample_state();
        let back = decode(&encode(&state), "s").unwrap();
        assert_eq!(serde_json::to_value(&back).unwrap(), serde_json::to_value(&state).unwrap());
    }

    #[test]
    fn every_kind_of_damage_is_refused_by_name() {
        let good = encode(&sample_state());
        let err = |bytes: &[u8]| decode(bytes, "state.json").unwrap_err().to_string();

        assert!(err(b"{\"json\": 1}").contains("not an umbra snapshot"), "{}", err(b"{}"));
        let mut other = good.clone();
        other[8..12].copy_from_slice(&7u32.to_le_bytes());
        assert!(err(&other).contains("format version 7; this umbra-vmm reads version 3"), "{}", err(&other));
        assert!(err(&good[..good.len() - 1]).contains("truncated"), "{}", err(&good[..good.len() - 1]));
        assert!(err(&good[..30]).contains("truncated"));
        for at in [HEADER_LEN, good.len() / 2, good.len() - 1] {
            let mut flipped = good.clone();
            flipped[at] ^= 0x20;
            assert!(err(&flipped).contains("corrupt: its SHA-256 does not match"), "byte {at}: {}", err(&flipped));
        }
        let mut huge = good.clone();
        huge[12..20].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(err(&huge).contains("exceeds"), "{}", err(&huge));
        let mut longer = good.clone();
        longer.push(0);
        assert!(err(&longer).contains("follow the"), "{}", err(&longer));
    }

    #[test]
    fn a_file_of_the_previous_format_is_read_and_an_older_one_named() {
        let framed = |version: u32, body: &[u8]| {
            let mut bytes = MAGIC.to_vec();
            bytes.extend(version.to_le_bytes());
            bytes.extend((body.len() as u64).to_le_bytes());
            bytes.extend(Sha256::digest(body));
            bytes.extend(body);
            bytes
        };
        // Version 2 kept a device's state as base64 bytes: past the header, its body is parsed
        // (this one is not a whole state, so the parse fails, not the version check).
        let body = br#"{"devices": [{"device_type": 26, "device_state": "c2Vzc2lvbg=="}]}"#;
        let e = decode(&framed(2, body), "old/state").unwrap_err().to_string();
        assert!(!e.contains("format version"), "{e}");
        let e = decode(&framed(1, body), "older/state").unwrap_err().to_string();
        assert_eq!(
            e,
            "older/state: state file format version 1; this umbra-vmm reads version 3 (take the snapshot again \
             with this version)"
        );
    }

    #[test]
    fn a_body_that_matches_its_digest_but_not_the_schema_is_a_parse_error() {
        let body = b"{\"vcpus\": 3}";
        let mut bytes = MAGIC.to_vec();
        bytes.extend(FORMAT_VERSION.to_le_bytes());
        bytes.extend((body.len() as u64).to_le_bytes());
        bytes.extend(Sha256::digest(body));
        bytes.extend(body);
        let e = decode(&bytes, "s").unwrap_err().to_string();
        assert!(e.contains("does not parse"), "{e}");
    }
}
