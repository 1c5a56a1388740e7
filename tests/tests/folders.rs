//! Folder sharing end to end on a real guest: umbra-fsd + virtiofsd on the host, virtio-fs in
//! the guest, on every backend this host supports (`UMBRA_TEST_BACKENDS`, as the conformance
//! suite). What the host enforces is tested from inside the guest as root.

use umbra_proto::{MountRequest, SpawnRequest};
use umbra_runtime::backend::{BackendKind, BootImage, KvmKind, Vm, VmSpec};
use umbra_tests::{cache_dir, test_bundle, TempDir};

fn backends() -> Vec<BackendKind> {
    if let Ok(list) = std::env::var("UMBRA_TEST_BACKENDS") {
        return list.split(',').filter_map(|n| BackendKind::from_name(n.trim())).collect();
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
        vm.folder_server().unwrap().add("proj", &folder, true).await.unwrap();
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
        vm.folder_server().unwrap().add("a", &a, false).await.unwrap();
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

        // A second folder appears in the running VM.
        std::fs::write(b.join("late"), b"added later\n").unwrap();
        vm.folder_server().unwrap().add("b", &b, false).await.unwrap();
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
        vm.folder_server().unwrap().add("proj", &folder, false).await.unwrap();
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
