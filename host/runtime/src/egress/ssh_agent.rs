//! The session's SSH agent, served on the host: the guest's `SSH_AUTH_SOCK` is a socket of the
//! guest agent that carries each connection here (an egress stream asking for `ssh_agent`),
//! so the private keys never enter the guest.
//!
//! The agent protocol (draft-miller-ssh-agent): list identities, sign, and OpenSSH's
//! `session-bind@openssh.com` extension, which an OpenSSH client (8.9 and later) sends first
//! with the server's host key, the session id and the host's signature over it. A key is used
//! only for the hosts the session named it for, as `ssh-add -h` restricts one: a sign request
//! is answered only on a connection bound (not for forwarding) to a session with one of those
//! hosts' keys, and only for data of that session. Every signature and refusal is reported,
//! naming the key and the host. Host keys: Ed25519 and ECDSA P-256.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use ssh_encoding::{Decode, Encode};
use ssh_key::{HashAlg, PrivateKey, PublicKey};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use umbra_api::secrets::{SshKeyInfo, SshKeySpec};
use umbra_api::EventKind;

use super::report::Report;

/// The keys a session's agent holds; `session.start` gives them, the session keeps them.
pub type SharedSshKeys = Arc<RwLock<SshKeys>>;

const FAILURE: u8 = 5;
const SUCCESS: u8 = 6;
const REQUEST_IDENTITIES: u8 = 11;
const IDENTITIES_ANSWER: u8 = 12;
const SIGN_REQUEST: u8 = 13;
const SIGN_RESPONSE: u8 = 14;
const EXTENSION: u8 = 27;
/// SSH_MSG_USERAUTH_REQUEST, which the data of a user-authentication signature holds.
const USERAUTH_REQUEST: u8 = 50;

/// The longest agent message taken (OpenSSH's own agent allows 256 KiB).
const MAX_MESSAGE: usize = 256 * 1024;
/// A connection with no message for this long is closed.
const IDLE: Duration = Duration::from_secs(300);

/// What a session keeps of a key across daemon restarts: never the private key.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SshKeyBinding {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_file: Option<std::path::PathBuf>,
    pub hosts: Vec<String>,
    /// Each host's keys, OpenSSH public-key lines, as given or found when the key was added.
    pub host_keys: Vec<(String, String)>,
}

#[derive(Clone)]
struct HeldKey {
    binding: SshKeyBinding,
    /// Absent after a restart when it was given inline.
    key: Option<PrivateKey>,
    /// The public key's wire encoding (what identities and sign requests carry).
    blob: Vec<u8>,
    fingerprint: String,
    /// (host name, host key wire encoding).
    host_keys: Vec<(String, Vec<u8>)>,
}

#[derive(Default, Clone)]
pub struct SshKeys {
    keys: Vec<HeldKey>,
}

impl std::fmt::Debug for SshKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.keys.iter().map(|k| &k.fingerprint)).finish()
    }
}

/// Host keys of `host` in an OpenSSH `known_hosts` text: lines whose (unhashed) host patterns
/// name it exactly (`name` or `[name]:port`).
pub fn known_host_keys(known_hosts: &str, host: &str) -> Vec<String> {
    known_hosts
        .lines()
        .filter(|l| !l.trim_start().starts_with('#') && !l.trim_start().starts_with('@'))
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (names, kind, data) = (f.next()?, f.next()?, f.next()?);
            let matches = names.split(',').any(|n| {
                let n = n.strip_prefix('[').and_then(|n| n.split_once("]:")).map_or(n, |(n, _)| n);
                n.eq_ignore_ascii_case(host)
            });
            matches.then(|| format!("{kind} {data}"))
        })
        .collect()
}

/// `x` in the SSH wire encoding.
fn wire(x: &impl Encode) -> Result<Vec<u8>, ssh_encoding::Error> {
    let mut out = Vec::new();
    x.encode(&mut out)?;
    Ok(out)
}

fn host_key_blob(line: &str) -> Result<Vec<u8>, String> {
    let key = PublicKey::from_openssh(line.trim()).map_err(|e| format!("host key {line:?}: {e}"))?;
    wire(key.key_data()).map_err(|e| format!("host key {line:?}: {e}"))
}

impl SshKeys {
    /// Adds (or replaces, by name) a key: its private key given or read from its file, each
    /// host's keys given or found in `known_hosts` (umbrad's user's file).
    pub fn add(&mut self, spec: &SshKeySpec, known_hosts: Option<&str>) -> Result<(), String> {
        spec.validate()?;
        let pem = match (&spec.private_key, &spec.from_file) {
            (Some(v), _) => v.expose().to_string(),
            (None, Some(path)) => {
                std::fs::read_to_string(path).map_err(|e| format!("ssh key {}: {}: {e}", spec.name, path.display()))?
            }
            (None, None) => unreachable!("validated"),
        };
        let mut host_keys = Vec::new();
        for h in &spec.hosts {
            let lines = match h.host_keys.is_empty() {
                false => h.host_keys.clone(),
                true => known_host_keys(known_hosts.unwrap_or_default(), &h.name),
            };
            if lines.is_empty() {
                return Err(format!(
                    "ssh key {}: no host key for {} (give `host_keys`, or add it to ~/.ssh/known_hosts)",
                    spec.name, h.name
                ));
            }
            for line in lines {
                host_keys.push((h.name.clone(), line));
            }
        }
        let binding = SshKeyBinding {
            name: spec.name.clone(),
            from_file: spec.from_file.clone(),
            hosts: spec.hosts.iter().map(|h| h.name.clone()).collect(),
            host_keys,
        };
        let held = Self::hold(binding, Some(&pem))?;
        self.keys.retain(|k| k.binding.name != spec.name);
        self.keys.push(held);
        Ok(())
    }

    fn hold(binding: SshKeyBinding, pem: Option<&str>) -> Result<HeldKey, String> {
        let name = binding.name.clone();
        let key = match pem {
            Some(pem) => {
                let key = PrivateKey::from_openssh(pem).map_err(|e| format!("ssh key {name}: {e}"))?;
                if key.is_encrypted() {
                    return Err(format!("ssh key {name}: it is encrypted: give an unencrypted copy"));
                }
                Some(key)
            }
            None => None,
        };
        let Some(public) = key.as_ref().map(|k| k.public_key().clone()) else {
            return Err(format!("ssh key {name}: no private key"));
        };
        let blob = wire(public.key_data()).map_err(|e| format!("ssh key {name}: {e}"))?;
        let host_keys = binding
            .host_keys
            .iter()
            .map(|(h, line)| Ok((h.clone(), host_key_blob(line)?)))
            .collect::<Result<Vec<_>, String>>()?;
        Ok(HeldKey { fingerprint: public.fingerprint(HashAlg::Sha256).to_string(), binding, key, blob, host_keys })
    }

    /// The keys a record kept: those read from a file are read again; an inline one is gone.
    pub fn restore(bindings: &[SshKeyBinding]) -> Self {
        let keys = bindings
            .iter()
            .filter_map(|b| {
                let pem = b.from_file.as_ref().and_then(|p| std::fs::read_to_string(p).ok());
                match Self::hold(b.clone(), pem.as_deref()) {
                    Ok(k) => Some(k),
                    Err(e) => {
                        tracing::warn!("{e}: the session no longer holds it");
                        None
                    }
                }
            })
            .collect();
        Self { keys }
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    pub fn bindings(&self) -> Vec<SshKeyBinding> {
        self.keys.iter().map(|k| k.binding.clone()).collect()
    }

    pub fn infos(&self) -> Vec<SshKeyInfo> {
        self.keys
            .iter()
            .map(|k| SshKeyInfo {
                name: k.binding.name.clone(),
                fingerprint: k.fingerprint.clone(),
                hosts: k.binding.hosts.clone(),
            })
            .collect()
    }
}

/// The host a connection was bound to by `session-bind`.
struct Binding {
    host_key: Vec<u8>,
    session_id: Vec<u8>,
    forwarding: bool,
}

/// Serves one agent connection until the client closes it (or goes quiet for [`IDLE`]).
pub async fn serve<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S, keys: SharedSshKeys, report: Report) {
    let mut bound: Option<Binding> = None;
    loop {
        let mut len = [0u8; 4];
        match tokio::time::timeout(IDLE, stream.read_exact(&mut len)).await {
            Ok(Ok(_)) => {}
            _ => return,
        }
        let len = u32::from_be_bytes(len) as usize;
        if len == 0 || len > MAX_MESSAGE {
            return;
        }
        let mut message = vec![0u8; len];
        if tokio::time::timeout(IDLE, stream.read_exact(&mut message)).await.map_or(true, |r| r.is_err()) {
            return;
        }
        let reply = answer(&message, &keys, &mut bound, &report);
        let mut out = (reply.len() as u32).to_be_bytes().to_vec();
        out.extend_from_slice(&reply);
        if stream.write_all(&out).await.is_err() {
            return;
        }
    }
}

/// The reply to one message (its type byte and body).
fn answer(message: &[u8], keys: &SharedSshKeys, bound: &mut Option<Binding>, report: &Report) -> Vec<u8> {
    let (kind, mut body) = (message[0], &message[1..]);
    let reply = match kind {
        REQUEST_IDENTITIES => Some(identities(&keys.read().unwrap())),
        SIGN_REQUEST => sign(&mut body, &keys.read().unwrap(), bound.as_ref(), report),
        EXTENSION => extension(&mut body, bound),
        _ => None,
    };
    reply.unwrap_or_else(|| vec![FAILURE])
}

fn identities(keys: &SshKeys) -> Vec<u8> {
    let held: Vec<&HeldKey> = keys.keys.iter().filter(|k| k.key.is_some()).collect();
    let mut out = vec![IDENTITIES_ANSWER];
    (held.len() as u32).encode(&mut out).expect("a Vec takes it");
    for k in held {
        k.blob.encode(&mut out).expect("a Vec takes it");
        k.binding.name.encode(&mut out).expect("a Vec takes it");
    }
    out
}

/// `session-bind@openssh.com`: the server's host key, the session id, the host's signature over
/// it, and whether the connection is being forwarded. Anything else is refused.
fn extension(body: &mut &[u8], bound: &mut Option<Binding>) -> Option<Vec<u8>> {
    let name = String::decode(body).ok()?;
    if name != "session-bind@openssh.com" {
        return None;
    }
    let host_key = Vec::<u8>::decode(body).ok()?;
    let session_id = Vec::<u8>::decode(body).ok()?;
    let signature = Vec::<u8>::decode(body).ok()?;
    let forwarding = u8::decode(body).ok()? != 0;
    let public = ssh_key::public::KeyData::decode(&mut host_key.as_slice()).ok()?;
    let signature = ssh_key::Signature::try_from(signature.as_slice()).ok()?;
    signature::Verifier::verify(&public, &session_id, &signature).ok()?;
    // A second bind on one connection is a forwarded agent's hop: we never forward.
    let forwarding = forwarding || bound.is_some();
    *bound = Some(Binding { host_key, session_id, forwarding });
    Some(vec![SUCCESS])
}

fn sign(body: &mut &[u8], keys: &SshKeys, bound: Option<&Binding>, report: &Report) -> Option<Vec<u8>> {
    let blob = Vec::<u8>::decode(body).ok()?;
    let data = Vec::<u8>::decode(body).ok()?;
    let held = keys.keys.iter().find(|k| k.blob == blob && k.key.is_some())?;
    let refuse = |reason: String| {
        report(EventKind::SshRefused { key: held.binding.name.clone(), reason });
        None
    };
    let Some(bound) = bound else {
        return refuse("the client did not bind the connection to a session (OpenSSH 8.9 or later does)".into());
    };
    if bound.forwarding {
        return refuse("the agent is not forwarded".into());
    }
    let Some((host, _)) = held.host_keys.iter().find(|(_, k)| *k == bound.host_key) else {
        return refuse(format!(
            "the server is not one of {} (its host key is not theirs)",
            held.binding.hosts.join(", ")
        ));
    };
    // The data must be a user authentication of the bound session.
    let mut data_reader = data.as_slice();
    let session_id = Vec::<u8>::decode(&mut data_reader).ok();
    let message = u8::decode(&mut data_reader).ok();
    if session_id.as_deref() != Some(bound.session_id.as_slice()) || message != Some(USERAUTH_REQUEST) {
        return refuse(format!("the data is not a login to {host} in the bound session"));
    }
    let key = held.key.as_ref()?;
    let signature: ssh_key::Signature = match signature::Signer::try_sign(key, &data) {
        Ok(s) => s,
        Err(e) => return refuse(format!("cannot sign: {e}")),
    };
    let encoded = wire(&signature).ok()?;
    report(EventKind::SshSigned { key: held.binding.name.clone(), host: host.clone() });
    let mut out = vec![SIGN_RESPONSE];
    encoded.encode(&mut out).ok()?;
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An Ed25519 key from a fixed seed (tests need no randomness).
    fn ed25519(seed: u8) -> PrivateKey {
        PrivateKey::from(ssh_key::private::Ed25519Keypair::from_seed(&[seed; 32]))
    }

    fn spec(key: &PrivateKey, host: &str, host_key: &PrivateKey) -> SshKeySpec {
        serde_json::from_value(serde_json::json!({
            "name": "deploy",
            "private_key": key.to_openssh(ssh_key::LineEnding::LF).unwrap().to_string(),
            "hosts": [{"name": host, "host_keys": [host_key.public_key().to_openssh().unwrap()]}],
        }))
        .unwrap()
    }

    fn message(kind: u8, parts: &[&[u8]]) -> Vec<u8> {
        let mut m = vec![kind];
        for p in parts {
            p.encode(&mut m).unwrap();
        }
        m
    }

    /// A session-bind by `host_key` for `session_id`.
    fn bind(host_key: &PrivateKey, session_id: &[u8], forwarding: bool) -> Vec<u8> {
        let sig: ssh_key::Signature = signature::Signer::sign(host_key, session_id);
        let mut m = message(
            EXTENSION,
            &[
                b"session-bind@openssh.com",
                &wire(host_key.public_key().key_data()).unwrap(),
                session_id,
                &wire(&sig).unwrap(),
            ],
        );
        m.push(forwarding as u8);
        m
    }

    fn userauth(session_id: &[u8]) -> Vec<u8> {
        let mut d = Vec::new();
        session_id.encode(&mut d).unwrap();
        d.push(USERAUTH_REQUEST);
        "git".encode(&mut d).unwrap();
        d
    }

    #[test]
    fn a_key_signs_only_for_its_hosts_bound_session() {
        let (key, git_host, other_host) = (ed25519(1), ed25519(2), ed25519(3));
        let mut keys = SshKeys::default();
        keys.add(&spec(&key, "git.test", &git_host), None).unwrap();
        let keys: SharedSshKeys = Arc::new(RwLock::new(keys));
        let events = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = events.clone();
        let report: Report = Arc::new(move |e| sink.lock().unwrap().push(e));
        let blob = wire(key.public_key().key_data()).unwrap();
        let sign_req = |data: &[u8]| {
            let mut m = message(SIGN_REQUEST, &[&blob, data]);
            0u32.encode(&mut m).unwrap();
            m
        };

        // Listed, with its name.
        let mut bound = None;
        let ids = answer(&[REQUEST_IDENTITIES], &keys, &mut bound, &report);
        assert_eq!(ids[0], IDENTITIES_ANSWER);
        assert!(ids.windows(blob.len()).any(|w| w == blob.as_slice()));

        // No bind: refused.
        assert_eq!(answer(&sign_req(&userauth(b"s1")), &keys, &mut bound, &report), vec![FAILURE]);
        // Bound to the git host's session: signs that session's login, and only that.
        assert_eq!(answer(&bind(&git_host, b"s1", false), &keys, &mut bound, &report), vec![SUCCESS]);
        let signed = answer(&sign_req(&userauth(b"s1")), &keys, &mut bound, &report);
        assert_eq!(signed[0], SIGN_RESPONSE);
        let sig = ssh_key::Signature::try_from(&Vec::<u8>::decode(&mut &signed[1..]).unwrap()[..]).unwrap();
        signature::Verifier::verify(key.public_key(), &userauth(b"s1"), &sig).unwrap();
        assert_eq!(answer(&sign_req(&userauth(b"s2")), &keys, &mut bound, &report), vec![FAILURE]);

        // Another host: refused. A forged bind (signed by another key): not bound at all.
        let mut other = None;
        assert_eq!(answer(&bind(&other_host, b"s3", false), &keys, &mut other, &report), vec![SUCCESS]);
        assert_eq!(answer(&sign_req(&userauth(b"s3")), &keys, &mut other, &report), vec![FAILURE]);
        let mut forged = bind(&git_host, b"s4", false);
        let at = forged.len() - 10;
        forged[at] ^= 1;
        let mut unbound = None;
        assert_eq!(answer(&forged, &keys, &mut unbound, &report), vec![FAILURE]);
        // Forwarded: refused.
        let mut fwd = None;
        answer(&bind(&git_host, b"s5", true), &keys, &mut fwd, &report);
        assert_eq!(answer(&sign_req(&userauth(b"s5")), &keys, &mut fwd, &report), vec![FAILURE]);
        // Malformed: a failure, never a panic.
        for junk in [&[SIGN_REQUEST][..], &[EXTENSION, 0, 0, 0, 99], &[200, 1, 2]] {
            assert_eq!(answer(junk, &keys, &mut None, &report), vec![FAILURE]);
        }

        let events = events.lock().unwrap();
        let signed: Vec<_> = events.iter().filter(|e| matches!(e, EventKind::SshSigned { .. })).collect();
        assert_eq!(signed, [&EventKind::SshSigned { key: "deploy".into(), host: "git.test".into() }]);
        assert!(events
            .iter()
            .any(|e| matches!(e, EventKind::SshRefused { reason, .. } if reason.contains("not one of git.test"))));
    }

    #[test]
    fn known_hosts_lines_name_their_hosts() {
        let text = "# c\ngit.test,10.0.0.1 ssh-ed25519 AAAA1\n[git.test]:2222 ecdsa-sha2-nistp256 AAAA2\n|1|hash= ssh-ed25519 AAAA3\nother ssh-ed25519 AAAA4\n";
        assert_eq!(known_host_keys(text, "GIT.test"), ["ssh-ed25519 AAAA1", "ecdsa-sha2-nistp256 AAAA2"]);
        assert!(known_host_keys(text, "nope").is_empty());
    }
}
