//! umbra-fsd's control protocol: one JSON object per line on its stdin, one reply per line on
//! its stdout. The first line it writes is [`FsdReply::Ready`] (virtiofsd listens) or
//! [`FsdReply::Error`] (it then exits 1); then one reply per request. Closing its stdin ends it,
//! and virtiofsd with it.
//!
//! ```text
//! ← {"reply":"ready"}
//! → {"op":"add","name":"proj","source":"/home/me/proj","read_only":true,"hide":[".env"]}
//! ← {"reply":"shared","identity":{"dev":2049,"ino":131073}}
//! → {"op":"remove","name":"proj"}
//! ← {"reply":"removed"}
//! ← {"reply":"error","error":"why"}
//! ```

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
pub use umbra_sys::FolderIdentity;

/// The virtio-fs tag the guest agent mounts the folder server's share by.
pub const FS_TAG: &str = "umbra";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase", deny_unknown_fields)]
pub enum FsdRequest {
    /// Bind `source` into the staging directory as `name` (read-only on the host if
    /// `read_only`), every `.git` read-only with `protect_git`, and what the gitignore
    /// patterns `hide` match never opened for the guest.
    Add {
        name: String,
        source: PathBuf,
        read_only: bool,
        #[serde(default)]
        protect_git: bool,
        #[serde(default)]
        hide: Vec<String>,
        /// The folder's identity when it was first shared: anything else there is refused.
        #[serde(default)]
        identity: Option<FolderIdentity>,
    },
    Remove {
        name: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "lowercase", deny_unknown_fields)]
pub enum FsdReply {
    /// virtiofsd listens: the VM can connect.
    Ready,
    /// The folder is shared; this is what was found at its path (opened without following a
    /// link).
    Shared {
        identity: FolderIdentity,
    },
    Removed,
    Error {
        error: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_replies_read_as_the_module_shows() {
        let add: FsdRequest =
            serde_json::from_str(r#"{"op":"add","name":"proj","source":"/p","read_only":true,"hide":[".env"]}"#)
                .unwrap();
        assert_eq!(
            add,
            FsdRequest::Add {
                name: "proj".into(),
                source: "/p".into(),
                read_only: true,
                protect_git: false,
                hide: vec![".env".into()],
                identity: None,
            }
        );
        assert!(serde_json::from_str::<FsdRequest>(r#"{"op":"remove","name":"p","x":1}"#).is_err());
        assert_eq!(serde_json::to_string(&FsdReply::Ready).unwrap(), r#"{"reply":"ready"}"#);
        let shared = FsdReply::Shared { identity: FolderIdentity { dev: 1, ino: 2 } };
        let line = serde_json::to_string(&shared).unwrap();
        assert_eq!(line, r#"{"reply":"shared","identity":{"dev":1,"ino":2}}"#);
        assert_eq!(serde_json::from_str::<FsdReply>(&line).unwrap(), shared);
        let e: FsdReply = serde_json::from_str(r#"{"reply":"error","error":"why"}"#).unwrap();
        assert_eq!(e, FsdReply::Error { error: "why".into() });
    }
}
