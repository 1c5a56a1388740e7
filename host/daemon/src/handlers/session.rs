//! `session.*` and `permission.respond`: a session's lifecycle, its network policy, its logs,
//! and the answers to its spawns' permission requests.

use std::sync::Arc;

use serde_json::Value;
use umbra_api::methods::{
    Done, Method, PermissionRespond, SessionDelete, SessionExpose, SessionFork, SessionGet, SessionList,
    SessionListMethod, SessionLogs, SessionLogsMethod, SessionPorts, SessionResume, SessionSetNetwork,
    SessionSetSecret, SessionSnapshot, SessionStart, SessionStop, SessionUnexpose, SessionUpdate,
};

use super::common::{call, Outcome};
use crate::client::Connection;
use umbra_api::{ApiError, ErrorCode};

/// Handles this module's methods; `None` for any other.
pub async fn handle(conn: &Arc<Connection>, method: &str, params: Option<Value>) -> Option<Outcome> {
    let manager = &conn.daemon.manager;
    Some(match method {
        SessionStart::NAME => {
            call::<SessionStart, _, _>(params, |mut p| async move {
                if let Some(reference) = p.image.take() {
                    if p.settings.bundle.is_some() {
                        return Err(ApiError::invalid_params("give `image` or `bundle`, not both"));
                    }
                    p.settings.bundle = Some(crate::images::bundle_for(&conn.daemon, &reference).await?);
                }
                Ok(manager.start(p).await?.info())
            })
            .await
        }
        SessionResume::NAME => {
            call::<SessionResume, _, _>(params, |p| async move {
                Ok(manager.resume_with(&p.name, p.discard_snapshot).await?.info())
            })
            .await
        }
        SessionSnapshot::NAME => {
            call::<SessionSnapshot, _, _>(params, |p| async move { Ok(manager.snapshot(&p.name).await?.info()) }).await
        }
        SessionFork::NAME => {
            call::<SessionFork, _, _>(params, |p| async move { Ok(manager.fork(&p.source, &p.name).await?.info()) })
                .await
        }
        SessionStop::NAME => {
            call::<SessionStop, _, _>(params, |p| async move { Ok(manager.stop(&p.name).await?.info()) }).await
        }
        SessionDelete::NAME => {
            call::<SessionDelete, _, _>(params, |p| async move {
                manager.delete(&p.name).await?;
                Ok(Done {})
            })
            .await
        }
        SessionSetNetwork::NAME => {
            call::<SessionSetNetwork, _, _>(params, |p| async move {
                let s = manager.get(&p.name)?;
                s.set_network(p.network)?;
                Ok(s.info())
            })
            .await
        }
        SessionUpdate::NAME => {
            call::<SessionUpdate, _, _>(params, |p| async move {
                let s = manager.get(&p.name)?;
                let change = s.update(&p.settings, &manager.config().session)?;
                Ok(umbra_api::methods::Updated {
                    session: s.info(),
                    applied: change.applied,
                    next_boot: change.next_boot,
                })
            })
            .await
        }
        SessionSetSecret::NAME => {
            call::<SessionSetSecret, _, _>(params, |p| async move {
                let s = manager.get(&p.name)?;
                s.set_secret(&p.secret)?;
                Ok(s.info())
            })
            .await
        }
        SessionExpose::NAME => {
            call::<SessionExpose, _, _>(params, |p| async move { Ok(manager.get(&p.session)?.expose(&p.port).await?) })
                .await
        }
        SessionUnexpose::NAME => {
            call::<SessionUnexpose, _, _>(params, |p| async move {
                manager.get(&p.session)?.unexpose(p.guest_port).await?;
                Ok(Done {})
            })
            .await
        }
        SessionPorts::NAME => {
            call::<SessionPorts, _, _>(params, |p| async move {
                Ok(umbra_api::ports::PortList { ports: manager.get(&p.name)?.ports() })
            })
            .await
        }
        PermissionRespond::NAME => {
            call::<PermissionRespond, _, _>(params, |p| async move {
                let (approved, scope) = p.decision.map(|d| d.answer()).unwrap_or((p.approved, p.scope));
                let always = approved && scope == umbra_api::event::PermissionScope::Always;
                // Checked before the answer takes effect: a remember that cannot be kept fails whole.
                let config_approval = manager.config().session.approval;
                if p.remember && (!always || config_approval.is_none()) {
                    return Err(ApiError::invalid_params(
                        "remember needs allow_always and approval settings in umbrad's configuration \
                         (config.set {\"approval\": …})",
                    ));
                }
                let patterns = manager.respond_permission(&p.request_id, approved, scope)?;
                if let (true, Some(mut approval)) = (p.remember && !patterns.is_empty(), config_approval) {
                    for pattern in patterns {
                        if !approval.allow.contains(&pattern) {
                            approval.allow.push(pattern);
                        }
                    }
                    let patch = umbra_api::ConfigPatch {
                        session: umbra_api::session::SettingsPatch { approval: Some(approval), ..Default::default() },
                        ..Default::default()
                    };
                    let path = &conn.daemon.options.config_path;
                    manager.set_config(&patch, |next| {
                        crate::settings::save(path, next).map_err(|e| {
                            ApiError::new(ErrorCode::Io, format!("cannot save the settings to {}: {e}", path.display()))
                        })
                    })?;
                    crate::watch::changed(&conn.daemon, "configuration", path);
                }
                Ok(Done {})
            })
            .await
        }
        SessionListMethod::NAME => {
            call::<SessionListMethod, _, _>(params, |_| async { Ok(SessionList { sessions: manager.list() }) }).await
        }
        SessionGet::NAME => call::<SessionGet, _, _>(params, |p| async move { Ok(manager.get(&p.name)?.info()) }).await,
        SessionLogsMethod::NAME => {
            call::<SessionLogsMethod, _, _>(params, |p| async move {
                let n = p.lines.unwrap_or(100).clamp(1, 10_000) as usize;
                let s = manager.get(&p.name)?;
                let console = s.console_tail(n).await.lines().map(str::to_string).collect();
                Ok(SessionLogs { events: manager.recent_events(&p.name, n), console })
            })
            .await
        }
        _ => return None,
    })
}
