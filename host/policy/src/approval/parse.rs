//! Splitting a command line into the simple commands it would run, with a real shell parser.
//!
//! brush-parser (the parser of the `brush` shell: POSIX and bash syntax) gives the syntax tree;
//! this module walks it and collects every simple command: the parts of `&&`, `||`, `;` and `&`
//! lists and of pipelines, the bodies of subshells, brace groups, `if`, `while`, `until`,
//! `for` and `case`, process substitutions, and every command substitution (`$(…)` and
//! backticks, parsed again from their text) wherever it appears — in an argument, an
//! assignment, a redirection, a here-document. It also looks *through* what runs another
//! command: wrappers (`env`, `sudo`, `nice`, `timeout`, `xargs`, …) add the command they run as
//! a part of its own, and `sh -c SCRIPT` / `eval` add the commands of their script.
//!
//! What it cannot see into it refuses (the caller then asks a person): a function definition,
//! a command inside a parameter expansion (`${x:-$(cmd)}`) or an arithmetic expression, a
//! script known only when the shell runs (`sh -c "$X"`), nesting deeper than [`MAX_DEPTH`].

use std::io::BufReader;
use std::panic::{catch_unwind, AssertUnwindSafe};

use brush_parser::ast::{self, Command, CommandPrefixOrSuffixItem, CompoundCommand, IoFileRedirectTarget, IoRedirect};
use brush_parser::word::{self as bword, WordPiece, WordPieceWithSource};
use brush_parser::{Parser, ParserOptions, SourceInfo};

/// Longest command line considered (longer ones need approval).
pub const MAX_COMMAND_LEN: usize = 64 * 1024;
/// Deepest nesting of substitutions and scripts followed.
pub const MAX_DEPTH: usize = 16;
/// The deepest nesting of parentheses a line may have before it reaches the parser.
/// brush-parser backtracks exponentially on unbalanced ones (found by fuzzing: 20 `(` take
/// 0.1 s, 30 take minutes), and a client's command line must never stall the daemon.
pub const MAX_PARENS: usize = 12;

/// One word of a command, unquoted. An expansion keeps its source text (`$HOME`, `~`,
/// `$(pwd)`), and the word is then not `literal`: its value is only known when the shell runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Word {
    pub text: String,
    pub literal: bool,
}

/// A simple command found in a command line.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Part {
    pub words: Vec<Word>,
    /// The part this one runs inside: the wrapper (`sudo`, `env`, …) or shell (`sh -c`) whose
    /// command it is.
    pub via: Option<usize>,
    /// The variables it runs with, as far as the line shows: its own assignments
    /// (`LD_PRELOAD=x git status`), those a wrapper passes on (`env PATH=/tmp git`, `sudo
    /// X=1 cmd`), those of the part it runs inside, and every bare assignment or `export` of
    /// the line (`PATH=/tmp:$PATH; git status`, counted for every part: where in the line it
    /// takes effect is not worked out). [`super::evaluate`] adds the request's own `env`.
    pub env: Vec<(String, Word)>,
    /// The files its output redirections write (`> f`, `>> f`, `<> f`, `>| f`, `&> f`, `>& f`),
    /// its own and those of a compound command around it (`{ a; b; } > f`).
    pub writes: Vec<Word>,
}

impl Part {
    pub fn argv(&self) -> Vec<String> {
        self.words.iter().map(|w| w.text.clone()).collect()
    }

    /// The program's name without its directory (`/usr/bin/sudo` → `sudo`).
    pub fn program(&self) -> Option<&str> {
        let w = self.words.first()?;
        Some(w.text.rsplit('/').next().unwrap_or(&w.text))
    }
}

/// Why a command line could not be split.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    #[error("not valid shell syntax: {0}")]
    Syntax(String),
    #[error("contains {0}, which cannot be checked before it runs")]
    Unsupported(&'static str),
    #[error("longer than {MAX_COMMAND_LEN} bytes")]
    TooLong,
    #[error("nests commands more than {MAX_DEPTH} deep")]
    TooDeep,
    #[error("nests parentheses more than {MAX_PARENS} deep")]
    TooManyParens,
}

/// Every simple command `text` would run, in order of appearance (a substitution before the
/// command whose word holds it).
pub fn split(text: &str) -> Result<Vec<Part>, SplitError> {
    if text.len() > MAX_COMMAND_LEN {
        return Err(SplitError::TooLong);
    }
    if paren_depth(text) > MAX_PARENS {
        return Err(SplitError::TooManyParens);
    }
    if empty_heredoc_delimiter(text) {
        // brush-parser allocates without bound on `cat <<"" ` (found by fuzzing: 2 GiB in
        // 11 s); nobody writes an empty delimiter on purpose.
        return Err(SplitError::Unsupported("a here-document with an empty delimiter"));
    }
    let mut walker = Walker { parts: Vec::new(), options: ParserOptions::default(), bare: Vec::new() };
    walker.program(text, 0, None)?;
    // What a part runs inside passes its variables on; a part comes after the one it runs in.
    let mut parts = walker.parts;
    for i in 0..parts.len() {
        if let Some(outer) = parts[i].via {
            let mut env = parts[outer].env.clone();
            env.append(&mut parts[i].env);
            parts[i].env = env;
        }
    }
    for part in &mut parts {
        let mut env = walker.bare.clone();
        env.append(&mut part.env);
        part.env = env;
    }
    Ok(parts)
}

/// `NAME=value` (or `NAME+=value`) as a variable assignment: the name must be a shell
/// identifier (`[A-Za-z_][A-Za-z0-9_]*`).
pub fn assignment(word: &Word) -> Option<(String, Word)> {
    let (name, value) = word.text.split_once('=')?;
    let name = name.strip_suffix('+').unwrap_or(name);
    is_identifier(name).then(|| (name.to_string(), Word { text: value.to_string(), literal: word.literal }))
}

/// Builtins whose `NAME=value` arguments set variables for the rest of the line.
const SETTERS: [&str; 5] = ["export", "declare", "typeset", "readonly", "local"];

/// The deepest nesting of `(` in `text`, quotes ignored (counting parentheses inside quotes only
/// errs towards asking a person).
fn paren_depth(text: &str) -> usize {
    let (mut depth, mut max) = (0usize, 0usize);
    for b in text.bytes() {
        match b {
            b'(' => {
                depth += 1;
                max = max.max(depth);
            }
            b')' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    max
}

/// Whether a here-document operator (`<<`, `<<-`) has an empty quoted delimiter (`""`, `''`).
fn empty_heredoc_delimiter(text: &str) -> bool {
    let b = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("<<").map(|p| p + i) {
        let mut j = at + 2;
        if b.get(j) == Some(&b'<') {
            // A here-string (`<<<`): not a here-document.
            i = j + 1;
            continue;
        }
        if b.get(j) == Some(&b'-') {
            j += 1;
        }
        while matches!(b.get(j), Some(b' ' | b'\t')) {
            j += 1;
        }
        if matches!((b.get(j), b.get(j + 1)), (Some(b'"'), Some(b'"')) | (Some(b'\''), Some(b'\''))) {
            return true;
        }
        i = at + 2;
    }
    false
}

struct Walker {
    parts: Vec<Part>,
    options: ParserOptions,
    /// Assignments that are commands of their own (`X=1;`, `export X=1`).
    bare: Vec<(String, Word)>,
}

type Result<T, E = SplitError> = std::result::Result<T, E>;

impl Walker {
    fn program(&mut self, text: &str, depth: usize, via: Option<usize>) -> Result<()> {
        if depth > MAX_DEPTH {
            return Err(SplitError::TooDeep);
        }
        let mut parser = Parser::new(BufReader::new(text.as_bytes()), &self.options, &SourceInfo::default());
        // The parser is not meant to panic; if it does on some input, that input is simply
        // not understood.
        let program = catch_unwind(AssertUnwindSafe(|| parser.parse_program()))
            .map_err(|_| SplitError::Syntax("the parser gave up".into()))?
            .map_err(|e| SplitError::Syntax(e.to_string()))?;
        for list in &program.complete_commands {
            self.list(list, depth, via)?;
        }
        Ok(())
    }

    fn list(&mut self, list: &ast::CompoundList, depth: usize, via: Option<usize>) -> Result<()> {
        for ast::CompoundListItem(and_or, _) in &list.0 {
            for (_, pipeline) in and_or.iter() {
                for command in &pipeline.seq {
                    self.command(command, depth, via)?;
                }
            }
        }
        Ok(())
    }

    fn command(&mut self, command: &Command, depth: usize, via: Option<usize>) -> Result<()> {
        match command {
            Command::Simple(simple) => self.simple(simple, depth, via),
            Command::Compound(compound, redirects) => {
                let first = self.parts.len();
                self.compound(compound, depth, via)?;
                let mut writes = Vec::new();
                for r in redirects.iter().flat_map(|r| &r.0) {
                    self.redirect(r, depth, via, &mut writes)?;
                }
                for part in &mut self.parts[first..] {
                    part.writes.extend(writes.iter().cloned());
                }
                Ok(())
            }
            Command::Function(_) => Err(SplitError::Unsupported("a function definition")),
            Command::ExtendedTest(test) => self.test(test, depth, via),
        }
    }

    fn test(&mut self, test: &ast::ExtendedTestExpr, depth: usize, via: Option<usize>) -> Result<()> {
        use ast::ExtendedTestExpr as T;
        match test {
            T::And(a, b) | T::Or(a, b) => {
                self.test(a, depth, via)?;
                self.test(b, depth, via)
            }
            T::Not(a) | T::Parenthesized(a) => self.test(a, depth, via),
            T::UnaryTest(_, w) => self.word(w, depth, via).map(drop),
            T::BinaryTest(_, a, b) => {
                self.word(a, depth, via)?;
                self.word(b, depth, via).map(drop)
            }
        }
    }

    fn compound(&mut self, compound: &CompoundCommand, depth: usize, via: Option<usize>) -> Result<()> {
        match compound {
            CompoundCommand::BraceGroup(ast::BraceGroupCommand(list))
            | CompoundCommand::Subshell(ast::SubshellCommand(list)) => self.list(list, depth, via),
            CompoundCommand::ForClause(f) => {
                for w in f.values.iter().flatten() {
                    self.word(w, depth, via)?;
                }
                self.list(&f.body.0, depth, via)
            }
            CompoundCommand::CaseClause(c) => {
                self.word(&c.value, depth, via)?;
                for item in &c.cases {
                    for w in &item.patterns {
                        self.word(w, depth, via)?;
                    }
                    if let Some(cmd) = &item.cmd {
                        self.list(cmd, depth, via)?;
                    }
                }
                Ok(())
            }
            CompoundCommand::IfClause(i) => {
                self.list(&i.condition, depth, via)?;
                self.list(&i.then, depth, via)?;
                for e in i.elses.iter().flatten() {
                    if let Some(c) = &e.condition {
                        self.list(c, depth, via)?;
                    }
                    self.list(&e.body, depth, via)?;
                }
                Ok(())
            }
            CompoundCommand::WhileClause(w) | CompoundCommand::UntilClause(w) => {
                self.list(&w.0, depth, via)?;
                self.list(&w.1 .0, depth, via)
            }
            CompoundCommand::Arithmetic(a) => arithmetic(&a.expr),
            CompoundCommand::ArithmeticForClause(f) => {
                for e in [&f.initializer, &f.condition, &f.updater].into_iter().flatten() {
                    arithmetic(e)?;
                }
                self.list(&f.body.0, depth, via)
            }
        }
    }

    /// Walks a redirection; the file it writes, if it does, goes to `writes`.
    fn redirect(&mut self, r: &IoRedirect, depth: usize, via: Option<usize>, writes: &mut Vec<Word>) -> Result<()> {
        use ast::IoFileRedirectKind as K;
        match r {
            IoRedirect::File(_, kind, target) => match target {
                IoFileRedirectTarget::Filename(w) | IoFileRedirectTarget::Duplicate(w) => {
                    let word = self.word(w, depth, via)?;
                    let fd_copy = matches!(target, IoFileRedirectTarget::Duplicate(_))
                        && (word.text == "-" || word.text.bytes().all(|b| b.is_ascii_digit()));
                    let writing =
                        matches!(kind, K::Write | K::Append | K::ReadAndWrite | K::Clobber | K::DuplicateOutput);
                    if writing && !fd_copy {
                        writes.push(word);
                    }
                    Ok(())
                }
                IoFileRedirectTarget::Fd(_) => Ok(()),
                IoFileRedirectTarget::ProcessSubstitution(_, ast::SubshellCommand(list)) => self.list(list, depth, via),
            },
            IoRedirect::HereDocument(_, doc) if doc.requires_expansion => self.word(&doc.doc, depth, via).map(drop),
            IoRedirect::HereDocument(..) => Ok(()),
            IoRedirect::HereString(_, w) => self.word(w, depth, via).map(drop),
            IoRedirect::OutputAndError(w, _) => {
                writes.push(self.word(w, depth, via)?);
                Ok(())
            }
        }
    }

    fn simple(&mut self, simple: &ast::SimpleCommand, depth: usize, via: Option<usize>) -> Result<()> {
        let mut words = Vec::new();
        let mut env = Vec::new();
        let mut writes = Vec::new();
        let prefix = simple.prefix.iter().flat_map(|p| &p.0);
        let suffix = simple.suffix.iter().flat_map(|s| &s.0);
        for item in prefix {
            match item {
                // `X=$(cmd) make`: the assignment's substitution runs, the assignment is no
                // word but a variable of the command.
                CommandPrefixOrSuffixItem::AssignmentWord(_, w) => {
                    let word = self.word(w, depth, via)?;
                    env.extend(assignment(&word));
                }
                other => self.item(other, &mut words, &mut writes, depth, via)?,
            }
        }
        if let Some(name) = &simple.word_or_name {
            words.push(self.word(name, depth, via)?);
        }
        for item in suffix {
            self.item(item, &mut words, &mut writes, depth, via)?;
        }
        if words.is_empty() {
            if !writes.is_empty() {
                // `> .env` alone truncates the file: a part that runs nothing but writes.
                self.parts.push(Part { words: vec![Word { text: ":".into(), literal: true }], via, env, writes });
                return Ok(());
            }
            // `PATH=/tmp:$PATH` alone: it changes what the rest of the line runs.
            self.bare.extend(env);
            return Ok(());
        }
        if words[0].literal && SETTERS.contains(&words[0].text.as_str()) {
            self.bare.extend(words[1..].iter().filter_map(assignment));
        }
        let first = self.parts.len();
        self.part(words, env, depth, via)?;
        self.parts[first].writes = writes;
        Ok(())
    }

    fn item(
        &mut self,
        item: &CommandPrefixOrSuffixItem,
        words: &mut Vec<Word>,
        writes: &mut Vec<Word>,
        depth: usize,
        via: Option<usize>,
    ) -> Result<()> {
        match item {
            CommandPrefixOrSuffixItem::Word(w) | CommandPrefixOrSuffixItem::AssignmentWord(_, w) => {
                words.push(self.word(w, depth, via)?)
            }
            CommandPrefixOrSuffixItem::IoRedirect(r) => self.redirect(r, depth, via, writes)?,
            CommandPrefixOrSuffixItem::ProcessSubstitution(_, ast::SubshellCommand(list)) => {
                self.list(list, depth, via)?
            }
        }
        Ok(())
    }

    /// Records a simple command, then what it runs in turn (a wrapper's command, a shell's
    /// script).
    fn part(&mut self, words: Vec<Word>, env: Vec<(String, Word)>, depth: usize, via: Option<usize>) -> Result<()> {
        if depth > MAX_DEPTH {
            return Err(SplitError::TooDeep);
        }
        let index = self.parts.len();
        self.parts.push(Part { words: words.clone(), via, env, writes: Vec::new() });
        if let Some(inner) = unwrap_wrapper(&words) {
            if !inner.is_empty() {
                // `env LD_PRELOAD=x git`, `sudo PATH=/tmp cmd`: the wrapper sets them for its
                // command.
                let passed = words[1..words.len() - inner.len()].iter().filter_map(assignment).collect();
                self.part(inner.to_vec(), passed, depth + 1, Some(index))?;
            }
        }
        if let Some(script) = shell_script(&words) {
            let script = script.ok_or(SplitError::Unsupported("a shell script known only when it runs"))?;
            self.program(&script, depth + 1, Some(index))?;
        }
        Ok(())
    }

    fn word(&mut self, word: &ast::Word, depth: usize, via: Option<usize>) -> Result<Word> {
        let pieces =
            bword::parse(&word.value, &self.options).map_err(|e| SplitError::Syntax(format!("{}: {e}", word.value)))?;
        let mut out = Word { text: String::new(), literal: true };
        self.pieces(&pieces, &word.value, &mut out, depth, via)?;
        Ok(out)
    }

    fn pieces(
        &mut self,
        pieces: &[WordPieceWithSource],
        source: &str,
        out: &mut Word,
        depth: usize,
        via: Option<usize>,
    ) -> Result<()> {
        for piece in pieces {
            let raw = source.get(piece.start_index..piece.end_index).unwrap_or("$…");
            match &piece.piece {
                WordPiece::Text(s) | WordPiece::SingleQuotedText(s) => out.text.push_str(s),
                WordPiece::AnsiCQuotedText(s) => {
                    out.literal &= !s.contains('\\');
                    out.text.push_str(s);
                }
                WordPiece::EscapeSequence(s) => out.text.push_str(s.strip_prefix('\\').unwrap_or(s)),
                WordPiece::DoubleQuotedSequence(inner) | WordPiece::GettextDoubleQuotedSequence(inner) => {
                    self.pieces(inner, source, out, depth, via)?
                }
                WordPiece::TildePrefix(user) => {
                    out.literal = false;
                    out.text.push('~');
                    out.text.push_str(user);
                }
                WordPiece::ParameterExpansion(expr) => {
                    if runs_commands(&format!("{expr:?}")) {
                        return Err(SplitError::Unsupported("a command inside a parameter expansion"));
                    }
                    out.literal = false;
                    out.text.push_str(raw);
                }
                WordPiece::CommandSubstitution(script) | WordPiece::BackquotedCommandSubstitution(script) => {
                    self.program(script, depth + 1, via)?;
                    out.literal = false;
                    out.text.push_str(raw);
                }
                WordPiece::ArithmeticExpression(expr) => {
                    arithmetic(expr)?;
                    out.literal = false;
                    out.text.push_str(raw);
                }
            }
        }
        Ok(())
    }
}

/// Whether text may hold a command substitution or a process substitution.
fn runs_commands(text: &str) -> bool {
    text.contains("$(") || text.contains('`') || text.contains("<(") || text.contains(">(")
}

fn arithmetic(expr: &ast::UnexpandedArithmeticExpr) -> Result<()> {
    if runs_commands(&expr.value) {
        return Err(SplitError::Unsupported("a command inside an arithmetic expression"));
    }
    Ok(())
}

/// A shell variable name: `[A-Za-z_][A-Za-z0-9_]*`.
pub fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The program a part runs: its first word's file name, when the word is literal.
pub fn program_of(words: &[Word]) -> Option<&str> {
    let w = words.first()?;
    if !w.literal {
        return None;
    }
    Some(w.text.rsplit('/').next().unwrap_or(&w.text))
}

/// For a wrapper — a program that runs the command in its arguments (`sudo`, `env`, `nice`,
/// `timeout`, `xargs`, …) — the words of that command (empty when it runs none). `None` for
/// any other program.
pub fn unwrap_wrapper(words: &[Word]) -> Option<&[Word]> {
    // Options that take a separate value, per wrapper.
    let (takes_value, positional): (&[&str], usize) = match program_of(words)? {
        "sudo" => (&["-u", "-g", "-C", "-D", "-h", "-p", "-r", "-t", "-U", "-T", "-R"], 0),
        "doas" => (&["-u", "-C"], 0),
        "env" => (&["-u", "-C", "--unset", "--chdir"], 0),
        "nice" => (&["-n", "--adjustment"], 0),
        "timeout" => (&["-s", "-k", "--signal", "--kill-after"], 1),
        "xargs" => (&["-a", "-d", "-E", "-I", "-L", "-n", "-P", "-s", "--arg-file", "--delimiter", "--max-args"], 0),
        "stdbuf" => (&["-i", "-o", "-e"], 0),
        "nohup" | "time" | "command" | "builtin" | "exec" | "setsid" => (&["-a"], 0),
        _ => return None,
    };
    let mut rest = &words[1..];
    let mut positional_left = positional;
    while let Some(w) = rest.first() {
        let t = w.text.as_str();
        if t == "--" {
            rest = &rest[1..];
            break;
        }
        if t.starts_with('-') && t.len() > 1 {
            // `command -v x` and `sudo -l` only look things up.
            if matches!(program_of(words), Some("command")) && (t == "-v" || t == "-V") {
                return Some(&[]);
            }
            rest = if takes_value.contains(&t) && rest.len() > 1 { &rest[2..] } else { &rest[1..] };
            continue;
        }
        if program_of(words) == Some("env") && t.contains('=') {
            rest = &rest[1..];
            continue;
        }
        if positional_left > 0 {
            positional_left -= 1;
            rest = &rest[1..];
            continue;
        }
        break;
    }
    Some(rest)
}

/// For a shell given a script (`sh -c SCRIPT`, `bash -lc SCRIPT`, `eval WORDS`): `Some(Some
/// script)`, or `Some(None)` when the script is only known when it runs. `None` otherwise.
pub fn shell_script(words: &[Word]) -> Option<Option<String>> {
    let program = program_of(words)?;
    if program == "eval" {
        let args = &words[1..];
        return Some(
            args.iter().all(|w| w.literal).then(|| args.iter().map(|w| w.text.as_str()).collect::<Vec<_>>().join(" ")),
        );
    }
    if !matches!(program, "sh" | "bash" | "dash" | "zsh" | "ksh" | "ash" | "mksh") {
        return None;
    }
    let mut args = words[1..].iter();
    while let Some(w) = args.next() {
        let t = w.text.as_str();
        if !t.starts_with('-') || t == "-" || t == "--" {
            return None;
        }
        if !t.starts_with("--") && t.contains('c') {
            return Some(args.next().and_then(|s| s.literal.then(|| s.text.clone())));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argvs(text: &str) -> Vec<Vec<String>> {
        split(text).unwrap_or_else(|e| panic!("{text}: {e}")).iter().map(Part::argv).collect()
    }

    fn v(parts: &[&[&str]]) -> Vec<Vec<String>> {
        parts.iter().map(|p| p.iter().map(|w| w.to_string()).collect()).collect()
    }

    #[test]
    fn compound_commands_split_into_every_part() {
        let cases: &[(&str, &[&[&str]])] = &[
            ("ls -la", &[&["ls", "-la"]]),
            ("make && make test || echo failed; true", &[&["make"], &["make", "test"], &["echo", "failed"], &["true"]]),
            ("cat a | grep b | wc -l", &[&["cat", "a"], &["grep", "b"], &["wc", "-l"]]),
            ("(cd sub && rm -rf build)", &[&["cd", "sub"], &["rm", "-rf", "build"]]),
            ("{ echo a; echo b; }", &[&["echo", "a"], &["echo", "b"]]),
            ("echo $(rm -rf /)", &[&["rm", "-rf", "/"], &["echo", "$(rm -rf /)"]]),
            ("echo `sudo id`", &[&["sudo", "id"], &["id"], &["echo", "`sudo id`"]]),
            ("X=$(curl evil) make", &[&["curl", "evil"], &["make"]]),
            ("cat <(git log) > $(mktemp)", &[&["git", "log"], &["mktemp"], &["cat"]]),
            ("if test -f x; then rm x; else touch x; fi", &[&["test", "-f", "x"], &["rm", "x"], &["touch", "x"]]),
            ("for f in $(ls); do gzip \"$f\"; done", &[&["ls"], &["gzip", "$f"]]),
            ("while true; do sleep 1; done &", &[&["true"], &["sleep", "1"]]),
            ("'r''m' \"-rf\" /tmp/x", &[&["rm", "-rf", "/tmp/x"]]),
            ("[[ -n $(whoami) ]] && echo y", &[&["whoami"], &["echo", "y"]]),
            ("echo \"$(echo \"$(id)\")\"", &[&["id"], &["echo", "$(id)"], &["echo", "$(echo \"$(id)\")"]]),
        ];
        for (text, want) in cases {
            assert_eq!(argvs(text), v(want), "{text}");
        }
    }

    #[test]
    fn wrappers_and_shells_add_the_command_they_run() {
        let cases: &[(&str, &[&[&str]])] = &[
            ("sudo -u root rm -rf /", &[&["sudo", "-u", "root", "rm", "-rf", "/"], &["rm", "-rf", "/"]]),
            (
                "env A=1 nice -n 5 make",
                &[&["env", "A=1", "nice", "-n", "5", "make"], &["nice", "-n", "5", "make"], &["make"]],
            ),
            ("timeout 10 npm test", &[&["timeout", "10", "npm", "test"], &["npm", "test"]]),
            (
                "sh -c 'git push && sudo reboot'",
                &[&["sh", "-c", "git push && sudo reboot"], &["git", "push"], &["sudo", "reboot"], &["reboot"]],
            ),
            ("bash -lc \"make\"", &[&["bash", "-lc", "make"], &["make"]]),
            ("eval 'rm -rf ~'", &[&["eval", "rm -rf ~"], &["rm", "-rf", "~"]]),
            ("find . | xargs -n 1 rm", &[&["find", "."], &["xargs", "-n", "1", "rm"], &["rm"]]),
            ("bash script.sh", &[&["bash", "script.sh"]]),
        ];
        for (text, want) in cases {
            assert_eq!(argvs(text), v(want), "{text}");
        }
        let parts = split("sudo rm x").unwrap();
        assert_eq!(parts[1].via, Some(0));
    }

    #[test]
    fn expansions_are_marked_not_literal() {
        let parts = split("rm -rf ~ $HOME \"$DIR\"/x build").unwrap();
        let literal: Vec<bool> = parts[0].words.iter().map(|w| w.literal).collect();
        assert_eq!(literal, [true, true, false, false, false, true]);
    }

    #[test]
    fn what_cannot_be_checked_is_refused() {
        for text in [
            "echo 'unterminated",
            "ls &&",
            "f() { rm -rf /; }; f",
            "echo ${X:-$(rm -rf /)}",
            "echo $(( $(id -u) + 1 ))",
            "sh -c \"$SCRIPT\"",
            "if true; then",
        ] {
            assert!(split(text).is_err(), "{text} should not split");
        }
        let deep = "$(".repeat(MAX_DEPTH + 2) + "id" + &")".repeat(MAX_DEPTH + 2);
        assert!(split(&format!("echo {deep}")).is_err());
        assert_eq!(split(&"a".repeat(MAX_COMMAND_LEN + 1)), Err(SplitError::TooLong));
    }

    #[test]
    fn nothing_to_run() {
        assert!(argvs("").is_empty());
        assert!(argvs("# just a comment").is_empty());
        assert!(argvs("X=1").is_empty());
    }
}
