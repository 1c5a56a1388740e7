//! Sessions: the spine that `vmctl`, `umbrad` and the tests all drive.
//!
//! A [`Session`] is one VM (booted again when it fails) with its folders, its processes, its
//! writable disk and its settings; a [`SessionManager`] owns many, by name. Everything that
//! happens is one typed [`umbra_api::SessionEvent`]: lifecycle events on a bus every
//! subscriber reads ([`EventBus`]), process output only to the process's owner ([`Exec`]).
//! Errors carry stable codes ([`SessionError::code`]).
//!
//! - [`manager`]: the registry; start (a second start of a starting session waits for the
//!   first), resume, stop, delete; records reloaded as `stopped` after a restart.
//! - [`instance`]: one session's state machine, supervisor (heartbeat, liveness, idle stop)
//!   and restart with back-off; its process, folder, file and shadow operations.
//! - [`incarnation`]: one VM of a session, from boot to teardown.
//! - [`launch`]: the one launch pipeline (bundle, backend, size; a boot slot, the disk, boot or
//!   restore) under a session's boot, its restore and the warm pool.
//! - [`exec`]: a process's lifecycle (flow-controlled output, timeout and signal escalation,
//!   an exit that always comes).
//! - [`admission`]: at most N boots at once, the rest queued in order.
//! - [`pool`]: VMs booted ahead of the starts that take them.
//! - [`snapshot`]: a session paused into its storage, resumed or forked from there.
//! - [`approval`]: the gate a spawn passes when the session has approval settings.
//! - [`ports`]: host listeners whose connections reach a port of the session's guest.
//! - [`events`], [`store`], [`outputs`]: the bus and event logs, the session records, the
//!   outputs-folder watcher.

pub mod admission;
pub mod approval;
mod context;
pub mod error;
pub mod events;
pub mod exec;
mod incarnation;
pub mod instance;
pub mod kept;
mod launch;
pub mod lsp;
pub mod manager;
pub mod outputs;
mod pool;
pub mod ports;
mod snapshot;
pub mod store;

pub use error::SessionError;
pub use events::EventBus;
pub use exec::{Exec, ExecControl, ExecOutput, ExecRequest, KILL_GRACE};
pub use incarnation::DISK_FILE;
pub use instance::{Session, SettingsChange, StopReason};
pub use kept::{Kept, KeptEvent, KeptReader, TerminalRequest};
pub use manager::{ManagerOptions, SessionManager};
