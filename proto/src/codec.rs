//! Byte stream ⇄ frames, as a `tokio_util` codec so both peers can wrap any async stream.
//!
//! Decoding is incremental and strictly bounded: a header is validated before any body byte is
//! buffered, so an oversized or garbage length is rejected after 12 bytes, and the buffer never
//! grows beyond one maximal frame.

use bytes::{Buf, BytesMut};
use tokio_util::codec::{Decoder, Encoder};

use crate::frame::{Frame, FrameHeader, HeaderError, HEADER_LEN, MAX_BODY_LEN};

/// Why a byte stream could not be decoded. Any of these ends the connection: after a bad
/// header the stream position of the next frame is unknown.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error(transparent)]
    Header(#[from] HeaderError),
    #[error("stream ended in the middle of a frame ({buffered} bytes buffered)")]
    Truncated { buffered: usize },
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
}

/// Why a frame could not be encoded.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    #[error("frame body of {len} bytes exceeds the {max}-byte limit")]
    TooLarge { len: usize, max: usize },
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
}

/// The Umbra frame codec.
#[derive(Debug, Default)]
pub struct FrameCodec {
    /// Header of the frame whose body is still arriving.
    pending: Option<FrameHeader>,
}

impl FrameCodec {
    pub fn new() -> Self {
        Self::default()
    }
}

impl Decoder for FrameCodec {
    type Item = Frame;
    type Error = DecodeError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, DecodeError> {
        let header = match self.pending {
            Some(h) => h,
            None => {
                let Some(raw) = src.get(..HEADER_LEN) else {
                    return Ok(None);
                };
                let raw: &[u8; HEADER_LEN] = raw.try_into().expect("slice has HEADER_LEN bytes");
                let h = FrameHeader::parse(raw)?;
                src.advance(HEADER_LEN);
                self.pending = Some(h);
                h
            }
        };
        let len = header.len as usize;
        if src.len() < len {
            // Bounded by the header check: len <= MAX_BODY_LEN.
            src.reserve(len - src.len());
            return Ok(None);
        }
        self.pending = None;
        let body = src.split_to(len).freeze();
        Ok(Some(Frame { kind: header.kind, channel: header.channel, id: header.id, body }))
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, DecodeError> {
        match self.decode(src)? {
            Some(frame) => Ok(Some(frame)),
            None if src.is_empty() && self.pending.is_none() => Ok(None),
            None => Err(DecodeError::Truncated { buffered: src.len() + self.pending.map_or(0, |_| HEADER_LEN) }),
        }
    }
}

impl Encoder<Frame> for FrameCodec {
    type Error = EncodeError;

    fn encode(&mut self, frame: Frame, dst: &mut BytesMut) -> Result<(), EncodeError> {
        if frame.body.len() > MAX_BODY_LEN {
            return Err(EncodeError::TooLarge { len: frame.body.len(), max: MAX_BODY_LEN });
        }
        frame.encode_into(dst);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{Channel, FrameKind, MAGIC};
    use proptest::prelude::*;

    fn encode(frames: &[Frame]) -> BytesMut {
        let mut buf = BytesMut::new();
        for f in frames {
            FrameCodec::new().encode(f.clone(), &mut buf).unwrap();
        }
        buf
    }

    fn decode_all(mut buf: BytesMut) -> Result<Vec<Frame>, DecodeError> {
        let mut codec = FrameCodec::new();
        let mut out = Vec::new();
        while let Some(f) = codec.decode_eof(&mut buf)? {
            out.push(f);
        }
        Ok(out)
    }

    fn header(kind: u8, channel: u8, id: u32, len: u32) -> Vec<u8> {
        let mut v = MAGIC.to_vec();
        v.extend([kind, channel]);
        v.extend(id.to_le_bytes());
        v.extend(len.to_le_bytes());
        v
    }

    #[test]
    fn oversized_length_is_rejected_before_buffering_the_body() {
        let mut buf = BytesMut::from(&header(2, 0, 1, u32::MAX)[..]);
        let err = FrameCodec::new().decode(&mut buf).unwrap_err();
        assert!(matches!(err, DecodeError::Header(HeaderError::TooLarge { len: u32::MAX, .. })), "{err}");
        assert!(buf.capacity() < 1024, "decoder must not reserve the claimed length");
    }

    #[test]
    fn truncated_frame_is_an_error_at_eof() {
        let mut bytes = encode(&[Frame::new(FrameKind::Request, 1, &b"{\"method\":\"ping\"}"[..])]);
        bytes.truncate(bytes.len() - 3);
        let err = decode_all(bytes).unwrap_err();
        assert!(matches!(err, DecodeError::Truncated { .. }), "{err}");
        // A partial header is truncation too.
        let err = decode_all(BytesMut::from(&MAGIC[..])).unwrap_err();
        assert!(matches!(err, DecodeError::Truncated { buffered: 2 }), "{err}");
    }

    #[test]
    fn unknown_kind_bad_magic_and_bad_channel_are_rejected() {
        let err = decode_all(BytesMut::from(&header(99, 0, 1, 0)[..])).unwrap_err();
        assert!(matches!(err, DecodeError::Header(HeaderError::UnknownKind(99))), "{err}");
        let mut bad_magic = header(2, 0, 1, 0);
        bad_magic[0] = b'X';
        let err = decode_all(BytesMut::from(&bad_magic[..])).unwrap_err();
        assert!(matches!(err, DecodeError::Header(HeaderError::BadMagic(_))), "{err}");
        // Data needs a channel; a Request must not have one; channel 9 does not exist.
        for (kind, ch) in [(5, 0), (2, 1), (5, 9)] {
            let err = decode_all(BytesMut::from(&header(kind, ch, 1, 0)[..])).unwrap_err();
            assert!(matches!(err, DecodeError::Header(HeaderError::BadChannel { .. })), "{err}");
        }
    }

    #[test]
    fn oversized_frames_are_not_encoded() {
        let f = Frame::new(FrameKind::Response, 1, vec![0u8; MAX_BODY_LEN + 1]);
        let err = FrameCodec::new().encode(f, &mut BytesMut::new()).unwrap_err();
        assert!(matches!(err, EncodeError::TooLarge { .. }));
    }

    fn arb_frame() -> impl Strategy<Value = Frame> {
        let kind = prop_oneof![
            Just(FrameKind::Hello),
            Just(FrameKind::Request),
            Just(FrameKind::Response),
            Just(FrameKind::Event),
            Just(FrameKind::Error),
        ];
        let control = (kind, any::<u32>(), proptest::collection::vec(any::<u8>(), 0..512))
            .prop_map(|(k, id, body)| Frame::new(k, id, body));
        let ch = prop_oneof![Just(Channel::Stdin), Just(Channel::Stdout), Just(Channel::Stderr)];
        let data = (ch.clone(), any::<u32>(), proptest::collection::vec(any::<u8>(), 0..4096))
            .prop_map(|(c, id, body)| Frame::data(id, c, body));
        let credit = (ch, any::<u32>(), any::<u32>()).prop_map(|(c, id, n)| Frame::credit(id, c, n));
        prop_oneof![control, data, credit]
    }

    proptest! {
        #[test]
        fn frames_round_trip_across_arbitrary_read_boundaries(
            frames in proptest::collection::vec(arb_frame(), 0..16),
            cut in proptest::collection::vec(1usize..64, 1..32),
        ) {
            let bytes = encode(&frames);
            // Feed the decoder in irregular pieces, as a socket would.
            let mut codec = FrameCodec::new();
            let mut buf = BytesMut::new();
            let mut out = Vec::new();
            let mut pos = 0;
            let mut i = 0;
            while pos < bytes.len() {
                let n = cut[i % cut.len()].min(bytes.len() - pos);
                buf.extend_from_slice(&bytes[pos..pos + n]);
                pos += n;
                i += 1;
                while let Some(f) = codec.decode(&mut buf).unwrap() {
                    out.push(f);
                }
            }
            prop_assert!(codec.decode_eof(&mut buf).unwrap().is_none());
            prop_assert_eq!(out, frames);
        }

        #[test]
        fn random_bytes_never_panic_and_stay_bounded(bytes in proptest::collection::vec(any::<u8>(), 0..8192)) {
            let mut buf = BytesMut::from(&bytes[..]);
            let mut codec = FrameCodec::new();
            while let Ok(Some(f)) = codec.decode_eof(&mut buf) {
                prop_assert!(f.body.len() <= MAX_BODY_LEN);
            }
            prop_assert!(buf.capacity() <= MAX_BODY_LEN + 8192 + HEADER_LEN);
        }
    }
}
