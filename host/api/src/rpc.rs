//! The JSON-RPC 2.0 envelope: one JSON value per line, each way.
//!
//! Requests carry an `id` and get exactly one response with that id; requests without one are
//! notifications and get none (a client sends `process.ack` so). The daemon sends
//! notifications of its own: [`NOTIFY_EVENT`], [`NOTIFY_PROCESS`] and [`NOTIFY_LOST`]. Batches
//! (a JSON array of requests) are answered with an array of responses.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{ApiError, ErrorCode};

pub const VERSION: &str = "2.0";

/// A subscribed event: params are a [`crate::SessionEvent`].
pub const NOTIFY_EVENT: &str = "event";
/// Output and exit of a process this connection spawned: params are a [`crate::SessionEvent`].
pub const NOTIFY_PROCESS: &str = "process.event";
/// The daemon dropped subscribed events because this client read too slowly: params are
/// [`EventsLost`].
pub const NOTIFY_LOST: &str = "events.lost";

/// A request id: a number or a string (JSON-RPC also allows null, which we answer but never
/// send).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum Id {
    Number(i64),
    String(String),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    pub jsonrpc: String,
    /// Absent for a notification.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<Id>,
    pub method: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub params: Option<Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Response {
    pub jsonrpc: String,
    /// Null when the request's id could not be read (a parse error).
    pub id: Option<Id>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<RpcError>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Notification {
    pub jsonrpc: String,
    pub method: String,
    pub params: Value,
}

/// The JSON-RPC error object. `data.code` is the stable [`ErrorCode`] name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RpcError {
    pub code: i64,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<RpcErrorData>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RpcErrorData {
    pub code: ErrorCode,
}

/// Params of [`NOTIFY_LOST`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct EventsLost {
    /// Events dropped since the last one this client received.
    pub count: u64,
}

impl From<&ApiError> for RpcError {
    fn from(e: &ApiError) -> Self {
        Self { code: e.code.rpc_code(), message: e.message.clone(), data: Some(RpcErrorData { code: e.code }) }
    }
}

impl From<RpcError> for ApiError {
    fn from(e: RpcError) -> Self {
        let code = match e.data {
            Some(d) => d.code,
            None => ErrorCode::ALL.into_iter().find(|c| c.rpc_code() == e.code).unwrap_or(ErrorCode::Unknown),
        };
        ApiError::new(code, e.message)
    }
}

impl Response {
    pub fn ok(id: Option<Id>, result: Value) -> Self {
        Self { jsonrpc: VERSION.into(), id, result: Some(result), error: None }
    }

    pub fn err(id: Option<Id>, error: &ApiError) -> Self {
        Self { jsonrpc: VERSION.into(), id, result: None, error: Some(error.into()) }
    }
}

impl Notification {
    pub fn new(method: &str, params: impl Serialize) -> Self {
        Self {
            jsonrpc: VERSION.into(),
            method: method.into(),
            params: serde_json::to_value(params).expect("notification params serialize"),
        }
    }
}

/// One line a server received, checked against JSON-RPC 2.0.
#[derive(Debug)]
pub enum Incoming {
    Single(Result<Request, (Option<Id>, ApiError)>),
    /// A batch: each entry checked on its own.
    Batch(Vec<Result<Request, (Option<Id>, ApiError)>>),
}

/// Parses a request line (without its newline). Errors carry the id when one could be read, so
/// the response can name it.
pub fn parse_request_line(line: &[u8]) -> Incoming {
    let value: Value = match serde_json::from_slice(line) {
        Ok(v) => v,
        Err(e) => return Incoming::Single(Err((None, ApiError::new(ErrorCode::ParseError, format!("not JSON: {e}"))))),
    };
    match value {
        Value::Array(items) if items.is_empty() => {
            Incoming::Single(Err((None, ApiError::new(ErrorCode::InvalidRequest, "an empty batch"))))
        }
        Value::Array(items) => Incoming::Batch(items.into_iter().map(check_request).collect()),
        other => Incoming::Single(check_request(other)),
    }
}

fn check_request(value: Value) -> Result<Request, (Option<Id>, ApiError)> {
    let invalid = |id: Option<Id>, m: &str| Err((id, ApiError::new(ErrorCode::InvalidRequest, m)));
    let Value::Object(obj) = &value else { return invalid(None, "a request must be a JSON object") };
    let id = match obj.get("id") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => match n.as_i64() {
            Some(n) => Some(Id::Number(n)),
            None => return invalid(None, "id must be an integer or a string"),
        },
        Some(Value::String(s)) => Some(Id::String(s.clone())),
        Some(_) => return invalid(None, "id must be an integer or a string"),
    };
    if obj.get("jsonrpc").and_then(Value::as_str) != Some(VERSION) {
        return invalid(id, "jsonrpc must be \"2.0\"");
    }
    let Some(method) = obj.get("method").and_then(Value::as_str) else {
        return invalid(id, "method must be a string");
    };
    let params = match obj.get("params") {
        None | Some(Value::Null) => None,
        Some(p @ (Value::Object(_) | Value::Array(_))) => Some(p.clone()),
        Some(_) => return invalid(id, "params must be an object or an array"),
    };
    Ok(Request { jsonrpc: VERSION.into(), id, method: method.to_string(), params })
}

/// Decodes a method's params; absent params read as `{}` (so methods whose params are all
/// optional can be called without any), an array holds them by position: `[params]`. A field
/// the method does not take is an error, not ignored: a typo (`memory` for `memory_mib`) must
/// not silently start a session with the default.
pub fn decode_params<P: serde::de::DeserializeOwned + schemars::JsonSchema + 'static>(
    params: Option<Value>,
) -> Result<P, ApiError> {
    let value = match params {
        None => Value::Object(Default::default()),
        Some(Value::Array(mut items)) if items.len() == 1 => items.remove(0),
        Some(Value::Array(_)) => return Err(ApiError::invalid_params("positional params take exactly one object")),
        Some(v) => v,
    };
    if let Value::Object(fields) = &value {
        let known = known_fields::<P>();
        if let Some(unknown) = fields.keys().find(|k| !known.contains(k.as_str())) {
            let list: Vec<&str> = known.iter().map(String::as_str).collect();
            return Err(ApiError::invalid_params(format!(
                "unknown field {unknown:?}; this method takes {}",
                if list.is_empty() { "no params".to_string() } else { list.join(", ") }
            )));
        }
    }
    serde_json::from_value(value).map_err(|e| ApiError::invalid_params(format!("invalid params: {e}")))
}

/// The field names a params type takes, read off its JSON Schema (flattened fields included),
/// computed once per type.
fn known_fields<P: schemars::JsonSchema + 'static>() -> std::sync::Arc<std::collections::BTreeSet<String>> {
    use std::any::TypeId;
    use std::collections::{BTreeSet, HashMap};
    use std::sync::{Arc, Mutex, OnceLock};
    static CACHE: OnceLock<Mutex<HashMap<TypeId, Arc<BTreeSet<String>>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(known) = cache.lock().unwrap().get(&TypeId::of::<P>()) {
        return known.clone();
    }
    let root = schemars::generate::SchemaSettings::draft2020_12().into_generator().into_root_schema_for::<P>();
    let root = root.as_value();
    let mut known = BTreeSet::new();
    collect_properties(root, root, &mut known, 0);
    let known = Arc::new(known);
    cache.lock().unwrap().insert(TypeId::of::<P>(), known.clone());
    known
}

fn collect_properties(schema: &Value, root: &Value, out: &mut std::collections::BTreeSet<String>, depth: u32) {
    if depth > 8 {
        return;
    }
    if let Some(props) = schema.get("properties").and_then(Value::as_object) {
        out.extend(props.keys().cloned());
    }
    if let Some(reference) = schema.get("$ref").and_then(Value::as_str) {
        if let Some(target) = reference.strip_prefix("#/$defs/").and_then(|name| root.get("$defs")?.get(name)) {
            collect_properties(target, root, out, depth + 1);
        }
    }
    for key in ["allOf", "anyOf", "oneOf"] {
        for sub in schema.get(key).and_then(Value::as_array).into_iter().flatten() {
            collect_properties(sub, root, out, depth + 1);
        }
    }
}

/// A line a client received: a response to one of its requests, or a notification.
#[derive(Debug)]
pub enum ServerMessage {
    Response(Response),
    Notification(Notification),
    Batch(Vec<Response>),
}

pub fn parse_server_line(line: &[u8]) -> Result<ServerMessage, ApiError> {
    let value: Value = serde_json::from_slice(line)
        .map_err(|e| ApiError::new(ErrorCode::ParseError, format!("umbrad sent invalid JSON: {e}")))?;
    let bad = |e: serde_json::Error| ApiError::new(ErrorCode::InvalidRequest, format!("umbrad sent {e}"));
    match &value {
        Value::Array(_) => serde_json::from_value(value).map(ServerMessage::Batch).map_err(bad),
        Value::Object(o) if o.contains_key("method") && !o.contains_key("id") => {
            serde_json::from_value(value).map(ServerMessage::Notification).map_err(bad)
        }
        _ => serde_json::from_value(value).map(ServerMessage::Response).map_err(bad),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn single(line: &str) -> Result<Request, (Option<Id>, ApiError)> {
        match parse_request_line(line.as_bytes()) {
            Incoming::Single(r) => r,
            Incoming::Batch(_) => panic!("not a batch"),
        }
    }

    #[test]
    fn requests_are_checked_against_the_spec() {
        let r = single(r#"{"jsonrpc":"2.0","id":1,"method":"session.list"}"#).unwrap();
        assert_eq!((r.id, r.method.as_str(), r.params), (Some(Id::Number(1)), "session.list", None));
        let r = single(r#"{"jsonrpc":"2.0","method":"process.ack","params":{"x":1}}"#).unwrap();
        assert!(r.id.is_none(), "a notification");

        assert_eq!(single("{oops").unwrap_err().1.code, ErrorCode::ParseError);
        let (id, e) = single(r#"{"jsonrpc":"1.0","id":"a","method":"m"}"#).unwrap_err();
        assert_eq!((id, e.code), (Some(Id::String("a".into())), ErrorCode::InvalidRequest));
        assert_eq!(single(r#"{"jsonrpc":"2.0","id":2,"method":7}"#).unwrap_err().1.code, ErrorCode::InvalidRequest);
        assert_eq!(
            single(r#"{"jsonrpc":"2.0","id":2,"method":"m","params":3}"#).unwrap_err().1.code,
            ErrorCode::InvalidRequest
        );
        assert_eq!(single(r#"{"jsonrpc":"2.0","id":1.5,"method":"m"}"#).unwrap_err().1.code, ErrorCode::InvalidRequest);
        assert_eq!(single("[]").unwrap_err().1.code, ErrorCode::InvalidRequest);
        match parse_request_line(br#"[{"jsonrpc":"2.0","id":1,"method":"a"}, 5]"#) {
            Incoming::Batch(items) => assert!(items[0].is_ok() && items[1].is_err()),
            Incoming::Single(_) => panic!("a batch"),
        }
    }

    #[test]
    fn params_decode_by_name_or_position() {
        #[derive(Deserialize, Debug, PartialEq, JsonSchema)]
        struct P {
            name: String,
        }
        let by_name: P = decode_params(Some(serde_json::json!({"name": "a"}))).unwrap();
        let by_pos: P = decode_params(Some(serde_json::json!([{"name": "a"}]))).unwrap();
        assert_eq!(by_name, by_pos);
        let e = decode_params::<P>(Some(serde_json::json!({"nom": "a"}))).unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidParams);
        assert!(e.message.contains("name"), "{}", e.message);
    }

    #[test]
    fn unknown_fields_are_refused_flattened_ones_known() {
        use crate::methods::{StartParams, StdinParams};
        let e = decode_params::<StartParams>(Some(serde_json::json!({"name": "a", "memory": 1}))).unwrap_err();
        assert!(e.message.contains("unknown field \"memory\"") && e.message.contains("memory_mib"), "{}", e.message);
        let p: StartParams = decode_params(Some(serde_json::json!({"name": "a", "memory_mib": 300}))).unwrap();
        assert_eq!(p.settings.memory_mib, Some(300), "a flattened field");
        let p: StdinParams = decode_params(Some(
            serde_json::json!({"session": "s", "process": 1, "data": "aGk=", "encoding": "base64"}),
        ))
        .unwrap();
        assert_eq!(p.data.to_bytes().unwrap(), b"hi");
        let e = decode_params::<crate::methods::NoParams>(Some(serde_json::json!({"x": 1}))).unwrap_err();
        assert!(e.message.contains("no params"), "{}", e.message);
    }

    #[test]
    fn errors_keep_their_code_across_the_wire() {
        let e = ApiError::new(ErrorCode::SessionNotFound, "no session x");
        let line = serde_json::to_string(&Response::err(Some(Id::Number(4)), &e)).unwrap();
        assert!(line.contains("-32001") && line.contains("\"session_not_found\""), "{line}");
        match parse_server_line(line.as_bytes()).unwrap() {
            ServerMessage::Response(r) => assert_eq!(ApiError::from(r.error.unwrap()), e),
            other => panic!("{other:?}"),
        }
        let n = serde_json::to_string(&Notification::new(NOTIFY_LOST, EventsLost { count: 3 })).unwrap();
        assert!(matches!(parse_server_line(n.as_bytes()).unwrap(), ServerMessage::Notification(_)));
    }
}
