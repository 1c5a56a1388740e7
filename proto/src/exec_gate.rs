//! The exec gate (since 1.9): with [`crate::SpawnRequest::exec_gate`], every program the
//! process and its descendants execute is checked before it runs. The agent lets an exec
//! through at once when its words match an allow pattern of the gate; any other becomes an
//! [`crate::Event::ExecCheck`] the host answers with [`crate::Request::ExecAnswer`].
//!
//! Both sides see an exec as the same words ([`exec_words`]), so a pattern means one thing to
//! the agent's quick check and to the host's rules.

use serde::{Deserialize, Serialize};

/// What a spawn's exec gate lets through without asking the host.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecGate {
    /// Command prefixes as words (`git status`, `cargo`): an exec whose [`exec_words`] start
    /// with a pattern's words runs at once, unless a `deny` pattern matches it too. Patterns
    /// with variable conditions (`NAME=value`) are ignored here: the agent does not read an
    /// exec's environment.
    #[serde(default)]
    pub allow: Vec<String>,
    /// Command prefixes the host refuses: an exec they match (by the program's base name too)
    /// is never let through here, and the host decides. A deny pattern with a variable
    /// condition sends every exec to the host.
    #[serde(default)]
    pub deny: Vec<String>,
}

/// The capability an agent lists in its Hello when it runs exec gates.
pub const CAP_EXEC_GATE: &str = "exec-gate";

/// The directories whose programs a pattern names by their base name (`git` is
/// `/usr/bin/git`); a program anywhere else is named by its full path (`/tmp/git`), so a
/// pattern for `git` never lets another directory's `git` through.
pub const SYSTEM_PATH: [&str; 6] = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"];

/// Most arguments, and bytes of them in all, an exec check carries; an exec beyond either is
/// decided on what fits, marked by a last word `…`.
pub const MAX_EXEC_ARGS: usize = 256;
pub const MAX_EXEC_BYTES: usize = 64 * 1024;

/// The words an exec is judged by: the program executed — by base name when it lives in a
/// [`SYSTEM_PATH`] directory, else its path — then the arguments after `argv[0]`. `argv[0]` is
/// the caller's to choose (`exec -a git /tmp/evil`), so it never names the program.
///
/// A multi-call binary is the exception: busybox runs the applet its `argv[0]` names, so a
/// system busybox run as `cat` is judged as `cat` (and as `busybox` when `argv[0]` is that).
pub fn exec_words(path: &str, argv: &[String]) -> Vec<String> {
    let program = match path.rsplit_once('/') {
        Some((dir, name)) if SYSTEM_PATH.contains(&dir) && !name.is_empty() => name.to_string(),
        _ => path.to_string(),
    };
    let applet = argv.first().map(|a| a.rsplit('/').next().unwrap_or(a)).filter(|a| !a.is_empty());
    let program = match applet {
        Some(applet) if MULTI_CALL.contains(&program.as_str()) => applet.to_string(),
        _ => program,
    };
    std::iter::once(program).chain(argv.iter().skip(1).cloned()).collect()
}

/// Programs that run what their `argv[0]` names (in a system directory).
const MULTI_CALL: [&str; 1] = ["busybox"];

impl ExecGate {
    /// Whether an exec's words may run without asking the host: an allow pattern's words
    /// start them and no deny pattern could refuse them.
    pub fn allows(&self, words: &[String]) -> bool {
        let Some(program) = words.first() else { return false };
        let base = program.rsplit('/').next().unwrap_or(program);
        let refused = self.deny.iter().any(|pattern| {
            let want: Vec<&str> = pattern.split_whitespace().collect();
            match want.first() {
                None => false,
                Some(first) if first.contains('=') => true,
                Some(first) => {
                    let first_ok = *first == program || (!first.contains('/') && *first == base);
                    first_ok && words.len() >= want.len() && want[1..].iter().zip(&words[1..]).all(|(w, a)| w == a)
                }
            }
        });
        let allowed = self.allow.iter().any(|pattern| {
            let want: Vec<&str> = pattern.split_whitespace().collect();
            let conditional = want.first().is_none_or(|w| w.contains('='));
            !conditional && words.len() >= want.len() && want.iter().zip(words).all(|(w, a)| w == a)
        });
        allowed && !refused
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(path: &str, argv: &[&str]) -> Vec<String> {
        exec_words(path, &argv.iter().map(|a| a.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn a_program_is_named_by_base_name_only_in_the_system_directories() {
        assert_eq!(words("/usr/bin/git", &["git", "status"]), ["git", "status"]);
        assert_eq!(words("/bin/sh", &["anything", "-c", "x"]), ["sh", "-c", "x"]);
        assert_eq!(words("/tmp/git", &["git", "status"]), ["/tmp/git", "status"]);
        assert_eq!(words("/usr/bin/../../tmp/git", &["git"]), ["/usr/bin/../../tmp/git"]);
        assert_eq!(words("git", &[]), ["git"]);
        // busybox runs the applet argv[0] names; another directory's busybox is not the system's.
        assert_eq!(words("/bin/busybox", &["cat", "/tmp/x"]), ["cat", "/tmp/x"]);
        assert_eq!(words("/usr/bin/busybox", &["/bin/ls", "-l"]), ["ls", "-l"]);
        assert_eq!(words("/bin/busybox", &["busybox", "sh"]), ["busybox", "sh"]);
        assert_eq!(words("/tmp/busybox", &["cat"]), ["/tmp/busybox"]);
    }

    #[test]
    fn allow_patterns_are_word_prefixes_and_conditions_are_left_to_the_host() {
        let allow = ["git status", "git", "true", "LD_PRELOAD=* ls", " ", "/opt/x"].map(String::from).to_vec();
        let gate = ExecGate { allow: allow.clone(), deny: vec!["git push".into()] };
        assert!(gate.allows(&words("/usr/bin/git", &["git", "status", "-s"])));
        assert!(!gate.allows(&words("/usr/bin/git", &["git", "push", "-f"])), "denied");
        assert!(gate.allows(&words("/usr/bin/git", &["git"])));
        assert!(!gate.allows(&words("/tmp/git", &["git", "status"])));
        assert!(gate.allows(&words("/bin/true", &["x"])));
        assert!(!gate.allows(&words("/bin/truex", &["truex"])));
        assert!(!gate.allows(&words("/bin/ls", &["ls"])));
        assert!(!ExecGate::default().allows(&words("/bin/true", &["true"])));
        // A deny pattern names a program by its base name wherever it lives.
        let gate = ExecGate { allow: allow.clone(), deny: vec!["x".into()] };
        assert!(!gate.allows(&words("/opt/x", &["x"])));
        // A condition on variables the agent cannot see sends everything to the host.
        let gate = ExecGate { allow, deny: vec!["LD_PRELOAD=*".into()] };
        assert!(!gate.allows(&words("/bin/true", &["true"])));
    }
}
