//! A real `umbrad` for tests: the built binary, in a private set of XDG directories (runtime,
//! state, data, config), serving its real socket. Helpers of its VMs carry the directory's path
//! in their command lines, which is how a test finds them (and checks none are left).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use umbra_api::client::{Client, Notifications};
use umbra_api::rpc::{Notification, NOTIFY_EVENT};
use umbra_api::{EventKind, SessionEvent};

pub use crate::boot_timeout_secs;
use crate::{workspace_bin, TempDir};

pub struct TestDaemon {
    pub dir: TempDir,
    pub socket: PathBuf,
    child: Option<Child>,
}

/// The public key `vmctl bundle build` signed this machine's bundles with, if it made one:
/// `$UMBRA_BUNDLE_SIGNING_KEY.pub`, else the user's default key's.
pub fn build_signing_public_key() -> Option<Vec<u8>> {
    let secret = std::env::var_os("UMBRA_BUNDLE_SIGNING_KEY")
        .map(PathBuf::from)
        .unwrap_or_else(umbra_api::paths::signing_key_path);
    let mut public = secret.into_os_string();
    public.push(".pub");
    std::fs::read(public).ok()
}

/// Names of the processes a VM runs on the host.
pub const HELPERS: [&str; 5] = ["qemu-system", "vhost-device-vsock", "virtiofsd", "umbra-fsd", "umbra-vmm"];

impl TestDaemon {
    /// Starts umbrad with `config` (merged over defaults that suit tests: the minimal bundle,
    /// 256 MiB guests, no idle stop).
    pub fn start(tag: &str, config: serde_json::Value) -> Self {
        Self::start_with_dir(TempDir::new(tag), config)
    }

    /// [`TestDaemon::start`] under a system policy (`policy`, written root-owned, mode 0644, at
    /// [`TestDaemon::system_policy_path`]); run as root, or umbrad refuses the file.
    pub fn start_with_system_policy(tag: &str, config: serde_json::Value, policy: &serde_json::Value) -> Self {
        let dir = TempDir::new(tag);
        write_system_policy(&dir.0, policy);
        Self::start_with_dir(dir, config)
    }

    /// Where its system policy is (nothing there unless a test puts one): never the machine's
    /// own `/etc/umbra/policy.json`.
    pub fn system_policy_path(dir: &Path) -> PathBuf {
        dir.join("system/policy.json")
    }

    /// [`TestDaemon::start`] in `dir` (created; removed when the daemon is dropped).
    pub fn start_in(dir: PathBuf, config: serde_json::Value) -> Self {
        std::fs::create_dir_all(&dir).expect("create the daemon's directory");
        Self::start_with_dir(TempDir(dir), config)
    }

    fn start_with_dir(dir: TempDir, config: serde_json::Value) -> Self {
        let mut base = serde_json::json!({
            "bundle": crate::test_bundle("minimal"),
            "memory_mib": 256,
            "idle_timeout_secs": 0,
            "disk_size_mib": 256,
            "boot_timeout_secs": boot_timeout_secs(),
        });
        for (k, v) in config.as_object().expect("config is an object") {
            base[k] = v.clone();
        }
        let config_dir = dir.0.join("config/umbra");
        std::fs::create_dir_all(&config_dir).unwrap();
        std::fs::write(config_dir.join("umbrad.json"), serde_json::to_vec_pretty(&base).unwrap()).unwrap();
        // The bundles this machine built are signed by its build key, which the user's own
        // configuration trusts (`vmctl bundle build` puts it there): the test daemon's does too.
        if let Some(public) = build_signing_public_key() {
            let keys = config_dir.join("trusted-keys");
            std::fs::create_dir_all(&keys).unwrap();
            std::fs::write(keys.join("local-build.pub"), public).unwrap();
        }
        let socket = dir.0.join("run/umbra/umbrad.sock");
        let mut d = Self { dir, socket, child: None };
        d.launch();
        d
    }

    /// Starts the daemon process (again) and waits until it serves.
    pub fn launch(&mut self) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.0.join("umbrad.log")).unwrap();
        let mut cmd = Command::new(workspace_bin("umbrad"));
        cmd.env("XDG_RUNTIME_DIR", self.dir.0.join("run"))
            .env("XDG_STATE_HOME", self.dir.0.join("state"))
            .env("XDG_DATA_HOME", self.dir.0.join("data"))
            .env("XDG_CONFIG_HOME", self.dir.0.join("config"))
            .env_remove("UMBRA_DATA_DIR")
            .env_remove("UMBRA_SOCKET")
            .env("RUST_LOG", "info,umbrad=debug")
            .arg("--system-policy")
            .arg(Self::system_policy_path(&self.dir.0))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        self.child = Some(cmd.spawn().expect("start umbrad"));
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::os::unix::net::UnixStream::connect(&self.socket).is_err() {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("umbrad exited ({status}) before serving; its log:\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "umbrad did not serve {} within 20 s", self.socket.display());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("umbrad.log")).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub async fn client(&self) -> (Client, Inbox) {
        let (client, notes) = Client::connect(Some(&self.socket)).await.expect("connect to umbrad");
        (client, Inbox::new(notes))
    }

    /// SIGKILLs the daemon and reaps it.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the daemon with SIGTERM (it stops its sessions) and waits for it.
    pub fn terminate(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: plain kill(2) on our own child.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(40);
            while child.try_wait().unwrap().is_none() {
                if Instant::now() > deadline {
                    let _ = child.kill();
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.wait();
        }
    }

    /// Host processes of this daemon's VMs (pid, command line).
    pub fn helpers(&self) -> Vec<(u32, String)> {
        processes_mentioning(&self.dir.0, &HELPERS)
    }

    /// Waits until no helper of this daemon's VMs is left; panics with the survivors.
    pub fn assert_no_helpers_within(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let left = self.helpers();
            if left.is_empty() {
                return;
            }
            assert!(Instant::now() < deadline, "still running after {limit:?}: {left:#?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for TestDaemon {
    fn drop(&mut self) {
        self.terminate();
        if std::thread::panicking() {
            let log = self.log();
            let lines: Vec<&str> = log.lines().collect();
            eprintln!("--- umbrad's log (last 80 lines):\n{}", lines[lines.len().saturating_sub(80)..].join("\n"));
        }
    }
}

/// Processes whose command line names one of `names` and whose command line or environment
/// contains `marker` — and the relays of jailed helpers (`umbra-relay`, forks of umbrad or
/// umbra-fsd whose environment has the marker): a jailed QEMU inherits every path it uses as
/// a descriptor, so only its environment names the daemon's directory.
pub fn processes_mentioning(marker: &Path, names: &[&str]) -> Vec<(u32, String)> {
    let marker = marker.display().to_string();
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else { continue };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        let env =
            String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default()).into_owned();
        let named = names.iter().any(|n| cmd.contains(n)) || crate::comm(pid) == "umbra-relay";
        if named && (cmd.contains(&marker) || env.contains(&marker)) {
            found.push((pid, cmd));
        }
    }
    found
}

/// A client's notifications, with those a reader set aside for later ones.
pub struct Inbox {
    notes: Notifications,
    backlog: std::collections::VecDeque<Notification>,
}

impl Inbox {
    pub fn new(notes: Notifications) -> Self {
        Self { notes, backlog: Default::default() }
    }

    /// The next notification, whatever it is.
    pub async fn next_raw(&mut self) -> Option<Notification> {
        match self.backlog.pop_front() {
            Some(n) => Some(n),
            None => self.notes.recv().await,
        }
    }

    async fn next(&mut self, deadline: tokio::time::Instant) -> Result<Option<Notification>, ()> {
        if let Some(n) = self.backlog.pop_front() {
            return Ok(Some(n));
        }
        tokio::time::timeout_at(deadline, self.notes.recv()).await.map_err(|_| ())
    }
}

/// Waits for an event (subscribed or of an owned process) matching `pred`, dropping the
/// others; panics after `limit` with what came instead.
pub async fn wait_event(
    inbox: &mut Inbox,
    limit: Duration,
    what: &str,
    mut pred: impl FnMut(&SessionEvent) -> bool,
) -> SessionEvent {
    let deadline = tokio::time::Instant::now() + limit;
    let mut seen = Vec::new();
    loop {
        let n = match inbox.next(deadline).await {
            Ok(Some(n)) => n,
            Ok(None) => panic!("the connection closed while waiting for {what}; saw {seen:#?}"),
            Err(()) => panic!("no {what} within {limit:?}; saw {seen:#?}"),
        };
        if n.method != NOTIFY_EVENT && n.method != umbra_api::rpc::NOTIFY_PROCESS {
            continue;
        }
        let ev: SessionEvent = serde_json::from_value(n.params).expect("events parse");
        if pred(&ev) {
            return ev;
        }
        seen.push(ev.name().to_string() + &status_suffix(&ev));
    }
}

fn status_suffix(ev: &SessionEvent) -> String {
    match &ev.kind {
        EventKind::Status { status, reason } => format!(" {status} {}", reason.as_deref().unwrap_or("")),
        _ => String::new(),
    }
}

/// Everything process `process` printed and how it ended, read from its `process.event`
/// notifications (acknowledged as they are consumed, as a client must); other notifications
/// are kept for later readers.
pub async fn process_output(
    client: &Client,
    inbox: &mut Inbox,
    session: &str,
    process: u64,
    limit: Duration,
) -> (Vec<u8>, Vec<u8>, umbra_api::ProcessExit) {
    use umbra_api::methods::{AckParams, ProcessAck, Stream};
    let deadline = tokio::time::Instant::now() + limit;
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let mut kept = Vec::new();
    let result = loop {
        let n = match inbox.next(deadline).await {
            Ok(Some(n)) => n,
            Ok(None) => panic!("the connection closed before process {process} exited"),
            Err(()) => panic!(
                "process {process} did not exit within {limit:?}; stdout so far {:?}",
                String::from_utf8_lossy(&stdout)
            ),
        };
        if n.method != umbra_api::rpc::NOTIFY_PROCESS {
            kept.push(n);
            continue;
        }
        let ev: SessionEvent = serde_json::from_value(n.params.clone()).expect("events parse");
        let (stream, data) = match ev.kind {
            EventKind::Stdout { process: p, data, .. } if p == process => (Stream::Stdout, data),
            EventKind::Stderr { process: p, data, .. } if p == process => (Stream::Stderr, data),
            EventKind::Exit(e) if e.process == process => break (stdout, stderr, e),
            _ => {
                kept.push(n);
                continue;
            }
        };
        let bytes = data.to_bytes().expect("valid data");
        let ack = AckParams { session: session.into(), process, stream, bytes: bytes.len() as u64 };
        client.notify::<ProcessAck>(ack).await.expect("ack");
        match stream {
            Stream::Stdout => stdout.extend(bytes),
            Stream::Stderr => stderr.extend(bytes),
        }
    };
    for n in kept.into_iter().rev() {
        inbox.backlog.push_front(n);
    }
    result
}

/// Writes `policy` as the system policy of a daemon in `dir`, as an administrator would: the
/// file and its directory owned by this (root) user, writable by nobody else.
pub fn write_system_policy(dir: &Path, policy: &serde_json::Value) {
    use std::os::unix::fs::PermissionsExt;
    let path = TestDaemon::system_policy_path(dir);
    let parent = path.parent().expect("a directory");
    std::fs::create_dir_all(parent).unwrap();
    std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(&path, serde_json::to_vec_pretty(policy).unwrap()).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
}
