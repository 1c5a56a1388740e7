//! Which environment variables change what a command runs: where programs are looked up, what
//! the dynamic loader or an interpreter loads first, what a shell sources, what git executes.
//! An approved `git status` with `LD_PRELOAD=/tmp/x.so`, `PATH=/tmp/evil:$PATH`, `BASH_ENV=…`
//! or `GIT_CONFIG_COUNT=1 GIT_CONFIG_KEY_0=core.fsmonitor …` runs something else than what was
//! approved, so these are part of the decision (`rules::allow_matches`) and shown to the
//! person asked. Other variables (`RUST_LOG`, `CI`, `LANG`) are not.

/// Exact names.
pub const NAMES: &[&str] = &[
    // Program lookup and the shells' start-up files and hooks.
    "PATH",
    "ENV",
    "BASH_ENV",
    "SHELLOPTS",
    "BASHOPTS",
    "PS4",
    "PROMPT_COMMAND",
    "IFS",
    "CDPATH",
    "HOME",
    "ZDOTDIR",
    "XDG_CONFIG_HOME",
    "XDG_CONFIG_DIRS",
    // The C library.
    "GCONV_PATH",
    "GLIBC_TUNABLES",
    "LOCPATH",
    "HOSTALIASES",
    "RESOLV_HOST_CONF",
    // Interpreters' module paths and start-up code.
    "PERL5LIB",
    "PERLLIB",
    "PERL5OPT",
    "RUBYLIB",
    "RUBYOPT",
    "GEM_HOME",
    "GEM_PATH",
    "BUNDLE_GEMFILE",
    "LUA_PATH",
    "LUA_CPATH",
    "CLASSPATH",
    "JAVA_TOOL_OPTIONS",
    "_JAVA_OPTIONS",
    "JDK_JAVA_OPTIONS",
    "TCLLIBPATH",
    "R_PROFILE",
    "R_PROFILE_USER",
    // Build tools that run what a variable names.
    "RUSTC",
    "RUSTC_WRAPPER",
    "RUSTC_WORKSPACE_WRAPPER",
    "RUSTFLAGS",
    "RUSTDOCFLAGS",
    "CC",
    "CXX",
    "LD",
    "AR",
    "CPP",
    "MAKEFLAGS",
    "MAKEFILES",
    "GOFLAGS",
    "CGO_CFLAGS",
    "CGO_LDFLAGS",
    // Programs other programs start.
    "EDITOR",
    "VISUAL",
    "PAGER",
    "MANPAGER",
    "BROWSER",
    "LESSOPEN",
    "LESSCLOSE",
    "SSH_ASKPASS",
    "SUDO_ASKPASS",
    "SUDO_EDITOR",
    "TAR_OPTIONS",
    "GZIP",
    "XZ_OPT",
    "ZSTD_CLEVEL",
    "WGETRC",
    "CURL_HOME",
];

/// Name prefixes: every variable starting with one of these.
pub const PREFIXES: &[&str] = &[
    // The dynamic loader (glibc `LD_PRELOAD`, `LD_LIBRARY_PATH`, `LD_AUDIT`; macOS `DYLD_`).
    "LD_",
    "DYLD_",
    // git: `GIT_CONFIG_*`, `GIT_EXEC_PATH`, `GIT_SSH_COMMAND`, `GIT_DIR`, `GIT_PAGER`, …
    "GIT_",
    // Functions bash imports from its environment (`BASH_FUNC_git%%=() { …; }`).
    "BASH_FUNC_",
    // Python (`PYTHONPATH`, `PYTHONSTARTUP`, `PYTHONHOME`, …), Node (`NODE_OPTIONS`,
    // `NODE_PATH`), npm and other package managers' configuration.
    "PYTHON",
    "NODE_",
    "NPM_CONFIG_",
    "YARN_",
    "PIP_",
    "CARGO_",
    "RUSTUP_",
    "GOPATH",
    "GOROOT",
    "GOTOOLCHAIN",
    "MAVEN_",
    "GRADLE_",
    "COMPOSER_",
];

/// Whether variable `name` set to `value` can change what a command runs. A value that is a
/// bash function definition (`() { …`) is, whatever the name: older bashes import those.
pub fn changes_what_runs(name: &str, value: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    NAMES.contains(&upper.as_str())
        || PREFIXES.iter().any(|p| upper.starts_with(p))
        || value.trim_start().starts_with("() {")
}

/// The names in `env` that change what runs, in order.
pub fn what_changes_what_runs<'a>(env: impl IntoIterator<Item = (&'a String, &'a String)>) -> Vec<String> {
    env.into_iter().filter(|(n, v)| changes_what_runs(n, v)).map(|(n, _)| n.clone()).collect()
}
