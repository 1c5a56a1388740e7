//! Hostile bytes from the host side: each case gets an Error frame or a closed connection, and
//! the agent keeps serving other connections.

use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio_util::codec::Framed;
use umbra_proto::{
    json_frame, parse_body, ErrorBody, ErrorCode, Frame, FrameCodec, FrameKind, Hello, ProtocolVersion, Request,
    SpawnRequest, PROTOCOL_VERSION,
};
use umbra_tests::HostAgent;

fn hello(protocol: ProtocolVersion) -> Frame {
    let h = Hello { protocol, software: "test".into(), hostname: None, pid1: false, capabilities: vec![] };
    json_frame(FrameKind::Hello, 0, &h)
}

/// A raw connection that has completed the handshake.
async fn raw(agent: &HostAgent) -> Framed<UnixStream, FrameCodec> {
    let mut f = Framed::new(UnixStream::connect(&agent.socket).await.unwrap(), FrameCodec::new());
    f.send(hello(PROTOCOL_VERSION)).await.unwrap();
    let reply = f.next().await.unwrap().unwrap();
    assert_eq!(reply.kind, FrameKind::Hello);
    f
}

/// Reads frames until an Error frame (returned) or the connection closes (None).
async fn next_error(f: &mut Framed<UnixStream, FrameCodec>) -> Option<ErrorBody> {
    loop {
        match tokio::time::timeout(Duration::from_secs(5), f.next()).await.expect("agent answered or closed") {
            Some(Ok(frame)) if frame.kind == FrameKind::Error => return Some(parse_body(&frame.body).unwrap().0),
            Some(Ok(_)) => continue,
            Some(Err(_)) | None => return None,
        }
    }
}

/// Writes raw bytes after the handshake; returns the Error frame, if any, and whether the
/// connection was closed afterwards.
async fn send_raw(agent: &HostAgent, bytes: &[u8], then_eof: bool) -> (Option<ErrorBody>, bool) {
    let f = raw(agent).await;
    let mut stream = f.into_inner();
    stream.write_all(bytes).await.unwrap();
    if then_eof {
        stream.shutdown().await.unwrap();
    }
    let mut f = Framed::new(stream, FrameCodec::new());
    let err = next_error(&mut f).await;
    let closed = tokio::time::timeout(Duration::from_secs(5), f.next()).await.map(|n| n.is_none()).unwrap_or(false);
    (err, closed)
}

async fn still_serving(agent: &HostAgent) {
    let client = agent.connect().await;
    client.ping().await.expect("agent still answers pings on a new connection");
    let out = client
        .spawn(SpawnRequest { argv: vec!["echo".into(), "ok".into()], ..Default::default() })
        .unwrap()
        .output()
        .await
        .unwrap();
    assert_eq!(out.stdout, b"ok\n");
}

#[tokio::test]
async fn random_bytes_close_the_connection_with_an_error() {
    let agent = HostAgent::start().await;
    // Deterministic pseudo-random garbage (xorshift), several seeds.
    for seed in [1u64, 42, 0xdead_beef] {
        let mut x = seed;
        let garbage: Vec<u8> = (0..4096)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let (err, closed) = send_raw(&agent, &garbage, false).await;
        assert_eq!(err.map(|e| e.code), Some(ErrorCode::Protocol));
        assert!(closed);
    }
    // Garbage instead of a Hello.
    let mut s = UnixStream::connect(&agent.socket).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await.unwrap().unwrap();
    still_serving(&agent).await;
}

#[tokio::test]
async fn oversized_length_is_refused_without_reading_the_body() {
    let agent = HostAgent::start().await;
    let mut header = b"UM".to_vec();
    header.extend([FrameKind::Request as u8, 0]);
    header.extend(7u32.to_le_bytes());
    header.extend(u32::MAX.to_le_bytes());
    let (err, closed) = send_raw(&agent, &header, false).await;
    let err = err.expect("error frame");
    assert!(err.message.contains("exceeds"), "{}", err.message);
    assert!(closed);
    still_serving(&agent).await;
}

#[tokio::test]
async fn truncated_frame_is_an_error() {
    let agent = HostAgent::start().await;
    let mut buf = bytes::BytesMut::new();
    json_frame(FrameKind::Request, 5, &Request::Ping).encode_into(&mut buf);
    buf.truncate(buf.len() - 4);
    let (err, closed) = send_raw(&agent, &buf, true).await;
    assert!(err.expect("error frame").message.contains("ended in the middle of a frame"));
    assert!(closed);
    still_serving(&agent).await;
}

#[tokio::test]
async fn unknown_kind_and_unknown_method_get_errors() {
    let agent = HostAgent::start().await;
    let mut header = b"UM".to_vec();
    header.extend([0x42, 0]);
    header.extend(1u32.to_le_bytes());
    header.extend(0u32.to_le_bytes());
    let (err, _) = send_raw(&agent, &header, false).await;
    assert!(err.expect("error frame").message.contains("unknown frame kind 66"));

    // A well-framed request for a method that does not exist: an error response, and the
    // connection goes on.
    let mut f = raw(&agent).await;
    f.send(Frame::new(FrameKind::Request, 9, Bytes::from_static(br#"{"method":"format_disk"}"#))).await.unwrap();
    let reply = f.next().await.unwrap().unwrap();
    assert_eq!((reply.kind, reply.id), (FrameKind::Response, 9));
    let (resp, _): (umbra_proto::Response, _) = parse_body(&reply.body).unwrap();
    assert!(matches!(resp, umbra_proto::Response::Error(ErrorBody { code: ErrorCode::BadRequest, .. })), "{resp:?}");
    f.send(json_frame(FrameKind::Request, 10, &Request::Ping)).await.unwrap();
    let reply = f.next().await.unwrap().unwrap();
    assert_eq!((reply.kind, reply.id), (FrameKind::Response, 10));
    still_serving(&agent).await;
}

#[tokio::test]
async fn duplicate_request_id_gets_an_error_frame() {
    let agent = HostAgent::start().await;
    let mut f = raw(&agent).await;
    let spawn = Request::Spawn(SpawnRequest { argv: vec!["sleep".into(), "5".into()], ..Default::default() });
    f.send(json_frame(FrameKind::Request, 77, &spawn)).await.unwrap();
    let reply = f.next().await.unwrap().unwrap();
    assert_eq!((reply.kind, reply.id), (FrameKind::Response, 77));
    // Id 77 is now a live process: reusing it is refused, the process is untouched.
    f.send(json_frame(FrameKind::Request, 77, &Request::Ping)).await.unwrap();
    let reply = f.next().await.unwrap().unwrap();
    assert_eq!((reply.kind, reply.id), (FrameKind::Error, 77));
    let (err, _): (ErrorBody, _) = parse_body(&reply.body).unwrap();
    assert_eq!(err.code, ErrorCode::DuplicateId);
    f.send(json_frame(FrameKind::Request, 78, &Request::Kill { process: 77, signal: 9 })).await.unwrap();
    let mut exit_seen = false;
    while let Some(Ok(frame)) = f.next().await {
        if frame.kind == FrameKind::Event && frame.id == 77 {
            exit_seen = true;
            break;
        }
    }
    assert!(exit_seen, "the process with the duplicated id still reports its exit");
    still_serving(&agent).await;
}

#[tokio::test]
async fn incompatible_version_and_missing_hello_are_refused() {
    let agent = HostAgent::start().await;
    let mut f = Framed::new(UnixStream::connect(&agent.socket).await.unwrap(), FrameCodec::new());
    f.send(hello(ProtocolVersion { major: PROTOCOL_VERSION.major + 1, minor: 0 })).await.unwrap();
    let err = next_error(&mut f).await.expect("error frame");
    assert_eq!(err.code, ErrorCode::IncompatibleVersion);
    assert!(f.next().await.is_none(), "closed after refusing");

    let mut f = Framed::new(UnixStream::connect(&agent.socket).await.unwrap(), FrameCodec::new());
    f.send(json_frame(FrameKind::Request, 1, &Request::Ping)).await.unwrap();
    assert!(next_error(&mut f).await.expect("error frame").message.contains("expected Hello"));

    // Stdin beyond the granted credit is a protocol violation. `sleep` never reads, so past the
    // initial window plus one pipe buffer no credit comes back.
    let mut f = raw(&agent).await;
    let cat = Request::Spawn(SpawnRequest { argv: vec!["sleep".into(), "5".into()], ..Default::default() });
    f.send(json_frame(FrameKind::Request, 3, &cat)).await.unwrap();
    f.next().await.unwrap().unwrap();
    for _ in 0..16 {
        // The agent closes the connection once the credit is exceeded; later sends may fail.
        if f.send(Frame::data(3, umbra_proto::Channel::Stdin, vec![0u8; 64 * 1024])).await.is_err() {
            break;
        }
    }
    assert!(next_error(&mut f).await.expect("error frame").message.contains("credit"));
    still_serving(&agent).await;
}

#[tokio::test]
async fn stdin_data_above_the_chunk_limit_is_a_protocol_error() {
    let agent = HostAgent::start().await;
    let mut f = raw(&agent).await;
    let cat = Request::Spawn(SpawnRequest { argv: vec!["cat".into()], ..Default::default() });
    f.send(json_frame(FrameKind::Request, 3, &cat)).await.unwrap();
    f.next().await.unwrap().unwrap();
    // Within the 256 KiB credit, but one frame may carry at most 64 KiB.
    f.send(Frame::data(3, umbra_proto::Channel::Stdin, vec![b'x'; umbra_proto::MAX_DATA_CHUNK + 1])).await.unwrap();
    let err = next_error(&mut f).await.expect("error frame");
    assert!(err.message.contains("exceeds the 65536-byte limit"), "{}", err.message);
    // Then the connection closes (after cat's exit, which its teardown caused).
    while let Some(frame) = tokio::time::timeout(Duration::from_secs(5), f.next()).await.expect("closed") {
        assert_eq!(frame.unwrap().kind, FrameKind::Event);
    }
    still_serving(&agent).await;
}

#[tokio::test]
async fn huge_inputs_echoed_in_errors_still_get_an_answer() {
    let agent = HostAgent::start().await;
    let client = agent.connect().await.with_call_timeout(Duration::from_secs(20));
    // Tabs: 2 bytes each in the request's JSON, 3 once quoted in a message and re-encoded, so an
    // error echoing the whole path would not fit in a frame.
    let path = format!("/{}", "\t".repeat(1_000_000));
    let e = client.stat(&path).await.unwrap_err();
    let e = e.agent_error().unwrap_or_else(|| panic!("an answer from the agent, got {e}"));
    assert!(e.message.len() < 4096 && e.message.contains("1000001 bytes"), "{}", e.message);

    // An unknown method of 1 MiB: serde's error names it.
    let mut f = raw(&agent).await;
    let body = format!("{{\"method\":\"{}\"}}", "\\t".repeat(1_048_500));
    f.send(Frame::new(FrameKind::Request, 9, body)).await.unwrap();
    let reply = tokio::time::timeout(Duration::from_secs(10), f.next()).await.expect("an answer").unwrap().unwrap();
    assert_eq!((reply.kind, reply.id), (FrameKind::Response, 9));
    let (resp, _): (umbra_proto::Response, _) = parse_body(&reply.body).unwrap();
    assert!(matches!(resp, umbra_proto::Response::Error(ErrorBody { code: ErrorCode::BadRequest, .. })), "{resp:?}");
    // Messages are clipped to 4 KiB (tabs then take 2 bytes each in JSON).
    assert!(reply.body.len() < 16 * 1024, "{} bytes", reply.body.len());
    still_serving(&agent).await;
}

#[tokio::test]
async fn running_out_of_file_descriptors_does_not_stop_the_agent() {
    let mut agent = HostAgent::start_with_fd_limit(48).await;
    // More connections than the agent has fds: accept fails with EMFILE for the rest.
    let mut conns = Vec::new();
    for _ in 0..80 {
        conns.push(UnixStream::connect(&agent.socket).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(agent.child.try_wait().unwrap().is_none(), "the agent survives failed accepts");
    drop(conns);
    tokio::time::timeout(Duration::from_secs(10), still_serving(&agent)).await.expect("served again once fds free up");
}

#[tokio::test]
async fn a_host_that_pipelines_file_reads_without_reading_keeps_the_agent_bounded() {
    let agent = HostAgent::start().await;
    let dir = umbra_tests::TempDir::new("pipelined");
    let path = dir.0.join("mib");
    std::fs::write(&path, vec![7u8; umbra_proto::MAX_FILE_CHUNK]).unwrap();
    let mut f = raw(&agent).await;
    const REQUESTS: u32 = 400;
    for id in 1..=REQUESTS {
        let req = Request::ReadFile { path: path.display().to_string(), offset: 0, len: 1 << 20 };
        f.feed(json_frame(FrameKind::Request, id, &req)).await.unwrap();
    }
    f.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let rss = umbra_tests::rss_kib(agent.pid());
    // Unbounded, every request would hold its MiB until the host reads (400 MiB here).
    assert!(rss < 200 * 1024, "agent RSS {rss} KiB with {REQUESTS} reads of 1 MiB pipelined");
    let mut answered = 0;
    while answered < REQUESTS {
        let reply = tokio::time::timeout(Duration::from_secs(10), f.next()).await.unwrap().unwrap().unwrap();
        assert_eq!(reply.kind, FrameKind::Response);
        assert_eq!(
            reply.body.len(),
            umbra_proto::MAX_FILE_CHUNK + r#"{"ok":{"type":"file_data","len":1048576,"eof":true}}"#.len() + 1
        );
        answered += 1;
    }
}
