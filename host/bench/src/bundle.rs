//! `vmctl bench bundle`: install throughput — download, decompress, verify both digests, write,
//! fsync, rename — from a loopback server, beside the shell pipeline
//! `curl -s URL | zstd -dc | openssl dgst -sha256` over the same files from the same server, in the same
//! run. The pipeline is the anchor: it does the network, the decompression and one digest, on
//! three processes, and writes nothing; the install does more (two digests, a file, an fsync)
//! and should still keep up (goal: ratio ≥ 0.9).
//!
//! The bundle is synthetic (compresses about 4:1, like a guest image) unless one is given, and
//! each install goes into a fresh store so nothing is reused between runs. Runs alternate which
//! side goes first so neither always gets the warmer page cache.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use umbra_bundle::testserver::{synthetic_bundle, TestServer};
use umbra_bundle::{Manifest, PullOptions, Store, MANIFEST_FILE};

#[derive(Args, Debug)]
pub struct BundleBenchArgs {
    /// Uncompressed size of the synthetic bundle's image artifact, in MiB (plus a 16 MiB kernel).
    #[arg(long, default_value_t = 256)]
    size_mib: usize,
    /// Benchmark this packed bundle directory instead of a synthetic one.
    #[arg(long)]
    bundle: Option<PathBuf>,
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// zstd level of the synthetic bundle.
    #[arg(long, default_value_t = 3)]
    level: i32,
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn mib_s(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / (1024.0 * 1024.0) / d.as_secs_f64()
}

struct Work(PathBuf);

impl Drop for Work {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn have(tool: &str) -> bool {
    Command::new("sh").arg("-c").arg(format!("command -v {tool} >/dev/null")).status().is_ok_and(|s| s.success())
}

/// The anchor: every artifact through `curl | zstd -dc | openssl dgst -sha256`, digests
/// checked. openssl, not coreutils' sha256sum: it uses the CPU's SHA extensions, as we do, so
/// the anchor is what the hardware can do (sha256sum made it 2.5 times slower).
fn anchor(server: &TestServer, prefix: &str, m: &Manifest) -> anyhow::Result<Duration> {
    let start = Instant::now();
    for a in &m.artifacts {
        let url = server.url(&format!("{prefix}/{}", a.file));
        let out = Command::new("bash")
            .arg("-c")
            .arg(format!("set -o pipefail; curl -s '{url}' | zstd -dc | openssl dgst -sha256 -r"))
            .output()
            .context("cannot run the anchor pipeline")?;
        let digest = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() || !digest.starts_with(&a.sha256) {
            bail!("anchor pipeline on {url}: status {}, digest {digest:?}, expected {}", out.status, a.sha256);
        }
    }
    Ok(start.elapsed())
}

fn install(server: &TestServer, prefix: &str, store_root: &Path) -> anyhow::Result<Duration> {
    let store = Store::new(store_root);
    let start = Instant::now();
    // The synthetic bundle is signed by the test key; the server is on loopback.
    let opts = PullOptions { trust: umbra_bundle::testserver::test_trust(), ..PullOptions::default() };
    store.pull(&server.url(&format!("{prefix}/")), &opts, &mut |_| {})?;
    let took = start.elapsed();
    std::fs::remove_dir_all(store_root).with_context(|| format!("cannot remove {}", store_root.display()))?;
    Ok(took)
}

pub fn bundle(args: BundleBenchArgs) -> anyhow::Result<()> {
    for tool in ["curl", "zstd", "openssl"] {
        if !have(tool) {
            bail!("{tool} not found; the anchor needs it (apt-get install -y curl zstd openssl)");
        }
    }
    let work = Work(std::env::temp_dir().join(format!("umbra-bench-bundle-{}", std::process::id())));
    let www = work.0.join("www");
    let (root, prefix) = match &args.bundle {
        Some(dir) => {
            let dir = dir.canonicalize().with_context(|| format!("no bundle at {}", dir.display()))?;
            let name = dir.file_name().and_then(|n| n.to_str()).context("bundle directory name")?.to_string();
            (dir.parent().context("bundle directory has a parent")?.to_path_buf(), name)
        }
        None => {
            eprintln!("vmctl: packing a synthetic bundle ({} MiB image, zstd -{})", args.size_mib, args.level);
            let version = format!("bench-{}m", args.size_mib);
            synthetic_bundle(
                &work.0.join("src"),
                &www.join("b"),
                &version,
                16 << 20,
                args.size_mib << 20,
                args.level,
                env!("CARGO_PKG_VERSION"),
            )?;
            (www.clone(), "b".to_string())
        }
    };
    let json = std::fs::read(root.join(&prefix).join(MANIFEST_FILE)).context("cannot read the bundle's manifest")?;
    let m = Manifest::parse(&json, env!("CARGO_PKG_VERSION"))?;
    let size: u64 = m.artifacts.iter().map(|a| a.size).sum();
    let zsize: u64 = m.artifacts.iter().map(|a| a.compressed_size).sum();
    let server = TestServer::start(&root)?;
    let runs = args.runs.max(1);
    println!(
        "bundle {} · {:.1} MiB uncompressed, {:.1} MiB compressed · {runs} runs · store on {}",
        m.bundle_version,
        size as f64 / 1048576.0,
        zsize as f64 / 1048576.0,
        std::env::temp_dir().display()
    );

    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for run in 0..runs {
        let store_root = work.0.join(format!("store-{run}"));
        if run % 2 == 0 {
            ours.push(install(&server, &prefix, &store_root)?);
            theirs.push(anchor(&server, &prefix, &m)?);
        } else {
            theirs.push(anchor(&server, &prefix, &m)?);
            ours.push(install(&server, &prefix, &store_root)?);
        }
        eprintln!(
            "vmctl: run {}: install {:.0} ms, anchor {:.0} ms",
            run + 1,
            ours[run].as_secs_f64() * 1000.0,
            theirs[run].as_secs_f64() * 1000.0
        );
    }
    let (o, t) = (median(ours), median(theirs));
    println!(
        "{:<44} median {:>7.0} ms  {:>7.1} MiB/s",
        "anchor: curl | zstd -dc | openssl sha256",
        t.as_secs_f64() * 1000.0,
        mib_s(size, t)
    );
    println!(
        "{:<44} median {:>7.0} ms  {:>7.1} MiB/s   ratio {:.2} (goal >= 0.9)",
        "install: download+verify+write+fsync+rename",
        o.as_secs_f64() * 1000.0,
        mib_s(size, o),
        t.as_secs_f64() / o.as_secs_f64()
    );
    Ok(())
}
