//! virtio-vsock in userspace, with Firecracker's *hybrid vsock* host side: guest AF_VSOCK
//! stream sockets appear on the host as Unix stream sockets.
//!
//! - Host → guest: a host process connects to `uds_path` and writes `CONNECT <port>\n`; the
//!   device asks the guest for a connection to that port and, once the guest accepts, answers
//!   `OK <host port>\n` on the Unix stream, which from then on carries the connection's bytes.
//!   If nothing listens in the guest the Unix stream is simply closed.
//! - Guest → host: a guest connection to CID 2 port P is connected to the Unix socket
//!   `<uds_path>_<P>`, or refused (RST) if nobody listens there.
//!
//! Layout (Firecracker's vsock folder, smaller): [`packet`] is the only code that reads or writes
//! guest buffers; [`connection`] is the per-connection state machine and flow control;
//! [`muxer`] routes packets, schedules rx and owns every host socket; [`unix_backend`] is the
//! Unix socket side (the CONNECT line, non-blocking connect and send); [`device`] is the
//! `VirtioDevice`; `worker` is the thread's epoll wiring (on the shared
//! [`crate::devices::epoll_helper`]) and nothing else.
//!
//! Everything the guest writes is hostile: headers and lengths are checked before use, every
//! limit (connections, buffered bytes, queued replies, time) is fixed, and malformed input
//! costs the guest that packet or that connection — never a panic, a hang, or unbounded memory.

pub mod connection;
pub mod device;
pub mod muxer;
pub mod packet;
pub mod unix_backend;
pub(crate) mod worker;

#[cfg(test)]
mod test_utils;
#[cfg(test)]
mod tests;

pub use device::Vsock;

/// The device's queues, in the order the virtio spec gives them (5.10.2): the device and its
/// worker thread both index by these.
pub const RX_QUEUE: usize = 0;
pub const TX_QUEUE: usize = 1;
pub const EVENT_QUEUE: usize = 2;
pub use muxer::{VsockCounters, VsockMuxer};
