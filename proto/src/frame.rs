//! Frame layout: a fixed header, then `len` body bytes.
//!
//! ```text
//! offset  size  field
//!      0     2  magic    0x55 0x4D ("UM")
//!      2     1  kind     FrameKind
//!      3     1  channel  Channel (0 unless kind is Data or Credit)
//!      4     4  id       u32 LE: request id, or process id for process-scoped frames
//!      8     4  len      u32 LE: body length, at most MAX_BODY_LEN
//! ```
//!
//! The header is explicit little-endian bytes rather than a `repr(C)` struct so that decoding
//! is a bounds-checked parse on any host, with no alignment or endianness assumptions.

use bytes::{BufMut, Bytes, BytesMut};

/// Header size in bytes.
pub const HEADER_LEN: usize = 12;
/// Frame magic, "UM".
pub const MAGIC: [u8; 2] = *b"UM";
/// Largest body a peer may send. Bounds every allocation the decoder makes.
pub const MAX_BODY_LEN: usize = 2 * 1024 * 1024;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// Handshake, JSON [`crate::Hello`]; first frame in each direction.
    Hello = 1,
    /// JSON [`crate::Request`], `id` = request id chosen by the host.
    Request = 2,
    /// JSON [`crate::Response`] to the request with the same `id`, plus an optional raw attachment.
    Response = 3,
    /// JSON [`crate::Event`] about process `id`.
    Event = 4,
    /// Raw stdio bytes of process `id` on `channel`.
    Data = 5,
    /// Flow-control grant: body is a u32 LE byte count for process `id`'s `channel`.
    Credit = 6,
    /// JSON [`crate::ErrorBody`]: a protocol error about frame `id` (0 = the connection).
    Error = 7,
}

impl FrameKind {
    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::Hello,
            2 => Self::Request,
            3 => Self::Response,
            4 => Self::Event,
            5 => Self::Data,
            6 => Self::Credit,
            7 => Self::Error,
            _ => return None,
        })
    }
}

/// Which stdio stream a Data or Credit frame belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[repr(u8)]
pub enum Channel {
    None = 0,
    Stdin = 1,
    Stdout = 2,
    Stderr = 3,
}

impl Channel {
    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => Self::None,
            1 => Self::Stdin,
            2 => Self::Stdout,
            3 => Self::Stderr,
            _ => return None,
        })
    }
}

/// A decoded header. Construction through [`FrameHeader::parse`] guarantees a valid kind,
/// channel and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: FrameKind,
    pub channel: Channel,
    pub id: u32,
    pub len: u32,
}

/// Why a header is invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("bad frame magic {0:02x?} (expected \"UM\"): the peer is not speaking the Umbra protocol or the stream lost sync")]
    BadMagic([u8; 2]),
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("unknown channel {channel} on a {kind:?} frame")]
    BadChannel { kind: FrameKind, channel: u8 },
    #[error("frame body of {len} bytes exceeds the {max}-byte limit")]
    TooLarge { len: u32, max: usize },
}

impl FrameHeader {
    /// Parses exactly [`HEADER_LEN`] bytes.
    pub fn parse(b: &[u8; HEADER_LEN]) -> Result<Self, HeaderError> {
        if b[0..2] != MAGIC {
            return Err(HeaderError::BadMagic([b[0], b[1]]));
        }
        let kind = FrameKind::from_u8(b[2]).ok_or(HeaderError::UnknownKind(b[2]))?;
        let channel = Channel::from_u8(b[3]).ok_or(HeaderError::BadChannel { kind, channel: b[3] })?;
        let stdio = matches!(kind, FrameKind::Data | FrameKind::Credit);
        if stdio == (channel == Channel::None) {
            return Err(HeaderError::BadChannel { kind, channel: b[3] });
        }
        let id = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let len = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
        if len as usize > MAX_BODY_LEN {
            return Err(HeaderError::TooLarge { len, max: MAX_BODY_LEN });
        }
        Ok(Self { kind, channel, id, len })
    }

    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..2].copy_from_slice(&MAGIC);
        b[2] = self.kind as u8;
        b[3] = self.channel as u8;
        b[4..8].copy_from_slice(&self.id.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b
    }
}

/// One frame: header fields plus the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: FrameKind,
    pub channel: Channel,
    pub id: u32,
    pub body: Bytes,
}

impl Frame {
    pub fn new(kind: FrameKind, id: u32, body: impl Into<Bytes>) -> Self {
        Self { kind, channel: Channel::None, id, body: body.into() }
    }

    /// A raw stdio frame.
    pub fn data(id: u32, channel: Channel, body: impl Into<Bytes>) -> Self {
        Self { kind: FrameKind::Data, channel, id, body: body.into() }
    }

    /// A flow-control grant of `bytes` on `channel` of process `id`.
    pub fn credit(id: u32, channel: Channel, bytes: u32) -> Self {
        Self { kind: FrameKind::Credit, channel, id, body: Bytes::copy_from_slice(&bytes.to_le_bytes()) }
    }

    /// The byte count of a Credit frame, if the body is exactly 4 bytes.
    pub fn credit_bytes(&self) -> Option<u32> {
        let b: [u8; 4] = self.body.as_ref().try_into().ok()?;
        Some(u32::from_le_bytes(b))
    }

    pub fn header(&self) -> FrameHeader {
        FrameHeader { kind: self.kind, channel: self.channel, id: self.id, len: self.body.len() as u32 }
    }

    /// Appends the encoded frame to `dst`. Bodies above [`MAX_BODY_LEN`] are a caller bug
    /// (the encoder checks before calling this).
    pub fn encode_into(&self, dst: &mut BytesMut) {
        dst.reserve(HEADER_LEN + self.body.len());
        dst.put_slice(&self.header().to_bytes());
        dst.put_slice(&self.body);
    }
}
