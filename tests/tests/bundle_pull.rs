//! Bundle downloads against a real HTTP server on 127.0.0.1 that misbehaves on cue: each failure
//! gives the right error, and after every failure the previous bundle is still current and
//! byte-identical, with no temp files left.

mod bundle_support;

use std::time::{Duration, Instant};

use bundle_support::*;
use umbra_bundle::testserver::Fault;
use umbra_bundle::{BundleError, ManifestError, Phase, PullOptions, PulledHow};

#[test]
fn a_good_bundle_installs_becomes_current_and_verifies() {
    let env = Env::new("bundle-good");
    let m = env.bundle("v1", 1_000_000, 2_000_000);
    let pulled = env.pull("v1").unwrap();
    assert_eq!(pulled.how, PulledHow::Downloaded);
    assert_eq!(pulled.downloaded, m.artifacts.iter().map(|a| a.compressed_size).sum::<u64>());
    assert_eq!(env.store.current().as_deref(), Some("v1"));
    let checks = env.store.verify("current").unwrap();
    assert_eq!(checks.len(), 2);
    assert!(checks.iter().all(|c| c.ok()), "{checks:?}");
    let kernel = env.store.get("v1").unwrap().kernel();
    assert_eq!(std::fs::metadata(&kernel).unwrap().len(), 1_000_000);
    assert_eq!(leftovers(env.store.root()), Vec::<std::path::PathBuf>::new());

    // Pulling it again downloads nothing.
    let n = env.server.requests().len();
    assert_eq!(env.pull("v1").unwrap().how, PulledHow::AlreadyInstalled);
    let again: Vec<_> = env.server.requests()[n..].iter().map(|r| r.path.clone()).collect();
    assert_eq!(again, ["/v1/manifest.json", "/v1/manifest.sig"], "the signature is checked every time");
}

#[test]
fn a_corrupted_byte_is_named_and_not_retried() {
    let env = Env::new("bundle-corrupt");
    let before = install_previous(&env);
    let m = env.bundle("v2", 500_000, 1_000_000);
    let a = m.artifacts.iter().find(|a| a.name == "initramfs").unwrap();
    env.server.push_fault(&env.path("v2", "initramfs.zst"), Fault::CorruptByte(a.compressed_size / 2));
    let e = env.pull("v2").unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, BundleError::DigestMismatch { kind: "compressed", .. }), "{msg}");
    assert!(msg.contains("artifact initramfs") && msg.contains(&env.server.url("v2/initramfs.zst")), "{msg}");
    assert!(msg.contains(&a.compressed_sha256), "names the expected digest: {msg}");
    assert_eq!(env.server.count(&env.path("v2", "initramfs.zst")), 1, "a checksum mismatch is not retried");
    assert_untouched(&env.store, "v1", &before);
}

#[test]
fn a_truncated_body_is_a_size_mismatch() {
    let env = Env::new("bundle-truncated");
    let before = install_previous(&env);
    let m = env.bundle("v2", 500_000, 1_000_000);
    let k = m.artifacts.iter().find(|a| a.name == "kernel").unwrap();
    // The body ends early and cleanly (no Content-Length, then close): a truncated file.
    env.server.push_fault(&env.path("v2", "kernel.zst"), Fault::Truncate(k.compressed_size - 1000));
    let e = env.pull("v2").unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(e, BundleError::SizeMismatch { kind: "compressed", expected, actual, .. }
            if expected == k.compressed_size && actual == k.compressed_size - 1000),
        "{msg}"
    );
    assert!(msg.contains(&env.server.url("v2/kernel.zst")), "{msg}");
    assert_eq!(env.server.count(&env.path("v2", "kernel.zst")), 1);
    assert_untouched(&env.store, "v1", &before);
}

#[test]
fn a_wrong_content_length_is_refused_before_the_body() {
    let env = Env::new("bundle-length");
    let before = install_previous(&env);
    let m = env.bundle("v2", 500_000, 1_000_000);
    let k = m.artifacts.iter().find(|a| a.name == "kernel").unwrap();
    for announced in [k.compressed_size - 7, k.compressed_size + 7] {
        env.server.push_fault(&env.path("v2", "kernel.zst"), Fault::ContentLength(announced));
        let e = env.pull("v2").unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(e, BundleError::SizeMismatch { expected, actual, .. } if expected == k.compressed_size && actual == announced),
            "{msg}"
        );
        assert!(msg.contains("Content-Length") && msg.contains(&env.server.url("v2/kernel.zst")), "{msg}");
        assert_untouched(&env.store, "v1", &before);
    }
    assert_eq!(env.server.count(&env.path("v2", "kernel.zst")), 2, "not retried");
}

#[test]
fn a_500_is_retried_and_a_404_is_not() {
    let env = Env::new("bundle-5xx");
    let before = install_previous(&env);
    env.bundle("v2", 500_000, 1_000_000);
    env.server.push_fault(&env.path("v2", "manifest.json"), Fault::Status(503));
    env.server.push_fault(&env.path("v2", "kernel.zst"), Fault::Status(500));
    env.server.push_fault(&env.path("v2", "kernel.zst"), Fault::Status(502));
    let mut retries = Vec::new();
    let pulled = env.store.pull(&env.url("v2"), &fast(), &mut |p| {
        if p.phase == Phase::Retry {
            retries.push(p.message.clone().unwrap_or_default());
        }
    });
    assert_eq!(pulled.unwrap().how, PulledHow::Downloaded);
    assert_eq!(env.server.count(&env.path("v2", "manifest.json")), 2);
    assert_eq!(env.server.count(&env.path("v2", "kernel.zst")), 3);
    assert!(retries.iter().any(|m| m.contains("HTTP 500")), "{retries:?}");
    assert_eq!(env.store.current().as_deref(), Some("v2"));

    // A 404 fails at once; a 500 that persists gives up after the retries.
    let env = Env::new("bundle-4xx");
    let before_v1 = install_previous(&env);
    let _ = before;
    env.bundle("v3", 500_000, 1_000_000);
    env.server.push_fault(&env.path("v3", "initramfs.zst"), Fault::Status(404));
    let e = env.pull("v3").unwrap_err();
    assert!(matches!(e, BundleError::Http { status: 404, .. }), "{e}");
    assert!(
        e.to_string().contains("not retried") && e.to_string().contains(&env.server.url("v3/initramfs.zst")),
        "{e}"
    );
    assert_eq!(env.server.count(&env.path("v3", "initramfs.zst")), 1);
    assert_untouched(&env.store, "v1", &before_v1);

    env.server.set_faults(&env.path("v3", "initramfs.zst"), vec![Fault::Status(500)]);
    let e = env.pull("v3").unwrap_err();
    assert!(matches!(e, BundleError::Http { status: 500, .. }), "{e}");
    assert!(e.to_string().contains("still failing after retries"), "{e}");
    assert_eq!(env.server.count(&env.path("v3", "initramfs.zst")), 1 + 5, "first try and 4 retries");
    assert_eq!(env.store.current().as_deref(), Some("v1"));
    assert_eq!(snapshot(&env.store.root().join("v1")), before_v1);
    // The kernel, verified before the server broke, is kept for the next pull (see
    // docs/bundle.md); nothing else is.
    let kept: Vec<_> = leftovers(env.store.root()).into_iter().map(|p| p.display().to_string()).collect();
    assert_eq!(kept, [".staging/v3", ".staging/v3/kernel"]);
    env.server.set_faults(&env.path("v3", "initramfs.zst"), vec![]);
    let kernel_gets = env.server.count(&env.path("v3", "kernel.zst"));
    env.pull("v3").unwrap();
    assert_eq!(env.server.count(&env.path("v3", "kernel.zst")), kernel_gets, "the kept kernel is not fetched again");
    assert_eq!(leftovers(env.store.root()), Vec::<std::path::PathBuf>::new());
}

#[test]
fn a_dropped_connection_resumes_with_a_range_request() {
    let env = Env::new("bundle-drop");
    let m = env.bundle("v1", 2_000_000, 3_000_000);
    let i = m.artifacts.iter().find(|a| a.name == "initramfs").unwrap();
    let cut = i.compressed_size / 3;
    let path = env.path("v1", "initramfs.zst");
    env.server.push_fault(&path, Fault::DropAfter(cut));
    env.server.push_fault(&path, Fault::DropAfter(2 * cut));
    let pulled = env.pull("v1").unwrap();
    assert_eq!(pulled.downloaded, m.artifacts.iter().map(|a| a.compressed_size).sum::<u64>(), "nothing twice");
    let ranges: Vec<_> = env.server.requests().into_iter().filter(|r| r.path == path).map(|r| r.range).collect();
    assert_eq!(ranges, [None, Some(format!("bytes={cut}-")), Some(format!("bytes={}-", 2 * cut))]);
    assert!(env.store.verify("v1").unwrap().iter().all(|c| c.ok()));
    assert_eq!(leftovers(env.store.root()), Vec::<std::path::PathBuf>::new());
}

#[test]
fn a_server_ignoring_range_is_read_from_the_start() {
    let env = Env::new("bundle-norange");
    let m = env.bundle("v1", 500_000, 2_000_000);
    let i = m.artifacts.iter().find(|a| a.name == "initramfs").unwrap();
    let path = env.path("v1", "initramfs.zst");
    env.server.set_faults(&path, vec![Fault::IgnoreRange]);
    env.server.push_fault(&path, Fault::DropAfter(i.compressed_size / 2));
    env.pull("v1").unwrap();
    let ranges: Vec<_> = env.server.requests().into_iter().filter(|r| r.path == path).map(|r| r.range).collect();
    assert_eq!(ranges, [None, Some(format!("bytes={}-", i.compressed_size / 2))]);
    assert!(env.store.verify("current").unwrap().iter().all(|c| c.ok()));
}

#[test]
fn an_interrupted_pull_resumes_in_the_next_one() {
    let env = Env::new("bundle-resume");
    let before = install_previous(&env);
    let m = env.bundle("v2", 500_000, 2_000_000);
    let i = m.artifacts.iter().find(|a| a.name == "initramfs").unwrap();
    let path = env.path("v2", "initramfs.zst");
    // Every attempt of the first pull is cut at the same byte: it gives up, keeping the bytes.
    env.server.set_faults(&path, vec![Fault::DropAfter(i.compressed_size / 2)]);
    let mut opts = fast();
    opts.retry.retries = 1;
    let e = env.store.pull(&env.url("v2"), &opts, &mut |_| {}).unwrap_err();
    assert!(matches!(e, BundleError::Network { .. }), "{e}");
    assert!(e.to_string().contains(&env.server.url("v2/initramfs.zst")), "{e}");
    assert_eq!(env.store.current().as_deref(), Some("v1"));
    assert_eq!(snapshot(&env.store.root().join("v1")), before);

    env.server.set_faults(&path, vec![]);
    let n = env.server.requests().len();
    let pulled = env.pull("v2").unwrap();
    let resumed: Vec<_> =
        env.server.requests()[n..].iter().filter(|r| r.path == path).map(|r| r.range.clone()).collect();
    assert_eq!(resumed, [Some(format!("bytes={}-", i.compressed_size / 2))]);
    assert_eq!(pulled.downloaded, i.compressed_size - i.compressed_size / 2, "only the rest of initramfs");
    assert_eq!(env.store.current().as_deref(), Some("v2"));
    assert!(env.store.verify("v2").unwrap().iter().all(|c| c.ok()));
    assert_eq!(leftovers(env.store.root()), Vec::<std::path::PathBuf>::new());
}

#[test]
fn a_slow_server_keeps_progress_coming() {
    let env = Env::new("bundle-slow");
    let m = env.bundle("v1", 100_000, 2_000_000);
    let total: u64 = m.artifacts.iter().map(|a| a.compressed_size).sum();
    env.server.set_faults(
        &env.path("v1", "initramfs.zst"),
        vec![Fault::Slow { chunk: 8 * 1024, delay: Duration::from_millis(25) }],
    );
    let start = Instant::now();
    let mut events = Vec::new();
    env.store
        .pull(&env.url("v1"), &fast(), &mut |p| {
            if p.phase == Phase::Download {
                events.push((start.elapsed(), p.clone()));
            }
        })
        .unwrap();
    let took = start.elapsed();
    assert!(took > Duration::from_millis(800), "the server really was slow: {took:?}");
    assert!(events.len() >= 8, "{} download events in {took:?}", events.len());
    // Never silent for long, always moving forward, with a rate and an ETA.
    let mut last = (Duration::ZERO, 0);
    for (t, p) in &events {
        assert!(*t - last.0 < Duration::from_millis(400), "progress gap {:?} at {}", *t - last.0, p.done);
        assert!(p.done >= last.1 && p.done <= total && p.total == total, "{p:?}");
        last = (*t, p.done);
    }
    let mid = &events[events.len() / 2].1;
    assert!(mid.rate > 0.0 && mid.eta_secs.is_some() && mid.artifact.as_deref() == Some("initramfs"), "{mid:?}");
}

#[test]
fn two_pulls_of_one_version_download_it_once() {
    let env = Env::new("bundle-concurrent");
    env.bundle("v1", 300_000, 1_000_000);
    env.server.set_faults(
        &env.path("v1", "initramfs.zst"),
        vec![Fault::Slow { chunk: 32 * 1024, delay: Duration::from_millis(30) }],
    );
    let url = env.url("v1");
    let waited = std::sync::atomic::AtomicBool::new(false);
    let results: Vec<_> = std::thread::scope(|s| {
        let pulls: Vec<_> = (0..2)
            .map(|_| {
                let (store, url, waited) = (env.store.clone(), url.clone(), &waited);
                s.spawn(move || {
                    store.pull(&url, &fast(), &mut |p| {
                        if p.phase == Phase::Waiting {
                            waited.store(true, std::sync::atomic::Ordering::Relaxed);
                        }
                    })
                })
            })
            .collect();
        pulls.into_iter().map(|t| t.join().unwrap().unwrap().how).collect()
    });
    let mut hows = results.clone();
    hows.sort_by_key(|h| format!("{h:?}"));
    assert_eq!(hows, [PulledHow::AlreadyInstalled, PulledHow::Downloaded], "{results:?}");
    assert!(waited.load(std::sync::atomic::Ordering::Relaxed), "the second pull reported that it waited");
    assert_eq!(env.server.count(&env.path("v1", "kernel.zst")), 1);
    assert_eq!(env.server.count(&env.path("v1", "initramfs.zst")), 1);
    assert_eq!(env.store.current().as_deref(), Some("v1"));
}

#[test]
fn a_bundle_for_a_newer_host_is_refused() {
    let env = Env::new("bundle-newer");
    let before = install_previous(&env);
    env.bundle_for_host("v9", 100_000, 100_000, "99.0.0");
    let e = env.pull("v9").unwrap_err();
    assert!(matches!(e, BundleError::Manifest(ManifestError::HostTooOld { .. })), "{e}");
    assert!(e.to_string().contains("needs Umbra 99.0.0 or newer"), "{e}");
    assert_eq!(env.server.count(&env.path("v9", "kernel.zst")), 0, "refused before any artifact");
    assert_untouched(&env.store, "v1", &before);
}

#[test]
fn a_warm_pull_is_promoted_instead_of_downloaded() {
    let env = Env::new("bundle-warm");
    let before = install_previous(&env);
    env.bundle("v2", 300_000, 600_000);
    let opts = umbra_bundle::PullOptions { warm: true, ..fast() };
    let warmed = env.store.pull(&env.url("v2"), &opts, &mut |_| {}).unwrap();
    assert_eq!(warmed.how, PulledHow::Warmed);
    assert_untouched(&env.store, "v1", &before);
    let ls = env.store.list();
    assert!(ls.iter().any(|i| i.version == "v2" && i.warm && !i.current), "{ls:?}");

    // The next start promotes it with a rename: no artifact is requested again.
    let n = env.server.requests().len();
    let promoted = env.store.promote_warm().unwrap().expect("a warm bundle");
    assert_eq!(promoted.manifest.bundle_version, "v2");
    assert_eq!(env.server.requests().len(), n);
    assert_eq!(env.store.current().as_deref(), Some("v2"));
    assert!(env.store.verify("v2").unwrap().iter().all(|c| c.ok()));
    assert!(env.store.promote_warm().unwrap().is_none(), "the slot is empty now");

    // And a pull of a warmed version promotes it too.
    env.bundle("v3", 300_000, 600_000);
    env.store.pull(&env.url("v3"), &opts, &mut |_| {}).unwrap();
    let n = env.server.requests().len();
    assert_eq!(env.pull("v3").unwrap().how, PulledHow::PromotedWarm);
    let paths: Vec<_> = env.server.requests()[n..].iter().map(|r| r.path.clone()).collect();
    assert_eq!(paths, ["/v3/manifest.json", "/v3/manifest.sig"]);
    assert_eq!(env.store.current().as_deref(), Some("v3"));
}

#[test]
fn import_ls_verify_rm_gc() {
    let env = Env::new("bundle-manage");
    for v in ["v1", "v2", "v3"] {
        env.bundle(v, 100_000, 200_000);
        // Local import: the packed directory on disk, no server involved.
        let n = env.server.requests().len();
        let pulled = env.store.import(&env.dir.0.join("www").join(v), &fast(), &mut |_| {}).unwrap();
        assert_eq!(pulled.how, PulledHow::Downloaded);
        assert_eq!(env.server.requests().len(), n);
        std::thread::sleep(Duration::from_millis(20)); // distinct install times
    }
    let ls = env.store.list();
    let names: Vec<_> = ls.iter().map(|i| (i.version.as_str(), i.current)).collect();
    assert_eq!(names, [("v3", true), ("v2", false), ("v1", false)]);

    // verify names the artifact that changed on disk.
    let kernel = env.store.get("v2").unwrap().kernel();
    let mut bytes = std::fs::read(&kernel).unwrap();
    bytes[1000] ^= 1;
    std::fs::set_permissions(&kernel, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    std::fs::write(&kernel, &bytes).unwrap();
    let checks = env.store.verify("v2").unwrap();
    let bad: Vec<_> = checks.iter().filter(|c| !c.ok()).map(|c| c.name.as_str()).collect();
    assert_eq!(bad, ["kernel"]);

    // rm refuses the current version unless forced; gc keeps N plus current.
    assert!(matches!(env.store.remove("v3", false), Err(BundleError::InUse { .. })));
    env.store.remove("v2", false).unwrap();
    assert!(matches!(env.store.remove("v2", false), Err(BundleError::NotInstalled { .. })));
    env.store.set_current("v1").unwrap();
    let removed = env.store.gc(1).unwrap();
    assert!(removed.is_empty(), "v3 is the newest, v1 is current: {removed:?}");
    let removed = env.store.gc(0).unwrap();
    assert_eq!(removed, ["v3"]);
    let names: Vec<_> = env.store.list().into_iter().map(|i| i.version).collect();
    assert_eq!(names, ["v1"]);
    assert_eq!(leftovers(env.store.root()), Vec::<std::path::PathBuf>::new());
}

#[test]
fn a_pull_of_a_newer_bundle_drops_an_older_warm_one() {
    let env = Env::new("bundle-stale-warm");
    install_previous(&env);
    env.bundle("v2", 100_000, 200_000);
    env.bundle("v3", 100_000, 200_000);
    let warm = umbra_bundle::PullOptions { warm: true, ..fast() };
    env.store.pull(&env.url("v2"), &warm, &mut |_| {}).unwrap();
    assert_eq!(env.pull("v3").unwrap().how, PulledHow::Downloaded);
    // The next start must not switch `current` back to the v2 warmed before v3 was pulled.
    assert!(env.store.list().iter().all(|i| !i.warm), "{:?}", env.store.list());
    assert!(env.store.promote_warm().unwrap().is_none());
    assert_eq!(env.store.current().as_deref(), Some("v3"));

    // Likewise when the version pulled was installed already.
    env.store.pull(&env.url("v2"), &warm, &mut |_| {}).unwrap();
    assert_eq!(env.pull("v1").unwrap().how, PulledHow::AlreadyInstalled);
    assert!(env.store.promote_warm().unwrap().is_none());
    assert_eq!(env.store.current().as_deref(), Some("v1"));
}

#[test]
fn a_manifest_with_an_absurd_size_is_refused() {
    let env = Env::new("bundle-huge");
    let before = install_previous(&env);
    let mut m = env.bundle("v2", 100_000, 200_000);
    // Sums and `size + 1` over this would overflow a u64.
    m.artifacts[0].compressed_size = u64::MAX - 1;
    std::fs::write(env.dir.0.join("www/v2/manifest.json"), m.to_json()).unwrap();
    let e = env.pull("v2").unwrap_err();
    assert!(matches!(e, BundleError::Manifest(ManifestError::Invalid { .. })), "{e}");
    assert!(e.to_string().contains("compressed_size") && e.to_string().contains("allowed"), "{e}");
    assert_eq!(env.server.count(&env.path("v2", "kernel.zst")), 0, "refused before any artifact");
    assert_untouched(&env.store, "v1", &before);
}

#[test]
fn a_reinstall_downloads_again_and_a_failed_one_keeps_the_old_copy() {
    let env = Env::new("bundle-reinstall");
    let before = install_previous(&env);
    let reinstall = PullOptions { reinstall: true, ..fast() };
    let m = env.store.get("v1").unwrap().manifest;
    let k = m.artifacts.iter().find(|a| a.name == "kernel").unwrap();
    env.server.push_fault(&env.path("v1", "kernel.zst"), Fault::CorruptByte(k.compressed_size / 2));
    let e = env.store.pull(&env.url("v1"), &reinstall, &mut |_| {}).unwrap_err();
    assert!(matches!(e, BundleError::DigestMismatch { .. }), "{e}");
    assert_untouched(&env.store, "v1", &before);

    let n = env.server.count(&env.path("v1", "kernel.zst"));
    let pulled = env.store.pull(&env.url("v1"), &reinstall, &mut |_| {}).unwrap();
    assert_eq!(pulled.how, PulledHow::Downloaded, "downloaded again, not found installed");
    assert_eq!(env.server.count(&env.path("v1", "kernel.zst")), n + 1);
    assert_untouched(&env.store, "v1", &before);
}

/// The paths the server was asked for from request `from` on.
fn asked(env: &Env, from: usize) -> Vec<String> {
    env.server.requests()[from..].iter().map(|r| r.path.clone()).collect()
}

#[test]
fn an_unsigned_bundle_is_refused_by_name_and_the_installed_one_kept() {
    let env = Env::new("bundle-unsigned");
    let before = install_previous(&env);
    env.bundle("v2", 300_000, 600_000);
    std::fs::remove_file(env.dir.0.join("www/v2").join(umbra_bundle::SIGNATURE_FILE)).unwrap();
    let n = env.server.requests().len();
    let e = env.pull("v2").unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, BundleError::Unsigned { ref version, .. } if version == "v2"), "{msg}");
    assert!(msg.contains("bundle v2 is not signed") && msg.contains(&env.server.url("v2/manifest.json")), "{msg}");
    assert_eq!(asked(&env, n), ["/v2/manifest.json", "/v2/manifest.sig"], "no artifact was fetched");
    assert_untouched(&env.store, "v1", &before);
}

#[test]
fn a_wrongly_signed_bundle_is_refused_and_the_installed_one_kept() {
    let env = Env::new("bundle-badsig");
    let before = install_previous(&env);
    let m = env.bundle("v2", 300_000, 600_000);
    let www = env.dir.0.join("www/v2");
    let manifest = std::fs::read_to_string(www.join("manifest.json")).unwrap();

    // Whoever serves the bundle changes the boot command line after it was signed...
    let mut altered = m.clone();
    altered.boot.cmdline = "init=/bin/sh".into();
    std::fs::write(www.join("manifest.json"), altered.to_json()).unwrap();
    let n = env.server.requests().len();
    let e = env.pull("v2").unwrap_err();
    assert!(matches!(e, BundleError::BadSignature { .. }), "{e}");
    assert!(e.to_string().contains("does not match this manifest"), "{e}");
    assert_eq!(asked(&env, n), ["/v2/manifest.json", "/v2/manifest.sig"], "no artifact was fetched");
    assert_untouched(&env.store, "v1", &before);

    // ...or an artifact's digest (to serve other bytes under it).
    let mut altered = m.clone();
    altered.artifacts[0].sha256 = "0".repeat(64);
    std::fs::write(www.join("manifest.json"), altered.to_json()).unwrap();
    assert!(matches!(env.pull("v2").unwrap_err(), BundleError::BadSignature { .. }));
    assert_untouched(&env.store, "v1", &before);

    // ...or signs it with a key of its own.
    std::fs::write(www.join("manifest.json"), &manifest).unwrap();
    std::fs::remove_file(www.join(umbra_bundle::SIGNATURE_FILE)).unwrap();
    let stranger = umbra_bundle::SecretKey::from_seed([9; 32]);
    umbra_bundle::sign_dir(&www, &stranger).unwrap();
    let e = env.pull("v2").unwrap_err();
    assert!(matches!(e, BundleError::UntrustedSigner { .. }), "{e}");
    assert!(e.to_string().contains(&stranger.public().id()), "names the signer: {e}");
    assert_untouched(&env.store, "v1", &before);

    // Signed again by the trusted key, it installs.
    umbra_bundle::sign_dir(&www, &umbra_bundle::testserver::test_key()).unwrap();
    assert_eq!(env.pull("v2").unwrap().how, PulledHow::Downloaded);
    let trust = umbra_bundle::testserver::test_trust();
    let signer = env.store.check_installed_signature("current", &trust).unwrap();
    assert_eq!(signer, umbra_bundle::testserver::test_key().public().id());
    assert!(env.store.check_installed_signature("current", &umbra_bundle::Trust::default()).is_err());
}

#[test]
fn plain_http_is_refused_unless_to_loopback_and_allowed() {
    let env = Env::new("bundle-http");
    env.bundle("v1", 100_000, 100_000);
    // Without the flag: refused before any request.
    let strict = PullOptions { trust: umbra_bundle::Trust { allow_http_loopback: false, ..fast().trust }, ..fast() };
    let e = env.store.pull(&env.url("v1"), &strict, &mut |_| {}).unwrap_err();
    assert!(matches!(e, BundleError::Url { .. }), "{e}");
    assert!(e.to_string().contains("http:// is refused") && e.to_string().contains("--allow-http-loopback"), "{e}");
    assert!(env.server.requests().is_empty(), "nothing was sent");
    // With it, only a loopback address: the decision comes before any connection, so the
    // private address here is never contacted.
    for url in ["http://10.0.0.1:9/v1/", "http://localhost:9/v1/"] {
        let e = env.store.pull(url, &fast(), &mut |_| {}).unwrap_err();
        assert!(e.to_string().contains("only to a loopback address"), "{url}: {e}");
    }
    // A redirect is held to the same rule, and refused before its target is contacted.
    let port = env.server.url("").trim_start_matches("http://127.0.0.1:").trim_end_matches('/').to_string();
    let elsewhere = format!("http://localhost:{port}/v1/manifest.json");
    env.server.push_fault("/v1/manifest.json", umbra_bundle::testserver::Fault::Redirect(elsewhere.clone()));
    let e = env.pull("v1").unwrap_err().to_string();
    assert!(e.contains(&format!("redirect to {elsewhere} refused")), "{e}");
    assert_eq!(env.server.count("/v1/manifest.json"), 1, "the redirect target was not fetched");
    assert!(env.store.current().is_none());
    // With the flag and a loopback address it installs.
    assert_eq!(env.pull("v1").unwrap().how, PulledHow::Downloaded);
}

/// The system policy's `bundle_sources` hold every redirect too: an allowed source cannot hand
/// the download to another, and the other is never contacted.
#[test]
fn a_redirect_out_of_the_allowed_sources_is_refused_before_it_is_followed() {
    let env = Env::new("bundle-sources");
    env.bundle("v1", 100_000, 100_000);
    env.bundle("v2", 100_000, 100_000);
    let allowed = env.url("v1");
    let policy = umbra_api::system::SystemPolicy { bundle_sources: Some(vec![allowed.clone()]), ..Default::default() };
    assert!(policy.check_bundle_source(&allowed).is_ok() && policy.check_bundle_source(&env.url("v2")).is_err());
    let opts = PullOptions { sources: umbra_runtime::bundle_trust::sources(Some(&policy)), ..fast() };
    env.server
        .push_fault("/v1/manifest.json", umbra_bundle::testserver::Fault::Redirect(env.url("v2") + "manifest.json"));
    let e = env.store.pull(&allowed, &opts, &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("refused") && e.contains("the system policy allows bundles only from"), "{e}");
    assert_eq!(env.server.count("/v2/manifest.json"), 0, "the redirect target was not contacted");
    assert!(env.store.current().is_none(), "nothing installed");
    // Without the redirect, the allowed source installs.
    assert_eq!(env.store.pull(&allowed, &opts, &mut |_| {}).unwrap().how, PulledHow::Downloaded);
}
