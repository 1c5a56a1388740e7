//! umbra-api: the contract between `umbrad` and its clients.
//!
//! Everything a client and the daemon exchange is defined here once, as Rust types: the JSON-RPC
//! 2.0 envelope ([`rpc`]), each method with its params and result ([`methods`]), the one event
//! type ([`event::SessionEvent`]) that the runtime emits and `vmctl --json`, the IPC and the
//! tests all consume, the session model ([`session`]), the daemon's configuration ([`config`])
//! and stable error codes ([`error`]). [`schema`] turns them into the JSON Schema that
//! `docs/ipc.md` and the TypeScript client are built from; [`typescript`] renders it as that
//! client's types (`host/client-ts/src/generated/types.ts`). The `client` feature adds an async
//! client over the daemon's socket.

pub mod config;
pub mod error;
pub mod event;
pub mod kept;
pub mod lsp;
pub mod methods;
pub mod paths;
pub mod ports;
pub mod python;
pub mod reference;
pub mod rpc;
pub mod schema;
pub mod secrets;
pub mod session;
pub mod system;
pub mod typescript;

/// Checks a generated, checked-in file against what the types generate now; with
/// `UMBRA_UPDATE_SCHEMA` set, rewrites it instead.
#[cfg(test)]
pub(crate) fn assert_generated_current(path: &std::path::Path, fresh: &str) {
    let checked_in = std::fs::read_to_string(path).unwrap_or_default();
    if std::env::var_os("UMBRA_UPDATE_SCHEMA").is_some() {
        if checked_in != fresh {
            std::fs::create_dir_all(path.parent().expect("a file in a directory")).unwrap();
            std::fs::write(path, fresh).unwrap();
        }
        return;
    }
    assert!(
        checked_in == fresh,
        "{} is stale: regenerate it with `UMBRA_UPDATE_SCHEMA=1 cargo test -p umbra-api` and commit it",
        path.display()
    );
}

#[cfg(feature = "client")]
pub mod client;

pub use config::{ConfigPatch, DaemonConfig};
pub use error::{ApiError, ErrorCode};
pub use event::{Data, Encoding, EventKind, ProcessExit, SessionEvent};
pub use session::{
    BackendChoice, FolderInfo, FolderSpec, IdleAction, SessionInfo, SessionSettings, SessionStatus, VmInfo,
};

/// The IPC contract's version: a new minor adds methods, fields or events; a new major breaks.
pub const API_VERSION: &str = "1.11";
