//! Network egress, host side: the guest has no network interface, and every connection it opens
//! arrives here over vsock (`umbra_proto::egress`) to be decided by name, checked by address and
//! carried — or refused, with an event either way (`docs/network.md`).
//!
//! [`policy`] is the decision (pure functions, tested without a packet); [`proxy`] is the
//! per-VM listener that applies it. A session's secrets ([`secrets`]) reach only the hosts they
//! are bound to: [`intercept`] reads those hosts' requests, over TLS made with [`tls`].

pub mod ask;
pub mod intercept;
pub mod policy;
pub mod proxy;
mod report;
pub mod secrets;
pub mod ssh_agent;
pub mod tls;
pub mod upstream_proxy;

pub use ask::{AskGate, Asker, Question};
pub use intercept::Broker;
pub use policy::{HostAddresses, Policy};
pub use proxy::{EgressLimits, EgressProxy, Resolver, SharedPolicy};
pub use report::Report;
pub use secrets::{SecretBinding, Secrets, SharedSecrets};
pub use ssh_agent::{SharedSshKeys, SshKeyBinding, SshKeys};
pub use tls::{SessionCa, TlsError, Upstream};
pub use upstream_proxy::UpstreamProxy;

#[cfg(test)]
mod broker_tests;
