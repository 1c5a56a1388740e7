//! The warm pool: VMs booted ahead of the sessions that will use them.
//!
//! A session start is otherwise a full boot. The pool keeps `pool_target()` VMs booted with the
//! daemon's session defaults (bundle, backend, memory, vCPUs, disk size, folder sharing on); a
//! start whose settings give the same [`PoolKey`] takes one, and a replacement boots in the
//! background. Everything else a session has is attached after boot and needs no fresh VM: its
//! folders (through the running folder server), its network policy (the host's egress proxy),
//! its outputs watcher and its approval settings.
//!
//! - A pooled VM with a session disk keeps it in the pool's directory until a session takes
//!   it; the take renames it into the session's storage (same filesystem, the VMM keeps its
//!   open descriptor), so the disk is the session's from then on.
//! - A VM is checked when it is taken (its processes alive, the agent answering a ping), so a
//!   VM that died while waiting costs a boot, never a broken session.
//! - When the defaults change (a new bundle installed as `current`, other memory), VMs of the
//!   old key are killed and the pool refills with the new one. Pool boots take a boot slot like
//!   any other ([`super::admission`]), one at a time.
//! - On a backend that can snapshot (kvm), the pool boots one template VM, snapshots it as soon
//!   as its agent has announced itself, and restores every pooled VM from that snapshot: each
//!   with its own sparse copy of the template's disk and its own entropy, machine id and clock
//!   (the backend re-identifies a restored guest). The template is taken again when the key
//!   changes, and removed when the pool is switched off. If taking or restoring it fails the
//!   pool boots its VMs one by one, says why in `pool.status` (`snapshot_error`), and tries the
//!   template again after [`TEMPLATE_RETRY`].
//! - Elsewhere (qemu, vz) the pool's VMs are booted ones.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use umbra_api::methods::PoolStatus;
use umbra_api::DaemonConfig;

use super::context::Context;
use crate::backend::{select, BackendKind, BootImage, Restore, Vm, VmSpec};

/// How long a taken VM's agent may take to answer the check ping.
const TAKE_PING: Duration = Duration::from_secs(2);
/// How often the pool looks at itself without being woken (dead VMs, a new `current`).
const PATROL: Duration = Duration::from_secs(30);
/// How long the pool waits after a failed boot before trying again.
const RETRY: Duration = Duration::from_secs(30);
/// How long the pool boots its VMs after taking or restoring its template failed, before it
/// tries the template again (a full disk, a VMM killed meanwhile: causes that may pass).
const TEMPLATE_RETRY: Duration = Duration::from_secs(600);

/// What makes a booted VM usable for a session: everything fixed at launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PoolKey {
    pub version: String,
    pub kernel: PathBuf,
    pub rootfs: Option<PathBuf>,
    pub backend: BackendKind,
    pub cpus: u32,
    pub memory_mib: u32,
    pub disk_size_mib: u64,
}

/// A booted VM waiting for a session.
pub(super) struct WarmVm {
    pub vm: Vm,
    pub key: PoolKey,
    /// Its session disk, in the pool's directory until a session takes it.
    pub disk: Option<PathBuf>,
}

#[derive(Default)]
struct State {
    ready: Vec<WarmVm>,
    booting: u32,
    /// The key the pool fills with, once resolved.
    key: Option<PoolKey>,
    target: u32,
    taken: u64,
    last_error: Option<String>,
}

/// The pool's snapshot: a VM of `key` booted and snapshotted right after its agent announced
/// itself. `dir` holds the snapshot (`snapshot/`) and the disk it expects (`disk.img`).
struct Template {
    key: PoolKey,
    dir: PathBuf,
}

impl Template {
    fn snapshot(&self) -> PathBuf {
        self.dir.join("snapshot")
    }

    fn disk(&self) -> PathBuf {
        self.dir.join("disk.img")
    }
}

#[derive(Default)]
enum TemplateSlot {
    #[default]
    None,
    Ready(Template),
    /// Taking or restoring the template failed for `key` at the instant: its VMs are booted
    /// until [`TEMPLATE_RETRY`] has passed (or the key changes).
    Failed(PoolKey, String, std::time::Instant),
}

impl TemplateSlot {
    fn key(&self) -> Option<&PoolKey> {
        match self {
            TemplateSlot::None => None,
            TemplateSlot::Ready(t) => Some(&t.key),
            TemplateSlot::Failed(k, _, _) => Some(k),
        }
    }

    /// Whether `key`'s VMs should come from a template (taking one if there is none): not while
    /// a failure for the same key is recent.
    fn worth_trying(&self, key: &PoolKey) -> bool {
        match self {
            TemplateSlot::Failed(k, _, at) => k != key || at.elapsed() >= TEMPLATE_RETRY,
            _ => true,
        }
    }

    /// Removes the template's files (a directory no VM uses: restores copy the disk and map
    /// the memory file privately, and a mapping outlives the file's name).
    fn clear(&mut self) {
        if let TemplateSlot::Ready(t) = std::mem::take(self) {
            let _ = std::fs::remove_dir_all(&t.dir);
        }
    }
}

pub(super) struct WarmPool {
    state: Mutex<State>,
    wake: Arc<Notify>,
    stop: CancellationToken,
    /// Where pooled VMs' disks wait (next to the sessions' storage, so a take is a rename).
    dir: Option<PathBuf>,
    next_disk: std::sync::atomic::AtomicU64,
    /// Only the refill task changes it (one boot at a time); status and shutdown read it.
    template: Mutex<TemplateSlot>,
}

impl WarmPool {
    /// A pool whose disks wait in `dir` (`None`: a manager without storage, which never pools).
    pub fn new(dir: Option<PathBuf>) -> Self {
        Self {
            state: Mutex::default(),
            wake: Arc::default(),
            stop: CancellationToken::new(),
            dir,
            next_disk: Default::default(),
            template: Mutex::default(),
        }
    }

    /// Starts the refill task (it ends with the manager, or at [`WarmPool::shutdown`]). Without
    /// a tokio runtime, or without storage, the pool stays empty.
    pub fn start(ctx: &Arc<Context>) {
        if ctx.pool.dir.is_none() || tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        if let Some(dir) = &ctx.pool.dir {
            // Disks left by a daemon that died are no session's: nothing in them is kept.
            let _ = std::fs::remove_dir_all(dir);
        }
        tokio::spawn(refill(Arc::downgrade(ctx)));
    }

    /// The configuration changed: the pool re-reads it.
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    pub fn status(&self) -> PoolStatus {
        let (restores, snapshot_error) = match &*self.template.lock().unwrap() {
            TemplateSlot::Ready(_) => (true, None),
            TemplateSlot::Failed(_, e, _) => (false, Some(e.clone())),
            TemplateSlot::None => (false, None),
        };
        let s = self.state.lock().unwrap();
        PoolStatus {
            restores,
            snapshot_error,
            target: s.target,
            ready: s.ready.len() as u32,
            booting: s.booting,
            bundle_version: s.key.as_ref().map(|k| k.version.clone()),
            backend: s.key.as_ref().map(|k| k.backend.name().to_string()),
            taken: s.taken,
            last_error: s.last_error.clone(),
        }
    }

    /// A ready VM for `key`, checked alive and answering, with its disk moved to `disk` (when
    /// the session has one: `disk` must not exist yet). `None` when the pool has none to give.
    pub async fn take(&self, key: &PoolKey, disk: Option<&Path>) -> Option<WarmVm> {
        if disk.is_some_and(|d| d.exists()) || disk.is_some() != (key.disk_size_mib > 0) {
            return None;
        }
        loop {
            let mut warm = {
                let mut s = self.state.lock().unwrap();
                let i = s.ready.iter().position(|w| &w.key == key)?;
                s.ready.remove(i)
            };
            self.wake.notify_one();
            let alive = warm.vm.check_alive().is_ok()
                && matches!(tokio::time::timeout(TAKE_PING, warm.vm.agent().ping()).await, Ok(Ok(_)));
            if !alive {
                tracing::warn!("a pooled VM no longer answered; it is replaced");
                discard(warm);
                continue;
            }
            if let (Some(from), Some(to)) = (&warm.disk, disk) {
                let moved = to.parent().map_or(Ok(()), std::fs::create_dir_all).and_then(|_| std::fs::rename(from, to));
                if let Err(e) = moved {
                    tracing::warn!("cannot move a pooled VM's disk to {}: {e}; booting instead", to.display());
                    discard(warm);
                    return None;
                }
                warm.disk = Some(to.to_path_buf());
            }
            self.state.lock().unwrap().taken += 1;
            return Some(warm);
        }
    }

    /// Kills every pooled VM and ends the refill task.
    pub fn shutdown(&self) {
        self.stop.cancel();
        let ready = std::mem::take(&mut self.state.lock().unwrap().ready);
        ready.into_iter().for_each(discard);
        self.template.lock().unwrap().clear();
    }
}

/// Removes a pooled VM's disk (no session ever wrote to it) and kills the VM. The disk goes
/// first: the VMM keeps its open descriptor, and whoever sees the VM gone finds no disk left.
fn discard(mut warm: WarmVm) {
    if let Some(disk) = warm.disk.take() {
        let _ = std::fs::remove_file(disk);
    }
    warm.vm.kill();
}

/// The key a start with `settings` would boot, why `auto` chose its backend, and the image (resolved
/// without promoting a warm download: that is a session start's to do).
async fn key_for(settings: &umbra_api::SessionSettings, ctx: &Context) -> Result<(PoolKey, String, BootImage), String> {
    let spec = settings.bundle.clone();
    let store = ctx.bundles.clone();
    let resolved = tokio::task::spawn_blocking(move || crate::image::resolve_with(&spec, &store, false))
        .await
        .map_err(|e| format!("bundle resolution panicked: {e}"))?
        .map_err(|e| e.to_string())?;
    let (backend, why) = select::choose(settings.backend, resolved.image.arch).map_err(|e| e.to_string())?;
    Ok((key_of(&resolved.image, backend, settings), why, resolved.image))
}

pub(super) fn key_of(image: &BootImage, backend: BackendKind, s: &umbra_api::SessionSettings) -> PoolKey {
    PoolKey {
        version: image.version.clone(),
        kernel: image.kernel.clone(),
        rootfs: image.rootfs.clone(),
        backend,
        cpus: s.cpus,
        memory_mib: s.memory_mib,
        disk_size_mib: s.disk_size_mib,
    }
}

/// The pool's task: keeps `pool_target()` VMs of the current key, one boot at a time.
async fn refill(ctx: Weak<Context>) {
    loop {
        let Some(c) = ctx.upgrade() else { return };
        if c.pool.stop.is_cancelled() {
            return;
        }
        let config = c.config();
        let wait = match step(&c, &config).await {
            Step::Again => None,
            Step::Idle => Some(PATROL),
            Step::Failed => Some(RETRY),
        };
        let Some(wait) = wait else { continue };
        // Hold no strong reference while waiting: the manager may go away meanwhile.
        let (stop, wake) = (c.pool.stop.clone(), c.pool.wake.clone());
        drop(c);
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = wake.notified() => {}
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

enum Step {
    /// Something changed: look again at once.
    Again,
    /// The pool is full (or off).
    Idle,
    /// A boot or the bundle failed: wait before trying again.
    Failed,
}

async fn step(ctx: &Arc<Context>, config: &DaemonConfig) -> Step {
    let pool = &ctx.pool;
    let target = config.pool_target();
    let want = if target == 0 {
        None
    } else {
        match key_for(&config.session, ctx).await {
            Ok(k) => Some(k),
            Err(e) => {
                let mut s = pool.state.lock().unwrap();
                (s.target, s.key) = (target, None);
                s.last_error = Some(format!("cannot resolve the pool's bundle: {e}"));
                let stale = std::mem::take(&mut s.ready);
                drop(s);
                stale.into_iter().for_each(discard);
                return Step::Failed;
            }
        }
    };
    // Keep what a start can still take, up to the target; drop the rest and the dead.
    let stale: Vec<WarmVm> = {
        let mut s = pool.state.lock().unwrap();
        s.target = target;
        s.key = want.as_ref().map(|(k, _, _)| k.clone());
        let mut stale = Vec::new();
        for mut w in std::mem::take(&mut s.ready) {
            let keep = s.key.as_ref() == Some(&w.key) && s.ready.len() < target as usize;
            if keep && w.vm.check_alive().is_ok() {
                s.ready.push(w);
            } else {
                stale.push(w);
            }
        }
        stale
    };
    stale.into_iter().for_each(discard);
    {
        let mut template = pool.template.lock().unwrap();
        if template.key() != want.as_ref().map(|(k, _, _)| k) {
            template.clear();
        }
    }
    let Some((key, _, image)) = want else { return Step::Idle };
    {
        let mut s = pool.state.lock().unwrap();
        if s.ready.len() as u32 + s.booting >= target {
            return Step::Idle;
        }
        s.booting += 1;
    }
    let booted = boot(ctx, &key, image, config).await;
    let mut s = pool.state.lock().unwrap();
    s.booting -= 1;
    match booted {
        Ok(warm) => {
            s.last_error = None;
            // The key may have moved on while this one booted: then it is stale at once.
            if s.key.as_ref() == Some(&warm.key) && !pool.stop.is_cancelled() {
                s.ready.push(warm);
            } else {
                drop(s);
                discard(warm);
            }
            Step::Again
        }
        Err(e) => {
            tracing::warn!("the warm pool could not boot a VM: {e}");
            s.last_error = Some(e);
            Step::Failed
        }
    }
}

/// One VM of `key` for the pool: restored from the template where the backend can snapshot
/// (taking the template first if there is none yet), booted otherwise or when that fails.
async fn boot(ctx: &Arc<Context>, key: &PoolKey, image: BootImage, config: &DaemonConfig) -> Result<WarmVm, String> {
    let worth_trying = ctx.pool.template.lock().unwrap().worth_trying(key);
    if !(key.backend.can_snapshot() && worth_trying) {
        return boot_fresh(ctx, key, image, config).await;
    }
    let restored = match ensure_template(ctx, key, image.clone(), config).await {
        Ok(()) => restore(ctx, key, image.clone(), config).await,
        Err(e) => Err(format!("cannot take the pool's snapshot: {e}")),
    };
    match restored {
        Ok(warm) => Ok(warm),
        Err(e) => {
            tracing::warn!("the warm pool boots its VMs instead of restoring them: {e}");
            {
                let mut template = ctx.pool.template.lock().unwrap();
                template.clear();
                *template = TemplateSlot::Failed(key.clone(), e, std::time::Instant::now());
            }
            boot_fresh(ctx, key, image, config).await
        }
    }
}

/// Takes the template for `key` unless it exists: boots a VM, then snapshots it at once.
async fn ensure_template(
    ctx: &Arc<Context>,
    key: &PoolKey,
    image: BootImage,
    config: &DaemonConfig,
) -> Result<(), String> {
    if matches!(&*ctx.pool.template.lock().unwrap(), TemplateSlot::Ready(t) if &t.key == key) {
        return Ok(());
    }
    let pool_dir = ctx.pool.dir.as_ref().ok_or("the pool has no directory")?;
    let n = ctx.pool.next_disk.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let template = Template { key: key.clone(), dir: pool_dir.join(format!("template-{n}")) };
    std::fs::create_dir_all(&template.dir).map_err(|e| format!("create {}: {e}", template.dir.display()))?;
    let taken = async {
        let disk = match key.disk_size_mib {
            0 => None,
            _ => Some(new_disk(template.disk(), key.disk_size_mib).await?),
        };
        let mut vm = launch(ctx, key, image, config, disk, None).await?.vm;
        let taken = vm.snapshot(&template.snapshot()).await.map_err(|e| e.to_string())?;
        tracing::info!(
            "the warm pool's snapshot: {} MiB of memory in {} ms",
            taken.memory_bytes >> 20,
            taken.took.as_millis()
        );
        Ok::<(), String>(())
    }
    .await;
    match taken {
        Ok(()) if ctx.pool.stop.is_cancelled() => {
            // The pool shut down meanwhile: nothing will restore from it or remove it later.
            let _ = std::fs::remove_dir_all(&template.dir);
            Err("the pool is shutting down".into())
        }
        Ok(()) => {
            let mut slot = ctx.pool.template.lock().unwrap();
            slot.clear();
            *slot = TemplateSlot::Ready(template);
            Ok(())
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&template.dir);
            Err(e)
        }
    }
}

/// Restores one VM from the template, on a sparse copy of the template's disk.
async fn restore(ctx: &Arc<Context>, key: &PoolKey, image: BootImage, config: &DaemonConfig) -> Result<WarmVm, String> {
    let (snapshot, template_disk) = match &*ctx.pool.template.lock().unwrap() {
        TemplateSlot::Ready(t) => (t.snapshot(), t.disk()),
        _ => return Err("the pool's snapshot is gone".into()),
    };
    let disk = match key.disk_size_mib {
        0 => None,
        _ => {
            let path = next_disk_path(ctx)?;
            let (from, to) = (template_disk, path.clone());
            tokio::task::spawn_blocking(move || crate::backend::disk::copy_sparse(&from, &to))
                .await
                .map_err(|e| format!("the disk copy panicked: {e}"))?
                .map_err(|e| e.to_string())?;
            Some(path)
        }
    };
    let restore = Restore { snapshot, hostname: super::incarnation::BOOT_HOSTNAME.into(), folders: Vec::new() };
    launch(ctx, key, image, config, disk, Some(restore)).await
}

/// Boots one VM of `key` for the pool, on a new disk.
async fn boot_fresh(
    ctx: &Arc<Context>,
    key: &PoolKey,
    image: BootImage,
    config: &DaemonConfig,
) -> Result<WarmVm, String> {
    let disk = match key.disk_size_mib {
        0 => None,
        size => Some(new_disk(next_disk_path(ctx)?, size).await?),
    };
    launch(ctx, key, image, config, disk, None).await
}

/// Creates an empty session disk of `size_mib` at `path`.
async fn new_disk(path: PathBuf, size_mib: u64) -> Result<PathBuf, String> {
    let p = path.clone();
    tokio::task::spawn_blocking(move || crate::backend::disk::ensure_session_disk(&p, size_mib << 20))
        .await
        .map_err(|e| format!("disk preparation panicked: {e}"))?
        .map_err(|e| e.to_string())?;
    Ok(path)
}

/// A new disk path in the pool's directory.
fn next_disk_path(ctx: &Context) -> Result<PathBuf, String> {
    let dir = ctx.pool.dir.as_ref().ok_or("the pool has no directory")?;
    std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let n = ctx.pool.next_disk.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Ok(dir.join(format!("disk-{n}.img")))
}

/// Launches (or restores) a VM of `key` on `disk` through a boot slot; the disk is removed if
/// the launch fails.
async fn launch(
    ctx: &Arc<Context>,
    key: &PoolKey,
    image: BootImage,
    config: &DaemonConfig,
    disk: Option<PathBuf>,
    restore: Option<Restore>,
) -> Result<WarmVm, String> {
    let slot = ctx.admission.enter(|_| {}).await;
    let mut spec = VmSpec::new(image);
    spec.cpus = key.cpus;
    spec.memory_mib = key.memory_mib;
    spec.boot_timeout = Duration::from_secs(config.boot_timeout_secs);
    spec.folder_sharing = true;
    spec.disk = disk.clone();
    spec.restore = restore;
    let launched = Vm::launch(key.backend, &spec).await;
    drop(slot);
    match launched {
        Ok(vm) => Ok(WarmVm { vm, key: key.clone(), disk }),
        Err(e) => {
            if let Some(d) = disk {
                let _ = std::fs::remove_file(d);
            }
            Err(e.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn key(memory_mib: u32) -> PoolKey {
        PoolKey {
            version: "v1".into(),
            kernel: "/k".into(),
            rootfs: None,
            backend: BackendKind::Kvm,
            cpus: 1,
            memory_mib,
            disk_size_mib: 0,
        }
    }

    #[test]
    fn a_failed_template_is_retried_after_a_while_or_for_another_key() {
        assert!(TemplateSlot::None.worth_trying(&key(256)));
        let recent = TemplateSlot::Failed(key(256), "disk full".into(), Instant::now());
        assert!(!recent.worth_trying(&key(256)), "a recent failure: boot instead");
        assert!(recent.worth_trying(&key(512)), "another key gets its own template");
        let ready = TemplateSlot::Ready(Template { key: key(256), dir: "/nowhere".into() });
        assert!(ready.worth_trying(&key(256)));
        let Some(long_ago) = Instant::now().checked_sub(TEMPLATE_RETRY + Duration::from_secs(1)) else {
            return; // a host up for less than TEMPLATE_RETRY cannot express the instant
        };
        let old = TemplateSlot::Failed(key(256), "disk full".into(), long_ago);
        assert!(old.worth_trying(&key(256)), "tried again after TEMPLATE_RETRY");
    }
}
