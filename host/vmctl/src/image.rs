//! `vmctl image pull|import|ls` and `vmctl run --image`: OCI images made into bundles
//! (umbra-image), signed with this machine's build key and installed in the store without
//! becoming `current`; sessions name them by version, or by the reference again.

use std::io::Read;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};
use umbra_bundle::{Arch, Store};
use umbra_runtime::oci::{self, ObtainOptions, Obtained, Origin};

#[derive(Subcommand, Debug)]
pub enum ImageCommand {
    /// Pull an image from a registry (or take it from the cache) and install it as a bundle.
    Pull(PullArgs),
    /// Install an image from an OCI image layout directory or a `docker save` archive.
    Import(ImportArgs),
    /// The images converted on this machine, by reference.
    Ls(LsArgs),
}

#[derive(Args, Debug, Clone, Default)]
pub struct ImageArgs {
    /// The guest's architecture: x86_64 (amd64) or aarch64 (arm64) [default: this host's].
    #[arg(long, value_parser = parse_arch)]
    pub arch: Option<Arch>,
    /// The bundle whose kernel and agent the image boots with [default: `current` for this
    /// host's architecture, the built `minimal-<arch>` for another].
    #[arg(long)]
    pub base: Option<String>,
    /// Plain HTTP to a registry on a loopback address (127.0.0.1, [::1], localhost): for a
    /// local registry or tests. Every other registry is https only.
    #[arg(long)]
    pub allow_http_loopback: bool,
    /// Registry username (with --password-stdin) instead of ~/.docker/config.json's.
    #[arg(long, requires = "password_stdin")]
    pub username: Option<String>,
    /// Read the registry password from stdin.
    #[arg(long, requires = "username")]
    pub password_stdin: bool,
}

#[derive(Args, Debug)]
pub struct PullArgs {
    /// An image reference: `alpine:3.20`, `ghcr.io/org/tool@sha256:…`, `127.0.0.1:5000/x:1`.
    reference: String,
    #[command(flatten)]
    image: ImageArgs,
    /// Print the result as one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub struct ImportArgs {
    /// An OCI image layout directory, or a `docker save` archive (tar).
    path: PathBuf,
    #[command(flatten)]
    image: ImageArgs,
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub struct LsArgs {
    #[arg(long)]
    json: bool,
}

fn parse_arch(name: &str) -> Result<Arch, String> {
    Arch::parse(name).ok_or_else(|| format!("unknown architecture {name:?} (x86_64 or aarch64)"))
}

impl ImageArgs {
    /// The runtime's options; the password is read from stdin here.
    fn options(&self) -> anyhow::Result<ObtainOptions> {
        let mut credentials = None;
        if let (Some(user), true) = (&self.username, self.password_stdin) {
            let mut password = String::new();
            std::io::stdin().read_to_string(&mut password).context("cannot read the password from stdin")?;
            credentials = Some((user.clone(), password.trim_end_matches(['\r', '\n']).to_string()));
        }
        Ok(ObtainOptions {
            arch: self.arch,
            base: self.base.clone(),
            allow_http_loopback: self.allow_http_loopback,
            credentials,
        })
    }
}

/// The keys this user trusts (the system policy's, umbrad's, the trusted-keys directory's).
fn trust() -> Result<umbra_bundle::Trust, umbra_bundle::BundleError> {
    crate::bundle_sign::TrustArgs::default()
        .trust()
        .map_err(|e| umbra_bundle::BundleError::Key { path: "trusted keys".into(), reason: format!("{e:#}") })
}

async fn obtain(origin: Origin<'_>, args: &ImageArgs) -> anyhow::Result<Obtained> {
    Ok(oci::obtain(origin, &args.options()?, &trust, &mut |line| eprintln!("vmctl: {line}")).await?)
}

fn report(result: anyhow::Result<Obtained>, json: bool) -> i32 {
    match result {
        Ok(o) if json => {
            println!("{}", serde_json::to_string(&o).expect("serializes"));
            0
        }
        Ok(o) => {
            println!("{}", o.bundle);
            eprintln!(
                "vmctl: {} ({}) is bundle {}: {} layer bytes downloaded, {} cached, {}",
                o.reference,
                o.digest,
                o.bundle,
                o.downloaded_bytes,
                o.cached_bytes,
                if o.converted { "converted now" } else { "converted before" }
            );
            0
        }
        Err(e) => {
            eprintln!("vmctl: error: {e:#}");
            1
        }
    }
}

pub async fn pull(args: PullArgs) -> i32 {
    report(obtain(Origin::Registry(&args.reference), &args.image).await, args.json)
}

pub async fn import(args: ImportArgs) -> i32 {
    report(obtain(Origin::Archive(&args.path), &args.image).await, args.json)
}

pub fn ls(args: LsArgs) -> i32 {
    let store = Store::new(Store::default_root());
    let rows: Vec<serde_json::Value> = oci::refs()
        .into_iter()
        .filter(|(_, v)| store.get(v).is_ok())
        .map(|(k, v)| {
            let (arch, reference) = k.split_once(' ').unwrap_or(("", &k));
            serde_json::json!({"reference": reference, "arch": arch, "bundle": v})
        })
        .collect();
    if args.json {
        println!("{}", serde_json::Value::Array(rows));
    } else {
        for r in rows {
            println!(
                "{}  {}  {}",
                r["bundle"].as_str().unwrap_or(""),
                r["arch"].as_str().unwrap_or(""),
                r["reference"].as_str().unwrap_or("")
            );
        }
    }
    0
}

/// `vmctl run --image`: the installed bundle for `reference`, pulled and converted if needed.
pub async fn for_run(reference: &str, args: &ImageArgs) -> anyhow::Result<(String, umbra_bundle::ImageInfo)> {
    let mut progress = |line: String| eprintln!("vmctl: {line}");
    Ok(oci::bundle_for(reference, &args.options()?, &trust, &mut progress).await?)
}
