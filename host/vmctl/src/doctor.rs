//! `vmctl doctor`: what this host can run, what is missing, and the command that fixes each.

use std::path::Path;
use std::process::Command;

use clap::Args;
use serde_json::json;
use umbra_runtime::backend::host::{Program, PROGRAMS};
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

fn program(p: &Program) -> Check {
    match p.find() {
        Some(path) => {
            // Third-party tools say which version they are; Umbra's own are this build.
            let v = if p.ships_with_umbra { String::new() } else { version_of(&path, "--version") };
            Check { name: p.name, ok: true, detail: format!("{} {v}", path.display()).trim().to_string(), fix: None }
        }
        None => Check { name: p.name, ok: false, detail: "not found".into(), fix: Some(p.fix.into()) },
    }
}

/// Whether umbrad answers on its socket (informational: `vmctl run` needs no daemon).
fn daemon_check() -> Check {
    let socket = umbra_api::paths::default_socket();
    match std::os::unix::net::UnixStream::connect(&socket) {
        Ok(_) => Check { name: "umbrad running", ok: true, detail: format!("serving {}", socket.display()), fix: None },
        Err(e) => Check {
            name: "umbrad running",
            ok: false,
            detail: format!("not at {} ({e}); `vmctl session` needs it, `vmctl run` does not", socket.display()),
            fix: Some("umbrad (foreground), or systemctl --user start umbrad (host/daemon/umbrad.service)".into()),
        },
    }
}

/// Whom a bundle download trusts (`docs/bundle.md`, "Signatures"): with no key, every pull is
/// refused, which is worth saying before one is tried.
fn bundle_keys_check() -> Check {
    let name = "bundle keys";
    match crate::bundle_sign::TrustArgs::default().trust() {
        Ok(t) if t.keys.is_empty() => Check {
            name,
            ok: true,
            detail: "none trusted: `vmctl bundle pull` and `bundle.download` refuse every bundle".into(),
            fix: Some(format!(
                "put the publisher's .pub file in {} (a `vmctl bundle build` trusts its own key)",
                umbra_api::paths::trusted_keys_dir().display()
            )),
        },
        Ok(t) => Check {
            name,
            ok: true,
            detail: t.keys.iter().map(|(k, from)| format!("{} ({from})", k.id())).collect::<Vec<_>>().join(", "),
            fix: None,
        },
        Err(e) => Check { name, ok: false, detail: format!("{e:#}"), fix: None },
    }
}

/// The machine's system policy (`docs/policy.md`): none, its ceilings, or why umbrad refuses it.
fn system_policy_check() -> Check {
    let path = std::path::Path::new(umbra_api::system::SYSTEM_POLICY_PATH);
    match umbra_runtime::system_policy::load(path) {
        Ok(None) => Check { name: "system policy", ok: true, detail: format!("none ({})", path.display()), fix: None },
        Ok(Some(policy)) => Check {
            name: "system policy",
            ok: true,
            detail: format!(
                "{}: {}",
                path.display(),
                serde_json::to_string(&policy).unwrap_or_else(|e| format!("(cannot show it: {e})"))
            ),
            fix: None,
        },
        Err(e) => Check {
            name: "system policy",
            ok: false,
            detail: format!("{e} (umbrad will not start)"),
            fix: Some(format!("sudo chown root:root {0} && sudo chmod 644 {0}, and fix what it says", path.display())),
        },
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
    let kernel_dir = paths::cache_dir().join("kernel");
    let mut kernels = dirs_with(&kernel_dir, "vmlinux");
    kernels.extend(dirs_with(&kernel_dir, "Image")); // arm64
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
    let mut checks = vec![kvm_check];
    checks.extend(PROGRAMS.iter().map(program));
    checks.extend([
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
        daemon_check(),
        system_policy_check(),
        bundle_keys_check(),
    ]);
    let (backend, why) =
        match umbra_runtime::backend::select::choose(umbra_api::BackendChoice::Auto, umbra_bundle::Arch::host()) {
            Ok((b, why)) => (format!("{b:?}").to_lowercase(), why),
            Err(e) => ("none".into(), e.to_string()),
        };
    // `idle_action: suspend` snapshots the VM: only the kvm backend (umbra-vmm) can.
    let suspends = backend == "kvm";
    let idle_suspend = if suspends {
        "idle_action \"suspend\": an idle session is snapshotted and the next call naming it restores it \
         (kvm backend)"
            .to_string()
    } else {
        format!(
            "idle_action \"suspend\" needs the kvm backend (snapshots): on {backend}, an idle session stops instead \
             (its processes end; a resume boots it)"
        )
    };
    let ok = |names: &[&str]| checks.iter().filter(|c| names.contains(&c.name)).all(|c| c.ok);
    // `vmctl run` on QEMU; sessions add folders (umbra-fsd, virtiofsd), the disk and the daemon.
    let runnable = ok(&["qemu-system-x86_64", "vhost-device-vsock", "bundles"]);
    let sessions = runnable && ok(&["umbra-fsd", "virtiofsd", "mkfs.ext4", "umbrad"]);
    // What confines the parts a hostile guest talks to, as things stand.
    #[cfg(target_os = "linux")]
    let landlock = match umbra_vmm::jail::landlock_abi() {
        Ok(Some(abi)) => format!("landlock ABI {abi}"),
        Ok(None) => "no landlock (not in this kernel)".to_string(),
        Err(e) => e,
    };
    #[cfg(not(target_os = "linux"))]
    let landlock = "no landlock (not Linux)".to_string();
    // SAFETY: geteuid has no preconditions.
    let identity = if unsafe { libc::geteuid() } == 0 {
        format!("as uid {} (nobody)", umbra_runtime::backend::kvm::JAIL_ID)
    } else {
        "as you, in a user namespace".to_string()
    };
    let jail = if umbra_runtime::backend::kvm::jail_enabled() {
        format!(
            "jailed: new mount, pid, ipc, uts and net namespaces, pivot_root into the VM's vsock directory, \
             {identity}, no core dumps, 4096 fds, {landlock}"
        )
    } else {
        "not jailed (UMBRA_VMM_JAIL=off)".to_string()
    };
    let confinement = [
        ("qemu", format!("seccomp: -sandbox {}", umbra_runtime::backend::QEMU_SANDBOX)),
        (
            "umbra-fsd",
            "a private mount namespace (and a user namespace when unprivileged); ro shares read-only on the host; \
             a seccomp filter on every thread once virtiofsd runs (kill-process)"
                .into(),
        ),
        ("network", "no guest NIC; every connection decided by the host's egress proxy (docs/network.md)".into()),
        (
            "umbra-vmm",
            format!(
                "seccomp filter per thread kind (main, vcpu, block, rng, vsock, fs_calls, fs_watchdog; kill-process), \
                 no_new_privs, no capabilities; {jail}"
            ),
        ),
    ];
    // And what the kernel shows for every helper process running now (any session's VMs).
    #[cfg(target_os = "linux")]
    let helpers = umbra_runtime::backend::confinement::Confinement::helpers();
    #[cfg(not(target_os = "linux"))]
    let helpers: Vec<umbra_runtime::backend::confinement::Confinement> = Vec::new();
    if args.json {
        let confinement: serde_json::Map<String, serde_json::Value> =
            confinement.iter().map(|(k, v)| (k.to_string(), json!(v))).collect();
        let items: Vec<_> =
            checks.iter().map(|c| json!({"name": c.name, "ok": c.ok, "detail": c.detail, "fix": c.fix})).collect();
        let doc = json!({"kvm": format!("{kvm:?}").to_lowercase(), "checks": items,
            "auto_backend": backend, "why": why, "can_run": runnable, "can_run_sessions": sessions,
            "idle_suspend": suspends, "idle_suspend_detail": idle_suspend,
            "confinement": confinement, "helpers": helpers});
        println!("{doc}");
    } else {
        for c in &checks {
            println!("{} {:<20} {}", if c.ok { "ok  " } else { "MISS" }, c.name, c.detail);
            if let Some(fix) = &c.fix {
                println!("     {:<20} fix: {fix}", "");
            }
        }
        println!("\nconfinement");
        for (part, what) in &confinement {
            println!("     {part:<20} {what}");
        }
        if !helpers.is_empty() {
            println!("\nrunning helpers (pid, name, uid:gid, capabilities, seccomp, own namespaces)");
            for h in &helpers {
                println!(
                    "     {:<8} {:<16} {}:{} cap {} seccomp {}{} ns [{}]",
                    h.pid,
                    h.name,
                    h.uid,
                    h.gid,
                    if h.no_capabilities() { "none".to_string() } else { h.cap_eff.clone() },
                    h.seccomp,
                    if h.no_new_privs { " no_new_privs" } else { "" },
                    h.own_namespaces.join(" ")
                );
            }
        }
        println!("\nbackend auto -> {backend}: {why}");
        println!("{idle_suspend}");
        println!(
            "{}",
            if runnable {
                "this host can run sandboxes"
            } else {
                "this host cannot run sandboxes yet: apply the fixes above"
            }
        );
        if runnable && !sessions {
            println!("sessions (folders, disks, umbrad) need the missing pieces above");
        }
    }
    if runnable {
        0
    } else {
        1
    }
}
