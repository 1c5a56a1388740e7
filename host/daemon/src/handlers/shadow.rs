//! `shadow.*`: a shadowed folder's changes, seen as a diff, applied to the host, exported as a
//! tarball or thrown away.

use std::path::PathBuf;
use std::sync::Arc;

use serde_json::Value;
use umbra_api::methods::{Done, Exported, Method, ShadowApply, ShadowDiff, ShadowExport, ShadowReset};
use umbra_api::{ApiError, ErrorCode};
use umbra_runtime::session::Session;

use super::common::{call, session, Outcome};
use crate::client::Connection;

/// Handles this module's methods; `None` for any other.
pub async fn handle(conn: &Arc<Connection>, method: &str, params: Option<Value>) -> Option<Outcome> {
    Some(match method {
        ShadowDiff::NAME => {
            call::<ShadowDiff, _, _>(
                params,
                |p| async move { Ok(session(conn, &p.session)?.shadow_diff(&p.folder).await?) },
            )
            .await
        }
        ShadowApply::NAME => {
            call::<ShadowApply, _, _>(params, |p| async move {
                let s = session(conn, &p.session)?;
                Ok(s.shadow_apply(&p.folder, p.changeset.as_deref(), p.paths.as_deref()).await?)
            })
            .await
        }
        ShadowExport::NAME => {
            call::<ShadowExport, _, _>(params, |p| async move {
                let s = session(conn, &p.session)?;
                let dest = match p.dest {
                    Some(d) if d.is_absolute() => d,
                    Some(d) => return Err(ApiError::invalid_params(format!("dest {} is not absolute", d.display()))),
                    None => default_export_path(&s, &p.folder)?,
                };
                let bytes = s.shadow_export(&p.folder, &dest).await?;
                Ok(Exported { path: dest, bytes })
            })
            .await
        }
        ShadowReset::NAME => {
            call::<ShadowReset, _, _>(params, |p| async move {
                session(conn, &p.session)?.shadow_reset(&p.folder).await?;
                Ok(Done {})
            })
            .await
        }
        _ => return None,
    })
}

/// `<storage>/shadow-exports/<folder>-<ms>.tar`, for an export without `dest`.
fn default_export_path(s: &Session, folder: &str) -> Result<PathBuf, ApiError> {
    let dir = s
        .storage_dir()
        .ok_or_else(|| ApiError::new(ErrorCode::Unsupported, "this session has no storage; pass dest"))?
        .join("shadow-exports");
    std::fs::create_dir_all(&dir)
        .map_err(|e| ApiError::new(ErrorCode::Io, format!("cannot create {}: {e}", dir.display())))?;
    Ok(dir.join(format!("{folder}-{}.tar", umbra_api::event::now_ms())))
}
