//! Where vmctl keeps things on this host: the runtime's rules.

pub use umbra_runtime::paths::{built_bundles_dir, cache_dir};
