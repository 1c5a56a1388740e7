//! What a connection's writer sends, and the queue to it.

use bytes::Bytes;
use tokio::sync::mpsc;
use umbra_proto::Frame;

/// What the connection's writer sends.
pub enum Outgoing {
    /// A frame to encode.
    Frame(Frame),
    /// A Data frame already encoded in place: its header, then the bytes read from the child
    /// straight behind it, so it goes to the socket without a copy.
    Encoded(Bytes),
}

impl From<Frame> for Outgoing {
    fn from(frame: Frame) -> Self {
        Self::Frame(frame)
    }
}

/// Where frames for the host go; bounded, so a host that stops reading stalls producers.
pub type FrameSink = mpsc::Sender<Outgoing>;
