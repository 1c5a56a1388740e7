//! The VM's folder server: an `umbra-fsd` process (a private mount namespace with a staging
//! directory served by virtiofsd) that folders are bound into while the VM runs. Both
//! backends attach its vhost-user socket as a virtio-fs device with the tag [`FS_TAG`].

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use async_trait::async_trait;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{ChildStdin, ChildStdout};

use umbra_contract::fsd::{FsdReply, FsdRequest};
use umbra_sys::FolderIdentity;

use super::rundir::RunDir;
pub use super::spec::Protection;
use super::vm::FolderShare;
use super::{SharedFolder, Supervised, VmError};

pub use umbra_contract::fsd::FS_TAG;
/// A mount in a private namespace takes microseconds; anything slower is a stuck server.
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

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
        match ready {
            FsdReply::Ready => {}
            FsdReply::Error { error } => return Err(failed(error, &log)),
            other => return Err(failed(format!("answered {other:?} before it was ready"), &log)),
        }
        Ok((server, child))
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    async fn reply(&mut self, log: &Path) -> Result<FsdReply, VmError> {
        match tokio::time::timeout(REPLY_TIMEOUT, self.replies.next_line()).await {
            Ok(Ok(Some(line))) => serde_json::from_str(&line).map_err(|_| failed(format!("bad reply {line:?}"), log)),
            Ok(Ok(None)) => Err(failed("exited", log)),
            Ok(Err(e)) => Err(failed(e.to_string(), log)),
            Err(_) => Err(failed(format!("no reply within {REPLY_TIMEOUT:?}"), log)),
        }
    }

    async fn request(&mut self, req: &FsdRequest) -> Result<FsdReply, VmError> {
        let line = serde_json::to_string(req).expect("a request serialises") + "\n";
        let log = self.socket.with_file_name("virtiofsd.log");
        self.stdin
            .write_all(line.as_bytes())
            .await
            .map_err(|e| VmError::Io { what: "talk to umbra-fsd".into(), source: e })?;
        match self.reply(&log).await? {
            FsdReply::Error { error } => Err(VmError::FolderServer(error)),
            reply => Ok(reply),
        }
    }
}

/// umbra-fsd binds each folder into its share root; it opens the source without following
/// links and, given an identity, refuses anything but that folder. A writable share gets every
/// `.git` read-only and/or ignored files hidden as the folder's protection asks.
#[async_trait]
impl FolderShare for FolderServer {
    async fn add(&mut self, folder: &SharedFolder) -> Result<FolderIdentity, VmError> {
        let request = FsdRequest::Add {
            name: folder.name.clone(),
            source: folder.source.clone(),
            read_only: folder.read_only,
            protect_git: folder.protection.protect_git,
            hide: folder.protection.hide.clone(),
            identity: folder.identity,
        };
        let name = &folder.name;
        match self.request(&request).await? {
            FsdReply::Shared { identity } => Ok(identity),
            other => Err(VmError::FolderServer(format!("umbra-fsd answered {other:?} to sharing {name}"))),
        }
    }

    async fn remove(&mut self, name: &str) -> Result<(), VmError> {
        match self.request(&FsdRequest::Remove { name: name.into() }).await? {
            FsdReply::Removed => Ok(()),
            other => Err(VmError::FolderServer(format!("umbra-fsd answered {other:?} to unsharing {name}"))),
        }
    }
}
