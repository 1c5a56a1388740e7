//! Bundles through the daemon: status, downloads with progress events, reinstall, and the
//! background download into the warm slot (`auto_download`).

use std::sync::Arc;

use umbra_api::methods::{BundleStatus, Downloaded};
use umbra_api::{ApiError, ErrorCode, EventKind, SessionEvent};
use umbra_bundle::{Progress, PullOptions};

use crate::state::Daemon;

pub fn status(daemon: &Daemon) -> BundleStatus {
    let store = daemon.manager.bundles();
    BundleStatus {
        current: store.current(),
        installed: store.list(),
        downloading: daemon.downloads.lock().unwrap().values().cloned().collect(),
        url: daemon.manager.config().bundle_url,
        root: store.root().to_path_buf(),
    }
}

/// Downloads, verifies and installs the bundle at `url` (default: the configured one),
/// reporting progress as `download_progress` events. With `reinstall`, the current version
/// is downloaded again from scratch; it stays in place until the new copy is verified.
pub async fn download(
    daemon: Arc<Daemon>,
    url: Option<String>,
    warm: bool,
    reinstall: bool,
) -> Result<Downloaded, ApiError> {
    let url = url.or_else(|| daemon.manager.config().bundle_url).ok_or_else(|| {
        ApiError::invalid_params("no url given and no bundle_url configured (config.set {\"bundle_url\": …})")
    })?;
    let system = daemon.manager.system_policy();
    if let Some(system) = &system {
        system.policy.check_bundle_source(&url).map_err(|e| ApiError::new(ErrorCode::PermissionDenied, e))?;
    }
    // Read at each download: a key file added to the trusted-keys directory counts at once.
    let trust = umbra_runtime::bundle_trust::trust(
        system.as_ref().map(|s| &s.policy),
        &daemon.manager.config().trusted_keys,
        &[],
        &umbra_api::paths::trusted_keys_dir(),
        daemon.options.allow_http_loopback,
    )
    .map_err(|e| ApiError::new(ErrorCode::BundleError, e.to_string()))?;
    let sources = umbra_runtime::bundle_trust::sources(system.as_ref().map(|s| &s.policy));
    let worker = daemon.clone();
    let key = url.clone();
    let pulled = tokio::task::spawn_blocking(move || {
        let store = worker.manager.bundles().clone();
        let opts = PullOptions { warm, reinstall, trust, sources, ..PullOptions::default() };
        let mut progress = |p: &Progress| {
            worker.downloads.lock().unwrap().insert(key.clone(), p.clone());
            worker.manager.emit(SessionEvent::new(None, EventKind::DownloadProgress(p.clone())));
        };
        let result = store.pull(&url, &opts, &mut progress);
        worker.downloads.lock().unwrap().remove(&key);
        result
    })
    .await
    .map_err(|e| ApiError::internal(format!("the download task failed: {e}")))?
    .map_err(|e| ApiError::new(ErrorCode::BundleError, e.to_string()))?;
    Ok(Downloaded {
        version: pulled.bundle.manifest.bundle_version.clone(),
        how: pulled.how,
        downloaded: pulled.downloaded,
    })
}

/// Starts a download of the configured URL into the warm slot, if one is configured and
/// `auto_download` is on; failures are logged (and were reported as events).
pub fn warm_in_background(daemon: Arc<Daemon>) {
    let config = daemon.manager.config();
    let (true, Some(url)) = (config.auto_download, config.bundle_url) else { return };
    tokio::spawn(async move {
        tracing::info!("downloading {url} into the warm slot");
        match download(daemon.clone(), Some(url.clone()), true, false).await {
            Ok(d) => tracing::info!("bundle {} is warm ({:?})", d.version, d.how),
            Err(e) => tracing::warn!("background download of {url} failed: {e}"),
        }
    });
}
