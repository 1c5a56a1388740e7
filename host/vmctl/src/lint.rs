//! `vmctl session lint`: the diagnostics a change to a folder's files would bring and take away
//! (`diagnostics.for_change`), from the language servers in the session; nothing is written.

use std::collections::BTreeMap;

use clap::Args;
use umbra_api::client::Client;
use umbra_api::lsp::{Diagnostic, ForChangeParams};
use umbra_api::methods::{DiagnosticsForChange, SessionGet, SessionRef};
use umbra_api::ApiError;

/// Exit status when the change brings new diagnostics (1 is vmctl's own errors).
pub const EXIT_NEW: i32 = 2;
/// Exit status when it brings none the servers reported, but they did not all finish in time.
pub const EXIT_INCOMPLETE: i32 = 3;

#[derive(Args, Debug)]
pub struct LintArgs {
    name: String,
    /// PATH=@FILE: the folder's PATH as if it held the host file FILE; PATH= : as if it were
    /// deleted. Repeatable.
    #[arg(long = "change", value_name = "PATH=@FILE", required = true, value_parser = parse_change)]
    changes: Vec<(String, Option<String>)>,
    /// The folder, by name (default: the session's first).
    #[arg(long)]
    folder: Option<String>,
    /// The changed files' language (python, c, cpp; default: by extension).
    #[arg(long)]
    language: Option<String>,
    /// How long the servers may take, in milliseconds (default 20 000).
    #[arg(long)]
    timeout_ms: Option<u64>,
    /// The whole answer as JSON.
    #[arg(long)]
    json: bool,
}

fn parse_change(s: &str) -> Result<(String, Option<String>), String> {
    let (path, value) = s.split_once('=').ok_or_else(|| format!("{s:?} is not PATH=@FILE or PATH="))?;
    if path.is_empty() {
        return Err(format!("{s:?} has an empty PATH"));
    }
    if value.is_empty() {
        return Ok((path.to_string(), None));
    }
    let file = value.strip_prefix('@').ok_or_else(|| format!("{s:?}: the content is @FILE (a host file)"))?;
    let text = std::fs::read_to_string(file).map_err(|e| format!("{file}: {e}"))?;
    Ok((path.to_string(), Some(text)))
}

/// Prints the new diagnostics (and the resolved ones); exits [`EXIT_NEW`] if there are new ones,
/// [`EXIT_INCOMPLETE`] if there are none but the servers did not finish.
pub async fn lint(args: LintArgs) -> i32 {
    match run(args).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("vmctl: error: {}", e.message);
            1
        }
    }
}

async fn run(args: LintArgs) -> Result<i32, ApiError> {
    let (client, _) = Client::connect(None).await?;
    let folder = match args.folder {
        Some(f) => f,
        None => {
            let info = client.call::<SessionGet>(SessionRef { name: args.name.clone() }).await?;
            let first = info.folders.first().ok_or_else(|| {
                ApiError::invalid_params(format!("session {} has no folder: pass --folder", args.name))
            })?;
            first.name.clone()
        }
    };
    let changes: BTreeMap<String, Option<String>> = args.changes.into_iter().collect();
    let params =
        ForChangeParams { session: args.name, folder, changes, language: args.language, timeout_ms: args.timeout_ms };
    let r = client.call::<DiagnosticsForChange>(params).await?;
    if args.json {
        println!("{}", serde_json::to_string(&r).expect("diagnostics serialize"));
    } else {
        for d in &r.diagnostics {
            println!("{}", line(d));
        }
        for d in &r.resolved {
            println!("resolved: {}", line(d));
        }
        let more = if r.complete { String::new() } else { " (incomplete: the servers did not finish in time)".into() };
        eprintln!(
            "vmctl: {} new, {} resolved, {} in the changed files ({} ms){more}",
            r.diagnostics.len(),
            r.resolved.len(),
            r.after.len(),
            r.elapsed_ms
        );
    }
    Ok(match (r.diagnostics.is_empty(), r.complete) {
        (false, _) => EXIT_NEW,
        (true, false) => EXIT_INCOMPLETE,
        (true, true) => 0,
    })
}

/// `path:line:column: severity: message [source]`, 1-based as compilers print them.
fn line(d: &Diagnostic) -> String {
    let severity = match d.severity {
        Some(1) => "error",
        Some(2) => "warning",
        Some(3) => "info",
        Some(4) => "hint",
        _ => "note",
    };
    let source = d.source.as_ref().map(|s| format!(" [{}]", printable(s))).unwrap_or_default();
    let (line, column) = (d.range.start.line + 1, d.range.start.character + 1);
    format!("{}:{line}:{column}: {severity}: {}{source}", printable(&d.path), printable(&d.message))
}

/// The guest's text made safe for a terminal: control and bidi characters become `?` (clang's
/// multi-line messages stay on one line).
fn printable(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_control() || ('\u{202a}'..='\u{202e}').contains(&c) || ('\u{2066}'..='\u{2069}').contains(&c) {
                '?'
            } else {
                c
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_are_a_file_or_a_deletion() {
        let f = std::env::temp_dir().join(format!("vmctl-lint-{}.py", std::process::id()));
        std::fs::write(&f, "x = 1\n").unwrap();
        let (p, c) = parse_change(&format!("pkg/a.py=@{}", f.display())).unwrap();
        assert_eq!((p.as_str(), c.as_deref()), ("pkg/a.py", Some("x = 1\n")));
        assert_eq!(parse_change("gone.py=").unwrap(), ("gone.py".into(), None));
        assert!(parse_change("a.py").unwrap_err().contains("PATH=@FILE"));
        assert!(parse_change("a.py=x = 1").unwrap_err().contains("@FILE"));
        assert!(parse_change("=@x").unwrap_err().contains("empty PATH"));
        assert!(parse_change("a.py=@/nonexistent/file").unwrap_err().contains("/nonexistent/file"));
        assert_eq!(printable("a\x1b[2Jb\nc\u{202e}d"), "a?[2Jb?c?d");
        std::fs::remove_file(f).unwrap();
    }
}
