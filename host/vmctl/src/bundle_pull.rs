//! `vmctl bundle pull URL` and `vmctl bundle import PATH`: the library does the work and
//! reports progress events; this file only draws them — an indicatif bar on stderr for people,
//! or one JSON object per line on stdout (`--json`) for programs.
//!
//! `--warm` downloads in the background: vmctl starts itself again, detached, with
//! `--foreground`, logging into the store, and returns at once; the next start promotes the
//! result with a rename.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::Context;
use clap::Args;
use indicatif::{HumanBytes, ProgressBar, ProgressStyle};
use umbra_bundle::{Phase, Progress, PullOptions, Pulled, PulledHow, RetryPolicy, Store};

#[derive(Args, Debug)]
pub struct PullArgs {
    /// Bundle URL: http(s):// or file:// of its manifest.json or of the directory holding it.
    url: String,
    /// Download into the warm slot, in the background; the next start promotes it.
    #[arg(long)]
    warm: bool,
    /// With --warm: stay in the foreground until the download is done.
    #[arg(long, requires = "warm")]
    foreground: bool,
    /// One JSON object per line on stdout instead of a progress bar.
    #[arg(long)]
    json: bool,
    /// Retries after a network error or a 5xx (none after a 4xx or a checksum mismatch).
    #[arg(long, default_value_t = RetryPolicy::default().retries)]
    retries: u32,
    #[command(flatten)]
    trust: crate::bundle_sign::TrustArgs,
}

#[derive(Args, Debug)]
pub struct ImportArgs {
    /// A bundle directory (manifest.json and the .zst files), or a flavor built by `vmctl bundle
    /// build`.
    path: String,
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    trust: crate::bundle_sign::TrustArgs,
}

pub fn store() -> Store {
    Store::new(Store::default_root())
}

/// Prints a JSON event line on stdout, flushed so a reader sees it at once.
pub fn json_line(value: serde_json::Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{value}");
    let _ = out.flush();
}

/// Draws progress events: a bar, or JSON lines.
struct Reporter {
    bar: Option<ProgressBar>,
}

impl Reporter {
    fn new(json: bool) -> Self {
        if json {
            return Self { bar: None };
        }
        let bar = ProgressBar::new(0);
        let style = ProgressStyle::with_template("{prefix:>10} [{bar:30}] {bytes:>10}/{total_bytes:<10} {msg}")
            .expect("a valid template")
            .progress_chars("=> ");
        bar.set_style(style);
        Self { bar: Some(bar) }
    }

    fn event(&self, p: &Progress) {
        let Some(bar) = &self.bar else {
            let mut v = serde_json::to_value(p).unwrap_or_default();
            v["event"] = "progress".into();
            json_line(v);
            return;
        };
        bar.set_length(p.total);
        bar.set_position(p.done);
        let what = match p.phase {
            Phase::Download | Phase::Retry => p.artifact.clone().unwrap_or_default(),
            other => serde_json::to_value(other).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default(),
        };
        bar.set_prefix(what);
        match p.phase {
            Phase::Retry | Phase::Waiting => {
                if let Some(m) = &p.message {
                    bar.println(format!("vmctl: {m}"));
                }
            }
            Phase::Download => {
                let eta = p.eta_secs.map_or(String::new(), |s| format!(", eta {}", fmt_secs(s)));
                bar.set_message(format!("{}/s{eta}", HumanBytes(p.rate as u64)));
            }
            _ => {}
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

fn fmt_secs(s: f64) -> String {
    let s = s.round() as u64;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, s % 3600 / 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

fn report(result: anyhow::Result<Pulled>, reporter: &Reporter, json: bool) -> i32 {
    reporter.finish();
    match result {
        Ok(p) => {
            let version = &p.bundle.manifest.bundle_version;
            if json {
                json_line(serde_json::json!({
                    "event": "pulled", "version": version, "how": p.how,
                    "downloaded": p.downloaded, "dir": p.bundle.dir,
                }));
            } else {
                let how = match p.how {
                    PulledHow::Downloaded => "installed and current",
                    PulledHow::AlreadyInstalled => "already installed; current",
                    PulledHow::PromotedWarm => "promoted from the warm slot; current",
                    PulledHow::Warmed => "ready in the warm slot; the next start promotes it",
                };
                eprintln!("vmctl: bundle {version}: {how} ({} downloaded)", HumanBytes(p.downloaded));
                println!("{}", p.bundle.dir.display());
            }
            0
        }
        Err(e) => {
            if json {
                json_line(serde_json::json!({"event": "error", "message": format!("{e:#}")}));
            }
            eprintln!("vmctl: error: {e:#}");
            1
        }
    }
}

pub fn pull(args: PullArgs) -> i32 {
    if args.warm && !args.foreground {
        // Refused now, not only in the background pull's log: the source and the signature.
        let checked = check_source(&args.url).and_then(|sources| {
            let opts = PullOptions { trust: args.trust.trust()?, sources, ..PullOptions::default() };
            store().check_signature(&args.url, &opts).map_err(anyhow::Error::from)
        });
        if let Err(e) = checked {
            eprintln!("vmctl: error: {e:#}");
            return 1;
        }
        return match spawn_warm(&args) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("vmctl: error: {e:#}");
                1
            }
        };
    }
    let reporter = Reporter::new(args.json);
    let result = args.trust.trust().and_then(|trust| {
        let opts = PullOptions {
            warm: args.warm,
            retry: RetryPolicy { retries: args.retries, ..RetryPolicy::default() },
            trust,
            sources: check_source(&args.url)?,
            ..PullOptions::default()
        };
        store().pull(&args.url, &opts, &mut |p| reporter.event(p)).map_err(anyhow::Error::from)
    });
    report(result, &reporter, args.json)
}

/// The system policy's `bundle_sources`, as umbrad holds `bundle.download` to them: `url`
/// checked now, and the check for the redirects the download meets.
fn check_source(url: &str) -> anyhow::Result<Option<umbra_bundle::SourceCheck>> {
    let path = std::path::Path::new(umbra_api::system::SYSTEM_POLICY_PATH);
    let system = umbra_runtime::system_policy::load(path)?;
    if let Some(system) = &system {
        system.check_bundle_source(url).map_err(anyhow::Error::msg)?;
    }
    Ok(umbra_runtime::bundle_trust::sources(system.as_ref()))
}

/// Starts `vmctl bundle pull --warm --foreground URL` detached, logging into the store.
fn spawn_warm(args: &PullArgs) -> anyhow::Result<()> {
    let store = store();
    std::fs::create_dir_all(store.root()).with_context(|| format!("cannot create {}", store.root().display()))?;
    // Dot-named: no bundle version can be called that.
    let log_path: PathBuf = store.root().join(".warm.log");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("cannot open {}", log_path.display()))?;
    let exe = std::env::current_exe().context("cannot find the vmctl executable")?;
    let child = Command::new(exe)
        .args(["bundle", "pull", "--warm", "--foreground", "--json", "--retries"])
        .arg(args.retries.to_string())
        .args(args.trust.trusted_keys.iter().flat_map(|k| [std::ffi::OsStr::new("--trusted-key"), k.as_os_str()]))
        .args(args.trust.allow_http_loopback.then_some("--allow-http-loopback"))
        .arg(&args.url)
        .stdin(Stdio::null())
        .stdout(log.try_clone().context("cannot dup the log")?)
        .stderr(log)
        // Its own process group: a Ctrl-C meant for this shell does not stop the download.
        .process_group(0)
        .spawn()
        .context("cannot start the background pull")?;
    if args.json {
        json_line(serde_json::json!({"event": "warming", "pid": child.id(), "log": log_path}));
    } else {
        eprintln!("vmctl: downloading {} into the warm slot in the background (pid {})", args.url, child.id());
        eprintln!("vmctl: log: {}; the next start promotes it", log_path.display());
    }
    Ok(())
}

pub fn import(args: ImportArgs) -> i32 {
    let reporter = Reporter::new(args.json);
    let result = crate::paths::bundle_dir(&args.path).and_then(|dir| {
        let opts = PullOptions { trust: args.trust.trust()?, ..PullOptions::default() };
        store().import(&dir, &opts, &mut |p| reporter.event(p)).map_err(anyhow::Error::from)
    });
    report(result, &reporter, args.json)
}
