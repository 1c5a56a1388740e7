//! What approval decides on (a command and its context) and what it answers (a verdict and the
//! rule that gave it).

use std::collections::BTreeMap;
use std::path::PathBuf;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::parse::Part;

/// A command to decide on.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct CommandRequest {
    /// The command line, as a shell would get it.
    pub command: String,
    /// Its working directory (a guest path).
    pub cwd: PathBuf,
    /// The workspace folders (guest paths); `rm` outside them needs approval.
    #[serde(default)]
    pub workspace: Vec<PathBuf>,
    /// The session it would run in, for hooks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// The variables it gets on top of the guest's defaults (the spawn's `env`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// The folders a command can change on the host directly (guest paths of `rw` and `rwd`
    /// shares): where `protect_dotfiles` asks before a dotfile is written.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub writable: Vec<PathBuf>,
    /// When the session's sandbox makes any command harmless, how (mode `auto`): no network,
    /// `.git` read-only, every workspace folder read-only or shadow. `None`: it does not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub contained: Option<String>,
}

/// The answer; `Ord` is the order of strictness (`Deny` strictest).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Allow,
    Ask,
    Deny,
}

/// The rule behind a verdict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "rule", rename_all = "snake_case")]
pub enum Reason {
    /// A part matched a deny pattern.
    DenyList { pattern: String, part: String },
    /// The line could not be split into commands; the error says why.
    Unparseable { error: String },
    /// The line runs no command.
    NoCommand,
    /// A part's program is an expansion, known only when the shell runs it.
    DynamicProgram { part: String },
    /// `sudo` and the like.
    Privilege { program: String, part: String },
    /// `rm -r` on `/`, a top-level directory, a home directory or a workspace folder itself.
    RmRecursiveRoot { path: String, part: String },
    /// `rm` of a path outside every workspace folder.
    RmOutsideWorkspace { path: String, part: String },
    /// `rm` of a path only known when the shell runs (`"$DIR"`).
    RmUnknownTarget { target: String, part: String },
    /// With `protect_dotfiles`: `part` writes the dotfile `path` in a writable folder (or one
    /// whose place is only known when the shell runs).
    DotfileWrite { path: String, part: String },
    /// The mode is ask-every-time.
    AskEveryTime,
    /// A part matched no allow pattern.
    NotAllowlisted { part: String },
    /// A part's words matched an allow pattern, but it runs with a variable that changes what
    /// runs (`variable`, as `NAME=value`) and that the pattern does not permit.
    EnvNotAllowed { variable: String, part: String },
    /// Every part matched an allow pattern (these).
    Allowlisted { patterns: Vec<String> },
    /// The mode is run-everything.
    RunEverything,
    /// Mode `auto`: `part` matched no allow pattern, and runs because the sandbox contains it
    /// (`how`).
    Contained { how: String, part: String },
    /// A hook answered.
    Hook { hook: String, permission: Verdict, message: Option<String> },
    /// A hook failed or did not answer in time; a person decides instead.
    HookFailed { hook: String, error: String },
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reason::DenyList { pattern, part } => write!(f, "`{part}` matches the deny pattern `{pattern}`"),
            Reason::Unparseable { error } => write!(f, "the command cannot be checked: {error}"),
            Reason::NoCommand => write!(f, "the line runs no command"),
            Reason::DynamicProgram { part } => write!(f, "`{part}`: the program is only known when the shell runs it"),
            Reason::Privilege { program, part } => write!(f, "`{part}` runs {program}, which always needs approval"),
            Reason::RmRecursiveRoot { path, part } => write!(f, "`{part}` deletes {path} recursively"),
            Reason::RmOutsideWorkspace { path, part } => write!(f, "`{part}` deletes {path}, outside the workspace"),
            Reason::RmUnknownTarget { target, part } => {
                write!(f, "`{part}` deletes {target}, only known when the shell runs")
            }
            Reason::DotfileWrite { path, part } => {
                write!(f, "`{part}` writes {path}, a dotfile in a writable folder (protect_dotfiles)")
            }
            Reason::AskEveryTime => write!(f, "the approval mode is ask-every-time"),
            Reason::NotAllowlisted { part } => write!(f, "`{part}` matches no allow pattern"),
            Reason::EnvNotAllowed { variable, part } => {
                write!(f, "`{part}` runs with {variable}, which changes what runs and no allow pattern for it permits")
            }
            Reason::Allowlisted { patterns } => write!(f, "allowed by {}", patterns.join(", ")),
            Reason::RunEverything => write!(f, "the approval mode is run-everything"),
            Reason::Contained { how, part } => {
                write!(f, "`{part}` matches no allow pattern and runs because the sandbox contains it ({how})")
            }
            Reason::Hook { hook, permission, message } => {
                write!(f, "hook {hook} answered {permission:?}")?;
                match message {
                    Some(m) => write!(f, ": {m}"),
                    None => Ok(()),
                }
            }
            Reason::HookFailed { hook, error } => write!(f, "hook {hook} failed ({error}); a person decides"),
        }
    }
}

/// A decision: the verdict, the rule, and the commands the line was split into (the candidates
/// a front end offers for the allow list).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Decision {
    pub verdict: Verdict,
    pub reason: Reason,
    pub parts: Vec<Vec<String>>,
}

impl Decision {
    pub(super) fn new(verdict: Verdict, reason: Reason, parts: &[Part]) -> Self {
        Self { verdict, reason, parts: parts.iter().map(Part::argv).collect() }
    }
}
