//! Method name → handler module, by the method's namespace (the part before the first `.`),
//! the way Cloud Hypervisor routes each request to its `ApiAction`. The handlers live in
//! `handlers/`, one module per namespace; this file only routes, and answers
//! `method_not_found` for any name no module claims. Nothing under `handlers/` imports it.

use std::sync::Arc;

use serde_json::Value;
use umbra_api::{ApiError, ErrorCode};

use crate::client::Connection;
use crate::handlers::{bundle, daemon, events, files, lsp, process, session, shadow};

// What the connection's loops need besides `dispatch`: the handlers' result, and the methods
// its reader applies itself, in arrival order.
pub use crate::handlers::common::Outcome;
pub use crate::handlers::process::{is_ordered, ordered};

pub async fn dispatch(conn: &Arc<Connection>, method: &str, params: Option<Value>) -> Outcome {
    let namespace = method.split_once('.').map_or(method, |(namespace, _)| namespace);
    let handled = match namespace {
        "daemon" | "config" | "pool" => daemon::handle(conn, method, params).await,
        "bundle" => bundle::handle(conn, method, params).await,
        "session" | "permission" => session::handle(conn, method, params).await,
        "process" | "terminal" => process::handle(conn, method, params).await,
        "folder" | "file" => files::handle(conn, method, params).await,
        "shadow" => shadow::handle(conn, method, params).await,
        "lsp" | "diagnostics" => lsp::handle(conn, method, params).await,
        "events" => events::handle(conn, method, params).await,
        _ => None,
    };
    handled.unwrap_or_else(|| {
        Outcome::from(Err(ApiError::new(
            ErrorCode::MethodNotFound,
            format!("no method {method:?} (see `daemon.info`'s api_version and docs/ipc.md)"),
        )))
    })
}

#[cfg(test)]
mod tests {
    use umbra_runtime::session::{ManagerOptions, SessionManager};

    use super::*;
    use crate::state::{Daemon, ServerOptions};

    /// A client of a daemon that keeps nothing and boots nothing.
    fn connection(dir: &std::path::Path) -> Arc<Connection> {
        let manager = SessionManager::new(ManagerOptions {
            config: Default::default(),
            state_dir: None,
            storage_root: None,
            bundles: umbra_bundle::Store::new(dir.join("bundles")),
        });
        let options = ServerOptions {
            socket: dir.join("umbrad.sock"),
            allow_root: false,
            max_clients: 1,
            max_request_bytes: 1024,
            config_path: dir.join("umbrad.json"),
            allow_http_loopback: false,
        };
        let (out, _) = tokio::sync::mpsc::channel(1);
        Arc::new(Connection::new(Arc::new(Daemon::new(manager, options)), out))
    }

    #[tokio::test]
    async fn every_method_reaches_its_handler_and_no_other_name_does() {
        let dir = tempfile::tempdir().unwrap();
        let conn = connection(dir.path());
        // Two positional params fail every method's decoding, before it does anything.
        let two = || Some(serde_json::json!([{}, {}]));
        for &method in umbra_api::methods::NAMES {
            let e = dispatch(&conn, method, two()).await.result.expect_err(method);
            let (code, message) = if is_ordered(method) {
                (ErrorCode::Internal, format!("{method} is applied in order by the reader"))
            } else {
                (ErrorCode::InvalidParams, "positional params take exactly one object".to_string())
            };
            assert_eq!((e.code, e.message), (code, message), "{method}");
        }
        for method in ["", ".", "daemon", "daemon.", "daemon.nope", "permission.request", "nope.info", "process"] {
            let e = dispatch(&conn, method, two()).await.result.expect_err(method);
            assert_eq!(e.code, ErrorCode::MethodNotFound, "{method}");
            assert_eq!(e.message, format!("no method {method:?} (see `daemon.info`'s api_version and docs/ipc.md)"));
        }
    }
}
