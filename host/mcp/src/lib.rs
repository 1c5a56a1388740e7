//! Umbra's sessions for agents that speak the Model Context Protocol (`docs/mcp.md`): the
//! server ([`server`]), served on stdio by `vmctl mcp` and on streamable HTTP by umbrad
//! ([`http`]).

pub mod http;
pub mod server;
