//! Sharing folders with a running VM: the host side binds the folder into the VM's folder
//! server (read-only on the host unless the mode lets the guest write through), then the agent
//! mounts it at `/sessions/<session>/mnt/<name>`. Shadow shares record a baseline of the host
//! folder first, so an apply can refuse files the host changed meanwhile.

use std::io::Write;
use std::path::{Path, PathBuf};

use umbra_proto::{ChangeKind, ShadowChange, ShareMode, ShareRequest, MAX_FILE_CHUNK};

use super::paths::{default_folder_name, validate_folder_name, validate_session_name, OUTPUTS, UPLOADS};
use super::shadow::{self, ApplyReport, Baseline};
use crate::backend::{Vm, VmError};

/// A folder shared with the VM.
pub struct Shared {
    pub session: String,
    pub name: String,
    pub host_path: PathBuf,
    pub mode: ShareMode,
    pub guest_path: String,
    /// The host folder as it was when a shadow share started.
    baseline: Option<Baseline>,
}

fn share_error(e: impl std::fmt::Display) -> VmError {
    VmError::Share(e.to_string())
}

impl Vm {
    /// Shares `host_path` with the running VM as `name` (default: its basename) in `mode`;
    /// returns the guest path. Needs a VM launched with `folder_sharing`.
    pub async fn share_folder(
        &mut self,
        session: &str,
        host_path: &Path,
        name: Option<&str>,
        mode: ShareMode,
    ) -> Result<String, VmError> {
        validate_session_name(session).map_err(share_error)?;
        let host_path =
            host_path.canonicalize().map_err(|e| VmError::Share(format!("{}: {e}", host_path.display())))?;
        let name = match name {
            Some(n) => n.to_string(),
            None => default_folder_name(&host_path).map_err(share_error)?,
        };
        validate_folder_name(&name).map_err(share_error)?;
        self.share_as(session, &host_path, &name, mode).await
    }

    /// Shares the session's own `outputs` (read-write-delete) and `uploads` (read-only) folders
    /// from `storage_dir`, creating them.
    pub async fn share_session_dirs(&mut self, session: &str, storage_dir: &Path) -> Result<(), VmError> {
        validate_session_name(session).map_err(share_error)?;
        for (name, mode) in [(OUTPUTS, ShareMode::Rwd), (UPLOADS, ShareMode::Ro)] {
            let dir = storage_dir.join(name);
            std::fs::create_dir_all(&dir).map_err(|e| VmError::Share(format!("{}: {e}", dir.display())))?;
            self.share_as(session, &dir, name, mode).await?;
        }
        Ok(())
    }

    async fn share_as(
        &mut self,
        session: &str,
        host_path: &Path,
        name: &str,
        mode: ShareMode,
    ) -> Result<String, VmError> {
        if self.shared.iter().any(|s| s.name == name) {
            return Err(VmError::Share(format!("{name:?} is already shared with this VM")));
        }
        let baseline = match mode {
            ShareMode::Shadow => Some(Baseline::record(host_path).map_err(share_error)?),
            _ => None,
        };
        // The bind's name in the share root is the folder name (one session per VM, DESIGN §7).
        let bind = name;
        let server =
            self.folder_server().ok_or_else(|| VmError::Share("the VM was launched without folder sharing".into()))?;
        server.add(bind, host_path, !mode.host_writable()).await?;
        let request = ShareRequest { session: session.into(), name: name.into(), mode };
        let guest_path = match self.agent().share(request).await {
            Ok(p) => p,
            Err(e) => {
                if let Some(server) = self.folder_server() {
                    let _ = server.remove(bind).await;
                }
                return Err(VmError::Share(format!("the guest could not mount {name}: {e}")));
            }
        };
        self.shared.push(Shared {
            session: session.into(),
            name: name.into(),
            host_path: host_path.to_path_buf(),
            mode,
            guest_path: guest_path.clone(),
            baseline,
        });
        Ok(guest_path)
    }

    pub fn shared_folders(&self) -> &[Shared] {
        &self.shared
    }

    fn shadow(&self, session: &str, name: &str) -> Result<&Shared, VmError> {
        self.shared
            .iter()
            .find(|s| s.session == session && s.name == name && s.mode == ShareMode::Shadow)
            .ok_or_else(|| VmError::Share(format!("no shadow share {name:?} in session {session:?}")))
    }

    /// What the guest changed in a shadow share (added, modified, deleted, with sizes).
    pub async fn shadow_diff(&self, session: &str, name: &str) -> Result<Vec<ShadowChange>, VmError> {
        self.shadow(session, name)?;
        let (changes, truncated) = self.agent().shadow_diff(session, name).await.map_err(share_error)?;
        if truncated {
            return Err(VmError::Share(format!(
                "the diff of {name} is too large to list ({} entries shown)",
                changes.len()
            )));
        }
        Ok(changes)
    }

    /// Copies a guest file (through the merged shadow view) into `dest`.
    async fn fetch_guest_file(&self, guest_path: &str, dest: &Path) -> Result<(), VmError> {
        let mut out = std::fs::File::create(dest).map_err(|e| VmError::Share(format!("{}: {e}", dest.display())))?;
        let mut offset = 0u64;
        loop {
            let (bytes, eof) =
                self.agent().read_file(guest_path, offset, MAX_FILE_CHUNK as u32).await.map_err(share_error)?;
            out.write_all(&bytes).map_err(share_error)?;
            offset += bytes.len() as u64;
            if eof || bytes.is_empty() {
                return Ok(());
            }
        }
    }

    /// Fetches every added or modified file of `changes` into a spool directory (index = change).
    async fn spool(&self, shared_guest_path: &str, changes: &[ShadowChange]) -> Result<PathBuf, VmError> {
        let spool = self.run_dir().join(format!("spool-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&spool);
        std::fs::create_dir_all(&spool).map_err(share_error)?;
        for (i, c) in changes.iter().enumerate() {
            if c.kind != ChangeKind::Deleted && !c.is_dir {
                self.fetch_guest_file(&format!("{shared_guest_path}/{}", c.path), &spool.join(i.to_string())).await?;
            }
        }
        Ok(spool)
    }

    fn spooled<'a>(
        spool: &'a Path,
        changes: &'a [ShadowChange],
    ) -> impl FnMut(&str) -> std::io::Result<std::fs::File> + 'a {
        move |path: &str| {
            let i = changes
                .iter()
                .position(|c| c.path == path && c.kind != ChangeKind::Deleted)
                .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, format!("{path} was not fetched")))?;
            std::fs::File::open(spool.join(i.to_string()))
        }
    }

    /// Applies a shadow share's changes to the host folder, file by file atomically; files the
    /// host changed since the share started are reported as conflicts and left alone.
    pub async fn shadow_apply(&self, session: &str, name: &str) -> Result<ApplyReport, VmError> {
        let shared = self.shadow(session, name)?;
        let changes = self.shadow_diff(session, name).await?;
        let spool = self.spool(&shared.guest_path, &changes).await?;
        let baseline = shared.baseline.as_ref().expect("shadow shares record a baseline");
        let report = shadow::apply(&shared.host_path, baseline, &changes, Self::spooled(&spool, &changes));
        let _ = std::fs::remove_dir_all(&spool);
        Ok(report)
    }

    /// Writes a shadow share's changes as a tar (added/modified files plus a deletion list).
    pub async fn shadow_export<W: Write>(&self, session: &str, name: &str, out: W) -> Result<W, VmError> {
        let shared = self.shadow(session, name)?;
        let changes = self.shadow_diff(session, name).await?;
        let spool = self.spool(&shared.guest_path, &changes).await?;
        let result = shadow::export_tar(&changes, Self::spooled(&spool, &changes), out).map_err(share_error);
        let _ = std::fs::remove_dir_all(&spool);
        result
    }

    /// Throws away the guest's changes in a shadow share.
    pub async fn shadow_reset(&self, session: &str, name: &str) -> Result<(), VmError> {
        self.shadow(session, name)?;
        self.agent().shadow_reset(session, name).await.map_err(share_error)
    }
}
