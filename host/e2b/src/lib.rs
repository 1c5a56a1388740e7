//! The E2B API in front of Umbra's sessions (`umbrad --e2b-listen`): the sandbox REST API and
//! envd's process and filesystem services, so the unmodified `e2b` SDKs run their sandboxes
//! as Umbra microVMs. A client of umbrad's own socket like any other: no logic of its own
//! beyond the mapping (docs/e2b.md).

pub mod connect;
pub mod fs;
pub mod http;
pub mod process;
pub mod records;
pub mod sandboxes;
pub mod wire;
