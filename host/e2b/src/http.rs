//! The E2B endpoint on HTTP/1.1 (what both SDKs speak to a plain `http://` URL): the sandbox
//! REST API, authenticated by `X-API-KEY`, and envd's services for every sandbox on the same
//! port (the SDKs' `E2B_SANDBOX_URL`), routed by `E2b-Sandbox-Id` and authenticated by that
//! sandbox's `X-Access-Token`. Loopback only; a `Host` that is not a loopback name is refused
//! (DNS rebinding).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};

use crate::connect::{self, Body, ConnectError, MAX_MESSAGE};
use crate::fs;
use crate::process::{self, StreamHeaders};
use crate::sandboxes::{digest, E2b, RestFailure, Sandbox, State};
use crate::wire;

/// Connections served at once; more wait to be accepted.
const MAX_CONNECTIONS: usize = 256;
/// How long a connection may take to send a request's headers, idle time between requests
/// included (hyper's timer covers both). The SDKs keep idle connections in their pools and
/// reuse them for POSTs, which they do not retry: a server that closes sooner than a client
/// expects fails a call ("fetch failed" after 10 s idle). Loopback only, 256 slots at most.
const HEADER_PATIENCE: std::time::Duration = std::time::Duration::from_secs(300);
/// Largest REST body.
const MAX_REST_BODY: usize = 1 << 20;

/// Why the endpoint cannot listen there: loopback addresses only.
pub fn check_address(addr: &SocketAddr) -> Result<(), String> {
    match addr.ip().is_loopback() {
        true => Ok(()),
        false => Err(format!("the E2B endpoint listens on a loopback address only, not {}", addr.ip())),
    }
}

/// Serves the E2B API on `listener` until it fails. `api_key` is what `X-API-KEY` must be.
pub async fn serve(listener: tokio::net::TcpListener, e2b: Arc<E2b>, api_key: String) -> std::io::Result<()> {
    let key: Arc<[u8; 32]> = Arc::new(digest(api_key.as_bytes()));
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let slot = slots.clone().acquire_owned().await.expect("the semaphore is never closed");
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!("E2B endpoint: accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let (e2b, key) = (e2b.clone(), key.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let handler = hyper::service::service_fn(move |req: Request<Incoming>| {
                let (e2b, key) = (e2b.clone(), key.clone());
                async move { Ok::<_, Infallible>(handle(e2b, &key, req).await) }
            });
            // HTTP/1.1 only (what the SDKs speak to http://): the automatic version sniffing
            // waits for a first byte with no timeout, so idle sockets could hold every slot.
            let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new()).http1_only();
            builder.http1().timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(HEADER_PATIENCE);
            if let Err(e) = builder.serve_connection(TokioIo::new(stream), handler).await {
                tracing::debug!(%peer, "E2B connection ended: {e}");
            }
        });
    }
}

fn header<'a>(req: &'a Request<Incoming>, name: &str) -> Option<&'a str> {
    req.headers().get(name).and_then(|v| v.to_str().ok())
}

/// Whether `Host` names this machine's loopback (or is absent, as HTTP/1.0 allows).
fn loopback_host(host: Option<&str>) -> bool {
    let Some(host) = host else { return true };
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host, |(h, _)| h),
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn json_response(status: StatusCode, value: &impl serde::Serialize) -> Response<Body> {
    let mut r = Response::new(connect::full(serde_json::to_vec(value).expect("serializes")));
    *r.status_mut() = status;
    r.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    r
}

fn empty(status: StatusCode) -> Response<Body> {
    let mut r = Response::new(connect::full(Bytes::new()));
    *r.status_mut() = status;
    r
}

fn rest_error(f: &RestFailure) -> Response<Body> {
    json_response(f.status, &f.body())
}

async fn read_body(body: Incoming, limit: usize) -> Result<Bytes, String> {
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) => Err(format!("the request body could not be read (at most {limit} bytes): {e}")),
    }
}

/// The query's parameters, decoded as a form (`+` a space, `%XX` a byte).
fn query(req: &Request<Incoming>) -> BTreeMap<String, String> {
    form_urlencoded::parse(req.uri().query().unwrap_or_default().as_bytes()).into_owned().collect()
}

/// One query component decoded as a form value.
#[cfg(test)]
fn percent_decode(s: &str) -> String {
    form_urlencoded::parse(format!("x={}", s.replace('&', "%26")).as_bytes())
        .next()
        .map(|(_, v)| v.into_owned())
        .unwrap_or_default()
}

/// Reads what is left of a refused request's body (bounded), so the client, still sending
/// it, reads the refusal instead of a reset connection.
async fn refused(req: Request<Incoming>, response: Response<Body>) -> Response<Body> {
    let _ = read_body(req.into_body(), MAX_REST_BODY).await;
    response
}

async fn handle(e2b: Arc<E2b>, key: &[u8; 32], req: Request<Incoming>) -> Response<Body> {
    if !loopback_host(header(&req, "host")) {
        let response = json_response(
            StatusCode::FORBIDDEN,
            &wire::RestError { code: 403, message: "the E2B endpoint answers loopback hosts only".into() },
        );
        return refused(req, response).await;
    }
    let path = req.uri().path().to_string();
    if path.starts_with("/process.Process/")
        || path.starts_with("/filesystem.Filesystem/")
        || path == "/files"
        || path == "/health"
    {
        return envd(e2b, req, &path).await;
    }
    let authorized = header(&req, "x-api-key").is_some_and(|k| digest(k.trim().as_bytes()) == *key);
    if !authorized {
        let response = json_response(
            StatusCode::UNAUTHORIZED,
            &wire::RestError {
                code: 401,
                message: "umbrad's E2B endpoint needs X-API-KEY: the key in e2b.json beside umbrad's socket".into(),
            },
        );
        return refused(req, response).await;
    }
    rest(e2b, req, &path).await
}

async fn rest(e2b: Arc<E2b>, req: Request<Incoming>, path: &str) -> Response<Body> {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let method = req.method().clone();
    let q = query(&req);
    let body = match read_body(req.into_body(), MAX_REST_BODY).await {
        Ok(b) => b,
        Err(e) => return rest_error(&RestFailure::new(StatusCode::BAD_REQUEST, e)),
    };
    let parse = |b: &Bytes| -> Result<serde_json::Value, RestFailure> {
        if b.is_empty() {
            return Ok(serde_json::json!({}));
        }
        serde_json::from_slice(b)
            .map_err(|e| RestFailure::new(StatusCode::BAD_REQUEST, format!("a malformed body: {e}")))
    };
    let result: Result<Response<Body>, RestFailure> = async {
        match (&method, segments.as_slice()) {
            (&Method::POST, ["sandboxes"] | ["v2", "sandboxes"]) => {
                let new: wire::NewSandbox = serde_json::from_value(parse(&body)?)
                    .map_err(|e| RestFailure::new(StatusCode::BAD_REQUEST, format!("a malformed sandbox: {e}")))?;
                let (status, created) = detached(&e2b, |e2b| async move { e2b.create(new).await }).await?;
                Ok(json_response(status, &created))
            }
            (&Method::GET, ["sandboxes"] | ["v2", "sandboxes"]) => {
                let v1 = segments.len() == 1;
                let states: Vec<&str> = match q.get("state") {
                    Some(s) => s.split(',').map(str::trim).filter(|s| !s.is_empty()).collect(),
                    None if v1 => vec!["running"],
                    None => vec![],
                };
                let metadata = metadata_filter(q.get("metadata").map(String::as_str).unwrap_or_default());
                Ok(json_response(StatusCode::OK, &e2b.list(&states, &metadata)))
            }
            (&Method::GET, ["sandboxes", id]) => Ok(json_response(StatusCode::OK, &e2b.get(id)?)),
            (&Method::DELETE, ["sandboxes", id]) => {
                let id = id.to_string();
                detached(&e2b, |e2b| async move { e2b.kill(&id).await }).await.map(|()| empty(StatusCode::NO_CONTENT))
            }
            (&Method::POST, ["sandboxes", id, "timeout"]) => {
                let t: wire::SetTimeout = serde_json::from_value(parse(&body)?)
                    .map_err(|e| RestFailure::new(StatusCode::BAD_REQUEST, format!("a malformed timeout: {e}")))?;
                e2b.set_timeout(id, t.timeout).map(|()| empty(StatusCode::NO_CONTENT))
            }
            (&Method::POST, ["sandboxes", id, "pause"]) => {
                let owned = id.to_string();
                let paused = detached(&e2b, |e2b| async move { e2b.pause(&owned).await }).await?;
                match paused {
                    true => Ok(empty(StatusCode::NO_CONTENT)),
                    false => Err(RestFailure::new(StatusCode::CONFLICT, format!("sandbox {id:?} is already paused"))),
                }
            }
            (&Method::POST, ["v2", "sandboxes", id, "connect"] | ["sandboxes", id, "resume"] | ["sandboxes", id, "connect"]) => {
                let c: wire::ConnectSandbox = serde_json::from_value(parse(&body)?).unwrap_or_default();
                let id = id.to_string();
                let connected = detached(&e2b, |e2b| async move { e2b.connect_sandbox(&id, c.timeout).await }).await?;
                Ok(json_response(StatusCode::OK, &connected))
            }
            (&Method::POST, ["sandboxes", _, "refreshes"]) => Ok(empty(StatusCode::NO_CONTENT)),
            (_, ["sandboxes", _, rest @ ..] | ["v2", "sandboxes", _, rest @ ..]) if !rest.is_empty() => {
                Err(RestFailure::new(
                    StatusCode::NOT_IMPLEMENTED,
                    format!("{method} {path} is not supported by umbrad's E2B endpoint (see docs/e2b.md)"),
                ))
            }
            (_, ["templates", ..] | ["snapshots", ..] | ["teams", ..] | ["volumes", ..]) => Err(RestFailure::new(
                StatusCode::NOT_IMPLEMENTED,
                format!("{method} {path} is not supported by umbrad's E2B endpoint: templates are umbrad's bundles (see docs/e2b.md)"),
            )),
            _ => Err(RestFailure::new(StatusCode::NOT_FOUND, format!("no such endpoint: {method} {path}"))),
        }
    }
    .await;
    result.unwrap_or_else(|f| rest_error(&f))
}

/// Runs a lifecycle call to its end even if its client goes: a create whose caller gave up
/// half way still registers its sandbox (and its timeout ends it), never a VM nobody lists.
async fn detached<T, F>(e2b: &Arc<E2b>, call: impl FnOnce(Arc<E2b>) -> F) -> Result<T, RestFailure>
where
    T: Send + 'static,
    F: std::future::Future<Output = Result<T, RestFailure>> + Send + 'static,
{
    tokio::spawn(call(e2b.clone()))
        .await
        .unwrap_or_else(|e| Err(RestFailure::new(StatusCode::INTERNAL_SERVER_ERROR, format!("the call failed: {e}"))))
}

/// The list's `metadata` filter: `k=v&k2=v2`, each part percent-encoded once more.
fn metadata_filter(s: &str) -> BTreeMap<String, String> {
    form_urlencoded::parse(s.as_bytes()).into_owned().collect()
}

/// The server-stream methods: their errors go in the stream (see [`connect::stream_error`]).
fn is_stream(path: &str) -> bool {
    matches!(path, "/process.Process/Start" | "/process.Process/Connect" | "/filesystem.Filesystem/WatchDir")
}

async fn envd(e2b: Arc<E2b>, req: Request<Incoming>, path: &str) -> Response<Body> {
    let rpc = path != "/files" && path != "/health";
    let refuse = |status: StatusCode, code: &'static str, message: String| match (rpc, is_stream(path)) {
        (true, true) => connect::stream_error(&ConnectError::new(code, message)),
        (true, false) => connect::error_response(&ConnectError::new(code, message)),
        (false, _) => fs::http_error(status, message),
    };
    let Some(id) = header(&req, "e2b-sandbox-id").map(str::to_string) else {
        let response = refuse(
            StatusCode::BAD_REQUEST,
            "invalid_argument",
            "envd calls need E2b-Sandbox-Id (set E2B_SANDBOX_URL to this endpoint)".into(),
        );
        return refused(req, response).await;
    };
    let Some(sb) = e2b.sandbox(&id) else {
        // The SDKs read "was not found" as "the sandbox is not running".
        let response = refuse(StatusCode::BAD_GATEWAY, "unavailable", format!("sandbox {id:?} was not found"));
        return refused(req, response).await;
    };
    if !header(&req, "x-access-token").is_some_and(|t| sb.admits(t.trim())) {
        let response = refuse(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            format!("a wrong or missing X-Access-Token for sandbox {id}"),
        );
        return refused(req, response).await;
    }
    if path == "/health" {
        return match sb.state() {
            State::Running => empty(StatusCode::NO_CONTENT),
            State::Paused => fs::http_error(StatusCode::BAD_GATEWAY, format!("sandbox {id} is paused")),
        };
    }
    if let Err(e) = e2b.check_running(&sb).await {
        let response = refuse(StatusCode::BAD_GATEWAY, e.code, e.message);
        return refused(req, response).await;
    }
    if path == "/files" {
        let q = query(&req);
        return match *req.method() {
            Method::GET => match q.get("path") {
                Some(p) => fs::download(e2b, sb, p).await,
                None => fs::http_error(StatusCode::BAD_REQUEST, "GET /files needs ?path="),
            },
            Method::POST => {
                let headers = req.headers().clone();
                fs::upload(e2b, sb, &headers, q.get("path").cloned(), req.into_body()).await
            }
            _ => fs::http_error(StatusCode::METHOD_NOT_ALLOWED, "GET or POST /files"),
        };
    }
    if req.method() != Method::POST {
        return connect::error_response(&ConnectError::new("unimplemented", "Connect calls are POSTs here"));
    }
    rpc_call(e2b, sb, req, path).await
}

async fn rpc_call(e2b: Arc<E2b>, sb: Arc<Sandbox>, req: Request<Incoming>, path: &str) -> Response<Body> {
    let content_type = header(&req, "content-type").unwrap_or_default().to_string();
    let stream_headers = StreamHeaders::from(req.headers());
    let method = path.rsplit('/').next().unwrap_or_default().to_string();
    let service = path.trim_start_matches('/').split('/').next().unwrap_or_default().to_string();
    if (service.as_str(), method.as_str()) == ("process.Process", "StreamInput") {
        return connect::unary_stream_answer(process::stream_input(&e2b, &sb, req.into_body()).await);
    }
    let body = match read_body(req.into_body(), MAX_MESSAGE).await {
        Ok(b) => b,
        Err(e) => return connect::error_response(&ConnectError::new("resource_exhausted", e)),
    };
    let stream = |b: &Bytes| -> Result<serde_json::Value, ConnectError> { connect::stream_request(&content_type, b) };
    let unary = |b: &Bytes| -> Result<serde_json::Value, ConnectError> { connect::unary_request(&content_type, b) };
    fn typed<T: serde::de::DeserializeOwned>(v: Result<serde_json::Value, ConnectError>) -> Result<T, ConnectError> {
        serde_json::from_value(v?)
            .map_err(|e| ConnectError::new("invalid_argument", format!("a malformed message: {e}")))
    }
    match (service.as_str(), method.as_str()) {
        ("process.Process", "Start") => match typed::<wire::StartRequest>(stream(&body)) {
            Ok(r) => process::start(&e2b, &sb, r, stream_headers).await,
            Err(e) => connect::stream_error(&e),
        },
        ("process.Process", "Connect") => match typed::<wire::SelectRequest>(stream(&body)) {
            Ok(r) => process::attach(&e2b, &sb, r.process.pid, r.process.tag.as_deref(), stream_headers).await,
            Err(e) => connect::stream_error(&e),
        },
        ("process.Process", "List") => connect::unary(process::list(&e2b, &sb).await),
        ("process.Process", "SendInput") => match typed(unary(&body)) {
            Ok(r) => connect::unary(process::send_input(&e2b, &sb, r).await),
            Err(e) => connect::error_response(&e),
        },
        ("process.Process", "SendSignal") => match typed(unary(&body)) {
            Ok(r) => connect::unary(process::send_signal(&e2b, &sb, r).await),
            Err(e) => connect::error_response(&e),
        },
        ("process.Process", "CloseStdin") => match typed::<wire::SelectRequest>(unary(&body)) {
            Ok(r) => connect::unary(process::close_stdin(&e2b, &sb, r.process.pid, r.process.tag.as_deref()).await),
            Err(e) => connect::error_response(&e),
        },
        ("process.Process", "Update") => match typed(unary(&body)) {
            Ok(r) => connect::unary(process::update(&e2b, &sb, r).await),
            Err(e) => connect::error_response(&e),
        },
        ("filesystem.Filesystem", "Stat") => match typed::<wire::PathRequest>(unary(&body)) {
            Ok(r) => connect::unary(fs::stat_entry(&e2b, &sb, &r.path).await),
            Err(e) => connect::error_response(&e),
        },
        ("filesystem.Filesystem", "ListDir") => match typed::<wire::ListDirRequest>(unary(&body)) {
            Ok(r) => connect::unary(fs::list_dir(&e2b, &sb, &r.path, r.depth).await),
            Err(e) => connect::error_response(&e),
        },
        ("filesystem.Filesystem", "MakeDir") => match typed::<wire::PathRequest>(unary(&body)) {
            Ok(r) => connect::unary(fs::make_dir(&e2b, &sb, &r.path).await),
            Err(e) => connect::error_response(&e),
        },
        ("filesystem.Filesystem", "Move") => match typed::<wire::MoveRequest>(unary(&body)) {
            Ok(r) => connect::unary(fs::move_entry(&e2b, &sb, &r.source, &r.destination).await),
            Err(e) => connect::error_response(&e),
        },
        ("filesystem.Filesystem", "Remove") => match typed::<wire::PathRequest>(unary(&body)) {
            Ok(r) => connect::unary(fs::remove(&e2b, &sb, &r.path).await),
            Err(e) => connect::error_response(&e),
        },
        ("filesystem.Filesystem", "WatchDir") => match typed::<wire::WatchRequest>(stream(&body)) {
            Ok(r) => fs::watch_dir(e2b.clone(), sb, r, stream_headers.keepalive).await,
            Err(e) => connect::stream_error(&e),
        },
        ("filesystem.Filesystem", "CreateWatcher") => match typed::<wire::WatchRequest>(unary(&body)) {
            Ok(r) => connect::unary(fs::create_watcher(e2b.clone(), sb, r).await),
            Err(e) => connect::error_response(&e),
        },
        ("filesystem.Filesystem", "GetWatcherEvents") => match typed::<wire::WatcherRef>(unary(&body)) {
            Ok(r) => connect::unary(fs::watcher_events(&sb, &r.watcher_id)),
            Err(e) => connect::error_response(&e),
        },
        ("filesystem.Filesystem", "RemoveWatcher") => match typed::<wire::WatcherRef>(unary(&body)) {
            Ok(r) => connect::unary(fs::remove_watcher(&sb, &r.watcher_id)),
            Err(e) => connect::error_response(&e),
        },
        _ => connect::error_response(&ConnectError::new("unimplemented", format!("{path} is not a method here"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_addresses_and_hosts() {
        assert!(check_address(&"127.0.0.1:1".parse().unwrap()).is_ok());
        assert!(check_address(&"[::1]:1".parse().unwrap()).is_ok());
        assert!(check_address(&"0.0.0.0:1".parse().unwrap()).is_err());
        for ok in [None, Some("127.0.0.1:4000"), Some("localhost:80"), Some("[::1]:9"), Some("LOCALHOST")] {
            assert!(loopback_host(ok), "{ok:?}");
        }
        for refused in [Some("evil.example:4000"), Some("10.0.0.1:80"), Some("localhost.evil.example")] {
            assert!(!loopback_host(refused), "{refused:?}");
        }
    }

    #[test]
    fn queries_decode_as_the_sdks_encode_them() {
        assert_eq!(percent_decode("running%2Cpaused"), "running,paused");
        assert_eq!(percent_decode("%2Fhome%2Fuser%2Fa+b.txt"), "/home/user/a b.txt");
        assert_eq!(percent_decode("100%"), "100%");
        // The SDK encodes `k=v` into the `metadata` parameter, each part encoded first.
        let once = percent_decode("k%3Dv%26a%253Db%3Dc");
        assert_eq!(metadata_filter(&once), [("k".into(), "v".into()), ("a=b".into(), "c".into())].into());
    }
}
