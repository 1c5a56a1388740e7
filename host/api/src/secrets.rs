//! Credentials a session's guest only ever sees as placeholders: the host's egress proxy puts
//! the value in place of the placeholder, and only in requests to the hosts the secret is bound
//! to (`docs/network.md`, "Secrets").

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A secret's value. Its `Debug` never shows it; it is never part of a record, a log or an
/// event (the only things that serialize it are a client's request and its parse).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(transparent)]
pub struct SecretValue(String);

impl SecretValue {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value itself: for the proxy that substitutes it, nothing else.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for SecretValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SecretValue(<{} bytes>)", self.0.len())
    }
}

impl Drop for SecretValue {
    // Best effort: the bytes do not linger in freed memory (a copy made by a parser may).
    fn drop(&mut self) {
        // SAFETY: zero bytes are valid UTF-8, and the string is dropped right after.
        unsafe { self.0.as_bytes_mut() }.fill(0);
    }
}

/// Where in a request the proxy looks for a secret's placeholder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Inject {
    /// Any request header's value (`Authorization: Bearer …`, `X-Api-Key: …`).
    Header,
    /// The user or password of an `Authorization: Basic` header, decoded (what `git` sends).
    Basic,
    /// The request target: its path and query (`?key=…`). Off unless asked: servers log URLs.
    Query,
}

fn default_inject() -> Vec<Inject> {
    vec![Inject::Header, Inject::Basic]
}

/// A secret as `session.start` and `session.set_secret` take it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SecretSpec {
    /// The environment variable the guest's processes see it as (holding the placeholder):
    /// letters, digits and `_`, not starting with a digit, at most 64 bytes.
    pub name: String,
    /// The value. Exactly one of `value` and `from_env`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<SecretValue>,
    /// The name of a variable of umbrad's own environment holding the value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_env: Option<String>,
    /// The hosts that receive the value: `api.example.com` or `*.example.com` (any name below
    /// it). A request to any other host carries the placeholder unchanged.
    pub hosts: Vec<String>,
    /// Where the placeholder is replaced: `header` and `basic` unless given.
    #[serde(default = "default_inject")]
    pub inject: Vec<Inject>,
}

/// The longest secret value accepted (a header line's worth).
pub const MAX_SECRET_BYTES: usize = 16 * 1024;

/// How many secrets a session may hold.
pub const MAX_SECRETS: usize = 64;

impl SecretSpec {
    /// Checks everything but where the value comes from (see [`SecretSpec::resolve_value`]).
    pub fn validate(&self) -> Result<(), String> {
        let n = &self.name;
        if n.is_empty()
            || n.len() > 64
            || n.starts_with(|c: char| c.is_ascii_digit())
            || !n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        {
            return Err(format!("secret name {n:?}: use letters, digits and _ (not first), at most 64 bytes"));
        }
        if self.hosts.is_empty() {
            return Err(format!("secret {n}: bind it to at least one host (`hosts`)"));
        }
        for h in &self.hosts {
            if !umbra_policy::network::is_host_name(h.strip_prefix("*.").unwrap_or(h)) {
                return Err(format!("secret {n}: {h:?} is not a host name or *.domain"));
            }
        }
        if self.inject.is_empty() {
            return Err(format!("secret {n}: `inject` names no place (header, basic, query)"));
        }
        match (&self.value, &self.from_env) {
            (Some(_), Some(_)) => Err(format!("secret {n}: give `value` or `from_env`, not both")),
            (None, None) => Err(format!("secret {n}: give its `value` or `from_env`")),
            (Some(v), None) => check_value(n, v.expose()),
            (None, Some(var)) if var.is_empty() || var.contains(['=', '\0']) => {
                Err(format!("secret {n}: from_env {var:?} is not a variable name"))
            }
            (None, Some(_)) => Ok(()),
        }
    }

    /// The value: given, or read from `env` (umbrad's environment) now.
    pub fn resolve_value(&self, env: impl Fn(&str) -> Option<String>) -> Result<SecretValue, String> {
        if let Some(v) = &self.value {
            return Ok(v.clone());
        }
        let var = self.from_env.as_deref().unwrap_or_default();
        let value = env(var).ok_or_else(|| format!("secret {}: umbrad's environment has no {var}", self.name))?;
        check_value(&self.name, &value)?;
        Ok(SecretValue::new(value))
    }
}

fn check_value(name: &str, v: &str) -> Result<(), String> {
    if v.is_empty() || v.len() > MAX_SECRET_BYTES {
        return Err(format!("secret {name}: its value must be 1 to {MAX_SECRET_BYTES} bytes"));
    }
    // It goes into header lines: a line break would let it add headers of its own.
    if v.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0) {
        return Err(format!("secret {name}: its value holds a line break or NUL"));
    }
    Ok(())
}

/// An SSH key the session's agent holds on the host (the guest's `SSH_AUTH_SOCK` reaches it;
/// the private key never enters the guest), usable only for logins to `hosts`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SshKeySpec {
    /// What events and `ssh-add -l` call it (the key's comment in the agent).
    pub name: String,
    /// The private key, OpenSSH format, unencrypted. Exactly one of this and `from_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub private_key: Option<SecretValue>,
    /// A file of umbrad's user holding it (read at start and after umbrad restarts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_file: Option<std::path::PathBuf>,
    /// The servers it may log in to, each known by its host keys (as `ssh-add -h` restricts a
    /// key). At least one.
    pub hosts: Vec<SshHostSpec>,
}

/// A server an SSH key may be used for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SshHostSpec {
    /// Its name, for events and for finding its keys in `~/.ssh/known_hosts`.
    pub name: String,
    /// Its host keys, OpenSSH public-key lines (`ssh-ed25519 AAAA…`); when absent, the
    /// unhashed lines of umbrad's user's `~/.ssh/known_hosts` that name it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub host_keys: Vec<String>,
}

impl SshKeySpec {
    pub fn validate(&self) -> Result<(), String> {
        let n = &self.name;
        if n.is_empty() || n.len() > 64 || n.chars().any(|c| c.is_control()) {
            return Err(format!("ssh key name {n:?}: 1 to 64 printable characters"));
        }
        match (&self.private_key, &self.from_file) {
            (Some(_), Some(_)) => return Err(format!("ssh key {n}: give `private_key` or `from_file`, not both")),
            (None, None) => return Err(format!("ssh key {n}: give its `private_key` or `from_file`")),
            _ => {}
        }
        if self.hosts.is_empty() {
            return Err(format!("ssh key {n}: name at least one host it may log in to"));
        }
        for h in &self.hosts {
            if !umbra_policy::network::is_host_name(&h.name) && h.name.parse::<std::net::IpAddr>().is_err() {
                return Err(format!("ssh key {n}: {:?} is not a host name", h.name));
            }
        }
        Ok(())
    }
}

/// An SSH key as `session.get` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SshKeyInfo {
    pub name: String,
    /// `SHA256:…`, as `ssh-add -l` shows it.
    pub fingerprint: String,
    pub hosts: Vec<String>,
}

/// A secret as `session.get` reports it: never its value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SecretInfo {
    pub name: String,
    /// What the guest's processes see in `$name`.
    pub placeholder: String,
    pub hosts: Vec<String>,
    pub inject: Vec<Inject>,
    /// The variable of umbrad's environment it comes from, when it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_env: Option<String>,
    /// Whether the host holds a value (a value given inline is gone after umbrad restarts,
    /// until `session.set_secret` gives it again).
    pub has_value: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: serde_json::Value) -> SecretSpec {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn a_spec_is_checked_and_defaults_to_headers_and_basic() {
        let s = spec(serde_json::json!({"name": "GH_TOKEN", "value": "v", "hosts": ["*.github.com"]}));
        assert_eq!(s.inject, vec![Inject::Header, Inject::Basic]);
        s.validate().unwrap();
        for (bad, why) in [
            (serde_json::json!({"name": "1X", "value": "v", "hosts": ["a.b"]}), "secret name"),
            (serde_json::json!({"name": "X", "value": "v", "hosts": []}), "at least one host"),
            (serde_json::json!({"name": "X", "value": "v", "hosts": ["a b"]}), "not a host name"),
            (serde_json::json!({"name": "X", "hosts": ["a.b"]}), "give its"),
            (serde_json::json!({"name": "X", "value": "v", "from_env": "Y", "hosts": ["a.b"]}), "not both"),
            (serde_json::json!({"name": "X", "value": "a\r\nHost: evil", "hosts": ["a.b"]}), "line break"),
            (serde_json::json!({"name": "X", "value": "v", "hosts": ["a.b"], "inject": []}), "no place"),
        ] {
            let e = spec(bad).validate().unwrap_err();
            assert!(e.contains(why), "{e}");
        }
    }

    #[test]
    fn a_value_never_shows_in_debug_output() {
        let s = spec(serde_json::json!({"name": "K", "value": "hunter2", "hosts": ["a.b"]}));
        assert!(!format!("{s:?}").contains("hunter2"));
        let from_env = spec(serde_json::json!({"name": "K", "from_env": "K_VAR", "hosts": ["a.b"]}));
        let v = from_env.resolve_value(|k| (k == "K_VAR").then(|| "from-env".to_string())).unwrap();
        assert_eq!(v.expose(), "from-env");
        assert!(from_env.resolve_value(|_| None).unwrap_err().contains("no K_VAR"));
    }
}
