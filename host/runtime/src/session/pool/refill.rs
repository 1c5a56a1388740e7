//! The pool's refill task: keeps `pool_target()` VMs of the daemon's session defaults, one
//! launch at a time through the same pipeline a session start uses ([`crate::session::launch`]),
//! restoring them from a template snapshot where the backend can.

use std::path::PathBuf;
use std::sync::{Arc, Weak};
use std::time::Duration;

use umbra_api::DaemonConfig;

use super::{discard, key_of, PoolKey, Template, TemplateSlot, WarmVm, PATROL, RETRY};
use crate::backend::Restore;
use crate::session::context::Context;
use crate::session::launch::{Bundle, Disk, LaunchError, Prepared, BOOT_HOSTNAME};

/// Starts the refill task (it ends with the manager, or at [`super::WarmPool::shutdown`]). Without
/// a tokio runtime, or without storage, the pool stays empty.
pub(in crate::session) fn start(ctx: &Arc<Context>) {
    if ctx.pool.dir.is_none() || tokio::runtime::Handle::try_current().is_err() {
        return;
    }
    if let Some(dir) = &ctx.pool.dir {
        // Disks left by a daemon that died are no session's: nothing in them is kept.
        let _ = std::fs::remove_dir_all(dir);
    }
    tokio::spawn(refill(Arc::downgrade(ctx)));
}

/// The key a start with `settings` would boot and the VM prepared for it (the bundle resolved
/// without promoting a warm download: that is a session start's to do).
async fn key_for(settings: &umbra_api::SessionSettings, ctx: &Context) -> Result<(PoolKey, Prepared), LaunchError> {
    let bundle = Bundle::Spec { spec: &settings.bundle, promote: false };
    let prepared = Prepared::new(bundle, &ctx.bundles, settings.backend, false).await?;
    Ok((key_of(&prepared.image, prepared.backend, settings), prepared))
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
        s.key = want.as_ref().map(|(k, _)| k.clone());
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
        if template.key() != want.as_ref().map(|(k, _)| k) {
            template.clear();
        }
    }
    let Some((key, prepared)) = want else { return Step::Idle };
    {
        let mut s = pool.state.lock().unwrap();
        if s.ready.len() as u32 + s.booting >= target {
            return Step::Idle;
        }
        s.booting += 1;
    }
    let booted = boot(ctx, &key, prepared, config).await;
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

/// Why the pool could not make a VM (kept as text in `pool.status`).
#[derive(Debug, thiserror::Error)]
enum PoolError {
    #[error(transparent)]
    Launch(#[from] LaunchError),
    #[error("cannot snapshot the template VM: {0}")]
    Snapshot(#[source] crate::backend::VmError),
    #[error("cannot create {path}: {source}")]
    Create { path: PathBuf, source: std::io::Error },
    #[error("the pool has no directory")]
    NoDirectory,
    #[error("the pool's snapshot is gone")]
    TemplateGone,
    #[error("the pool is shutting down")]
    ShuttingDown,
}

/// One VM of `key` for the pool: restored from the template where the backend can snapshot
/// (taking the template first if there is none yet), booted otherwise or when that fails.
async fn boot(ctx: &Arc<Context>, key: &PoolKey, vm: Prepared, config: &DaemonConfig) -> Result<WarmVm, String> {
    let vm = vm.size(key.cpus, key.memory_mib, Duration::from_secs(config.boot_timeout_secs)).folder_sharing(true);
    let worth_trying = ctx.pool.template.lock().unwrap().worth_trying(key);
    if !(key.backend.capabilities().snapshot && worth_trying) {
        return boot_fresh(ctx, key, vm).await.map_err(|e| e.to_string());
    }
    let restored = match ensure_template(ctx, key, vm.clone()).await {
        Ok(()) => restore(ctx, key, vm.clone()).await.map_err(|e| e.to_string()),
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
            boot_fresh(ctx, key, vm).await.map_err(|e| e.to_string())
        }
    }
}

/// Takes the template for `key` unless it exists: boots a VM, then snapshots it at once.
async fn ensure_template(ctx: &Arc<Context>, key: &PoolKey, vm: Prepared) -> Result<(), PoolError> {
    if matches!(&*ctx.pool.template.lock().unwrap(), TemplateSlot::Ready(t) if &t.key == key) {
        return Ok(());
    }
    let pool_dir = ctx.pool.dir.as_ref().ok_or(PoolError::NoDirectory)?;
    let n = ctx.pool.next_disk.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let template = Template { key: key.clone(), dir: pool_dir.join(format!("template-{n}")) };
    std::fs::create_dir_all(&template.dir)
        .map_err(|source| PoolError::Create { path: template.dir.clone(), source })?;
    let taken = async {
        let disk = match key.disk_size_mib {
            0 => Disk::None,
            size_mib => Disk::Fresh { path: template.disk(), size_mib },
        };
        let mut vm = launch(ctx, key, vm, disk, None).await?.vm;
        let taken = vm.snapshot(&template.snapshot()).await.map_err(PoolError::Snapshot)?;
        tracing::info!(
            "the warm pool's snapshot: {} MiB of memory in {} ms",
            taken.memory_bytes >> 20,
            taken.took.as_millis()
        );
        Ok::<(), PoolError>(())
    }
    .await;
    match taken {
        Ok(()) if ctx.pool.stop.is_cancelled() => {
            // The pool shut down meanwhile: nothing will restore from it or remove it later.
            let _ = std::fs::remove_dir_all(&template.dir);
            Err(PoolError::ShuttingDown)
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
async fn restore(ctx: &Arc<Context>, key: &PoolKey, vm: Prepared) -> Result<WarmVm, PoolError> {
    let (snapshot, template_disk) = match &*ctx.pool.template.lock().unwrap() {
        TemplateSlot::Ready(t) => (t.snapshot(), t.disk()),
        _ => return Err(PoolError::TemplateGone),
    };
    let disk = match key.disk_size_mib {
        0 => Disk::None,
        _ => Disk::CopyOf { from: template_disk, to: next_disk_path(ctx)? },
    };
    let restore = Restore { snapshot, hostname: BOOT_HOSTNAME.into(), folders: Vec::new() };
    launch(ctx, key, vm, disk, Some(restore)).await
}

/// Boots one VM of `key` for the pool, on a new disk.
async fn boot_fresh(ctx: &Arc<Context>, key: &PoolKey, vm: Prepared) -> Result<WarmVm, PoolError> {
    let disk = match key.disk_size_mib {
        0 => Disk::None,
        size_mib => Disk::Fresh { path: next_disk_path(ctx)?, size_mib },
    };
    launch(ctx, key, vm, disk, None).await
}

/// A new disk path in the pool's directory.
fn next_disk_path(ctx: &Context) -> Result<PathBuf, PoolError> {
    let dir = ctx.pool.dir.as_ref().ok_or(PoolError::NoDirectory)?;
    std::fs::create_dir_all(dir).map_err(|source| PoolError::Create { path: dir.clone(), source })?;
    let n = ctx.pool.next_disk.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Ok(dir.join(format!("disk-{n}.img")))
}

/// Launches (or restores) a VM of `key` on `disk`, which is removed if the launch fails.
async fn launch(
    ctx: &Arc<Context>,
    key: &PoolKey,
    vm: Prepared,
    disk: Disk,
    restore: Option<Restore>,
) -> Result<WarmVm, PoolError> {
    let path = match &disk {
        Disk::None => None,
        Disk::Fresh { path, .. } | Disk::CopyOf { to: path, .. } => Some(path.clone()),
    };
    match vm.launch(&ctx.admission, |_| {}, disk, restore).await {
        Ok(vm) => Ok(WarmVm { vm, key: key.clone(), disk: path }),
        Err(e) => {
            if let Some(d) = path {
                let _ = std::fs::remove_file(d);
            }
            Err(e.into())
        }
    }
}
