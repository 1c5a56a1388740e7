//! The writable session disk, end to end: a sparse ext4 file made by the runtime
//! (`ensure_session_disk`), attached as a second virtio-blk disk, found by the agent by its
//! label and used for the root overlay's upper layer — so files written in one VM are there in
//! the next VM booted with the same disk, and writes go to the disk rather than guest RAM.
//! Without a disk nothing changes: the `minimal` initramfs root stays as it is, the `standard`
//! image's overlay keeps its tmpfs upper.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use umbra_proto::SpawnRequest;
use umbra_runtime::agent::AgentClient;
use umbra_runtime::backend::disk::ensure_session_disk;
use umbra_runtime::backend::{BackendKind, BootImage, Vm, VmSpec};
use umbra_tests::{backends, cache_dir, test_bundle, TempDir};

const MIB: u64 = 1024 * 1024;
const GIB: u64 = 1024 * MIB;

async fn boot(backend: BackendKind, flavor: &str, disk: Option<&Path>, memory_mib: u32) -> Vm {
    let image = BootImage::from_bundle_dir(&test_bundle(flavor), &cache_dir().join("extracted")).unwrap();
    let mut spec = VmSpec::new(image);
    spec.memory_mib = memory_mib;
    spec.disk = disk.map(Path::to_path_buf);
    Vm::launch(backend, &spec).await.unwrap_or_else(|e| panic!("{backend:?} {flavor} boot: {e}"))
}

/// Runs `script` under `sh -c` and returns its stdout; any other outcome than exit 0 fails.
async fn sh(agent: &AgentClient, script: &str) -> String {
    let req = SpawnRequest { argv: vec!["sh".into(), "-c".into(), script.into()], ..Default::default() };
    let out = agent.spawn(req).unwrap().output().await.unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code, Some(0), "{script}\nstdout: {stdout}\nstderr: {stderr}");
    stdout.into_owned()
}

/// The /proc/mounts line of the guest's root, the last one mounted on `/`.
async fn root_mount(agent: &AgentClient) -> String {
    let mounts = sh(agent, "cat /proc/mounts").await;
    mounts.lines().rev().find(|l| l.split(' ').nth(1) == Some("/")).unwrap_or_default().to_string()
}

/// Size of `/` in KiB as `df` sees it: an overlay reports its upper layer's filesystem.
async fn root_size_kib(agent: &AgentClient) -> u64 {
    let df = sh(agent, "df -k / | tail -n 1").await;
    df.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("df: {df}"))
}

/// (mount point, filesystem type) of each line of /proc/mounts.
fn mount_points(mounts: &str) -> impl Iterator<Item = (&str, &str)> {
    mounts.lines().map(|l| {
        let mut f = l.split(' ');
        (f.nth(1).unwrap_or_default(), f.next().unwrap_or_default())
    })
}

fn new_disk(dir: &TempDir) -> std::path::PathBuf {
    let disk = dir.0.join("session.img");
    assert!(ensure_session_disk(&disk, GIB).unwrap(), "a fresh disk is created");
    disk
}

fn allocated(disk: &Path) -> u64 {
    std::fs::metadata(disk).unwrap().blocks() * 512
}

fn assert_overlay_on_disk(root: &str) {
    assert!(root.starts_with("overlay / overlay "), "the root is an overlay: {root}");
    assert!(root.contains("upperdir=/umbra/disk/upper,workdir=/umbra/disk/work"), "upper on the disk: {root}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minimal_writes_survive_a_restart_on_the_session_disk() {
    for backend in backends() {
        let dir = TempDir::new("session-disk-minimal");
        let disk = new_disk(&dir);

        let vm = boot(backend, "minimal", Some(&disk), 256).await;
        let agent = vm.agent();
        assert_overlay_on_disk(&root_mount(agent).await);
        assert!(root_size_kib(agent).await > 900 * 1024, "/ has the disk's size");
        sh(agent, "echo kept > /root/keep.txt && mkdir -p /var/lib/app && echo state > /var/lib/app/s && sync").await;
        // The disk itself, its scratch mounts and the old root are out of sight.
        let mounts = sh(agent, "cat /proc/mounts").await;
        assert!(mount_points(&mounts).all(|(at, fs)| !at.starts_with("/umbra") && fs != "ext4"), "{mounts}");
        vm.shutdown().await;

        assert!(!ensure_session_disk(&disk, GIB).unwrap(), "the existing disk is kept");
        let vm = boot(backend, "minimal", Some(&disk), 256).await;
        let agent = vm.agent();
        assert_overlay_on_disk(&root_mount(agent).await);
        assert_eq!(sh(agent, "cat /root/keep.txt /var/lib/app/s").await, "kept\nstate\n");
        // The image's own files are still there below the upper layer.
        assert!(sh(agent, "cat /etc/os-release").await.contains("Umbra minimal"));
        // Later mounts land in the new root, like a shadow share's tmpfs and overlay.
        let shadow_like =
            "mkdir -p /umbra/t && mount -t tmpfs tmpfs /umbra/t && mkdir /umbra/t/u /umbra/t/w /umbra/t/m \
            && mount -t overlay overlay -o lowerdir=/etc,upperdir=/umbra/t/u,workdir=/umbra/t/w /umbra/t/m \
            && echo y > /umbra/t/m/new && cat /umbra/t/u/new && grep -c ' /umbra/t/m overlay ' /proc/mounts \
            && umount /umbra/t/m /umbra/t";
        assert_eq!(sh(agent, shadow_like).await, "y\n1\n");
        // Killed, not shut down, in the middle of writing: what was synced survives, and the
        // journal makes the disk mountable again.
        sh(agent, "echo synced > /root/synced.txt && sync && for i in $(seq 300); do echo $i > /root/u$i; done").await;
        let mut vm = vm;
        vm.kill();
        drop(vm);

        let vm = boot(backend, "minimal", Some(&disk), 256).await;
        let agent = vm.agent();
        assert_overlay_on_disk(&root_mount(agent).await);
        assert_eq!(sh(agent, "cat /root/keep.txt /root/synced.txt").await, "kept\nsynced\n");
        vm.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standard_writes_go_to_the_session_disk_not_to_ram() {
    for backend in backends() {
        let dir = TempDir::new("session-disk-standard");
        let disk = new_disk(&dir);
        let before = allocated(&disk);

        // 256 MiB of guest RAM (a tmpfs upper could hold at most half of it): 400 MiB of writes
        // only fit on the disk.
        let vm = boot(backend, "standard", Some(&disk), 256).await;
        let agent = vm.agent();
        assert_overlay_on_disk(&root_mount(agent).await);
        sh(agent, "echo kept > /root/keep.txt && dd if=/dev/zero of=/root/big bs=1M count=400 2>/dev/null && sync")
            .await;
        // A lower-layer file replaced in the upper layer.
        sh(agent, "test -s /etc/debian_version && echo changed > /etc/debian_version && sync").await;
        vm.shutdown().await;
        let grown = allocated(&disk) - before;
        assert!(grown >= 400 * MIB, "the host file holds the writes: {grown} bytes allocated since mkfs");

        let vm = boot(backend, "standard", Some(&disk), 256).await;
        let agent = vm.agent();
        assert_overlay_on_disk(&root_mount(agent).await);
        assert_eq!(
            sh(agent, "cat /root/keep.txt /etc/debian_version; stat -c %s /root/big").await,
            "kept\nchanged\n419430400\n"
        );
        vm.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_disk_nothing_changes() {
    for backend in backends() {
        // minimal: the initramfs root is left as it is.
        let vm = boot(backend, "minimal", None, 256).await;
        let agent = vm.agent();
        let root = root_mount(agent).await;
        assert!(root.starts_with("rootfs / "), "the initramfs is the root: {root}");
        let mounts = sh(agent, "cat /proc/mounts").await;
        assert!(mount_points(&mounts).all(|(at, _)| !at.starts_with("/umbra")), "nothing left on /umbra: {mounts}");
        sh(agent, "echo x > /root/f && test -d /umbra").await;
        vm.shutdown().await;

        // standard: the read-only image gets its overlay with a tmpfs upper.
        let vm = boot(backend, "standard", None, 512).await;
        let agent = vm.agent();
        let root = root_mount(agent).await;
        assert!(root.starts_with("overlay / overlay "), "{root}");
        assert!(root.contains("upperdir=/umbra/upper,workdir=/umbra/work"), "tmpfs upper: {root}");
        assert!(root_size_kib(agent).await < 512 * 1024, "/ is a tmpfs within guest RAM");
        sh(agent, "echo x > /root/f").await;
        vm.shutdown().await;
    }
}
