//! The reference half of `docs/ipc.md`, rendered from the JSON Schema document
//! ([`crate::schema::document`]): every method with its params and result, the notifications,
//! every event, the error codes and the types they use. `docs/ipc.md` holds it between
//! [`BEGIN_MARKER`] and [`END_MARKER`]; a test fails when that part is stale, and
//! `UMBRA_UPDATE_SCHEMA=1 cargo test -p umbra-api` rewrites it (never the hand-written part).
//!
//! The renderer knows JSON Schema only as far as schemars emits it for these types: `$ref`s into
//! `$defs`, string enums (`enum`, `const`, or a `oneOf` of those when variants are documented),
//! `Option`s (`"type": [T, "null"]` or `anyOf: [T, null]`), arrays, string maps, and the one
//! flattened, internally tagged enum (`SessionEvent`).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use serde_json::{Map, Value};

/// The line before the generated part of `docs/ipc.md`.
pub const BEGIN_MARKER: &str =
    "<!-- BEGIN GENERATED REFERENCE (cargo test -p umbra-api; UMBRA_UPDATE_SCHEMA=1 rewrites) -->";
/// The line after it.
pub const END_MARKER: &str = "<!-- END GENERATED REFERENCE -->";

/// The def whose variants are the events; rendered in its own section.
const EVENT_DEF: &str = "SessionEvent";
/// The def of the error codes; rendered as the error-code table.
const ERROR_DEF: &str = "ErrorCode";
/// The tag field of [`EVENT_DEF`]'s variants.
const EVENT_TAG: &str = "event";
/// An enum with more values than this is shown by name (a link), not by its values.
const MAX_INLINE_VALUES: usize = 8;

/// Meanings of error codes whose variants carry no doc comment yet; a doc comment on the
/// variant (which reaches the schema as a description) takes precedence.
const ERROR_FALLBACKS: &[(&str, &str)] = &[
    ("method_not_found", "No method of that name (see `daemon.info`'s `api_version`)."),
    ("timeout", "The guest did not answer in time."),
    ("unsupported", "This daemon, session or guest cannot do that (for example, a session without storage)."),
];

/// The generated reference: Markdown, deterministic, ending with a newline.
pub fn markdown() -> String {
    render(&crate::schema::document())
}

/// Renders a schema document of the shape [`crate::schema::document`] produces.
pub fn render(doc: &Value) -> String {
    let empty = Map::new();
    let defs = doc["$defs"].as_object().unwrap_or(&empty);
    let r = Renderer { defs };
    let methods = doc["methods"].as_object().unwrap_or(&empty);
    let notifications = doc["notifications"].as_object().unwrap_or(&empty);
    let plan = Plan::new(methods, notifications, defs);
    let mut out = String::new();

    let version = doc["api_version"].as_str().unwrap_or("?");
    let _ = write!(
        out,
        "## Reference\n\nThis part is generated from the Rust types in `host/api` (through the JSON Schema \
         `host/api/schema/umbrad-ipc.json`) for API version {version}; do not edit it by hand.\n\n\
         In the tables, required fields come first in their declared order, then optional ones by \
         name. An optional param may be left out (or sent as `null`); an optional result field may \
         be absent or `null`. Integers name their range (`uint64`, `int32`, …). A type in a link \
         is described under [Types](#types).\n\n"
    );

    // ---- methods
    out.push_str("## Methods\n\n| method | summary |\n|---|---|\n");
    for name in method_order(methods) {
        let summary = methods[name.as_str()]["summary"].as_str().unwrap_or("");
        let _ = writeln!(out, "| [`{name}`](#{}) | {} |", slug(&name), cell(&r.doc(summary)));
    }
    out.push('\n');
    for name in method_order(methods) {
        let m = &methods[name.as_str()];
        let _ = write!(out, "### {name}\n\n{}\n\n", r.doc(m["summary"].as_str().unwrap_or("")));
        r.params(&mut out, &m["params"]);
        r.result(&mut out, &m["result"], &plan);
    }

    // ---- notifications
    out.push_str(
        "## Notifications\n\nSent by umbrad without an `id` (nothing answers them); `method` names the \
         notification and `params` carries:\n\n",
    );
    for (name, n) in notifications {
        let _ = write!(out, "### {name}\n\n{}\n\n", r.doc(n["summary"].as_str().unwrap_or("")));
        let params = &n["params"];
        match ref_name(params) {
            Some(def) if def == EVENT_DEF => out.push_str("**Params**: an [event](#events).\n\n"),
            Some(def) if !plan.in_types.contains(def) => {
                out.push_str("**Params**\n\n");
                r.describe_def(&mut out, def);
                r.table(&mut out, &r.resolved_fields(&r.def(def)));
            }
            _ => {
                let _ = write!(out, "**Params**: {}\n\n", r.type_of(params));
            }
        }
    }

    // ---- events
    r.events(&mut out);

    // ---- error codes
    r.errors(&mut out, doc["errors"].as_array().map(Vec::as_slice).unwrap_or_default());

    // ---- types
    out.push_str("## Types\n\n");
    for name in &plan.in_types {
        let _ = write!(out, "<a id=\"{}\"></a>\n\n### {name}\n\n", type_anchor(name));
        r.describe_def(&mut out, name);
        let def = r.def(name);
        if let Some(values) = r.enum_values(&def) {
            out.push_str("| value | meaning |\n|---|---|\n");
            for (value, doc) in values {
                let _ = writeln!(out, "| `{}` | {} |", cell(&value), cell(&r.doc(doc.as_deref().unwrap_or(""))));
            }
            out.push('\n');
        } else {
            let fields = r.resolved_fields(&def);
            if fields.is_empty() {
                let _ = write!(out, "{}\n\n", r.type_of(&def));
            } else {
                r.table(&mut out, &fields);
            }
        }
    }
    while out.ends_with("\n\n") {
        out.pop();
    }
    out
}

/// Methods in declaration order ([`crate::methods::NAMES`]), then any others by name.
fn method_order(methods: &Map<String, Value>) -> Vec<String> {
    let mut names: Vec<String> =
        crate::methods::NAMES.iter().filter(|n| methods.contains_key(**n)).map(|n| n.to_string()).collect();
    names.extend(methods.keys().filter(|k| !crate::methods::NAMES.contains(&k.as_str())).cloned());
    names
}

/// Which defs get a section under "Types": everything except the events and error codes
/// (their own sections), empty objects (`{}`), and defs that only a method's params use or that
/// exactly one method's result (or one notification's params) uses — those are shown in place.
struct Plan {
    in_types: BTreeSet<String>,
}

impl Plan {
    fn new(methods: &Map<String, Value>, notifications: &Map<String, Value>, defs: &Map<String, Value>) -> Self {
        let mut uses: BTreeMap<String, usize> = BTreeMap::new();
        let mut top_level: BTreeSet<String> = BTreeSet::new();
        for m in methods.values() {
            // A method's params are always shown in place: they are not a use.
            if let Some(r) = ref_name(&m["result"]) {
                top_level.insert(r.to_string());
            }
            count_refs(&m["result"], &mut uses);
        }
        for n in notifications.values() {
            if let Some(r) = ref_name(&n["params"]) {
                top_level.insert(r.to_string());
            }
            count_refs(&n["params"], &mut uses);
        }
        for d in defs.values() {
            count_refs(d, &mut uses);
        }
        let in_types = defs
            .iter()
            .filter(|(name, def)| {
                let n = uses.get(name.as_str()).copied().unwrap_or(0);
                name.as_str() != EVENT_DEF
                    && name.as_str() != ERROR_DEF
                    && !is_empty_object(def)
                    && (n > 1 || (n == 1 && !top_level.contains(name.as_str())))
            })
            .map(|(name, _)| name.clone())
            .collect();
        Self { in_types }
    }
}

fn count_refs(v: &Value, uses: &mut BTreeMap<String, usize>) {
    match v {
        Value::Object(o) => {
            if let Some(r) = ref_name(v) {
                *uses.entry(r.to_string()).or_default() += 1;
            }
            for (k, x) in o {
                if k != "$ref" {
                    count_refs(x, uses);
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|x| count_refs(x, uses)),
        _ => {}
    }
}

/// The def a schema points at (`{"$ref": "#/$defs/Name", …}`).
fn ref_name(schema: &Value) -> Option<&str> {
    schema.get("$ref")?.as_str()?.strip_prefix("#/$defs/")
}

fn is_empty_object(def: &Value) -> bool {
    def.get("type").and_then(Value::as_str) == Some("object")
        && def.get("properties").is_none()
        && def.get("additionalProperties").is_none()
        && def.get("$ref").is_none()
        && def.get("oneOf").is_none()
}

/// A row of a field table.
#[derive(Debug, Clone, PartialEq)]
struct Field {
    name: String,
    schema: Value,
    required: bool,
}

/// An object schema's own fields: required ones in their declared order (schemars keeps it in
/// `required`; `properties` is sorted by name), then the optional ones by name.
fn self_fields(schema: &Value) -> Vec<Field> {
    let empty = Map::new();
    let props = schema.get("properties").and_then(Value::as_object).unwrap_or(&empty);
    let required: Vec<&str> =
        schema.get("required").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str).collect();
    let mut fields: Vec<Field> = required
        .iter()
        .filter_map(|r| props.get(*r).map(|s| Field { name: r.to_string(), schema: s.clone(), required: true }))
        .collect();
    for (name, s) in props {
        if !required.contains(&name.as_str()) {
            fields.push(Field { name: name.clone(), schema: s.clone(), required: false });
        }
    }
    fields
}

struct Renderer<'a> {
    defs: &'a Map<String, Value>,
}

impl Renderer<'_> {
    fn def(&self, name: &str) -> Value {
        self.defs.get(name).cloned().unwrap_or(Value::Null)
    }

    /// A schema with its `$ref` (if any) merged in: the def's fields, then the schema's own
    /// (a newtype variant of a tagged enum is `{"$ref": Def, "properties": {tag}}`).
    fn resolved_fields(&self, schema: &Value) -> Vec<Field> {
        let mut fields = match ref_name(schema) {
            Some(def) => self.resolved_fields(&self.def(def)),
            None => Vec::new(),
        };
        for f in self_fields(schema) {
            fields.retain(|g| g.name != f.name);
            fields.push(f);
        }
        fields
    }

    /// A description for Markdown: one paragraph, rustdoc links made readable.
    fn doc(&self, text: &str) -> String {
        let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
        let mut out = String::new();
        let mut rest = text.as_str();
        while let Some(start) = rest.find("[`") {
            let Some(len) = rest[start + 2..].find("`]") else { break };
            let target = &rest[start + 2..start + 2 + len];
            out.push_str(&rest[..start]);
            out.push_str(&self.intra_doc(target));
            rest = &rest[start + 2 + len + 2..];
        }
        out.push_str(rest);
        out
    }

    /// A rustdoc link (`[`NAME`]`) as a reader of the wire protocol needs it.
    fn intra_doc(&self, target: &str) -> String {
        match target {
            "OUTPUT_WINDOW" => format!("`OUTPUT_WINDOW` ({})", crate::methods::OUTPUT_WINDOW),
            "MAX_FILE_CHUNK" => format!("`MAX_FILE_CHUNK` ({})", crate::methods::MAX_FILE_CHUNK),
            "NOTIFY_EVENT" => format!("`{}`", crate::rpc::NOTIFY_EVENT),
            "NOTIFY_PROCESS" => format!("`{}`", crate::rpc::NOTIFY_PROCESS),
            "NOTIFY_LOST" => format!("`{}`", crate::rpc::NOTIFY_LOST),
            _ => match target.split_once("::") {
                Some((ERROR_DEF, variant)) => format!("`{}`", snake_case(variant)),
                Some((ty, member)) if self.defs.contains_key(ty) => {
                    format!("[`{ty}.{member}`](#{})", type_anchor(ty))
                }
                None if self.defs.contains_key(target) => self.link(target),
                _ => format!("`{}`", target.replace("::", ".")),
            },
        }
    }

    fn link(&self, def: &str) -> String {
        match def {
            EVENT_DEF => "[event](#events)".to_string(),
            ERROR_DEF => "[`ErrorCode`](#error-codes)".to_string(),
            _ => format!("[`{def}`](#{})", type_anchor(def)),
        }
    }

    /// The values of a string enum, with their descriptions; `None` if it is not one.
    fn enum_values(&self, schema: &Value) -> Option<Vec<(String, Option<String>)>> {
        let desc = |s: &Value| s.get("description").and_then(Value::as_str).map(str::to_string);
        if let Some(c) = schema.get("const") {
            return Some(vec![(json_literal(c), desc(schema))]);
        }
        if let Some(values) = schema.get("enum").and_then(Value::as_array) {
            return Some(values.iter().map(|v| (json_literal(v), None)).collect());
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

    /// A schema without its `null` alternative, and whether it had one.
    fn strip_null(&self, schema: &Value) -> (Value, bool) {
        if let Some(Value::Array(types)) = schema.get("type") {
            let rest: Vec<Value> = types.iter().filter(|t| t.as_str() != Some("null")).cloned().collect();
            if rest.len() < types.len() {
                let mut s = schema.clone();
                s["type"] = if rest.len() == 1 { rest[0].clone() } else { Value::Array(rest) };
                return (s, true);
            }
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(branches) = schema.get(key).and_then(Value::as_array) {
                let is_null = |b: &Value| b.get("type").and_then(Value::as_str) == Some("null");
                let rest: Vec<&Value> = branches.iter().filter(|b| !is_null(b)).collect();
                if rest.len() == 1 && branches.len() == 2 {
                    return (rest[0].clone(), true);
                }
            }
        }
        (schema.clone(), false)
    }

    /// A schema's type as a table shows it (Markdown).
    fn type_of(&self, schema: &Value) -> String {
        let (schema, _) = self.strip_null(schema);
        if let Some(def) = ref_name(&schema) {
            if def == ERROR_DEF || def == EVENT_DEF {
                return self.link(def);
            }
            let target = self.def(def);
            return match self.enum_values(&target) {
                Some(values) if values.len() <= MAX_INLINE_VALUES => {
                    let documented = values.iter().any(|(_, d)| d.is_some()) || target.get("description").is_some();
                    let shown = values_list(&values);
                    if documented {
                        format!("{shown} ({})", self.link(def))
                    } else {
                        shown
                    }
                }
                _ => self.link(def),
            };
        }
        if let Some(values) = self.enum_values(&schema) {
            return values_list(&values);
        }
        match schema.get("type") {
            Some(Value::String(t)) if t == "array" => {
                let item = schema.get("items").map(|i| self.type_of(i)).unwrap_or_else(|| "`any`".into());
                let simple =
                    item.len() > 2 && item.starts_with('`') && item.ends_with('`') && item.matches('`').count() == 2;
                if simple {
                    format!("{}[]`", &item[..item.len() - 1])
                } else if item.contains(" \\| ") {
                    format!("({item})`[]`")
                } else {
                    format!("{item}`[]`")
                }
            }
            Some(Value::String(t)) if t == "object" => match schema.get("additionalProperties") {
                Some(v) if v.is_object() => format!("`object` (`string` → {})", self.type_of(v)),
                _ => "`object`".to_string(),
            },
            Some(Value::String(t)) if t == "integer" || t == "number" => {
                let name = schema.get("format").and_then(Value::as_str).unwrap_or(t);
                let name = if name == "double" || name == "float" { "number" } else { name };
                format!("`{name}`")
            }
            Some(Value::String(t)) => format!("`{t}`"),
            Some(Value::Array(ts)) => {
                ts.iter().filter_map(Value::as_str).map(|t| format!("`{t}`")).collect::<Vec<_>>().join(" \\| ")
            }
            _ => "`any`".to_string(),
        }
    }

    /// A field table.
    fn table(&self, out: &mut String, fields: &[Field]) {
        out.push_str("| field | type | required | description |\n|---|---|---|---|\n");
        for f in fields {
            let (_, nullable) = self.strip_null(&f.schema);
            let required = match (f.required, f.schema.get("default")) {
                (true, _) if nullable => "yes (may be `null`)".to_string(),
                (true, _) => "yes".to_string(),
                (false, Some(d)) => format!("no (default `{}`)", cell(&json_literal(d))),
                (false, None) => "no".to_string(),
            };
            let desc = f.schema.get("description").and_then(Value::as_str).unwrap_or("");
            let _ = writeln!(
                out,
                "| `{}` | {} | {} | {} |",
                f.name,
                cell(&self.type_of(&f.schema)),
                required,
                cell(&self.doc(desc))
            );
        }
        out.push('\n');
    }

    /// A def's description, as a paragraph (nothing if it has none).
    fn describe_def(&self, out: &mut String, def: &str) {
        if let Some(d) = self.defs.get(def).and_then(|d| d.get("description")).and_then(Value::as_str) {
            let _ = write!(out, "{}\n\n", self.doc(d));
        }
    }

    fn params(&self, out: &mut String, params: &Value) {
        let def = ref_name(params).map(|d| self.def(d)).unwrap_or_else(|| params.clone());
        if is_empty_object(&def) {
            out.push_str("**Params**: none (send `{}`, or leave `params` out).\n\n");
            return;
        }
        let fields = self.resolved_fields(&def);
        if fields.is_empty() {
            let _ = write!(out, "**Params**: {}\n\n", self.type_of(params));
            return;
        }
        out.push_str("**Params**");
        if fields.iter().all(|f| !f.required) {
            out.push_str(" (all optional: `params` may be left out)");
        }
        out.push_str("\n\n");
        if let Some(d) = def.get("description").and_then(Value::as_str) {
            let _ = write!(out, "{}\n\n", self.doc(d));
        }
        self.table(out, &fields);
    }

    fn result(&self, out: &mut String, result: &Value, plan: &Plan) {
        let name = ref_name(result);
        let def = name.map(|d| self.def(d)).unwrap_or_else(|| result.clone());
        if is_empty_object(&def) {
            out.push_str("**Result**: `{}`\n\n");
            return;
        }
        if let Some(name) = name.filter(|n| plan.in_types.contains(*n)) {
            let _ = write!(out, "**Result**: {}\n\n", self.link(name));
            return;
        }
        let fields = self.resolved_fields(&def);
        if fields.is_empty() {
            let _ = write!(out, "**Result**: {}\n\n", self.type_of(result));
            return;
        }
        out.push_str("**Result**\n\n");
        if let Some(d) = def.get("description").and_then(Value::as_str) {
            let _ = write!(out, "{}\n\n", self.doc(d));
        }
        self.table(out, &fields);
    }

    /// The events: the common fields once, then each variant of the tagged `oneOf`.
    fn events(&self, out: &mut String) {
        let event = self.def(EVENT_DEF);
        out.push_str("## Events\n\n");
        if let Some(d) = event.get("description").and_then(Value::as_str) {
            let _ = write!(out, "{}\n\n", self.doc(d));
        }
        let variants: Vec<(String, Value)> = event
            .get("oneOf")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|v| Some((v["properties"][EVENT_TAG]["const"].as_str()?.to_string(), v.clone())))
            .collect();
        let _ = write!(
            out,
            "Every event is one JSON object: these fields, plus those of its kind, which `{EVENT_TAG}` names.\n\n"
        );
        let mut common = self_fields(&event);
        common.push(Field {
            name: EVENT_TAG.to_string(),
            schema: serde_json::json!({
                "type": "string",
                "description": "The kind of event, one of the sections below.",
            }),
            required: true,
        });
        self.table(out, &common);
        let _ = write!(
            out,
            "| event | summary |\n|---|---|\n{}\n",
            variants
                .iter()
                .map(|(n, v)| format!(
                    "| [`{n}`](#{}) | {} |\n",
                    slug(n),
                    cell(&self.doc(v.get("description").and_then(Value::as_str).unwrap_or("")))
                ))
                .collect::<String>()
        );
        for (name, variant) in &variants {
            let _ = write!(out, "### {name}\n\n");
            if let Some(d) = variant.get("description").and_then(Value::as_str) {
                let _ = write!(out, "{}\n\n", self.doc(d));
            }
            let fields: Vec<Field> =
                self.resolved_fields(variant).into_iter().filter(|f| f.name != EVENT_TAG).collect();
            if let Some(def) = ref_name(variant) {
                let _ = write!(out, "The fields of {}:\n\n", self.link(def));
            }
            if fields.is_empty() {
                out.push_str("No other fields.\n\n");
            } else {
                self.table(out, &fields);
            }
        }
    }

    /// The error codes, in their declared order, with the variants' descriptions.
    fn errors(&self, out: &mut String, errors: &[Value]) {
        let def = self.def(ERROR_DEF);
        let meanings: BTreeMap<String, Option<String>> =
            self.enum_values(&def).unwrap_or_default().into_iter().collect();
        out.push_str("## Error codes\n\n");
        if let Some(d) = def.get("description").and_then(Value::as_str) {
            let _ = write!(out, "{}\n\n", self.doc(d));
        }
        out.push_str(
            "An error response's `error.code` is the number, `error.data.code` the name; decide by the \
             name.\n\n| name | code | meaning |\n|---|---|---|\n",
        );
        for e in errors {
            let name = e["name"].as_str().unwrap_or("");
            let meaning = meanings
                .get(&format!("\"{name}\""))
                .cloned()
                .flatten()
                .or_else(|| ERROR_FALLBACKS.iter().find(|(n, _)| *n == name).map(|(_, m)| m.to_string()))
                .unwrap_or_default();
            let _ = writeln!(out, "| `{name}` | {} | {} |", e["code"], cell(&self.doc(&meaning)));
        }
        out.push('\n');
    }
}

/// Enum values as a table cell shows them: `"a"` \| `"b"`.
fn values_list(values: &[(String, Option<String>)]) -> String {
    values.iter().map(|(v, _)| format!("`{v}`")).collect::<Vec<_>>().join(" \\| ")
}

fn json_literal(v: &Value) -> String {
    serde_json::to_string(v).expect("JSON values serialize")
}

/// Text for a table cell: one line, pipes escaped.
fn cell(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut prev = '\0';
    for c in text.chars() {
        match c {
            '\n' | '\r' => out.push(' '),
            '|' if prev != '\\' => out.push_str("\\|"),
            c => out.push(c),
        }
        prev = c;
    }
    out
}

/// GitHub's anchor for a heading: lowercase, punctuation other than `-` and `_` dropped, spaces
/// as `-`.
fn slug(heading: &str) -> String {
    heading
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c.to_ascii_lowercase()),
            _ => None,
        })
        .collect()
}

/// The anchor of a type's section (explicit: `SessionList` and `session.list` would share a
/// heading anchor).
fn type_anchor(def: &str) -> String {
    format!("type-{}", def.to_ascii_lowercase())
}

fn snake_case(camel: &str) -> String {
    let mut out = String::new();
    for (i, c) in camel.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// `doc` with the part between the markers replaced by `reference`; an error if the markers
/// are missing or out of order.
pub fn splice(doc: &str, reference: &str) -> Result<String, String> {
    let begin = doc.find(BEGIN_MARKER).ok_or_else(|| format!("no line {BEGIN_MARKER}"))?;
    let after_begin = begin + BEGIN_MARKER.len();
    let end =
        doc[after_begin..].find(END_MARKER).ok_or_else(|| format!("no line {END_MARKER} after the begin marker"))?
            + after_begin;
    Ok(format!("{}{BEGIN_MARKER}\n\n{}\n\n{}", &doc[..begin], reference.trim_end(), &doc[end..]))
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use serde_json::json;

    use super::*;

    fn renderer(defs: &Value) -> Renderer<'_> {
        Renderer { defs: defs.as_object().unwrap() }
    }

    #[test]
    fn the_reference_in_docs_ipc_md_is_current() {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/ipc.md");
        let doc = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let fresh = splice(&doc, &markdown()).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        crate::assert_generated_current(&path, &fresh);
    }

    #[test]
    fn everything_in_the_schema_is_documented() {
        let doc = crate::schema::document();
        let md = markdown();
        let methods = doc["methods"].as_object().unwrap();
        assert_eq!(methods.len(), crate::methods::NAMES.len(), "NAMES and the schema agree");
        let mut last = 0;
        for name in crate::methods::NAMES {
            let at = md.find(&format!("\n### {name}\n")).unwrap_or_else(|| panic!("no section for {name}"));
            assert!(at > last, "{name} is out of declaration order");
            last = at;
        }
        for name in doc["notifications"].as_object().unwrap().keys() {
            assert!(md.contains(&format!("\n### {name}\n")), "no section for notification {name}");
        }
        for variant in doc["$defs"][EVENT_DEF]["oneOf"].as_array().unwrap() {
            let name = variant["properties"][EVENT_TAG]["const"].as_str().unwrap();
            assert!(md.contains(&format!("\n### {name}\n")), "no section for event {name}");
        }
        for code in crate::ErrorCode::ALL {
            let row = format!("| `{}` | {} | ", code.name(), code.rpc_code());
            let line = md.lines().find(|l| l.starts_with(&row)).unwrap_or_else(|| panic!("no row for {code}"));
            assert!(!line.ends_with("|  |"), "{code} has no meaning: give its variant a doc comment");
        }
        // Every link into Types has a target.
        for part in md.split("](#type-").skip(1) {
            let anchor = part.split(')').next().unwrap();
            assert!(md.contains(&format!("<a id=\"type-{anchor}\"></a>")), "dangling link to type-{anchor}");
        }
        for (name, _) in doc["$defs"].as_object().unwrap() {
            assert!(!md.contains(&format!("[`{name}`](#{})", slug(name))), "a type linked by heading slug");
        }
        assert_eq!(md, markdown(), "deterministic");
    }

    #[test]
    fn refs_resolve_to_links_or_inline_values() {
        let defs = json!({
            "Mode": { "description": "How.", "oneOf": [
                { "enum": ["a"], "type": "string" },
                { "const": "b", "description": "Bee.", "type": "string" },
            ]},
            "Plain": { "enum": ["x", "y"], "type": "string" },
            "Thing": { "type": "object", "properties": { "n": { "type": "integer", "format": "uint32" } } },
            "Many": { "enum": ["1", "2", "3", "4", "5", "6", "7", "8", "9"], "type": "string" },
        });
        let r = renderer(&defs);
        assert_eq!(r.type_of(&json!({ "$ref": "#/$defs/Thing" })), "[`Thing`](#type-thing)");
        assert_eq!(r.type_of(&json!({ "$ref": "#/$defs/Plain" })), "`\"x\"` \\| `\"y\"`", "undocumented: values only");
        assert_eq!(
            r.type_of(&json!({ "$ref": "#/$defs/Mode" })),
            "`\"a\"` \\| `\"b\"` ([`Mode`](#type-mode))",
            "documented values link to their descriptions"
        );
        assert_eq!(r.type_of(&json!({ "$ref": "#/$defs/Many" })), "[`Many`](#type-many)", "too many to inline");
        assert_eq!(r.type_of(&json!({ "$ref": "#/$defs/ErrorCode" })), "[`ErrorCode`](#error-codes)");
        assert_eq!(
            r.type_of(&json!({ "type": "array", "items": { "$ref": "#/$defs/Thing" } })),
            "[`Thing`](#type-thing)`[]`"
        );
        assert_eq!(
            r.type_of(&json!({ "type": "array", "items": { "$ref": "#/$defs/Plain" } })),
            "(`\"x\"` \\| `\"y\"`)`[]`"
        );
        assert_eq!(
            r.type_of(&json!({ "type": "object", "additionalProperties": { "type": "string" } })),
            "`object` (`string` → `string`)"
        );
        assert_eq!(r.type_of(&json!({ "type": "number", "format": "double" })), "`number`");
        assert_eq!(r.type_of(&json!({ "type": "integer", "format": "int64" })), "`int64`");
        assert_eq!(r.type_of(&json!({ "const": "status", "type": "string" })), "`\"status\"`");
        assert_eq!(r.type_of(&json!({})), "`any`");
        assert_eq!(r.type_of(&json!({ "type": "array", "items": { "type": "string" } })), "`string[]`");
    }

    #[test]
    fn options_are_optional_fields_of_the_underlying_type() {
        let defs = json!({ "Thing": { "type": "object" } });
        let r = renderer(&defs);
        for nullable in
            [json!({ "type": ["string", "null"] }), json!({ "anyOf": [{ "type": "string" }, { "type": "null" }] })]
        {
            assert_eq!(r.type_of(&nullable), "`string`");
            assert!(r.strip_null(&nullable).1);
        }
        assert_eq!(
            r.type_of(&json!({ "anyOf": [{ "$ref": "#/$defs/Thing" }, { "type": "null" }] })),
            "[`Thing`](#type-thing)"
        );
        assert!(!r.strip_null(&json!({ "type": "string" })).1);

        let schema = json!({
            "type": "object",
            "properties": {
                "z": { "type": "string" },
                "a": { "type": "boolean", "default": false, "description": "Flag |\nsecond line." },
                "m": { "type": ["integer", "null"], "format": "int32" },
                "b": { "type": "string" },
            },
            "required": ["z", "b", "m"],
        });
        let fields = self_fields(&schema);
        let names: Vec<&str> = fields.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["z", "b", "m", "a"], "required in declared order, then optional by name");
        let mut out = String::new();
        r.table(&mut out, &fields);
        assert!(out.contains("| `m` | `int32` | yes (may be `null`) |  |"), "{out}");
        assert!(out.contains("| `a` | `boolean` | no (default `false`) | Flag \\| second line. |"), "{out}");
    }

    #[test]
    fn tagged_variants_merge_their_def_and_drop_the_tag() {
        let defs = json!({
            "Exit": { "type": "object", "properties": { "code": { "type": "integer", "format": "int32" },
                "process": { "type": "integer", "format": "uint64" } }, "required": ["process"] },
        });
        let r = renderer(&defs);
        let variant =
            json!({ "$ref": "#/$defs/Exit", "properties": { "event": { "const": "exit" } }, "required": ["event"] });
        let names: Vec<(String, bool)> =
            r.resolved_fields(&variant).into_iter().map(|f| (f.name, f.required)).collect();
        assert_eq!(names, [("process".into(), true), ("code".into(), false), ("event".into(), true)]);
    }

    #[test]
    fn rustdoc_links_become_readable() {
        let defs = json!({ "SessionSettings": {} });
        let r = renderer(&defs);
        assert_eq!(r.doc("see [`ErrorCode::Unknown`]."), "see `unknown`.");
        assert_eq!(r.doc("at most\n[`MAX_FILE_CHUNK`]"), "at most `MAX_FILE_CHUNK` (1048576)");
        assert_eq!(r.doc("[`SessionSettings::bundle`]"), "[`SessionSettings.bundle`](#type-sessionsettings)");
        assert_eq!(r.doc("[`Nope::x`] and [`y`"), "`Nope.x` and [`y`");
    }

    #[test]
    fn splicing_replaces_only_the_generated_part() {
        let doc = format!("# Title\nhand\n{BEGIN_MARKER}\nold\n{END_MARKER}\ntail\n");
        let new = splice(&doc, "new\n").unwrap();
        assert_eq!(new, format!("# Title\nhand\n{BEGIN_MARKER}\n\nnew\n\n{END_MARKER}\ntail\n"));
        assert_eq!(splice(&new, "new").unwrap(), new, "idempotent");
        assert!(splice("no markers", "x").is_err());
        assert!(splice(&format!("{END_MARKER}\n{BEGIN_MARKER}\n"), "x").is_err());
    }

    #[test]
    fn slugs_follow_github() {
        assert_eq!(slug("session.start"), "sessionstart");
        assert_eq!(slug("Error codes"), "error-codes");
        assert_eq!(slug("shadow_exported"), "shadow_exported");
    }
}
