//! The rules applied to each part of a command: prefix matching of allow and deny patterns,
//! and the `rm` and `sudo` protections. (What wrappers and shells run is the parser's: it looks
//! through them while splitting.)

use std::path::{Component, Path, PathBuf};

use super::parse::{is_identifier, program_of, Part, Word};

/// A pattern: optional leading `NAME=value` conditions on the command's variables (`value`
/// `*` for any value), then the command prefix as words: `git status`,
/// `LD_PRELOAD=* git status`, `PATH=/usr/bin:/bin make`, or only conditions in a deny list
/// (`LD_PRELOAD=*`: any command run with it).
struct Pattern<'a> {
    env: Vec<(&'a str, &'a str)>,
    words: Vec<&'a str>,
}

fn pattern(text: &str) -> Pattern<'_> {
    let mut env = Vec::new();
    let mut words: Vec<&str> = text.split_whitespace().collect();
    while let Some(first) = words.first() {
        let Some((name, value)) = first.split_once('=') else { break };
        if !is_identifier(name) {
            break;
        }
        env.push((name, value));
        words.remove(0);
    }
    Pattern { env, words }
}

/// Whether `value` satisfies a pattern's `NAME=want` (`*` any value; otherwise the literal
/// value exactly).
fn value_matches(want: &str, value: &Word) -> bool {
    want == "*" || (value.literal && value.text == want)
}

/// Whether the part's words start with the pattern's (seed 003's `$Jt`, on parsed words: `rm`
/// matches `rm -rf /` but not `rmdir foo`; `git push` matches `git push origin`). A pattern
/// whose first word has no `/` also matches the program by its base name (`rm` matches
/// `/bin/rm -rf /`) when `by_name` is set — deny lists do, allow lists do not (another
/// directory's `rm` is another program). Variables are not looked at here: see
/// [`allow_matches`] and [`deny_matches`].
pub fn prefix_matches(part: &Part, pattern_text: &str, by_name: bool) -> bool {
    words_match(part, &pattern(pattern_text).words, by_name)
}

fn words_match(part: &Part, want: &[&str], by_name: bool) -> bool {
    if want.is_empty() || part.words.len() < want.len() {
        return false;
    }
    let first = &part.words[0].text;
    let first_ok = first == want[0] || (by_name && !want[0].contains('/') && part.program() == Some(want[0]));
    first_ok && want[1..].iter().zip(&part.words[1..]).all(|(w, a)| *w == a.text)
}

/// A deny pattern matches a part when its words prefix it (by name too) and every variable it
/// names is set for the part (to that value, or to any with `*`); a pattern of variables only
/// matches every part run with them.
pub fn deny_matches(part: &Part, pattern_text: &str) -> bool {
    let p = pattern(pattern_text);
    if p.words.is_empty() && p.env.is_empty() {
        return false;
    }
    let env_ok = p.env.iter().all(|(name, want)| part.env.iter().any(|(n, v)| n == name && value_matches(want, v)));
    env_ok && (p.words.is_empty() || words_match(part, &p.words, true))
}

/// A variable set for `part` that changes what it runs and that allow pattern `pattern_text`
/// does not permit (the pattern permits `NAME=value` and `NAME=*` it lists), if any.
pub fn unpermitted_env<'a>(part: &'a Part, pattern_text: &str) -> Option<&'a (String, Word)> {
    let p = pattern(pattern_text);
    part.env.iter().find(|(name, value)| {
        super::env::changes_what_runs(name, &value.text)
            && !p.env.iter().any(|(n, want)| n == name && value_matches(want, value))
    })
}

/// An allow pattern matches a part when its words prefix it exactly (not by name) and every
/// variable set for the part that changes what runs is one the pattern permits: `git status`
/// does not allow `LD_PRELOAD=/tmp/x.so git status`; `LD_PRELOAD=* git status` does.
pub fn allow_matches(part: &Part, pattern_text: &str) -> bool {
    words_match(part, &pattern(pattern_text).words, false) && unpermitted_env(part, pattern_text).is_none()
}

/// Programs that run commands as another user.
pub const PRIVILEGE_PROGRAMS: [&str; 4] = ["sudo", "doas", "su", "pkexec"];

/// A protection a part trips: it needs a person's approval in every mode unless an allow
/// pattern names the program explicitly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Protection {
    Privilege { program: String },
    RmRecursiveRoot { path: String },
    RmOutsideWorkspace { path: String },
    RmUnknownTarget { target: String },
}

/// Which protection `part` trips, if any. `cwd` and `workspace` are guest paths; `rm` targets
/// are resolved against `cwd` lexically.
pub fn protection(part: &Part, cwd: &Path, workspace: &[PathBuf]) -> Option<Protection> {
    let program = program_of(&part.words)?;
    if PRIVILEGE_PROGRAMS.contains(&program) {
        return Some(Protection::Privilege { program: program.to_string() });
    }
    if program != "rm" {
        return None;
    }
    let mut recursive = false;
    let mut targets = Vec::new();
    let mut options_done = false;
    for w in &part.words[1..] {
        let t = w.text.as_str();
        if !options_done && t == "--" {
            options_done = true;
        } else if !options_done && t.starts_with("--") {
            recursive |= t == "--recursive";
        } else if !options_done && t.starts_with('-') && t.len() > 1 && w.literal {
            recursive |= t.contains('r') || t.contains('R');
        } else {
            targets.push(w);
        }
    }
    // Recursive deletes on root-like paths first: they are the worse of the two.
    let mut outside = None;
    for target in targets {
        if !target.literal {
            if recursive && is_home_like(&target.text) {
                return Some(Protection::RmRecursiveRoot { path: target.text.clone() });
            }
            outside.get_or_insert(Protection::RmUnknownTarget { target: target.text.clone() });
            continue;
        }
        let Some(path) = resolve(cwd, &target.text) else {
            outside.get_or_insert(Protection::RmUnknownTarget { target: target.text.clone() });
            continue;
        };
        if recursive && is_root_like(&path, workspace) {
            return Some(Protection::RmRecursiveRoot { path: path.display().to_string() });
        }
        if !workspace.iter().any(|root| path.starts_with(root)) {
            outside.get_or_insert(Protection::RmOutsideWorkspace { path: path.display().to_string() });
        }
    }
    outside
}

/// Programs whose arguments name files they write, and which of them: every operand
/// (`tee`, `touch`, `truncate`), the last (`cp`, `mv`, `install`, `ln`: the destination, or a
/// directory it writes into), the operands after the script with `-i` (`sed`, `perl`), `of=`
/// (`dd`).
const WRITERS_ALL: [&str; 3] = ["tee", "touch", "truncate"];
const WRITERS_LAST: [&str; 4] = ["cp", "mv", "install", "ln"];
const WRITERS_IN_PLACE: [&str; 2] = ["sed", "perl"];

/// The files a part writes, as far as its words show: its output redirections, and the
/// operands of the writers above. A heuristic for a person's attention (`protect_dotfiles`),
/// never a boundary: a program can write whatever it likes.
pub fn written(part: &Part) -> Vec<&Word> {
    let mut out: Vec<&Word> = part.writes.iter().collect();
    let Some(program) = program_of(&part.words) else { return out };
    let operands: Vec<&Word> = part.words[1..].iter().filter(|w| !w.text.starts_with('-') || w.text == "-").collect();
    if WRITERS_ALL.contains(&program) {
        out.extend(operands);
    } else if WRITERS_LAST.contains(&program) {
        out.extend(operands.last());
        // `cp -t DIR …`, `--target-directory=DIR`.
        let words = &part.words[1..];
        out.extend(words.iter().zip(words.iter().skip(1)).filter(|(w, _)| w.text == "-t").map(|(_, dir)| dir));
        out.extend(words.iter().filter(|w| w.text.starts_with("--target-directory=")));
    } else if WRITERS_IN_PLACE.contains(&program) {
        // `-i`, `-i.bak`, `-pi`, `--in-place`: an option cluster with `i`.
        let cluster = |t: &str| t.starts_with('-') && !t.starts_with("--") && t[1..].contains('i');
        if part.words[1..].iter().any(|w| cluster(&w.text) || w.text.starts_with("--in-place")) {
            // The first operand is the script, unless an option gave it.
            let scripted = part.words[1..].iter().any(|w| {
                w.text.starts_with("-e")
                    || w.text.starts_with("--expression")
                    || w.text.starts_with("-f")
                    || (program == "perl" && cluster(&w.text) && w.text.ends_with('e'))
            });
            out.extend(operands.into_iter().skip(usize::from(!scripted)));
        }
    } else if program == "dd" {
        out.extend(part.words[1..].iter().filter(|w| w.text.starts_with("of=")));
    }
    out
}

/// A file `part` writes that is a dotfile (a path with a component starting with `.`, other
/// than `.` and `..`: `.env`, `.git/config`, `.github/workflows/x.yml`) in one of the
/// `writable` folders — or one whose place is only known when the shell runs (`$D/.env`).
pub fn dotfile_write(part: &Part, cwd: &Path, writable: &[PathBuf]) -> Option<String> {
    for word in written(part) {
        let text = word
            .text
            .strip_prefix("of=")
            .or_else(|| word.text.strip_prefix("--target-directory="))
            .unwrap_or(&word.text);
        let dotted = text.split('/').any(|c| c.starts_with('.') && c != "." && c != "..");
        if !dotted {
            continue;
        }
        if !word.literal {
            return Some(text.to_string());
        }
        match resolve(cwd, text) {
            Some(path) if writable.iter().any(|root| path.starts_with(root)) => {
                return Some(path.display().to_string())
            }
            Some(_) => {}
            None => return Some(text.to_string()),
        }
    }
    None
}

/// `~`, `~/`, `~user`, `$HOME`, `${HOME}`, optionally followed by `/*`.
fn is_home_like(text: &str) -> bool {
    let t = text.trim_end_matches('*').trim_end_matches('/');
    t == "~" || (t.starts_with('~') && !t.contains('/')) || t == "$HOME" || t == "${HOME}"
}

/// A target resolved against the working directory, `..` applied lexically. `None` when the
/// working directory is not absolute.
fn resolve(cwd: &Path, target: &str) -> Option<PathBuf> {
    let joined = if target.starts_with('/') { PathBuf::from(target) } else { cwd.join(target) };
    if !joined.is_absolute() {
        return None;
    }
    let mut out = PathBuf::from("/");
    for c in joined.components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    Some(out)
}

/// `/`, a top-level directory (`/usr`, `/etc`), a home directory (`/home/me`, `/root`), a
/// workspace folder itself or one of its parents — or a glob (`/*`, `/home/*`) directly in one.
fn is_root_like(path: &Path, workspace: &[PathBuf]) -> bool {
    let is_glob = |s: &str| s.contains(['*', '?', '[']);
    let path = match path.file_name().and_then(|n| n.to_str()) {
        Some(name) if is_glob(name) => path.parent().unwrap_or(path),
        _ => path,
    };
    let depth = path.components().filter(|c| matches!(c, Component::Normal(_))).count();
    depth <= 1 || (path.starts_with("/home") && depth <= 2) || workspace.iter().any(|root| root.starts_with(path))
}

#[cfg(test)]
mod tests {
    use super::super::parse::split;
    use super::*;

    fn part(text: &str) -> Part {
        split(text).unwrap().remove(0)
    }

    #[test]
    fn prefix_matching_follows_the_seed() {
        // Seed 003's examples, then words rather than characters.
        assert!(prefix_matches(&part("rm -rf /"), "rm", false));
        assert!(!prefix_matches(&part("rmdir foo"), "rm", false));
        assert!(prefix_matches(&part("git push"), "git", false));
        assert!(prefix_matches(&part("git push origin main"), "git push", false));
        assert!(!prefix_matches(&part("git pushx"), "git push", false));
        assert!(!prefix_matches(&part("git"), "git push", false));
        assert!(prefix_matches(&part("  git   push  "), "git  push", false));
        assert!(!prefix_matches(&part("/bin/rm x"), "rm", false));
        assert!(prefix_matches(&part("/bin/rm x"), "rm", true));
        assert!(prefix_matches(&part("/bin/rm x"), "/bin/rm", false));
        assert!(!prefix_matches(&part("ls"), "", true));
    }

    #[test]
    fn rm_and_privilege_protection() {
        let ws = [PathBuf::from("/sessions/s/mnt/work")];
        let cwd = Path::new("/sessions/s/mnt/work");
        let p = |t: &str| protection(&part(t), cwd, &ws);
        assert_eq!(p("rm build/x.o"), None);
        assert_eq!(p("rm -rf build target"), None);
        assert_eq!(p("rm -rf ./src/../build/*"), None);
        assert!(matches!(p("rm -rf /"), Some(Protection::RmRecursiveRoot { .. })));
        assert!(matches!(p("rm -fr /*"), Some(Protection::RmRecursiveRoot { .. })));
        assert!(matches!(p("rm -r --no-preserve-root /usr"), Some(Protection::RmRecursiveRoot { .. })));
        assert!(matches!(p("rm --recursive /home/me"), Some(Protection::RmRecursiveRoot { .. })));
        assert!(matches!(p("rm -rf ~"), Some(Protection::RmRecursiveRoot { .. })));
        assert!(matches!(p("rm -rf $HOME/*"), Some(Protection::RmRecursiveRoot { .. })));
        assert!(matches!(p("rm -rf ."), Some(Protection::RmRecursiveRoot { .. })), "the workspace itself");
        assert!(matches!(p("rm -rf ../../mnt"), Some(Protection::RmRecursiveRoot { .. })));
        assert!(matches!(p("rm /etc/passwd"), Some(Protection::RmOutsideWorkspace { .. })));
        assert!(matches!(p("rm ../other/file"), Some(Protection::RmOutsideWorkspace { .. })));
        assert!(matches!(p("rm -f \"$TARGET\""), Some(Protection::RmUnknownTarget { .. })));
        assert!(p("rm -- -rf").is_none(), "after -- it is a file name");
        assert_eq!(p("sudo ls"), Some(Protection::Privilege { program: "sudo".into() }));
        assert_eq!(p("/usr/bin/sudo ls"), Some(Protection::Privilege { program: "sudo".into() }));
        assert_eq!(p("rmdir /etc"), None);
        // Without a workspace every rm target is outside it.
        assert!(matches!(
            protection(&part("rm x"), Path::new("/tmp"), &[]),
            Some(Protection::RmOutsideWorkspace { .. })
        ));
    }
}
