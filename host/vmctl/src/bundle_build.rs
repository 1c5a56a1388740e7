//! `vmctl bundle build`: runs the image recipes of a source checkout (kernel, agent, image) and
//! packs their outputs into a bundle directory.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use umbra_bundle::{pack, ArtifactRole, PackInput, PackOptions};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Flavor {
    /// busybox + agent initramfs: a few MB, builds in seconds.
    Minimal,
    /// Debian bookworm (git, python3, build tools) on a read-only erofs disk.
    Standard,
}

#[derive(Args, Debug)]
pub struct BuildArgs {
    #[arg(long, value_enum, default_value = "minimal")]
    flavor: Flavor,
    /// Output directory [default: ~/.cache/umbra/bundles/<flavor>]
    #[arg(long)]
    out: Option<PathBuf>,
    /// Use this vmlinux instead of running scripts/build-kernel.
    #[arg(long)]
    kernel: Option<PathBuf>,
    /// Use this static agent instead of running scripts/build-agent.
    #[arg(long)]
    agent: Option<PathBuf>,
    /// Umbra source checkout holding scripts/ and rootfs/ [default: $UMBRA_SOURCE_DIR, else the
    /// checkout vmctl was built from]
    #[arg(long)]
    source: Option<PathBuf>,
    /// Bundle version [default: <flavor>-<content digest>]
    #[arg(long)]
    version: Option<String>,
    /// zstd level for the bundle's artifacts [default: 19 for minimal; 9 for standard, whose
    /// erofs image is already lz4hc-compressed and 19 would take minutes for ~1% more]
    #[arg(long)]
    level: Option<i32>,
}

fn source_dir(arg: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    let dir = arg
        .or_else(|| std::env::var_os("UMBRA_SOURCE_DIR").map(PathBuf::from))
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."));
    let dir = dir.canonicalize().unwrap_or(dir);
    if !dir.join("rootfs/minimal/build").exists() {
        bail!("{} is not an Umbra source checkout (no rootfs/minimal/build); pass --source", dir.display());
    }
    Ok(dir)
}

/// Runs a recipe script that prints one path on stdout (its logs go to our stderr).
fn script_output(script: &Path, args: &[&Path]) -> anyhow::Result<PathBuf> {
    eprintln!("vmctl: running {}", script.display());
    let out = Command::new(script)
        .args(args)
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run {}", script.display()))?;
    if !out.status.success() {
        bail!("{} failed ({})", script.display(), out.status);
    }
    let path = String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or_default().trim().to_string();
    Ok(PathBuf::from(path))
}

fn run_script(script: &Path, args: &[&Path]) -> anyhow::Result<()> {
    eprintln!("vmctl: running {}", script.display());
    let status =
        Command::new(script).args(args).status().with_context(|| format!("cannot run {}", script.display()))?;
    if !status.success() {
        bail!("{} failed ({status})", script.display());
    }
    Ok(())
}

pub fn run(args: BuildArgs) -> anyhow::Result<()> {
    let src = source_dir(args.source)?;
    let kernel = match args.kernel {
        Some(k) => k,
        None => script_output(&src.join("scripts/build-kernel"), &[])?,
    };
    let agent = match args.agent {
        Some(a) => a,
        None => script_output(&src.join("scripts/build-agent"), &[])?,
    };
    let cache = crate::paths::cache_dir();
    let flavor_name = match args.flavor {
        Flavor::Minimal => "minimal",
        Flavor::Standard => "standard",
    };
    let work = cache.join("bundle-work").join(flavor_name);
    std::fs::create_dir_all(&work).with_context(|| format!("cannot create {}", work.display()))?;

    let kernel_input =
        PackInput { name: "kernel".into(), role: ArtifactRole::Kernel, format: "elf-vmlinux".into(), path: kernel };
    let (image, cmdline) = match args.flavor {
        Flavor::Minimal => {
            let img = work.join("initramfs.cpio.zst");
            run_script(&src.join("rootfs/minimal/build"), &[&agent, &img])?;
            let input = PackInput {
                name: "initramfs".into(),
                role: ArtifactRole::Initrd,
                format: "cpio-newc-zstd".into(),
                path: img,
            };
            (input, "")
        }
        Flavor::Standard => {
            let img = work.join("rootfs.erofs");
            run_script(&src.join("rootfs/standard/build"), &[&agent, &img])?;
            let input =
                PackInput { name: "rootfs".into(), role: ArtifactRole::Rootfs, format: "erofs".into(), path: img };
            (input, "root=/dev/vda rootfstype=erofs ro init=/sbin/umbra-agent")
        }
    };
    let out = args.out.unwrap_or_else(|| cache.join("bundles").join(flavor_name));
    let opts = PackOptions {
        flavor: flavor_name,
        cmdline,
        min_host_version: env!("CARGO_PKG_VERSION"),
        version: args.version,
        zstd_level: args.level.unwrap_or(match args.flavor {
            Flavor::Minimal => 19,
            Flavor::Standard => 9,
        }),
    };
    let manifest = pack(&[kernel_input, image], &opts, &out).context("cannot pack the bundle")?;
    eprintln!("vmctl: bundle {} written to {}", manifest.bundle_version, out.display());
    for a in &manifest.artifacts {
        eprintln!(
            "vmctl:   {:<10} {:>11} bytes  zst {:>11} bytes  sha256 {}",
            a.name, a.size, a.compressed_size, a.sha256
        );
    }
    println!("{}", out.display());
    Ok(())
}
