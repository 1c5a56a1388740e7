//! What every handler module uses: the [`Outcome`] a handler returns, [`call`] (decode params,
//! run, encode the result) and the lookups of a session and of a client's own process. A leaf:
//! it imports no handler and no router.

use std::future::Future;
use std::sync::Arc;

use serde_json::Value;
use umbra_api::methods::Method;
use umbra_api::rpc::decode_params;
use umbra_api::{ApiError, ErrorCode};
use umbra_runtime::session::Session;

use crate::client::Connection;
use crate::owned::Owned;

/// A handler's result, and work to do once the response is queued.
pub struct Outcome {
    pub result: Result<Value, ApiError>,
    pub after: Option<Box<dyn FnOnce() + Send>>,
}

impl From<Result<Value, ApiError>> for Outcome {
    fn from(result: Result<Value, ApiError>) -> Self {
        Self { result, after: None }
    }
}

/// Decodes `params` for method `M`, runs `f`, encodes its result.
pub async fn call<M, F, Fut>(params: Option<Value>, f: F) -> Outcome
where
    M: Method,
    F: FnOnce(M::Params) -> Fut,
    Fut: Future<Output = Result<M::Result, ApiError>>,
{
    let result = match decode_params::<M::Params>(params) {
        Ok(p) => f(p).await.map(|r| serde_json::to_value(r).expect("results serialize")),
        Err(e) => Err(e),
    };
    result.into()
}

/// A session, marked as used now (its idle timer restarts).
pub fn session(conn: &Connection, name: &str) -> Result<Arc<Session>, ApiError> {
    let s = conn.daemon.manager.get(name)?;
    s.touch();
    Ok(s)
}

/// A process this client spawned in `session`; another client's processes are not found.
pub fn owned(conn: &Connection, session: &str, process: u64) -> Result<Arc<Owned>, ApiError> {
    let p = conn.processes.lock().unwrap().get(&process).cloned();
    match p {
        Some(p) if p.session == session => Ok(p),
        _ => Err(ApiError::new(
            ErrorCode::NotFound,
            format!("process {process} of session {session:?} is not running (or was not spawned by this client)"),
        )),
    }
}
