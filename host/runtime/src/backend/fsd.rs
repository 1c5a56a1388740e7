//! The VM's folder server: an `umbra-fsd` process (a private mount namespace with a staging
//! directory served by virtiofsd) that folders are bound into while the VM runs. Both
//! backends attach its vhost-user socket as a virtio-fs device with the tag [`FS_TAG`].

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{ChildStdin, ChildStdout};

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

    async fn request(&mut self, req: serde_json::Value) -> Result<(), VmError> {
        let line = format!("{req}\n");
        let log = self.socket.with_file_name("virtiofsd.log");
        self.stdin
            .write_all(line.as_bytes())
            .await
            .map_err(|e| VmError::Io { what: "talk to umbra-fsd".into(), source: e })?;
        let reply = self.reply(&log).await?;
        match reply.get("ok") {
            Some(serde_json::Value::Bool(true)) => Ok(()),
            _ => Err(VmError::FolderServer(reply["error"].as_str().unwrap_or("unknown error").to_string())),
        }
    }

    /// Binds `source` into the share root as `name`; read-only on the host if `read_only`.
    pub async fn add(&mut self, name: &str, source: &Path, read_only: bool) -> Result<(), VmError> {
        self.add_protected(name, source, read_only, &Protection::default()).await
    }

    /// [`Self::add`], with every `.git` read-only and/or ignored files hidden, on the host.
    pub async fn add_protected(
        &mut self,
        name: &str,
        source: &Path,
        read_only: bool,
        protection: &Protection,
    ) -> Result<(), VmError> {
        self.request(serde_json::json!({
            "op": "add",
            "name": name,
            "source": source,
            "read_only": read_only,
            "protect_git": protection.protect_git,
            "hide": protection.hide,
        }))
        .await
    }

    pub async fn remove(&mut self, name: &str) -> Result<(), VmError> {
        self.request(serde_json::json!({"op": "remove", "name": name})).await
    }
}
