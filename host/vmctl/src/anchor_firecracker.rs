//! Firecracker as a benchmark anchor for the Umbra VMM: the same guest, booted by Firecracker in
//! the same run. Never a dependency: the benches use it when a binary is found
//! (`$UMBRA_FIRECRACKER_BIN`, else `firecracker` on `PATH`) and say so when it is not.
//!
//! Firecracker runs without its API (`--no-api --config-file`), configured like umbra-vmm: the
//! same kernel, initramfs and kernel arguments, one vCPU, the same memory, a virtio-rng device,
//! and vsock over the same hybrid Unix-socket protocol — so the guest agent announces itself on
//! `<uds>_1025` and answers `CONNECT 1024` exactly as under umbra-vmm.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use umbra_runtime::agent::AgentClient;
use umbra_runtime::backend::kvm::KVM_CMDLINE;
use umbra_runtime::backend::BootImage;

/// The Firecracker binary to measure against, if there is one.
pub fn find() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("UMBRA_FIRECRACKER_BIN").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("PATH")?.to_str()?.split(':').map(|d| Path::new(d).join("firecracker")).find(|p| p.is_file())
}

/// A Firecracker process, killed when dropped (a failed bench leaves no VM behind).
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(fc: &Path, config: &Path, stdout: Stdio) -> anyhow::Result<Running> {
    let child = Command::new(fc)
        .args(["--no-api", "--level", "Error", "--config-file"])
        .arg(config)
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("start {}", fc.display()))?;
    Ok(Running(child))
}

/// One bare-guest run: (launch → first serial byte, launch → exit), as `bare_once` measures
/// umbra-vmm. The guest's i8042 reset ends Firecracker.
pub fn bare_once(fc: &Path, elf: &Path, dir: &Path) -> anyhow::Result<(Duration, Duration)> {
    let config = dir.join("fc-bare.json");
    let json = serde_json::json!({
        "boot-source": { "kernel_image_path": elf, "boot_args": "console=ttyS0" },
        "machine-config": { "vcpu_count": 1, "mem_size_mib": 32 },
        "drives": [],
    });
    std::fs::write(&config, serde_json::to_vec(&json)?)?;
    let t = Instant::now();
    let mut run = spawn(fc, &config, Stdio::piped())?;
    let mut first = [0u8; 1];
    let n = run.0.stdout.take().expect("piped").read(&mut first).context("read Firecracker's serial output")?;
    let first_byte = t.elapsed();
    let status = run.0.wait()?;
    let exited = t.elapsed();
    if n != 1 || !status.success() {
        let mut err = String::new();
        run.0.stderr.take().expect("piped").read_to_string(&mut err)?;
        bail!("the bare guest did not print and reset under Firecracker ({status}): {err}");
    }
    Ok((first_byte, exited))
}

/// One Linux boot: Firecracker launch → the agent answered the protocol handshake (what
/// `VmInfo::boot_ms` measures for the Umbra backends). The VM is killed afterwards.
pub async fn linux_once(fc: &Path, image: &BootImage, memory_mib: u32, dir: &Path) -> anyhow::Result<Duration> {
    let Some(initrd) = &image.initrd else { bail!("the Firecracker anchor needs an initramfs bundle (minimal)") };
    let uds = dir.join("fc-vsock.sock");
    let ready_path = PathBuf::from(format!("{}_{}", uds.display(), umbra_proto::AGENT_READY_VSOCK_PORT));
    for p in [&uds, &ready_path] {
        let _ = std::fs::remove_file(p);
    }
    let config = dir.join("fc-linux.json");
    let json = serde_json::json!({
        "boot-source": {
            "kernel_image_path": image.kernel,
            "initrd_path": initrd,
            "boot_args": format!("{KVM_CMDLINE} {}", image.cmdline).trim(),
        },
        "machine-config": { "vcpu_count": 1, "mem_size_mib": memory_mib },
        "vsock": { "guest_cid": 3, "uds_path": uds },
        "entropy": {},
        "drives": [],
    });
    std::fs::write(&config, serde_json::to_vec(&json)?)?;
    let ready = tokio::net::UnixListener::bind(&ready_path).context("listen for the agent's announcement")?;
    let t = Instant::now();
    let mut run = spawn(fc, &config, Stdio::null())?;
    let result = wait_agent(&mut run, &ready, &uds, t).await;
    drop(run);
    let _ = std::fs::remove_file(&ready_path);
    let _ = std::fs::remove_file(&uds);
    result
}

/// Waits for the announcement, then for the handshake; fails at once if Firecracker exits.
async fn wait_agent(
    run: &mut Running,
    ready: &tokio::net::UnixListener,
    uds: &Path,
    t: Instant,
) -> anyhow::Result<Duration> {
    let mut announced = false;
    while t.elapsed() < Duration::from_secs(120) {
        if let Some(status) = run.0.try_wait()? {
            let mut err = String::new();
            run.0.stderr.take().expect("piped").read_to_string(&mut err)?;
            bail!("Firecracker exited ({status}) before its guest's agent answered: {err}");
        }
        if !announced {
            announced = matches!(tokio::time::timeout(Duration::from_millis(50), ready.accept()).await, Ok(Ok(_)));
            continue;
        }
        if AgentClient::connect_hybrid_vsock(uds, umbra_proto::AGENT_VSOCK_PORT).await.is_ok() {
            return Ok(t.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    bail!("Firecracker's guest agent did not answer within 120 s (announced: {announced})")
}
