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
    /// The machine's system policy (`umbra_api::system`), when it has one.
    pub system: RwLock<Option<umbra_api::system::SystemPolicyInfo>>,
    next_process: AtomicU64,
    /// The egress proxy's upstream TLS trust, made when first needed and again when the
    /// configuration's `trust_ca` changes.
    upstream: std::sync::Mutex<Option<(Vec<PathBuf>, crate::egress::Upstream)>>,
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
            upstream: Default::default(),
            system: RwLock::new(None),
        }
    }

    /// The system policy's ceilings, if the machine has one.
    pub fn system(&self) -> Option<umbra_api::system::SystemPolicy> {
        self.system.read().unwrap().as_ref().map(|s| s.policy.clone())
    }

    /// Refuses when the system policy turns sessions off.
    pub fn check_enabled(&self) -> Result<(), super::error::SessionError> {
        match &*self.system.read().unwrap() {
            Some(s) if !s.policy.enabled => {
                Err(super::error::SessionError::DisabledByAdmin(s.path.display().to_string()))
            }
            _ => Ok(()),
        }
    }

    /// `settings` held to the system policy's ceilings (see `SystemPolicy::cap`).
    pub fn cap(&self, settings: &mut umbra_api::SessionSettings) {
        if let Some(system) = self.system() {
            for lowered in system.cap(settings) {
                tracing::info!("{lowered}");
            }
        }
    }

    /// Whether the system policy lets `folder` (canonical) be shared.
    pub fn check_folder(&self, folder: &std::path::Path) -> Result<(), super::error::SessionError> {
        match self.system() {
            Some(system) => system.check_folder(folder).map_err(super::error::SessionError::SystemPolicy),
            None => Ok(()),
        }
    }

    /// Whether the system policy lets a session boot `bundle` (a setting's value): a bundle
    /// directory must be beneath a listed one; versions, `current` and flavors always may.
    pub fn check_bundle(&self, bundle: &str) -> Result<(), super::error::SessionError> {
        let Some(system) = self.system() else { return Ok(()) };
        if !bundle.contains('/') {
            return Ok(());
        }
        let path = std::path::Path::new(bundle);
        let shown = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
        system.check_bundle_source(&shown.to_string_lossy()).map_err(super::error::SessionError::SystemPolicy)
    }

    /// The company proxy guest connections go out through: the configuration's, else this
    /// process's `HTTPS_PROXY`/`HTTP_PROXY` (with `NO_PROXY`); none when neither is set.
    pub fn upstream_proxy(&self) -> Result<Option<crate::egress::UpstreamProxy>, String> {
        let config = self.config();
        let no_proxy = |from_env: Option<String>| match &config.no_proxy {
            Some(list) => list.join(","),
            None => from_env.unwrap_or_default(),
        };
        let env = |k: &str| std::env::var(k).ok().or_else(|| std::env::var(k.to_ascii_lowercase()).ok());
        match &config.upstream_proxy {
            Some(url) => crate::egress::UpstreamProxy::parse(url, &no_proxy(env("NO_PROXY"))).map(Some),
            None => crate::egress::UpstreamProxy::from_env(|k| match k.eq_ignore_ascii_case("NO_PROXY") {
                true => Some(no_proxy(env("NO_PROXY"))),
                false => std::env::var(k).ok(),
            })
            .transpose(),
        }
    }

    /// How the egress proxy verifies the hosts it reads requests for: the host's trust store
    /// and the configuration's `trust_ca` files.
    pub fn upstream(&self) -> Result<crate::egress::Upstream, String> {
        let files = self.config().trust_ca;
        let mut cached = self.upstream.lock().unwrap();
        if let Some((for_files, upstream)) = cached.as_ref() {
            if *for_files == files {
                return Ok(upstream.clone());
            }
        }
        let mut extra = Vec::new();
        for f in &files {
            let pem = std::fs::read_to_string(f).map_err(|e| format!("trust_ca {}: {e}", f.display()))?;
            extra.push((f.display().to_string(), pem));
        }
        let upstream = crate::egress::Upstream::new(&extra).map_err(|e| e.to_string())?;
        *cached = Some((files, upstream.clone()));
        Ok(upstream)
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
