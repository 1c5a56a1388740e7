//! A session's exposed ports: the listeners ([`crate::session::ports`]) and their record.
//! Every change — a client's expose or unexpose, the record reopened, the supervisor's
//! automatic exposures — holds the session's `port_changes` lock, so the listeners, the set
//! of automatic ones and the record move together.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use umbra_api::ports::{PortInfo, PortSpec};
use umbra_api::EventKind;
use umbra_proto::ListeningPort;

use super::Session;
use crate::session::error::SessionError;
use crate::session::ports::{ExposeError, Target, Touch, MAX_AUTO_EXPOSED};

/// The most listening ports one poll takes from the guest.
const MAX_LISTENING_SEEN: usize = 256;

fn expose_error(e: ExposeError) -> SessionError {
    match e {
        ExposeError::InUse(s) => SessionError::Busy(s),
        ExposeError::Address(s) => SessionError::InvalidArgument(s),
    }
}

impl Session {
    /// Listens for `spec` on the host (see `session.expose`): checked against umbrad's
    /// settings, recorded with the host port it got, kept until unexposed or the session is
    /// deleted. A guest port exposed already is moved to the new host port (or left as it is,
    /// when that is where it listens).
    pub async fn expose(self: &Arc<Self>, spec: &PortSpec) -> Result<PortInfo, SessionError> {
        let config = self.ctx.config();
        spec.check(config.ports_beyond_loopback, config.ports_privileged).map_err(SessionError::InvalidArgument)?;
        let _changes = self.port_changes.lock().await;
        let info = self.ports.expose(spec, self.port_target(), self.port_touch()).await.map_err(expose_error)?;
        // Exposed by a client now: no longer taken away when its program stops listening.
        self.auto_exposed.lock().unwrap().remove(&spec.guest_port);
        self.record_port(&info);
        Ok(info)
    }

    /// Stops listening for `guest_port`; connections it carries end.
    pub async fn unexpose(&self, guest_port: u16) -> Result<(), SessionError> {
        let _changes = self.port_changes.lock().await;
        let recorded = {
            let mut state = self.state.lock().unwrap();
            let before = state.record.ports.len();
            state.record.ports.retain(|p| p.guest_port != guest_port);
            before != state.record.ports.len()
        };
        self.auto_exposed.lock().unwrap().remove(&guest_port);
        if !self.ports.unexpose(guest_port).await && !recorded {
            return Err(SessionError::NotFound(format!(
                "session {}: guest port {guest_port} is not exposed",
                self.name
            )));
        }
        self.persist();
        Ok(())
    }

    /// Closes every listener (the session is being deleted); the record is left alone.
    pub(crate) async fn close_ports(&self) {
        let _changes = self.port_changes.lock().await;
        self.ports.close_all().await;
    }

    /// The exposed ports: listening ones with their connections, recorded ones not listening
    /// in this umbrad yet (until the session runs) with none.
    pub fn ports(&self) -> Vec<PortInfo> {
        let recorded = self.state.lock().unwrap().record.ports.clone();
        self.ports_info(&recorded)
    }

    pub(super) fn ports_info(&self, recorded: &[PortSpec]) -> Vec<PortInfo> {
        let mut ports = self.ports.list();
        for p in recorded.iter().filter(|p| !self.ports.is_open(p.guest_port)) {
            ports.push(PortInfo {
                guest_port: p.guest_port,
                host_port: p.host_port.unwrap_or(0),
                bind: p.bind(),
                connections: 0,
            });
        }
        ports.sort_by_key(|p| p.guest_port);
        ports
    }

    /// Listens for every recorded port not listening yet (at the session's start, and at each
    /// boot after umbrad restarted). Returns the first failure; the others are still opened.
    pub(crate) async fn open_recorded_ports(self: &Arc<Self>) -> Result<(), SessionError> {
        let _changes = self.port_changes.lock().await;
        let recorded = self.state.lock().unwrap().record.ports.clone();
        let mut first = Ok(());
        for spec in recorded.iter().filter(|p| !self.ports.is_open(p.guest_port)) {
            match self.ports.expose(spec, self.port_target(), self.port_touch()).await {
                Ok(info) => self.record_port(&info),
                Err(e) => {
                    tracing::warn!("session {}: guest port {}: {e}", self.name, spec.guest_port);
                    if first.is_ok() {
                        first = Err(expose_error(e));
                    }
                }
            }
        }
        first
    }

    /// What the guest listens on now (`listening`, from the supervisor's poll), against what
    /// it listened on at the last poll (`seen`, port → whether this exposed it): announces
    /// each change, and with `auto_expose` exposes a new port on a free host port (not
    /// recorded: it lasts while the port is listened on) and takes it away again after.
    pub(super) async fn ports_changed(
        self: &Arc<Self>,
        seen: &mut BTreeMap<u16, bool>,
        mut listening: Vec<ListeningPort>,
    ) {
        // What the guest says is bounded and made unique here, whatever its agent claims.
        listening.truncate(MAX_LISTENING_SEEN);
        listening.sort_by_key(|p| p.port);
        listening.dedup_by_key(|p| p.port);
        let _changes = self.port_changes.lock().await;
        let auto = self.settings().auto_expose;
        let now: BTreeSet<u16> = listening.iter().map(|p| p.port).collect();
        for p in listening.into_iter().filter(|p| !seen.contains_key(&p.port)).collect::<Vec<_>>() {
            let mut exposed = self.ports.list().into_iter().find(|i| i.guest_port == p.port);
            let mut mine = false;
            if auto && exposed.is_none() && self.auto_exposed.lock().unwrap().len() < MAX_AUTO_EXPOSED {
                let spec = PortSpec { guest_port: p.port, host_port: None, bind: None };
                match self.ports.expose(&spec, self.port_target(), self.port_touch()).await {
                    Ok(info) => {
                        exposed = Some(info);
                        mine = true;
                        self.auto_exposed.lock().unwrap().insert(p.port);
                    }
                    Err(e) => tracing::warn!("session {}: cannot expose guest port {}: {e}", self.name, p.port),
                }
            }
            seen.insert(p.port, mine);
            self.emit(EventKind::PortOpened { port: p.port, process: p.process.map(|p| p.tidy()), exposed });
        }
        let gone: Vec<u16> = seen.keys().filter(|p| !now.contains(p)).copied().collect();
        for port in gone {
            seen.remove(&port);
            // Still this poll's to take away only if no client exposed it meanwhile.
            if self.auto_exposed.lock().unwrap().remove(&port) {
                self.ports.unexpose(port).await;
            }
            self.emit(EventKind::PortClosed { port });
        }
    }

    /// Takes away the ports the VM's programs had exposed automatically, each announced as
    /// closed (the VM is gone, or a new one starts with nothing listening).
    pub(super) async fn drop_auto_exposed(&self) {
        let _changes = self.port_changes.lock().await;
        let ports = std::mem::take(&mut *self.auto_exposed.lock().unwrap());
        for port in ports {
            self.ports.unexpose(port).await;
            self.emit(EventKind::PortClosed { port });
        }
    }

    fn record_port(&self, info: &PortInfo) {
        {
            let mut state = self.state.lock().unwrap();
            let spec = PortSpec { guest_port: info.guest_port, host_port: Some(info.host_port), bind: Some(info.bind) };
            state.record.ports.retain(|p| p.guest_port != info.guest_port);
            state.record.ports.push(spec);
            state.record.ports.sort_by_key(|p| p.guest_port);
        }
        self.persist();
    }

    /// The running VM's dialer, looked up for each connection (a restart or resume brings a
    /// new VM; the session may be gone). A connection to a suspended session wakes it, as a
    /// call naming it does; one to a stopped session finds no VM.
    fn port_target(self: &Arc<Self>) -> Target {
        let me = Arc::downgrade(self);
        Arc::new(move || {
            let me = me.clone();
            Box::pin(async move {
                let me = me.upgrade()?;
                if me.state.lock().unwrap().record.suspended {
                    if let Err(e) = me.wake().await {
                        tracing::info!(session = %me.name, "a connection to an exposed port could not wake it: {e}");
                        return None;
                    }
                }
                let state = me.state.lock().unwrap();
                state.current.as_ref().map(|inc| inc.dialer.clone())
            })
        })
    }

    fn port_touch(self: &Arc<Self>) -> Touch {
        let me = Arc::downgrade(self);
        Arc::new(move || {
            if let Some(me) = me.upgrade() {
                me.touch();
            }
        })
    }
}
