//! Language servers in the guest (`lsp.*`) and diagnostics for a proposed change
//! (`diagnostics.for_change`): `docs/diagnostics.md`.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The languages Umbra knows a server for, by name (`language`) and by file extension.
pub const LANGUAGES: &[(&str, &[&str])] =
    &[("python", &["py", "pyi"]), ("c", &["c", "h"]), ("cpp", &["cc", "cpp", "cxx", "hh", "hpp", "hxx"])];

/// The server a language runs: the standard image carries both.
pub fn default_command(language: &str) -> Option<Vec<String>> {
    let argv: &[&str] = match language {
        "python" => &["pylsp"],
        "c" | "cpp" => &["clangd", "--log=error", "--background-index=false", "--use-dirty-headers"],
        _ => return None,
    };
    Some(argv.iter().map(|s| s.to_string()).collect())
}

/// The language of a file, by its extension.
pub fn language_of(path: &str) -> Option<&'static str> {
    let ext = path.rsplit_once('.').map(|(_, e)| e)?;
    LANGUAGES.iter().find(|(_, exts)| exts.contains(&ext)).map(|(name, _)| *name)
}

/// Params of `lsp.start`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct LspStartParams {
    pub session: String,
    /// The folder (by name) the server works on: its root is the folder's guest path.
    pub folder: String,
    /// `python` (pylsp), `c` or `cpp` (clangd): the servers the standard image carries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub language: Option<String>,
    /// Another server to run instead (argv in the guest, speaking LSP on stdin and stdout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<String>>,
    /// The `initializationOptions` of its `initialize` request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization_options: Option<Value>,
}

/// A running language server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct LspServerInfo {
    /// Names it in `lsp.request`, `lsp.notify`, `lsp.stop` and `lsp_notification` events.
    pub server: u64,
    pub folder: String,
    /// Its workspace root in the guest (`file://` + this is its `rootUri`).
    pub root: String,
    pub command: Vec<String>,
    /// What it answered `initialize` with: `capabilities` and `serverInfo`.
    #[serde(default)]
    pub initialize: Value,
}

/// Params of `lsp.request`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct LspRequestParams {
    pub session: String,
    pub server: u64,
    /// An LSP method: `textDocument/definition`, `textDocument/hover`, ...
    pub method: String,
    #[serde(default)]
    pub params: Value,
    /// How long to wait for its answer (default 30 000, at most 300 000); past it the request
    /// is cancelled (`$/cancelRequest`) and the error is `timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

/// The server's answer to `lsp.request` (an LSP error answer is the call's error instead:
/// `guest_error`, with the server's code and message).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct LspResult {
    #[serde(default)]
    pub result: Value,
}

/// Params of `lsp.notify`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct LspNotifyParams {
    pub session: String,
    pub server: u64,
    /// `textDocument/didOpen`, `textDocument/didChange`, ...
    pub method: String,
    #[serde(default)]
    pub params: Value,
}

/// A language server of a session (`lsp.stop`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct LspRef {
    pub session: String,
    pub server: u64,
}

/// A session's language servers (`lsp.list`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct LspList {
    pub servers: Vec<LspServerInfo>,
}

/// Params of `diagnostics.for_change`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ForChangeParams {
    pub session: String,
    /// The folder (by name) the change is to: a shadow or read-only folder, or any other.
    pub folder: String,
    /// Path in the folder → its new content, or `null` for a deletion. Nothing is written: the
    /// change lives in the language server's open documents for the request's length.
    pub changes: BTreeMap<String, Option<String>>,
    /// The language of every changed file; default: each file's, by its extension.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub language: Option<String>,
    /// How long the servers may take to answer once they are free and started (default 20 000,
    /// at most 300 000); waiting for them and starting them (on first use) is bounded apart
    /// (90 s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

/// An LSP diagnostic of a file in the folder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Diagnostic {
    /// The file, relative to the folder (or the server's URI, for a file outside it).
    pub path: String,
    /// LSP's range: 0-based lines and UTF-16 columns, in the changed file.
    pub range: Range,
    /// 1 error, 2 warning, 3 information, 4 hint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub severity: Option<u8>,
    pub message: String,
    /// Which tool said it: `pyflakes`, `clang`, ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<Value>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Range {
    pub start: Position,
    pub end: Position,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Position {
    pub line: u32,
    pub character: u32,
}

/// What a change does to the diagnostics (`diagnostics.for_change`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ForChange {
    /// Diagnostics the change brings: in the changed files afterwards, and not there before.
    pub diagnostics: Vec<Diagnostic>,
    /// Diagnostics the change takes away: there before, and not afterwards.
    pub resolved: Vec<Diagnostic>,
    /// Every diagnostic of the changed files afterwards.
    pub after: Vec<Diagnostic>,
    /// Every server said it was done (a diagnostics report for each file, then no work in
    /// progress and a quiet period); false when `timeout_ms` ran out first, with what had come.
    pub complete: bool,
    /// The languages whose servers were asked.
    pub languages: Vec<String>,
    pub elapsed_ms: u64,
}

impl Diagnostic {
    /// What makes two diagnostics the same one, wherever a change moved it: the file, the
    /// severity, the message, the source and the code (not the range).
    pub fn identity(&self) -> (String, Option<u8>, String, Option<String>, String) {
        let code = self.code.as_ref().map(Value::to_string).unwrap_or_default();
        (self.path.clone(), self.severity, self.message.clone(), self.source.clone(), code)
    }
}

/// `after` minus `before` and `before` minus `after`, as multisets of [`Diagnostic::identity`]:
/// a diagnostic that only moved (lines added above it) is neither new nor resolved.
pub fn compare(before: &[Diagnostic], after: &[Diagnostic]) -> (Vec<Diagnostic>, Vec<Diagnostic>) {
    let minus = |a: &[Diagnostic], b: &[Diagnostic]| {
        let mut left: BTreeMap<_, usize> = BTreeMap::new();
        for d in b {
            *left.entry(d.identity()).or_default() += 1;
        }
        a.iter()
            .filter(|d| match left.get_mut(&d.identity()) {
                Some(n) if *n > 0 => {
                    *n -= 1;
                    false
                }
                _ => true,
            })
            .cloned()
            .collect::<Vec<_>>()
    };
    (minus(after, before), minus(before, after))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(line: u32, message: &str) -> Diagnostic {
        let at = Position { line, character: 0 };
        Diagnostic {
            path: "a.py".into(),
            range: Range { start: at, end: at },
            severity: Some(1),
            message: message.into(),
            source: Some("pyflakes".into()),
            code: None,
        }
    }

    #[test]
    fn a_moved_diagnostic_is_neither_new_nor_resolved() {
        let before = [d(3, "undefined name 'x'"), d(7, "undefined name 'x'"), d(9, "unused import")];
        // A line added at the top moves everything; one `x` fixed, a new error added.
        let after = [d(4, "undefined name 'x'"), d(10, "unused import"), d(1, "undefined name 'y'")];
        let (new, resolved) = compare(&before, &after);
        assert_eq!(new, [d(1, "undefined name 'y'")]);
        assert_eq!(resolved, [d(7, "undefined name 'x'")]);
        assert_eq!(compare(&after, &after), (vec![], vec![]));
    }

    #[test]
    fn languages_by_name_and_extension() {
        assert_eq!(language_of("pkg/mod.py"), Some("python"));
        assert_eq!(language_of("src/x.h"), Some("c"));
        assert_eq!(language_of("src/x.hpp"), Some("cpp"));
        assert_eq!(language_of("Makefile"), None);
        assert_eq!(language_of("a.b/c"), None);
        assert_eq!(default_command("python").unwrap(), ["pylsp"]);
        assert_eq!(default_command("cpp").unwrap()[0], "clangd");
        assert!(default_command("cobol").is_none());
    }
}
