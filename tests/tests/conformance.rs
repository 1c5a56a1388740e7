//! The conformance suite: the same cases against every lane this host supports — each backend
//! with the host's architecture (`qemu`; the Umbra VMM adds `kvm` on hardware KVM), and QEMU
//! with every other guest architecture, emulated (an aarch64 guest on `qemu-system-aarch64`
//! here). Each case checks an outcome a user relies on.

use std::io::Write;
use std::time::{Duration, Instant};

use umbra_proto::SpawnRequest;
use umbra_runtime::agent::{AgentClient, ProcessEvent};
use umbra_runtime::backend::{BootImage, Vm, VmError, VmSpec};
use umbra_tests::{cache_dir, lanes, Lane};

fn sh(script: &str) -> SpawnRequest {
    SpawnRequest { argv: vec!["sh".into(), "-c".into(), script.into()], ..Default::default() }
}

fn lane_image(lane: Lane) -> BootImage {
    let image = BootImage::from_bundle_dir(&lane.bundle("minimal"), &cache_dir().join("extracted")).unwrap();
    assert_eq!(image.arch, lane.arch, "the {lane:?} bundle's manifest");
    image
}

async fn boot(lane: Lane) -> Vm {
    Vm::launch(lane.backend, &VmSpec::new(lane_image(lane))).await.unwrap_or_else(|e| panic!("{lane:?} boot: {e}"))
}

async fn run(agent: &AgentClient, req: SpawnRequest) -> umbra_runtime::agent::ProcessOutput {
    agent.spawn(req).unwrap().output().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_semantics() {
    for lane in lanes() {
        let vm = boot(lane).await;
        let agent = vm.agent();

        // the guest is the architecture its bundle says
        let out = run(agent, sh("uname -m")).await;
        let machine = String::from_utf8_lossy(&out.stdout).trim_end().to_string();
        assert_eq!(machine, lane.arch.as_str(), "{lane:?}");
        // In every run's log (libtest captures only the print macros): which lanes ran.
        let _ = writeln!(
            std::io::stderr(),
            "conformance lane {} / {}: booted in {:?}, `uname -m` = {}",
            lane.backend.name(),
            lane.arch,
            vm.boot_time,
            machine
        );

        // exit codes and stdio separation
        let out = run(agent, sh("echo out; echo err >&2; exit 3")).await;
        assert_eq!(
            (out.stdout.as_slice(), out.stderr.as_slice(), out.status.code),
            (&b"out\n"[..], &b"err\n"[..], Some(3))
        );

        // signals: self-inflicted and host-sent
        let out = run(agent, sh("kill -TERM $$")).await;
        assert_eq!(out.status.signal, Some(15), "{lane:?}");
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
        assert!(worst < Duration::from_secs(2), "{lane:?}: slowest heartbeat {worst:?}");
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
    for lane in lanes() {
        expect_death(boot(lane).await, KILL_AGENT, "the guest agent (PID 1) died and the kernel panicked").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_kernel_panic_is_reported_as_such() {
    for lane in lanes() {
        expect_death(boot(lane).await, "echo c > /proc/sysrq-trigger; sleep 30", "the guest kernel panicked").await;
    }
}

/// virtio-blk: a read-only disk image reads back byte-exact in the guest and refuses writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_disk_reads_back_and_refuses_writes() {
    let dir = umbra_tests::TempDir::new("blk");
    let image_path = dir.0.join("disk.img");
    // 1 MiB with a recognisable pattern in every sector.
    let image: Vec<u8> = (0..(1u32 << 20)).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    std::fs::write(&image_path, &image).unwrap();
    let expected = sha256_hex(&image[4096..8192]);
    for lane in lanes() {
        let mut boot_image = lane_image(lane);
        boot_image.rootfs = Some(image_path.clone());
        let vm = Vm::launch(lane.backend, &VmSpec::new(boot_image)).await.unwrap_or_else(|e| panic!("{lane:?}: {e}"));
        let out = run(
            vm.agent(),
            sh("cat /sys/block/vda/size; dd if=/dev/vda bs=4096 skip=1 count=1 2>/dev/null | sha256sum"),
        )
        .await;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(text.starts_with("2048\n"), "{lane:?}: 2048 sectors: {text}");
        assert!(text.contains(&expected), "{lane:?}: sector bytes: {text}");
        let out = run(vm.agent(), sh("echo x | dd of=/dev/vda bs=512 count=1 conv=notrunc,fsync")).await;
        assert_ne!(out.status.code, Some(0), "{lane:?}: a write to a read-only disk must fail");
        vm.shutdown().await;
        assert_eq!(std::fs::read(&image_path).unwrap(), image, "{lane:?}: the image is unchanged");
    }
}

fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}
