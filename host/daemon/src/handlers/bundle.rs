//! `bundle.*`: the installed bundles and downloads (the work itself is in `bundles.rs`).

use std::sync::Arc;

use serde_json::Value;
use umbra_api::methods::{BundleDeleteAndReinstall, BundleDownload, BundleStatusMethod, Method};

use super::common::{call, Outcome};
use crate::client::Connection;

/// Handles this module's methods; `None` for any other.
pub async fn handle(conn: &Arc<Connection>, method: &str, params: Option<Value>) -> Option<Outcome> {
    let daemon = &conn.daemon;
    Some(match method {
        BundleStatusMethod::NAME => {
            call::<BundleStatusMethod, _, _>(params, |_| async { Ok(crate::bundles::status(daemon)) }).await
        }
        BundleDownload::NAME => {
            call::<BundleDownload, _, _>(params, |p| crate::bundles::download(daemon.clone(), p.url, p.warm, false))
                .await
        }
        BundleDeleteAndReinstall::NAME => {
            call::<BundleDeleteAndReinstall, _, _>(params, |p| {
                crate::bundles::download(daemon.clone(), p.url, false, true)
            })
            .await
        }
        _ => return None,
    })
}
