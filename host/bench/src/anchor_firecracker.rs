//! Firecracker as a benchmark anchor for the Umbra VMM: the same guest, booted by Firecracker in
//! the same run. Never a dependency: the benches use it when a binary is found
//! (`$UMBRA_FIRECRACKER_BIN`, else `firecracker` on `PATH`) and say so when it is not.
//!
//! Firecracker boots from a config file (`--config-file`), configured like umbra-vmm: the
//! same kernel, initramfs and kernel arguments, one vCPU, the same memory, a virtio-rng device,
//! and vsock over the same hybrid Unix-socket protocol — so the guest agent announces itself on
//! `<uds>_1025` and answers `CONNECT 1024` exactly as under umbra-vmm. Boots run without its
//! API (`--no-api`); snapshots use it (`--api-sock`: pause, `PUT /snapshot/create`, and in a new
//! process `PUT /snapshot/load` with the memory file as a `File` backend, which Firecracker maps
//! privately, as umbra-vmm does).

use std::ffi::OsStr;
use std::io::{Read, Write};
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
    spawn_with(fc, [OsStr::new("--no-api"), OsStr::new("--config-file"), config.as_os_str()], stdout)
}

fn spawn_with<'a>(fc: &Path, args: impl IntoIterator<Item = &'a OsStr>, stdout: Stdio) -> anyhow::Result<Running> {
    let child = Command::new(fc)
        .args(["--level", "Error"])
        .args(args)
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
    let (uds, ready_path) = vsock_paths(dir);
    let config = linux_config(image, memory_mib, dir)?;
    let ready = tokio::net::UnixListener::bind(&ready_path).context("listen for the agent's announcement")?;
    let t = Instant::now();
    let mut run = spawn(fc, &config, Stdio::null())?;
    let result = wait_agent(&mut run, &ready, &uds, t).await;
    drop(run);
    let _ = std::fs::remove_file(&ready_path);
    let _ = std::fs::remove_file(&uds);
    result
}

/// The guest's vsock socket in `dir` and its announcement socket, neither left over.
fn vsock_paths(dir: &Path) -> (PathBuf, PathBuf) {
    let uds = dir.join("fc-vsock.sock");
    let ready_path = PathBuf::from(format!("{}_{}", uds.display(), umbra_proto::AGENT_READY_VSOCK_PORT));
    for p in [&uds, &ready_path] {
        let _ = std::fs::remove_file(p);
    }
    (uds, ready_path)
}

/// Writes the config file for `image` (vsock at [`vsock_paths`]) into `dir`.
fn linux_config(image: &BootImage, memory_mib: u32, dir: &Path) -> anyhow::Result<PathBuf> {
    let Some(initrd) = &image.initrd else { bail!("the Firecracker anchor needs an initramfs bundle (minimal)") };
    let uds = dir.join("fc-vsock.sock");
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
    Ok(config)
}

/// A Firecracker snapshot of the Linux guest, taken once its agent answered.
pub struct Snapshot {
    dir: PathBuf,
    state: PathBuf,
    memory: PathBuf,
}

/// Boots `image` under Firecracker with its API, waits for the agent, pauses the VM and writes a
/// full snapshot into `dir`; the VM is then killed.
pub async fn snapshot_linux(fc: &Path, image: &BootImage, memory_mib: u32, dir: &Path) -> anyhow::Result<Snapshot> {
    let (uds, ready_path) = vsock_paths(dir);
    let config = linux_config(image, memory_mib, dir)?;
    let api_sock = dir.join("fc-api.sock");
    let _ = std::fs::remove_file(&api_sock);
    let ready = tokio::net::UnixListener::bind(&ready_path).context("listen for the agent's announcement")?;
    let args = [OsStr::new("--api-sock"), api_sock.as_os_str(), OsStr::new("--config-file"), config.as_os_str()];
    let mut run = spawn_with(fc, args, Stdio::null())?;
    wait_agent(&mut run, &ready, &uds, Instant::now()).await?;
    let snap = Snapshot { dir: dir.to_path_buf(), state: dir.join("fc.state"), memory: dir.join("fc.memory") };
    api(&api_sock, "PATCH", "/vm", &serde_json::json!({ "state": "Paused" }))?;
    api(
        &api_sock,
        "PUT",
        "/snapshot/create",
        &serde_json::json!({ "snapshot_type": "Full", "snapshot_path": snap.state, "mem_file_path": snap.memory }),
    )?;
    drop(run);
    let _ = std::fs::remove_file(&ready_path);
    Ok(snap)
}

/// One restore: a new Firecracker process → `PUT /snapshot/load` (resumed) → the agent answered
/// the protocol handshake. The VM is killed afterwards.
/// One Firecracker restore, by phase: launch → the API answers → `PUT /snapshot/load` done
/// (state read, memory mapped, guest resumed) → the agent answers.
#[derive(Debug, Clone, Copy)]
pub struct RestoreTimes {
    /// Launch until `/snapshot/load` returned: the VMM's part.
    pub loaded: Duration,
    /// Launch until the agent answered.
    pub ready: Duration,
}

pub async fn restore_once(fc: &Path, snap: &Snapshot) -> anyhow::Result<RestoreTimes> {
    // The snapshot names the vsock socket; the restored device binds it again.
    let (uds, _) = vsock_paths(&snap.dir);
    let api_sock = snap.dir.join("fc-api.sock");
    let _ = std::fs::remove_file(&api_sock);
    let t = Instant::now();
    let mut run = spawn_with(fc, [OsStr::new("--api-sock"), api_sock.as_os_str()], Stdio::null())?;
    while std::os::unix::net::UnixStream::connect(&api_sock).is_err() {
        if let Some(status) = run.0.try_wait()? {
            bail!("Firecracker exited ({status}) before serving its API");
        }
        anyhow::ensure!(t.elapsed() < Duration::from_secs(10), "Firecracker's API socket did not appear within 10 s");
        std::thread::sleep(Duration::from_micros(200));
    }
    let load = serde_json::json!({
        "snapshot_path": snap.state,
        "mem_backend": { "backend_type": "File", "backend_path": snap.memory },
        "resume_vm": true,
    });
    api(&api_sock, "PUT", "/snapshot/load", &load)?;
    let loaded = t.elapsed();
    while t.elapsed() < Duration::from_secs(60) {
        if let Some(status) = run.0.try_wait()? {
            let mut err = String::new();
            run.0.stderr.take().expect("piped").read_to_string(&mut err)?;
            bail!("the restored Firecracker exited ({status}) before its agent answered: {err}");
        }
        let connect = AgentClient::connect_hybrid_vsock(&uds, umbra_proto::AGENT_VSOCK_PORT);
        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(2), connect).await {
            return Ok(RestoreTimes { loaded, ready: t.elapsed() });
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    bail!("the restored guest's agent did not answer within 60 s")
}

/// One request to Firecracker's API on a new connection; anything but a 2xx answer is an error
/// carrying Firecracker's message.
fn api(sock: &Path, method: &str, path: &str, body: &serde_json::Value) -> anyhow::Result<()> {
    let mut stream = std::os::unix::net::UnixStream::connect(sock)
        .with_context(|| format!("connect to Firecracker's API at {}", sock.display()))?;
    stream.set_read_timeout(Some(Duration::from_secs(60)))?;
    let body = body.to_string();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = stream.read(&mut chunk).with_context(|| format!("read Firecracker's answer to {method} {path}"))?;
        if n == 0 {
            bail!("Firecracker closed the connection without answering {method} {path}");
        }
        buf.extend_from_slice(&chunk[..n]);
        anyhow::ensure!(buf.len() <= 1 << 20, "Firecracker's answer to {method} {path} exceeds 1 MiB");
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut response = httparse::Response::new(&mut headers);
        let httparse::Status::Complete(head) = response.parse(&buf)? else { continue };
        let length = response
            .headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case("content-length"))
            .and_then(|h| std::str::from_utf8(h.value).ok()?.trim().parse::<usize>().ok())
            .unwrap_or(0);
        if buf.len() < head + length {
            continue;
        }
        let code = response.code.unwrap_or(0);
        if !(200..300).contains(&code) {
            let text = String::from_utf8_lossy(&buf[head..head + length]);
            bail!("Firecracker answered {method} {path} with {code}: {text}");
        }
        return Ok(());
    }
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
