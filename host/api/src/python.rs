//! Python declarations of the IPC, rendered from the same JSON Schema document as the
//! TypeScript ones ([`crate::schema::document`]), for the Python client (`host/client-py`, the
//! package `umbra`). `host/client-py/src/umbra/_generated.py` is [`definitions`], checked in; a
//! test fails when it is stale, and `UMBRA_UPDATE_SCHEMA=1 cargo test -p umbra-api` rewrites it.
//!
//! What becomes what (Python has no intersection types, so objects are flattened):
//!
//! - an object with properties → a `TypedDict` (fields that are not required are
//!   `NotRequired`); one whose field names are not all identifiers (`from`) uses the functional
//!   form;
//! - a string enum → a `Literal` alias;
//! - an internally tagged `oneOf` (`SessionEvent`) → one `TypedDict` per variant holding the
//!   common fields, the tag as a `Literal` and the variant's own, their union, and a tuple of
//!   the tag values (`SESSION_EVENT_KINDS`);
//! - `anyOf`/`oneOf` → a union, a one-element `allOf` → its element (a longer one, and an
//!   object without a declaration of its own → `dict[str, Any]`), arrays → `list`, string maps
//!   → `dict[str, T]`, nullable → `T | None`;
//! - declarations come in the order Python needs at import time (a class after its bases, an
//!   alias after its operands; annotations are lazy), so aliases are real types;
//! - the document's errors → `ERROR_CODES` and one exception class per code (subclasses of
//!   `UmbraError`, which `umbra._base` defines), its methods → `METHOD_NAMES` and `MethodName`.

use std::collections::HashMap;
use std::fmt::Write as _;

use serde_json::{Map, Value};

use crate::typescript::{
    fields, json_literal, last_word, one_line, pascal_case, ref_name, tagged_union, upper_snake_case,
};

/// Where the generated file lives, relative to the workspace root.
pub const GENERATED_PATH: &str = "host/client-py/src/umbra/_generated.py";

const KEYWORDS: &[&str] = &[
    "False", "None", "True", "and", "as", "assert", "async", "await", "break", "class", "continue", "def", "del",
    "elif", "else", "except", "finally", "for", "from", "global", "if", "import", "in", "is", "lambda", "nonlocal",
    "not", "or", "pass", "raise", "return", "try", "while", "with", "yield",
];

/// The generated Python: deterministic, ending with a newline.
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
        "# Generated from the Rust types in host/api (through the JSON Schema\n\
         # host/api/schema/umbrad-ipc.json) by host/api/src/python.rs: do not edit.\n\
         # `UMBRA_UPDATE_SCHEMA=1 cargo test -p umbra-api` rewrites it; a test fails when it is stale.\n\
         # The wire protocol and what every field means: docs/ipc.md.\n\
         \"\"\"The IPC's types, constants and error classes (generated).\"\"\"\n\n\
         from __future__ import annotations\n\n\
         from typing import Any, Literal, NotRequired, TypeAlias, TypedDict\n\n\
         from ._base import UmbraError\n\n\
         #: The IPC contract's version (`major.minor`) these types describe.\n\
         API_VERSION = {}\n\
         #: Bytes of each output stream umbrad sends before it waits for `process.ack`.\n\
         OUTPUT_WINDOW = {}\n\
         #: Largest read or write of `file.read` / `file.write` in one request.\n\
         MAX_FILE_CHUNK = {}\n\n",
        json_literal(&Value::String(version.to_string())),
        crate::methods::OUTPUT_WINDOW,
        crate::methods::MAX_FILE_CHUNK,
    );

    let mut decls = Vec::new();
    for (name, def) in defs {
        r.declaration(&mut decls, name, def);
    }
    for d in ordered(decls) {
        out.push_str(d.text.trim_end());
        out.push_str("\n\n\n");
    }

    let methods = doc["methods"].as_object().unwrap_or(&empty);
    let mut names: Vec<&str> = crate::methods::NAMES.iter().copied().filter(|n| methods.contains_key(*n)).collect();
    names.extend(methods.keys().map(String::as_str).filter(|k| !crate::methods::NAMES.contains(k)));
    let quoted: Vec<String> = names.iter().map(|n| json_literal(&Value::String(n.to_string()))).collect();
    let _ = write!(
        out,
        "#: Every method umbrad serves, in documentation order.\nMETHOD_NAMES = (\n{})\n\n\
         #: A method's name.\nMethodName: TypeAlias = Literal[\n{}]\n\n",
        quoted.iter().map(|q| format!("    {q},\n")).collect::<String>(),
        quoted.iter().map(|q| format!("    {q},\n")).collect::<String>(),
    );
    out.push_str("#: Each method's params and result types, by name.\nMETHOD_TYPES: dict[str, tuple[str, str]] = {\n");
    for name in &names {
        let m = &methods[*name];
        let _ = writeln!(
            out,
            "    {}: ({}, {}),",
            json_literal(&Value::String(name.to_string())),
            json_literal(&Value::String(r.py_type(&m["params"]))),
            json_literal(&Value::String(r.py_type(&m["result"])))
        );
    }
    out.push_str("}\n\n");

    // ---- error codes and classes
    out.push_str(
        "#: Every error code's JSON-RPC number (`error.code`), by its stable name (`error.data.code`).\n\
         ERROR_CODES: dict[str, int] = {\n",
    );
    let errors = doc["errors"].as_array().map(Vec::as_slice).unwrap_or_default();
    for e in errors {
        let _ = writeln!(out, "    {}: {},", json_literal(&e["name"]), e["code"]);
    }
    out.push_str("}\n\n");
    let mut classes = Vec::new();
    for e in errors {
        let code = e["name"].as_str().unwrap_or("");
        let class = match code {
            "internal" => "InternalError".to_string(),
            "io" => "IoError".to_string(),
            "timeout" => "UmbraTimeoutError".to_string(),
            _ => format!("{}Error", pascal_case(code).trim_end_matches("Error")),
        };
        let doc = e["description"].as_str().map(one_line).unwrap_or_default();
        let _ = write!(
            out,
            "\nclass {class}(UmbraError):\n    \"\"\"{}\"\"\"\n\n    code = {}\n\n",
            py_doc(if doc.is_empty() { code } else { &doc }),
            json_literal(&Value::String(code.to_string()))
        );
        classes.push((code.to_string(), class));
    }
    out.push_str("\n#: The exception class of each error code.\nERROR_CLASSES: dict[str, type[UmbraError]] = {\n");
    for (code, class) in &classes {
        let _ = writeln!(out, "    {}: {class},", json_literal(&Value::String(code.clone())));
    }
    out.push_str("}\n");
    out
}

/// Text for a docstring: nothing that would end it.
fn py_doc(text: &str) -> String {
    text.replace('\\', "\\\\").replace("\"\"\"", "'''")
}

fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !KEYWORDS.contains(&name)
}

struct Renderer<'a> {
    defs: &'a Map<String, Value>,
}

impl Renderer<'_> {
    /// The values of a string enum; `None` if it is not one.
    fn enum_values(&self, schema: &Value) -> Option<Vec<Value>> {
        if let Some(c) = schema.get("const") {
            return Some(vec![c.clone()]);
        }
        if let Some(values) = schema.get("enum").and_then(Value::as_array) {
            return Some(values.clone());
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

    fn is_typed_dict(&self, name: &str) -> bool {
        self.defs.get(name).is_some_and(|d| {
            d.get("properties").is_some()
                && d.get("additionalProperties").is_none()
                && tagged_union(d).is_none()
                && self.enum_values(d).is_none()
        })
    }

    fn declaration(&self, decls: &mut Vec<Decl>, name: &str, def: &Value) {
        let description = def.get("description").and_then(Value::as_str).unwrap_or("");
        if let Some(values) = self.enum_values(def) {
            let mut text = String::new();
            comment(&mut text, description);
            let literals: Vec<String> = values.iter().map(json_literal).collect();
            let _ = write!(text, "{name}: TypeAlias = Literal[{}]\n\n", literals.join(", "));
            decls.push(Decl { name: name.into(), text, deps: Vec::new() });
            return;
        }
        if let Some((tag, variants)) = tagged_union(def) {
            self.tagged(decls, name, description, def, &tag, &variants);
            return;
        }
        if self.is_typed_dict(name) {
            self.typed_dict(decls, name, description, &[], &[def], None);
        } else {
            let mut text = String::new();
            comment(&mut text, description);
            let expr = self.py_type(def);
            let _ = write!(text, "{name}: TypeAlias = {expr}\n\n");
            decls.push(Decl { name: name.into(), deps: identifiers(&expr), text });
        }
    }

    /// A `TypedDict` named `name` with the fields of every schema in `parts` (later ones
    /// override), extending `bases`; with `tag`, that field is a `Literal` of its value.
    fn typed_dict(
        &self,
        decls: &mut Vec<Decl>,
        name: &str,
        description: &str,
        bases: &[&str],
        parts: &[&Value],
        tag: Option<(&str, &str)>,
    ) {
        let mut all: Vec<(String, String, bool, String)> = Vec::new();
        let mut put = |field: String, ty: String, required: bool, doc: String| {
            all.retain(|(f, ..)| *f != field);
            all.push((field, ty, required, doc));
        };
        for part in parts {
            for f in fields(part) {
                let doc = f.schema.get("description").and_then(Value::as_str).map(one_line).unwrap_or_default();
                put(f.name.to_string(), self.py_type(f.schema), f.required, doc);
            }
        }
        if let Some((t, value)) = tag {
            put(t.to_string(), format!("Literal[{}]", json_literal(&Value::String(value.into()))), true, String::new());
        }
        let field_type =
            |ty: &str, required: bool| if required { ty.to_string() } else { format!("NotRequired[{ty}]") };
        let mut text = String::new();
        let out = &mut text;
        let base_list = if bases.is_empty() { "TypedDict".to_string() } else { bases.join(", ") };
        if all.iter().all(|(f, ..)| is_identifier(f)) {
            let _ = writeln!(out, "class {name}({base_list}):");
            let doc = py_doc(description.trim());
            if !doc.is_empty() {
                let _ = writeln!(out, "    \"\"\"{}\"\"\"\n", doc.replace('\n', "\n    ").replace("\n    \n", "\n\n"));
            }
            if all.is_empty() && doc.is_empty() {
                out.push_str("    pass\n");
            }
            for (f, ty, required, doc) in &all {
                if !doc.is_empty() {
                    let _ = writeln!(out, "    #: {doc}");
                }
                let _ = writeln!(out, "    {f}: {}", field_type(ty, *required));
            }
            out.push_str("\n\n");
        } else {
            comment(out, description);
            // The functional form cannot extend: the bases' fields are listed again.
            let mut inherited = Vec::new();
            for b in bases {
                if let Some(d) = self.defs.get(*b) {
                    inherited.push(d);
                }
            }
            let _ = writeln!(out, "{name} = TypedDict(\n    {},\n    {{", json_literal(&Value::String(name.into())));
            let mut seen = Vec::new();
            for d in &inherited {
                for f in fields(d) {
                    if all.iter().any(|(n, ..)| n == f.name) {
                        continue;
                    }
                    seen.push(f.name.to_string());
                    let _ = writeln!(
                        out,
                        "        {}: {},",
                        json_literal(&Value::String(f.name.into())),
                        json_literal(&Value::String(field_type(&self.py_type(f.schema), f.required)))
                    );
                }
            }
            for (f, ty, required, _) in &all {
                let _ = writeln!(
                    out,
                    "        {}: {},",
                    json_literal(&Value::String(f.clone())),
                    json_literal(&Value::String(field_type(ty, *required)))
                );
            }
            out.push_str("    },\n)\n\n");
        }
        // A class needs its bases first; its fields' annotations are lazy (`annotations`).
        decls.push(Decl { name: name.into(), text, deps: bases.iter().map(|b| b.to_string()).collect() });
    }

    fn tagged(
        &self,
        decls: &mut Vec<Decl>,
        name: &str,
        description: &str,
        def: &Value,
        tag: &str,
        variants: &[(String, &Value)],
    ) {
        let suffix = last_word(name);
        let names: Vec<String> = variants.iter().map(|(v, _)| format!("{}{suffix}", pascal_case(v))).collect();
        let mut doc = description.to_string();
        let _ = write!(doc, "{}The `{tag}` field tells the kinds apart.", if doc.is_empty() { "" } else { "\n\n" });
        let mut text = String::new();
        comment(&mut text, &doc);
        let _ = write!(text, "{name}: TypeAlias = {}\n\n", names.join(" | "));
        decls.push(Decl { name: name.into(), text, deps: names.clone() });
        let kinds = format!("{}_KINDS", upper_snake_case(name));
        let text = format!(
            "#: Every value of {name}'s `{tag}` field, in declaration order.\n{kinds} = (\n{})\n\n",
            variants
                .iter()
                .map(|(v, _)| format!("    {},\n", json_literal(&Value::String(v.clone()))))
                .collect::<String>()
        );
        decls.push(Decl { name: kinds, text, deps: Vec::new() });
        for ((value, variant), type_name) in variants.iter().zip(&names) {
            let doc = variant.get("description").and_then(Value::as_str).unwrap_or("");
            let doc = if doc.is_empty() { format!("`{tag}`: `{value}`.") } else { doc.to_string() };
            let target = ref_name(variant).filter(|t| self.is_typed_dict(t));
            let bases: Vec<&str> = target.into_iter().collect();
            self.typed_dict(decls, type_name, &doc, &bases, &[def, variant], Some((tag, value)));
        }
    }

    /// A schema as a Python type expression.
    fn py_type(&self, schema: &Value) -> String {
        if let Some(Value::Array(types)) = schema.get("type") {
            if types.len() > 1 {
                let mut alternatives: Vec<String> = types
                    .iter()
                    .filter_map(Value::as_str)
                    .filter(|t| *t != "null")
                    .map(|t| {
                        let mut s = schema.clone();
                        s["type"] = Value::String(t.to_string());
                        self.py_type(&s)
                    })
                    .collect();
                if types.iter().any(|t| t == "null") {
                    alternatives.push("None".into());
                }
                return alternatives.join(" | ");
            }
        }
        if let Some(target) = ref_name(schema) {
            return if schema.get("properties").is_some() { "dict[str, Any]".into() } else { target.to_string() };
        }
        if let Some(values) = self.enum_values(schema) {
            return format!("Literal[{}]", values.iter().map(json_literal).collect::<Vec<_>>().join(", "));
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(branches) = schema.get(key).and_then(Value::as_array) {
                let mut parts: Vec<String> = Vec::new();
                for b in branches {
                    let t = self.py_type(b);
                    if !parts.contains(&t) {
                        parts.push(t);
                    }
                }
                return parts.join(" | ");
            }
        }
        if let Some(branches) = schema.get("allOf").and_then(Value::as_array) {
            return match branches.as_slice() {
                [one] => self.py_type(one),
                _ => "dict[str, Any]".into(),
            };
        }
        match schema.get("type").and_then(Value::as_str) {
            Some("string") => "str".into(),
            Some("integer") => "int".into(),
            Some("number") => "float".into(),
            Some("boolean") => "bool".into(),
            Some("null") => "None".into(),
            Some("array") => {
                format!("list[{}]", schema.get("items").map(|i| self.py_type(i)).unwrap_or("Any".into()))
            }
            Some("object") => match schema.get("additionalProperties") {
                Some(v @ Value::Object(_)) if schema.get("properties").is_none() => {
                    format!("dict[str, {}]", self.py_type(v))
                }
                _ => "dict[str, Any]".into(),
            },
            _ => "Any".into(),
        }
    }
}

/// One top-level declaration of the generated module, and the names it needs defined before it
/// (at import time: a class's bases, an alias's operands).
struct Decl {
    name: String,
    text: String,
    deps: Vec<String>,
}

/// The identifiers in a type expression.
fn identifiers(expr: &str) -> Vec<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .map(str::to_string)
        .collect()
}

/// `decls` with each after what it needs (depth first, in their own order otherwise, so the
/// output is deterministic). Names that are not declarations here (`str`, `Literal`) are ignored.
fn ordered(decls: Vec<Decl>) -> Vec<Decl> {
    fn visit(i: usize, decls: &[Decl], index: &HashMap<&str, usize>, state: &mut [u8], order: &mut Vec<usize>) {
        if state[i] != 0 {
            return; // done, or a cycle (only lazy references can form one)
        }
        state[i] = 1;
        for d in &decls[i].deps {
            if let Some(&j) = index.get(d.as_str()) {
                visit(j, decls, index, state, order);
            }
        }
        state[i] = 2;
        order.push(i);
    }
    let index: HashMap<&str, usize> = decls.iter().enumerate().map(|(i, d)| (d.name.as_str(), i)).collect();
    let mut state = vec![0u8; decls.len()];
    let mut order = Vec::new();
    for i in 0..decls.len() {
        visit(i, &decls, &index, &mut state, &mut order);
    }
    drop(index);
    let mut slots: Vec<Option<Decl>> = decls.into_iter().map(Some).collect();
    order.into_iter().filter_map(|i| slots[i].take()).collect()
}

/// `#:` comment lines (a documentation comment for the next name).
fn comment(out: &mut String, text: &str) {
    for line in text.trim().lines() {
        let line = line.trim_end();
        if line.is_empty() {
            out.push_str("#:\n");
        } else {
            let _ = writeln!(out, "#: {line}");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use serde_json::json;

    use super::*;

    #[test]
    fn the_python_client_types_are_current() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).ancestors().nth(2).expect("host/api is two levels down");
        crate::assert_generated_current(&root.join(GENERATED_PATH), &definitions());
    }

    #[test]
    fn every_def_method_and_error_code_is_declared() {
        let doc = crate::schema::document();
        let py = definitions();
        for name in doc["$defs"].as_object().unwrap().keys() {
            assert!(
                py.contains(&format!("class {name}("))
                    || py.contains(&format!("\n{name}: TypeAlias"))
                    || py.contains(&format!("\n{name} = TypedDict(")),
                "{name} is not declared"
            );
        }
        for m in crate::methods::NAMES {
            assert!(py.contains(&format!("    \"{m}\",\n")), "{m}");
        }
        for e in doc["errors"].as_array().unwrap() {
            assert!(py.contains(&format!("    {}: {},", json_literal(&e["name"]), e["code"])), "{e}");
        }
    }

    #[test]
    fn objects_enums_and_tagged_unions() {
        let defs = json!({
            "Mode": { "enum": ["a", "b"], "type": "string" },
            "Thing": { "type": "object", "description": "A thing.", "properties": {
                "a": { "type": "string" }, "b": { "type": ["integer", "null"] },
                "m": { "$ref": "#/$defs/Mode" }, "xs": { "type": "array", "items": { "type": "number" } },
                "env": { "type": "object", "additionalProperties": { "type": "string" } }
            }, "required": ["a"] },
            "Attach": { "type": "object", "properties": { "from": { "type": "integer" } } },
            "Event": { "type": "object", "properties": { "time_ms": { "type": "integer" } }, "required": ["time_ms"],
                "oneOf": [
                    { "type": "object", "properties": { "event": { "const": "exit" }, "code": { "type": "integer" } },
                      "required": ["event", "code"] },
                    { "type": "object", "properties": { "event": { "const": "boot_queued" } }, "required": ["event"] }
                ] }
        });
        let doc = json!({ "$defs": defs, "methods": {}, "errors": [{"name": "io", "code": -32017}] });
        let py = render(&doc);
        assert!(py.contains("Mode: TypeAlias = Literal[\"a\", \"b\"]"), "{py}");
        assert!(py.contains("class Thing(TypedDict):\n    \"\"\"A thing.\"\"\""), "{py}");
        assert!(py.contains("    a: str\n"), "{py}");
        assert!(py.contains("    b: NotRequired[int | None]\n"), "{py}");
        assert!(py.contains("    m: NotRequired[Mode]\n"), "{py}");
        assert!(py.contains("    xs: NotRequired[list[float]]\n"), "{py}");
        assert!(py.contains("    env: NotRequired[dict[str, str]]\n"), "{py}");
        assert!(
            py.contains("Attach = TypedDict(\n    \"Attach\",\n    {\n        \"from\": \"NotRequired[int]\","),
            "{py}"
        );
        assert!(py.contains("Event: TypeAlias = ExitEvent | BootQueuedEvent"), "{py}");
        assert!(py.find("class ExitEvent(").unwrap() < py.find("Event: TypeAlias").unwrap(), "operands first: {py}");
        assert!(py.contains("EVENT_KINDS = (\n    \"exit\",\n    \"boot_queued\",\n)"), "{py}");
        assert!(py.contains("class ExitEvent(TypedDict):"), "{py}");
        assert!(py.contains("    time_ms: int\n    code: int\n    event: Literal[\"exit\"]\n"), "{py}");
        assert!(py.contains("class IoError(UmbraError):"), "{py}");
    }
}
