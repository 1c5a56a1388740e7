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
pub mod methods;
pub mod paths;
pub mod reference;
pub mod rpc;
pub mod schema;
pub mod session;
pub mod typescript;

#[cfg(feature = "client")]
pub mod client;

pub use config::{ConfigPatch, DaemonConfig};
pub use error::{ApiError, ErrorCode};
pub use event::{Data, Encoding, EventKind, ProcessExit, SessionEvent};
pub use session::{BackendChoice, FolderInfo, FolderSpec, SessionInfo, SessionSettings, SessionStatus, VmInfo};

/// The IPC contract's version: a new minor adds methods, fields or events; a new major breaks.
pub const API_VERSION: &str = "1.0";
