//! Pulling an image from a registry (the OCI distribution protocol, by `oci-client`): the
//! manifest for the guest's architecture (an index or a Docker manifest list resolved to it),
//! its config and its layers, each blob verified against its digest and kept once in the blob
//! cache, so a second pull of the same image, or of another sharing layers, transfers none.
//!
//! Credentials: given ones, else `~/.docker/config.json` (`auths`, `credHelpers`,
//! `credsStore`, as `docker login` leaves them), else anonymous; the registry's token flow is
//! the client's. `https://` only, except a registry on the loopback address when the caller
//! allows plain HTTP there (tests, a local mirror).

use std::net::IpAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::manifest::{ImageIndexEntry, OciDescriptor};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use tokio::io::AsyncWrite;
use umbra_bundle::Arch;

use crate::cache::BlobCache;
use crate::config::{oci_arch, MAX_CONFIG_BYTES};
use crate::{ImageError, Layer, Source};

/// Media types of layers this converter applies.
pub const LAYER_MEDIA_TYPES: &[&str] = &[
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.diff.tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
];

/// Layer `i` is a tar layer this converter applies (not, say, an encrypted one).
pub(crate) fn check_layer_type(i: usize, media_type: &str) -> Result<(), ImageError> {
    if !LAYER_MEDIA_TYPES.contains(&media_type) {
        return Err(ImageError::Invalid(format!("layer {i} has media type {media_type:?}, which is not a tar layer")));
    }
    Ok(())
}

#[derive(Clone, Debug, Default)]
pub struct PullOptions {
    /// The guest's architecture [default: the host's].
    pub arch: Option<Arch>,
    /// Plain HTTP to a registry on 127.0.0.1, ::1 or localhost.
    pub allow_http_loopback: bool,
    /// Username and password instead of the Docker config's.
    pub credentials: Option<(String, String)>,
}

/// What a pull fetched, and how much of it came over the network.
#[derive(Debug)]
pub struct Pulled {
    pub source: Source,
    pub downloaded_bytes: u64,
    pub cached_bytes: u64,
}

fn is_loopback(registry: &str) -> bool {
    let host = match registry.rsplit_once(':') {
        Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => registry,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The credentials to use for `registry`.
fn auth_for(registry: &str, given: &Option<(String, String)>) -> Result<RegistryAuth, ImageError> {
    if let Some((user, password)) = given {
        return Ok(RegistryAuth::Basic(user.clone(), password.clone()));
    }
    let candidates: Vec<String> = if registry == "index.docker.io" || registry == "docker.io" {
        vec!["https://index.docker.io/v1/".into(), "index.docker.io".into(), "docker.io".into()]
    } else {
        vec![registry.to_string(), format!("https://{registry}"), format!("http://{registry}")]
    };
    for key in candidates {
        match docker_credential::get_credential(&key) {
            Ok(docker_credential::DockerCredential::UsernamePassword(u, p)) => return Ok(RegistryAuth::Basic(u, p)),
            Ok(docker_credential::DockerCredential::IdentityToken(_)) => {
                return Err(ImageError::Registry(format!(
                    "the Docker config holds an identity token for {registry}, which Umbra cannot use: log in \
                     with a username and password (or pass them)"
                )))
            }
            Err(docker_credential::CredentialRetrievalError::HelperFailure { helper, stderr, .. }) => {
                return Err(ImageError::Registry(format!(
                    "the credential helper docker-credential-{helper} failed for {registry}: {}",
                    stderr.trim()
                )))
            }
            Err(_) => {}
        }
    }
    Ok(RegistryAuth::Anonymous)
}

/// The index entry for linux on `arch` (arm64 of any variant, v8 preferred).
fn pick(entries: &[ImageIndexEntry], arch: Arch) -> Option<String> {
    let want = oci_arch(arch);
    let matching = entries
        .iter()
        .filter(|e| e.platform.as_ref().is_some_and(|p| p.os == oci_spec::image::Os::Linux && p.architecture == want));
    let mut best: Option<&ImageIndexEntry> = None;
    for e in matching {
        let v8 = e.platform.as_ref().and_then(|p| p.variant.as_deref()) == Some("v8");
        if best.is_none() || v8 {
            best = Some(e);
        }
    }
    best.map(|e| e.digest.clone())
}

fn registry_error(what: &str, reference: &Reference, e: impl std::fmt::Display) -> ImageError {
    ImageError::Registry(format!("{what} {}: {e}", reference.whole()))
}

/// `reference` as the registry names it (`alpine:3` is `docker.io/library/alpine:3`), if it
/// is a reference at all.
pub fn canonical(reference: &str) -> Option<String> {
    reference.parse::<Reference>().ok().map(|r| r.whole())
}

/// Fetches `reference` into `cache`; `progress` hears one line per step.
pub async fn pull(
    reference: &str,
    opts: &PullOptions,
    cache: &BlobCache,
    progress: &mut (dyn FnMut(String) + Send),
) -> Result<Pulled, ImageError> {
    let arch = opts.arch.unwrap_or(Arch::host());
    let parsed: Reference =
        reference.parse().map_err(|e| ImageError::Invalid(format!("{reference:?} is not an image reference: {e}")))?;
    let registry = parsed.resolve_registry().to_string();
    let protocol = if is_loopback(&registry) && opts.allow_http_loopback {
        ClientProtocol::HttpsExcept(vec![registry.clone()])
    } else {
        ClientProtocol::Https
    };
    let config = ClientConfig {
        protocol,
        platform_resolver: Some(Box::new(move |entries: &[ImageIndexEntry]| pick(entries, arch))),
        connect_timeout: Some(Duration::from_secs(30)),
        read_timeout: Some(Duration::from_secs(120)),
        ..Default::default()
    };
    // reqwest is built without a TLS provider of its own (as in umbra-bundle): ring's. An
    // error means one is installed already.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = Client::new(config);
    let auth = auth_for(&registry, &opts.credentials)?;
    // The registry's challenge decides: a bearer token from its realm (anonymous or with the
    // credentials), or basic auth on every request.
    client
        .auth(&parsed, &auth, oci_client::RegistryOperation::Pull)
        .await
        .map_err(|e| registry_error("cannot authenticate to pull", &parsed, e))?;
    let anonymous = matches!(auth, RegistryAuth::Anonymous);
    let (manifest, digest) = client.pull_image_manifest(&parsed, &auth).await.map_err(|e| {
        let refused = matches!(e, oci_client::errors::OciDistributionError::UnauthorizedError { .. });
        match (refused, anonymous) {
            (true, true) => registry_error(
                "not authorized (no credentials for this registry: pass --username and --password-stdin, or log in \
                 with `docker login`) to get the manifest of",
                &parsed,
                e,
            ),
            (true, false) => registry_error("the registry refused the credentials for", &parsed, e),
            _ => registry_error("cannot get the manifest of", &parsed, e),
        }
    })?;
    progress(format!("{}: manifest {digest} ({} layers)", parsed.whole(), manifest.layers.len()));
    if manifest.config.size < 0 || manifest.config.size as usize > MAX_CONFIG_BYTES {
        return Err(ImageError::Invalid(format!("the image config's size {} is out of bounds", manifest.config.size)));
    }
    let mut config = Vec::new();
    client
        .pull_blob(&parsed, &manifest.config, Bounded { inner: &mut config, left: manifest.config.size as u64 })
        .await
        .map_err(|e| registry_error("cannot get the config of", &parsed, e))?;
    let (mut downloaded, mut cached) = (0, 0);
    let mut layers = Vec::new();
    for (i, desc) in manifest.layers.iter().enumerate() {
        check_layer_type(i, &desc.media_type)?;
        let size =
            u64::try_from(desc.size).map_err(|_| ImageError::Invalid(format!("layer {i} has a negative size")))?;
        let path = match cache.get(&desc.digest)? {
            Some(path) => {
                cached += size;
                progress(format!("layer {i}: {} cached ({size} bytes)", desc.digest));
                path
            }
            None => {
                let path = fetch_blob(&client, &parsed, desc, size, cache).await?;
                downloaded += size;
                progress(format!("layer {i}: {} downloaded ({size} bytes)", desc.digest));
                path
            }
        };
        layers.push(Layer { digest: desc.digest.clone(), path });
    }
    Ok(Pulled {
        source: Source { reference: parsed.whole(), digest, config, layers },
        downloaded_bytes: downloaded,
        cached_bytes: cached,
    })
}

/// Downloads one blob into the cache; the client checks its digest, the writer its size.
async fn fetch_blob(
    client: &Client,
    reference: &Reference,
    desc: &OciDescriptor,
    size: u64,
    cache: &BlobCache,
) -> Result<std::path::PathBuf, ImageError> {
    let partial = cache.partial_path(&desc.digest)?;
    let result = async {
        let mut file = tokio::fs::File::create(&partial).await.map_err(|e| ImageError::io("create", &partial, e))?;
        client
            .pull_blob(reference, desc, Bounded { inner: &mut file, left: size })
            .await
            .map_err(|e| registry_error(&format!("cannot get layer {} of", desc.digest), reference, e))?;
        file.sync_all().await.map_err(|e| ImageError::io("fsync", &partial, e))?;
        Ok::<_, ImageError>(())
    }
    .await;
    match result {
        Ok(()) => cache.commit(&desc.digest, &partial),
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            Err(e)
        }
    }
}

/// A writer that refuses more than `left` bytes: a registry decides how much it sends, and the
/// descriptor's size is what the manifest promised.
struct Bounded<W> {
    inner: W,
    left: u64,
}

impl<W: AsyncWrite + Unpin> AsyncWrite for Bounded<W> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        if buf.len() as u64 > self.left {
            return Poll::Ready(Err(std::io::Error::other("the registry sent more bytes than the manifest's size")));
        }
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = &polled {
            this.left -= *n as u64;
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Whether a registry name is served over plain HTTP under `allow_http_loopback`.
pub fn http_allowed(registry: &str, allow_http_loopback: bool) -> bool {
    allow_http_loopback && is_loopback(registry)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_registries_may_use_http() {
        for r in ["127.0.0.1:5000", "localhost:5000", "[::1]:5000", "127.0.0.1"] {
            assert!(http_allowed(r, true), "{r}");
            assert!(!http_allowed(r, false), "{r}");
        }
        for r in ["10.0.0.1:5000", "registry.example.com", "ghcr.io", "localhost.example.com:5000"] {
            assert!(!http_allowed(r, true), "{r}");
        }
    }
}
