//! Flow control under load, in its own test binary so the client RSS measured is this test's.
//!
//! 1 GiB goes through one process's stdout while a second process runs and heartbeats keep
//! answering; the agent's and the client's resident memory stay bounded throughout.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use umbra_proto::SpawnRequest;
use umbra_runtime::agent::ProcessEvent;
use umbra_tests::{rss_kib, HostAgent};

const GIB: u64 = 1 << 30;
const RSS_LIMIT_KIB: u64 = 64 * 1024;
const HEARTBEAT_LIMIT: Duration = Duration::from_millis(100);

fn sh(script: &str) -> SpawnRequest {
    SpawnRequest { argv: vec!["sh".into(), "-c".into(), script.into()], ..Default::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_gib_of_stdout_while_another_process_runs_and_heartbeats_stay_prompt() {
    let agent = HostAgent::start().await;
    let client = agent.connect().await;
    let done = Arc::new(AtomicBool::new(false));

    // Memory sampler: agent and this process (the client), every 20 ms.
    let peak_agent = Arc::new(AtomicU64::new(0));
    let peak_client = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (done, pa, pc, agent_pid) = (done.clone(), peak_agent.clone(), peak_client.clone(), agent.pid());
        tokio::spawn(async move {
            while !done.load(Ordering::Acquire) {
                pa.fetch_max(rss_kib(agent_pid), Ordering::Relaxed);
                pc.fetch_max(rss_kib(std::process::id()), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    // Heartbeats every 25 ms; record the slowest.
    let heartbeats = {
        let (done, client) = (done.clone(), client.clone());
        tokio::spawn(async move {
            let (mut n, mut worst) = (0u32, Duration::ZERO);
            while !done.load(Ordering::Acquire) {
                let t = Instant::now();
                client.ping().await.expect("ping during flood");
                worst = worst.max(t.elapsed());
                n += 1;
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            (n, worst)
        })
    };
    // A second process that must keep making progress during the flood.
    let ticker = client.spawn(sh("i=0; while [ $i -lt 40 ]; do echo tick $i; sleep 0.02; i=$((i+1)); done")).unwrap();
    let ticker = tokio::spawn(ticker.output());

    let started = Instant::now();
    let mut flood = client
        .spawn(SpawnRequest {
            argv: vec!["head".into(), "-c".into(), GIB.to_string(), "/dev/zero".into()],
            ..Default::default()
        })
        .unwrap();
    let mut received = 0u64;
    let status = loop {
        match flood.next_event().await.expect("flood events") {
            ProcessEvent::Stdout(b) => {
                assert!(b.iter().all(|&x| x == 0));
                received += b.len() as u64;
            }
            ProcessEvent::Exit(s) => break s,
            ProcessEvent::Spawned { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    };
    let elapsed = started.elapsed();
    let ticks = ticker.await.unwrap().unwrap();
    done.store(true, Ordering::Release);
    let (beats, worst) = heartbeats.await.unwrap();
    sampler.await.unwrap();

    assert_eq!(status.code, Some(0));
    assert_eq!(received, GIB, "every byte arrives, none duplicated");
    assert_eq!(String::from_utf8(ticks.stdout).unwrap().lines().count(), 40);
    let (pa, pc) = (peak_agent.load(Ordering::Relaxed), peak_client.load(Ordering::Relaxed));
    eprintln!(
        "1 GiB in {elapsed:?} ({:.0} MiB/s); {beats} heartbeats, worst {worst:?}; peak RSS agent {pa} KiB, client {pc} KiB",
        1024.0 / elapsed.as_secs_f64()
    );
    assert!(beats >= 5, "heartbeats ran during the flood ({beats})");
    assert!(worst < HEARTBEAT_LIMIT, "slowest heartbeat {worst:?}");
    assert!(pa > 0 && pa < RSS_LIMIT_KIB, "agent peak RSS {pa} KiB");
    assert!(pc > 0 && pc < RSS_LIMIT_KIB, "client peak RSS {pc} KiB");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_stops_stalls_only_its_own_process() {
    let agent = HostAgent::start().await;
    let client = agent.connect().await;
    // Never read: the agent may send only the initial credit, then the writer blocks in its pipe.
    let mut stalled = client
        .spawn(SpawnRequest {
            argv: vec!["head".into(), "-c".into(), "100000000".into(), "/dev/zero".into()],
            ..Default::default()
        })
        .unwrap();
    assert!(matches!(stalled.next_event().await, Some(ProcessEvent::Spawned { .. })));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let out = client.spawn(sh("echo still-served")).unwrap().output().await.unwrap();
    assert_eq!(out.stdout, b"still-served\n");
    let agent_rss = rss_kib(agent.pid());
    assert!(agent_rss < RSS_LIMIT_KIB, "agent RSS {agent_rss} KiB with a stalled 100 MB producer");
    // Now drain it: everything arrives.
    let mut got = 0u64;
    while let Some(ev) = stalled.next_event().await {
        match ev {
            ProcessEvent::Stdout(b) => got += b.len() as u64,
            ProcessEvent::Exit(s) => {
                assert_eq!(s.code, Some(0));
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(got, 100_000_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_process_with_unread_output_lets_it_finish() {
    let agent = HostAgent::start().await;
    let client = agent.connect().await;
    let mut p = client
        .spawn(SpawnRequest {
            argv: vec!["head".into(), "-c".into(), "3000000".into(), "/dev/zero".into()],
            ..Default::default()
        })
        .unwrap();
    assert!(matches!(p.next_event().await, Some(ProcessEvent::Spawned { .. })));
    // The whole initial credit arrives and sits unread in `p`; the agent's pump has none left.
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(p);
    // Only once its credit comes back can the pump drain the pipe, see the end and report the
    // exit, which is what frees the process's entry.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let live = client.stats().await.unwrap().agent_processes;
        if live == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{live} process(es) still held by the agent");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The largest output Data frame a raw host sees from a 2 MB producer that writes 200 KB at a
/// time, granting back what it reads. With `capabilities` listing large output the agent may
/// use frames up to `LARGE_OUTPUT_CHUNK`; without (a 1.3 host), never above `MAX_DATA_CHUNK`.
async fn largest_output_frame(agent: &HostAgent, capabilities: Vec<String>) -> usize {
    use futures_util::{SinkExt, StreamExt};
    use umbra_proto::{json_frame, Channel, Frame, FrameCodec, FrameKind, Hello, Request, PROTOCOL_VERSION};

    let stream = tokio::net::UnixStream::connect(&agent.socket).await.unwrap();
    let mut f = tokio_util::codec::Framed::new(stream, FrameCodec::new());
    let hello =
        Hello { protocol: PROTOCOL_VERSION, software: "test".into(), hostname: None, pid1: false, capabilities };
    f.send(json_frame(FrameKind::Hello, 0, &hello)).await.unwrap();
    assert_eq!(f.next().await.unwrap().unwrap().kind, FrameKind::Hello);
    let script = "for i in 1 2 3 4 5 6 7 8 9 10; do head -c 200000 /dev/zero; sleep 0.02; done";
    f.send(json_frame(FrameKind::Request, 1, &Request::Spawn(sh(script)))).await.unwrap();
    let (mut largest, mut total) = (0, 0);
    loop {
        let frame = tokio::time::timeout(Duration::from_secs(10), f.next()).await.expect("output").unwrap().unwrap();
        match frame.kind {
            FrameKind::Data => {
                largest = largest.max(frame.body.len());
                total += frame.body.len();
                f.send(Frame::credit(1, Channel::Stdout, frame.body.len() as u32)).await.unwrap();
            }
            FrameKind::Event => break,
            _ => {}
        }
    }
    assert_eq!(total, 2_000_000);
    largest
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_frames_are_as_large_as_the_host_accepts() {
    let agent = HostAgent::start().await;
    let old_host = largest_output_frame(&agent, vec![]).await;
    assert!(old_host <= umbra_proto::MAX_DATA_CHUNK, "{old_host}-byte frame to a host without large-output");
    let new_host = largest_output_frame(&agent, vec![umbra_proto::CAP_LARGE_OUTPUT.into()]).await;
    assert!(
        new_host > umbra_proto::MAX_DATA_CHUNK && new_host <= umbra_proto::LARGE_OUTPUT_CHUNK,
        "largest frame {new_host} bytes to a host with large-output"
    );
}
