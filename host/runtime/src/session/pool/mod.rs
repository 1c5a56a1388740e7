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
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use umbra_api::methods::PoolStatus;

use crate::backend::{BackendKind, BootImage, Vm};

pub(super) mod refill;

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
pub(in crate::session) struct PoolKey {
    pub version: String,
    pub kernel: PathBuf,
    pub rootfs: Option<PathBuf>,
    pub backend: BackendKind,
    pub cpus: u32,
    pub memory_mib: u32,
    pub disk_size_mib: u64,
}

/// A booted VM waiting for a session.
pub(in crate::session) struct WarmVm {
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

pub(in crate::session) struct WarmPool {
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

/// The key a session with `settings` booting `image` on `backend` takes a pooled VM of.
pub(in crate::session) fn key_of(image: &BootImage, backend: BackendKind, s: &umbra_api::SessionSettings) -> PoolKey {
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
