//! The folders shared with one running VM: the host side binds each folder into the VM's folder
//! server (read-only on the host unless the mode lets the guest write through), then the agent
//! mounts it at `/sessions/<session>/mnt/<name>`. Shadow shares record a baseline of the host
//! folder first, so an apply can refuse files the host changed meanwhile.
//!
//! [`SharedFolders`] is kept beside the [`Vm`] by whoever owns it (a session): the VM knows
//! nothing of folders beyond its folder server, so this module depends on `backend` and never
//! the other way round.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use umbra_proto::{ChangeKind, ShareMode, ShareRequest, MAX_FILE_CHUNK};

use super::paths::{
    default_folder_name, validate_folder_name, validate_session_name, PathError, OUTPUTS, READONLY_TMP, UPLOADS,
};
use super::shadow::{ApplyReport, Baseline, CaptureLimits, ChangeSet, Rules, ShadowError};
use crate::agent::ClientError;
use crate::backend::fsd::Protection;
use crate::backend::{FolderIdentity, Vm, VmError};

/// Why sharing (or a shadow operation) failed, with its cause kept whole so a caller can tell
/// a bad name from a missing folder from a guest that refused.
#[derive(Debug, thiserror::Error)]
pub enum ShareError {
    #[error(transparent)]
    Path(#[from] PathError),
    #[error("{}: {source}", path.display())]
    HostPath { path: PathBuf, source: std::io::Error },
    #[error("a folder named {0:?} is already shared with this session")]
    AlreadyShared(String),
    #[error("no folder {0:?} is shared with this session")]
    NotShared(String),
    #[error("{0:?} is not a shadow folder")]
    NotShadow(String),
    #[error("the VM was launched without folder sharing")]
    NoFolderServer,
    /// The folder server (umbra-fsd) failed or refused.
    #[error(transparent)]
    Server(VmError),
    #[error("the guest could not mount {name}: {source}")]
    GuestMount { name: String, source: ClientError },
    #[error("the guest failed: {0}")]
    Guest(#[from] ClientError),
    #[error(transparent)]
    Shadow(#[from] ShadowError),
    #[error("the diff of {name} is too large to list ({shown} entries shown)")]
    DiffTooLarge { name: String, shown: usize },
    #[error(
        "applying {name} needs the changeset id of a shadow diff: an apply writes exactly what a diff \
         captured (and showed), never what the guest holds by then"
    )]
    NoChangeSet { name: String },
    #[error("changeset {id:?} is not the latest diff of {name} (superseded, reset or lost in a restart); take the diff again")]
    UnknownChangeSet { name: String, id: String },
    #[error("cannot {what}: {source}")]
    Io { what: String, source: std::io::Error },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ShareError {
    let what = what.into();
    move |source| ShareError::Io { what, source }
}

/// A folder shared with the VM.
pub struct Shared {
    pub session: String,
    pub name: String,
    pub host_path: PathBuf,
    pub mode: ShareMode,
    pub guest_path: String,
    /// Served with the policy's protection (`.git`, ignored files): the user's folders and
    /// extra paths, not the session's own.
    protected: bool,
    /// The host folder as it was when a shadow share started.
    baseline: Option<Baseline>,
    /// What the folder server shared (device, inode).
    identity: Option<FolderIdentity>,
}

/// A folder a session shared: where it is (its path as first resolved, without links) and
/// what it was (device, inode).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Pinned {
    pub path: PathBuf,
    pub identity: FolderIdentity,
}

/// The folders a session has shared, by the path it asked for. A later boot, resume, restart,
/// restore, fork or hot-add of the same path gets the recorded folder or a refusal: it is
/// never resolved again, and a guest that replaced it (with a link to elsewhere on the host,
/// or another directory) through a writable folder gets an error naming it.
pub type FolderPins = BTreeMap<PathBuf, Pinned>;

/// A [`Shared`] as a session snapshot keeps it: what a restored VM's folder server must serve
/// again under the same name, and what the host needs to go on (guest path, shadow baseline).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SavedFolder {
    /// The session whose guest path it has (a fork keeps its source's paths).
    pub session: String,
    pub name: String,
    pub host_path: PathBuf,
    pub mode: ShareMode,
    pub guest_path: String,
    pub protected: bool,
    pub baseline: Option<Baseline>,
    /// What the folder was (absent in snapshots taken before it was recorded).
    #[serde(default)]
    pub identity: Option<FolderIdentity>,
}

/// What a sandbox policy asks of the folders a session shares (see `docs/policy.md`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FolderPolicy {
    /// `workspace_readonly`: the user's folders are shared read-only whatever mode they ask.
    pub workspace_readonly: bool,
    /// `block_git_writes`: every `.git` of a writable folder is read-only on the host.
    pub protect_git: bool,
    /// `ignore`: gitignore patterns whose files are never opened for the guest.
    pub hide: Vec<String>,
}

impl FolderPolicy {
    pub fn from_policy(policy: &umbra_policy::EffectivePolicy) -> Self {
        Self {
            workspace_readonly: policy.kind == umbra_policy::PolicyType::WorkspaceReadonly,
            protect_git: policy.block_git_writes,
            hide: policy.ignore.clone(),
        }
    }

    /// The mode a workspace folder asked to be shared in gets under this policy: read-only
    /// for `workspace_readonly` (a shadow too: its writes would succeed in the guest).
    pub fn workspace_mode(&self, asked: ShareMode) -> ShareMode {
        if self.workspace_readonly {
            ShareMode::Ro
        } else {
            asked
        }
    }
}

impl Shared {
    /// How the session reports it.
    pub fn info(&self) -> umbra_api::FolderInfo {
        umbra_api::FolderInfo {
            name: self.name.clone(),
            host_path: self.host_path.clone(),
            mode: self.mode,
            guest_path: self.guest_path.clone(),
        }
    }
}

/// Every folder shared with one VM.
#[derive(Default)]
pub struct SharedFolders {
    shared: Vec<Shared>,
    policy: FolderPolicy,
    pins: FolderPins,
    /// The latest diff of each shadow folder, captured: what an apply may write.
    changesets: std::collections::HashMap<String, ChangeSet>,
}

impl SharedFolders {
    pub fn new() -> Self {
        Self::default()
    }

    /// Folders shared under `policy` (user folders and extra paths; never the session's own
    /// `outputs` and `uploads`).
    pub fn with_policy(policy: FolderPolicy) -> Self {
        Self { shared: Vec::new(), policy, pins: FolderPins::new(), changesets: Default::default() }
    }

    /// With the folders the session shared before, which must still be what they were.
    pub fn with_pins(mut self, pins: FolderPins) -> Self {
        self.pins = pins;
        self
    }

    /// Every folder shared so far (with the ones given to [`Self::with_pins`]): what the
    /// session keeps for its next VM.
    pub fn pins(&self) -> &FolderPins {
        &self.pins
    }

    /// Where the folder asked for as `asked` is, and what it must be: a folder shared before
    /// is taken as recorded (never resolved again: a link there now is refused by the folder
    /// server), a new one is resolved once, here.
    fn locate(&self, asked: &Path) -> Result<(PathBuf, Option<FolderIdentity>), ShareError> {
        if let Some(pin) = self.pins.get(asked) {
            return Ok((pin.path.clone(), Some(pin.identity)));
        }
        let path = asked.canonicalize().map_err(|source| ShareError::HostPath { path: asked.to_path_buf(), source })?;
        if !path.is_dir() {
            return Err(PathError::NotADirectory(path).into());
        }
        if let Some(pin) = self.pins.get(&path) {
            return Ok((pin.path.clone(), Some(pin.identity)));
        }
        Ok((path, None))
    }

    /// Shares a host path the policy adds beyond the workspace (`additional_*_paths`): `Rwd`
    /// or `Ro` whatever the workspace type, with `.git` and ignore protection still applied.
    pub async fn share_extra(
        &mut self,
        vm: &mut Vm,
        session: &str,
        host_path: &Path,
        read_only: bool,
    ) -> Result<String, ShareError> {
        let asked = host_path;
        let (host_path, expected) = self.locate(asked)?;
        let base = default_folder_name(&host_path)?;
        let name = (1..)
            .map(|i| if i == 1 { base.clone() } else { format!("{base}-{i}") })
            .find(|n| !self.shared.iter().any(|s| &s.name == n))
            .expect("some suffix is free");
        validate_folder_name(&name)?;
        let mode = if read_only { ShareMode::Ro } else { ShareMode::Rwd };
        let guest_path = self.share_as(vm, session, &host_path, &name, mode, true, expected).await?;
        self.pin(asked, &host_path);
        Ok(guest_path)
    }

    /// Records the folder just shared from `host_path` (asked for as `asked`).
    fn pin(&mut self, asked: &Path, host_path: &Path) {
        let Some(identity) = self.shared.last().and_then(|s| s.identity) else { return };
        for key in [asked, host_path] {
            self.pins.entry(key.to_path_buf()).or_insert(Pinned { path: host_path.to_path_buf(), identity });
        }
    }

    /// Makes the guest's `/tmp` read-only on the host (`disable_tmp_write`): an empty host
    /// directory, shared read-only, bound over `/tmp`. A guest root remounting `/tmp`
    /// read-write gets nowhere: the host refuses the writes.
    pub async fn readonly_tmp(&mut self, vm: &mut Vm, session: &str) -> Result<(), ShareError> {
        let empty = vm.run_dir().join("readonly-tmp");
        std::fs::create_dir_all(&empty).map_err(io(format!("create {}", empty.display())))?;
        let guest_path = self.share_as(vm, session, &empty, READONLY_TMP, ShareMode::Ro, false, None).await?;
        let bind = umbra_proto::MountRequest {
            source: guest_path,
            target: "/tmp".into(),
            fs_type: String::new(),
            read_only: true,
            bind: true,
        };
        vm.agent().mount(bind).await.map_err(|source| ShareError::GuestMount { name: "/tmp".into(), source })
    }

    /// Shares `host_path` with the running `vm` as `name` (default: its basename) in `mode`;
    /// returns the guest path. Needs a VM launched with `folder_sharing`.
    pub async fn share(
        &mut self,
        vm: &mut Vm,
        session: &str,
        host_path: &Path,
        name: Option<&str>,
        mode: ShareMode,
    ) -> Result<String, ShareError> {
        validate_session_name(session)?;
        let asked = host_path;
        let (host_path, expected) = self.locate(asked)?;
        let name = match name {
            Some(n) => n.to_string(),
            None => default_folder_name(&host_path)?,
        };
        validate_folder_name(&name)?;
        let mode = self.policy.workspace_mode(mode);
        let guest_path = self.share_as(vm, session, &host_path, &name, mode, true, expected).await?;
        self.pin(asked, &host_path);
        Ok(guest_path)
    }

    /// Shares the session's own `outputs` (read-write-delete) and `uploads` (read-only) folders
    /// from `storage_dir`, creating them.
    pub async fn share_session_dirs(
        &mut self,
        vm: &mut Vm,
        session: &str,
        storage_dir: &Path,
    ) -> Result<Vec<String>, ShareError> {
        validate_session_name(session)?;
        let mut guest_paths = Vec::new();
        for (name, mode) in [(OUTPUTS, ShareMode::Rwd), (UPLOADS, ShareMode::Ro)] {
            let dir = storage_dir.join(name);
            std::fs::create_dir_all(&dir).map_err(io(format!("create {}", dir.display())))?;
            if mode.host_writable() {
                crate::backend::fsd::give_to_share_owner(&dir).map_err(io(format!("chown {}", dir.display())))?;
            }
            guest_paths.push(self.share_as(vm, session, &dir, name, mode, false, None).await?);
        }
        Ok(guest_paths)
    }

    #[allow(clippy::too_many_arguments)]
    async fn share_as(
        &mut self,
        vm: &mut Vm,
        session: &str,
        host_path: &Path,
        name: &str,
        mode: ShareMode,
        protect: bool,
        expected: Option<FolderIdentity>,
    ) -> Result<String, ShareError> {
        if self.shared.iter().any(|s| s.name == name) {
            return Err(ShareError::AlreadyShared(name.into()));
        }
        let baseline = match mode {
            ShareMode::Shadow => {
                Some(Baseline::record(host_path).map_err(io(format!("record {}", host_path.display())))?)
            }
            _ => None,
        };
        // The bind's name in the share root is the folder name (one session per VM).
        if !vm.shares_folders() {
            return Err(ShareError::NoFolderServer);
        }
        let protection = match protect {
            true => Protection { protect_git: self.policy.protect_git, hide: self.policy.hide.clone() },
            false => Protection::default(),
        };
        let identity = vm.add_folder(name, host_path, !mode.host_writable(), &protection, expected).await.map_err(
            |e| match e {
                VmError::FolderServer(why) => {
                    ShareError::Server(VmError::FolderServer(format!("folder {name}: {why}")))
                }
                e => ShareError::Server(e),
            },
        )?;
        let request = ShareRequest { session: session.into(), name: name.into(), mode };
        let guest_path = match vm.agent().share(request).await {
            Ok(p) => p,
            Err(source) => {
                let _ = vm.remove_folder(name).await;
                return Err(ShareError::GuestMount { name: name.into(), source });
            }
        };
        self.shared.push(Shared {
            session: session.into(),
            name: name.into(),
            host_path: host_path.to_path_buf(),
            mode,
            guest_path: guest_path.clone(),
            protected: protect,
            baseline,
            identity: Some(identity),
        });
        Ok(guest_path)
    }

    /// Unmounts folder `name` in the guest and removes it from the folder server.
    pub async fn unshare(&mut self, vm: &mut Vm, name: &str) -> Result<(), ShareError> {
        let i = self.shared.iter().position(|s| s.name == name).ok_or_else(|| ShareError::NotShared(name.into()))?;
        let session = self.shared[i].session.clone();
        vm.agent().unshare(&session, name).await?;
        vm.remove_folder(name).await.map_err(|e| match e {
            VmError::NoFolderSharing => ShareError::NoFolderServer,
            e => ShareError::Server(e),
        })?;
        self.shared.remove(i);
        self.changesets.remove(name);
        Ok(())
    }

    pub fn list(&self) -> &[Shared] {
        &self.shared
    }

    /// The folders as a snapshot keeps them.
    pub fn saved(&self) -> Vec<SavedFolder> {
        self.shared
            .iter()
            .map(|s| SavedFolder {
                session: s.session.clone(),
                name: s.name.clone(),
                host_path: s.host_path.clone(),
                mode: s.mode,
                guest_path: s.guest_path.clone(),
                protected: s.protected,
                baseline: s.baseline.clone(),
                identity: s.identity,
            })
            .collect()
    }

    /// What a restored VM's folder server must serve (see [`crate::backend::Restore`]).
    pub fn server_folders(&self) -> Vec<crate::backend::SharedFolder> {
        self.shared
            .iter()
            .map(|s| crate::backend::SharedFolder {
                name: s.name.clone(),
                source: s.host_path.clone(),
                read_only: !s.mode.host_writable(),
                protection: match s.protected {
                    true => Protection { protect_git: self.policy.protect_git, hide: self.policy.hide.clone() },
                    false => Protection::default(),
                },
                identity: s.identity,
            })
            .collect()
    }

    /// The folders of a VM restored from a snapshot: already mounted in the guest and served
    /// by the VM's folder server, so nothing is asked of either.
    pub fn restored(policy: FolderPolicy, saved: Vec<SavedFolder>) -> Self {
        let shared = saved
            .into_iter()
            .map(|f| Shared {
                session: f.session,
                name: f.name,
                host_path: f.host_path,
                mode: f.mode,
                guest_path: f.guest_path,
                protected: f.protected,
                baseline: f.baseline,
                identity: f.identity,
            })
            .collect();
        Self { shared, policy, pins: FolderPins::new(), changesets: Default::default() }
    }

    fn shadow(&self, name: &str) -> Result<&Shared, ShareError> {
        let shared = self.shared.iter().find(|s| s.name == name).ok_or_else(|| ShareError::NotShared(name.into()))?;
        if shared.mode != ShareMode::Shadow {
            return Err(ShareError::NotShadow(name.into()));
        }
        Ok(shared)
    }

    /// What the guest changed in a shadow share, captured on the host as the folder's change-set
    /// (replacing the previous one): the entries with their sizes, hashes and risks.
    pub async fn shadow_diff(
        &mut self,
        vm: &Vm,
        name: &str,
    ) -> Result<umbra_api::methods::ShadowDiffResult, ShareError> {
        let set = self.capture(vm, name).await?;
        let result = umbra_api::methods::ShadowDiffResult { changeset: set.id().to_owned(), changes: set.report() };
        self.changesets.insert(name.to_owned(), set);
        Ok(result)
    }

    /// Applies change-set `changeset` of a shadow share (all of it that applies by default, or
    /// only `paths`) to the host folder: the bytes captured by its diff, file by file
    /// atomically; files the host changed since the share started are conflicts, left alone.
    /// Without a change-set, or with one that is not the folder's latest, nothing is applied.
    pub fn shadow_apply(
        &self,
        name: &str,
        changeset: Option<&str>,
        paths: Option<&[String]>,
    ) -> Result<ApplyReport, ShareError> {
        let shared = self.shadow(name)?;
        let id = changeset.ok_or_else(|| ShareError::NoChangeSet { name: name.into() })?;
        let set = self
            .changesets
            .get(name)
            .filter(|s| s.id() == id)
            .ok_or_else(|| ShareError::UnknownChangeSet { name: name.into(), id: id.into() })?;
        let baseline = shared.baseline.as_ref().expect("shadow shares record a baseline");
        Ok(set.apply(&shared.host_path, baseline, paths)?)
    }

    /// Writes a shadow share's changes as a tar (added/modified files plus a deletion list),
    /// from a capture of its own.
    pub async fn shadow_export<W: Write>(&self, vm: &Vm, name: &str, out: W) -> Result<W, ShareError> {
        Ok(self.capture(vm, name).await?.export_tar(out)?)
    }

    /// The number of changes in a shadow share, without capturing them.
    pub async fn shadow_count(&self, vm: &Vm, name: &str) -> Result<usize, ShareError> {
        let shared = self.shadow(name)?;
        let (changes, truncated) = vm.agent().shadow_diff(&shared.session, name).await?;
        if truncated {
            return Err(ShareError::DiffTooLarge { name: name.into(), shown: changes.len() });
        }
        Ok(changes.len())
    }

    /// Throws away the guest's changes in a shadow share (and its change-set).
    pub async fn shadow_reset(&mut self, vm: &Vm, name: &str) -> Result<(), ShareError> {
        let session = self.shadow(name)?.session.clone();
        self.changesets.remove(name);
        Ok(vm.agent().shadow_reset(&session, name).await?)
    }

    /// The guest's diff of a shadow share with every changed file's bytes copied to the VM's run
    /// directory. What the guest has at a path is asked without following a final symlink; a
    /// file that changes size while it is read fails the capture.
    async fn capture(&self, vm: &Vm, name: &str) -> Result<ChangeSet, ShareError> {
        let shared = self.shadow(name)?;
        let (changes, truncated) = vm.agent().shadow_diff(&shared.session, name).await?;
        if truncated {
            return Err(ShareError::DiffTooLarge { name: name.into(), shown: changes.len() });
        }
        let baseline = shared.baseline.as_ref().expect("shadow shares record a baseline");
        let ignore = match shared.protected && !self.policy.hide.is_empty() {
            true => Some(
                umbra_policy::IgnoreSet::new(&shared.host_path, &self.policy.hide)
                    .map_err(|e| io("compile the policy's ignore patterns")(std::io::Error::other(e.to_string())))?,
            ),
            false => None,
        };
        let rules = Rules { block_git: self.policy.protect_git, ignore };
        let mut set = ChangeSet::create(vm.run_dir(), CaptureLimits::default())?;
        for change in changes {
            let guest_path = format!("{}/{}", shared.guest_path, change.path);
            let guest = match change.kind != ChangeKind::Deleted && !change.is_dir {
                true => match vm.agent().stat(&guest_path).await {
                    Ok(stat) => Some(stat),
                    Err(ClientError::Agent(e)) if e.code == umbra_proto::ErrorCode::NotFound => None,
                    Err(e) => return Err(e.into()),
                },
                false => None,
            };
            // Only a regular file's bytes are captured (and read: a guest read follows symlinks).
            let Some(mut capture) = set.add(change, guest, baseline, &rules)? else { continue };
            let mut offset = 0u64;
            loop {
                let (bytes, eof) = vm.agent().read_file(&guest_path, offset, MAX_FILE_CHUNK as u32).await?;
                set.write(&mut capture, &bytes)?;
                offset += bytes.len() as u64;
                if eof || bytes.is_empty() {
                    break;
                }
            }
            set.finish(capture)?;
        }
        Ok(set)
    }
}
