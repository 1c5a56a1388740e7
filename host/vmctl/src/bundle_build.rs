//! `vmctl bundle build`: runs the image recipes of a source checkout (kernel, agent, image) and
//! packs their outputs into a bundle directory.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use umbra_bundle::{pack, Arch, ArtifactRole, PackInput, PackOptions};

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
    /// Guest architecture: x86_64 (amd64) or aarch64 (arm64) [default: this host's]. A guest
    /// of another architecture runs on the qemu backend, emulated.
    #[arg(long, value_parser = parse_arch)]
    arch: Option<Arch>,
    /// Output directory [default: ~/.cache/umbra/bundles/<flavor>, or <flavor>-<arch> for a
    /// guest of another architecture than this host's]
    #[arg(long)]
    out: Option<PathBuf>,
    /// Use this kernel (vmlinux, or Image for arm64) instead of running scripts/build-kernel.
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
    /// Sign with this secret key [default: $UMBRA_BUNDLE_SIGNING_KEY, else
    /// ~/.config/umbra/bundle-signing.key, made on first use and trusted by this user]
    #[arg(long)]
    signing_key: Option<PathBuf>,
}

fn parse_arch(name: &str) -> Result<Arch, String> {
    Arch::parse(name)
        .ok_or_else(|| format!("unknown architecture {name:?} (x86_64 or aarch64; amd64 and arm64 work too)"))
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
fn script_output(script: &Path, args: &[&str]) -> anyhow::Result<PathBuf> {
    eprintln!("vmctl: running {} {}", script.display(), args.join(" "));
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

/// Runs an image recipe; `UMBRA_GUEST_ARCH` tells it which architecture to build for.
fn run_script(script: &Path, args: &[&Path], arch: Arch) -> anyhow::Result<()> {
    eprintln!("vmctl: running {} ({arch})", script.display());
    let status = Command::new(script)
        .args(args)
        .env("UMBRA_GUEST_ARCH", arch.debian_name())
        .status()
        .with_context(|| format!("cannot run {}", script.display()))?;
    if !status.success() {
        bail!("{} failed ({status})", script.display());
    }
    Ok(())
}

pub fn run(args: BuildArgs) -> anyhow::Result<()> {
    let src = source_dir(args.source)?;
    let arch = args.arch.unwrap_or(Arch::host());
    let arch_args = ["--arch", arch.debian_name()];
    let kernel = match args.kernel {
        Some(k) => k,
        None => script_output(&src.join("scripts/build-kernel"), &arch_args)?,
    };
    let agent = match args.agent {
        Some(a) => a,
        None => script_output(&src.join("scripts/build-agent"), &arch_args)?,
    };
    let cache = crate::paths::cache_dir();
    let flavor_name = match args.flavor {
        Flavor::Minimal => "minimal",
        Flavor::Standard => "standard",
    };
    let name = umbra_runtime::paths::built_bundle_name(flavor_name, arch);
    let work = cache.join("bundle-work").join(&name);
    std::fs::create_dir_all(&work).with_context(|| format!("cannot create {}", work.display()))?;

    let kernel_format = match arch {
        Arch::X86_64 => "elf-vmlinux",
        Arch::Aarch64 => "arm64-image",
    };
    let kernel_input =
        PackInput { name: "kernel".into(), role: ArtifactRole::Kernel, format: kernel_format.into(), path: kernel };
    let (image, cmdline) = match args.flavor {
        Flavor::Minimal => {
            let img = work.join("initramfs.cpio.zst");
            run_script(&src.join("rootfs/minimal/build"), &[&agent, &img], arch)?;
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
            run_script(&src.join("rootfs/standard/build"), &[&agent, &img], arch)?;
            let input =
                PackInput { name: "rootfs".into(), role: ArtifactRole::Rootfs, format: "erofs".into(), path: img };
            (input, "root=/dev/vda rootfstype=erofs ro init=/sbin/umbra-agent")
        }
    };
    let out = args.out.unwrap_or_else(|| cache.join("bundles").join(&name));
    let opts = PackOptions {
        flavor: flavor_name,
        arch,
        cmdline,
        min_host_version: env!("CARGO_PKG_VERSION"),
        version: args.version,
        zstd_level: args.level.unwrap_or(match args.flavor {
            Flavor::Minimal => 19,
            Flavor::Standard => 9,
        }),
        image: None,
    };
    // The agent on its own as well, for the OCI images made with this bundle's kernel.
    let agent_input =
        PackInput { name: "agent".into(), role: ArtifactRole::Agent, format: "elf-static".into(), path: agent };
    let inputs = [kernel_input, image, agent_input];
    // The same inputs packed before (bundles are reproducible): kept, not compressed again
    // (for the standard image that is half a minute of zstd). An explicit --level is not in
    // the manifest, so it always packs.
    let kept = if args.level.is_none() { umbra_bundle::current(&inputs, &opts, &out) } else { None };
    let manifest = match kept {
        Some(manifest) => {
            eprintln!("vmctl: bundle {} in {} is current (same inputs): kept", manifest.bundle_version, out.display());
            manifest
        }
        None => {
            let manifest = pack(&inputs, &opts, &out).context("cannot pack the bundle")?;
            eprintln!("vmctl: bundle {} written to {}", manifest.bundle_version, out.display());
            manifest
        }
    };
    crate::bundle_sign::sign_build(&out, args.signing_key).context("cannot sign the bundle")?;
    for a in &manifest.artifacts {
        eprintln!(
            "vmctl:   {:<10} {:>11} bytes  zst {:>11} bytes  sha256 {}",
            a.name, a.size, a.compressed_size, a.sha256
        );
    }
    println!("{}", out.display());
    Ok(())
}
