//! `vmctl bench fs`: a shared folder (virtio-fs through umbra-fsd + virtiofsd) measured from
//! inside the guest, beside the same work done natively on the host in the same run:
//! - create + stat of N small files (one shell loop writing them, then `ls -l` of them all),
//! - a sequential read of a large file (`dd bs=1M` to /dev/null; the host's page cache is warm
//!   for both sides).
//!
//! The guest also does the small-file work on its own tmpfs, which separates the cost of the
//! share from the cost of the guest CPU (TCG emulation on hosts without hardware KVM).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use umbra_proto::{MountRequest, SpawnRequest};
use umbra_runtime::backend::{Vm, VmSpec};

use crate::boot::ms;

#[derive(Args, Debug)]
pub struct FsBenchArgs {
    /// Small files to create and stat.
    #[arg(long, default_value_t = 10_000)]
    files: u32,
    /// Size of the sequentially read file, in MiB.
    #[arg(long, default_value_t = 1024)]
    read_mib: u32,
    #[arg(long, default_value = "minimal")]
    bundle: String,
}

/// Creates `$1` files in the current directory and stats them all.
const SMALL_FILES: &str = "i=0; while [ $i -lt $1 ]; do echo $i > f$i; i=$((i+1)); done; ls -l >/dev/null";
const SEQ_READ: &str = "dd if=$1 of=/dev/null bs=1M 2>/dev/null";

fn native(script: &str, dir: &Path, arg: &str) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let status = Command::new("busybox").args(["sh", "-c", script, "sh", arg]).current_dir(dir).status()?;
    if !status.success() {
        bail!("native run failed: {status}");
    }
    Ok(t.elapsed())
}

async fn guest(vm: &Vm, script: &str, cwd: &str, arg: &str) -> anyhow::Result<Duration> {
    let argv = ["sh", "-c", script, "sh", arg].map(String::from).to_vec();
    let t = Instant::now();
    let out = vm.agent().spawn(SpawnRequest { argv, cwd: Some(cwd.into()), ..Default::default() })?.output().await?;
    let took = t.elapsed();
    if out.status.code != Some(0) {
        bail!("guest run failed ({:?}): {}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    Ok(took)
}

fn ratio(guest: Duration, native: Duration) -> String {
    format!("{:.1}x", guest.as_secs_f64() / native.as_secs_f64())
}

pub async fn fs(args: FsBenchArgs) -> anyhow::Result<()> {
    let image = crate::boot_image(&args.bundle)?;
    let (backend, why) = umbra_runtime::backend::select::choose(umbra_api::BackendChoice::Auto, image.arch)?;
    let mut spec = VmSpec::new(image);
    spec.folder_sharing = true;
    let root = std::env::temp_dir().join(format!("umbra-bench-fs-{}", std::process::id()));
    let (native_dir, shared) = (root.join("native"), root.join("shared"));
    std::fs::create_dir_all(&native_dir)?;
    std::fs::create_dir_all(shared.join("files"))?;
    let result = async {
        let big = shared.join("big");
        let file = std::fs::File::create(&big)?;
        file.set_len(args.read_mib as u64 * 1024 * 1024)?; // sparse: the read measures the share, not the disk
        let mut vm = Vm::launch(backend, &spec).await.context("boot")?;
        println!(
            "backend {} ({why}) · {} small files · {} MiB sequential read",
            backend.name(),
            args.files,
            args.read_mib
        );
        vm.add_folder("bench", &shared, false, &Default::default(), None).await?;
        let mount = MountRequest {
            source: "umbra".into(),
            target: "/umbra/shares".into(),
            fs_type: "virtiofs".into(),
            read_only: false,
            bind: false,
        };
        vm.agent().mount(mount).await?;
        let n = args.files.to_string();

        let native_small = native(SMALL_FILES, &native_dir, &n)?;
        let guest_tmpfs = guest(&vm, &format!("mkdir -p /tmp/b && cd /tmp/b && {SMALL_FILES}"), "/", &n).await?;
        let guest_share = guest(&vm, SMALL_FILES, "/umbra/shares/bench/files", &n).await?;
        let native_read = native(SEQ_READ, &shared, big.to_str().expect("utf-8 temp path"))?;
        let guest_read = guest(&vm, SEQ_READ, "/", "/umbra/shares/bench/big").await?;
        vm.shutdown().await;

        let mibs = |d: Duration| args.read_mib as f64 / d.as_secs_f64();
        println!("{:<44} {:>9.0} ms", "create+stat, native (host tmp dir)", ms(native_small));
        println!(
            "{:<44} {:>9.0} ms   {} native",
            "create+stat, guest tmpfs",
            ms(guest_tmpfs),
            ratio(guest_tmpfs, native_small)
        );
        println!(
            "{:<44} {:>9.0} ms   {} native, {} guest tmpfs",
            "create+stat, guest on the share",
            ms(guest_share),
            ratio(guest_share, native_small),
            ratio(guest_share, guest_tmpfs)
        );
        println!("{:<44} {:>9.0} MiB/s", "sequential read, native", mibs(native_read));
        println!(
            "{:<44} {:>9.0} MiB/s   {:.2} of native",
            "sequential read, guest on the share",
            mibs(guest_read),
            native_read.as_secs_f64() / guest_read.as_secs_f64()
        );
        anyhow::Ok(())
    }
    .await;
    let _ = std::fs::remove_dir_all(&root);
    result
}
