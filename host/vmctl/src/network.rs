//! The network flags `vmctl run` and `vmctl session start` share.

use std::collections::BTreeMap;
use std::net::IpAddr;

use clap::{Args, ValueEnum};
use umbra_api::session::{NetworkMode, NetworkPolicy};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    None,
    Allowlist,
    /// As allowlist; a connection to another name waits for the user's answer.
    Ask,
    Any,
}

#[derive(Args, Debug, Clone, Default)]
pub struct NetworkArgs {
    /// What the guest may connect to: none, allowlist (the --allow-domain names), ask (those,
    /// and any other name the user allows when asked) or any (public addresses) [default: none,
    /// or the daemon's setting for sessions]
    #[arg(long, value_enum)]
    network: Option<Mode>,
    /// A name the guest may connect to (repeatable); `*.example.com` for names below a domain.
    /// Implies --network allowlist when --network is not given.
    #[arg(long = "allow-domain", value_name = "NAME")]
    allow_domains: Vec<String>,
    /// An address range the guest may reach although it is private, loopback or link-local
    /// (repeatable): 10.0.0.0/8, 127.0.0.1/32.
    #[arg(long = "allow-cidr", value_name = "CIDR")]
    allow_cidrs: Vec<String>,
    /// Resolve NAME to ADDR on the host instead of asking DNS (repeatable), like curl's --resolve.
    #[arg(long = "resolve", value_name = "NAME:ADDR", value_parser = parse_resolve)]
    resolve: Vec<(String, IpAddr)>,
    /// With --network ask: seconds a connection waits for the answer before it is denied
    /// [default: 60].
    #[arg(long = "ask-timeout", value_name = "SECS")]
    ask_timeout: Option<u64>,
    /// A name whose TLS the host never opens, even where a --secret is bound (repeatable):
    /// `pinned.example.com` inside `*.example.com`, for a client that pins its certificate.
    #[arg(long = "tls-passthrough", value_name = "NAME")]
    tls_passthrough: Vec<String>,
    /// A secret the guest sees only as a placeholder in $NAME (repeatable): the host's egress
    /// proxy puts the value of this vmctl's variable ENV_VAR in its place in requests to HOST
    /// (a name or *.domain; several with commas), and nowhere else.
    #[arg(long = "secret", value_name = "NAME@HOST=ENV_VAR", value_parser = parse_secret)]
    secrets: Vec<SecretArg>,
    /// An SSH key the session's agent holds on the host (repeatable): the guest's
    /// SSH_AUTH_SOCK reaches it, and it signs only logins to HOST (several with commas), known
    /// by their keys in ~/.ssh/known_hosts. The private key file (unencrypted OpenSSH format)
    /// never enters the guest.
    #[arg(long = "ssh-key", value_name = "NAME=FILE@HOST", value_parser = parse_ssh_key)]
    ssh_keys: Vec<umbra_api::secrets::SshKeySpec>,
}

fn parse_ssh_key(s: &str) -> Result<umbra_api::secrets::SshKeySpec, String> {
    let bad = || format!("{s:?} is not NAME=FILE@HOST[,HOST...]");
    let (key, hosts) = s.rsplit_once('@').ok_or_else(bad)?;
    let (name, file) = key.split_once('=').ok_or_else(bad)?;
    let file = std::path::absolute(file).map_err(|e| format!("{file}: {e}"))?;
    let hosts = hosts
        .split(',')
        .map(|h| umbra_api::secrets::SshHostSpec { name: h.to_string(), host_keys: Vec::new() })
        .collect();
    let spec = umbra_api::secrets::SshKeySpec { name: name.into(), private_key: None, from_file: Some(file), hosts };
    spec.validate().map(|()| spec)
}

#[derive(Debug, Clone)]
pub struct SecretArg {
    name: String,
    hosts: Vec<String>,
    env_var: String,
}

fn parse_secret(s: &str) -> Result<SecretArg, String> {
    let (name, rest) = s.split_once('@').ok_or_else(|| format!("{s:?} is not NAME@HOST=ENV_VAR"))?;
    let (hosts, env_var) = rest.split_once('=').ok_or_else(|| format!("{s:?} is not NAME@HOST=ENV_VAR"))?;
    let hosts = hosts.split(',').map(str::to_string).collect();
    Ok(SecretArg { name: name.into(), hosts, env_var: env_var.into() })
}

/// `--publish [[BIND:]HOST:]GUEST`, as docker's `-p` (an IPv6 bind in brackets).
pub(crate) fn parse_publish(s: &str) -> Result<umbra_api::ports::PortSpec, String> {
    let bad = |why: &str| format!("--publish {s:?}: {why} (expected [[BIND:]HOST:]GUEST)");
    let (rest, guest) = match s.rsplit_once(':') {
        Some((rest, guest)) => (Some(rest), guest),
        None => (None, s),
    };
    let guest_port = guest.parse().map_err(|_| bad("the guest port is not a port number"))?;
    let (bind, host) = match rest {
        None => (None, None),
        Some(rest) => match rest.rsplit_once(':') {
            Some((bind, host)) => {
                let bind = bind.trim_start_matches('[').trim_end_matches(']');
                (Some(bind.parse().map_err(|_| bad("the bind is not an address"))?), Some(host))
            }
            None => (None, Some(rest)),
        },
    };
    let host_port = match host {
        Some(h) => Some(h.parse().map_err(|_| bad("the host port is not a port number"))?),
        None => None,
    };
    Ok(umbra_api::ports::PortSpec { guest_port, host_port, bind })
}

fn parse_resolve(s: &str) -> Result<(String, IpAddr), String> {
    let (name, addr) = s.split_once(':').ok_or_else(|| format!("{s:?} is not NAME:ADDR"))?;
    let addr = addr.trim_start_matches('[').trim_end_matches(']');
    let addr: IpAddr = addr.parse().map_err(|e| format!("{s:?}: {addr:?} is not an address: {e}"))?;
    Ok((name.to_string(), addr))
}

impl NetworkArgs {
    pub fn ssh_keys(&self) -> Vec<umbra_api::secrets::SshKeySpec> {
        self.ssh_keys.clone()
    }

    /// The secrets, their values read from this process's environment now (they go to the
    /// session's host side, never to the guest).
    pub fn secrets(&self) -> Result<Vec<umbra_api::secrets::SecretSpec>, String> {
        self.secrets
            .iter()
            .map(|s| {
                let value = std::env::var(&s.env_var)
                    .map_err(|_| format!("--secret {}: the variable {} is not set", s.name, s.env_var))?;
                let spec = umbra_api::secrets::SecretSpec {
                    name: s.name.clone(),
                    value: Some(umbra_api::secrets::SecretValue::new(value)),
                    from_env: None,
                    hosts: s.hosts.clone(),
                    inject: vec![umbra_api::secrets::Inject::Header, umbra_api::secrets::Inject::Basic],
                };
                spec.validate().map(|()| spec).map_err(|e| format!("--secret: {e}"))
            })
            .collect()
    }

    /// Whether any network flag was given.
    pub fn given(&self) -> bool {
        self.network.is_some()
            || !self.allow_domains.is_empty()
            || !self.allow_cidrs.is_empty()
            || !self.resolve.is_empty()
            || self.ask_timeout.is_some()
            || !self.tls_passthrough.is_empty()
    }

    /// The policy these flags describe; `None` when no flag was given (the default applies).
    pub fn policy(&self) -> Option<NetworkPolicy> {
        if !self.given() {
            return None;
        }
        let mode = match self.network {
            Some(Mode::None) => NetworkMode::None,
            Some(Mode::Any) => NetworkMode::Any,
            Some(Mode::Allowlist) => NetworkMode::Allowlist,
            Some(Mode::Ask) => NetworkMode::Ask,
            None if !self.allow_domains.is_empty() || !self.allow_cidrs.is_empty() => NetworkMode::Allowlist,
            None => NetworkMode::None,
        };
        Some(NetworkPolicy {
            mode,
            allow_domains: self.allow_domains.clone(),
            allow_cidrs: self.allow_cidrs.clone(),
            resolve: self.resolve.iter().cloned().collect::<BTreeMap<_, _>>(),
            ask_timeout_secs: self.ask_timeout,
            tls_passthrough: self.tls_passthrough.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publish_reads_like_dockers_p() {
        let p = |s| parse_publish(s).unwrap();
        assert_eq!((p("8000").guest_port, p("8000").host_port, p("8000").bind), (8000, None, None));
        assert_eq!(p("9000:8000").host_port, Some(9000));
        let any = p("0.0.0.0:9000:8000");
        assert_eq!((any.bind, any.host_port), (Some("0.0.0.0".parse().unwrap()), Some(9000)));
        assert_eq!(p("[::1]:9000:8000").bind, Some("::1".parse().unwrap()));
        assert!(parse_publish("x:8000").is_err());
        assert!(parse_publish("70000").is_err());
    }

    #[test]
    fn resolve_takes_v4_and_v6_and_domains_imply_allowlist() {
        assert_eq!(parse_resolve("a.test:127.0.0.1").unwrap(), ("a.test".into(), "127.0.0.1".parse().unwrap()));
        assert_eq!(parse_resolve("a.test:[::1]").unwrap().1, "::1".parse::<IpAddr>().unwrap());
        assert!(parse_resolve("a.test").is_err());
        let args = NetworkArgs { allow_domains: vec!["pypi.org".into()], ..Default::default() };
        assert_eq!(args.policy().unwrap().mode, NetworkMode::Allowlist);
        assert!(NetworkArgs::default().policy().is_none());
    }
}
