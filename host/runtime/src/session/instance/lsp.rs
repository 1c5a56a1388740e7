//! A session's language servers (`lsp.*`) and `diagnostics.for_change`: the servers run in the
//! guest as processes of the session (through its approval gate, like any command), on a
//! folder's guest path; `session/lsp/` speaks LSP to them.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use umbra_api::lsp::{self as api, ForChange, ForChangeParams, LspServerInfo, LspStartParams};
use umbra_api::{ErrorCode, EventKind, FolderInfo};

use super::Session;
use crate::session::error::SessionError;
use crate::session::exec::ExecRequest;
use crate::session::lsp::{self, FileChange, Server};

/// `lsp.request`'s default wait and its bound.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
const MAX_TIMEOUT: Duration = Duration::from_secs(300);
/// `diagnostics.for_change`'s default wait.
const FOR_CHANGE_TIMEOUT: Duration = Duration::from_secs(20);

impl Session {
    /// Starts and initializes a language server on a folder.
    pub async fn lsp_start(self: &Arc<Self>, p: LspStartParams) -> Result<LspServerInfo, SessionError> {
        let folder = self.folder(&p.folder)?;
        let command = command(p.language.as_deref(), p.command)?;
        let place = self.lsp.reserve()?;
        let id = self.lsp.next_id();
        let me = self.me.clone();
        let sink: lsp::Sink = Box::new(move |method: &str, params: &Value| {
            if let Some(s) = me.upgrade() {
                s.emit(EventKind::LspNotification { server: id, method: method.to_string(), params: params.clone() });
            }
        });
        let server = self.start_server(&folder, &command, p.initialization_options, Some(sink)).await?;
        let info = LspServerInfo {
            server: id,
            folder: folder.name.clone(),
            root: folder.guest_path.clone(),
            command,
            initialize: server.1,
        };
        self.lsp.add(info.clone(), Arc::new(server.0), place);
        Ok(info)
    }

    /// A request to a server started with `lsp.start`: its result, or its error answer as a
    /// `guest_error`.
    pub async fn lsp_request(
        &self,
        server: u64,
        method: &str,
        params: Value,
        timeout_ms: Option<u64>,
    ) -> Result<Value, SessionError> {
        self.touch();
        let timeout = timeout_ms.map_or(REQUEST_TIMEOUT, Duration::from_millis).min(MAX_TIMEOUT);
        let s = self.lsp.get(server)?;
        s.request(method, params, timeout).await?.map_err(|e| {
            SessionError::Lsp(format!("language server {server} answered {method} with {}", lsp::lsp_error_text(&e)))
        })
    }

    pub async fn lsp_notify(&self, server: u64, method: &str, params: Value) -> Result<(), SessionError> {
        self.touch();
        self.lsp.get(server)?.notify(method, params).await
    }

    /// Shuts a server down: `shutdown` and `exit`, then SIGKILL if it lingers.
    pub async fn lsp_stop(&self, server: u64) -> Result<(), SessionError> {
        self.touch();
        let s = self.lsp.remove(server)?;
        s.stop(Duration::from_secs(3)).await;
        Ok(())
    }

    pub fn lsp_list(&self) -> Vec<LspServerInfo> {
        self.lsp.list()
    }

    /// The diagnostics `p.changes` would bring and take away, from a pooled server per
    /// language; nothing is written (see `session/lsp/mod.rs`).
    pub async fn diagnostics_for_change(self: &Arc<Self>, p: ForChangeParams) -> Result<ForChange, SessionError> {
        let started = Instant::now();
        let timeout = p.timeout_ms.map_or(FOR_CHANGE_TIMEOUT, Duration::from_millis).min(MAX_TIMEOUT);
        // The servers' answers get `timeout` once they are lent; waiting for them to be free or
        // to start (on first use) is bounded apart, by the start's own bound.
        let bound = tokio::time::Instant::now() + timeout + lsp::INITIALIZE_TIMEOUT + Duration::from_secs(3);
        let folder = self.folder(&p.folder)?;
        if p.changes.is_empty() {
            return Err(SessionError::InvalidArgument("changes is empty: name at least one file".into()));
        }
        if p.changes.len() > lsp::MAX_CHANGED_FILES {
            return Err(SessionError::InvalidArgument(format!(
                "{} files changed: at most {} in one request",
                p.changes.len(),
                lsp::MAX_CHANGED_FILES
            )));
        }
        // Files by language, each with what it holds now.
        let mut by_language: BTreeMap<String, Vec<FileChange>> = BTreeMap::new();
        let mut text_bytes = 0;
        for (path, after) in p.changes {
            lsp::check_relative(&path)?;
            let language = match &p.language {
                Some(l) => l.clone(),
                None => api::language_of(&path)
                    .ok_or_else(|| {
                        SessionError::InvalidArgument(format!(
                            "no language server for {path:?}: pass language (python, c or cpp)"
                        ))
                    })?
                    .to_string(),
            };
            if after.as_ref().is_some_and(|a| a.len() > lsp::MAX_FILE_BYTES) {
                return Err(SessionError::InvalidArgument(format!("{path}: more than {} bytes", lsp::MAX_FILE_BYTES)));
            }
            let guest = format!("{}/{path}", folder.guest_path);
            let before = self.read_text(&guest).await?;
            // The guest chooses the sizes of the files read: the request's texts are bounded.
            text_bytes += before.as_ref().map_or(0, String::len) + after.as_ref().map_or(0, String::len);
            if text_bytes > lsp::MAX_CHANGE_BYTES {
                return Err(SessionError::InvalidArgument(format!(
                    "the changed files hold more than {} bytes, before and after",
                    lsp::MAX_CHANGE_BYTES
                )));
            }
            let language_id = match api::language_of(&path) {
                Some(l) if p.language.is_none() => l.to_string(),
                _ => language.clone(),
            };
            by_language.entry(language).or_default().push(FileChange {
                uri: lsp::file_uri(&guest),
                path,
                language_id,
                before,
                after,
            });
        }
        // One server per language, concurrently.
        let runs = by_language.into_iter().map(|(language, files)| {
            let folder = folder.clone();
            let run = async move {
                let command = command(Some(&language), None)?;
                let pool = self.lsp.pool(&folder.guest_path, &command);
                // A server for each side of the change, asked at once; one when no file exists yet.
                let sides = if files.iter().any(|f| f.before.is_some()) { 2 } else { 1 };
                let start = || async { Ok(self.start_server(&folder, &command, None, None).await?.0) };
                let mut lent = pool.take(sides, start).await?;
                let deadline = tokio::time::Instant::now() + timeout;
                let after_server = lent.pop().expect("take gives what it is asked for");
                let before_server = lent.pop();
                let (before, after) = tokio::join!(
                    async {
                        match &before_server {
                            Some(l) => lsp::report(&l.server, &files, lsp::Side::Before, deadline).await,
                            None => Ok(lsp::SideReport {
                                files: vec![Some(Vec::new()); files.len()],
                                complete: true,
                                clean: true,
                            }),
                        }
                    },
                    lsp::report(&after_server.server, &files, lsp::Side::After, deadline),
                );
                for (lent, side) in [(before_server, &before), (Some(after_server), &after)] {
                    let Some(lent) = lent else { continue };
                    match side {
                        Ok(r) if r.clean => pool.give_back(lent),
                        _ => lent.server.stop(Duration::from_secs(1)).await,
                    }
                }
                let (before, after) = (before?, after?);
                let files: Vec<lsp::FileReport> = files
                    .iter()
                    .zip(before.files.into_iter().zip(after.files))
                    .map(|(f, (before, after))| lsp::FileReport { uri: f.uri.clone(), before, after })
                    .collect();
                Ok((language, files, before.complete && after.complete))
            };
            // Whatever the servers do, the call ends: a server lent and not given back is dropped,
            // which kills it.
            async move {
                tokio::time::timeout_at(bound, run).await.unwrap_or_else(|_| {
                    Err(SessionError::Timeout(format!(
                        "the language servers did not finish within timeout_ms ({} ms) and {} s to start",
                        timeout.as_millis(),
                        lsp::INITIALIZE_TIMEOUT.as_secs()
                    )))
                })
            }
        });
        let mut out = ForChange { complete: true, ..Default::default() };
        for run in futures_util::future::join_all(runs).await {
            let (language, files, complete) = run?;
            // A file without both reports is unknown: neither new nor resolved.
            for file in files {
                if let (Some(before), Some(after)) = (file.before, file.after) {
                    let (before, after) =
                        (lsp::relative(&folder.guest_path, before), lsp::relative(&folder.guest_path, after));
                    let (new, resolved) = api::compare(&before, &after);
                    out.diagnostics.extend(new);
                    out.resolved.extend(resolved);
                    out.after.extend(after);
                }
            }
            out.complete &= complete;
            out.languages.push(language);
        }
        out.elapsed_ms = started.elapsed().as_millis() as u64;
        Ok(out)
    }

    /// A folder of the running VM, by name.
    fn folder(&self, name: &str) -> Result<FolderInfo, SessionError> {
        let info = self.info();
        info.folders
            .into_iter()
            .find(|f| f.name == name)
            .ok_or_else(|| SessionError::InvalidArgument(format!("no folder {name:?} in session {:?}", self.name)))
    }

    /// A file's text in the guest; `None` if it does not exist.
    async fn read_text(&self, guest: &str) -> Result<Option<String>, SessionError> {
        let mut bytes = Vec::new();
        loop {
            match self.read_file(guest, false, bytes.len() as u64, umbra_proto::MAX_FILE_CHUNK as u32).await {
                Ok((chunk, eof)) => {
                    bytes.extend_from_slice(&chunk);
                    if bytes.len() > lsp::MAX_FILE_BYTES {
                        return Err(SessionError::InvalidArgument(format!(
                            "{guest}: more than {} bytes",
                            lsp::MAX_FILE_BYTES
                        )));
                    }
                    if eof || chunk.is_empty() {
                        break;
                    }
                }
                Err(e) if bytes.is_empty() && e.code() == ErrorCode::NotFound => return Ok(None),
                Err(e) => return Err(e),
            }
        }
        String::from_utf8(bytes)
            .map(Some)
            .map_err(|_| SessionError::InvalidArgument(format!("{guest} is not UTF-8 text")))
    }

    /// Runs `command` on `folder` and initializes it: the server and its `initialize` answer.
    async fn start_server(
        self: &Arc<Self>,
        folder: &FolderInfo,
        command: &[String],
        options: Option<Value>,
        sink: Option<lsp::Sink>,
    ) -> Result<(Server, Value), SessionError> {
        let req = ExecRequest { argv: command.to_vec(), cwd: Some(folder.guest_path.clone()), ..Default::default() };
        let server = Server::new(self.spawn(req).await?, sink);
        match lsp::initialize(&server, &folder.guest_path, &folder.name, options).await {
            Ok(answer) => Ok((server, answer)),
            Err(e) => {
                let why = server.ended().map(|w| format!(" ({w})")).unwrap_or_default();
                server.stop(Duration::from_secs(1)).await;
                Err(SessionError::Lsp(format!("{} did not start: {e}{why}", command[0])))
            }
        }
    }
}

/// The server to run: `command` if given, else the language's.
fn command(language: Option<&str>, command: Option<Vec<String>>) -> Result<Vec<String>, SessionError> {
    match (command, language) {
        (Some(c), _) if !c.is_empty() && !c[0].is_empty() => Ok(c),
        (Some(_), _) => Err(SessionError::InvalidArgument("command must name a program".into())),
        (None, Some(l)) => api::default_command(l).ok_or_else(|| {
            SessionError::InvalidArgument(format!("no language server for {l:?}: python, c or cpp, or pass command"))
        }),
        (None, None) => Err(SessionError::InvalidArgument("pass language (python, c or cpp) or command".into())),
    }
}
