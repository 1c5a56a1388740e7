//! What every session of one manager shares: the event bus, boot admission, where records and
//! storage live, the bundle store and the configuration.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use umbra_api::DaemonConfig;

use super::admission::Admission;
use super::events::EventBus;
use super::store::RecordStore;

pub(super) struct Context {
    pub bus: Arc<EventBus>,
    pub admission: Admission,
    pub records: RecordStore,
    pub config: RwLock<DaemonConfig>,
    /// `<data_dir>/sessions/<name>` holds each session's outputs, uploads and disk; `None`
    /// gives sessions no storage of their own (`vmctl run`).
    pub storage_root: Option<PathBuf>,
    pub bundles: umbra_bundle::Store,
    pub approvals: super::approval::Approvals,
    pub pool: super::pool::WarmPool,
    next_process: AtomicU64,
}

impl Context {
    pub fn new(
        bus: Arc<EventBus>,
        admission: Admission,
        records: RecordStore,
        config: DaemonConfig,
        storage_root: Option<PathBuf>,
        bundles: umbra_bundle::Store,
    ) -> Self {
        Self {
            bus,
            admission,
            records,
            config: RwLock::new(config),
            storage_root: storage_root.clone(),
            bundles,
            approvals: Default::default(),
            // Beside the sessions' storage (`<data_dir>/pool`): a take renames a disk across.
            pool: super::pool::WarmPool::new(storage_root.as_ref().map(|r| r.with_file_name("pool"))),
            next_process: AtomicU64::new(1),
        }
    }

    pub fn config(&self) -> DaemonConfig {
        self.config.read().unwrap().clone()
    }

    /// A process id unique within this manager.
    pub fn next_process_id(&self) -> u64 {
        self.next_process.fetch_add(1, Ordering::Relaxed)
    }

    pub fn storage_dir(&self, session: &str) -> Option<PathBuf> {
        self.storage_root.as_ref().map(|root| root.join(session))
    }
}
