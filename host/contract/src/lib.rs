//! The contracts between the Umbra runtime and the helper processes it starts, typed once and
//! used by both ends:
//!
//! - [`vm`]: the VM description `umbra-vmm` reads (`vm.json`);
//! - [`control`]: requests and replies on umbra-vmm's control socket;
//! - [`exit`]: what umbra-vmm's exit status says, in both directions;
//! - [`fsd`]: umbra-fsd's start-up line, requests and replies.
//!
//! Only data lives here (serde types, their defaults and the constants both sides need); each
//! side keeps its own behaviour (umbra-vmm validates a config against what its machine can
//! build; the runtime decides what to ask).

pub mod control;
pub mod exit;
pub mod fsd;
pub mod vm;
