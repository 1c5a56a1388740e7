//! `vmctl bundle keygen | sign`, the signature half of `vmctl bundle verify`, and whom `pull`,
//! `import` and `verify` trust (`--trusted-key`, umbrad's `trusted_keys`, the trusted-keys
//! directory — or only the system policy's keys when it names any).

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use umbra_bundle::{sign_dir, SecretKey, Trust};

#[derive(Args, Debug, Clone, Default)]
pub struct TrustArgs {
    /// Also trust this public key file (`umbra-ed25519 …`, as `vmctl bundle keygen` writes
    /// it). Repeatable. The `*.pub` files in ~/.config/umbra/trusted-keys/ and umbrad's
    /// `trusted_keys` are trusted too, unless the system policy names the keys.
    #[arg(long = "trusted-key", value_name = "FILE")]
    pub trusted_keys: Vec<PathBuf>,
    /// Allow plain `http://` to a loopback address (127.0.0.1, [::1]): for tests against a
    /// local server. Any other `http://` is refused regardless.
    #[arg(long)]
    pub allow_http_loopback: bool,
}

impl TrustArgs {
    pub fn trust(&self) -> anyhow::Result<Trust> {
        let system = umbra_runtime::system_policy::load(Path::new(umbra_api::system::SYSTEM_POLICY_PATH))?;
        let config = umbra_api::paths::config_dir().join("umbrad.json");
        let configured = match std::fs::read(&config) {
            Ok(bytes) => {
                serde_json::from_slice::<umbra_api::DaemonConfig>(&bytes)
                    .with_context(|| format!("{} is not a valid umbrad configuration", config.display()))?
                    .trusted_keys
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", config.display())),
        };
        Ok(umbra_runtime::bundle_trust::trust(
            system.as_ref(),
            &configured,
            &self.trusted_keys,
            &umbra_api::paths::trusted_keys_dir(),
            self.allow_http_loopback,
        )?)
    }
}

#[derive(Args, Debug)]
pub struct KeygenArgs {
    /// Where to write the secret key (mode 0600); the public key goes beside it as `.pub`.
    /// Never over an existing file. [default: ~/.config/umbra/bundle-signing.key]
    #[arg(long)]
    out: Option<PathBuf>,
    /// A comment on the public key's line.
    #[arg(long, default_value = "")]
    comment: String,
}

#[derive(Args, Debug)]
pub struct SignArgs {
    /// The bundle directory (manifest.json and its .zst files), or a flavor built by `vmctl
    /// bundle build`.
    path: String,
    /// The secret key [default: $UMBRA_BUNDLE_SIGNING_KEY, else
    /// ~/.config/umbra/bundle-signing.key]
    #[arg(long)]
    key: Option<PathBuf>,
}

/// The signing key: `given`, else `$UMBRA_BUNDLE_SIGNING_KEY`, else the user's default one.
pub fn key_path(given: Option<PathBuf>) -> (PathBuf, bool) {
    match given.or_else(|| std::env::var_os("UMBRA_BUNDLE_SIGNING_KEY").map(PathBuf::from)) {
        Some(p) => (p, false),
        None => (umbra_api::paths::signing_key_path(), true),
    }
}

pub fn keygen(args: KeygenArgs) -> anyhow::Result<()> {
    let (path, _) = key_path(args.out);
    let key = SecretKey::generate()?;
    let public = key.write_new(&path, &args.comment)?;
    eprintln!("vmctl: secret key {} (keep it; mode 0600)", path.display());
    eprintln!(
        "vmctl: public key {} (key id {}); give it to whoever installs your bundles",
        public.display(),
        key.public().id()
    );
    println!("{}", key.public().to_line(&args.comment));
    Ok(())
}

pub fn sign(args: SignArgs) -> anyhow::Result<()> {
    let dir = crate::paths::bundle_dir(&args.path)?;
    let (path, _) = key_path(args.key);
    let key = SecretKey::read(&path)?;
    let version = sign_dir(&dir, &key)?;
    eprintln!("vmctl: bundle {version} in {} signed by {}", dir.display(), key.public().id());
    Ok(())
}

/// Signs a bundle `vmctl bundle build` just wrote (`umbra_runtime::bundle_trust::sign_local`:
/// the user's key, made and trusted on first use).
pub fn sign_build(dir: &Path, given: Option<PathBuf>) -> anyhow::Result<()> {
    let (id, made) = umbra_runtime::bundle_trust::sign_local(dir, given)?;
    if let Some(trusted) = made {
        eprintln!("vmctl: made the signing key {id}; this user trusts it: {}", trusted.display());
    }
    eprintln!("vmctl: signed by {id}");
    Ok(())
}
