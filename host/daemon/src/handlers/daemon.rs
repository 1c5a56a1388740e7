//! `daemon.info`, `config.*` and `pool.status`: the daemon itself, its settings and its warm
//! pool.

use std::sync::Arc;

use serde_json::Value;
use umbra_api::methods::{ConfigGet, ConfigSet, DaemonInfo, DaemonInfoMethod, Method, PoolStatusMethod};
use umbra_api::{ApiError, ErrorCode};

use super::common::{call, Outcome};
use crate::client::Connection;

/// Handles this module's methods; `None` for any other.
pub async fn handle(conn: &Arc<Connection>, method: &str, params: Option<Value>) -> Option<Outcome> {
    let daemon = &conn.daemon;
    let manager = &daemon.manager;
    Some(match method {
        DaemonInfoMethod::NAME => {
            call::<DaemonInfoMethod, _, _>(params, |_| async {
                Ok(DaemonInfo {
                    version: env!("CARGO_PKG_VERSION").into(),
                    api_version: umbra_api::API_VERSION.into(),
                    pid: std::process::id(),
                    uid: daemon.uid,
                    socket: daemon.options.socket.clone(),
                    system_policy: manager.system_policy(),
                })
            })
            .await
        }
        ConfigGet::NAME => call::<ConfigGet, _, _>(params, |_| async { Ok(manager.config()) }).await,
        ConfigSet::NAME => {
            call::<ConfigSet, _, _>(params, |patch| async move {
                let path = &daemon.options.config_path;
                // Saved first: settings that took effect but vanish at the next start would lie.
                let config = manager.set_config(&patch, |next| {
                    crate::settings::save(path, next).map_err(|e| {
                        ApiError::new(ErrorCode::Io, format!("cannot save the settings to {}: {e}", path.display()))
                    })
                })?;
                crate::watch::changed(daemon, "configuration", path);
                if patch.auto_download == Some(true) || (patch.bundle_url.is_some() && config.auto_download) {
                    crate::bundles::warm_in_background(daemon.clone());
                }
                Ok(config)
            })
            .await
        }
        PoolStatusMethod::NAME => call::<PoolStatusMethod, _, _>(params, |_| async { Ok(manager.pool_status()) }).await,
        _ => return None,
    })
}
