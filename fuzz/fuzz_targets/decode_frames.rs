//! Feeds arbitrary bytes to the frame decoder in arbitrary-sized pieces, then every decoded
//! control body to the message parsers — everything the agent does with host bytes before
//! acting on them (and the host with a hostile guest's) — and the same bytes as the egress
//! header line the host's proxy reads from the guest. Must never panic, hang, or allocate
//! beyond one maximal frame.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use tokio_util::codec::Decoder;
use umbra_proto::{parse_body, ErrorBody, Event, FrameCodec, FrameKind, Hello, Request, Response, MAX_BODY_LEN};

fuzz_target!(|data: &[u8]| {
    let _ = umbra_proto::egress::EgressRequest::parse(data);
    // First byte picks the read size, so boundaries between socket reads are fuzzed too.
    let Some((&step, data)) = data.split_first() else { return };
    let step = (step as usize % 64) + 1;
    let mut codec = FrameCodec::new();
    let mut buf = BytesMut::new();
    for piece in data.chunks(step) {
        buf.extend_from_slice(piece);
        loop {
            match codec.decode(&mut buf) {
                Ok(Some(frame)) => {
                    assert!(frame.body.len() <= MAX_BODY_LEN);
                    match frame.kind {
                        FrameKind::Hello => drop(parse_body::<Hello>(&frame.body)),
                        FrameKind::Request => drop(parse_body::<Request>(&frame.body)),
                        FrameKind::Response => drop(parse_body::<Response>(&frame.body)),
                        FrameKind::Event => drop(parse_body::<Event>(&frame.body)),
                        FrameKind::Error => drop(parse_body::<ErrorBody>(&frame.body)),
                        FrameKind::Credit => drop(frame.credit_bytes()),
                        FrameKind::Data => {}
                    }
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
    let _ = codec.decode_eof(&mut buf);
});
