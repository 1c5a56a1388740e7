//! `lsp.*` and `diagnostics.*`: language servers in a session's guest, and the diagnostics a
//! proposed change would bring (`docs/diagnostics.md`).

use std::sync::Arc;

use serde_json::Value;
use umbra_api::lsp::{LspList, LspResult};
use umbra_api::methods::{DiagnosticsForChange, Done, LspListMethod, LspNotify, LspRequest, LspStart, LspStop, Method};

use super::common::{call, session, Outcome};
use crate::client::Connection;

/// Handles this module's methods; `None` for any other.
pub async fn handle(conn: &Arc<Connection>, method: &str, params: Option<Value>) -> Option<Outcome> {
    Some(match method {
        LspStart::NAME => {
            call::<LspStart, _, _>(params, |p| async move { Ok(session(conn, &p.session)?.lsp_start(p).await?) }).await
        }
        LspRequest::NAME => {
            call::<LspRequest, _, _>(params, |p| async move {
                let s = session(conn, &p.session)?;
                Ok(LspResult { result: s.lsp_request(p.server, &p.method, p.params, p.timeout_ms).await? })
            })
            .await
        }
        LspNotify::NAME => {
            call::<LspNotify, _, _>(params, |p| async move {
                session(conn, &p.session)?.lsp_notify(p.server, &p.method, p.params).await?;
                Ok(Done {})
            })
            .await
        }
        LspStop::NAME => {
            call::<LspStop, _, _>(params, |p| async move {
                session(conn, &p.session)?.lsp_stop(p.server).await?;
                Ok(Done {})
            })
            .await
        }
        LspListMethod::NAME => {
            call::<LspListMethod, _, _>(params, |p| async move {
                Ok(LspList { servers: session(conn, &p.session)?.lsp_list() })
            })
            .await
        }
        DiagnosticsForChange::NAME => {
            call::<DiagnosticsForChange, _, _>(params, |p| async move {
                Ok(session(conn, &p.session)?.diagnostics_for_change(p).await?)
            })
            .await
        }
        _ => return None,
    })
}
