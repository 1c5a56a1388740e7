//! The session's CA in the guest's trust stores (`Request::InstallCa`): the host's egress proxy
//! presents certificates signed by it for the hosts a secret is bound to, and every TLS client
//! in the guest must accept them — OpenSSL and GnuTLS programs through the system store and
//! `SSL_CERT_FILE`, Python's `requests`, git, pip and Node through their own variables.

use std::path::Path;
use std::sync::RwLock;

use umbra_proto::{ErrorBody, ErrorCode, MAX_CA_PEM};

/// Debian's (and Alpine's, Arch's) system bundle, which OpenSSL reads by default.
const SYSTEM_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
const DIR: &str = "/run/umbra";
/// The session CA alone (Node adds it to its own roots).
const CA_FILE: &str = "/run/umbra/session-ca.pem";
/// The system's CAs and the session's, for the variables that replace the system store.
const BUNDLE_FILE: &str = "/run/umbra/ca-bundle.pem";

const BEGIN: &str = "# umbra session CA: begin\n";
const END: &str = "# umbra session CA: end\n";

static TRUST_ENV: RwLock<Vec<(String, String)>> = RwLock::new(Vec::new());

/// Variables every spawned process gets once a CA is installed (before the request's `env`).
pub fn trust_env() -> Vec<(String, String)> {
    TRUST_ENV.read().unwrap().clone()
}

/// Installs `pem` (see `Request::InstallCa`). Only PID 1 changes the machine's trust.
pub fn install_ca(pem: &str, pid1: bool) -> Result<(), ErrorBody> {
    validate(pem)?;
    if !pid1 {
        return Err(ErrorBody::new(
            ErrorCode::Unsupported,
            "install_ca changes the machine's trust store: only the guest's PID-1 agent does it",
        ));
    }
    let io = |what: &str, e: std::io::Error| ErrorBody::new(ErrorCode::Io, format!("{what}: {e}"));
    std::fs::create_dir_all(DIR).map_err(|e| io("create /run/umbra", e))?;
    let block = format!("{BEGIN}{}\n{END}", pem.trim_end());
    write_atomic(Path::new(CA_FILE), pem.as_bytes()).map_err(|e| io(CA_FILE, e))?;
    let system = std::fs::read_to_string(SYSTEM_BUNDLE).unwrap_or_default();
    let with_ca = format!("{}{block}", without_block(&system));
    write_atomic(Path::new(BUNDLE_FILE), with_ca.as_bytes()).map_err(|e| io(BUNDLE_FILE, e))?;
    // The system store too, for programs that ignore the variables. A read-only root keeps
    // its store: the variables still name the bundle.
    let system_dir = Path::new(SYSTEM_BUNDLE).parent().expect("a file in a directory");
    if let Err(e) =
        std::fs::create_dir_all(system_dir).and_then(|()| write_atomic(Path::new(SYSTEM_BUNDLE), with_ca.as_bytes()))
    {
        tracing::warn!("cannot add the session CA to {SYSTEM_BUNDLE}: {e}");
    }
    let bundle = BUNDLE_FILE.to_string();
    *TRUST_ENV.write().unwrap() =
        ["SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO", "PIP_CERT"]
            .into_iter()
            .map(|k| (k.to_string(), bundle.clone()))
            .chain([("NODE_EXTRA_CA_CERTS".to_string(), CA_FILE.to_string())])
            .collect();
    Ok(())
}

fn validate(pem: &str) -> Result<(), ErrorBody> {
    let bad = |why: &str| Err(ErrorBody::new(ErrorCode::BadRequest, format!("install_ca: {why}")));
    if pem.len() > MAX_CA_PEM {
        return bad(&format!("the certificate is longer than {MAX_CA_PEM} bytes"));
    }
    let body = pem.trim();
    if !body.starts_with("-----BEGIN CERTIFICATE-----") || !body.ends_with("-----END CERTIFICATE-----") {
        return bad("not one PEM certificate");
    }
    if body.matches("-----BEGIN").count() != 1 || !body.bytes().all(|b| b.is_ascii_graphic() || b == b'\n' || b == b' ')
    {
        return bad("not one PEM certificate");
    }
    Ok(())
}

/// `bundle` without the block an earlier install added.
fn without_block(bundle: &str) -> String {
    match (bundle.find(BEGIN), bundle.find(END)) {
        (Some(b), Some(e)) if e > b => format!("{}{}", &bundle[..b], &bundle[e + END.len()..]),
        _ => bundle.to_string(),
    }
}

fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("umbra-tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PEM: &str = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";

    #[test]
    fn only_one_certificate_is_taken_and_only_by_pid1() {
        assert_eq!(install_ca(PEM, false).unwrap_err().code, ErrorCode::Unsupported);
        for bad in ["", "junk", &format!("{PEM}{PEM}"), &PEM.replace("MIIB", "MI\u{7}IB")] {
            assert_eq!(install_ca(bad, true).unwrap_err().code, ErrorCode::BadRequest, "{bad:?}");
        }
    }

    #[test]
    fn a_second_install_replaces_the_first_block() {
        let once = format!("system\n{BEGIN}{PEM}{END}");
        assert_eq!(format!("{}{BEGIN}new\n{END}", without_block(&once)), format!("system\n{BEGIN}new\n{END}"));
        assert_eq!(without_block("system\n"), "system\n");
    }
}
