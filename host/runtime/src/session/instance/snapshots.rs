//! Pausing a session into a snapshot in its storage, and what forks take from it.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use umbra_api::{SessionSettings, SessionStatus};

use super::Session;
use crate::session::error::SessionError;
use crate::session::incarnation::Incarnation;
use crate::session::snapshot::{PendingSnapshot, SnapshotMeta};
use crate::session::store::SessionRecord;
use crate::share::tree;

impl Session {
    /// Pauses the running session into a snapshot in its storage and stops it (see
    /// [`super::snapshot`]); [`super::SessionManager::resume`] restores it. Processes get their
    /// exit event now, saying so; in the guest the agent ends them at the restore, when their
    /// connections reset (processes detached in the guest run on). The session's kept
    /// processes and terminals are parked in the guest instead, and the restore adopts them:
    /// they run on, their output and exit reaching the host as before. If the snapshot fails
    /// while the VM still answers, the session goes on running (kept processes adopted again)
    /// and the error says why; if the VM is lost, the session stops (shadow changes saved as on
    /// any stop, when the agent answers).
    pub async fn snapshot(self: &Arc<Self>) -> Result<(), SessionError> {
        self.touch();
        self.pause("the session was paused into a snapshot; resume restores it".into(), None).await
    }

    /// Suspends the session after `idle_secs` idle (`idle_action: suspend`): a snapshot, as
    /// [`Self::snapshot`], that the next call naming the session restores. A call that came in
    /// meanwhile keeps it running (and watched again).
    pub(super) async fn suspend(self: &Arc<Self>, idle_secs: u64) -> Result<(), SessionError> {
        let text = format!("the session was suspended after {idle_secs} s idle; the next call naming it resumes it");
        self.pause(text, Some(idle_secs)).await
    }

    /// Supervises `inc` again after a pause that did not happen.
    fn supervise_again(self: &Arc<Self>, inc: Arc<Incarnation>) {
        let cancel = CancellationToken::new();
        self.state.lock().unwrap().cancel = cancel.clone();
        tokio::spawn(self.clone().supervise(inc, cancel));
    }

    /// Whether an idle timeout can suspend the running VM: its backend snapshots (kvm) and the
    /// session has storage for the snapshot.
    pub(super) async fn can_suspend(&self, inc: &Incarnation) -> bool {
        self.storage_dir().is_some() && inc.machine.lock().await.vm.backend.capabilities().snapshot
    }

    /// A snapshot that stops the session; `idle_secs`: an idle suspension.
    async fn pause(self: &Arc<Self>, text: String, idle_secs: Option<u64>) -> Result<(), SessionError> {
        let _lifecycle = self.lifecycle.lock().await;
        if self.status() != SessionStatus::Ready {
            return Err(self.invalid_state("snapshot it"));
        }
        let Some(storage) = self.storage_dir() else {
            return Err(SessionError::Unsupported(format!(
                "session {:?} has no storage directory to keep a snapshot in",
                self.name
            )));
        };
        let inc = self.state.lock().unwrap().current.clone().ok_or_else(|| self.invalid_state("snapshot it"))?;
        let backend = inc.machine.lock().await.vm.backend;
        if !backend.capabilities().snapshot {
            return Err(SessionError::Unsupported(format!(
                "session {:?} runs on the {} backend, which cannot snapshot a VM: snapshots need the kvm \
                 backend (umbra-vmm)",
                self.name,
                backend.name()
            )));
        }
        if let Some(idle_secs) = idle_secs {
            // Checked again here, under the lifecycle lock and just before `stopping`: every
            // call touches the session first, and one from now on waits for the suspension.
            if self.idle_for(true) < Duration::from_secs(idle_secs) {
                self.supervise_again(inc);
                return Ok(());
            }
            self.emit(umbra_api::EventKind::IdleSuspend { idle_secs });
        }
        // The supervisor stops first: the guest is paused while its memory is written.
        self.state.lock().unwrap().cancel.cancel();
        self.set_status(SessionStatus::Stopping, Some(text.clone()));
        inc.set_ending(Some(text.clone()));
        let settings = self.settings();
        match self.write_snapshot(&inc, &storage, &settings).await {
            Ok(info) => {
                let console = inc.end(&text, false).await;
                {
                    let mut state = self.state.lock().unwrap();
                    state.current = None;
                    state.last_console = console;
                    state.record.snapshot = Some(info);
                    state.record.suspended = idle_secs.is_some();
                }
                self.set_status(SessionStatus::Stopped, Some(text));
                Ok(())
            }
            Err(e) => {
                tracing::warn!(session = %self.name, "snapshot failed: {e}");
                let alive = inc.check_alive().is_ok() && inc.heartbeat(Duration::from_secs(5)).await.is_ok();
                if alive {
                    self.adopt_kept(&inc).await;
                    inc.set_ending(None);
                    self.set_status(SessionStatus::Ready, None);
                    // A failed suspension: idle from now, not suspended again at once.
                    self.touch();
                    self.supervise_again(inc);
                } else {
                    let why = format!("the snapshot failed and the VM ended: {e}");
                    self.release_kept(&why);
                    inc.export_shadows(&storage, &self.report(), None).await;
                    let console = inc.end(&why, false).await;
                    {
                        let mut state = self.state.lock().unwrap();
                        state.current = None;
                        state.last_console = console;
                    }
                    self.set_status(SessionStatus::Stopped, Some(why));
                }
                Err(e)
            }
        }
    }

    /// The VM's state, memory, disk and folder table into `<storage>/snapshot`.
    pub(super) async fn write_snapshot(
        &self,
        inc: &Incarnation,
        storage: &Path,
        settings: &SessionSettings,
    ) -> Result<umbra_api::session::SnapshotInfo, SessionError> {
        let pending = PendingSnapshot::begin(storage)?;
        // Parked, their output up to now has reached the host, and the rest waits in the guest.
        self.park_kept(inc).await;
        let mut machine = inc.machine.lock().await;
        let folders = machine.folders.saved();
        let folder_sharing = machine.vm.shares_folders();
        let taken = machine
            .vm
            .snapshot(&pending.vm_dir())
            .await
            .map_err(|source| SessionError::Snapshot { name: self.name.clone(), source })?;
        drop(machine);
        let disk = storage.join(crate::session::DISK_FILE);
        let has_disk = settings.disk_size_mib > 0 && disk.is_file();
        if has_disk {
            let to = pending.disk();
            tokio::task::spawn_blocking(move || crate::backend::disk::copy_sparse(&disk, &to))
                .await
                .map_err(SessionError::task("the disk copy"))?
                .map_err(|source| SessionError::Snapshot { name: self.name.clone(), source })?;
        }
        let meta = self.snapshot_meta(inc, settings, &taken, has_disk, folder_sharing, folders);
        let meta = tokio::task::spawn_blocking(move || pending.commit(&meta).map(|_| meta))
            .await
            .map_err(SessionError::task("writing the snapshot"))??;
        tracing::info!(session = %self.name, took_ms = taken.took.as_millis() as u64, "snapshot taken");
        Ok(meta.info(true))
    }

    fn snapshot_meta(
        &self,
        inc: &Incarnation,
        settings: &SessionSettings,
        taken: &crate::backend::SnapshotTaken,
        disk: bool,
        folder_sharing: bool,
        folders: Vec<crate::share::folders::SavedFolder>,
    ) -> SnapshotMeta {
        SnapshotMeta {
            version: crate::session::snapshot::META_VERSION,
            session: self.name.clone(),
            hostname: inc.hostname.clone(),
            taken_ms: umbra_api::event::now_ms(),
            bundle: inc.bundle.clone(),
            bundle_version: inc.info.bundle_version.clone(),
            cpus: settings.cpus,
            memory_mib: settings.memory_mib,
            folder_sharing,
            disk,
            memory_bytes: taken.memory_bytes,
            pause_ms: taken.took.as_millis() as u64,
            pause_phases: taken.phases.clone(),
            folders,
        }
    }

    /// Whether a fork of this running session can leave it running: its backend forks live
    /// (kvm) and it has storage.
    pub(in crate::session) async fn can_fork_live(&self) -> bool {
        let Some(inc) = self.state.lock().unwrap().current.clone() else { return false };
        self.storage_dir().is_some() && inc.machine.lock().await.vm.capabilities.live_fork
    }

    /// Gives `dest` (a new fork's storage) a snapshot of this running session, which runs on:
    /// its guest pauses while the VM's state is read, its memory made copy-on-write and its disk
    /// copied ([`crate::backend::Vm::fork`]); nothing in it restarts, no process of it sees the
    /// fork, and its own snapshot (if any) stays its own. Outputs and uploads are copied after.
    pub(in crate::session) async fn fork_live_into(
        &self,
        dest: &Path,
    ) -> Result<umbra_api::session::SnapshotInfo, SessionError> {
        let _lifecycle = self.lifecycle.lock().await;
        if self.status() != SessionStatus::Ready {
            return Err(self.invalid_state("fork it"));
        }
        let Some(storage) = self.storage_dir() else {
            return Err(SessionError::Unsupported(format!("session {:?} has no storage", self.name)));
        };
        let inc = self.state.lock().unwrap().current.clone().ok_or_else(|| self.invalid_state("fork it"))?;
        self.touch();
        let settings = self.settings();
        let pending = PendingSnapshot::begin(dest)?;
        let disk = storage.join(crate::session::DISK_FILE);
        let has_disk = settings.disk_size_mib > 0 && disk.is_file();
        let disk_copy = pending.disk();
        // The disk must be what the memory expects: copied while the guest is paused.
        let during_pause: crate::backend::DuringPause = Box::new(move || match has_disk {
            true => crate::backend::disk::copy_sparse(&disk, &disk_copy).map(|_| ()).map_err(|e| e.to_string()),
            false => Ok(()),
        });
        let mut machine = inc.machine.lock().await;
        let folders = machine.folders.saved();
        let folder_sharing = machine.vm.shares_folders();
        inc.forks.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        let taken = machine.vm.fork(&pending.vm_dir(), during_pause).await;
        inc.forks.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        let taken = taken.map_err(|source| SessionError::Snapshot { name: self.name.clone(), source })?;
        drop(machine);
        let meta = self.snapshot_meta(&inc, &settings, &taken, has_disk, folder_sharing, folders);
        tracing::info!(session = %self.name, paused_ms = taken.took.as_millis() as u64, phases = %taken.phases, "forked live");
        let dest = dest.to_path_buf();
        tokio::task::spawn_blocking(move || {
            pending.commit(&meta)?;
            copy_guest_trees(&storage, &dest)?;
            Ok(meta.info(true))
        })
        .await
        .map_err(SessionError::task("the fork's copy"))?
    }

    /// Gives `dest` (a new fork's storage) this session's snapshot, by hard links, while no
    /// snapshot of this session can replace it; with its outputs and uploads copied.
    /// `just_taken`: the caller snapshotted this session for the fork; otherwise its snapshot
    /// must still be the one it resumes from, as a session that ran on after its restore has
    /// outputs and a disk newer than the snapshot's memory.
    pub(in crate::session) async fn fork_into(
        &self,
        dest: &Path,
        just_taken: bool,
    ) -> Result<umbra_api::session::SnapshotInfo, SessionError> {
        let _lifecycle = self.lifecycle.lock().await;
        let Some(storage) = self.storage_dir() else {
            return Err(SessionError::Unsupported(format!("session {:?} has no storage", self.name)));
        };
        match self.state.lock().unwrap().record.snapshot.as_ref().map(|s| s.resumes) {
            None => return Err(self.invalid_state("fork it: it has no snapshot (fork it while it runs, or take one)")),
            Some(false) if !just_taken => {
                return Err(self.invalid_state(
                    "fork it from its snapshot: it ran on after the snapshot was restored, so the snapshot is \
                     older than its disk and outputs; a fork of the running session takes a new one",
                ))
            }
            Some(_) => {}
        }
        let dest = dest.to_path_buf();
        tokio::task::spawn_blocking(move || {
            let meta = crate::session::snapshot::link(&storage, &dest)?;
            copy_guest_trees(&storage, &dest)?;
            Ok(meta.info(true))
        })
        .await
        .map_err(SessionError::task("the fork's copy"))?
    }

    /// Deletes a stopped or failed session's snapshot, so its next start boots from its disk.
    pub(in crate::session) async fn discard_snapshot(&self) -> Result<(), SessionError> {
        let _lifecycle = self.lifecycle.lock().await;
        if self.status().is_active() {
            return Err(self.invalid_state("discard its snapshot (stop it first)"));
        }
        if self.state.lock().unwrap().record.snapshot.take().is_none() {
            return Ok(());
        }
        self.state.lock().unwrap().record.suspended = false;
        self.release_kept("its session's snapshot was discarded");
        self.persist();
        if let Some(storage) = self.storage_dir() {
            let dir = storage.join(crate::session::snapshot::SNAPSHOT_DIR);
            if dir.exists() {
                std::fs::remove_dir_all(&dir).map_err(SessionError::io(format!("remove {}", dir.display())))?;
            }
        }
        tracing::info!(session = %self.name, "snapshot discarded");
        Ok(())
    }

    /// The record a fork of this session starts with: its settings and folders (which must
    /// be what they were when this session first shared them).
    pub(in crate::session) fn fork_record(&self, name: &str) -> SessionRecord {
        let state = self.state.lock().unwrap();
        let mut record = SessionRecord::new(name, state.record.settings.clone(), state.record.folders.clone());
        record.pinned = state.record.pinned.clone();
        // The same placeholders: the snapshot's processes hold them.
        record.secrets = state.record.secrets.clone();
        record.ssh_keys = state.record.ssh_keys.clone();
        // The same guest ports, each on a free host port of its own (the source keeps its).
        record.ports =
            state.record.ports.iter().map(|p| umbra_api::ports::PortSpec { host_port: None, ..*p }).collect();
        record
    }

    /// A fork's snapshot, once linked into its storage: its first start restores it.
    pub(in crate::session) fn set_snapshot(&self, snapshot: umbra_api::session::SnapshotInfo) {
        self.state.lock().unwrap().record.snapshot = Some(snapshot);
        self.persist();
    }
}

/// Copies the session's outputs and uploads from `storage` into a fork's `dest`. The guest
/// writes these trees (and may still, if the source runs): they are copied beneath-only,
/// following no symlink, within the guest-tree bounds.
fn copy_guest_trees(storage: &Path, dest: &Path) -> Result<(), SessionError> {
    for dir in [crate::share::paths::OUTPUTS, crate::share::paths::UPLOADS] {
        let src = storage.join(dir);
        if src.is_dir() {
            let what = || format!("copy {} into the fork", src.display());
            let root = tree::open_root(&src).map_err(|source| SessionError::Tree { what: what(), source })?;
            tree::copy(&root, &src, &dest.join(dir), tree::TreeLimits::GUEST_TREE)
                .map_err(|source| SessionError::Tree { what: what(), source })?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::instance::test_support::stopped_session;
    use umbra_api::FolderSpec;

    #[tokio::test]
    async fn only_a_running_session_snapshots_and_only_a_snapshot_forks() {
        let dir = tempfile::tempdir().unwrap();
        let session = stopped_session(dir.path(), "s", Default::default(), Vec::new());
        assert!(matches!(session.snapshot().await.unwrap_err(), SessionError::InvalidState { .. }));
        let e = session.fork_into(&dir.path().join("fork"), false).await.unwrap_err();
        assert!(e.to_string().contains("no snapshot"), "{e}");
        session.discard_snapshot().await.unwrap();
        assert!(!dir.path().join("fork").exists());
    }

    #[test]
    fn a_fork_starts_with_the_settings_folders_and_pins_of_its_source() {
        let dir = tempfile::tempdir().unwrap();
        let settings = SessionSettings { memory_mib: 777, ..Default::default() };
        let folders =
            vec![FolderSpec { path: dir.path().into(), name: Some("proj".into()), mode: umbra_proto::ShareMode::Ro }];
        let session = stopped_session(dir.path(), "s", settings, folders.clone());
        let record = session.fork_record("f");
        assert_eq!(record.name, "f");
        assert_eq!(record.settings.memory_mib, 777);
        assert_eq!(record.folders, folders);
        assert_eq!(record.pinned, session.state.lock().unwrap().record.pinned);
        assert!(record.snapshot.is_none(), "its snapshot is linked in later");
    }
}
