//! `vmctl bundle pull | ls | verify | rm | gc | import` and `vmctl bench bundle` as a user runs
//! them, against a store under UMBRA_DATA_DIR and a server on 127.0.0.1.

mod bundle_support;

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use bundle_support::*;
use serde_json::Value;
use umbra_bundle::testserver::Fault;
use umbra_tests::workspace_bin;

/// vmctl with this test's store and configuration: it trusts the test key (a .pub file in its
/// trusted-keys directory), and `pull` may use the test server's loopback `http://`.
fn vmctl(env: &Env, args: &[&str]) -> Output {
    let mut args = args.to_vec();
    if args[..2] == ["bundle", "pull"] {
        args.insert(2, "--allow-http-loopback");
    }
    Command::new(workspace_bin("vmctl")).args(args).envs(env.vmctl_env()).output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn json_lines(out: &Output) -> Vec<Value> {
    text(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect()
}

#[test]
fn pull_ls_verify_rm_gc_import() {
    let env = &Env::new("bundle-cli");
    env.bundle("v1", 300_000, 2_000_000);
    env.server.set_faults(
        &env.path("v1", "initramfs.zst"),
        vec![Fault::Slow { chunk: 64 * 1024, delay: Duration::from_millis(60) }],
    );

    // --json: progress lines while it downloads, then the outcome.
    let out = vmctl(env, &["bundle", "pull", "--json", &env.url("v1")]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines = json_lines(&out);
    let downloads = lines.iter().filter(|v| v["event"] == "progress" && v["phase"] == "download").count();
    assert!(downloads >= 3, "{lines:?}");
    let last = lines.last().unwrap();
    assert_eq!(
        (last["event"].as_str(), last["version"].as_str(), last["how"].as_str()),
        (Some("pulled"), Some("v1"), Some("downloaded"))
    );

    // Without --json: the installed directory on stdout.
    env.bundle("v2", 100_000, 200_000);
    let out = vmctl(env, &["bundle", "pull", &env.url("v2")]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), env.store.root().join("v2").display().to_string());

    let out = vmctl(env, &["bundle", "ls", "--json"]);
    let ls: Value = serde_json::from_slice(&out.stdout).unwrap();
    let versions: Vec<_> = ls
        .as_array()
        .unwrap()
        .iter()
        .map(|i| (i["version"].as_str().unwrap(), i["current"].as_bool().unwrap()))
        .collect();
    assert_eq!(versions, [("v2", true), ("v1", false)]);
    let out = vmctl(env, &["bundle", "ls"]);
    assert!(text(&out.stdout).contains("* v2"), "{}", text(&out.stdout));

    // verify: exit 0, then a changed artifact is named and exits 1.
    let out = vmctl(env, &["bundle", "verify"]);
    assert!(out.status.success(), "{}{}", text(&out.stdout), text(&out.stderr));
    let initrd = env.store.get("v1").unwrap().path(umbra_bundle::ArtifactRole::Initrd).unwrap();
    let mut bytes = std::fs::read(&initrd).unwrap();
    bytes.truncate(bytes.len() - 1);
    std::fs::set_permissions(&initrd, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    std::fs::write(&initrd, &bytes).unwrap();
    let out = vmctl(env, &["bundle", "verify", "v1"]);
    assert_eq!(out.status.code(), Some(1));
    let report = text(&out.stdout);
    assert!(report.contains("CHANGED  initramfs") && report.contains("ok       kernel"), "{report}");

    // A 404 is an error naming the URL; nothing changes.
    let out = vmctl(env, &["bundle", "pull", &env.url("nope")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains(&env.server.url("nope/manifest.json")), "{}", text(&out.stderr));
    assert_eq!(env.store.current().as_deref(), Some("v2"));

    // rm refuses current; gc keeps N and current; import installs a local directory.
    let out = vmctl(env, &["bundle", "rm", "v2"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("is current"), "{}", text(&out.stderr));
    let www = env.dir.0.join("www");
    let out = vmctl(env, &["bundle", "import", www.join("v1").to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(env.store.current().as_deref(), Some("v1"));
    let out = vmctl(env, &["bundle", "gc", "--keep", "0"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let names: Vec<_> = env.store.list().into_iter().map(|i| i.version).collect();
    assert_eq!(names, ["v1"]);
    let out = vmctl(env, &["bundle", "rm", "--force", "v1"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(env.store.current(), None);
}

#[test]
fn warm_pull_runs_in_the_background_and_is_promoted() {
    let env = &Env::new("bundle-cli-warm");
    env.bundle("v1", 100_000, 200_000);
    env.pull("v1").unwrap();
    env.bundle("v2", 300_000, 2_000_000);
    // About 1.5 s of download: long enough to see the command return first.
    env.server.set_faults(
        &env.path("v2", "initramfs.zst"),
        vec![Fault::Slow { chunk: 16 * 1024, delay: Duration::from_millis(40) }],
    );

    let out = vmctl(env, &["bundle", "pull", "--warm", "--json", &env.url("v2")]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(json_lines(&out)[0]["event"], "warming");
    assert!(!env.store.list().iter().any(|i| i.version == "v2"), "returned before the download finished");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !env.store.list().iter().any(|i| i.version == "v2" && i.warm) {
        assert!(Instant::now() < deadline, "the warm download did not finish");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(env.store.current().as_deref(), Some("v1"), "warming does not switch");

    let gets = env.server.count(&env.path("v2", "initramfs.zst"));
    let out = vmctl(env, &["bundle", "pull", "--json", &env.url("v2")]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(json_lines(&out).last().unwrap()["how"], "promoted_warm");
    assert_eq!(env.server.count(&env.path("v2", "initramfs.zst")), gets, "promoted, not downloaded");
    assert_eq!(env.store.current().as_deref(), Some("v2"));
}

#[test]
fn bench_bundle_reports_a_ratio() {
    let have = |t: &str| {
        Command::new("sh").arg("-c").arg(format!("command -v {t}")).output().is_ok_and(|o| o.status.success())
    };
    if !have("curl") || !have("zstd") || !have("openssl") {
        eprintln!("skipping: curl, zstd and openssl are needed for the anchor");
        return;
    }
    let out = Command::new(workspace_bin("vmctl"))
        .args(["bench", "bundle", "--size-mib", "8", "--runs", "1"])
        .output()
        .unwrap();
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(stdout.contains("anchor: curl | zstd -dc | openssl sha256") && stdout.contains("ratio"), "{stdout}");
}

#[test]
fn two_vmctl_processes_pulling_one_version_download_it_once() {
    let env = &Env::new("bundle-cli-two");
    env.bundle("v1", 300_000, 1_000_000);
    env.server.set_faults(
        &env.path("v1", "initramfs.zst"),
        vec![Fault::Slow { chunk: 32 * 1024, delay: Duration::from_millis(30) }],
    );
    let spawn = || {
        Command::new(workspace_bin("vmctl"))
            .args(["bundle", "pull", "--allow-http-loopback", "--json", &env.url("v1")])
            .envs(env.vmctl_env())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (spawn(), spawn());
    let mut hows: Vec<String> = [a, b]
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().unwrap();
            assert!(out.status.success(), "{}", text(&out.stderr));
            json_lines(&out).last().unwrap()["how"].as_str().unwrap().to_string()
        })
        .collect();
    hows.sort();
    assert_eq!(hows, ["already_installed", "downloaded"]);
    assert_eq!(env.server.count(&env.path("v1", "kernel.zst")), 1);
    assert_eq!(env.server.count(&env.path("v1", "initramfs.zst")), 1);
}

#[test]
fn keygen_sign_verify_and_pull_only_what_a_trusted_key_signed() {
    let env = &Env::new("bundle-cli-sign");
    env.bundle("v1", 100_000, 200_000);
    let www = env.dir.0.join("www").join("v1");
    std::fs::remove_file(www.join(umbra_bundle::SIGNATURE_FILE)).unwrap();
    let dir = www.to_str().unwrap();

    // Unsigned: verify and pull both refuse it by name; nothing is installed.
    let out = vmctl(env, &["bundle", "verify", dir]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("bundle v1 is not signed"), "{}", text(&out.stderr));
    let out = vmctl(env, &["bundle", "pull", &env.url("v1")]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("bundle v1 is not signed"), "{}", text(&out.stderr));
    assert!(env.store.current().is_none());

    // A publisher's key, and the bundle signed with it.
    let key = env.dir.0.join("publisher.key");
    let out = vmctl(env, &["bundle", "keygen", "--out", key.to_str().unwrap(), "--comment", "publisher"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).starts_with("umbra-ed25519 ") && text(&out.stdout).trim_end().ends_with(" publisher"));
    let public = umbra_bundle::public_path(&key);
    let out = vmctl(env, &["bundle", "sign", dir, "--key", key.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));

    // Signed by a key nobody trusts yet: refused, naming the signer.
    let id = umbra_bundle::PublicKey::read(&public).unwrap().id();
    let out = vmctl(env, &["bundle", "pull", &env.url("v1")]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains(&format!("signed only by {id}, which this host does not trust")), "{err}");

    // Trusted with --trusted-key: verify says who signed, and the pull installs.
    let trusted = ["--trusted-key", public.to_str().unwrap()];
    let out = vmctl(env, &[&["bundle", "verify", "--json", dir][..], &trusted].concat());
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(json_lines(&out)[0]["signer"], id.as_str());
    let out = vmctl(env, &[&["bundle", "pull", &env.url("v1")][..], &trusted].concat());
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(env.store.current().as_deref(), Some("v1"));
    // An installed bundle's verify checks the signature it was installed with, too.
    let out = vmctl(env, &[&["bundle", "verify", "--json"][..], &trusted].concat());
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(json_lines(&out)[0]["signer"], id.as_str());
    let out = vmctl(env, &["bundle", "verify", "--json"]);
    assert_eq!(out.status.code(), Some(1), "without the key the signature is not trusted");
    assert!(json_lines(&out)[0]["signature_error"].as_str().unwrap().contains("does not trust"));

    // By URL too, before installing.
    let url = env.url("v1");
    let out = vmctl(env, &[&["bundle", "verify", "--allow-http-loopback", "--json", &url][..], &trusted].concat());
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(json_lines(&out)[0]["signer"], id.as_str());

    // A warm pull of a bundle nobody trusts is refused at once, not only in its log.
    let out = vmctl(env, &["bundle", "pull", "--warm", &url]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("which this host does not trust"), "{}", text(&out.stderr));

    // Plain http:// without the loopback flag is refused before any request.
    let n = env.server.requests().len();
    let out = Command::new(workspace_bin("vmctl"))
        .args(["bundle", "pull", &env.url("v1")])
        .envs(env.vmctl_env())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("http:// is refused"), "{}", text(&out.stderr));
    assert_eq!(env.server.requests().len(), n);
}
