//! `vmctl doctor`: what this host can run, what is missing, and the command that fixes each.

use std::path::Path;
use std::process::Command;

use clap::Args;
use serde_json::json;
use umbra_runtime::backend::host::find_binary;
use umbra_runtime::backend::KvmKind;

use crate::paths;

#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

struct Check {
    name: &'static str,
    ok: bool,
    detail: String,
    fix: Option<String>,
}

fn version_of(bin: &Path, arg: &str) -> String {
    Command::new(bin)
        .arg(arg)
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().next().unwrap_or_default().trim().to_string())
        .unwrap_or_default()
}

fn binary(name: &'static str, env: &str, version_arg: &str, fix: &str) -> Check {
    match find_binary(name, env) {
        Some(p) => {
            let v = version_of(&p, version_arg);
            Check { name, ok: true, detail: format!("{} {v}", p.display()).trim().to_string(), fix: None }
        }
        None => Check { name, ok: false, detail: "not found".into(), fix: Some(fix.into()) },
    }
}

fn kvm_check() -> (KvmKind, Check) {
    let kind = KvmKind::detect();
    let (ok, detail) = match kind {
        KvmKind::Hardware => (true, "hardware (VT-x/AMD-V): guests run at native speed".to_string()),
        KvmKind::Pvm => (
            false,
            "kvm_pvm: a software hypervisor that cannot boot an ordinary Linux guest; guests run under QEMU's TCG emulation (slow but correct)".into(),
        ),
        KvmKind::Absent => (false, "no usable /dev/kvm; guests run under QEMU's TCG emulation".into()),
    };
    let fix = (!ok).then(|| "use a host with VT-x/AMD-V and load kvm-intel or kvm-amd for native speed".to_string());
    (kind, Check { name: "kvm", ok, detail, fix })
}

fn vmm_check() -> Check {
    match umbra_runtime::backend::kvm::find_vmm() {
        Some(p) => Check { name: "umbra-vmm", ok: true, detail: p.display().to_string(), fix: None },
        None => Check {
            name: "umbra-vmm",
            ok: false,
            detail: "not found next to vmctl, on PATH or in UMBRA_VMM_BIN".into(),
            fix: Some("cargo build -p umbra-vmm (it ships next to vmctl)".into()),
        },
    }
}

fn dirs_with(root: &Path, file: &str) -> Vec<String> {
    let mut found: Vec<String> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().join(file).exists())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    found.sort();
    found
}

pub fn run(args: DoctorArgs) -> i32 {
    let (kvm, kvm_check) = kvm_check();
    let kernels = dirs_with(&paths::cache_dir().join("kernel"), "vmlinux");
    let built = dirs_with(&paths::built_bundles_dir(), "manifest.json");
    let store = umbra_bundle::Store::new(umbra_bundle::Store::default_root());
    let installed: Vec<String> = store
        .list()
        .into_iter()
        .map(|b| {
            format!(
                "{}{}",
                b.version,
                if b.current {
                    " (current)"
                } else if b.warm {
                    " (warm)"
                } else {
                    ""
                }
            )
        })
        .collect();
    let bundles: Vec<String> = built.iter().map(|b| format!("{b} (built)")).chain(installed).collect();
    let checks = vec![
        kvm_check,
        binary(
            "qemu-system-x86_64",
            "UMBRA_QEMU",
            "--version",
            "scripts/install-deps (apt-get install qemu-system-x86)",
        ),
        vmm_check(),
        binary(
            "vhost-device-vsock",
            "UMBRA_VHOST_VSOCK",
            "--version",
            "scripts/install-deps (cargo install --locked vhost-device-vsock@0.3.0)",
        ),
        binary(
            "virtiofsd",
            "UMBRA_VIRTIOFSD",
            "--version",
            "scripts/install-deps (cargo install --locked virtiofsd@1.14.0)",
        ),
        Check {
            name: "kernel cache",
            ok: !kernels.is_empty(),
            detail: if kernels.is_empty() {
                "no built kernel".into()
            } else {
                format!("{} build(s) in {}", kernels.len(), paths::cache_dir().join("kernel").display())
            },
            fix: kernels.is_empty().then(|| "scripts/build-kernel".into()),
        },
        Check {
            name: "bundles",
            ok: !bundles.is_empty(),
            detail: if bundles.is_empty() { "none built".into() } else { bundles.join(", ") },
            fix: bundles.is_empty().then(|| "vmctl bundle build --flavor minimal, or vmctl bundle pull URL".into()),
        },
    ];
    let (backend, why) = match umbra_runtime::backend::select::choose(umbra_api::BackendChoice::Auto) {
        Ok((b, why)) => (format!("{b:?}").to_lowercase(), why),
        Err(e) => ("none".into(), e.to_string()),
    };
    let needed = ["qemu-system-x86_64", "vhost-device-vsock", "bundles"];
    let runnable = checks.iter().filter(|c| needed.contains(&c.name)).all(|c| c.ok);
    if args.json {
        let items: Vec<_> =
            checks.iter().map(|c| json!({"name": c.name, "ok": c.ok, "detail": c.detail, "fix": c.fix})).collect();
        let doc = json!({"kvm": format!("{kvm:?}").to_lowercase(), "checks": items,
            "auto_backend": backend, "why": why, "can_run": runnable});
        println!("{doc}");
    } else {
        for c in &checks {
            println!("{} {:<20} {}", if c.ok { "ok  " } else { "MISS" }, c.name, c.detail);
            if let Some(fix) = &c.fix {
                println!("     {:<20} fix: {fix}", "");
            }
        }
        println!("\nbackend auto -> {backend}: {why}");
        println!(
            "{}",
            if runnable {
                "this host can run sandboxes"
            } else {
                "this host cannot run sandboxes yet: apply the fixes above"
            }
        );
    }
    if runnable {
        0
    } else {
        1
    }
}
