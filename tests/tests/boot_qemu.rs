//! Real guests under QEMU (`-M microvm`, TCG here, KVM on hardware hosts) with the agent as
//! PID 1, reached through vhost-device-vsock's hybrid socket by the runtime's client.

use std::time::Duration;

use umbra_proto::SpawnRequest;
use umbra_runtime::backend::{BackendKind, BootImage, Restore, Vm, VmSpec};
use umbra_tests::{cache_dir, test_bundle};

fn sh(script: &str) -> SpawnRequest {
    SpawnRequest { argv: vec!["sh".into(), "-c".into(), script.into()], ..Default::default() }
}

async fn boot(flavor: &str) -> Vm {
    let image =
        BootImage::from_bundle_dir(&test_bundle(flavor), &cache_dir().join("extracted")).expect("bundle verifies");
    Vm::launch(BackendKind::Qemu, &VmSpec::new(image)).await.expect("VM boots and the agent answers")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minimal_bundle_boots_and_runs_uname() {
    let vm = boot("minimal").await;
    eprintln!("minimal: launch -> agent ready in {:?}", vm.boot_time);
    let info = vm.agent().agent_info().clone();
    assert!(info.pid1, "the agent runs as PID 1 in the guest");
    assert_eq!(info.hostname.as_deref(), Some("umbra"));
    vm.agent().ping().await.unwrap();
    let out = vm.agent().spawn(SpawnRequest { argv: vec!["uname".into(), "-a".into()], ..Default::default() }).unwrap();
    let out = out.output().await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("Linux umbra 6.1"), "{text:?}");
    assert_eq!(out.status.code, Some(0));
    let run_dir = vm.run_dir().to_path_buf();
    let pids = vm.pids();
    vm.shutdown().await;
    assert!(!run_dir.exists(), "run directory removed");
    for pid in pids {
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "helper {pid} reaped");
    }
}

/// Snapshots need umbra-vmm: on QEMU a snapshot is refused by name and leaves the VM running
/// and no directory behind, and a restore is refused before anything starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_refuses_snapshot_and_restore_by_name() {
    let mut vm = boot("minimal").await;
    let dir = std::env::temp_dir().join(format!("umbra-qemu-snapshot-{}", std::process::id()));
    let err = vm.snapshot(&dir).await.unwrap_err().to_string();
    assert!(err.contains("qemu backend cannot snapshot") && err.contains("kvm"), "{err}");
    assert!(!dir.exists(), "no snapshot directory for a refused snapshot");
    vm.agent().ping().await.expect("the VM runs on");
    vm.shutdown().await;

    let image =
        BootImage::from_bundle_dir(&test_bundle("minimal"), &cache_dir().join("extracted")).expect("bundle verifies");
    let mut spec = VmSpec::new(image);
    spec.restore = Some(Restore { snapshot: dir, hostname: "fork".into(), folders: Vec::new() });
    let err = Vm::launch(BackendKind::Qemu, &spec).await.err().expect("refused").to_string();
    assert!(err.contains("qemu backend cannot restore") && err.contains("kvm"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_shutdown_ends_the_vm() {
    let mut vm = boot("minimal").await;
    let out =
        vm.agent().spawn(sh("echo $$; cat /proc/1/comm; mount | grep -c ' /proc '")).unwrap().output().await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("init"), "agent is /init: {text:?}");
    vm.agent().shutdown().await.unwrap();
    let ended = vm.wait(Duration::from_secs(20)).await.expect("the VM ends after a guest shutdown");
    assert!(ended.to_string().contains("qemu-system-x86_64 exited: exit status: 0"), "{ended}");
}

fn sha256_of(path: &std::path::Path) -> String {
    let out = std::process::Command::new("sha256sum").arg(path).output().expect("sha256sum");
    String::from_utf8_lossy(&out.stdout).split_whitespace().next().unwrap_or_default().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standard_bundle_runs_debian_tools_and_writes_only_to_the_overlay() {
    let image = BootImage::from_bundle_dir(&test_bundle("standard"), &cache_dir().join("extracted")).unwrap();
    let rootfs = image.rootfs.clone().expect("standard has a rootfs disk");
    let before = sha256_of(&rootfs);
    let mut spec = VmSpec::new(image);
    spec.boot_timeout = Duration::from_secs(90); // TCG: Debian userspace is slower to reach
    let vm = Vm::launch(BackendKind::Qemu, &spec).await.expect("standard boots");
    eprintln!("standard: launch -> agent ready in {:?}", vm.boot_time);

    let out = vm.agent().spawn(sh("git --version && python3 -c 'print(1)'")).unwrap().output().await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code, Some(0), "{text} {}", String::from_utf8_lossy(&out.stderr));
    assert!(text.starts_with("git version 2.39") && text.ends_with("1\n"), "{text:?}");

    // What agents reach for: pip and venv, Node.js with npm, ripgrep, jq.
    let tools = "python3 -m pip --version | cut -d' ' -f1,2 && python3 -m venv /tmp/venv && /tmp/venv/bin/python -m pip --version | cut -d' ' -f1 && \
                 node --version | cut -c1-4 && npm --version | cut -d. -f1 && rg --version | head -1 | cut -d' ' -f1 && \
                 echo '{\"a\":[1,2]}' | jq -c '.a | length'";
    let out = vm.agent().spawn(sh(tools)).unwrap().output().await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code, Some(0), "{text} {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(text, "pip 23.0.1\npip\nv18.\n9\nripgrep\n2\n", "{text:?}");

    // Writes anywhere (even over image files) land in the tmpfs upper layer of the overlay.
    let out = vm
        .agent()
        .spawn(sh("echo written > /root/new.txt && echo changed > /etc/hostname && rm /etc/hosts && \
                   cat /root/new.txt /etc/hostname && test ! -e /etc/hosts && \
                   grep ' / ' /proc/mounts | cut -d' ' -f1,3"))
        .unwrap()
        .output()
        .await
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "written\nchanged\noverlay overlay\n", "{out:?}");
    vm.shutdown().await;
    assert_eq!(sha256_of(&rootfs), before, "the image is unchanged after the session");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reidentify_gives_the_guest_a_new_name_clock_and_machine_id() {
    let vm = boot("minimal").await;
    let agent = vm.agent().clone();
    let run = |script: &'static str| {
        let agent = agent.clone();
        async move {
            let out = agent.spawn(sh(script)).unwrap().output().await.unwrap();
            assert_eq!(out.status.code, Some(0), "{script}: {}", String::from_utf8_lossy(&out.stderr));
            String::from_utf8_lossy(&out.stdout).into_owned()
        }
    };
    // What a restored guest looks like: the snapshot's clock (here: 2001) and name.
    run("date -s '2001-09-09 01:46:40' >/dev/null; echo 0123456789abcdef0123456789abcdef > /etc/machine-id").await;
    let before = run("hostname; date +%s; cat /etc/machine-id").await;
    assert!(before.starts_with("umbra\n1000000"), "{before}");

    let bad = vm.agent().reidentify("not a name").await.unwrap_err();
    let bad = bad.agent_error().expect("the agent refuses it");
    assert!(bad.code == umbra_proto::ErrorCode::BadRequest && bad.message.contains("hostname"), "{bad:?}");
    vm.agent().reidentify("fork-7").await.expect("the guest's PID 1 takes a new identity");

    let after = run("hostname; date +%s; cat /etc/machine-id; cat /proc/sys/kernel/random/uuid").await;
    let lines: Vec<&str> = after.lines().collect();
    assert_eq!(lines[0], "fork-7");
    let host_now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    let guest_now: i64 = lines[1].parse().unwrap();
    assert!((guest_now - host_now).abs() < 60, "the clock was stepped to the host's: {guest_now} vs {host_now}");
    assert_ne!(lines[2], "0123456789abcdef0123456789abcdef", "a new machine id");
    assert_eq!(lines[2].len(), 32);
    assert_eq!(lines[3].len(), 36, "the kernel RNG still serves uuids");
    vm.shutdown().await;
}
