//! The one launch pipeline under a session's boot, its restore and the warm pool (Firecracker's
//! builder and `PreparedVm` are the model): [`Prepared::new`] decides once what is fixed before
//! a VM runs — the bundle's image, the backend and why, the machine's size — and
//! [`Prepared::launch`] takes a boot slot, makes the session disk and boots, or resumes a
//! snapshot. What a session adds once its VM runs (folders, egress, outputs) is the
//! incarnation's.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use umbra_api::BackendChoice;
use umbra_bundle::Store;

use super::admission::Admission;
use crate::backend::{select, BackendKind, BootImage, Restore, Vm, VmError, VmSpec};
use crate::image::ImageError;

/// What a booted guest calls itself (a restored one is told its name: [`Restore::hostname`]).
pub(super) const BOOT_HOSTNAME: &str = "umbra";

/// Why a VM did not launch.
#[derive(Debug, thiserror::Error)]
pub(super) enum LaunchError {
    #[error(transparent)]
    Image(#[from] ImageError),
    /// A snapshot's bundle can no longer be found.
    #[error("{0}")]
    BundleGone(String),
    /// No backend here can do what is asked, or the VM did not start.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// A blocking step panicked: the runtime's fault.
    #[error("{what} failed inside umbrad: {source}")]
    Task { what: &'static str, source: tokio::task::JoinError },
}

fn task(what: &'static str) -> impl FnOnce(tokio::task::JoinError) -> LaunchError {
    move |source| LaunchError::Task { what, source }
}

/// Which bundle a VM boots.
pub(super) enum Bundle<'a> {
    /// `spec` as a start names it (`current`, a version, a built flavor); a warm download is
    /// made `current` first when `promote` (a start does; the pool, which only looks ahead, not).
    Spec { spec: &'a str, promote: bool },
    /// What a snapshot booted: `spec` if it still resolves to `version`, else `version` itself.
    Snapshotted { spec: &'a str, version: &'a str },
}

/// What a VM's session disk starts as.
pub(super) enum Disk {
    /// No disk: guest writes stay in RAM.
    None,
    /// `path`, an empty disk of `size_mib` made unless it exists (a session's disk outlives its
    /// VMs).
    Fresh { path: PathBuf, size_mib: u64 },
    /// A sparse copy of `from` (the disk a snapshot expects) put at `to` — only once complete,
    /// and only while its launch is still wanted.
    CopyOf { from: PathBuf, to: PathBuf },
}

/// A VM ready to launch: everything decided but the disk and whether it resumes a snapshot.
#[derive(Clone)]
pub(super) struct Prepared {
    pub image: BootImage,
    pub backend: BackendKind,
    /// Why this backend (`auto`'s choice, shown in `session.get` and the `ready` event).
    pub why: String,
    pub spec: VmSpec,
}

impl Prepared {
    /// Resolves `bundle` against `store` and chooses the backend for `choice`; a VM that will
    /// resume a snapshot (`restore`) gets a backend that can.
    pub async fn new(
        bundle: Bundle<'_>,
        store: &Store,
        choice: BackendChoice,
        restore: bool,
    ) -> Result<Self, LaunchError> {
        let image = resolve(bundle, store).await?;
        let (backend, why) = match restore {
            false => select::choose(choice, image.arch)?,
            true => select::choose_snapshot_capable(choice, image.arch)?,
        };
        let spec = VmSpec::new(image.clone());
        Ok(Self { image, backend, why, spec })
    }

    /// Sets the machine's size and how long its boot may take (from its boot slot on).
    pub fn size(mut self, cpus: u32, memory_mib: u32, boot_timeout: Duration) -> Self {
        self.spec.cpus = cpus;
        self.spec.memory_mib = memory_mib;
        self.spec.boot_timeout = boot_timeout;
        self
    }

    /// Starts the folder server with the VM, so folders can be shared while it runs.
    pub fn folder_sharing(mut self, on: bool) -> Self {
        self.spec.folder_sharing = on;
        self
    }

    /// Takes a boot slot (`queued` hears the place in the queue if it must wait), makes `disk`
    /// and boots — or resumes `restore`, whose snapshot the rest of the spec must describe.
    pub async fn launch(
        mut self,
        admission: &Admission,
        queued: impl FnOnce(u32),
        disk: Disk,
        restore: Option<Restore>,
    ) -> Result<Vm, LaunchError> {
        let slot = admission.enter(queued).await;
        self.spec.disk = make_disk(disk).await?;
        self.spec.restore = restore;
        let vm = Vm::launch(self.backend, &self.spec).await?;
        drop(slot);
        Ok(vm)
    }
}

async fn resolve(bundle: Bundle<'_>, store: &Store) -> Result<BootImage, LaunchError> {
    let store = store.clone();
    let resolved = match bundle {
        Bundle::Spec { spec, promote } => {
            let spec = spec.to_string();
            tokio::task::spawn_blocking(move || crate::image::resolve_with(&spec, &store, promote))
                .await
                .map_err(task("bundle resolution"))??
        }
        Bundle::Snapshotted { spec, version } => {
            let (spec, version) = (spec.to_string(), version.to_string());
            tokio::task::spawn_blocking(move || match crate::image::resolve_with(&spec, &store, false) {
                Ok(r) if r.image.version == version => Ok(r),
                first => crate::image::resolve_with(&version, &store, false).map_err(|e| match first {
                    Ok(r) => LaunchError::BundleGone(format!(
                        "the snapshot was taken with bundle {version}, {spec} is now {} and {version} cannot be \
                         found ({e}); delete the session or install {version} again",
                        r.image.version
                    )),
                    Err(_) => e.into(),
                }),
            })
            .await
            .map_err(task("bundle resolution"))??
        }
    };
    Ok(resolved.image)
}

async fn make_disk(disk: Disk) -> Result<Option<PathBuf>, LaunchError> {
    match disk {
        Disk::None => Ok(None),
        Disk::Fresh { path, size_mib } => {
            let p = path.clone();
            tokio::task::spawn_blocking(move || {
                if let Some(dir) = p.parent() {
                    std::fs::create_dir_all(dir)
                        .map_err(|source| VmError::Io { what: format!("create {}", dir.display()), source })?;
                }
                crate::backend::disk::ensure_session_disk(&p, size_mib << 20)
            })
            .await
            .map_err(task("disk preparation"))??;
            Ok(Some(path))
        }
        Disk::CopyOf { from, to } => copy_disk(from, to).await.map(Some),
    }
}

/// Copies `from` beside `to`, then renames it over `to`: a failed copy leaves `to` as it was.
/// A cancelled launch (a stop during a restore) cancels the wait but not the blocking copy,
/// which then must not replace a disk a later launch's VM has opened: the copy is put in place
/// only while its launch is wanted, one copy at a time.
async fn copy_disk(from: PathBuf, to: PathBuf) -> Result<PathBuf, LaunchError> {
    static SWAP: std::sync::Mutex<()> = std::sync::Mutex::new(());
    static COPIES: AtomicU64 = AtomicU64::new(0);
    let n = COPIES.fetch_add(1, Ordering::Relaxed);
    let name = to.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = to.with_file_name(format!(".{name}.copy-{}-{n}", std::process::id()));
    let wanted = Wanted::default();
    let still_wanted = wanted.0.clone();
    let copied = tokio::task::spawn_blocking(move || {
        crate::backend::disk::copy_sparse(&from, &tmp)?;
        let _swap = SWAP.lock().unwrap_or_else(|e| e.into_inner());
        if !still_wanted.load(Ordering::SeqCst) {
            let _ = std::fs::remove_file(&tmp);
            return Err(VmError::Io {
                what: "the launch was cancelled".into(),
                source: std::io::ErrorKind::Interrupted.into(),
            });
        }
        std::fs::rename(&tmp, &to).map_err(|source| {
            let _ = std::fs::remove_file(&tmp);
            VmError::Io { what: format!("rename {}", tmp.display()), source }
        })?;
        Ok::<_, VmError>(to)
    })
    .await
    .map_err(task("the disk copy"))??;
    drop(wanted);
    Ok(copied)
}

/// True until dropped: a launch's future holds it while its blocking disk copy runs, so a
/// cancelled launch's copy knows not to put itself in place.
struct Wanted(Arc<AtomicBool>);

impl Default for Wanted {
    fn default() -> Self {
        Self(Arc::new(AtomicBool::new(true)))
    }
}

impl Drop for Wanted {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_disk_copy_replaces_the_target_only_when_complete() {
        let dir = tempfile::tempdir().unwrap();
        let (from, to) = (dir.path().join("snap.img"), dir.path().join("disk.img"));
        std::fs::write(&from, b"snapshot's disk").unwrap();
        std::fs::write(&to, b"old disk").unwrap();
        let copied = copy_disk(from.clone(), to.clone()).await.unwrap();
        assert_eq!(copied, to);
        assert_eq!(std::fs::read(&to).unwrap(), b"snapshot's disk");
        // A copy of what does not exist fails and leaves the target as it was.
        let e = copy_disk(dir.path().join("missing.img"), to.clone()).await.unwrap_err();
        assert!(matches!(e, LaunchError::Vm(_)), "{e}");
        assert_eq!(std::fs::read(&to).unwrap(), b"snapshot's disk");
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left.len(), 2, "no temporary copy left behind: {left:?}");
    }

    #[tokio::test]
    async fn a_fresh_disk_keeps_what_is_there() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sessions/s/disk.img");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, b"an earlier run's data").unwrap();
        let made = make_disk(Disk::Fresh { path: path.clone(), size_mib: 64 }).await.unwrap();
        assert_eq!(made.as_deref(), Some(path.as_path()));
        assert_eq!(std::fs::read(&path).unwrap(), b"an earlier run's data", "never reformatted");
        assert!(make_disk(Disk::None).await.unwrap().is_none());
    }
}
