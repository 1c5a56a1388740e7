//! What a virtio device keeps beyond its transport, in a snapshot: one typed state per device
//! kind (Firecracker's `Persist::State`), and the error of saving or loading it.
//!
//! Firecracker's `Persist` restores a device from its state as a constructor. Here a device is
//! built from the VM configuration first (its host resources: a disk, a socket, a virtiofsd
//! connection) and its transport restored around it, so the device's part goes through
//! [`super::VirtioDevice`]: `quiesce` stops it and returns its [`DeviceState`],
//! `prepare_restore` hands that to the new device before the transport activates it. The
//! transport's own state (registers, queue layout) is [`super::mmio::TransportState`], which
//! holds this one.
//!
//! Most devices keep nothing the transport does not: virtio-blk, virtio-rng and virtio-vsock
//! finish every request they take before stopping, and vsock's connections do not survive a
//! restore. Only virtio-fs has state of its own, virtiofsd's FUSE session, which is virtiofsd's
//! migration stream and opaque to the VMM.

use serde::{Deserialize, Serialize};

use super::fs::backend::FsError;

/// A device's own state in a snapshot, by device kind. In the state file it is a JSON object
/// whose `kind` names the variant.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum DeviceState {
    /// The device keeps no state beyond its transport (or was not running when saved).
    #[default]
    Stateless,
    Fs(FsState),
}

impl DeviceState {
    /// The kind's name in messages.
    pub fn kind(&self) -> &'static str {
        match self {
            DeviceState::Stateless => "no",
            DeviceState::Fs(_) => "virtio-fs",
        }
    }

    /// For a device that keeps no state: refuses anything but [`DeviceState::Stateless`].
    pub fn expect_stateless(&self) -> Result<(), DeviceStateError> {
        match self {
            DeviceState::Stateless => Ok(()),
            other => Err(DeviceStateError::Unexpected { saved: other.kind() }),
        }
    }
}

/// virtio-fs: the FUSE session of the virtiofsd the device was connected to (negotiated
/// options, the inodes and open handles the guest holds, by path), as virtiofsd's
/// `VHOST_USER_SET_DEVICE_STATE_FD` stream. Base64 in the state file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsState {
    #[serde(with = "base64_bytes")]
    pub virtiofsd: Vec<u8>,
}

/// Why a device could not be saved or given its saved state.
#[derive(Debug, thiserror::Error)]
pub enum DeviceStateError {
    #[error("the device cannot be stopped for a snapshot")]
    CannotStop,
    #[error("{saved} device state was saved for a device that keeps none")]
    Unexpected { saved: &'static str },
    #[error("virtio-fs {tag:?}: {source}")]
    Fs { tag: String, source: FsError },
}

/// Bytes as a base64 string (serde `with`): a JSON array of numbers would be four times larger.
mod base64_bytes {
    use base64::engine::general_purpose::STANDARD;
    use base64::Engine as _;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(deserializer)?;
        STANDARD.decode(text).map_err(|e| serde::de::Error::custom(format!("not base64: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_is_named_in_the_state_file_and_bytes_are_base64() {
        let fs = DeviceState::Fs(FsState { virtiofsd: b"session".to_vec() });
        let json = serde_json::to_string(&fs).unwrap();
        assert_eq!(json, r#"{"kind":"fs","virtiofsd":"c2Vzc2lvbg=="}"#);
        assert_eq!(serde_json::from_str::<DeviceState>(&json).unwrap(), fs);
        let none = serde_json::to_string(&DeviceState::Stateless).unwrap();
        assert_eq!(none, r#"{"kind":"stateless"}"#);
        assert_eq!(serde_json::from_str::<DeviceState>(&none).unwrap(), DeviceState::Stateless);
    }

    #[test]
    fn a_state_that_is_not_one_is_refused_by_name() {
        let parse = |json: &str| serde_json::from_str::<DeviceState>(json).unwrap_err().to_string();
        assert!(parse(r#"{"kind":"fs","virtiofsd":"not base64!"}"#).contains("not base64"));
        assert!(parse(r#"{"kind":"gpu"}"#).contains("unknown variant `gpu`"));
        assert!(parse(r#"{"kind":"fs"}"#).contains("missing field `virtiofsd`"));
    }

    #[test]
    fn a_stateless_device_refuses_another_kinds_state() {
        assert!(DeviceState::Stateless.expect_stateless().is_ok());
        let e = DeviceState::Fs(FsState { virtiofsd: vec![1] }).expect_stateless().unwrap_err();
        assert_eq!(e.to_string(), "virtio-fs device state was saved for a device that keeps none");
    }
}
