//! umbrad's warm pool over its real socket, with real VMs: a start takes a booted VM (with its
//! disk and folders working as in a fresh one), the pool refills, a start that does not match
//! boots its own, and switching the pool off kills its VMs.

use std::time::{Duration, Instant};

use umbra_api::client::Client;
use umbra_api::methods::*;
use umbra_api::{ConfigPatch, FolderSpec, SessionInfo};
use umbra_proto::ShareMode;
use umbra_tests::daemon::{boot_timeout_secs, process_output, Inbox, TestDaemon};

const RUN: Duration = Duration::from_secs(60);

fn sh(session: &str, script: &str) -> SpawnParams {
    SpawnParams { session: session.into(), argv: vec!["sh".into(), "-c".into(), script.into()], ..Default::default() }
}

/// Polls `pool.status` until `done` holds; panics with the last status after the boot timeout.
async fn wait_pool(client: &Client, what: &str, done: impl Fn(&PoolStatus) -> bool) -> PoolStatus {
    let deadline = Instant::now() + Duration::from_secs(boot_timeout_secs() + 30);
    loop {
        let status = client.call::<PoolStatusMethod>(NoParams {}).await.unwrap();
        if done(&status) {
            return status;
        }
        assert!(Instant::now() < deadline, "the pool never got to {what}: {status:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn run(client: &Client, inbox: &mut Inbox, session: &str, script: &str) -> String {
    let p = client.call::<ProcessSpawn>(sh(session, script)).await.unwrap();
    let (out, err, exit) = process_output(client, inbox, session, p.process, RUN).await;
    assert_eq!(exit.code, Some(0), "{script}: {}", String::from_utf8_lossy(&err));
    String::from_utf8_lossy(&out).into_owned()
}

fn vm(info: &SessionInfo) -> &umbra_api::VmInfo {
    info.vm.as_ref().expect("a running session has a VM")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_takes_a_pooled_vm_and_the_pool_refills() {
    let daemon = TestDaemon::start("daemon-pool", serde_json::json!({ "pool_size": 1 }));
    let (client, mut inbox) = daemon.client().await;
    let status = wait_pool(&client, "one ready VM", |s| s.ready == 1).await;
    assert_eq!((status.target, status.taken), (1, 0));
    assert_eq!(status.backend.as_deref(), Some("qemu"), "this host runs guests on QEMU: {status:?}");
    assert!(!status.restores && status.snapshot_error.is_none(), "QEMU's pool boots its VMs: {status:?}");
    let pooled: Vec<u32> = daemon.helpers().into_iter().map(|(pid, _)| pid).collect();
    assert!(!pooled.is_empty(), "the pooled VM runs on the host");

    // A start with the defaults and a folder takes it: the same host processes, no new boot.
    let work = daemon.dir.0.join("work");
    std::fs::create_dir_all(&work).unwrap();
    std::fs::write(work.join("from-host"), b"host\n").unwrap();
    let folder = FolderSpec { path: work.clone(), name: Some("work".into()), mode: ShareMode::Rw };
    let started = Instant::now();
    let a = client
        .call::<SessionStart>(StartParams { name: "a".into(), folders: vec![folder], ..Default::default() })
        .await
        .unwrap();
    let took = started.elapsed();
    assert!(vm(&a).from_pool, "{a:?}");
    assert!(
        vm(&a).pids.iter().all(|p| pooled.contains(p)),
        "the pooled VM's processes: {:?} of {pooled:?}",
        vm(&a).pids
    );
    println!("pool: session.start took {} ms with a pooled VM", took.as_millis());

    // Folders, outputs and the session disk work as in a booted-for-it VM.
    let out = run(&client, &mut inbox, "a", "cat /sessions/a/mnt/work/from-host; echo guest > /sessions/a/mnt/work/from-guest; echo kept > /root/marker; echo out > /sessions/a/mnt/outputs/o; hostname").await;
    assert!(out.starts_with("host\n"), "{out}");
    assert_eq!(std::fs::read(work.join("from-guest")).unwrap(), b"guest\n");
    let storage = daemon.dir.0.join("data/umbra/sessions/a");
    assert!(storage.join("disk.img").is_file(), "the pooled disk became the session's");
    assert_eq!(std::fs::read(storage.join("outputs/o")).unwrap(), b"out\n");

    // The pool refills in the background.
    let status = wait_pool(&client, "a replacement", |s| s.ready == 1 && s.taken == 1).await;
    assert!(status.last_error.is_none(), "{status:?}");

    // A start with other memory cannot use the pool's VM: it boots its own, the pool keeps its.
    let other = StartParams {
        name: "b".into(),
        settings: umbra_api::session::SettingsPatch { memory_mib: Some(320), ..Default::default() },
        ..Default::default()
    };
    let b = client.call::<SessionStart>(other).await.unwrap();
    assert!(!vm(&b).from_pool);
    assert_eq!(client.call::<PoolStatusMethod>(NoParams {}).await.unwrap().ready, 1);

    // The session's disk is its own: a resume boots a fresh VM (never the pool's) on it.
    client.call::<SessionStop>(SessionRef { name: "a".into() }).await.unwrap();
    let a = client.call::<SessionResume>(ResumeParams { name: "a".into(), discard_snapshot: false }).await.unwrap();
    assert!(!vm(&a).from_pool, "a resume has a disk: it boots");
    assert_eq!(run(&client, &mut inbox, "a", "cat /root/marker").await, "kept\n");

    // Switching the pool off kills its VM (as many host processes as the first pooled VM had);
    // the sessions' stay.
    let before: Vec<u32> = daemon.helpers().into_iter().map(|(pid, _)| pid).collect();
    client.call::<ConfigSet>(ConfigPatch { pool_size: Some(0), ..Default::default() }).await.unwrap();
    wait_pool(&client, "empty", |s| s.ready == 0 && s.target == 0).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left: Vec<u32> = daemon.helpers().into_iter().map(|(pid, _)| pid).collect();
        assert!(left.iter().all(|p| before.contains(p)), "nothing new starts: {left:?} vs {before:?}");
        if left.len() == before.len() - pooled.len() {
            break;
        }
        assert!(Instant::now() < deadline, "the pool's VM outlived it: {left:?} of {before:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for s in [&a, &b] {
        let left = daemon.helpers();
        assert!(vm(s).pids.iter().all(|p| left.iter().any(|(l, _)| l == p)), "{} lost its VM", s.name);
    }
    assert!(
        !daemon.dir.0.join("data/umbra/pool").read_dir().is_ok_and(|mut d| d.next().is_some()),
        "no pool disk left"
    );
    for s in ["a", "b"] {
        client.call::<SessionDelete>(SessionRef { name: s.into() }).await.unwrap();
    }
    daemon.assert_no_helpers_within(Duration::from_secs(10));
}
