//! Command approval: whether a command line runs, is refused, or waits for a person — and the
//! rule that said so.
//!
//! The order, after seed 003's `xOh` with its gaps closed:
//! 1. the line is split into every simple command it would run (`parse.rs`, a real shell
//!    parser); a line that cannot be split needs approval in every mode (it is refused if a
//!    deny pattern matches its text);
//! 2. any part matching a deny pattern refuses the whole line (deny wins);
//! 3. a part whose program is only known when it runs (`$CMD x`) needs approval;
//! 4. `sudo` (and `doas`, `su`, `pkexec`), and `rm` outside the workspace or recursive on a
//!    root-like path, need approval in every mode — run-everything included — unless an allow
//!    pattern for that program matches the part (`rules.rs`);
//! 5. with `protect_dotfiles`, a part writing a dotfile in a writable folder needs approval;
//! 6. the mode: ask-every-time asks; allowlist allows when every part matches an allow pattern
//!    (or runs inside a wrapper or shell whose part did); run-everything allows;
//! 7. hooks (`hook.rs`, only in [`decide`]) may make the answer stricter, never laxer.
//!
//! A part's variables are part of the decision: the request's `env` and what the line itself
//! sets (`LD_PRELOAD=x git status`, `env PATH=… git`, `export BASH_ENV=…; …`). Those that change
//! what runs (`env.rs`: `PATH`, `LD_*`, `BASH_ENV`, `GIT_*`, `PYTHONPATH`, `NODE_OPTIONS`, …)
//! must be permitted by the allow pattern that allows the part (`LD_PRELOAD=* git status`), or
//! the part is not allowed by it; deny patterns can name them too (`LD_PRELOAD=*`).

mod decision;
mod env;
mod hook;
mod parse;
mod rules;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use decision::{CommandRequest, Decision, Reason, Verdict};
pub use env::{changes_what_runs, what_changes_what_runs};
pub use hook::{HookAnswer, HookError, HookSpec};
pub use parse::{split, Part, SplitError, Word, MAX_COMMAND_LEN, MAX_DEPTH};
pub use rules::{allow_matches, deny_matches, dotfile_write, prefix_matches, written, Protection, PRIVILEGE_PROGRAMS};

/// When commands run without asking (seed 003's auto-run modes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalMode {
    /// Every command waits for a person.
    #[default]
    AskEveryTime,
    /// Commands whose every part matches the allow list run; others wait.
    Allowlist,
    /// As `allowlist`, and a command it does not allow runs all the same when the session's
    /// sandbox makes it harmless (no network, `.git` read-only, every workspace folder
    /// read-only or shadow: [`CommandRequest::contained`]); the decision says so. The
    /// protections (`sudo`, `rm` outside the workspace, …) still ask.
    Auto,
    /// Everything runs, except what the deny list, the protections or a hook stop.
    RunEverything,
}

/// Which programs approval sees.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalScope {
    /// The commands clients run in the session (`session.exec`, `process.spawn`, terminals);
    /// what those commands start in the guest is theirs.
    #[default]
    Command,
    /// Every program the session's commands execute, down their whole process tree — an agent
    /// running in the guest included — is checked before it runs (the guest agent's exec
    /// gate). Allowlisted programs run at once; the others ask as a command would. This is
    /// policy on top of the VM, not the boundary: see `docs/policy.md`.
    Guest,
}

/// The approval settings of a session (merged from wherever they come from by the caller).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct ApprovalSettings {
    pub mode: ApprovalMode,
    /// Command prefixes, as words: `git status`, `cargo`, `npm test`. Variables that change
    /// what runs (`PATH`, `LD_PRELOAD`, `GIT_*`, …) set for a command must be listed before the
    /// words to be allowed: `LD_PRELOAD=* git status`, `PATH=/usr/bin:/bin make`.
    pub allow: Vec<String>,
    /// Command prefixes that refuse a command outright; they win over everything. Leading
    /// `NAME=value` (or `NAME=*`) words refuse only when the command runs with that variable;
    /// `LD_PRELOAD=*` alone refuses every command run with it.
    pub deny: Vec<String>,
    /// Executables asked in turn after the rules (see [`HookSpec`]).
    pub hooks: Vec<HookSpec>,
    /// How long a command waits for a person's answer before it counts as denied.
    pub timeout_secs: u64,
    /// Which programs are checked: the commands clients run, or every exec in the guest.
    pub scope: ApprovalScope,
    /// Ask, in every mode, before a command writes a dotfile (`.env`, `.git/config`,
    /// `.github/…`, `.bashrc`) in a folder it can change on the host directly (`rw`, `rwd`):
    /// through a redirection or as the file operand of `tee`, `touch`, `truncate`, `cp`, `mv`,
    /// `install`, `ln`, `sed -i`, `perl -i`, `dd of=`. A heuristic on the line's words.
    pub protect_dotfiles: bool,
}

/// How long a permission request waits by default: long enough for a person to read it.
pub const DEFAULT_APPROVAL_TIMEOUT_SECS: u64 = 300;
/// Bounds on the lists (they arrive over IPC).
pub const MAX_RULES: usize = 1024;
pub const MAX_HOOKS: usize = 16;

impl Default for ApprovalSettings {
    fn default() -> Self {
        Self {
            mode: ApprovalMode::default(),
            allow: Vec::new(),
            deny: Vec::new(),
            hooks: Vec::new(),
            timeout_secs: DEFAULT_APPROVAL_TIMEOUT_SECS,
            scope: ApprovalScope::default(),
            protect_dotfiles: false,
        }
    }
}

impl ApprovalMode {
    /// Rank in strictness: ask-every-time is the strictest.
    pub fn laxity(self) -> u8 {
        match self {
            ApprovalMode::AskEveryTime => 0,
            ApprovalMode::Allowlist => 1,
            ApprovalMode::Auto => 2,
            ApprovalMode::RunEverything => 3,
        }
    }
}

impl ApprovalSettings {
    /// Checks the lists are bounded, patterns non-empty, hooks absolute paths and the timeout
    /// between 1 s and a day.
    pub fn validate(&self) -> Result<(), String> {
        for (field, list) in [("allow", &self.allow), ("deny", &self.deny)] {
            if list.len() > MAX_RULES {
                return Err(format!("{field}: at most {MAX_RULES} patterns"));
            }
            if let Some(bad) = list.iter().find(|p| p.trim().is_empty() || p.len() > MAX_COMMAND_LEN) {
                return Err(format!("{field}: {bad:?} is not a command prefix"));
            }
        }
        if self.hooks.len() > MAX_HOOKS {
            return Err(format!("hooks: at most {MAX_HOOKS}"));
        }
        if let Some(hook) = self.hooks.iter().find(|h| !h.command.is_absolute()) {
            return Err(format!("hooks: {:?} is not an absolute path", hook.command));
        }
        if !(1..=86_400).contains(&self.timeout_secs) {
            return Err(format!("timeout_secs: {} is not between 1 and 86400", self.timeout_secs));
        }
        Ok(())
    }

    /// Both sources' settings, the stricter winning: the stricter mode, both deny lists, both
    /// sources' hooks, the shorter timeout, the wider scope (`guest`), `protect_dotfiles` when
    /// either has it; the allow list of `self` (the more specific source)
    /// when it has one, else `base`'s — an allow entry never beats a deny entry anyway.
    pub fn merged_onto(&self, base: &ApprovalSettings) -> ApprovalSettings {
        let mode = if self.mode.laxity() <= base.mode.laxity() { self.mode } else { base.mode };
        let mut deny = base.deny.clone();
        deny.extend(self.deny.iter().filter(|d| !base.deny.contains(d)).cloned());
        let mut hooks = base.hooks.clone();
        hooks.extend(self.hooks.iter().filter(|h| !base.hooks.contains(h)).cloned());
        ApprovalSettings {
            mode,
            allow: if self.allow.is_empty() { base.allow.clone() } else { self.allow.clone() },
            deny,
            hooks,
            timeout_secs: self.timeout_secs.min(base.timeout_secs),
            scope: self.scope.max(base.scope),
            protect_dotfiles: self.protect_dotfiles || base.protect_dotfiles,
        }
    }
}

fn text(part: &Part) -> String {
    part.argv().join(" ")
}

/// The request's own variables, as the line's assignments are kept.
fn request_env(request: &CommandRequest) -> Vec<(String, Word)> {
    request.env.iter().map(|(n, v)| (n.clone(), Word { text: v.clone(), literal: true })).collect()
}

/// `NAME=value` for a message, the value cut at 200 bytes.
fn show_variable(name: &str, value: &Word) -> String {
    let mut v = value.text.clone();
    if v.len() > 200 {
        let mut cut = 200;
        while !v.is_char_boundary(cut) {
            cut -= 1;
        }
        v.truncate(cut);
        v.push('…');
    }
    format!("{name}={v}")
}

/// The decision of the rules alone (no hooks).
pub fn evaluate(settings: &ApprovalSettings, request: &CommandRequest) -> Decision {
    let parts = split(&request.command).map(|mut parts| {
        // The request's variables come first: the line's own assignments override them.
        for part in &mut parts {
            let mut env = request_env(request);
            env.append(&mut part.env);
            part.env = env;
        }
        parts
    });
    let parts = match parts {
        Ok(parts) => parts,
        Err(error) => {
            // Refused if a deny pattern matches the raw text, else a person decides: an
            // unparseable command is never allowed silently, whatever the mode.
            let raw = Part {
                words: request
                    .command
                    .split_whitespace()
                    .map(|w| Word { text: w.to_string(), literal: true })
                    .collect(),
                via: None,
                env: request_env(request),
                writes: Vec::new(),
            };
            if let Some(pattern) = settings.deny.iter().find(|p| deny_matches(&raw, p)) {
                let reason = Reason::DenyList { pattern: pattern.clone(), part: request.command.clone() };
                return Decision::new(Verdict::Deny, reason, &[]);
            }
            return Decision::new(Verdict::Ask, Reason::Unparseable { error: error.to_string() }, &[]);
        }
    };
    if parts.is_empty() {
        return Decision::new(Verdict::Ask, Reason::NoCommand, &parts);
    }
    for part in &parts {
        if let Some(pattern) = settings.deny.iter().find(|p| deny_matches(part, p)) {
            return Decision::new(
                Verdict::Deny,
                Reason::DenyList { pattern: pattern.clone(), part: text(part) },
                &parts,
            );
        }
    }
    for part in &parts {
        if !part.words[0].literal {
            return Decision::new(Verdict::Ask, Reason::DynamicProgram { part: text(part) }, &parts);
        }
    }
    for part in &parts {
        let Some(protection) = rules::protection(part, &request.cwd, &request.workspace) else { continue };
        let program = part.program().unwrap_or_default();
        let explicitly_allowed = settings.allow.iter().any(|p| {
            p.split_whitespace()
                .find(|w| !w.contains('='))
                .is_some_and(|first| first.rsplit('/').next() == Some(program))
                && allow_matches(part, p)
        });
        if explicitly_allowed {
            continue;
        }
        let part = text(part);
        let reason = match protection {
            Protection::Privilege { program } => Reason::Privilege { program, part },
            Protection::RmRecursiveRoot { path } => Reason::RmRecursiveRoot { path, part },
            Protection::RmOutsideWorkspace { path } => Reason::RmOutsideWorkspace { path, part },
            Protection::RmUnknownTarget { target } => Reason::RmUnknownTarget { target, part },
        };
        return Decision::new(Verdict::Ask, reason, &parts);
    }
    if settings.protect_dotfiles {
        for part in &parts {
            if let Some(path) = rules::dotfile_write(part, &request.cwd, &request.writable) {
                return Decision::new(Verdict::Ask, Reason::DotfileWrite { path, part: text(part) }, &parts);
            }
        }
    }
    match settings.mode {
        ApprovalMode::AskEveryTime => Decision::new(Verdict::Ask, Reason::AskEveryTime, &parts),
        ApprovalMode::RunEverything => Decision::new(Verdict::Allow, Reason::RunEverything, &parts),
        ApprovalMode::Allowlist | ApprovalMode::Auto => {
            let mut matched: Vec<Option<&String>> = Vec::with_capacity(parts.len());
            for part in &parts {
                let own = settings.allow.iter().find(|p| allow_matches(part, p));
                // Inside an allowed wrapper or shell: allowed by its pattern, as long as that
                // pattern permits the variables this part runs with (`env LD_PRELOAD=x git`
                // under an allowed `env` is not allowed).
                let inherited = part
                    .via
                    .and_then(|i| matched.get(i).copied().flatten())
                    .filter(|p| rules::unpermitted_env(part, p).is_none());
                match own.or(inherited) {
                    Some(p) => matched.push(Some(p)),
                    None => {
                        // Say so when the words were allowed and a variable was not.
                        let blocked = settings
                            .allow
                            .iter()
                            .filter(|p| prefix_matches(part, p, false))
                            .chain(part.via.and_then(|i| matched.get(i).copied().flatten()))
                            .find_map(|p| rules::unpermitted_env(part, p));
                        let reason = match blocked {
                            Some((name, value)) => {
                                Reason::EnvNotAllowed { variable: show_variable(name, value), part: text(part) }
                            }
                            None => Reason::NotAllowlisted { part: text(part) },
                        };
                        if let (ApprovalMode::Auto, Some(how)) = (settings.mode, &request.contained) {
                            let reason = Reason::Contained { how: how.clone(), part: text(part) };
                            return Decision::new(Verdict::Allow, reason, &parts);
                        }
                        return Decision::new(Verdict::Ask, reason, &parts);
                    }
                }
            }
            let mut patterns: Vec<String> = matched.into_iter().flatten().cloned().collect();
            patterns.sort();
            patterns.dedup();
            Decision::new(Verdict::Allow, Reason::Allowlisted { patterns }, &parts)
        }
    }
}

/// The decision of the rules, then of each hook in turn: a hook can make it stricter (ask,
/// deny), never laxer; a hook that fails or does not answer in time makes it at least `ask`.
/// Hooks are not run for a line the rules already refuse.
pub async fn decide(settings: &ApprovalSettings, request: &CommandRequest) -> Decision {
    let decision = evaluate_bounded(settings, request, EVALUATE_BUDGET).await;
    ask_hooks(settings, request, decision).await
}

/// How long the rules may take on one line before a person decides instead.
pub const EVALUATE_BUDGET: std::time::Duration = std::time::Duration::from_secs(2);

/// At most one line is parsed at a time, on a blocking thread.
static PARSING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);

/// [`evaluate`] on a blocking thread, one line at a time, within `budget`: a line it cannot
/// decide in time (or while an earlier one still holds the parser) needs a person. brush-parser
/// backtracks exponentially on some lines (fuzzing found several; `split` refuses the known
/// shapes up front), and a client's command line must never stall the caller: a stuck parse
/// keeps one blocking thread busy, never the async workers, and fails closed.
pub async fn evaluate_bounded(
    settings: &ApprovalSettings,
    request: &CommandRequest,
    budget: std::time::Duration,
) -> Decision {
    let too_slow = || Decision {
        verdict: Verdict::Ask,
        reason: Reason::Unparseable { error: format!("it could not be checked within {} s", budget.as_secs_f32()) },
        parts: Vec::new(),
    };
    let (settings, request) = (settings.clone(), request.clone());
    let work = async move {
        let permit = PARSING.acquire().await.expect("never closed");
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            evaluate(&settings, &request)
        })
        .await
    };
    match tokio::time::timeout(budget, work).await {
        Ok(Ok(decision)) => decision,
        _ => too_slow(),
    }
}

async fn ask_hooks(settings: &ApprovalSettings, request: &CommandRequest, mut decision: Decision) -> Decision {
    for spec in &settings.hooks {
        if decision.verdict == Verdict::Deny {
            break;
        }
        let hook = spec.command.display().to_string();
        let (verdict, reason) = match hook::run(spec, request, &decision).await {
            Ok(answer) => {
                (answer.permission, Reason::Hook { hook, permission: answer.permission, message: answer.reason })
            }
            Err(e) => (Verdict::Ask, Reason::HookFailed { hook, error: e.to_string() }),
        };
        if verdict > decision.verdict {
            decision.verdict = verdict;
            decision.reason = reason;
        }
    }
    decision
}

#[cfg(test)]
mod tests;
