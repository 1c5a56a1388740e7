//! The JSON-RPC handlers, one module per namespace of methods, as Firecracker keeps one file per
//! API resource (`api_server/request/<resource>.rs`). Each decodes its methods' params, calls
//! the runtime's session layer and encodes the result; `dispatch.rs` picks the module by the
//! method's namespace. The modules share only [`common`]: none imports the router or this file,
//! so the layers stay one-way.

pub mod bundle;
pub mod common;
pub mod daemon;
pub mod events;
pub mod files;
pub mod lsp;
pub mod process;
pub mod session;
pub mod shadow;
