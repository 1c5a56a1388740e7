//! The conformance suite: the same cases against every backend this host supports (today
//! `qemu`; the Umbra VMM adds `kvm`). Each case checks an outcome a user relies on.

use std::time::{Duration, Instant};

use umbra_proto::SpawnRequest;
use umbra_runtime::agent::{AgentClient, ProcessEvent};
use umbra_runtime::backend::{BackendKind, BootImage, KvmKind, Vm, VmError, VmSpec};
use umbra_tests::{cache_dir, test_bundle};

/// Backends this host can run. KVM joins when the Umbra VMM lands.
/// The backends this host runs the suite on: `UMBRA_TEST_BACKENDS` (comma list of `qemu`,
/// `kvm`; the nested lane sets `kvm`), else QEMU plus the Umbra VMM where KVM is hardware.
fn backends() -> Vec<BackendKind> {
    if let Ok(list) = std::env::var("UMBRA_TEST_BACKENDS") {
        return list
            .split(',')
            .map(|n| {
                BackendKind::from_name(n.trim())
                    .unwrap_or_else(|| panic!("unknown backend {n:?} in UMBRA_TEST_BACKENDS"))
            })
            .collect();
    }
    let mut all = vec![BackendKind::Qemu];
    if KvmKind::detect() == KvmKind::Hardware {
        all.push(BackendKind::Kvm);
    }
    all
}

fn sh(script: &str) -> SpawnRequest {
    SpawnRequest { argv: vec!["sh".into(), "-c".into(), script.into()], ..Default::default() }
}

async fn boot(backend: BackendKind) -> Vm {
    let image = BootImage::from_bundle_dir(&test_bundle("minimal"), &cache_dir().join("extracted")).unwrap();
    Vm::launch(backend, &VmSpec::new(image)).await.unwrap_or_else(|e| panic!("{backend:?} boot: {e}"))
}

async fn run(agent: &AgentClient, req: SpawnRequest) -> umbra_runtime::agent::ProcessOutput {
    agent.spawn(req).unwrap().output().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_semantics() {
    for backend in backends() {
        let vm = boot(backend).await;
        let agent = vm.agent();

        // exit codes and stdio separation
        let out = run(agent, sh("echo out; echo err >&2; exit 3")).await;
        assert_eq!(
            (out.stdout.as_slice(), out.stderr.as_slice(), out.status.code),
            (&b"out\n"[..], &b"err\n"[..], Some(3))
        );

        // signals: self-inflicted and host-sent
        let out = run(agent, sh("kill -TERM $$")).await;
        assert_eq!(out.status.signal, Some(15), "{backend:?}");
        let mut p = agent.spawn(sh("sleep 60")).unwrap();
        assert!(matches!(p.next_event().await, Some(ProcessEvent::Spawned { .. })));
        p.kill(9).await.unwrap();
        assert_eq!(p.output().await.unwrap().status.signal, Some(9));

        // stdin through cat, closed by the host
        let p = agent.spawn(SpawnRequest { argv: vec!["cat".into()], ..Default::default() }).unwrap();
        p.stdin().write(&b"hello from the host\n"[..]).await.unwrap();
        p.stdin().close().await.unwrap();
        assert_eq!(p.output().await.unwrap().stdout, b"hello from the host\n");

        // env and cwd
        let mut req = sh("echo $FOO; pwd");
        req.env.insert("FOO".into(), "bar baz".into());
        req.cwd = Some("/tmp".into());
        assert_eq!(run(agent, req).await.stdout, b"bar baz\n/tmp\n");

        // large output arrives complete
        let out = run(agent, sh("head -c 16777216 /dev/zero")).await;
        assert_eq!(out.stdout.len(), 16 << 20);

        // many processes at once
        let procs: Vec<_> = (0..50).map(|i| agent.spawn(sh(&format!("exit {}", i % 5))).unwrap()).collect();
        let outs = futures_util::future::join_all(procs.into_iter().map(|p| p.output())).await;
        for (i, o) in outs.into_iter().enumerate() {
            assert_eq!(o.unwrap().status.code, Some((i % 5) as i32));
        }

        // heartbeats answer while a process keeps the guest busy
        let busy = agent.spawn(sh("i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done")).unwrap();
        let mut worst = Duration::ZERO;
        for _ in 0..10 {
            let t = Instant::now();
            agent.ping().await.unwrap();
            worst = worst.max(t.elapsed());
        }
        assert!(worst < Duration::from_secs(2), "{backend:?}: slowest heartbeat {worst:?}");
        drop(busy);
        vm.shutdown().await;
    }
}

/// Kills PID 1: overwrites its whole executable mapping through /proc/1/mem (root may; the
/// kernel has CONFIG_PROC_MEM_ALWAYS_FORCE), then prints so the agent runs and faults.
const KILL_AGENT: &str = "set -- $(grep ' r-xp ' /proc/1/maps | head -1 | cut -d' ' -f1 | tr - ' '); \
    dd if=/dev/zero of=/proc/1/mem bs=4096 seek=$((0x$1 / 4096)) count=$(((0x$2 - 0x$1) / 4096)) conv=notrunc; \
    while true; do echo wake-the-agent; sleep 0.1; done";

async fn expect_death(mut vm: Vm, script: &str, reason: &str) {
    let mut p = vm.agent().spawn(sh(script)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match tokio::time::timeout_at(deadline.into(), p.next_event()).await.expect("an event, never a hang") {
            Some(ProcessEvent::Error(msg)) => {
                assert!(msg.contains("connection lost"), "{msg}");
                break;
            }
            Some(ProcessEvent::Exit(s)) => panic!("the process exited ({s:?}) instead of the VM dying"),
            Some(_) => continue,
            None => break,
        }
    }
    match vm.wait(Duration::from_secs(10)).await {
        Some(VmError::GuestDied { reason: r, console }) => {
            assert_eq!(r, reason, "console:\n{console}");
            assert!(console.contains("Kernel panic"), "{console}");
        }
        other => panic!("expected the VM to report its death, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_agent_is_reported_as_such() {
    for backend in backends() {
        expect_death(boot(backend).await, KILL_AGENT, "the guest agent (PID 1) died and the kernel panicked").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_kernel_panic_is_reported_as_such() {
    for backend in backends() {
        expect_death(boot(backend).await, "echo c > /proc/sysrq-trigger; sleep 30", "the guest kernel panicked").await;
    }
}
