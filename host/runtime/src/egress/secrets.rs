//! A session's secrets as the egress proxy holds them: for each, the placeholder the guest sees
//! and the hosts that get the value in its place. The values live only here, in the host
//! process (and, for `from_env`, in umbrad's environment); never in a record, a log, an event
//! or anything sent over vsock.

use std::collections::BTreeSet;
use std::sync::{Arc, RwLock};

use base64::Engine as _;
use hyper::header::{HeaderMap, HeaderValue, AUTHORIZATION, PROXY_AUTHORIZATION};
use hyper::Uri;
use umbra_api::secrets::{Inject, SecretInfo, SecretSpec, SecretValue, MAX_SECRETS};

pub use super::policy::host_matches;
use super::policy::normalise;

/// The secrets a session's proxy and its spawns share; `session.set_secret` changes them live.
pub type SharedSecrets = Arc<RwLock<Secrets>>;

/// What a session keeps of a secret across daemon restarts: everything but the value.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SecretBinding {
    pub name: String,
    pub placeholder: String,
    pub hosts: Vec<String>,
    pub inject: Vec<Inject>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_env: Option<String>,
}

#[derive(Debug, Clone)]
struct Entry {
    binding: SecretBinding,
    value: Option<SecretValue>,
}

impl Entry {
    fn bound_to(&self, host: &str) -> bool {
        self.binding.hosts.iter().any(|p| host_matches(p, host))
    }
}

/// A fresh placeholder: nothing in it relates to the value.
fn placeholder() -> String {
    let mut bytes = [0u8; 16];
    // The kernel's CSPRNG; a placeholder an attacker could guess would let it be planted.
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
        .expect("/dev/urandom is readable");
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("umbra-secret-{hex}")
}

/// The names a request's placeholders stood for: substituted, or left as they were because the
/// host is not one the secret is bound to (or the host holds no value for it).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Rewrite {
    pub used: BTreeSet<String>,
    pub withheld: BTreeSet<String>,
}

#[derive(Debug, Default, Clone)]
pub struct Secrets {
    entries: Vec<Entry>,
}

impl Secrets {
    /// The bindings a record kept, with the values their `from_env` gives now (an inline value
    /// did not survive: the secret has none until `session.set_secret`).
    pub fn restore(bindings: &[SecretBinding], env: impl Fn(&str) -> Option<String>) -> Self {
        let entries = bindings
            .iter()
            .map(|b| {
                let value = b.from_env.as_deref().and_then(&env).filter(|v| !v.is_empty()).map(SecretValue::new);
                Entry { binding: b.clone(), value }
            })
            .collect();
        Self { entries }
    }

    /// Adds `spec`, or replaces the secret of its name keeping its placeholder. Checked whole.
    pub fn set(&mut self, spec: &SecretSpec, env: impl Fn(&str) -> Option<String>) -> Result<(), String> {
        spec.validate()?;
        let value = spec.resolve_value(env)?;
        let mut inject = spec.inject.clone();
        inject.sort();
        inject.dedup();
        let existing = self.entries.iter().position(|e| e.binding.name == spec.name);
        let binding = SecretBinding {
            name: spec.name.clone(),
            placeholder: existing.map_or_else(placeholder, |i| self.entries[i].binding.placeholder.clone()),
            hosts: spec.hosts.iter().map(|h| normalise(h)).collect(),
            inject,
            from_env: spec.from_env.clone(),
        };
        let entry = Entry { binding, value: Some(value) };
        match existing {
            Some(i) => self.entries[i] = entry,
            None if self.entries.len() >= MAX_SECRETS => {
                return Err(format!("a session holds at most {MAX_SECRETS} secrets"))
            }
            None => self.entries.push(entry),
        }
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn bindings(&self) -> Vec<SecretBinding> {
        self.entries.iter().map(|e| e.binding.clone()).collect()
    }

    pub fn infos(&self) -> Vec<SecretInfo> {
        self.entries
            .iter()
            .map(|e| SecretInfo {
                name: e.binding.name.clone(),
                placeholder: e.binding.placeholder.clone(),
                hosts: e.binding.hosts.clone(),
                inject: e.binding.inject.clone(),
                from_env: e.binding.from_env.clone(),
                has_value: e.value.is_some(),
            })
            .collect()
    }

    /// What a spawned process gets: each secret's name set to its placeholder.
    pub fn env(&self) -> impl Iterator<Item = (String, String)> + '_ {
        self.entries.iter().map(|e| (e.binding.name.clone(), e.binding.placeholder.clone()))
    }

    /// Whether a connection to `host` is one whose requests the proxy must read (a secret is
    /// bound to it).
    pub fn bound_to(&self, host: &str) -> bool {
        self.entries.iter().any(|e| e.bound_to(host))
    }

    /// Each secret's placeholder, with its name: what a connection the proxy does not read is
    /// scanned for.
    pub fn placeholders(&self) -> Vec<(String, String)> {
        self.entries.iter().map(|e| (e.binding.name.clone(), e.binding.placeholder.clone())).collect()
    }

    /// Puts values in place of placeholders in a request to `host`: in header values, in a
    /// Basic authorization's decoded user and password, in the target — each only where the
    /// secret's `inject` says and only when the secret is bound to `host` and has a value. A
    /// placeholder found anywhere else is left as it is and reported as withheld.
    pub fn rewrite(&self, host: &str, uri: &mut Uri, headers: &mut HeaderMap) -> Rewrite {
        let mut out = Rewrite::default();
        for e in &self.entries {
            let ph = e.binding.placeholder.as_str();
            let value = e.value.as_ref().filter(|_| e.bound_to(host));
            let may = |at: Inject| value.filter(|_| e.binding.inject.contains(&at));
            let mut note = |replaced: bool| {
                let set = if replaced { &mut out.used } else { &mut out.withheld };
                set.insert(e.binding.name.clone());
            };
            for (name, v) in headers.iter_mut() {
                let basic = (name == AUTHORIZATION || name == PROXY_AUTHORIZATION)
                    .then(|| basic_credentials(v.as_bytes()))
                    .flatten();
                if let Some(decoded) = basic.filter(|d| contains(d, ph)) {
                    if let Some(value) = may(Inject::Basic) {
                        let replaced = replace(&decoded, ph, value.expose());
                        let encoded = base64::engine::general_purpose::STANDARD.encode(replaced);
                        *v = HeaderValue::from_str(&format!("Basic {encoded}")).expect("base64 is a header value");
                    }
                    note(may(Inject::Basic).is_some());
                }
                if contains(v.as_bytes(), ph) {
                    let sub = may(Inject::Header)
                        .and_then(|value| HeaderValue::from_bytes(&replace(v.as_bytes(), ph, value.expose())).ok());
                    note(sub.is_some());
                    if let Some(sub) = sub {
                        *v = sub;
                    }
                }
            }
            let target = uri.path_and_query().map(|p| p.as_str().to_string()).unwrap_or_default();
            if contains(target.as_bytes(), ph) {
                let sub = may(Inject::Query).and_then(|value| {
                    let mut parts = uri.clone().into_parts();
                    let replaced = String::from_utf8(replace(target.as_bytes(), ph, &percent_encode(value.expose())))
                        .expect("UTF-8 in, UTF-8 out");
                    parts.path_and_query = Some(replaced.parse().ok()?);
                    Uri::from_parts(parts).ok()
                });
                note(sub.is_some());
                if let Some(sub) = sub {
                    *uri = sub;
                }
            }
        }
        // A name both used and withheld (two headers, one not allowed) counts as withheld too:
        // the event stream says each.
        out
    }
}

/// The decoded `user:password` of a `Basic` credential.
fn basic_credentials(v: &[u8]) -> Option<Vec<u8>> {
    let s = std::str::from_utf8(v).ok()?.trim();
    let (scheme, rest) = s.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    base64::engine::general_purpose::STANDARD.decode(rest.trim()).ok()
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    memchr::memmem::find(haystack, needle.as_bytes()).is_some()
}

fn replace(haystack: &[u8], needle: &str, with: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(haystack.len() + with.len());
    let mut rest = haystack;
    while let Some(i) = memchr::memmem::find(rest, needle.as_bytes()) {
        out.extend_from_slice(&rest[..i]);
        out.extend_from_slice(with.as_bytes());
        rest = &rest[i + needle.len()..];
    }
    out.extend_from_slice(rest);
    out
}

/// A value put into a request target: everything but unreserved characters escaped, so it
/// cannot end the query or add parameters.
fn percent_encode(v: &str) -> String {
    v.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Looks for placeholders in a byte stream the proxy carries without reading it (TLS to a
/// host no secret is bound to, or any other protocol), across chunk boundaries: a guest
/// sending one where it is not bound is reported, once per connection and secret.
pub struct Scanner {
    placeholders: Vec<(String, memchr::memmem::Finder<'static>)>,
    tail: Vec<u8>,
    keep: usize,
    found: BTreeSet<String>,
}

impl Scanner {
    pub fn new(placeholders: Vec<(String, String)>) -> Self {
        let keep = placeholders.iter().map(|(_, p)| p.len()).max().unwrap_or(1) - 1;
        let placeholders = placeholders
            .into_iter()
            .map(|(n, p)| (n, memchr::memmem::Finder::new(p.as_bytes()).into_owned()))
            .collect();
        Self { placeholders, tail: Vec::new(), keep, found: BTreeSet::new() }
    }

    /// The names whose placeholder first appears in `chunk` (with the end of the chunks
    /// before it).
    pub fn feed(&mut self, chunk: &[u8]) -> Vec<String> {
        if self.placeholders.is_empty() {
            return Vec::new();
        }
        let mut window = std::mem::take(&mut self.tail);
        window.extend_from_slice(chunk);
        let mut new = Vec::new();
        for (name, finder) in &self.placeholders {
            if !self.found.contains(name) && finder.find(&window).is_some() {
                self.found.insert(name.clone());
                new.push(name.clone());
            }
        }
        let from = window.len().saturating_sub(self.keep);
        self.tail = window.split_off(from);
        new
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secrets(specs: serde_json::Value) -> Secrets {
        let mut s = Secrets::default();
        for spec in specs.as_array().unwrap() {
            s.set(&serde_json::from_value(spec.clone()).unwrap(), |_| None).unwrap();
        }
        s
    }

    fn ph(s: &Secrets, name: &str) -> String {
        s.placeholders().into_iter().find(|(n, _)| n == name).unwrap().1
    }

    #[test]
    fn hosts_match_exactly_or_below_a_wildcard() {
        assert!(host_matches("api.example.com", "API.example.com."));
        assert!(!host_matches("api.example.com", "x.api.example.com"));
        assert!(host_matches("*.github.com", "api.github.com"));
        assert!(!host_matches("*.github.com", "github.com"));
        assert!(!host_matches("*.github.com", "evilgithub.com"));
    }

    #[test]
    fn placeholders_are_replaced_only_for_bound_hosts_and_places() {
        let s = secrets(serde_json::json!([
            {"name": "TOKEN", "value": "s3cret", "hosts": ["api.test"]},
            {"name": "KEY", "value": "k&y=1", "hosts": ["api.test"], "inject": ["query"]},
        ]));
        let (token, key) = (ph(&s, "TOKEN"), ph(&s, "KEY"));
        let basic = base64::engine::general_purpose::STANDARD.encode(format!("x-access-token:{token}"));
        let mut headers = HeaderMap::new();
        headers.insert(AUTHORIZATION, HeaderValue::from_str(&format!("Basic {basic}")).unwrap());
        headers.insert("x-api-key", HeaderValue::from_str(&format!("pre-{token}")).unwrap());
        headers.insert("x-other", HeaderValue::from_str(&key).unwrap());
        let mut uri: Uri = format!("/v1?key={key}&t={token}").parse().unwrap();
        let r = s.rewrite("API.test", &mut uri, &mut headers);
        let decoded = basic_credentials(headers[AUTHORIZATION].as_bytes()).unwrap();
        assert_eq!(decoded, b"x-access-token:s3cret");
        assert_eq!(headers["x-api-key"], "pre-s3cret");
        // KEY may go in the query only; TOKEN may not go in the query.
        assert_eq!(headers["x-other"], key.as_str());
        assert_eq!(uri.to_string(), format!("/v1?key=k%26y%3D1&t={token}"));
        assert_eq!(r.used, ["KEY", "TOKEN"].map(String::from).into());
        assert_eq!(r.withheld, ["KEY", "TOKEN"].map(String::from).into());

        // Another host: nothing is replaced, everything is reported.
        let mut headers = HeaderMap::new();
        headers.insert(AUTHORIZATION, HeaderValue::from_str(&format!("Bearer {token}")).unwrap());
        let mut uri: Uri = "/".parse().unwrap();
        let r = s.rewrite("elsewhere.test", &mut uri, &mut headers);
        assert_eq!(headers[AUTHORIZATION], format!("Bearer {token}").as_str());
        assert!(r.used.is_empty());
        assert_eq!(r.withheld, ["TOKEN".to_string()].into());
    }

    #[test]
    fn a_rotation_keeps_the_placeholder_and_a_restore_keeps_no_inline_value() {
        let mut s = secrets(serde_json::json!([{"name": "T", "value": "one", "hosts": ["a.test"]}]));
        let before = ph(&s, "T");
        s.set(
            &serde_json::from_value(serde_json::json!({"name": "T", "value": "two", "hosts": ["a.test"]})).unwrap(),
            |_| None,
        )
        .unwrap();
        assert_eq!(ph(&s, "T"), before);
        let mut headers = HeaderMap::new();
        headers.insert("x", HeaderValue::from_str(&before).unwrap());
        s.rewrite("a.test", &mut "/".parse().unwrap(), &mut headers);
        assert_eq!(headers["x"], "two");

        let restored = Secrets::restore(&s.bindings(), |_| Some("env".into()));
        assert!(!restored.infos()[0].has_value);
        assert!(!format!("{:?}", restored.bindings()).contains("two"));
    }

    #[test]
    fn the_scanner_finds_a_placeholder_split_across_chunks_once() {
        let mut scan = Scanner::new(vec![("T".into(), "umbra-secret-abcdef".into())]);
        assert!(scan.feed(b"GET /?q=umbra-sec").is_empty());
        assert_eq!(scan.feed(b"ret-abcdef HTTP/1.1"), vec!["T".to_string()]);
        assert!(scan.feed(b"umbra-secret-abcdef").is_empty());
    }
}
