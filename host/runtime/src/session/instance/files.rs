//! A running session's folders (mount, unmount), files (by guest path, or by host path inside
//! a shared folder) and shadow folders (diff, apply, export, reset).

use std::path::{Component, Path};
use std::sync::Arc;

use umbra_api::event::ShadowApplyReport;
use umbra_api::methods::ShadowDiffResult;
use umbra_api::{EventKind, FolderInfo, FolderSpec};
use umbra_proto::{DirEntry, FileStat, WriteFileRequest, WriteMode};

use super::Session;
use crate::session::error::SessionError;
use crate::session::incarnation::{folder_mounted, Incarnation};

impl Session {
    /// Shares another host folder with the running session; it is shared again after a
    /// restart or resume.
    pub async fn mount(self: &Arc<Self>, spec: FolderSpec) -> Result<FolderInfo, SessionError> {
        self.touch();
        let canonical = spec.path.canonicalize().map_err(SessionError::io(format!("share {}", spec.path.display())))?;
        self.ctx.check_folder(&canonical)?;
        let inc = self.running("mount a folder").await?;
        let mut machine = inc.machine.lock().await;
        let machine = &mut *machine;
        machine.folders.share(&mut machine.vm, &self.name, &spec.path, spec.name.as_deref(), spec.mode).await?;
        let info = machine.folders.list().last().expect("just shared").info();
        {
            // The user's folders come before the session's own (outputs, uploads).
            let mut infos = inc.folder_infos.lock().unwrap();
            let at = infos.iter().position(|f| f.name == crate::share::paths::OUTPUTS).unwrap_or(infos.len());
            infos.insert(at, info.clone());
        }
        {
            let mut state = self.state.lock().unwrap();
            // Record the canonical path and the name it got, so a restart mounts the same.
            state.record.folders.push(FolderSpec {
                path: info.host_path.clone(),
                name: Some(info.name.clone()),
                mode: spec.mode,
            });
            state.record.pinned = machine.folders.pins().clone();
        }
        self.persist();
        self.emit(folder_mounted(&info));
        Ok(info)
    }

    pub async fn unmount(self: &Arc<Self>, name: &str) -> Result<(), SessionError> {
        self.touch();
        if name == crate::share::paths::OUTPUTS || name == crate::share::paths::UPLOADS {
            return Err(SessionError::InvalidArgument(format!("{name} is the session's own folder")));
        }
        let inc = self.running("unmount a folder").await?;
        if let Some(dir) = self.storage_dir() {
            // A shadow folder's unapplied changes would vanish with it: saved first.
            inc.export_shadows(&dir, &self.report(), Some(name)).await;
        }
        let mut machine = inc.machine.lock().await;
        let machine = &mut *machine;
        machine.folders.unshare(&mut machine.vm, name).await?;
        inc.folder_infos.lock().unwrap().retain(|f| f.name != name);
        {
            let mut state = self.state.lock().unwrap();
            state.record.folders.retain(|f| f.name.as_deref() != Some(name) && !default_name_is(&f.path, name));
        }
        self.persist();
        self.emit(EventKind::FolderUnmounted { name: name.into() });
        Ok(())
    }

    /// A client's path as a guest path. Either way it must be absolute, without `..` or NUL;
    /// with `host` it is a host path that must lie inside one of the session's shared folders
    /// and is translated to that folder's guest path.
    pub(super) fn guest_path(&self, inc: &Incarnation, path: &str, host: bool) -> Result<String, SessionError> {
        guest_path(&inc.folder_infos.lock().unwrap(), path, host)
    }

    /// Reads up to `len` bytes at `offset` (see [`Session::guest_path`] for `path` and `host`).
    pub async fn read_file(
        &self,
        path: &str,
        host: bool,
        offset: u64,
        len: u32,
    ) -> Result<(bytes::Bytes, bool), SessionError> {
        self.touch();
        let inc = self.running("read a file").await?;
        let guest = self.guest_path(&inc, path, host)?;
        Ok(inc.agent.read_file(&guest, offset, len.min(umbra_proto::MAX_FILE_CHUNK as u32)).await?)
    }

    pub async fn write_file(
        &self,
        path: &str,
        host: bool,
        data: &[u8],
        mode: WriteMode,
        create_dirs: bool,
        permissions: Option<u32>,
    ) -> Result<u64, SessionError> {
        self.touch();
        let inc = self.running("write a file").await?;
        let guest = self.guest_path(&inc, path, host)?;
        let request = WriteFileRequest { path: guest, mode, permissions, create_dirs };
        Ok(inc.agent.write_file(request, data).await?)
    }

    pub async fn stat(&self, path: &str, host: bool) -> Result<FileStat, SessionError> {
        self.touch();
        let inc = self.running("stat a file").await?;
        let guest = self.guest_path(&inc, path, host)?;
        Ok(inc.agent.stat(&guest).await?)
    }

    pub async fn list_dir(
        &self,
        path: &str,
        host: bool,
        limit: Option<u32>,
    ) -> Result<(Vec<DirEntry>, bool), SessionError> {
        self.touch();
        let inc = self.running("list a directory").await?;
        let guest = self.guest_path(&inc, path, host)?;
        Ok(inc.agent.list_dir(&guest, limit).await?)
    }

    /// What the guest changed in shadow folder `folder`, captured on the host as a change-set
    /// (the folder's latest, replacing any earlier one).
    pub async fn shadow_diff(&self, folder: &str) -> Result<ShadowDiffResult, SessionError> {
        self.touch();
        let inc = self.running("diff a shadow folder").await?;
        let mut machine = inc.machine.lock().await;
        let machine = &mut *machine;
        Ok(machine.folders.shadow_diff(&machine.vm, folder).await?)
    }

    /// Applies change-set `changeset` (required) of shadow folder `folder`, all of it that
    /// applies by default or only `paths`: exactly the bytes its diff captured.
    pub async fn shadow_apply(
        &self,
        folder: &str,
        changeset: Option<&str>,
        paths: Option<&[String]>,
    ) -> Result<ShadowApplyReport, SessionError> {
        self.touch();
        let inc = self.running("apply a shadow folder").await?;
        let machine = inc.machine.lock().await;
        let report = machine.folders.shadow_apply(folder, changeset, paths)?;
        Ok(ShadowApplyReport {
            applied: report.applied,
            conflicts: report
                .conflicts
                .into_iter()
                .map(|c| umbra_api::event::ShadowConflict { path: c.path, reason: c.reason.to_string() })
                .collect(),
            errors: report
                .errors
                .into_iter()
                .map(|e| umbra_api::event::ShadowApplyError { path: e.path, message: e.error.to_string() })
                .collect(),
            skipped: report
                .skipped
                .into_iter()
                .map(|s| umbra_api::event::ShadowSkipped { path: s.path, reason: s.reason })
                .collect(),
        })
    }

    /// Writes a shadow folder's changes as a tar to `dest`; returns its size.
    pub async fn shadow_export(&self, folder: &str, dest: &Path) -> Result<u64, SessionError> {
        self.touch();
        let inc = self.running("export a shadow folder").await?;
        let machine = inc.machine.lock().await;
        let tmp = dest.with_extension("tar.part");
        let file = std::fs::File::create(&tmp).map_err(SessionError::io(format!("create {}", tmp.display())))?;
        let written = machine.folders.shadow_export(&machine.vm, folder, file).await;
        let file = match written {
            Ok(f) => f,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(e.into());
            }
        };
        file.sync_all().map_err(SessionError::io(format!("write {}", tmp.display())))?;
        std::fs::rename(&tmp, dest).map_err(SessionError::io(format!("rename to {}", dest.display())))?;
        Ok(std::fs::metadata(dest).map(|m| m.len()).unwrap_or(0))
    }

    pub async fn shadow_reset(&self, folder: &str) -> Result<(), SessionError> {
        self.touch();
        let inc = self.running("reset a shadow folder").await?;
        let mut machine = inc.machine.lock().await;
        let machine = &mut *machine;
        Ok(machine.folders.shadow_reset(&machine.vm, folder).await?)
    }
}

/// Whether a folder recorded without a name got `name` by default.
fn default_name_is(path: &Path, name: &str) -> bool {
    crate::share::paths::default_folder_name(path).is_ok_and(|n| n == name)
}

/// `path` as a guest path; with `host`, the host path inside one of `folders` translated to the
/// folder's guest path.
fn guest_path(folders: &[FolderInfo], path: &str, host: bool) -> Result<String, SessionError> {
    let bad = |why: &str| Err(SessionError::InvalidArgument(format!("path {path:?} {why}")));
    if path.contains('\0') {
        return bad("contains a NUL byte");
    }
    let p = Path::new(path);
    if !p.is_absolute() {
        return bad("is not absolute");
    }
    if p.components().any(|c| matches!(c, Component::ParentDir)) {
        return bad("contains a `..` component");
    }
    if !host {
        return Ok(path.to_string());
    }
    for f in folders {
        if let Ok(rel) = p.strip_prefix(&f.host_path) {
            let rel = rel.to_string_lossy();
            return Ok(if rel.is_empty() { f.guest_path.clone() } else { format!("{}/{rel}", f.guest_path) });
        }
    }
    Err(crate::share::paths::PathError::NotShared(path.to_string()).into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::instance::test_support::stopped_session;
    use umbra_proto::ShareMode;

    fn folder(name: &str, host: &str) -> FolderInfo {
        FolderInfo {
            name: name.into(),
            host_path: host.into(),
            guest_path: format!("/sessions/s/mnt/{name}"),
            mode: ShareMode::Rw,
        }
    }

    #[test]
    fn a_client_path_is_absolute_clean_and_inside_a_share() {
        let folders = [folder("proj", "/home/u/proj")];
        assert_eq!(guest_path(&folders, "/etc/hosts", false).unwrap(), "/etc/hosts");
        for bad in ["etc/hosts", "/tmp/../etc", "/tmp/a\0b"] {
            let e = guest_path(&folders, bad, false).unwrap_err();
            assert!(matches!(e, SessionError::InvalidArgument(_)), "{bad:?}: {e}");
        }
        assert_eq!(guest_path(&folders, "/home/u/proj", true).unwrap(), "/sessions/s/mnt/proj");
        assert_eq!(guest_path(&folders, "/home/u/proj/src/a.rs", true).unwrap(), "/sessions/s/mnt/proj/src/a.rs");
        let e = guest_path(&folders, "/home/u/project", true).unwrap_err();
        assert!(e.to_string().contains("/home/u/project"), "a sibling with a common prefix is not inside: {e}");
        assert!(guest_path(&folders, "/home/u/proj/../other", true).is_err());
    }

    #[test]
    fn a_folder_without_a_name_is_known_by_its_default_one() {
        assert!(default_name_is(Path::new("/home/u/proj"), "proj"));
        assert!(!default_name_is(Path::new("/home/u/proj"), "other"));
    }

    #[tokio::test]
    async fn folders_and_files_need_a_running_session_and_the_sessions_own_folders_stay() {
        let dir = tempfile::tempdir().unwrap();
        let session = stopped_session(dir.path(), "s", Default::default(), Vec::new());
        for own in [crate::share::paths::OUTPUTS, crate::share::paths::UPLOADS] {
            let e = session.unmount(own).await.unwrap_err();
            assert!(matches!(e, SessionError::InvalidArgument(_)), "{own}: {e}");
        }
        let spec = FolderSpec { path: dir.path().into(), name: None, mode: ShareMode::Ro };
        assert!(matches!(session.mount(spec).await.unwrap_err(), SessionError::InvalidState { .. }));
        assert!(matches!(session.stat("/etc", false).await.unwrap_err(), SessionError::InvalidState { .. }));
        assert!(matches!(session.shadow_diff("proj").await.unwrap_err(), SessionError::InvalidState { .. }));
    }
}
