//! `vmctl bundle ls | verify | rm | gc`, and how `vmctl run --bundle SPEC` finds what to boot.
//!
//! Two places hold bundles: the packed directories `vmctl bundle build` writes (extracted into a
//! cache on use, as before) and the store that `pull` and `import` install into. A SPEC that
//! names a packed directory or a built flavor keeps meaning what it meant; otherwise it is
//! looked up in the store, where `current` promotes a warm download first — the "next start"
//! that a warm pull waits for.

use std::time::{SystemTime, UNIX_EPOCH};

use clap::Args;
use indicatif::HumanBytes;

use crate::bundle_pull::{json_line, store};

#[derive(Args, Debug)]
pub struct LsArgs {
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// An installed version [default: current], a bundle directory, or a bundle URL.
    version: Option<String>,
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    trust: crate::bundle_sign::TrustArgs,
}

#[derive(Args, Debug)]
pub struct RmArgs {
    version: String,
    /// Also remove the current version (and with it `current`).
    #[arg(long)]
    force: bool,
}

#[derive(Args, Debug)]
pub struct GcArgs {
    /// How many of the most recently installed versions to keep (current is always kept).
    #[arg(long, default_value_t = 2)]
    keep: usize,
}

fn fail(e: impl std::fmt::Display) -> i32 {
    eprintln!("vmctl: error: {e:#}");
    1
}

fn ago(secs: u64) -> String {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let d = now.saturating_sub(secs);
    match d {
        0..60 => format!("{d}s ago"),
        60..3600 => format!("{}m ago", d / 60),
        3600..86400 => format!("{}h ago", d / 3600),
        _ => format!("{}d ago", d / 86400),
    }
}

pub fn ls(args: LsArgs) -> i32 {
    let store = store();
    let list = store.list();
    if args.json {
        println!("{}", serde_json::to_string(&list).unwrap_or_default());
        return 0;
    }
    if list.is_empty() {
        eprintln!("vmctl: no bundles installed in {}", store.root().display());
        return 0;
    }
    println!("  {:<32} {:<9} {:>10}  INSTALLED", "VERSION", "FLAVOR", "SIZE");
    for i in &list {
        let mark = if i.current { "*" } else { " " };
        let version = if i.warm { format!("{} (warm)", i.version) } else { i.version.clone() };
        println!("{mark} {version:<32} {:<9} {:>10}  {}", i.flavor, HumanBytes(i.bytes).to_string(), ago(i.installed));
    }
    0
}

pub fn verify(args: VerifyArgs) -> i32 {
    let store = store();
    let spec = args.version.as_deref().unwrap_or("current");
    // A URL or a bundle directory (a path, or a flavor `vmctl bundle build` made) unless an
    // installed version has that name.
    let installed = store.resolve(spec).ok().filter(|v| store.get(v).is_ok());
    let version = match installed {
        Some(v) => v,
        None if spec.contains("://") || umbra_runtime::image::packed_dir(spec).is_some() => {
            return verify_source(spec, &args.trust, args.json).unwrap_or_else(fail);
        }
        None => match store.resolve(spec).and_then(|v| store.get(&v).map(|_| v)) {
            Ok(v) => v,
            Err(e) => return fail(e),
        },
    };
    let signature = args
        .trust
        .trust()
        .map_err(|e| e.to_string())
        .and_then(|trust| store.check_installed_signature(&version, &trust).map_err(|e| e.to_string()));
    let checks = match store.verify(&version) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    let changed = checks.iter().filter(|c| !c.ok()).count();
    let signed = signature.is_ok();
    if args.json {
        let (signer, signature_error) = match &signature {
            Ok(id) => (Some(id.as_str()), None),
            Err(e) => (None, Some(e.as_str())),
        };
        json_line(serde_json::json!({
            "version": version, "ok": changed == 0 && signed, "artifacts": checks,
            "signer": signer, "signature_error": signature_error,
        }));
    } else {
        match &signature {
            Ok(id) => println!("ok       signature    by trusted key {id}"),
            Err(e) => println!("BAD      signature    {e}"),
        }
        for c in &checks {
            if c.ok() {
                println!("ok       {:<12} {} bytes, sha256 {}", c.name, c.expected_size, c.expected_sha256);
            } else if let Some(err) = &c.error {
                println!("MISSING  {:<12} {}: {err}", c.name, c.path.display());
            } else {
                println!(
                    "CHANGED  {:<12} {}: expected {} bytes sha256 {}, found {} bytes sha256 {}",
                    c.name,
                    c.path.display(),
                    c.expected_size,
                    c.expected_sha256,
                    c.actual_size.unwrap_or(0),
                    c.actual_sha256.as_deref().unwrap_or("-")
                );
            }
        }
        if changed > 0 {
            eprintln!("vmctl: bundle {version}: {changed} artifact(s) changed since install; pull it again");
        } else {
            eprintln!("vmctl: bundle {version}: all {} artifacts verified", checks.len());
        }
    }
    i32::from(changed > 0 || !signed)
}

pub fn rm(args: RmArgs) -> i32 {
    match store().remove(&args.version, args.force) {
        Ok(()) => {
            eprintln!("vmctl: removed bundle {}", args.version);
            0
        }
        Err(e) => fail(e),
    }
}

pub fn gc(args: GcArgs) -> i32 {
    match store().gc(args.keep) {
        Ok(removed) => {
            for v in &removed {
                eprintln!("vmctl: removed bundle {v}");
            }
            eprintln!("vmctl: gc kept the {} newest and current; removed {}", args.keep, removed.len());
            0
        }
        Err(e) => fail(e),
    }
}

/// `verify`'s signature check of a bundle that is not installed: a directory or a URL.
fn verify_source(source: &str, trust: &crate::bundle_sign::TrustArgs, json: bool) -> anyhow::Result<i32> {
    let url = if source.contains("://") {
        source.to_string()
    } else {
        umbra_bundle::dir_url(&crate::paths::bundle_dir(source)?)?
    };
    let opts = umbra_bundle::PullOptions { trust: trust.trust()?, ..Default::default() };
    let result = store().check_signature(&url, &opts);
    match result {
        Ok(signed) => {
            if json {
                json_line(serde_json::json!({
                    "version": signed.manifest.bundle_version, "ok": true, "signer": signed.signer,
                }));
            } else {
                eprintln!("vmctl: bundle {}: signed by trusted key {}", signed.manifest.bundle_version, signed.signer);
            }
            Ok(0)
        }
        Err(e) => {
            if json {
                json_line(serde_json::json!({"ok": false, "error": e.to_string()}));
            }
            eprintln!("vmctl: error: {e}");
            Ok(1)
        }
    }
}
