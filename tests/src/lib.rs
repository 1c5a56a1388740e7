//! Test support: runs the real `umbra-agent` binary on a Unix socket and connects the runtime's
//! client to it, so behaviour tests exercise both sides of the protocol with real processes.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use umbra_runtime::agent::AgentClient;
use umbra_runtime::backend::{BackendKind, KvmKind};

pub mod daemon;
pub mod pty;
pub mod registry;

/// Path of a workspace binary built next to the running test executable.
/// The boot timeout tests give guests: `UMBRA_BOOT_TIMEOUT_SECS`, else 120 s (software
/// emulation on a loaded 2-core host).
pub fn boot_timeout_secs() -> u64 {
    std::env::var("UMBRA_BOOT_TIMEOUT_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(120)
}

pub fn workspace_bin(name: &str) -> PathBuf {
    if let Ok(p) = std::env::var(format!("{}_BIN", name.to_uppercase().replace('-', "_"))) {
        return p.into();
    }
    // target/<profile>/deps/<test>-<hash> → target/<profile>/<name>
    let exe = std::env::current_exe().expect("current_exe");
    let profile_dir = exe.parent().and_then(Path::parent).expect("test binary lives in target/<profile>/deps");
    let bin = profile_dir.join(name);
    assert!(bin.exists(), "{} not found: build it first (cargo build -p {name})", bin.display());
    bin
}

/// A fresh directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("umbra-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create temp dir");
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The agent running as an ordinary host process, killed on drop.
pub struct HostAgent {
    pub child: Child,
    pub socket: PathBuf,
    _dir: TempDir,
}

impl HostAgent {
    pub async fn start() -> Self {
        Self::start_with(|_| {}).await
    }

    /// Starts the agent with its open-file limit (soft and hard) lowered to `limit`.
    pub async fn start_with_fd_limit(limit: u64) -> Self {
        Self::start_with(move |cmd| {
            let lim = libc::rlimit { rlim_cur: limit as libc::rlim_t, rlim_max: limit as libc::rlim_t };
            // SAFETY: the closure runs between fork and exec and only calls setrlimit, which is
            // async-signal-safe, on a value it owns.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        })
        .await
    }

    /// Starts the agent with `configure` applied to its command (extra flags, pre_exec steps).
    pub async fn start_with(configure: impl FnOnce(&mut Command)) -> Self {
        let dir = TempDir::new("agent");
        let socket = dir.0.join("agent.sock");
        let mut cmd = Command::new(workspace_bin("umbra-agent"));
        cmd.arg("--listen").arg(format!("unix:{}", socket.display())).stdin(Stdio::null());
        configure(&mut cmd);
        let child = cmd.spawn().expect("start umbra-agent");
        // Wait for a connection to succeed, not just for the socket file: bind creates the file
        // before listen, and a connect in between is refused.
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            assert!(Instant::now() < deadline, "agent did not listen on {}", socket.display());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Self { child, socket, _dir: dir }
    }

    pub async fn connect(&self) -> AgentClient {
        AgentClient::connect_unix(&self.socket).await.expect("connect to agent")
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for HostAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Resident set size of a process, from /proc/<pid>/status.
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// The state letter of a process ('R', 'S', 'Z', ...) from /proc/<pid>/stat; None once it is gone.
pub fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) S ..." — comm may contain spaces and parens, so split after the last ')'.
    stat.rsplit_once(')')?.1.split_whitespace().next()?.chars().next()
}

/// `roots` and every process descended from them, read from /proc (a jailed helper is the
/// child of its relay; virtiofsd, of umbra-fsd's relay).
pub fn with_descendants(roots: &[u32]) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            // "pid (comm) S ppid ..." — comm may contain spaces and parens.
            let ppid = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()?;
            Some((pid, ppid))
        })
        .collect();
    let mut all = roots.to_vec();
    let mut grew = true;
    while grew {
        grew = false;
        for (pid, ppid) in &parents {
            if all.contains(ppid) && !all.contains(pid) {
                all.push(*pid);
                grew = true;
            }
        }
    }
    all
}

/// The name the kernel shows for a process (`comm`); empty once it is gone.
pub fn comm(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default().trim().to_string()
}

/// Pids of the zombie children of `parent`, read from /proc.
pub fn zombie_children(parent: u32) -> Vec<u32> {
    let mut zombies = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // "pid (comm) S ppid ..." — comm may contain spaces and parens, so split after the last ')'.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else { continue };
        let mut fields = rest.split_whitespace();
        let state = fields.next();
        let ppid = fields.next().and_then(|p| p.parse::<u32>().ok());
        if state == Some("Z") && ppid == Some(parent) {
            zombies.push(pid);
        }
    }
    zombies
}

/// `$UMBRA_CACHE_DIR`, else `${XDG_CACHE_HOME:-~/.cache}/umbra` — the same rule vmctl uses.
pub use umbra_runtime::paths::cache_dir;

/// A built bundle of `flavor`: `$UMBRA_TEST_BUNDLE_<FLAVOR>`, else where `vmctl bundle build`
/// puts it. Missing is a failure with the command that fixes it, never a silent skip.
pub fn test_bundle(flavor: &str) -> PathBuf {
    let var = format!("UMBRA_TEST_BUNDLE_{}", flavor.to_uppercase());
    let dir = std::env::var_os(&var).map(PathBuf::from).unwrap_or_else(|| cache_dir().join("bundles").join(flavor));
    assert!(
        dir.join("manifest.json").exists(),
        "no {flavor} bundle at {} (set {var} or run: cargo run -p vmctl -- bundle build --flavor {flavor})",
        dir.display()
    );
    dir
}

/// The backends this host runs VM suites on: `UMBRA_TEST_BACKENDS` (comma list of `qemu`,
/// `kvm`; the nested lane sets `kvm`), else QEMU plus the Umbra VMM where KVM is hardware. An
/// unknown name is a failure, so a typo never quietly skips a backend.
pub fn backends() -> Vec<BackendKind> {
    if let Ok(list) = std::env::var("UMBRA_TEST_BACKENDS") {
        return list
            .split(',')
            .map(|n| {
                BackendKind::from_name(n.trim())
                    .unwrap_or_else(|| panic!("unknown backend {n:?} in UMBRA_TEST_BACKENDS"))
            })
            .collect();
    }
    let mut all = vec![BackendKind::Qemu];
    if KvmKind::detect() == KvmKind::Hardware {
        all.push(BackendKind::Kvm);
    }
    all
}

/// A VM suite lane: a backend and the guest architecture it boots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lane {
    pub backend: BackendKind,
    pub arch: umbra_bundle::Arch,
}

impl Lane {
    /// The built bundle of `flavor` for this lane's architecture (`minimal`, `minimal-aarch64`).
    pub fn bundle(&self, flavor: &str) -> PathBuf {
        test_bundle(&umbra_runtime::paths::built_bundle_name(flavor, self.arch))
    }
}

/// The lanes suites that run on every architecture use: each of [`backends`] with this host's
/// architecture, and QEMU with every other one too, emulated (an aarch64 guest on
/// `qemu-system-aarch64` here). `UMBRA_TEST_ARCHS` (comma list of `x86_64`, `aarch64`) narrows
/// the architectures; an unknown name is a failure.
pub fn lanes() -> Vec<Lane> {
    use umbra_bundle::Arch;
    let archs: Vec<Arch> = match std::env::var("UMBRA_TEST_ARCHS") {
        Ok(list) => list
            .split(',')
            .map(|n| Arch::parse(n.trim()).unwrap_or_else(|| panic!("unknown architecture {n:?} in UMBRA_TEST_ARCHS")))
            .collect(),
        Err(_) => Arch::ALL.to_vec(),
    };
    let mut lanes = Vec::new();
    for backend in backends() {
        for &arch in &archs {
            if arch == Arch::host() || backend == BackendKind::Qemu {
                lanes.push(Lane { backend, arch });
            }
        }
    }
    lanes
}

/// A session manager like umbrad's, on the minimal bundle (256 MiB, no session disk, no idle
/// stop), keeping its records, logs and session storage under `dir`.
pub fn session_manager(dir: &TempDir) -> umbra_runtime::session::SessionManager {
    session_manager_for(dir, "minimal", 256)
}

/// [`session_manager`] on another built bundle flavor and memory size.
pub fn session_manager_for(dir: &TempDir, flavor: &str, memory_mib: u32) -> umbra_runtime::session::SessionManager {
    let session = umbra_api::SessionSettings {
        bundle: test_bundle(flavor).display().to_string(),
        memory_mib,
        disk_size_mib: 0,
        idle_timeout_secs: 0,
        ..Default::default()
    };
    let config = umbra_api::DaemonConfig { session, boot_timeout_secs: boot_timeout_secs(), ..Default::default() };
    umbra_runtime::session::SessionManager::new(umbra_runtime::session::ManagerOptions {
        config,
        state_dir: Some(dir.0.join("state")),
        storage_root: Some(dir.0.join("data")),
        bundles: umbra_bundle::Store::new(dir.0.join("bundles")),
    })
}

/// Fills `fill_mib` of a tmpfs in the running session `s`, then deletes it, and waits up to
/// 30 s for the VM's host memory (`VmInfo::host_memory_kib`) to fall by at least half of that
/// from its peak: free page reporting at work. Returns (before, peak, after) in MiB.
pub async fn freed_memory_goes_back(
    s: &std::sync::Arc<umbra_runtime::session::Session>,
    fill_mib: u64,
) -> (u64, u64, u64) {
    let memory_mib = || s.info().vm.and_then(|vm| vm.host_memory_kib).expect("the VM's host memory") / 1024;
    let run = |script: String| async move {
        let argv = vec!["sh".into(), "-c".into(), script.clone()];
        let out = s.spawn(umbra_runtime::session::ExecRequest { argv, ..Default::default() }).await.unwrap();
        let out = out.output().await;
        assert_eq!(out.exit.code, Some(0), "{script}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let before = memory_mib();
    // In a tmpfs of its own, so the pages stay in use until the file goes.
    run(format!(
        "mkdir -p /mnt/fill && mount -t tmpfs -o size={}M fill /mnt/fill && \
         dd if=/dev/zero of=/mnt/fill/f bs=1M count={fill_mib} 2>/dev/null",
        fill_mib + 64
    ))
    .await;
    let peak = memory_mib();
    assert!(peak >= before + fill_mib * 5 / 6, "{fill_mib} MiB written: {before} MiB before, {peak} MiB with it");
    run("rm /mnt/fill/f".into()).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut now = memory_mib();
    while now > peak - fill_mib / 2 {
        assert!(Instant::now() < deadline, "{before} MiB before, {peak} MiB at the peak, {now} MiB 30 s after");
        tokio::time::sleep(Duration::from_secs(1)).await;
        now = memory_mib();
    }
    eprintln!("host memory of the VM: {before} MiB, {peak} MiB with {fill_mib} MiB used, {now} MiB once freed");
    (before, peak, now)
}
