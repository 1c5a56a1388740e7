//! Bundle signatures: who may choose a guest.
//!
//! A bundle's manifest pins every artifact's digest and the kernel command line, so a signature
//! over the manifest's exact bytes covers the whole guest. The signature is a detached file,
//! [`SIGNATURE_FILE`], beside `manifest.json`: JSON holding one or more ed25519 signatures (more
//! than one lets a publisher rotate keys). The signed message is a fixed context string followed
//! by the manifest's bytes, so an umbra signature can never be replayed as anything else.
//!
//! Keys are one line of text, the way OpenSSH writes them: `umbra-ed25519 <base64> [comment]`
//! for a public key, `umbra-ed25519-secret <base64 seed>` for a secret one (mode 0600; a secret
//! key others can read is refused). A key is named by its id, `ed25519:` and the first 16 hex
//! digits of the sha256 of its 32 bytes.
//!
//! [`Trust`] is what a pull checks against: the keys it trusts, and whether plain `http://` to a
//! loopback address is allowed (tests only). A pull refuses a bundle that is unsigned, signed
//! only by keys it does not trust, or whose trusted signature does not match — before anything
//! is written, so the installed bundle stays current.

use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};
use sha2::Digest;

use crate::BundleError;

/// The detached signature file beside `manifest.json`.
pub const SIGNATURE_FILE: &str = "manifest.sig";
/// What every signed message starts with (domain separation).
const CONTEXT: &[u8] = b"umbra bundle manifest v1\n";
const PUBLIC_TAG: &str = "umbra-ed25519";
const SECRET_TAG: &str = "umbra-ed25519-secret";
/// A signature file is a few hundred bytes; anything near this is not one.
pub(crate) const SIGNATURE_LIMIT: u64 = 64 << 10;
/// Signatures one file may hold.
const MAX_SIGNATURES: usize = 16;

/// A public key: what is trusted and what a signature names.
#[derive(Clone, PartialEq, Eq)]
pub struct PublicKey(VerifyingKey);

impl std::fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.id())
    }
}

impl PublicKey {
    /// `umbra-ed25519 <base64> [comment]`, or the bare base64.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut words = text.split_whitespace();
        let first = words.next().ok_or("an empty key")?;
        let b64 = if first == PUBLIC_TAG { words.next().ok_or("no key after umbra-ed25519")? } else { first };
        if first == SECRET_TAG {
            return Err("this is a secret key; trust its .pub file instead".into());
        }
        let bytes: [u8; 32] = B64
            .decode(b64)
            .map_err(|e| format!("not base64: {e}"))?
            .try_into()
            .map_err(|v: Vec<u8>| format!("{} bytes; an ed25519 public key is 32", v.len()))?;
        let key = VerifyingKey::from_bytes(&bytes).map_err(|_| "not a valid ed25519 point".to_string())?;
        if key.is_weak() {
            return Err("a weak (small-order) ed25519 key".into());
        }
        Ok(Self(key))
    }

    /// Reads a public key file (its first non-empty, non-comment line).
    pub fn read(path: &Path) -> Result<Self, BundleError> {
        let text = std::fs::read_to_string(path).map_err(crate::io_err("cannot read", path))?;
        let line = text.lines().map(str::trim).find(|l| !l.is_empty() && !l.starts_with('#')).unwrap_or("");
        Self::parse(line).map_err(|reason| BundleError::Key { path: path.display().to_string(), reason })
    }

    /// `ed25519:` and 16 hex digits of the key's sha256.
    pub fn id(&self) -> String {
        let digest = sha2::Sha256::digest(self.0.as_bytes());
        format!("ed25519:{}", hex::encode(&digest[..8]))
    }

    pub fn to_base64(&self) -> String {
        B64.encode(self.0.as_bytes())
    }

    /// The key file's line.
    pub fn to_line(&self, comment: &str) -> String {
        format!("{PUBLIC_TAG} {} {comment}", self.to_base64()).trim_end().to_string()
    }
}

/// A secret key, held to sign bundles.
pub struct SecretKey(SigningKey);

impl SecretKey {
    /// A new key from the operating system's randomness.
    pub fn generate() -> Result<Self, BundleError> {
        let mut seed = [0u8; 32];
        getrandom::getrandom(&mut seed).map_err(|e| BundleError::Key {
            path: "(new key)".into(),
            reason: format!("no randomness from the operating system: {e}"),
        })?;
        Ok(Self(SigningKey::from_bytes(&seed)))
    }

    pub fn from_seed(seed: [u8; 32]) -> Self {
        Self(SigningKey::from_bytes(&seed))
    }

    pub fn public(&self) -> PublicKey {
        PublicKey(self.0.verifying_key())
    }

    /// Reads a secret key file, refusing one that others can read or write, or that another
    /// user owns.
    pub fn read(path: &Path) -> Result<Self, BundleError> {
        use std::io::Read;
        let bad = |reason: String| BundleError::Key { path: path.display().to_string(), reason };
        let f = std::fs::File::open(path).map_err(crate::io_err("cannot read", path))?;
        let meta = f.metadata().map_err(crate::io_err("cannot read", path))?;
        // SAFETY: geteuid cannot fail and touches no memory.
        let euid = unsafe { libc::geteuid() };
        if meta.uid() != euid {
            return Err(bad(format!("owned by uid {}, not by this user (uid {euid})", meta.uid())));
        }
        if meta.mode() & 0o077 != 0 {
            return Err(bad(format!(
                "mode {:04o}: a secret key must be readable by its owner only (chmod 600)",
                meta.mode() & 0o7777
            )));
        }
        let mut text = String::new();
        f.take(4096).read_to_string(&mut text).map_err(crate::io_err("cannot read", path))?;
        let mut words = text.split_whitespace();
        if words.next() != Some(SECRET_TAG) {
            return Err(bad(format!("not an {SECRET_TAG} key file")));
        }
        let seed: [u8; 32] = words
            .next()
            .and_then(|b| B64.decode(b).ok())
            .and_then(|v| v.try_into().ok())
            .ok_or_else(|| bad("the seed is not 32 base64 bytes".into()))?;
        Ok(Self::from_seed(seed))
    }

    /// Writes this key to `path` (mode 0600, never over an existing file) and its public half
    /// to `path.pub`.
    pub fn write_new(&self, path: &Path, comment: &str) -> Result<PathBuf, BundleError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(crate::io_err("cannot create", dir))?;
        }
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(crate::io_err("cannot create", path))?;
        writeln!(f, "{SECRET_TAG} {}", B64.encode(self.0.to_bytes())).map_err(crate::io_err("cannot write", path))?;
        f.sync_all().map_err(crate::io_err("cannot fsync", path))?;
        let public = public_path(path);
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&public)
            .and_then(|mut p| p.write_all((self.public().to_line(comment) + "\n").as_bytes()));
        if let Err(e) = written {
            // A secret key without its public half would never be trusted or handed out.
            let _ = std::fs::remove_file(path);
            return Err(crate::io_err("cannot create", &public)(e));
        }
        Ok(public)
    }

    /// This key's entry for the manifest `manifest_json` (its exact bytes).
    pub fn sign(&self, manifest_json: &[u8]) -> SignatureEntry {
        let sig = self.0.sign(&message(manifest_json));
        let public = self.public();
        SignatureEntry { key_id: public.id(), public_key: public.to_base64(), signature: B64.encode(sig.to_bytes()) }
    }
}

fn entry_signature(entry: &SignatureEntry) -> Option<Signature> {
    let bytes: [u8; 64] = B64.decode(&entry.signature).ok()?.try_into().ok()?;
    Some(Signature::from_bytes(&bytes))
}

/// Whether some signature in `signatures` matches `manifest_json` under the key it names —
/// whoever that is. For bundles accepted once already (the warm slot), to tell them from
/// copies nobody signed; it says nothing about trust.
pub(crate) fn self_consistent(manifest_json: &[u8], signatures: &[u8]) -> bool {
    let Ok(file) = SignatureFile::parse(signatures) else { return false };
    let msg = message(manifest_json);
    file.signatures.iter().any(|e| match (PublicKey::parse(&e.public_key), entry_signature(e)) {
        (Ok(key), Some(sig)) => key.0.verify_strict(&msg, &sig).is_ok(),
        _ => false,
    })
}

/// `path` with `.pub` appended.
pub fn public_path(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".pub");
    PathBuf::from(p)
}

fn message(manifest_json: &[u8]) -> Vec<u8> {
    [CONTEXT, manifest_json].concat()
}

/// `manifest.sig`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignatureFile {
    pub schema_version: u32,
    pub signatures: Vec<SignatureEntry>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignatureEntry {
    /// Informative: the id is recomputed from `public_key`.
    pub key_id: String,
    pub public_key: String,
    pub signature: String,
}

impl SignatureFile {
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        // Escaped: the server's bytes reach a terminal through this message.
        let f: SignatureFile = serde_json::from_slice(bytes)
            .map_err(|e| format!("{SIGNATURE_FILE} is not valid: {}", crate::manifest::printable(&e.to_string())))?;
        if f.schema_version != 1 {
            return Err(format!("{SIGNATURE_FILE} schema {} is not supported (1)", f.schema_version));
        }
        if f.signatures.is_empty() || f.signatures.len() > MAX_SIGNATURES {
            return Err(format!("{SIGNATURE_FILE} holds {} signatures (1 to {MAX_SIGNATURES})", f.signatures.len()));
        }
        Ok(f)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("signatures serialize") + "\n"
    }

    /// Adds `entry`, replacing any earlier signature by the same key.
    pub fn add(&mut self, entry: SignatureEntry) {
        self.signatures.retain(|s| s.public_key != entry.public_key);
        self.signatures.push(entry);
    }
}

/// Signs the bundle in directory `dir` with `key`: writes (or adds to) its `manifest.sig`.
/// Returns the signed manifest's version.
pub fn sign_dir(dir: &Path, key: &SecretKey) -> Result<String, BundleError> {
    let mpath = dir.join(crate::MANIFEST_FILE);
    let json = std::fs::read(&mpath).map_err(crate::io_err("cannot read", &mpath))?;
    // Only a valid manifest is worth a signature; one for a newer host than this is fine (the
    // publisher's vmctl may be older than the hosts the bundle is for).
    let manifest = crate::Manifest::parse(&json, "18446744073709551615.0.0")?;
    let spath = dir.join(SIGNATURE_FILE);
    let mut file = match std::fs::read(&spath) {
        Ok(bytes) => SignatureFile::parse(&bytes)
            .map_err(|reason| BundleError::Key { path: spath.display().to_string(), reason })?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => SignatureFile { schema_version: 1, signatures: vec![] },
        Err(e) => return Err(crate::io_err("cannot read", &spath)(e)),
    };
    // Another key's signature over older bytes (a rebuilt bundle) would only mislead.
    let msg = message(&json);
    file.signatures.retain(|e| match (PublicKey::parse(&e.public_key), entry_signature(e)) {
        (Ok(k), Some(sig)) => k.0.verify_strict(&msg, &sig).is_ok(),
        _ => false,
    });
    file.add(key.sign(&json));
    let tmp = dir.join(format!(".{SIGNATURE_FILE}.tmp"));
    std::fs::write(&tmp, file.to_json()).map_err(crate::io_err("cannot write", &tmp))?;
    std::fs::rename(&tmp, &spath).map_err(crate::io_err("cannot rename", &spath))?;
    Ok(manifest.bundle_version)
}

/// What a pull trusts.
#[derive(Debug, Clone, Default)]
pub struct Trust {
    /// Keys whose signature makes a bundle installable, each with where it came from.
    pub keys: Vec<(PublicKey, String)>,
    /// Allow `http://` to a loopback address (127.0.0.0/8, ::1): for tests against a local
    /// server. Every other `http://` URL, and every redirect to one, is refused.
    pub allow_http_loopback: bool,
}

impl Trust {
    pub fn key(mut self, key: PublicKey, source: impl Into<String>) -> Self {
        self.keys.push((key, source.into()));
        self
    }

    /// Adds every `*.pub` file in `dir` (none if it does not exist). A key file that cannot be
    /// read is an error: silently trusting fewer keys than configured would hide it.
    pub fn keys_in_dir(mut self, dir: &Path) -> Result<Self, BundleError> {
        let entries = match std::fs::read_dir(dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(self),
            Err(e) => return Err(crate::io_err("cannot read", dir)(e)),
        };
        // As ssh's StrictModes: a directory or key file others can write is anyone's trust.
        let writable = |p: &Path| -> Result<(), BundleError> {
            let m = std::fs::metadata(p).map_err(crate::io_err("cannot read", p))?;
            if m.mode() & 0o022 != 0 {
                return Err(BundleError::Key {
                    path: p.display().to_string(),
                    reason: format!(
                        "mode {:04o}: writable by its group or by everyone, so anyone could add a trusted key; refusing it (chmod go-w)",
                        m.mode() & 0o7777
                    ),
                });
            }
            Ok(())
        };
        writable(dir)?;
        let mut paths: Vec<PathBuf> =
            entries.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "pub")).collect();
        paths.sort();
        for p in paths {
            writable(&p)?;
            let key = PublicKey::read(&p)?;
            self.keys.push((key, p.display().to_string()));
        }
        Ok(self)
    }

    pub fn trusts(&self, key: &PublicKey) -> bool {
        self.keys.iter().any(|(k, _)| k == key)
    }

    /// Checks `signatures` (the bytes of `manifest.sig`, `None` when there is none) over the
    /// exact `manifest_json` of bundle `version`. Returns the id of the trusted key that signed.
    pub fn verify(
        &self,
        version: &str,
        manifest_json: &[u8],
        signatures: Option<&[u8]>,
        location: &str,
    ) -> Result<String, BundleError> {
        let Some(bytes) = signatures else {
            return Err(BundleError::Unsigned { version: version.into(), location: location.into() });
        };
        let bad = |reason: String| BundleError::BadSignature { version: version.into(), reason };
        let file = SignatureFile::parse(bytes).map_err(bad)?;
        let msg = message(manifest_json);
        let mut signers = Vec::new();
        let mut mismatched = None;
        for entry in &file.signatures {
            let key = PublicKey::parse(&entry.public_key).map_err(|e| bad(format!("a signer's key: {e}")))?;
            if !self.trusts(&key) {
                signers.push(key.id());
                continue;
            }
            // Strict: no malleable signatures, no small-order keys. One trusted signature that
            // matches is enough; a stale one beside it (an older manifest's) does not refuse.
            match entry_signature(entry).map(|sig| key.0.verify_strict(&msg, &sig)) {
                Some(Ok(())) => return Ok(key.id()),
                Some(Err(_)) => mismatched = Some(key.id()),
                None => mismatched = mismatched.or(Some(format!("{} (not 64 base64 bytes)", key.id()))),
            }
        }
        if let Some(id) = mismatched {
            return Err(bad(format!(
                "the signature by trusted key {id} does not match this manifest: the manifest (its artifact digests or boot command line) or the signature was altered"
            )));
        }
        Err(BundleError::UntrustedSigner {
            version: version.into(),
            signers: signers.join(", "),
            hint: if self.keys.is_empty() {
                "no keys are trusted here: add the publisher's public key (umbrad's trusted_keys, vmctl --trusted-key, or a .pub file in the trusted-keys directory)".into()
            } else {
                format!(
                    "trusted: {}",
                    self.keys.iter().map(|(k, from)| format!("{} ({from})", k.id())).collect::<Vec<_>>().join(", ")
                )
            },
        })
    }
}

/// Whether a redirect may go to `url`: as [`check_url`], but never to `file://`.
pub(crate) fn check_redirect(url: &reqwest::Url, allow_http_loopback: bool) -> Result<(), String> {
    if url.scheme() == "file" {
        return Err("a redirect to file:// is refused".into());
    }
    check_url(url, allow_http_loopback)
}

/// Whether `url` may be fetched under `allow_http_loopback`: `https://` always, `file://`
/// always (a local path the caller named), `http://` only to a loopback address and only when
/// allowed. The reason when not.
pub fn check_url(url: &reqwest::Url, allow_http_loopback: bool) -> Result<(), String> {
    match url.scheme() {
        "https" | "file" => Ok(()),
        "http" if allow_http_loopback && is_loopback(url) => Ok(()),
        "http" if allow_http_loopback => Err(
            "http:// is allowed only to a loopback address (127.0.0.1 or [::1]), and only for tests; bundles come over https://".into(),
        ),
        "http" => Err(
            "http:// is refused: whoever serves the bundle or sits on the path would choose the guest; bundles come over https:// (http://127.0.0.1 only with --allow-http-loopback, for tests)".into(),
        ),
        other => Err(format!("scheme {other}: is not supported (https, file)")),
    }
}

fn is_loopback(url: &reqwest::Url) -> bool {
    // An address literal only: a name would be resolved, and could resolve anywhere.
    let host = url.host_str().unwrap_or("");
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    host.parse::<std::net::IpAddr>().is_ok_and(|a| a.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    const JSON: &[u8] = br#"{"schema_version":1,"boot":{"cmdline":"quiet"}}"#;

    fn key(n: u8) -> SecretKey {
        SecretKey::from_seed([n; 32])
    }

    fn sigs(entries: Vec<SignatureEntry>) -> Vec<u8> {
        SignatureFile { schema_version: 1, signatures: entries }.to_json().into_bytes()
    }

    #[test]
    fn a_trusted_signature_over_the_exact_bytes_verifies_and_nothing_else_does() {
        let (a, b) = (key(1), key(2));
        let trust = Trust::default().key(a.public(), "test");
        let signed = sigs(vec![a.sign(JSON)]);
        assert_eq!(trust.verify("v1", JSON, Some(&signed), "x").unwrap(), a.public().id());

        let e = trust.verify("v1", JSON, None, "http://127.0.0.1:1/v1/manifest.json").unwrap_err().to_string();
        assert!(e.contains("bundle v1 is not signed") && e.contains("127.0.0.1:1/v1/manifest.json"), "{e}");

        // One byte of the boot command line changed after signing.
        let altered = String::from_utf8(JSON.to_vec()).unwrap().replace("quiet", "init=/x").into_bytes();
        let e = trust.verify("v1", &altered, Some(&signed), "x").unwrap_err();
        assert!(matches!(e, BundleError::BadSignature { .. }), "{e}");
        assert!(e.to_string().contains("does not match this manifest"), "{e}");

        // Signed by someone else only.
        let e = trust.verify("v1", JSON, Some(&sigs(vec![b.sign(JSON)])), "x").unwrap_err();
        assert!(matches!(e, BundleError::UntrustedSigner { .. }), "{e}");
        let e = e.to_string();
        assert!(e.contains(&b.public().id()) && e.contains(&a.public().id()), "{e}");

        // Nobody trusted at all: the hint says how to trust.
        let e = Trust::default().verify("v1", JSON, Some(&signed), "x").unwrap_err().to_string();
        assert!(e.contains("no keys are trusted"), "{e}");

        // A second, trusted signature among untrusted ones (key rotation) counts.
        let both = sigs(vec![b.sign(JSON), a.sign(JSON)]);
        assert_eq!(trust.verify("v1", JSON, Some(&both), "x").unwrap(), a.public().id());

        // A signature by the trusted key over another manifest, swapped in.
        let mut forged = a.sign(b"{}");
        forged.key_id = a.public().id();
        let e = trust.verify("v1", JSON, Some(&sigs(vec![forged])), "x").unwrap_err();
        assert!(matches!(e, BundleError::BadSignature { .. }), "{e}");
    }

    #[test]
    fn a_stale_trusted_signature_beside_a_valid_one_does_not_refuse_and_resigning_drops_it() {
        let a = key(1);
        let trust = Trust::default().key(a.public(), "test");
        let both = sigs(vec![a.sign(b"an older manifest"), a.sign(JSON)]);
        assert_eq!(trust.verify("v1", JSON, Some(&both), "x").unwrap(), a.public().id());

        let dir = tempfile::tempdir().unwrap();
        let m = crate::manifest::tests::good();
        std::fs::write(dir.path().join(crate::MANIFEST_FILE), m.to_json()).unwrap();
        sign_dir(dir.path(), &key(2)).unwrap();
        // Rebuilt: other bytes. Key 2's signature is stale and goes; key 1's is added.
        let mut rebuilt = m.clone();
        rebuilt.boot.cmdline = "quiet".into();
        std::fs::write(dir.path().join(crate::MANIFEST_FILE), rebuilt.to_json()).unwrap();
        sign_dir(dir.path(), &a).unwrap();
        let file = SignatureFile::parse(&std::fs::read(dir.path().join(SIGNATURE_FILE)).unwrap()).unwrap();
        assert_eq!(file.signatures.len(), 1);
        assert_eq!(file.signatures[0].key_id, a.public().id());
    }

    #[test]
    fn a_trusted_keys_directory_others_can_write_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let keys = dir.path().join("trusted-keys");
        key(1).write_new(&keys.join("a.key"), "").unwrap();
        std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(Trust::default().keys_in_dir(&keys).unwrap().keys.len(), 1);
        std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = Trust::default().keys_in_dir(&keys).unwrap_err().to_string();
        assert!(e.contains("mode 0777") && e.contains("chmod go-w"), "{e}");
        std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(keys.join("a.key.pub"), std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(Trust::default().keys_in_dir(&keys).is_err(), "nor a key file others can write");
    }

    #[test]
    fn malformed_signature_files_are_refused_not_panicked_on() {
        let trust = Trust::default().key(key(1).public(), "test");
        let mut wrong_len = key(1).sign(JSON);
        wrong_len.signature = B64.encode([0u8; 10]);
        let cases: Vec<Vec<u8>> = vec![
            b"".to_vec(),
            b"not json".to_vec(),
            br#"{"schema_version":2,"signatures":[]}"#.to_vec(),
            br#"{"schema_version":1,"signatures":[]}"#.to_vec(),
            br#"{"schema_version":1,"signatures":[{"key_id":"","public_key":"AAAA","signature":""}]}"#.to_vec(),
            sigs(vec![wrong_len]),
            sigs((0..17).map(|_| key(1).sign(JSON)).collect()),
        ];
        for c in cases {
            let e = trust.verify("v1", JSON, Some(&c), "x").unwrap_err();
            assert!(matches!(e, BundleError::BadSignature { .. }), "{e}");
        }
    }

    #[test]
    fn key_files_round_trip_and_a_readable_secret_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys").join("signing.key");
        let k = SecretKey::generate().unwrap();
        let public = k.write_new(&path, "test key").unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        assert_eq!(PublicKey::read(&public).unwrap(), k.public());
        assert_eq!(SecretKey::read(&path).unwrap().public(), k.public());
        assert!(k.write_new(&path, "").is_err(), "never over an existing key");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = SecretKey::read(&path).err().unwrap().to_string();
        assert!(e.contains("mode 0644") && e.contains("chmod 600"), "{e}");
        assert!(PublicKey::parse("umbra-ed25519-secret AAAA").unwrap_err().contains("secret key"));
        assert!(PublicKey::parse("umbra-ed25519 AAAA").is_err());
        // The identity point is a weak key.
        let mut identity = [0u8; 32];
        identity[0] = 1;
        assert!(PublicKey::parse(&B64.encode(identity)).unwrap_err().contains("weak"));
        let id = k.public().id();
        assert!(id.starts_with("ed25519:") && id.len() == 8 + 16, "{id}");
    }

    #[test]
    fn only_https_file_and_allowed_loopback_http_are_fetched() {
        let ok = |u: &str, allow| check_url(&reqwest::Url::parse(u).unwrap(), allow);
        assert!(ok("https://bundles.example.com/v1/", false).is_ok());
        assert!(ok("file:///opt/b/", false).is_ok());
        assert!(ok("http://127.0.0.1:8080/v1/", false).unwrap_err().contains("--allow-http-loopback"));
        assert!(ok("http://127.0.0.1:8080/v1/", true).is_ok());
        assert!(ok("http://[::1]:8080/v1/", true).is_ok());
        // Not by name, not a private address, not anything else.
        for u in ["http://localhost:8080/", "http://10.0.0.1/", "http://192.168.1.1/", "http://example.com/"] {
            assert!(ok(u, true).unwrap_err().contains("only to a loopback address"), "{u}");
        }
        assert!(ok("ftp://h/x", true).is_err());
    }
}
