//! The JSON Schema of the whole IPC, generated from the Rust types: every method's params and
//! result, the notifications, and the error codes. `host/api/schema/umbrad-ipc.json` is this
//! document, checked in; a test fails when it is stale (`UMBRA_UPDATE_SCHEMA=1 cargo test -p
//! umbra-api` rewrites it), and the TypeScript client's types are generated from it.

use serde_json::{json, Map, Value};

use crate::error::ErrorCode;
use crate::event::SessionEvent;
use crate::rpc::{EventsLost, NOTIFY_EVENT, NOTIFY_LOST, NOTIFY_PROCESS};

/// The schema document.
pub fn document() -> Value {
    let mut gen = schemars::generate::SchemaSettings::draft2020_12().into_generator();
    let mut methods = Map::new();
    for m in crate::methods::all(&mut gen) {
        methods
            .insert(m.name.to_string(), json!({ "summary": m.summary.trim(), "params": m.params, "result": m.result }));
    }
    let event = gen.subschema_for::<SessionEvent>();
    let lost = gen.subschema_for::<EventsLost>();
    let notifications = json!({
        NOTIFY_EVENT: { "summary": "A lifecycle event of a subscribed session (or of the host).", "params": event },
        NOTIFY_PROCESS: { "summary": "Events of a process this connection spawned: spawned, stdout, stderr, then exit.", "params": event },
        NOTIFY_LOST: { "summary": "Subscribed events were dropped because this client read too slowly.", "params": lost },
    });
    let errors: Vec<Value> = ErrorCode::ALL.iter().map(|c| json!({ "name": c.name(), "code": c.rpc_code() })).collect();
    let defs = gen.take_definitions(true);
    json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "umbrad IPC (JSON-RPC 2.0 over a Unix socket, one message per line)",
        "api_version": crate::API_VERSION,
        "methods": methods,
        "notifications": notifications,
        "errors": errors,
        "$defs": defs,
    })
}

/// The document as it is checked in: pretty, with a trailing newline.
pub fn document_text() -> String {
    let mut text = serde_json::to_string_pretty(&document()).expect("a schema serializes");
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    #[test]
    fn the_checked_in_schema_is_current() {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("schema/umbrad-ipc.json");
        crate::assert_generated_current(&path, &super::document_text());
    }

    #[test]
    fn every_method_has_a_summary_and_refs_resolve() {
        let doc = super::document();
        let defs = doc["$defs"].as_object().unwrap();
        let text = serde_json::to_string(&doc).unwrap();
        for r in text.split("\"$ref\":\"#/$defs/").skip(1) {
            let name = r.split('"').next().unwrap();
            assert!(defs.contains_key(name), "dangling $ref {name}");
        }
        for (name, m) in doc["methods"].as_object().unwrap() {
            assert!(!m["summary"].as_str().unwrap().is_empty(), "{name} has no summary");
        }
    }
}
