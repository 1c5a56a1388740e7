//! The fault suite (issue 16), over umbrad's real socket with real VMs: the VMM SIGKILLed, the
//! agent killed, a guest kernel panic, virtiofsd killed, the host disk full under a session,
//! truncated and corrupt bundles, umbrad SIGKILLed and restarted, and 32 concurrent session
//! starts. Each case must end with recovery or a clear error, no process of a dead VM left
//! behind, and no host data lost. The suite prints one summary line with its case counts.
//!
//! Each case runs as its own task, so a case that panics (a helper's wait that timed out)
//! counts as that case failing and the suite goes on.

use std::future::Future;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use umbra_api::client::Client;
use umbra_api::methods::*;
use umbra_api::session::SettingsPatch;
use umbra_api::{EventKind, FolderSpec, SessionStatus};
use umbra_proto::ShareMode;
use umbra_tests::comm;
use umbra_tests::daemon::{boot_timeout_secs, process_output, wait_event, Inbox, TestDaemon};

type Outcome = Result<String, String>;
type Case = Pin<Box<dyn Future<Output = Outcome> + Send>>;

fn sh(session: &str, script: &str) -> SpawnParams {
    SpawnParams { session: session.into(), argv: vec!["sh".into(), "-c".into(), script.into()], ..Default::default() }
}

fn boot_wait() -> Duration {
    Duration::from_secs(boot_timeout_secs() + 30)
}

const RUN: Duration = Duration::from_secs(60);

/// Overwrites PID 1's code through /proc/1/mem, so the agent faults.
const KILL_AGENT: &str = "set -- $(grep ' r-xp ' /proc/1/maps | head -1 | cut -d' ' -f1 | tr - ' '); \
    dd if=/dev/zero of=/proc/1/mem bs=4096 seek=$((0x$1 / 4096)) count=$(((0x$2 - 0x$1) / 4096)) conv=notrunc; \
    while true; do echo wake-the-agent; sleep 0.1; done";

/// Each guest process that is in uninterruptible sleep or is `dd`, with its kernel stack, and
/// the kernel's last messages: where a guest waits when a command does not end.
const GUEST_WAITS: &str = "for p in /proc/[0-9]*; do s=$(cut -d' ' -f3 $p/stat 2>/dev/null); \
    if [ \"$s\" = D ] || [ \"$(cat $p/comm 2>/dev/null)\" = dd ]; then \
    echo \"${p#/proc/} $(cat $p/comm) $s $(cat $p/wchan 2>/dev/null)\"; cat $p/stack 2>/dev/null; fi; done; \
    dmesg | tail -n 20";

async fn run(client: &Client, notes: &mut Inbox, session: &str, script: &str) -> (Option<i32>, String) {
    run_for(client, notes, session, script, RUN).await
}

async fn run_for(
    client: &Client,
    notes: &mut Inbox,
    session: &str,
    script: &str,
    limit: Duration,
) -> (Option<i32>, String) {
    let p = client.call::<ProcessSpawn>(sh(session, script)).await.map_err(|e| e.to_string());
    let p = match p {
        Ok(p) => p,
        Err(e) => return (None, format!("spawn failed: {e}")),
    };
    let (out, err, exit) = process_output(client, notes, session, p.process, limit).await;
    (exit.code, String::from_utf8_lossy(&out).into_owned() + &String::from_utf8_lossy(&err))
}

fn alive(pid: u32) -> bool {
    umbra_tests::process_state(pid).is_some_and(|s| s != 'Z')
}

/// Waits until none of `pids` is alive (a zombie awaiting its reaper counts as gone).
async fn gone_within(pids: &[u32], limit: Duration) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    loop {
        let left: Vec<u32> = pids.iter().copied().filter(|p| alive(*p)).collect();
        if left.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            let names: Vec<String> = left
                .iter()
                .map(|p| std::fs::read_to_string(format!("/proc/{p}/comm")).unwrap_or_default().trim().to_string())
                .collect();
            return Err(format!("processes of the dead VM still run after {limit:?}: {left:?} {names:?}"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn session_pids(client: &Client, name: &str) -> Vec<u32> {
    let info = client.call::<SessionGet>(SessionRef { name: name.into() }).await.unwrap();
    info.vm.map(|v| v.pids).unwrap_or_default()
}

/// A ready session `name` with a rwd folder holding `seen.txt` and a mark on its disk.
async fn ready_session(daemon: &TestDaemon, name: &str) -> (Client, Inbox, PathBuf) {
    let (client, mut notes) = daemon.client().await;
    let work = daemon.dir.0.join(format!("work-{name}"));
    std::fs::create_dir_all(&work).unwrap();
    std::fs::write(work.join("seen.txt"), b"host\n").unwrap();
    client.call::<EventsSubscribe>(SubscribeParams { session: Some(name.into()) }).await.unwrap();
    // rwd, not rw: an rw share puts spawned processes under landlock, which (rightly) denies
    // them the ptrace access that writing /proc/1/mem needs.
    let folder = FolderSpec { path: work.clone(), name: Some("work".into()), mode: ShareMode::Rwd };
    let start = StartParams { name: name.into(), folders: vec![folder], ..Default::default() };
    client.call::<SessionStart>(start).await.unwrap();
    let (code, out) = run(&client, &mut notes, name, "echo kept > /root/on-disk.txt && sync").await;
    assert_eq!(code, Some(0), "{out}");
    (client, notes, work)
}

/// Breaks the session's VM with `breaker` and checks the whole recovery: a running process
/// ends lost (SIGKILL) naming the restart, the session restarts and is ready again, its disk
/// and folder survive, the dead VM's host processes are all gone.
async fn break_and_recover(
    daemon: Arc<TestDaemon>,
    name: &'static str,
    breaker: impl FnOnce(&[u32]) -> Option<String> + Send + 'static,
) -> Outcome {
    let (client, mut notes, work) = ready_session(&daemon, name).await;
    let old = session_pids(&client, name).await;
    let sleeper = client.call::<ProcessSpawn>(sh(name, "sleep 600")).await.map_err(|e| e.to_string())?;
    let started = Instant::now();
    if let Some(script) = breaker(&old) {
        let _ = client.call::<ProcessSpawn>(sh(name, &script)).await;
    }
    let (_, _, exit) = process_output(&client, &mut notes, name, sleeper.process, boot_wait()).await;
    if !(exit.lost && exit.signal == Some(9)) {
        return Err(format!("the running process did not end lost by SIGKILL: {exit:?}"));
    }
    let reason = exit.reason.clone().unwrap_or_default();
    wait_event(&mut notes, boot_wait(), "ready again", |e| {
        matches!(e.kind, EventKind::Status { status: SessionStatus::Ready, .. })
    })
    .await;
    let recovered = started.elapsed();
    let (code, out) =
        run(&client, &mut notes, name, &format!("cat /root/on-disk.txt /sessions/{name}/mnt/work/seen.txt")).await;
    if (code, out.as_str()) != (Some(0), "kept\nhost\n") {
        return Err(format!("the disk or the folder did not survive: {code:?} {out:?}"));
    }
    gone_within(&old, Duration::from_secs(10)).await?;
    if std::fs::read(work.join("seen.txt")).unwrap() != b"host\n" {
        return Err("the host folder changed".into());
    }
    let info = client.call::<SessionGet>(SessionRef { name: name.into() }).await.unwrap();
    client.call::<SessionDelete>(SessionRef { name: name.into() }).await.map_err(|e| e.to_string())?;
    Ok(format!(
        "ready again in {recovered:.1?} ({} restart); the process ended lost: {reason:?}; disk and folder intact; \
         {} old processes gone",
        info.restarts,
        old.len()
    ))
}

fn kill9_helper(pids: &[u32], name_prefix: &str) -> Result<u32, String> {
    // The helper itself, not its jail's relay (which would take it down all the same).
    let pid = umbra_tests::with_descendants(pids)
        .into_iter()
        .find(|p| comm(*p).starts_with(name_prefix))
        .ok_or_else(|| format!("no {name_prefix} among the VM's processes {pids:?}"))?;
    // SAFETY: kill(2) of a process this test's daemon started.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    Ok(pid)
}

fn vmm_sigkill(daemon: Arc<TestDaemon>) -> Case {
    Box::pin(break_and_recover(daemon, "vmm", |pids| {
        // QEMU here; umbra-vmm (its jail's parent) where the session runs on KVM.
        let _ = kill9_helper(pids, "qemu-system").or_else(|_| kill9_helper(pids, "umbra-vmm"));
        None
    }))
}

fn agent_killed(daemon: Arc<TestDaemon>) -> Case {
    Box::pin(break_and_recover(daemon, "agent", |_| Some(KILL_AGENT.to_string())))
}

fn guest_panic(daemon: Arc<TestDaemon>) -> Case {
    Box::pin(break_and_recover(daemon, "panic", |_| Some("echo c > /proc/sysrq-trigger".to_string())))
}

fn virtiofsd_killed(daemon: Arc<TestDaemon>) -> Case {
    Box::pin(break_and_recover(daemon, "fsd", |pids| {
        // virtiofsd is umbra-fsd's descendant (through its pid namespace's relay).
        let fsd: Vec<u32> = pids.iter().copied().filter(|p| comm(*p) == "umbra-fsd").collect();
        let _ = kill9_helper(&fsd, "virtiofsd");
        None
    }))
}

/// The host filesystem under the session's disk fills up while the guest writes: the guest
/// gets I/O errors (not a paused VM), the agent and the daemon keep answering, and once the
/// host has room again the session works and nothing already written is lost.
fn host_disk_full(daemon_dir: PathBuf) -> Case {
    Box::pin(async move {
        let data = daemon_dir.join("data");
        std::fs::create_dir_all(&data).unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=96m", "umbra-faults-full"])
            .arg(&data)
            .status()
            .map_err(|e| format!("mount a small tmpfs (needs root): {e}"))?;
        if !mounted.success() {
            return Err("mount of a 96 MiB tmpfs failed (the suite runs as root)".into());
        }
        let outcome = async {
            let mut daemon = TestDaemon::start_in(daemon_dir.clone(), serde_json::json!({ "disk_size_mib": 512 }));
            let (client, mut notes) = daemon.client().await;
            client
                .call::<SessionStart>(StartParams { name: "full".into(), ..Default::default() })
                .await
                .map_err(|e| e.to_string())?;
            let (code, out) = run(&client, &mut notes, "full", "echo kept > /root/kept && sync && echo ok").await;
            if code != Some(0) {
                return Err(format!("the first write failed: {out}"));
            }
            // More than the host has: the host's ENOSPC reaches the guest as I/O errors.
            let fill = "dd if=/dev/zero of=/root/big bs=1M count=200 conv=fsync 2>&1 | tail -2; sync; echo done";
            let p = client.call::<ProcessSpawn>(sh("full", fill)).await.map_err(|e| e.to_string())?;
            let limit = Duration::from_secs(240);
            let filled = process_output(&client, &mut notes, "full", p.process, limit + RUN);
            let (code, out) = match tokio::time::timeout(limit, filled).await {
                Ok((out, err, exit)) => {
                    (exit.code, String::from_utf8_lossy(&out).into_owned() + &String::from_utf8_lossy(&err))
                }
                // Seen once in CI (not reproduced in 9 runs since): say where the guest waits.
                Err(_) => {
                    let (_, guest) = run(&client, &mut notes, "full", GUEST_WAITS).await;
                    return Err(format!("the filling command did not end within {limit:?}; in the guest:\n{guest}"));
                }
            };
            if code != Some(0) || !out.contains("done") {
                return Err(format!("the filling command did not finish: {code:?} {out}"));
            }
            let df = std::process::Command::new("df").arg("-m").arg(&data).output().unwrap();
            let df = String::from_utf8_lossy(&df.stdout).lines().last().unwrap_or_default().to_string();
            // The agent and the daemon still answer; the session was not restarted or paused.
            let (code, alive) = run(&client, &mut notes, "full", "cat /root/kept").await;
            let info =
                client.call::<SessionGet>(SessionRef { name: "full".into() }).await.map_err(|e| e.to_string())?;
            if code != Some(0) || alive != "kept\n" || info.status != SessionStatus::Ready {
                return Err(format!("after the host filled: {code:?} {alive:?} {:?}", info.status));
            }
            let _ = run(&client, &mut notes, "full", "rm -f /root/big; sync; fstrim / 2>/dev/null; true").await;
            client.call::<SessionDelete>(SessionRef { name: "full".into() }).await.map_err(|e| e.to_string())?;
            daemon.terminate();
            daemon.assert_no_helpers_within(Duration::from_secs(10));
            let errors = out.lines().filter(|l| l.contains("error") || l.contains("No space")).count();
            Ok(format!(
                "a 512 MiB disk on a 96 MiB host filesystem: the guest saw I/O errors ({errors} lines: {:?}); the \
                 session stayed ready, earlier data intact; host `{df}`",
                out.lines().next().unwrap_or_default()
            ))
        }
        .await;
        let _ = std::process::Command::new("umount").arg("-l").arg(&data).status();
        outcome
    })
}

/// A bundle directory with one artifact damaged by `damage`.
fn damaged_bundle(dir: &Path, tag: &str, damage: impl Fn(&Path)) -> PathBuf {
    let src = umbra_tests::test_bundle("minimal");
    let out = dir.join(format!("bundle-{tag}"));
    std::fs::create_dir_all(&out).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), out.join(entry.file_name())).unwrap();
    }
    // Another version, so nothing extracted from the intact bundle stands in for it.
    let mut manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    let version = format!("{}-{tag}-{}", manifest["bundle_version"].as_str().unwrap(), std::process::id());
    manifest["bundle_version"] = version.into();
    std::fs::write(out.join("manifest.json"), serde_json::to_vec_pretty(&manifest).unwrap()).unwrap();
    let kernel = manifest["artifacts"]
        .as_array()
        .and_then(|a| a.iter().find(|x| x["name"] == "kernel"))
        .and_then(|k| k["file"].as_str())
        .unwrap_or("kernel.zst")
        .to_string();
    damage(&out.join(kernel));
    out
}

/// Starts with a truncated and a corrupt bundle fail with an error naming the problem, leave
/// no session running and no process behind; the daemon and its other sessions go on.
fn bad_bundles(daemon: Arc<TestDaemon>) -> Case {
    Box::pin(async move {
        let (client, _notes) = daemon.client().await;
        let truncated = damaged_bundle(&daemon.dir.0, "truncated", |f| {
            let len = std::fs::metadata(f).unwrap().len();
            std::fs::OpenOptions::new().write(true).open(f).unwrap().set_len(len / 2).unwrap();
        });
        let corrupt = damaged_bundle(&daemon.dir.0, "corrupt", |f| {
            let mut bytes = std::fs::read(f).unwrap();
            let mid = bytes.len() / 2;
            bytes[mid] ^= 0xff;
            std::fs::write(f, bytes).unwrap();
        });
        let before = daemon.helpers().len();
        let mut notes = Vec::new();
        for (tag, bundle) in [("truncated", truncated), ("corrupt", corrupt)] {
            let settings = SettingsPatch { bundle: Some(bundle.display().to_string()), ..Default::default() };
            let start = StartParams { name: format!("b-{tag}"), settings, ..Default::default() };
            let err = match client.call::<SessionStart>(start).await {
                Ok(info) => return Err(format!("a {tag} bundle started a session: {:?}", info.status)),
                Err(e) => e.to_string(),
            };
            let named = ["sha256", "checksum", "digest", "size", "truncated", "corrupt", "mismatch"];
            if !named.iter().any(|w| err.to_lowercase().contains(w)) {
                return Err(format!("the {tag} bundle's error does not say what is wrong: {err}"));
            }
            notes.push(format!("{tag}: {err}"));
        }
        let cache = umbra_tests::cache_dir().join("extracted");
        let left: Vec<_> = std::fs::read_dir(&cache)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name())
                    .map(|n| n.to_string_lossy().into_owned())
                    // An extraction's lock file stays (removing it under a waiter would race).
                    .filter(|n| !n.starts_with('.') && n.contains(&format!("-{}", std::process::id())))
                    .collect()
            })
            .unwrap_or_default();
        if !left.is_empty() {
            return Err(format!("a failed verification left extractions in {}: {left:?}", cache.display()));
        }
        if daemon.helpers().len() > before {
            return Err(format!("a failed start left processes: {:?}", daemon.helpers()));
        }
        // The good bundle still boots.
        client
            .call::<SessionStart>(StartParams { name: "b-good".into(), ..Default::default() })
            .await
            .map_err(|e| format!("the intact bundle no longer starts: {e}"))?;
        client.call::<SessionDelete>(SessionRef { name: "b-good".into() }).await.map_err(|e| e.to_string())?;
        Ok(notes.join("; "))
    })
}

/// umbrad SIGKILLed with a session running: its VM dies with it (no process left), a new
/// daemon lists the session as stopped naming the daemon, resumes it with its disk and folder.
fn umbrad_sigkill(daemon_dir: PathBuf) -> Case {
    Box::pin(async move {
        let mut daemon = TestDaemon::start_in(daemon_dir, serde_json::json!({}));
        let work = daemon.dir.0.join("work");
        std::fs::create_dir_all(&work).unwrap();
        std::fs::write(work.join("seen.txt"), b"host\n").unwrap();
        {
            let (client, mut notes) = daemon.client().await;
            let folder = FolderSpec { path: work.clone(), name: None, mode: ShareMode::Rwd };
            client
                .call::<SessionStart>(StartParams { name: "k".into(), folders: vec![folder], ..Default::default() })
                .await
                .map_err(|e| e.to_string())?;
            let (code, out) = run(&client, &mut notes, "k", "echo before > /root/mark && sync").await;
            if code != Some(0) {
                return Err(format!("the first write failed: {out}"));
            }
        }
        let helpers = daemon.helpers().len();
        let killed = Instant::now();
        daemon.kill9();
        daemon.assert_no_helpers_within(Duration::from_secs(5));
        let cleaned = killed.elapsed();

        daemon.launch();
        let (client, mut notes) = daemon.client().await;
        let list = client.call::<SessionListMethod>(NoParams {}).await.map_err(|e| e.to_string())?;
        let k = list.sessions.iter().find(|s| s.name == "k").ok_or("the session record was lost")?;
        if k.status != SessionStatus::Stopped || !k.last_error.as_deref().unwrap_or("").contains("daemon") {
            return Err(format!("after the restart: {:?} {:?}", k.status, k.last_error));
        }
        let info = client
            .call::<SessionResume>(ResumeParams { name: "k".into(), discard_snapshot: false })
            .await
            .map_err(|e| e.to_string())?;
        let (code, out) = run(&client, &mut notes, "k", "cat /root/mark /sessions/k/mnt/work/seen.txt").await;
        if info.status != SessionStatus::Ready || code != Some(0) || out != "before\nhost\n" {
            return Err(format!("the resumed session lost data: {:?} {code:?} {out:?}", info.status));
        }
        client.call::<SessionDelete>(SessionRef { name: "k".into() }).await.map_err(|e| e.to_string())?;
        daemon.terminate();
        daemon.assert_no_helpers_within(Duration::from_secs(10));
        Ok(format!(
            "{helpers} VM processes gone within {cleaned:.1?} of the kill; the new daemon resumed the session with \
             its disk and folder"
        ))
    })
}

/// 32 session starts at once on one connection: admission queues boots (and says so), all
/// become ready, each runs a command, none restarted or panicked.
fn concurrent_starts(daemon_dir: PathBuf) -> Case {
    Box::pin(async move {
        let daemon = TestDaemon::start_in(daemon_dir, serde_json::json!({ "memory_mib": 128 }));
        let (client, mut notes) = daemon.client().await;
        client.call::<EventsSubscribe>(SubscribeParams { session: None }).await.map_err(|e| e.to_string())?;
        let started = Instant::now();
        let starts =
            (0..32).map(|i| client.call::<SessionStart>(StartParams { name: format!("s{i}"), ..Default::default() }));
        let results = futures_util::future::join_all(starts).await;
        let took = started.elapsed();
        for (i, r) in results.iter().enumerate() {
            match r {
                Ok(info) if info.status == SessionStatus::Ready => {}
                Ok(info) => return Err(format!("s{i}: {:?}", info.status)),
                Err(e) => return Err(format!("s{i}: {e}")),
            }
        }
        let mut queued = 0;
        while let Ok(Some(n)) = tokio::time::timeout(Duration::from_millis(200), notes.next_raw()).await {
            if serde_json::to_string(&n.params).unwrap().contains("\"boot_queued\"") {
                queued += 1;
            }
        }
        if queued == 0 {
            return Err("no start was queued (or none said so)".into());
        }
        for i in 0..32 {
            let s = format!("s{i}");
            let (_, out) = run(&client, &mut notes, &s, &format!("echo {i}")).await;
            if out != format!("{i}\n") {
                return Err(format!("{s} answered {out:?}"));
            }
            let logs = client.call::<SessionLogsMethod>(LogsParams { name: s.clone(), lines: Some(1000) }).await;
            let logs = logs.map_err(|e| e.to_string())?;
            let info = client.call::<SessionGet>(SessionRef { name: s.clone() }).await.map_err(|e| e.to_string())?;
            if logs.console.iter().any(|l| l.contains("Kernel panic")) || info.restarts != 0 {
                return Err(format!("{s}: {} restarts, console {:?}", info.restarts, logs.console));
            }
        }
        drop(client);
        let mut daemon = daemon;
        daemon.terminate();
        daemon.assert_no_helpers_within(Duration::from_secs(20));
        Ok(format!("32 sessions ready in {took:.1?} ({queued} boots queued first); each ran a command"))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fault_ends_in_recovery_or_a_clear_error_with_nothing_lost() {
    let daemon = Arc::new(TestDaemon::start("faults", serde_json::json!({ "max_restarts": 10 })));
    let root = daemon.dir.0.clone();
    let cases: Vec<(&str, Case)> = vec![
        ("VMM SIGKILL", vmm_sigkill(daemon.clone())),
        ("agent killed", agent_killed(daemon.clone())),
        ("guest kernel panic", guest_panic(daemon.clone())),
        ("virtiofsd killed", virtiofsd_killed(daemon.clone())),
        ("truncated and corrupt bundles", bad_bundles(daemon.clone())),
        ("host disk full under a session", host_disk_full(root.join("full"))),
        ("umbrad SIGKILL and restart", umbrad_sigkill(root.join("kill9"))),
        ("32 concurrent session starts", concurrent_starts(root.join("burst"))),
    ];
    let only = std::env::var("UMBRA_FAULTS_ONLY").ok();
    let total = cases.iter().filter(|(n, _)| only.as_ref().is_none_or(|o| n.contains(o.as_str()))).count();
    let (mut held, mut failed) = (0, Vec::new());
    for (name, case) in cases {
        if only.as_ref().is_some_and(|o| !name.contains(o.as_str())) {
            continue;
        }
        let started = Instant::now();
        let outcome = match tokio::spawn(case).await {
            Ok(outcome) => outcome,
            Err(e) if e.is_panic() => {
                let p = e.into_panic();
                Err(p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "the case panicked".into()))
            }
            Err(e) => Err(e.to_string()),
        };
        match outcome {
            Ok(note) => {
                held += 1;
                eprintln!("fault [{name}]: recovered ({:.1?}): {note}", started.elapsed());
            }
            Err(why) => {
                eprintln!("fault [{name}]: FAILED: {why}");
                failed.push(name);
            }
        }
    }
    // Straight to the stderr handle, which the test harness does not capture: the summary
    // shows in every run's log, passing or not.
    let _ = writeln!(
        std::io::stderr(),
        "fault suite: {total} cases, {held} ended in recovery or a clear error, {} failed",
        failed.len()
    );
    let mut daemon = Arc::try_unwrap(daemon).ok().expect("every case has ended");
    daemon.terminate();
    daemon.assert_no_helpers_within(Duration::from_secs(20));
    assert!(failed.is_empty(), "failed cases: {failed:?}");
}
