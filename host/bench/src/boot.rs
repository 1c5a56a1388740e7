//! `vmctl bench boot`: launch → agent ready for each available backend, beside the anchor —
//! the time QEMU itself takes from launch to `/init` with the same kernel and initramfs
//! (measured as launch → exit with `rdinit=/bin/reboot -- -f`: the first userspace instruction
//! reboots, and `-no-reboot` makes QEMU exit). Medians of N runs, in the same invocation.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use umbra_runtime::backend::{BackendKind, BootImage, KvmKind, Supervised, Vm, VmSpec, BASE_CMDLINE};

use crate::paths;

#[derive(Args, Debug)]
pub struct BootBenchArgs {
    #[arg(long, default_value_t = 10)]
    runs: usize,
    #[arg(long, default_value = "minimal")]
    bundle: String,
}

const ANCHOR_TIMEOUT: Duration = Duration::from_secs(60);

/// The middle of `v` (the upper one of an even count); `v` must not be empty.
pub(crate) fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The median of `runs` launches of `image` on `backend`, launch → agent ready.
pub(crate) async fn median_boot_time(backend: BackendKind, image: &BootImage, runs: usize) -> anyhow::Result<Duration> {
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let vm = Vm::launch(backend, &VmSpec::new(image.clone())).await?;
        times.push(vm.boot_time);
        vm.shutdown().await;
    }
    Ok(median(times))
}

async fn anchor_once(qemu: &Path, image: &BootImage, kvm: bool) -> anyhow::Result<Duration> {
    let Some(initrd) = &image.initrd else { bail!("the anchor needs an initramfs bundle (minimal)") };
    let t = Instant::now();
    let mut cmd = Command::new(qemu);
    cmd.args(["-M", "microvm,acpi=off", "-m", "512M", "-smp", "1", "-no-reboot", "-nographic", "-nodefaults"])
        .args(["-no-user-config", "-serial", "null", "-accel", if kvm { "kvm" } else { "tcg" }])
        .arg("-kernel")
        .arg(&image.kernel)
        .arg("-initrd")
        .arg(initrd)
        .arg("-append")
        .arg(format!("{BASE_CMDLINE} rdinit=/bin/reboot -- -f"))
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    // Supervised: killed with vmctl, and a guest that never reboots cannot hang the bench.
    let mut qemu = Supervised::spawn("qemu-system-x86_64", cmd).context("run qemu for the anchor")?;
    match qemu.wait_timeout(ANCHOR_TIMEOUT).await {
        Some(status) if status.success() => Ok(t.elapsed()),
        Some(status) => bail!("anchor qemu exited with {status}"),
        None => bail!("anchor qemu did not exit within {ANCHOR_TIMEOUT:?} (does the initramfs have /bin/reboot?)"),
    }
}

pub async fn boot(args: BootBenchArgs) -> anyhow::Result<()> {
    let dir = crate::bundle_dir(&args.bundle)?;
    let image = BootImage::from_bundle_dir(&dir, &paths::extracted_dir())?;
    if image.arch != umbra_bundle::Arch::X86_64 {
        bail!(
            "vmctl bench boot measures x86_64 bundles (its anchor is qemu -M microvm); {} is {}",
            image.version,
            image.arch
        );
    }
    let qemu = umbra_runtime::backend::host::QEMU.require()?;
    let kvm = KvmKind::detect() == KvmKind::Hardware;
    let runs = args.runs.max(1);
    println!("bundle {} · {} runs each · accel {}", image.version, runs, if kvm { "kvm" } else { "tcg" });

    let mut anchors = Vec::with_capacity(runs);
    for _ in 0..runs {
        anchors.push(anchor_once(&qemu, &image, kvm).await?);
    }
    let anchor = median(anchors);
    println!("{:<34} median {:>7.1} ms", "anchor: qemu launch -> /init", ms(anchor));

    for backend in [BackendKind::Qemu] {
        let m = median_boot_time(backend, &image, runs).await?;
        println!(
            "{:<34} median {:>7.1} ms   ratio {:.2}x the anchor",
            format!("{backend:?}: launch -> agent ready").to_lowercase(),
            ms(m),
            m.as_secs_f64() / anchor.as_secs_f64()
        );
    }
    Ok(())
}

/// A session manager for a benchmark's guests: nothing recorded, no storage, no idle stop, no
/// disk; `extra` adds to (or overrides) that configuration.
pub fn bench_manager(
    memory_mib: u32,
    boot_timeout_secs: u64,
    bundle: &str,
    backend: umbra_api::BackendChoice,
    extra: serde_json::Value,
) -> anyhow::Result<umbra_runtime::session::SessionManager> {
    let mut config = serde_json::json!({
        "memory_mib": memory_mib,
        "idle_timeout_secs": 0,
        "disk_size_mib": 0,
        "boot_timeout_secs": boot_timeout_secs.max(1),
        "bundle": bundle,
        "backend": backend,
    });
    if let (Some(config), serde_json::Value::Object(extra)) = (config.as_object_mut(), extra) {
        config.extend(extra);
    }
    Ok(umbra_runtime::session::SessionManager::new(umbra_runtime::session::ManagerOptions {
        config: serde_json::from_value(config)?,
        state_dir: None,
        storage_root: None,
        bundles: umbra_bundle::Store::new(umbra_bundle::Store::default_root()),
    }))
}
