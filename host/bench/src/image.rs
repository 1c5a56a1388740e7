//! `vmctl bench image`: an OCI image of a real root filesystem (by default the standard image's
//! Debian tree, one gzip layer) pushed to Debian's `docker-registry` on 127.0.0.1, then, in one
//! run:
//!
//! - **pull and convert**: `vmctl image pull` from an empty cache (download, verify, apply the
//!   layers, write the erofs root, sign, install), beside the anchor pipeline on the same image:
//!   `skopeo copy` to an OCI layout, `umoci unpack`, `mkfs.erofs` (uncompressed, as ours);
//! - **a second pull**: the layer bytes it transferred (zero) and its time;
//! - **a session start**: `vmctl run --image … -- true` beside `vmctl run --bundle standard --
//!   true`, command to exit.
//!
//! Every tool runs as a process, timed from its start to its exit.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;

#[derive(Args, Debug)]
pub struct ImageBenchArgs {
    /// The root filesystem tree to make an image of [default: the standard image's cached
    /// Debian tree].
    #[arg(long)]
    tree: Option<PathBuf>,
    /// The base bundle (kernel, agent) [default: the built `standard` flavor].
    #[arg(long, default_value = "standard")]
    base: String,
    /// Timed session starts of each kind.
    #[arg(long, default_value_t = 3)]
    runs: usize,
}

fn run(cmd: &mut Command) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let out = cmd.stdin(Stdio::null()).output().with_context(|| format!("cannot run {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    Ok(started.elapsed())
}

fn default_tree() -> anyhow::Result<PathBuf> {
    let dir = umbra_runtime::paths::cache_dir().join("standard-build");
    let mut trees: Vec<_> = std::fs::read_dir(&dir)
        .with_context(|| format!("{} (build the standard bundle, or pass --tree)", dir.display()))?
        .flatten()
        .filter(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.starts_with("tree-") && !n.starts_with("tree-arm64-")
        })
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    trees.sort();
    trees.pop().map(|(_, p)| p).with_context(|| format!("no tree in {} (pass --tree)", dir.display()))
}

/// Debian's registry on a free loopback port, storing under `dir`; killed on drop.
struct Registry(Child, String);

impl Registry {
    fn start(dir: &Path) -> anyhow::Result<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let addr = format!("127.0.0.1:{port}");
        let config = dir.join("registry.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    \
                 rootdirectory: {}\nhttp:\n  addr: {addr}\n",
                dir.join("storage").display()
            ),
        )?;
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("cannot start docker-registry (scripts/install-deps installs it)")?;
        let registry = Registry(child, addr);
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(&registry.1).is_err() {
            if Instant::now() > deadline {
                bail!("docker-registry did not listen on {}", registry.1);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(registry)
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

pub fn image(args: ImageBenchArgs) -> anyhow::Result<()> {
    let tree = match args.tree {
        Some(t) => t,
        None => default_tree()?,
    };
    let work = std::env::temp_dir().join(format!("umbra-bench-image-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let result = measure(&tree, &args.base, args.runs.max(1), &work);
    let _ = std::fs::remove_dir_all(&work);
    result
}

fn measure(tree: &Path, base: &str, runs: usize, work: &Path) -> anyhow::Result<()> {
    let vmctl = std::env::current_exe()?;
    let registry = Registry::start(work)?;
    // The image: one gzip layer of the tree, made with umoci (which records owners, modes and
    // xattrs as a runtime's unpack expects), pushed with skopeo.
    println!("image: {} as one gzip layer", tree.display());
    let layout = work.join("layout");
    run(Command::new("umoci").args(["init", "--layout"]).arg(&layout))?;
    run(Command::new("umoci").args(["new", "--image"]).arg(format!("{}:src", layout.display())))?;
    let made = run(Command::new("umoci")
        .args(["insert", "--image"])
        .arg(format!("{}:src", layout.display()))
        .arg(tree)
        .arg("/"))?;
    println!("  made in {} (not timed against anything)", secs(made));
    let reference = format!("{}/bench/debian:1", registry.1);
    run(Command::new("skopeo")
        .args(["copy", "--quiet", "--dest-tls-verify=false"])
        .arg(format!("oci:{}:src", layout.display()))
        .arg(format!("docker://{reference}")))?;

    // Our side from empty caches and store, the anchor beside it.
    let vm = |cmd: &mut Command| {
        cmd.env("UMBRA_CACHE_DIR", work.join("cache")).env("UMBRA_DATA_DIR", work.join("data"));
    };
    let base_dir = crate::bundle_dir(base)?;
    let pull = || {
        let mut c = Command::new(&vmctl);
        c.args(["image", "pull", "--json", "--allow-http-loopback", "--base"]).arg(&base_dir).arg(&reference);
        vm(&mut c);
        c
    };
    let first_started = Instant::now();
    let out = pull().stdin(Stdio::null()).output()?;
    let first = first_started.elapsed();
    if !out.status.success() {
        bail!("vmctl image pull failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let first_json: serde_json::Value = serde_json::from_slice(&out.stdout)?;

    let anchor_layout = work.join("anchor-layout");
    let copy = run(Command::new("skopeo")
        .args(["copy", "--quiet", "--src-tls-verify=false"])
        .arg(format!("docker://{reference}"))
        .arg(format!("oci:{}:img", anchor_layout.display())))?;
    let unpacked = work.join("anchor-bundle");
    let unpack = run(Command::new("umoci")
        .args(["unpack", "--image"])
        .arg(format!("{}:img", anchor_layout.display()))
        .arg(&unpacked))?;
    let erofs = run(Command::new("mkfs.erofs")
        .arg("--quiet")
        .arg(work.join("anchor.erofs"))
        .arg(unpacked.join("rootfs"))
        .stdout(Stdio::null()))?;
    let anchor = copy + unpack + erofs;
    let _ = std::fs::remove_dir_all(&unpacked);

    let second_started = Instant::now();
    let out = pull().stdin(Stdio::null()).output()?;
    let second = second_started.elapsed();
    let second_json: serde_json::Value = serde_json::from_slice(&out.stdout)?;

    println!("pull and convert ({} layer bytes):", first_json["downloaded_bytes"]);
    println!("  vmctl image pull (download, verify, apply, erofs, sign, install)  {}", secs(first));
    println!(
        "  skopeo copy {} + umoci unpack {} + mkfs.erofs {}                {}",
        secs(copy),
        secs(unpack),
        secs(erofs),
        secs(anchor)
    );
    println!("  ratio vmctl / anchor: {:.2}", first.as_secs_f64() / anchor.as_secs_f64());
    println!(
        "second pull: {} layer bytes transferred, {} cached, converted again: {}, {}",
        second_json["downloaded_bytes"],
        second_json["cached_bytes"],
        second_json["converted"],
        secs(second)
    );

    // Session starts: command to exit, through vmctl run.
    let start = |image: bool| -> anyhow::Result<Duration> {
        let mut c = Command::new(&vmctl);
        c.arg("run");
        if image {
            c.args(["--image", &reference, "--allow-http-loopback", "--base"]).arg(&base_dir);
        } else {
            c.arg("--bundle").arg(&base_dir);
        }
        c.args(["--", "true"]);
        vm(&mut c);
        run(&mut c)
    };
    let mut from_image = Vec::new();
    let mut from_bundle = Vec::new();
    for _ in 0..runs {
        from_image.push(start(true)?);
        from_bundle.push(start(false)?);
    }
    from_image.sort();
    from_bundle.sort();
    let (a, b) = (from_image[runs / 2], from_bundle[runs / 2]);
    println!("session start to exit (`vmctl run … -- true`, median of {runs}):");
    println!("  converted image  {}", secs(a));
    println!("  {base} bundle  {}", secs(b));
    println!("  ratio image / bundle: {:.2}", a.as_secs_f64() / b.as_secs_f64());
    Ok(())
}
