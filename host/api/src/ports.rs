//! Guest ports reached from the host (`session.expose`): a host TCP listener whose connections
//! the runtime carries to a port on the guest's loopback (`docs/sessions.md`, "Ports").

use std::net::{IpAddr, Ipv4Addr};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A port to expose, as `session.start {ports}` and `session.expose` take it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct PortSpec {
    /// The port a server listens on in the guest (on its loopback, or on every address).
    pub guest_port: u16,
    /// The host port to listen on; unset or 0: a free one, chosen by the host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_port: Option<u16>,
    /// The host address to listen on: 127.0.0.1 unless given. Any other address (`0.0.0.0`,
    /// a LAN address) needs umbrad's `ports_beyond_loopback`; a host port below 1024, its
    /// `ports_privileged`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bind: Option<IpAddr>,
}

impl PortSpec {
    pub fn bind(&self) -> IpAddr {
        self.bind.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
    }

    /// Checks the port against what the daemon allows; the error names the setting.
    pub fn check(&self, beyond_loopback: bool, privileged: bool) -> Result<(), String> {
        if self.guest_port == 0 {
            return Err("guest_port must be 1 to 65535".into());
        }
        let bind = self.bind();
        if !bind.is_loopback() && !beyond_loopback {
            return Err(format!(
                "binding {bind} makes the guest's port {} reachable from other machines: umbrad's \
                 ports_beyond_loopback setting must allow it",
                self.guest_port
            ));
        }
        if let Some(p) = self.host_port.filter(|&p| p != 0 && p < 1024) {
            if !privileged {
                return Err(format!("host port {p} is privileged: umbrad's ports_privileged setting must allow it"));
            }
        }
        Ok(())
    }
}

/// An exposed port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct PortInfo {
    pub guest_port: u16,
    /// Where the host listens for it.
    pub host_port: u16,
    pub bind: IpAddr,
    /// Connections carried now.
    #[serde(default)]
    pub connections: u32,
}

/// Params of `session.expose`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ExposeParams {
    pub session: String,
    #[serde(flatten)]
    pub port: PortSpec,
}

/// Params of `session.unexpose`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct UnexposeParams {
    pub session: String,
    pub guest_port: u16,
}

/// A session's exposed ports (`session.ports`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct PortList {
    pub ports: Vec<PortInfo>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_and_unprivileged_unless_the_daemon_allows_more() {
        let p = |guest_port, host_port, bind: Option<&str>| PortSpec {
            guest_port,
            host_port,
            bind: bind.map(|b| b.parse().unwrap()),
        };
        assert!(p(8000, None, None).check(false, false).is_ok());
        assert_eq!(p(8000, None, None).bind(), IpAddr::V4(Ipv4Addr::LOCALHOST));
        assert!(p(8000, Some(8080), Some("::1")).check(false, false).is_ok());
        let e = p(8000, None, Some("0.0.0.0")).check(false, false).unwrap_err();
        assert!(e.contains("ports_beyond_loopback"), "{e}");
        assert!(p(8000, None, Some("0.0.0.0")).check(true, false).is_ok());
        let e = p(8000, Some(80), None).check(true, false).unwrap_err();
        assert!(e.contains("ports_privileged"), "{e}");
        assert!(p(8000, Some(80), None).check(false, true).is_ok());
        assert!(p(0, None, None).check(true, true).is_err());
        let parsed: ExposeParams = serde_json::from_str(r#"{"session":"s","guest_port":8000}"#).unwrap();
        assert_eq!(parsed.port, p(8000, None, None));
    }
}
