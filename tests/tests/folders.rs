//! Folder sharing end to end on a real guest: umbra-fsd + virtiofsd on the host, virtio-fs in
//! the guest, on every backend this host supports (`UMBRA_TEST_BACKENDS`, as the conformance
//! suite). What the host enforces is tested from inside the guest as root.

use umbra_proto::{ChangeKind, MountRequest, ShareMode, SpawnRequest};
use umbra_runtime::backend::{BackendKind, BootImage, Vm, VmSpec};
use umbra_runtime::share::{FolderPolicy, SharedFolders};
use umbra_tests::{backends, cache_dir, test_bundle, TempDir};

fn sh(script: &str) -> SpawnRequest {
    SpawnRequest { argv: vec!["sh".into(), "-c".into(), script.into()], ..Default::default() }
}

async fn run(vm: &Vm, script: &str) -> (i32, String, String) {
    let out = vm.agent().spawn(sh(script)).unwrap().output().await.unwrap();
    (
        out.status.code.unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

async fn boot_sharing(backend: BackendKind) -> Vm {
    let image = BootImage::from_bundle_dir(&test_bundle("minimal"), &cache_dir().join("extracted")).unwrap();
    let mut spec = VmSpec::new(image);
    spec.folder_sharing = true;
    Vm::launch(backend, &spec).await.unwrap_or_else(|e| panic!("{backend:?} boot with folder sharing: {e}"))
}

async fn mount_share_root(vm: &Vm) {
    let req = MountRequest {
        source: "umbra".into(),
        target: "/umbra/shares".into(),
        fs_type: "virtiofs".into(),
        read_only: false,
        bind: false,
    };
    vm.agent().mount(req).await.expect("the guest mounts the virtio-fs share root");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_folder_stays_read_only_even_for_guest_root_remounting_it() {
    for backend in backends() {
        let dir = TempDir::new("share-ro");
        let folder = dir.0.join("proj");
        std::fs::create_dir(&folder).unwrap();
        std::fs::write(folder.join("README"), b"from the host\n").unwrap();
        let mut vm = boot_sharing(backend).await;
        vm.add_folder("proj", &folder, true, &Default::default(), None).await.unwrap();
        mount_share_root(&vm).await;

        let (code, out, _) = run(&vm, "cat /umbra/shares/proj/README").await;
        assert_eq!((code, out.as_str()), (0, "from the host\n"), "{backend:?}");
        let (code, _, err) = run(&vm, "echo x > /umbra/shares/proj/new").await;
        assert_ne!(code, 0, "{backend:?}: a write to a ro share must fail");
        assert!(err.contains("Read-only file system"), "{backend:?}: {err}");
        // Guest root remounts read-write: the host's read-only bind still refuses.
        let (_, _, _) = run(&vm, "mount -o remount,rw /umbra/shares").await;
        let (code, _, err) = run(&vm, "echo x > /umbra/shares/proj/new; echo y >> /umbra/shares/proj/README").await;
        assert_ne!(code, 0, "{backend:?}: still read-only after a guest remount: {err}");
        assert!(!folder.join("new").exists());
        assert_eq!(std::fs::read(folder.join("README")).unwrap(), b"from the host\n");
        vm.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_write_folder_carries_bytes_both_ways_and_folders_can_be_added_while_running() {
    for backend in backends() {
        let dir = TempDir::new("share-rw");
        let (a, b) = (dir.0.join("a"), dir.0.join("b"));
        std::fs::create_dir(&a).unwrap();
        std::fs::create_dir(&b).unwrap();
        let mut vm = boot_sharing(backend).await;
        vm.add_folder("a", &a, false, &Default::default(), None).await.unwrap();
        mount_share_root(&vm).await;

        // Guest → host, byte-identical (binary content, 1 MiB).
        let (code, _, err) = run(&vm, "head -c 1048576 /dev/urandom > /umbra/shares/a/blob && sha256sum /umbra/shares/a/blob > /umbra/shares/a/blob.sum").await;
        assert_eq!(code, 0, "{backend:?}: {err}");
        let blob = std::fs::read(a.join("blob")).unwrap();
        assert_eq!(blob.len(), 1 << 20);
        let sum = std::fs::read_to_string(a.join("blob.sum")).unwrap();
        let host_sum = sha256_hex(&blob);
        assert!(sum.starts_with(&host_sum), "{backend:?}: guest {sum} host {host_sum}");

        // Host → guest.
        std::fs::write(a.join("from-host"), b"written on the host\n").unwrap();
        let (_, out, _) = run(&vm, "cat /umbra/shares/a/from-host").await;
        assert_eq!(out, "written on the host\n", "{backend:?}");

        // A set-id file the folder already holds: the guest's write lands and the host's
        // kernel clears the bits, whatever the runtime runs as (virtiofsd has no CAP_FSETID).
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(a.join("setid"), b"#!/bin/sh\n").unwrap();
        std::fs::set_permissions(a.join("setid"), std::fs::Permissions::from_mode(0o6755)).unwrap();
        let (code, _, err) = run(&vm, "echo 'echo guest' >> /umbra/shares/a/setid").await;
        assert_eq!(code, 0, "{backend:?}: {err}");
        assert_eq!(std::fs::read_to_string(a.join("setid")).unwrap(), "#!/bin/sh\necho guest\n");
        let mode = std::fs::metadata(a.join("setid")).unwrap().permissions().mode();
        assert_eq!(mode & 0o7777, 0o755, "{backend:?}: the set-id bits stayed ({mode:o})");

        // A second folder appears in the running VM.
        std::fs::write(b.join("late"), b"added later\n").unwrap();
        vm.add_folder("b", &b, false, &Default::default(), None).await.unwrap();
        let (_, out, _) = run(&vm, "cat /umbra/shares/b/late").await;
        assert_eq!(out, "added later\n", "{backend:?}");
        vm.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn escapes_never_reveal_host_files_outside_the_share() {
    for backend in backends() {
        let dir = TempDir::new("share-escape");
        let folder = dir.0.join("proj");
        std::fs::create_dir(&folder).unwrap();
        let secret = dir.0.join("secret");
        std::fs::write(&secret, b"host secret\n").unwrap();
        std::os::unix::fs::symlink(&secret, folder.join("abs-link")).unwrap();
        std::os::unix::fs::symlink("../secret", folder.join("rel-link")).unwrap();
        let mut vm = boot_sharing(backend).await;
        vm.add_folder("proj", &folder, false, &Default::default(), None).await.unwrap();
        mount_share_root(&vm).await;
        let script = "cd /umbra/shares/proj; \
            cat abs-link rel-link ../../secret /umbra/shares/proj/../secret /umbra/shares/../secret 2>/dev/null; \
            ln ../secret hard 2>/dev/null; ln abs-link hard2 2>/dev/null; cat hard hard2 2>/dev/null; \
            ls -la /umbra/shares /umbra/shares/proj/.. 2>/dev/null; true";
        let (_, out, _) = run(&vm, script).await;
        assert!(!out.contains("host secret"), "{backend:?}: host content leaked:\n{out}");
        assert_eq!(std::fs::read(&secret).unwrap(), b"host secret\n");
        vm.shutdown().await;
    }
}

fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}

// ---- modes and the shadow workspace, through the runtime's session API ----

const SESSION: &str = "s1";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rw_denies_deletion_and_rwd_allows_it() {
    for backend in backends() {
        let dir = TempDir::new("share-modes");
        let (rw, rwd) = (dir.0.join("rw"), dir.0.join("rwd"));
        for d in [&rw, &rwd] {
            std::fs::create_dir(d).unwrap();
            std::fs::write(d.join("keep"), b"x").unwrap();
        }
        let mut vm = boot_sharing(backend).await;
        let mut folders = SharedFolders::new();
        let rw_path = folders.share(&mut vm, SESSION, &rw, None, ShareMode::Rw).await.unwrap();
        let rwd_path = folders.share(&mut vm, SESSION, &rwd, None, ShareMode::Rwd).await.unwrap();
        assert_eq!(rw_path, "/sessions/s1/mnt/rw");

        let (code, _, err) = run(&vm, &format!("echo new > {rw_path}/new && echo more >> {rw_path}/keep")).await;
        assert_eq!(code, 0, "{backend:?}: rw creates and modifies: {err}");
        assert_eq!(std::fs::read(rw.join("new")).unwrap(), b"new\n");
        let (code, _, err) = run(&vm, &format!("rm {rw_path}/keep")).await;
        assert_ne!(code, 0, "{backend:?}: rm in an rw share must fail");
        assert!(err.contains("Permission denied") || err.contains("not permitted"), "{backend:?}: {err}");
        assert!(rw.join("keep").exists());
        let (code, _, _) = run(&vm, &format!("mv {rw_path}/new /tmp/away")).await;
        assert_ne!(code, 0, "{backend:?}: renaming away from an rw share must fail");
        assert!(rw.join("new").exists());

        let (code, _, err) = run(&vm, &format!("rm {rwd_path}/keep")).await;
        assert_eq!(code, 0, "{backend:?}: rwd deletes: {err}");
        assert!(!rwd.join("keep").exists());
        vm.shutdown().await;
    }
}

fn tree(root: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            if p.is_dir() {
                out.push((rel + "/", Vec::new()));
                stack.push(p);
            } else {
                out.push((rel, std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_changes_stay_in_the_guest_until_applied_and_conflicts_are_kept() {
    for backend in backends() {
        let dir = TempDir::new("share-shadow");
        let proj = dir.0.join("proj");
        std::fs::create_dir_all(proj.join("src")).unwrap();
        std::fs::write(proj.join("src/main.rs"), b"fn main() {}\n").unwrap();
        std::fs::write(proj.join("README"), b"readme\n").unwrap();
        std::fs::write(proj.join("old.txt"), b"old\n").unwrap();
        std::fs::write(proj.join("contested"), b"v1\n").unwrap();
        let before = tree(&proj);
        let mut vm = boot_sharing(backend).await;
        let mut folders = SharedFolders::new();
        let g = folders.share(&mut vm, SESSION, &proj, None, ShareMode::Shadow).await.unwrap();

        let script = format!(
            "cd {g} && echo added > new.txt && mkdir -p docs && echo guide > docs/guide.md \
             && echo 'fn main() {{ println!(); }}' > src/main.rs && rm old.txt && echo v2-guest > contested"
        );
        let (code, _, err) = run(&vm, &script).await;
        assert_eq!(code, 0, "{backend:?}: {err}");
        assert_eq!(tree(&proj), before, "{backend:?}: the host folder is untouched");

        let captured = folders.shadow_diff(&vm, "proj").await.unwrap();
        let mut diff: Vec<(String, ChangeKind, Option<u64>)> =
            captured.changes.into_iter().map(|c| (c.path, c.kind, c.size)).collect();
        diff.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            diff,
            vec![
                ("contested".into(), ChangeKind::Modified, Some(9)),
                ("docs".into(), ChangeKind::Added, None),
                ("docs/guide.md".into(), ChangeKind::Added, Some(6)),
                ("new.txt".into(), ChangeKind::Added, Some(6)),
                ("old.txt".into(), ChangeKind::Deleted, None),
                ("src/main.rs".into(), ChangeKind::Modified, Some(26)),
            ],
            "{backend:?}"
        );

        // The host edits one of those files meanwhile: a conflict, not an overwrite.
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(proj.join("contested"), b"v2-host\n").unwrap();
        let report = folders.shadow_apply("proj", Some(&captured.changeset), None).unwrap();
        let conflicts: Vec<&str> = report.conflicts.iter().map(|c| c.path.as_str()).collect();
        assert_eq!(conflicts, vec!["contested"], "{backend:?}: {report:?}");
        assert!(report.errors.is_empty(), "{backend:?}: {report:?}");
        assert_eq!(std::fs::read(proj.join("contested")).unwrap(), b"v2-host\n");
        assert_eq!(std::fs::read(proj.join("new.txt")).unwrap(), b"added\n");
        assert_eq!(std::fs::read(proj.join("docs/guide.md")).unwrap(), b"guide\n");
        assert_eq!(std::fs::read(proj.join("src/main.rs")).unwrap(), b"fn main() { println!(); }\n");
        assert!(!proj.join("old.txt").exists());
        assert_eq!(std::fs::read(proj.join("README")).unwrap(), b"readme\n");

        // Reset throws the guest's changes away.
        folders.shadow_reset(&vm, "proj").await.unwrap();
        // virtiofsd's default cache policy lets the guest keep attributes for 1 s.
        tokio::time::sleep(std::time::Duration::from_millis(1200)).await;
        let (_, out, _) = run(&vm, &format!("cat {g}/contested; ls {g}")).await;
        assert!(out.starts_with("v2-host\n"), "{backend:?}: after reset the guest sees the host: {out}");
        vm.shutdown().await;
    }
}

/// Issue 28: a process left running in the guest changes a reviewed file and appends a
/// `core.fsmonitor` line to `.git/config` after the diff. The apply writes the reviewed bytes
/// only; `.git/config` is neither applied by default nor, under `block_git_writes`, when named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_apply_writes_only_what_the_diff_captured() {
    for backend in backends() {
        let dir = TempDir::new("share-shadow-exact");
        let proj = dir.0.join("proj");
        std::fs::create_dir_all(proj.join(".git")).unwrap();
        std::fs::write(proj.join("f.txt"), b"original\n").unwrap();
        std::fs::write(proj.join(".git/config"), b"[core]\n\tbare = false\n").unwrap();
        let mut vm = boot_sharing(backend).await;
        let policy = FolderPolicy { protect_git: true, ..Default::default() };
        let mut folders = SharedFolders::with_policy(policy);
        let g = folders.share(&mut vm, SESSION, &proj, None, ShareMode::Shadow).await.unwrap();

        let (code, _, err) = run(&vm, &format!("echo reviewed > {g}/f.txt")).await;
        assert_eq!(code, 0, "{backend:?}: {err}");
        let reviewed = folders.shadow_diff(&vm, "proj").await.unwrap();
        let paths: Vec<&str> = reviewed.changes.iter().map(|c| c.path.as_str()).collect();
        assert_eq!(paths, ["f.txt"], "{backend:?}");
        assert_eq!(reviewed.changes[0].sha256.as_deref(), Some(sha256_hex(b"reviewed\n").as_str()));

        // After the review: the file changes again and git is told to run a command.
        let attack =
            format!("echo 'malicious' > {g}/f.txt && printf '\\tfsmonitor = touch /tmp/pwned\\n' >> {g}/.git/config");
        let (code, _, err) = run(&vm, &attack).await;
        assert_eq!(code, 0, "{backend:?}: {err}");

        let report = folders.shadow_apply("proj", Some(&reviewed.changeset), None).unwrap();
        assert_eq!(report.applied, ["f.txt"], "{backend:?}: {report:?}");
        assert_eq!(std::fs::read(proj.join("f.txt")).unwrap(), b"reviewed\n", "{backend:?}: the reviewed bytes");
        assert_eq!(std::fs::read(proj.join(".git/config")).unwrap(), b"[core]\n\tbare = false\n");
        // Naming a path the diff did not list, or applying with no change-set, writes nothing.
        let named = [".git/config".to_owned()];
        assert!(folders.shadow_apply("proj", Some(&reviewed.changeset), Some(&named)).is_err());
        assert!(folders.shadow_apply("proj", None, None).is_err());

        // A new diff lists .git/config, marked, and it is never applied under block_git_writes.
        let again = folders.shadow_diff(&vm, "proj").await.unwrap();
        let config = again.changes.iter().find(|c| c.path == ".git/config").expect("listed");
        assert!(config.risks.contains(&umbra_api::event::ShadowRisk::Git), "{config:?}");
        assert_eq!(config.applies, umbra_api::event::ShadowApplies::Never);
        let err = folders.shadow_apply("proj", Some(&again.changeset), Some(&named)).unwrap_err();
        assert!(err.to_string().contains("block_git_writes"), "{err}");
        assert!(folders.shadow_apply("proj", Some(&reviewed.changeset), None).is_err(), "superseded");
        assert_eq!(std::fs::read(proj.join(".git/config")).unwrap(), b"[core]\n\tbare = false\n");
        vm.shutdown().await;
    }
}
