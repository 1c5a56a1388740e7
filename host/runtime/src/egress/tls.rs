//! TLS for the connections the proxy reads: the session's own CA, whose certificates the guest
//! trusts and whose key never leaves this process, and the verified connection upstream,
//! checked against the host's trust store (plus any CA the configuration adds).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};

/// What fails when setting TLS up (never a guest's doing: its handshake errors are per
/// connection and reported there).
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot make a certificate: {0}")]
    Certificate(#[from] rcgen::Error),
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
    #[error("{0}: no certificate in it")]
    NoCertificate(String),
    #[error("the host's trust store holds no certificate ({0})")]
    NoRoots(String),
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Certificates made for host names at most: a guest naming endless hosts gets them made
/// again, not kept.
const MAX_CACHED_HOSTS: usize = 256;

/// A session's certificate authority: the guest trusts it (`Request::InstallCa`), the proxy
/// signs a certificate with it for each host whose requests it reads.
pub struct SessionCa {
    cert: CertificateDer<'static>,
    pem: String,
    issuer: Issuer<'static, KeyPair>,
    servers: Mutex<HashMap<String, Arc<rustls::ServerConfig>>>,
}

impl std::fmt::Debug for SessionCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionCa").finish_non_exhaustive()
    }
}

/// From a day ago (a guest's clock may lag) to 400 days on: past any session's life in one
/// daemon process, which makes a new one.
fn validity(params: &mut CertificateParams) {
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::days(1);
    params.not_after = now + time::Duration::days(400);
}

impl SessionCa {
    pub fn generate(session: &str) -> Result<Self, TlsError> {
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "Umbra");
        dn.push(DnType::CommonName, format!("Umbra session {session} CA"));
        params.distinguished_name = dn;
        // It signs leaf certificates only, never another CA.
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        validity(&mut params);
        let key = KeyPair::generate()?;
        let cert = params.self_signed(&key)?;
        let pem = cert.pem();
        let der = cert.der().clone();
        Ok(Self { cert: der, pem, issuer: Issuer::new(params, key), servers: Mutex::new(HashMap::new()) })
    }

    /// The CA certificate, for the guest's trust store (never the key).
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// A server configuration presenting a certificate for `host` (a name or an address),
    /// HTTP/1.1 only: the proxy reads requests as HTTP/1.1.
    pub fn server_config(&self, host: &str) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        if let Some(c) = self.servers.lock().unwrap().get(host) {
            return Ok(c.clone());
        }
        let mut params = CertificateParams::new(vec![host.to_string()])?;
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, host);
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        validity(&mut params);
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(vec![cert.der().clone(), self.cert.clone()], key)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let config = Arc::new(config);
        let mut servers = self.servers.lock().unwrap();
        if servers.len() >= MAX_CACHED_HOSTS {
            servers.clear();
        }
        servers.insert(host.to_string(), config.clone());
        Ok(config)
    }
}

/// How the proxy's own connections upstream are verified: the host's trust store (as
/// `rustls-native-certs` finds it, which honours `SSL_CERT_FILE` and `SSL_CERT_DIR`) plus the
/// configuration's extra CAs (a company's TLS-inspecting proxy, a test's CA).
#[derive(Clone)]
pub struct Upstream {
    config: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream").finish_non_exhaustive()
    }
}

impl Upstream {
    /// The host's trust store and `extra` (PEM certificates, each named for errors).
    pub fn new(extra: &[(String, String)]) -> Result<Self, TlsError> {
        let mut roots = rustls::RootCertStore::empty();
        let native = rustls_native_certs::load_native_certs();
        let (added, _) = roots.add_parsable_certificates(native.certs);
        for (name, pem) in extra {
            let certs: Vec<CertificateDer<'static>> =
                CertificateDer::pem_slice_iter(pem.as_bytes()).filter_map(Result::ok).collect();
            if certs.is_empty() {
                return Err(TlsError::NoCertificate(name.clone()));
            }
            roots.add_parsable_certificates(certs);
        }
        if roots.is_empty() {
            let why = native.errors.first().map_or("none found".to_string(), |e| e.to_string());
            return Err(TlsError::NoRoots(why));
        }
        tracing::debug!("egress: {added} host trust anchors, {} extra", extra.len());
        let mut config = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self { config: Arc::new(config) })
    }

    /// TLS over `tcp` to `host`, its certificate verified for that name.
    pub async fn connect<S>(&self, host: &str, tcp: S) -> std::io::Result<tokio_rustls::client::TlsStream<S>>
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let name = ServerName::try_from(host.to_string())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{host}: {e}")))?;
        tokio_rustls::TlsConnector::from(self.config.clone()).connect(name, tcp).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_session_ca_certificate_verifies_for_its_host_only() {
        let ca = SessionCa::generate("t").unwrap();
        let upstream = Upstream::new(&[("session CA".into(), ca.pem().to_string())]).unwrap();
        for (asked, presented, ok) in [("api.test", "api.test", true), ("other.test", "api.test", false)] {
            let (client, server) = tokio::io::duplex(64 * 1024);
            let acceptor = tokio_rustls::TlsAcceptor::from(ca.server_config(presented).unwrap());
            let serve = tokio::spawn(async move { acceptor.accept(server).await.map(|_| ()) });
            let got = upstream.connect(asked, client).await;
            assert_eq!(got.is_ok(), ok, "{asked}: {:?}", got.err());
            let _ = serve.await;
        }
        assert!(matches!(Upstream::new(&[("x".into(), "junk".into())]), Err(TlsError::NoCertificate(_))));
    }
}
