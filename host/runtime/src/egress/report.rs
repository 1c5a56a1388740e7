//! Where the egress proxy's decisions go.

/// The session's event bus, as the proxy and the connections it reads report to it.
pub type Report = std::sync::Arc<dyn Fn(umbra_api::EventKind) + Send + Sync>;
