//! The Umbra host↔guest protocol, shared by the in-guest agent and the host runtime.
//!
//! A connection is a byte stream (vsock in a VM, a Unix socket in host-side tests) carrying
//! frames: a fixed 12-byte header followed by a bounded body ([`frame`]). Control frames carry
//! JSON ([`messages`]); stdio frames carry raw bytes. [`codec::FrameCodec`] turns bytes into
//! frames and rejects anything malformed with a [`codec::DecodeError`] — it never panics and never
//! allocates more than [`frame::MAX_BODY_LEN`] for one frame.
//!
//! This crate holds no I/O policy: who sends what, when, is documented in `docs/protocol.md` and
//! implemented by the agent and the runtime's agent client.

pub mod codec;
pub mod container;
pub mod egress;
pub mod exec_gate;
pub mod forward;
pub mod frame;
pub mod messages;

pub use codec::{DecodeError, FrameCodec};
pub use exec_gate::{ExecGate, CAP_EXEC_GATE};
pub use frame::{Channel, Frame, FrameHeader, FrameKind, HEADER_LEN, MAX_BODY_LEN};
pub use messages::*;

/// The vsock port the agent listens on inside the guest.
pub const AGENT_VSOCK_PORT: u32 = 1024;

/// The host vsock port the agent connects to (and at once closes) once it listens: the runtime
/// starts connecting only then. A host connection that reaches a vhost-user vsock backend while
/// the guest driver is still setting the device up can kill the backend (vhost-device-vsock's
/// worker thread exits when a queue is not ready yet), so the host waits for the guest.
pub const AGENT_READY_VSOCK_PORT: u32 = 1025;

/// The ext4 volume label of a VM's writable session disk (at most 16 bytes). The host formats
/// the disk with this label; the agent finds it by it (never by device order), mounts it and
/// keeps the root overlay's upper and work directories on it.
pub const SESSION_DISK_LABEL: &str = "umbra-session";

/// Protocol version spoken by this build. Peers with a different major refuse each other;
/// a newer minor only adds optional fields and methods.
pub const PROTOCOL_VERSION: ProtocolVersion = ProtocolVersion { major: 1, minor: 9 };

/// Bytes of stdout or stderr the agent may send per stream before the host grants more credit.
pub const INITIAL_OUTPUT_CREDIT: u32 = 1024 * 1024;

/// Bytes of stdin the host may send per process before the agent grants more credit.
pub const INITIAL_STDIN_CREDIT: u32 = 256 * 1024;

/// Largest data payload in one stdio frame. Smaller than [`MAX_BODY_LEN`] so that a data frame
/// never monopolises the connection for long.
pub const MAX_DATA_CHUNK: usize = 64 * 1024;

/// Largest output payload in one Data frame from the agent to a host whose Hello lists
/// [`CAP_LARGE_OUTPUT`] (since 1.4): a quarter of the output credit, so a stream still has
/// frames in flight while the host consumes one. Fewer frames per byte is most of what the
/// output path costs beyond the copies.
pub const LARGE_OUTPUT_CHUNK: usize = INITIAL_OUTPUT_CREDIT as usize / 4;

/// The host capability "I accept output Data frames up to [`LARGE_OUTPUT_CHUNK`]".
pub const CAP_LARGE_OUTPUT: &str = "large-output";

/// Largest file payload moved by one read_file/write_file request.
pub const MAX_FILE_CHUNK: usize = 1024 * 1024;
