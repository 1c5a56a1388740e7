//! The VM's folder server: an `umbra-fsd` process (a private mount namespace with a staging
//! directory served by virtiofsd) that folders are bound into while the VM runs. Both
//! backends attach its vhost-user socket as a virtio-fs device with the tag [`FS_TAG`].

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{ChildStdin, ChildStdout};

use umbra_sys::FolderIdentity;

use super::rundir::RunDir;
use super::{Supervised, VmError};

/// The virtio-fs tag the guest agent mounts.
pub const FS_TAG: &str = "umbra";
/// A mount in a private namespace takes microseconds; anything slower is a stuck server.
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// What umbra-fsd enforces inside a share beyond its mode (a sandbox policy's filesystem
/// fields): `.git` read-only, files matching gitignore patterns never opened for the guest.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Protection {
    pub protect_git: bool,
    pub hide: Vec<String>,
}

pub struct FolderServer {
    stdin: ChildStdin,
    replies: Lines<BufReader<ChildStdout>>,
    socket: PathBuf,
}

fn failed(status: impl Into<String>, log: &Path) -> VmError {
    VmError::HelperFailed {
        helper: "umbra-fsd",
        status: status.into(),
        log: std::fs::read_to_string(log).unwrap_or_default(),
    }
}

/// Who files the guest creates in a share belong to, when the runtime runs as root on someone's
/// behalf: `UMBRA_SHARE_OWNER=UID:GID`, else the user `sudo` ran it for (`SUDO_UID`,
/// `SUDO_GID`). Without root the runtime's own user owns them already (umbra-fsd's user
/// namespace maps only it).
pub fn share_owner() -> Option<(u32, u32)> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return None;
    }
    let parse = |u: &str, g: &str| -> Option<(u32, u32)> {
        let ids = (u.trim().parse().ok()?, g.trim().parse().ok()?);
        (ids.0 != 0 && ids.1 != 0).then_some(ids)
    };
    if let Ok(owner) = std::env::var("UMBRA_SHARE_OWNER") {
        return owner.split_once(':').and_then(|(u, g)| parse(u, g));
    }
    parse(&std::env::var("SUDO_UID").ok()?, &std::env::var("SUDO_GID").ok()?)
}

/// Hands a folder the runtime makes for the guest to write (a session's `outputs`) to the
/// [`share_owner`], when there is one: the guest writes as that user.
pub fn give_to_share_owner(dir: &Path) -> std::io::Result<()> {
    match share_owner() {
        Some((uid, gid)) => std::os::unix::fs::lchown(dir, Some(uid), Some(gid)),
        None => Ok(()),
    }
}

impl FolderServer {
    /// Starts umbra-fsd + virtiofsd for the VM in `run`; returns once virtiofsd listens.
    pub async fn start(run: &RunDir) -> Result<(Self, Supervised), VmError> {
        let fsd = super::host::UMBRA_FSD.require()?;
        let virtiofsd = super::host::VIRTIOFSD.require()?;
        let socket = run.join("virtiofsd.sock");
        let log = run.join("virtiofsd.log");
        let mut cmd = Command::new(&fsd);
        cmd.arg("--staging")
            .arg(run.join("shares"))
            .arg("--socket")
            .arg(&socket)
            .arg("--virtiofsd")
            .arg(&virtiofsd)
            .arg("--log")
            .arg(&log)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        if let Some((uid, gid)) = share_owner() {
            cmd.arg("--owner").arg(format!("{uid}:{gid}"));
        }
        let mut child = Supervised::spawn("umbra-fsd", cmd)
            .map_err(|source| VmError::Io { what: format!("start {}", fsd.display()), source })?;
        let io = |e: std::io::Error| VmError::Io { what: "talk to umbra-fsd".into(), source: e };
        let stdin = ChildStdin::from_std(child.take_stdin().expect("piped")).map_err(io)?;
        let stdout = ChildStdout::from_std(child.take_stdout().expect("piped")).map_err(io)?;
        let mut server = Self { stdin, replies: BufReader::new(stdout).lines(), socket };
        let ready = server.reply(&log).await?;
        if ready.get("ready") != Some(&serde_json::Value::Bool(true)) {
            return Err(failed(ready["error"].as_str().unwrap_or("did not start").to_string(), &log));
        }
        Ok((server, child))
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    async fn reply(&mut self, log: &Path) -> Result<serde_json::Value, VmError> {
        match tokio::time::timeout(REPLY_TIMEOUT, self.replies.next_line()).await {
            Ok(Ok(Some(line))) => serde_json::from_str(&line).map_err(|_| failed(format!("bad reply {line:?}"), log)),
            Ok(Ok(None)) => Err(failed("exited", log)),
            Ok(Err(e)) => Err(failed(e.to_string(), log)),
            Err(_) => Err(failed(format!("no reply within {REPLY_TIMEOUT:?}"), log)),
        }
    }

    async fn request(&mut self, req: serde_json::Value) -> Result<serde_json::Value, VmError> {
        let line = format!("{req}\n");
        let log = self.socket.with_file_name("virtiofsd.log");
        self.stdin
            .write_all(line.as_bytes())
            .await
            .map_err(|e| VmError::Io { what: "talk to umbra-fsd".into(), source: e })?;
        let reply = self.reply(&log).await?;
        match reply.get("ok") {
            Some(serde_json::Value::Bool(true)) => Ok(reply),
            _ => Err(VmError::FolderServer(reply["error"].as_str().unwrap_or("unknown error").to_string())),
        }
    }

    /// Binds `source` into the share root as `name`; read-only on the host if `read_only`,
    /// with every `.git` read-only and/or ignored files hidden as `protection` asks. umbra-fsd
    /// opens `source` without following links and, given `expected`, refuses anything but that
    /// folder; it returns the identity it found.
    pub async fn add(
        &mut self,
        name: &str,
        source: &Path,
        read_only: bool,
        protection: &Protection,
        expected: Option<FolderIdentity>,
    ) -> Result<FolderIdentity, VmError> {
        let reply = self
            .request(serde_json::json!({
                "op": "add",
                "name": name,
                "source": source,
                "read_only": read_only,
                "protect_git": protection.protect_git,
                "hide": protection.hide,
                "identity": expected,
            }))
            .await?;
        serde_json::from_value(reply["identity"].clone())
            .map_err(|_| VmError::FolderServer(format!("umbra-fsd shared {name} without saying what it shared")))
    }

    pub async fn remove(&mut self, name: &str) -> Result<(), VmError> {
        self.request(serde_json::json!({"op": "remove", "name": name})).await.map(drop)
    }
}
