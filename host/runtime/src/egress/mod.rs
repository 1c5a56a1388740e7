//! Network egress, host side: the guest has no network interface, and every connection it opens
//! arrives here over vsock (`umbra_proto::egress`) to be decided by name, checked by address and
//! carried — or refused, with an event either way (`docs/network.md`).
//!
//! [`policy`] is the decision (pure functions, tested without a packet); [`proxy`] is the
//! per-VM listener that applies it.

pub mod policy;
pub mod proxy;

pub use policy::{HostAddresses, Policy};
pub use proxy::{EgressLimits, EgressProxy, Report, Resolver, SharedPolicy};
