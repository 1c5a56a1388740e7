//! The client against a scripted agent: a hostile or broken guest must end the connection with a
//! cause, never grow the host's memory, panic, or leave a caller waiting forever.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncWrite, AsyncWriteExt, DuplexStream};
use tokio_util::codec::Framed;
use umbra_proto::{
    json_frame, parse_body, Channel, Event, Frame, FrameCodec, FrameKind, Hello, Request, Response, ResponseBody,
    SpawnRequest, WriteFileRequest, WriteMode, MAX_BODY_LEN, MAX_DATA_CHUNK, MAX_FILE_CHUNK, PROTOCOL_VERSION,
};

use super::{AgentClient, ClientError, Process, ProcessEvent};

type FakeAgent = Framed<DuplexStream, FrameCodec>;

const PATIENCE: Duration = Duration::from_secs(5);

/// Completes the handshake over `stream`, playing the agent on `agent`.
async fn handshake<S>(stream: S, agent: &mut FakeAgent) -> AgentClient
where
    S: tokio::io::AsyncRead + AsyncWrite + Send + 'static,
{
    let play = async {
        let hello = agent.next().await.unwrap().unwrap();
        assert_eq!(hello.kind, FrameKind::Hello);
        let (theirs, _): (Hello, _) = umbra_proto::parse_body(&hello.body).unwrap();
        assert!(theirs.capabilities.iter().any(|c| c == umbra_proto::CAP_LARGE_OUTPUT), "{theirs:?}");
        let ours = Hello {
            protocol: PROTOCOL_VERSION,
            software: "fake-agent".into(),
            hostname: None,
            pid1: false,
            capabilities: vec![],
        };
        agent.send(json_frame(FrameKind::Hello, 0, &ours)).await.unwrap();
    };
    let (client, ()) = tokio::join!(AgentClient::handshake(stream), play);
    client.unwrap()
}

async fn fake_agent() -> (AgentClient, FakeAgent) {
    let (client_side, agent_side) = tokio::io::duplex(4 << 20);
    let mut agent = Framed::new(agent_side, FrameCodec::new());
    (handshake(client_side, &mut agent).await, agent)
}

/// The next frame the client sent, skipping credit frames unless asked for.
async fn next_request(agent: &mut FakeAgent) -> Frame {
    loop {
        let f = tokio::time::timeout(PATIENCE, agent.next()).await.expect("a frame").expect("open").unwrap();
        if f.kind == FrameKind::Request {
            return f;
        }
    }
}

async fn respond(agent: &mut FakeAgent, id: u32, body: ResponseBody) {
    agent.send(json_frame(FrameKind::Response, id, &Response::Ok(body))).await.unwrap();
}

/// Spawns a process and confirms it; returns it with its first event consumed.
/// A ping answered by the fake agent. Frames are routed in order, so once it returns every
/// frame the agent sent before the answer has been delivered.
async fn ping_round_trip(client: &AgentClient, agent: &mut FakeAgent) {
    let ping = tokio::spawn({
        let client = client.clone();
        async move { client.ping().await }
    });
    let req = next_request(agent).await;
    respond(agent, req.id, ResponseBody::Pong { uptime_ms: 1 }).await;
    ping.await.unwrap().unwrap();
}

async fn spawned(client: &AgentClient, agent: &mut FakeAgent) -> Process {
    let mut p = client.spawn(SpawnRequest { argv: vec!["x".into()], ..Default::default() }).unwrap();
    let req = next_request(agent).await;
    respond(agent, req.id, ResponseBody::Spawned { pid: 42 }).await;
    assert_eq!(p.next_event().await, Some(ProcessEvent::Spawned { pid: 42 }));
    p
}

/// Reads events until the connection-lost error; returns its message and the output bytes seen.
async fn until_lost(p: &mut Process) -> (String, usize) {
    let mut output = 0;
    loop {
        match tokio::time::timeout(PATIENCE, p.next_event()).await.expect("the connection must end") {
            Some(ProcessEvent::Stdout(b) | ProcessEvent::Stderr(b)) => output += b.len(),
            Some(ProcessEvent::Error(msg)) => return (msg, output),
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// The client closed its side: the agent reads end of stream (after whatever was queued).
async fn sees_close(agent: &mut FakeAgent) {
    loop {
        match tokio::time::timeout(PATIENCE, agent.next()).await.expect("client must close its write side") {
            None | Some(Err(_)) => return,
            Some(Ok(_)) => continue,
        }
    }
}

#[tokio::test]
async fn output_beyond_the_credit_ends_the_connection() {
    let (client, mut agent) = fake_agent().await;
    let p = spawned(&client, &mut agent).await;
    // Never read: 16 chunks are exactly the initial credit, the 17th is over it.
    let mut p = p;
    for _ in 0..=umbra_proto::INITIAL_OUTPUT_CREDIT as usize / MAX_DATA_CHUNK {
        agent.send(Frame::data(p.id(), Channel::Stdout, vec![b'x'; MAX_DATA_CHUNK])).await.unwrap();
    }
    let (msg, output) = until_lost(&mut p).await;
    assert!(msg.contains("credit"), "{msg}");
    assert_eq!(output, umbra_proto::INITIAL_OUTPUT_CREDIT as usize);
    assert!(matches!(client.ping().await, Err(ClientError::ConnectionLost(_))));
    sees_close(&mut agent).await;
}

#[tokio::test]
async fn consumed_output_is_granted_back_and_extends_the_window() {
    let (client, mut agent) = fake_agent().await;
    let mut p = spawned(&client, &mut agent).await;
    // Three times the initial credit, sent only as grants come back.
    let total = 3 * umbra_proto::INITIAL_OUTPUT_CREDIT as usize;
    let (mut sent, mut credit) = (0, umbra_proto::INITIAL_OUTPUT_CREDIT as usize);
    let mut received = 0;
    while received < total {
        while sent < total && credit >= MAX_DATA_CHUNK {
            agent.send(Frame::data(p.id(), Channel::Stderr, vec![0u8; MAX_DATA_CHUNK])).await.unwrap();
            (sent, credit) = (sent + MAX_DATA_CHUNK, credit - MAX_DATA_CHUNK);
        }
        match p.next_event().await {
            Some(ProcessEvent::Stderr(b)) => received += b.len(),
            other => panic!("unexpected {other:?}"),
        }
        while let Ok(Some(Ok(f))) = tokio::time::timeout(Duration::from_millis(1), agent.next()).await {
            assert_eq!((f.kind, f.channel), (FrameKind::Credit, Channel::Stderr));
            // Grants come in batches of a quarter window, not per chunk.
            let grant = f.credit_bytes().unwrap() as usize;
            assert!(grant >= umbra_proto::INITIAL_OUTPUT_CREDIT as usize / 4, "a {grant}-byte grant");
            credit += grant;
        }
    }
    agent.send(json_frame(FrameKind::Event, p.id(), &Event::Exit(exit_status()))).await.unwrap();
    assert!(matches!(p.next_event().await, Some(ProcessEvent::Exit(_))));
}

fn exit_status() -> umbra_proto::ExitStatus {
    umbra_proto::ExitStatus { code: Some(0), signal: None, duration_ms: 1 }
}

#[tokio::test]
async fn an_oversized_data_frame_ends_the_connection() {
    let (client, mut agent) = fake_agent().await;
    let mut p = spawned(&client, &mut agent).await;
    let over = umbra_proto::LARGE_OUTPUT_CHUNK + 1;
    agent.send(Frame::data(p.id(), Channel::Stdout, vec![b'x'; over])).await.unwrap();
    let (msg, output) = until_lost(&mut p).await;
    assert!(msg.contains("limit"), "{msg}");
    assert_eq!(output, 0);
}

#[tokio::test]
async fn a_flood_of_error_events_ends_the_connection() {
    let (client, mut agent) = fake_agent().await;
    let mut p = spawned(&client, &mut agent).await;
    let err = Event::Error { message: "e".repeat(1000) };
    for _ in 0..1000 {
        if agent.send(json_frame(FrameKind::Event, p.id(), &err)).await.is_err() {
            break;
        }
    }
    let mut errors = 0;
    let last = loop {
        match tokio::time::timeout(PATIENCE, p.next_event()).await.expect("the connection must end") {
            Some(ProcessEvent::Error(msg)) if msg.starts_with("agent connection lost") => break msg,
            Some(ProcessEvent::Error(_)) => errors += 1,
            other => panic!("unexpected {other:?}"),
        }
    };
    assert!(errors <= 16 && last.contains("error events"), "{errors} errors, then {last}");
}

#[tokio::test]
async fn stdin_credit_beyond_what_was_sent_ends_the_connection_without_panicking() {
    let (client, mut agent) = fake_agent().await;
    let mut p = spawned(&client, &mut agent).await;
    p.stdin().write(&b"hello"[..]).await.unwrap();
    let data = loop {
        let f = tokio::time::timeout(PATIENCE, agent.next()).await.unwrap().unwrap().unwrap();
        if f.kind == FrameKind::Data {
            break f;
        }
    };
    assert_eq!(data.body, &b"hello"[..]);
    // Returning what was sent is fine; the connection goes on.
    agent.send(Frame::credit(p.id(), Channel::Stdin, 5)).await.unwrap();
    ping_round_trip(&client, &mut agent).await;
    // A grant of more than is outstanding (u32::MAX, repeatedly, would overflow the semaphore).
    agent.send(Frame::credit(p.id(), Channel::Stdin, u32::MAX)).await.unwrap();
    let (msg, _) = until_lost(&mut p).await;
    assert!(msg.contains("outstanding"), "{msg}");
}

#[tokio::test]
async fn oversized_requests_fail_at_the_caller_and_the_connection_goes_on() {
    let (client, mut agent) = fake_agent().await;
    let req = WriteFileRequest { path: "/f".into(), mode: WriteMode::Truncate, permissions: None, create_dirs: false };
    let e = client.write_file(req, &vec![0u8; MAX_FILE_CHUNK + 1]).await.unwrap_err();
    assert!(matches!(e, ClientError::TooLarge(_)), "{e}");
    let huge = SpawnRequest { argv: vec!["x".repeat(MAX_BODY_LEN)], ..Default::default() };
    let e = client.spawn(huge).err().expect("too large");
    assert!(matches!(e, ClientError::TooLarge(_)), "{e}");
    let e = client.stat(&"/".repeat(MAX_BODY_LEN)).await.unwrap_err();
    assert!(matches!(e, ClientError::TooLarge(_)), "{e}");
    // Nothing reached the writer: the next request is the ping, and it is answered.
    let ping = tokio::spawn({
        let client = client.clone();
        async move { client.ping().await }
    });
    let req = next_request(&mut agent).await;
    assert!(matches!(parse_body::<Request>(&req.body).unwrap().0, Request::Ping));
    respond(&mut agent, req.id, ResponseBody::Pong { uptime_ms: 1 }).await;
    ping.await.unwrap().unwrap();
}

/// A writer that works until told to break.
struct Breakable<W> {
    inner: W,
    broken: Arc<AtomicBool>,
}

impl<W: AsyncWrite + Unpin> AsyncWrite for Breakable<W> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        if self.broken.load(Ordering::Acquire) {
            return Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into()));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[tokio::test]
async fn a_failed_write_fails_pending_calls_instead_of_hanging_them() {
    let (client_side, agent_side) = tokio::io::duplex(1 << 16);
    let mut agent = Framed::new(agent_side, FrameCodec::new());
    let (r, w) = tokio::io::split(client_side);
    let broken = Arc::new(AtomicBool::new(false));
    let stream = tokio::io::join(r, Breakable { inner: w, broken: broken.clone() });
    let client = handshake(stream, &mut agent).await.with_call_timeout(PATIENCE);
    let p = client.spawn(SpawnRequest { argv: vec!["x".into()], ..Default::default() }).unwrap();
    let req = next_request(&mut agent).await;
    respond(&mut agent, req.id, ResponseBody::Spawned { pid: 42 }).await;
    broken.store(true, Ordering::Release);
    let e = client.ping().await.unwrap_err();
    match e {
        ClientError::ConnectionLost(cause) => assert!(cause.contains("cannot write"), "{cause}"),
        other => panic!("expected ConnectionLost, got {other}"),
    }
    let out = tokio::time::timeout(PATIENCE, p.output()).await.expect("process ends too");
    assert!(matches!(out, Err(ClientError::ConnectionLost(_))), "{out:?}");
    // The write side was shut down, so the agent sees the connection close.
    sees_close(&mut agent).await;
}

#[tokio::test]
async fn undecodable_input_closes_the_clients_side_too() {
    let (client, mut agent) = fake_agent().await;
    agent.get_mut().write_all(b"garbage!garbage!").await.unwrap();
    sees_close(&mut agent).await;
    assert!(matches!(client.ping().await, Err(ClientError::ConnectionLost(_))));
}

#[tokio::test]
async fn calls_time_out_and_a_late_answer_is_ignored() {
    let (client, mut agent) = fake_agent().await;
    let client = client.with_call_timeout(Duration::from_millis(100));
    let e = client.ping().await.unwrap_err();
    assert!(matches!(e, ClientError::Timeout(_)), "{e}");
    let late = next_request(&mut agent).await;
    respond(&mut agent, late.id, ResponseBody::Pong { uptime_ms: 1 }).await;
    // Still usable: the next call gets its own answer.
    let ping = tokio::spawn({
        let client = client.clone();
        async move { client.ping().await }
    });
    let req = next_request(&mut agent).await;
    assert_ne!(req.id, late.id);
    respond(&mut agent, req.id, ResponseBody::Pong { uptime_ms: 7 }).await;
    assert_eq!(ping.await.unwrap().unwrap(), Duration::from_millis(7));
}

#[tokio::test]
async fn dropping_a_process_returns_the_credit_of_output_it_never_read() {
    let (client, mut agent) = fake_agent().await;
    let p = spawned(&client, &mut agent).await;
    let id = p.id();
    for _ in 0..3 {
        agent.send(Frame::data(id, Channel::Stdout, vec![b'x'; 1000])).await.unwrap();
    }
    agent.send(Frame::data(id, Channel::Stderr, vec![b'x'; 500])).await.unwrap();
    // Frames are routed in order: once this ping is answered, the output is queued in `p`.
    ping_round_trip(&client, &mut agent).await;
    drop(p);
    let (mut stdout, mut stderr, mut killed) = (0, 0, false);
    while !(killed && stdout == 3000 && stderr == 500) {
        let f = tokio::time::timeout(PATIENCE, agent.next()).await.expect("credit for queued output").unwrap().unwrap();
        match (f.kind, f.channel) {
            (FrameKind::Credit, Channel::Stdout) => stdout += f.credit_bytes().unwrap(),
            (FrameKind::Credit, Channel::Stderr) => stderr += f.credit_bytes().unwrap(),
            (FrameKind::Request, _) => {
                killed = matches!(parse_body::<Request>(&f.body).unwrap().0, Request::Kill { process, signal: 9 } if process == id)
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[tokio::test]
async fn a_park_answer_ends_only_the_streams_that_were_asked_for() {
    let (client, mut agent) = fake_agent().await;
    let mut asked = spawned(&client, &mut agent).await;
    let mut other = spawned(&client, &mut agent).await;
    let park = tokio::spawn({
        let (client, id) = (client.clone(), asked.id());
        async move { client.park(&[id]).await }
    });
    let req = next_request(&mut agent).await;
    // A hostile guest names the other process too, and one that does not exist.
    let lie = [asked.id(), other.id(), 4242]
        .map(|process| umbra_proto::ParkedProcess { process, token: u64::from(process) + 100 })
        .to_vec();
    respond(&mut agent, req.id, ResponseBody::Parked { processes: lie }).await;
    let parked = park.await.unwrap().unwrap();
    assert_eq!(parked.len(), 1, "{parked:?}");
    assert_eq!(asked.next_event().await, Some(ProcessEvent::Parked { token: u64::from(asked.id()) + 100 }));
    // The other process goes on: its output still arrives.
    agent.send(Frame::data(other.id(), Channel::Stdout, &b"still here"[..])).await.unwrap();
    assert_eq!(other.next_event().await, Some(ProcessEvent::Stdout(bytes::Bytes::from_static(b"still here"))));
}

#[tokio::test]
async fn exec_checks_nobody_can_answer_are_refused_by_the_reader() {
    let (client, mut agent) = fake_agent().await;
    let p = spawned(&client, &mut agent).await;
    let check = |check: u64, process: u32, argv: Vec<String>| {
        let event = Event::ExecCheck { check, pid: 7, path: "/usr/bin/id".into(), argv, cwd: None };
        json_frame(FrameKind::Event, process, &event)
    };
    let refused = |frame: Frame| {
        assert_eq!(frame.kind, FrameKind::Request);
        let (req, _): (Request, _) = parse_body(&frame.body).unwrap();
        match req {
            Request::ExecAnswer { check, allow: false } => check,
            other => panic!("expected a refusal, got {other:?}"),
        }
    };
    // Before anyone takes the checks: refused at once.
    agent.send(check(1, p.id(), vec!["id".into()])).await.unwrap();
    assert_eq!(refused(next_request(&mut agent).await), 1);
    let mut checks = client.exec_checks().unwrap();
    // Taken: a check of a process that is not this connection's, and one larger than any the
    // agent sends, are refused; a well-formed one reaches the taker.
    agent.send(check(2, 4242, vec!["id".into()])).await.unwrap();
    assert_eq!(refused(next_request(&mut agent).await), 2);
    let huge = vec!["x".repeat(1024); 1024];
    agent.send(check(3, p.id(), huge)).await.unwrap();
    assert_eq!(refused(next_request(&mut agent).await), 3);
    agent.send(check(4, p.id(), vec!["id".into(), "-u".into()])).await.unwrap();
    let got = tokio::time::timeout(PATIENCE, checks.recv()).await.unwrap().unwrap();
    assert_eq!((got.check, got.process, got.argv.as_slice()), (4, p.id(), &["id".to_string(), "-u".into()][..]));
    // A flood past the queue is refused, not held: nobody reads `checks` now.
    for n in 0..(super::MAX_QUEUED_EXEC_CHECKS as u64 + 3) {
        agent.send(check(100 + n, p.id(), vec!["id".into()])).await.unwrap();
    }
    let mut refusals = Vec::new();
    for _ in 0..3 {
        refusals.push(refused(next_request(&mut agent).await));
    }
    assert_eq!(refusals.len(), 3);
    // Dropped: refused again, and the connection goes on.
    drop(checks);
    agent.send(check(9, p.id(), vec!["id".into()])).await.unwrap();
    // (the queued ones are dropped unanswered with the receiver: the agent gives up on a dead
    // caller itself.)
    loop {
        if refused(next_request(&mut agent).await) == 9 {
            break;
        }
    }
    ping_round_trip(&client, &mut agent).await;
}
