//! TypeScript declarations of the IPC, rendered from the JSON Schema document
//! ([`crate::schema::document`]) for the TypeScript client (`host/client-ts`, the npm package
//! `@umbra/client`). `host/client-ts/src/generated/types.ts` is [`definitions`], checked in; a
//! test fails when it is stale, and `UMBRA_UPDATE_SCHEMA=1 cargo test -p umbra-api` rewrites it.
//!
//! What becomes what:
//!
//! - every `$defs` entry is one declaration: an object → an `interface` (fields that are not
//!   required get `?`), a string enum (`enum`, `const`, or a `oneOf` of those) → a union of string
//!   literals, an object without properties → `Record<string, never>`;
//! - an internally tagged `oneOf` (the one `SessionEvent` has: `EventKind` flattened into it) →
//!   a discriminated union: one interface per variant (`StatusEvent`, `ExitEvent`, …, named after
//!   the tag value), the union of them (`SessionEventKind`), the common fields
//!   (`SessionEventBase`) and a const array of the tag values (`SESSION_EVENT_KINDS`);
//! - `allOf` → an intersection, `anyOf`/`oneOf` → a union, integers and numbers → `number`,
//!   string maps → `Record<string, T>`, nullable (`[T, "null"]`, `anyOf: [T, null]`) → `T | null`;
//! - descriptions → doc comments (rustdoc links made readable, defaults as `@defaultValue`);
//! - the document's `methods` → a `Methods` map (`{ "session.start": { params: StartParams;
//!   result: SessionInfo }, … }`), its `notifications` → `Notifications`, its `errors` →
//!   `ERROR_CODES` (name → JSON-RPC number), and `API_VERSION`, `OUTPUT_WINDOW`, `MAX_FILE_CHUNK`.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use serde_json::{Map, Value};

/// Where the generated file lives, relative to the workspace root.
pub const GENERATED_PATH: &str = "host/client-ts/src/generated/types.ts";

/// The generated TypeScript: deterministic, ending with a newline.
pub fn definitions() -> String {
    render(&crate::schema::document())
}

/// Renders a schema document of the shape [`crate::schema::document`] produces.
pub fn render(doc: &Value) -> String {
    let empty = Map::new();
    let defs = doc["$defs"].as_object().unwrap_or(&empty);
    let r = Renderer { defs };
    let mut out = String::new();
    let version = doc["api_version"].as_str().unwrap_or("?");
    let _ = write!(
        out,
        "// Generated from the Rust types in host/api (through the JSON Schema\n\
         // host/api/schema/umbrad-ipc.json) by host/api/src/typescript.rs: do not edit.\n\
         // `UMBRA_UPDATE_SCHEMA=1 cargo test -p umbra-api` rewrites it; a test fails when it is stale.\n\
         // The wire protocol and what every field means: docs/ipc.md.\n\n\
         /** The IPC contract's version (`major.minor`) these types describe. */\n\
         export const API_VERSION = {};\n\n\
         /** Bytes of each output stream umbrad sends before it waits for `process.ack`. */\n\
         export const OUTPUT_WINDOW = {};\n\n\
         /** Largest read or write of `file.read` / `file.write` in one request. */\n\
         export const MAX_FILE_CHUNK = {};\n\n",
        json_literal(&Value::String(version.to_string())),
        crate::methods::OUTPUT_WINDOW,
        crate::methods::MAX_FILE_CHUNK,
    );

    // ---- types
    for (name, def) in defs {
        r.declaration(&mut out, name, def);
    }

    // ---- methods, in declaration order
    let methods = doc["methods"].as_object().unwrap_or(&empty);
    out.push_str(
        "/** Every method umbrad serves, with the types of its params and result. */\nexport interface Methods {\n",
    );
    let mut names: Vec<&str> = crate::methods::NAMES.iter().copied().filter(|n| methods.contains_key(*n)).collect();
    names.extend(methods.keys().map(String::as_str).filter(|k| !crate::methods::NAMES.contains(k)));
    for name in &names {
        let m = &methods[*name];
        r.comment(&mut out, "  ", m["summary"].as_str().unwrap_or(""), None);
        let _ = writeln!(
            out,
            "  {}: {{ params: {}; result: {} }};",
            json_literal(&Value::String(name.to_string())),
            r.ts_type(&m["params"]),
            r.ts_type(&m["result"])
        );
    }
    out.push_str("}\n\n/** A method's name. */\nexport type MethodName = keyof Methods;\n\n");
    let _ = write!(
        out,
        "/** Every method's name, in documentation order. */\nexport const METHOD_NAMES = [\n{}] as const;\n\n",
        names.iter().map(|n| format!("  {},\n", json_literal(&Value::String(n.to_string())))).collect::<String>()
    );

    // ---- notifications
    let notifications = doc["notifications"].as_object().unwrap_or(&empty);
    out.push_str(
        "/** Notifications umbrad sends (lines without `id`): method → params. */\nexport interface Notifications {\n",
    );
    for (name, n) in notifications {
        r.comment(&mut out, "  ", n["summary"].as_str().unwrap_or(""), None);
        let _ = writeln!(out, "  {}: {};", json_literal(&Value::String(name.clone())), r.ts_type(&n["params"]));
    }
    out.push_str("}\n\n");

    // ---- error codes
    out.push_str(
        "/** Every error code's JSON-RPC number (`error.code`), by its stable name (`error.data.code`). */\n\
         export const ERROR_CODES = {\n",
    );
    for e in doc["errors"].as_array().map(Vec::as_slice).unwrap_or_default() {
        let _ = writeln!(out, "  {}: {},", property_name(e["name"].as_str().unwrap_or("")), e["code"]);
    }
    out.push_str("} as const;\n");
    out
}

/// A schema's `$ref` target (`{"$ref": "#/$defs/Name", …}`).
pub(crate) fn ref_name(schema: &Value) -> Option<&str> {
    schema.get("$ref")?.as_str()?.strip_prefix("#/$defs/")
}

pub(crate) fn json_literal(v: &Value) -> String {
    serde_json::to_string(v).expect("JSON values serialize")
}

/// A property name as TypeScript needs it: bare when it is an identifier, quoted otherwise.
fn property_name(name: &str) -> String {
    let mut chars = name.chars();
    let ident = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == '$')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$');
    if ident {
        name.to_string()
    } else {
        json_literal(&Value::String(name.to_string()))
    }
}

/// `boot_queued` → `BootQueued`.
pub(crate) fn pascal_case(snake: &str) -> String {
    snake
        .split(['_', '-', '.'])
        .filter(|w| !w.is_empty())
        .map(|w| {
            let mut cs = w.chars();
            cs.next().map(|c| c.to_ascii_uppercase().to_string() + cs.as_str()).unwrap_or_default()
        })
        .collect()
}

/// `SessionEvent` → `SESSION_EVENT`.
pub(crate) fn upper_snake_case(camel: &str) -> String {
    let mut out = String::new();
    for (i, c) in camel.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

/// The last word of a CamelCase name (`SessionEvent` → `Event`): the suffix of its variants'
/// names.
pub(crate) fn last_word(camel: &str) -> &str {
    let at = camel.char_indices().rev().find(|(_, c)| c.is_ascii_uppercase()).map_or(0, |(i, _)| i);
    &camel[at..]
}

/// `snake_case` of a CamelCase rustdoc name (`ErrorCode::SessionNotFound` → `session_not_found`).
pub(crate) fn snake_case(camel: &str) -> String {
    upper_snake_case(camel).to_ascii_lowercase()
}

/// A field of an object schema.
pub(crate) struct Field<'a> {
    pub name: &'a str,
    pub schema: &'a Value,
    pub required: bool,
}

/// An object schema's own fields: required ones in their declared order (schemars keeps it in
/// `required`; `properties` is sorted by name), then the optional ones by name.
pub(crate) fn fields(schema: &Value) -> Vec<Field<'_>> {
    let Some(props) = schema.get("properties").and_then(Value::as_object) else { return Vec::new() };
    let required: Vec<&str> =
        schema.get("required").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str).collect();
    let mut out: Vec<Field<'_>> = required
        .iter()
        .filter_map(|r| props.get_key_value(*r).map(|(k, s)| Field { name: k, schema: s, required: true }))
        .collect();
    for (name, s) in props {
        if !required.contains(&name.as_str()) {
            out.push(Field { name, schema: s, required: false });
        }
    }
    out
}

/// A tagged `oneOf`: the tag's name and each variant's tag value, when every variant is an
/// object naming itself by the same `const` property.
pub(crate) fn tagged_union(schema: &Value) -> Option<(String, Vec<(String, &Value)>)> {
    let variants = schema.get("oneOf")?.as_array()?;
    let first = variants.first()?.get("properties")?.as_object()?;
    let tag = first.iter().find(|(k, p)| {
        p.get("const").is_some_and(Value::is_string)
            && variants.iter().all(|v| {
                v["properties"][k.as_str()]["const"].is_string()
                    && v["required"].as_array().is_some_and(|r| r.iter().any(|x| x == k.as_str()))
            })
    })?;
    let tag = tag.0.clone();
    let values: Vec<(String, &Value)> = variants
        .iter()
        .map(|v| (v["properties"][tag.as_str()]["const"].as_str().unwrap_or("").to_string(), v))
        .collect();
    Some((tag, values))
}

struct Renderer<'a> {
    defs: &'a Map<String, Value>,
}

impl Renderer<'_> {
    /// The values of a string enum with their descriptions; `None` if it is not one.
    fn enum_values(&self, schema: &Value) -> Option<Vec<(Value, Option<String>)>> {
        let desc = |s: &Value| s.get("description").and_then(Value::as_str).map(str::to_string);
        if let Some(c) = schema.get("const") {
            return Some(vec![(c.clone(), desc(schema))]);
        }
        if let Some(values) = schema.get("enum").and_then(Value::as_array) {
            return Some(values.iter().map(|v| (v.clone(), None)).collect());
        }
        let branches = schema.get("oneOf").or_else(|| schema.get("anyOf"))?.as_array()?;
        let mut all = Vec::new();
        for b in branches {
            if b.get("properties").is_some() || ref_name(b).is_some() {
                return None;
            }
            all.extend(self.enum_values(b)?);
        }
        (!all.is_empty()).then_some(all)
    }

    /// One `$defs` entry as TypeScript declarations.
    fn declaration(&self, out: &mut String, name: &str, def: &Value) {
        let description = def.get("description").and_then(Value::as_str).unwrap_or("");
        if let Some(values) = self.enum_values(def) {
            let documented: Vec<String> = values
                .iter()
                .filter_map(|(v, d)| d.as_ref().map(|d| format!("- `{}`: {}", json_literal(v), one_line(d))))
                .collect();
            let mut text = description.to_string();
            if !documented.is_empty() {
                if !text.is_empty() {
                    text.push_str("\n\n");
                }
                text.push_str(&documented.join("\n"));
            }
            self.comment(out, "", &text, None);
            let union: Vec<String> = values.iter().map(|(v, _)| json_literal(v)).collect();
            let _ = write!(out, "export type {name} = {};\n\n", union.join(" | "));
            return;
        }
        if let Some((tag, variants)) = tagged_union(def) {
            self.tagged(out, name, description, def, &tag, &variants);
            return;
        }
        self.comment(out, "", description, None);
        let is_object = def.get("type").and_then(Value::as_str) == Some("object")
            && def.get("$ref").is_none()
            && def.get("allOf").is_none();
        if is_object && def.get("properties").is_some() && def.get("additionalProperties").is_none() {
            let _ = write!(out, "export interface {name} {}\n\n", self.object_body(def, "", None));
        } else {
            let _ = write!(out, "export type {name} = {};\n\n", self.ts_type(def));
        }
    }

    /// A def whose `oneOf` is tagged: the union of its variants, each variant, and the fields
    /// all of them share.
    fn tagged(
        &self,
        out: &mut String,
        name: &str,
        description: &str,
        def: &Value,
        tag: &str,
        variants: &[(String, &Value)],
    ) {
        let suffix = last_word(name);
        let kind = format!("{name}Kind");
        let common = def.get("properties").is_some();
        let base = format!("{name}Base");
        let mut text = description.to_string();
        let _ = write!(
            text,
            "{}The `{tag}` field tells the kinds apart ({{@link {kind}}}); narrow on it with `switch` or `===`.",
            if text.is_empty() { "" } else { "\n\n" }
        );
        self.comment(out, "", &text, None);
        if common {
            let _ = write!(out, "export type {name} = {base} & {kind};\n\n");
            self.comment(out, "", &format!("The fields every {{@link {name}}} has, whatever its kind."), None);
            let _ = write!(out, "export interface {base} {}\n\n", self.object_body(def, "", None));
        } else {
            let _ = write!(out, "export type {name} = {kind};\n\n");
        }
        let names: Vec<String> = variants.iter().map(|(v, _)| format!("{}{suffix}", pascal_case(v))).collect();
        self.comment(out, "", &format!("The kinds of {{@link {name}}}, by their `{tag}` field."), None);
        let _ = write!(
            out,
            "export type {kind} =\n{};\n\n",
            names.iter().map(|n| format!("  | {n}")).collect::<Vec<_>>().join("\n")
        );
        self.comment(out, "", &format!("Every value of {{@link {name}}}'s `{tag}` field, in declaration order."), None);
        let _ = write!(
            out,
            "export const {}_KINDS = [\n{}] as const;\n\n",
            upper_snake_case(name),
            variants
                .iter()
                .map(|(v, _)| format!("  {},\n", json_literal(&Value::String(v.clone()))))
                .collect::<String>()
        );
        for ((value, variant), type_name) in variants.iter().zip(&names) {
            let tag_line = format!("{}: {};", property_name(tag), json_literal(&Value::String(value.clone())));
            let doc = variant.get("description").and_then(Value::as_str).unwrap_or("");
            let doc = if doc.is_empty() { format!("`{tag}`: `{value}`.") } else { doc.to_string() };
            self.comment(out, "", &doc, None);
            match ref_name(variant) {
                Some(target) if self.defs.get(target).is_some_and(|d| d.get("properties").is_some()) => {
                    let _ = write!(
                        out,
                        "export interface {type_name} extends {target} {}\n\n",
                        self.object_body(variant, "", Some((tag, &tag_line)))
                    );
                }
                Some(target) => {
                    let _ = write!(
                        out,
                        "export type {type_name} = {target} & {};\n\n",
                        self.object_body(variant, "", Some((tag, &tag_line)))
                    );
                }
                None => {
                    let _ = write!(
                        out,
                        "export interface {type_name} {}\n\n",
                        self.object_body(variant, "", Some((tag, &tag_line)))
                    );
                }
            }
        }
    }

    /// `{ field: T; … }` over several lines, indented by `indent`; with `tag`, that field is
    /// written first as the given line.
    fn object_body(&self, schema: &Value, indent: &str, tag: Option<(&str, &str)>) -> String {
        let mut body = String::from("{\n");
        let inner = format!("{indent}  ");
        if let Some((_, line)) = tag {
            let _ = writeln!(body, "{inner}{line}");
        }
        for f in fields(schema) {
            if tag.is_some_and(|(t, _)| t == f.name) {
                continue;
            }
            let desc = f.schema.get("description").and_then(Value::as_str).unwrap_or("");
            self.comment(&mut body, &inner, desc, f.schema.get("default"));
            let _ = writeln!(
                body,
                "{inner}{}{}: {};",
                property_name(f.name),
                if f.required { "" } else { "?" },
                self.ts_type_indented(f.schema, &inner)
            );
        }
        body.push_str(indent);
        body.push('}');
        body
    }

    /// A schema as a TypeScript type expression.
    fn ts_type(&self, schema: &Value) -> String {
        self.ts_type_indented(schema, "")
    }

    fn ts_type_indented(&self, schema: &Value, indent: &str) -> String {
        // Nullable: `"type": [T, "null"]`, or `anyOf`/`oneOf` of T and `{"type": "null"}`.
        if let Some(Value::Array(types)) = schema.get("type") {
            if types.len() > 1 {
                let mut alternatives: Vec<String> = types
                    .iter()
                    .filter_map(Value::as_str)
                    .filter(|t| *t != "null")
                    .map(|t| {
                        let mut s = schema.clone();
                        s["type"] = Value::String(t.to_string());
                        self.ts_type_indented(&s, indent)
                    })
                    .collect();
                if types.iter().any(|t| t == "null") {
                    alternatives.push("null".into());
                }
                return alternatives.join(" | ");
            }
        }
        if let Some(target) = ref_name(schema) {
            return if schema.get("properties").is_some() {
                format!("{target} & {}", self.object_body(schema, indent, None))
            } else {
                target.to_string()
            };
        }
        if let Some(values) = self.enum_values(schema) {
            return values.iter().map(|(v, _)| json_literal(v)).collect::<Vec<_>>().join(" | ");
        }
        for (key, joiner) in [("anyOf", " | "), ("oneOf", " | "), ("allOf", " & ")] {
            if let Some(branches) = schema.get(key).and_then(Value::as_array) {
                let parts: Vec<String> = branches
                    .iter()
                    .map(|b| {
                        let t = self.ts_type_indented(b, indent);
                        if joiner == " & " && t.contains(" | ") {
                            format!("({t})")
                        } else {
                            t
                        }
                    })
                    .collect();
                return parts.join(joiner);
            }
        }
        match schema.get("type").and_then(Value::as_str) {
            Some("string") => "string".into(),
            Some("integer" | "number") => "number".into(),
            Some("boolean") => "boolean".into(),
            Some("null") => "null".into(),
            Some("array") => {
                let item = schema.get("items").map(|i| self.ts_type_indented(i, indent)).unwrap_or("unknown".into());
                if item.contains(' ') {
                    format!("({item})[]")
                } else {
                    format!("{item}[]")
                }
            }
            Some("object") => {
                let values = match schema.get("additionalProperties") {
                    Some(v @ Value::Object(_)) => Some(self.ts_type_indented(v, indent)),
                    Some(Value::Bool(true)) => Some("unknown".into()),
                    _ => None,
                };
                match (schema.get("properties").is_some(), values) {
                    (true, None) => self.object_body(schema, indent, None),
                    (true, Some(v)) => format!("{} & Record<string, {v}>", self.object_body(schema, indent, None)),
                    (false, Some(v)) => format!("Record<string, {v}>"),
                    (false, None) => "Record<string, never>".into(),
                }
            }
            _ => "unknown".into(),
        }
    }

    /// A doc comment (nothing when there is neither text nor default).
    fn comment(&self, out: &mut String, indent: &str, text: &str, default: Option<&Value>) {
        let mut lines: Vec<String> = if text.trim().is_empty() {
            Vec::new()
        } else {
            self.doc(text).lines().map(|l| l.trim_end().to_string()).collect()
        };
        if let Some(d) = default {
            if !lines.is_empty() {
                lines.push(String::new());
            }
            lines.push(format!("@defaultValue `{}`", json_literal(d)));
        }
        match lines.as_slice() {
            [] => {}
            [one] if indent.len() + one.len() + 7 <= 120 => {
                let _ = writeln!(out, "{indent}/** {one} */");
            }
            _ => {
                let _ = writeln!(out, "{indent}/**");
                for l in &lines {
                    if l.is_empty() {
                        let _ = writeln!(out, "{indent} *");
                    } else {
                        let _ = writeln!(out, "{indent} * {l}");
                    }
                }
                let _ = writeln!(out, "{indent} */");
            }
        }
    }

    /// A description for a doc comment: its lines kept, rustdoc links made readable, and
    /// nothing that would end the comment.
    fn doc(&self, text: &str) -> String {
        let mut out = String::new();
        let mut rest = text.trim();
        while let Some(start) = rest.find("[`") {
            let Some(len) = rest[start + 2..].find("`]") else { break };
            let target = &rest[start + 2..start + 2 + len];
            out.push_str(&rest[..start]);
            out.push_str(&self.intra_doc(target));
            rest = &rest[start + 2 + len + 2..];
        }
        out.push_str(rest);
        out.replace("*/", "*\\/")
    }

    /// A rustdoc link (`[`NAME`]`) as a TypeScript reader needs it.
    fn intra_doc(&self, target: &str) -> String {
        match target {
            "OUTPUT_WINDOW" | "MAX_FILE_CHUNK" => format!("{{@link {target}}}"),
            "NOTIFY_EVENT" => format!("`{}`", crate::rpc::NOTIFY_EVENT),
            "NOTIFY_PROCESS" => format!("`{}`", crate::rpc::NOTIFY_PROCESS),
            "NOTIFY_LOST" => format!("`{}`", crate::rpc::NOTIFY_LOST),
            _ => match target.split_once("::") {
                Some(("ErrorCode", variant)) => format!("`\"{}\"`", snake_case(variant)),
                Some((ty, member)) if self.defs.contains_key(ty) => format!("{{@link {ty}.{member}}}"),
                None if self.defs.contains_key(target) => format!("{{@link {target}}}"),
                _ => format!("`{}`", target.replace("::", ".")),
            },
        }
    }
}

/// A description on one line (for a list item).
pub(crate) fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Every name the generated file exports, for checks.
pub fn exported_names(ts: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in ts.lines() {
        for prefix in ["export interface ", "export type ", "export const "] {
            if let Some(rest) = line.strip_prefix(prefix) {
                let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                assert!(names.insert(name.clone()), "{name} is exported twice");
            }
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use serde_json::json;

    use super::*;

    fn renderer(defs: &Value) -> Renderer<'_> {
        Renderer { defs: defs.as_object().unwrap() }
    }

    #[test]
    fn the_typescript_client_types_are_current() {
        // host/api → the workspace root.
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).ancestors().nth(2).expect("host/api is two levels down");
        let path = root.join(GENERATED_PATH);
        crate::assert_generated_current(&path, &definitions());
    }

    #[test]
    fn every_def_method_event_and_error_code_is_declared() {
        let doc = crate::schema::document();
        let ts = definitions();
        let names = exported_names(&ts);
        for name in doc["$defs"].as_object().unwrap().keys() {
            assert!(names.contains(name), "no declaration for {name}");
        }
        for name in crate::methods::NAMES {
            assert!(ts.contains(&format!("  \"{name}\": {{ params: ")), "no entry for {name} in Methods");
        }
        for variant in doc["$defs"]["SessionEvent"]["oneOf"].as_array().unwrap() {
            let tag = variant["properties"]["event"]["const"].as_str().unwrap();
            let name = format!("{}Event", pascal_case(tag));
            assert!(names.contains(&name), "no {name} for event {tag}");
            assert!(ts.contains(&format!("  event: \"{tag}\";")), "{name} has no tag");
        }
        for code in crate::ErrorCode::ALL {
            assert!(ts.contains(&format!("  {}: {},\n", code.name(), code.rpc_code())), "{code} missing");
        }
        assert!(ts.contains(&format!("export const API_VERSION = \"{}\";", crate::API_VERSION)));
        assert!(!ts.contains(": any") && !ts.contains("<any"), "no `any` in the generated types");
        assert_eq!(ts, definitions(), "deterministic");
    }

    #[test]
    fn scalars_options_arrays_and_maps() {
        let defs = json!({ "Thing": { "type": "object", "properties": { "a": { "type": "string" } } } });
        let r = renderer(&defs);
        assert_eq!(r.ts_type(&json!({ "type": "integer", "format": "uint64" })), "number");
        assert_eq!(r.ts_type(&json!({ "type": ["string", "null"] })), "string | null");
        assert_eq!(r.ts_type(&json!({ "anyOf": [{ "$ref": "#/$defs/Thing" }, { "type": "null" }] })), "Thing | null");
        assert_eq!(r.ts_type(&json!({ "type": "array", "items": { "type": "string" } })), "string[]");
        assert_eq!(r.ts_type(&json!({ "type": "array", "items": { "enum": ["a", "b"] } })), "(\"a\" | \"b\")[]");
        assert_eq!(
            r.ts_type(&json!({ "type": "object", "additionalProperties": { "type": "string" } })),
            "Record<string, string>"
        );
        assert_eq!(r.ts_type(&json!({ "type": "object" })), "Record<string, never>");
        assert_eq!(
            r.ts_type(&json!({ "allOf": [{ "$ref": "#/$defs/Thing" }, { "enum": ["x", "y"] }] })),
            "Thing & (\"x\" | \"y\")"
        );
        assert_eq!(r.ts_type(&json!({})), "unknown");
    }

    #[test]
    fn objects_become_interfaces_with_optional_fields() {
        let defs = json!({
            "Thing": {
                "description": "A thing.\nSee [`Other::field`] and [`ErrorCode::SessionNotFound`]; */ is escaped.",
                "type": "object",
                "properties": {
                    "z": { "type": "string" },
                    "a": { "type": "boolean", "default": false, "description": "A flag." },
                    "m": { "type": ["integer", "null"] },
                },
                "required": ["z", "m"],
            },
            "Other": { "type": "object", "properties": { "field": { "type": "string" } } },
        });
        let mut out = String::new();
        let r = renderer(&defs);
        r.declaration(&mut out, "Thing", &defs["Thing"]);
        assert_eq!(
            out,
            "/**\n * A thing.\n * See {@link Other.field} and `\"session_not_found\"`; *\\/ is escaped.\n */\n\
             export interface Thing {\n  z: string;\n  m: number | null;\n  /**\n   * A flag.\n   *\n   * \
             @defaultValue `false`\n   */\n  a?: boolean;\n}\n\n"
        );
    }

    #[test]
    fn string_enums_become_unions_with_their_meanings() {
        let defs = json!({ "Mode": { "description": "How.", "oneOf": [
            { "enum": ["a"], "type": "string" },
            { "const": "b", "description": "Bee.", "type": "string" },
        ]}});
        let mut out = String::new();
        renderer(&defs).declaration(&mut out, "Mode", &defs["Mode"]);
        assert_eq!(out, "/**\n * How.\n *\n * - `\"b\"`: Bee.\n */\nexport type Mode = \"a\" | \"b\";\n\n");
    }

    #[test]
    fn tagged_unions_become_discriminated_unions() {
        let defs = json!({
            "Exit": { "type": "object", "properties": { "code": { "type": "integer" } }, "required": ["code"] },
            "AnEvent": {
                "type": "object",
                "properties": { "time_ms": { "type": "integer" } },
                "required": ["time_ms"],
                "oneOf": [
                    { "description": "Went.", "type": "object",
                      "properties": { "kind": { "const": "went_away", "type": "string" }, "why": { "type": "string" } },
                      "required": ["kind", "why"] },
                    { "$ref": "#/$defs/Exit", "type": "object",
                      "properties": { "kind": { "const": "exit", "type": "string" } }, "required": ["kind"] },
                ],
            },
        });
        let mut out = String::new();
        renderer(&defs).declaration(&mut out, "AnEvent", &defs["AnEvent"]);
        assert!(out.contains("export type AnEvent = AnEventBase & AnEventKind;\n"), "{out}");
        assert!(out.contains("export interface AnEventBase {\n  time_ms: number;\n}\n"), "{out}");
        assert!(out.contains("export type AnEventKind =\n  | WentAwayEvent\n  | ExitEvent;\n"), "{out}");
        assert!(out.contains("export const AN_EVENT_KINDS = [\n  \"went_away\",\n  \"exit\",\n] as const;"), "{out}");
        assert!(
            out.contains("/** Went. */\nexport interface WentAwayEvent {\n  kind: \"went_away\";\n  why: string;\n}"),
            "{out}"
        );
        assert!(out.contains("export interface ExitEvent extends Exit {\n  kind: \"exit\";\n}"), "{out}");
        let names = exported_names(&out);
        assert_eq!(names.len(), 6, "{names:?}");
    }

    #[test]
    fn names_convert() {
        assert_eq!(pascal_case("outputs_file_created"), "OutputsFileCreated");
        assert_eq!(upper_snake_case("SessionEvent"), "SESSION_EVENT");
        assert_eq!(last_word("SessionEvent"), "Event");
        assert_eq!(snake_case("SessionNotFound"), "session_not_found");
        assert_eq!(property_name("time_ms"), "time_ms");
        assert_eq!(property_name("session.start"), "\"session.start\"");
    }
}
