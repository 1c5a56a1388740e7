//! `vmctl bench lint`: `diagnostics.for_change` for a one-line change in a Python project of
//! `--files` modules (1,000 by default), beside running pyflakes on the changed file directly in
//! the same guest, in one run:
//!
//! - **for_change**: the change to one module, then a fix of it, alternately, each timed from
//!   the call to its answer (pylsp's pyflakes in the guest, the baseline, the change, the
//!   settling); the first request, which starts the server, is reported apart.
//! - **pyflakes directly**: the same changed text written to a file in the guest and checked
//!   with `python3 -m pyflakes`, timed the same way from the host (a process spawned through
//!   the agent) and, inside the guest, the interpreter's own run.
//!
//! Needs the standard bundle (pylsp and pyflakes in the guest).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use umbra_api::lsp::ForChangeParams;
use umbra_api::methods::StartParams;
use umbra_api::{BackendChoice, FolderSpec};
use umbra_proto::ShareMode;
use umbra_runtime::session::{ExecRequest, Session};

use crate::boot::{median, ms};

#[derive(Args, Debug)]
pub struct LintBenchArgs {
    #[arg(long, default_value = "standard")]
    bundle: String,
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendChoice,
    /// Modules in the project.
    #[arg(long, default_value_t = 1000)]
    files: usize,
    /// Timed requests of each kind.
    #[arg(long, default_value_t = 10)]
    runs: usize,
    /// Guest memory, MiB.
    #[arg(long, default_value_t = 1024)]
    memory: u32,
    #[arg(long, default_value_t = 120, env = "UMBRA_BOOT_TIMEOUT_SECS")]
    boot_timeout: u64,
}

/// Module `i` of the project: imports from its neighbour, a class, three functions.
fn module(i: usize) -> String {
    let prev = if i == 0 { String::new() } else { format!("from pkg.mod_{:04} import helper_{:04}\n", i - 1, i - 1) };
    let call = if i == 0 { "x".to_string() } else { format!("helper_{:04}(x)", i - 1) };
    format!(
        "\"\"\"Module {i}.\"\"\"\nimport os\n{prev}\n\nclass Thing{i}:\n    def __init__(self, x):\n        self.x = x\n\n    \
         def value(self):\n        return self.x + {i}\n\n\ndef helper_{i:04}(x):\n    return {call}\n\n\ndef path_{i}(name):\n    \
         return os.path.join(\"/tmp\", name)\n\n\ndef total_{i}(items):\n    return sum(Thing{i}(v).value() for v in items)\n"
    )
}

pub async fn lint(args: LintBenchArgs) -> anyhow::Result<()> {
    if args.files == 0 || args.runs == 0 {
        bail!("--files and --runs must be at least 1");
    }
    let project = std::env::temp_dir().join(format!("umbra-bench-lint-{}", std::process::id()));
    std::fs::create_dir_all(project.join("pkg"))?;
    std::fs::write(project.join("pkg/__init__.py"), "")?;
    for i in 0..args.files {
        std::fs::write(project.join(format!("pkg/mod_{i:04}.py")), module(i))?;
    }
    let manager =
        crate::boot::bench_manager(args.memory, args.boot_timeout, &args.bundle, args.backend, serde_json::json!({}))?;
    let start = StartParams {
        name: "bench-lint".into(),
        folders: vec![FolderSpec { path: project.clone(), name: Some("work".into()), mode: ShareMode::Shadow }],
        ..Default::default()
    };
    let result = async {
        let session = manager.start(start).await?;
        measure(&args, &session).await
    }
    .await;
    let _ = manager.delete("bench-lint").await;
    let _ = std::fs::remove_dir_all(&project);
    result
}

async fn measure(args: &LintBenchArgs, session: &std::sync::Arc<Session>) -> anyhow::Result<()> {
    let target = format!("pkg/mod_{:04}.py", args.files / 2);
    let original = module(args.files / 2);
    // The one-line change: an undefined name in a return.
    let broken = original.replacen("return self.x + ", "return missing_name + self.x + ", 1);
    if broken == original {
        bail!("the change did not apply to {target}");
    }
    let request = |text: &str| ForChangeParams {
        session: session.name().into(),
        folder: "work".into(),
        changes: BTreeMap::from([(target.clone(), Some(text.to_string()))]),
        language: None,
        timeout_ms: Some(120_000),
    };

    let t = Instant::now();
    let first = session.diagnostics_for_change(request(&broken)).await?;
    let first_time = t.elapsed();
    if first.diagnostics.len() != 1 || !first.complete {
        bail!("the change should bring one diagnostic: {first:?}");
    }
    let mut for_change = Vec::new();
    for i in 0..args.runs {
        let text = if i % 2 == 0 { &original } else { &broken };
        let t = Instant::now();
        let r = session.diagnostics_for_change(request(text)).await?;
        for_change.push(t.elapsed());
        if !r.complete {
            bail!("request {i} did not settle: {r:?}");
        }
    }

    // The anchor: pyflakes on the same text, in the same guest.
    let guest_file = "/tmp/bench-lint-target.py";
    session
        .write_file(guest_file, false, broken.as_bytes(), umbra_proto::WriteMode::Truncate, false, None)
        .await
        .context("write the changed file in the guest")?;
    let timer = "import subprocess, sys, time\nt = time.monotonic()\n\
                 subprocess.run([sys.executable, '-m', 'pyflakes', sys.argv[1]], stdout=subprocess.DEVNULL)\n\
                 print(time.monotonic() - t)\n";
    let (mut spawned, mut inside) = (Vec::new(), Vec::new());
    for _ in 0..args.runs {
        let req = ExecRequest {
            argv: vec!["python3".into(), "-c".into(), timer.into(), guest_file.into()],
            ..Default::default()
        };
        let t = Instant::now();
        let out = session.spawn(req).await?.output().await;
        spawned.push(t.elapsed());
        let secs: f64 = String::from_utf8_lossy(&out.stdout).trim().parse().with_context(|| {
            format!("the guest's timer printed {:?} {:?}", out.stdout, String::from_utf8_lossy(&out.stderr))
        })?;
        inside.push(Duration::from_secs_f64(secs));
    }
    let (fc, sp, ins) = (median(for_change.clone()), median(spawned), median(inside));
    let mut sorted = for_change;
    sorted.sort();
    let p90 = sorted[sorted.len() * 9 / 10];
    println!("lint benchmark: a one-line change in a {}-module Python project ({target})", args.files);
    println!("  diagnostics.for_change, first (starts pylsp): {:>8.0} ms", ms(first_time));
    println!("  diagnostics.for_change, median of {:<3}     : {:>8.0} ms (p90 {:.0} ms)", args.runs, ms(fc), ms(p90));
    println!("  pyflakes on the file, spawned from the host: {:>8.0} ms", ms(sp));
    println!("  pyflakes on the file, inside the guest     : {:>8.0} ms", ms(ins));
    println!(
        "  ratio for_change / pyflakes spawned: {:.2}; / pyflakes inside the guest: {:.2}",
        fc.as_secs_f64() / sp.as_secs_f64(),
        fc.as_secs_f64() / ins.as_secs_f64()
    );
    Ok(())
}
