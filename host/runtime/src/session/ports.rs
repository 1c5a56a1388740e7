//! A session's exposed ports: a host TCP listener per guest port; each connection it accepts
//! is carried to that port on the guest's loopback through the running VM (a stream to the
//! agent's forward port, `umbra_proto::forward`). The listeners belong to the session, not to
//! a VM: they stay through restarts, resumes and forks' first boots, and a connection made
//! while no VM runs is closed at once.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixStream};
use umbra_api::ports::{PortInfo, PortSpec};
use umbra_proto::forward::{ForwardReply, ForwardRequest, FORWARD_VSOCK_PORT, MAX_FORWARD_LINE};

use crate::backend::Dialer;

/// The most ports `auto_expose` keeps exposed at once; further ones are announced, not exposed.
pub const MAX_AUTO_EXPOSED: usize = 64;

/// Connections one exposed port carries at once; more are closed as they arrive.
pub const MAX_CONNECTIONS_PER_PORT: usize = 512;

/// How long the agent has to connect to the guest's port and answer.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(15);

/// After the host client's end of stream, how long the guest side may stay silent before both
/// are closed. Its half-close cannot be passed on: the backends' vsock turns a host end's
/// write shutdown into a full one, which would cut the server's answer off.
const HALF_CLOSED_LINGER: Duration = Duration::from_secs(5);

/// The running VM's dialer — a suspended session's once it is restored — or `None` while none
/// runs.
pub type Target =
    Arc<dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<Dialer>> + Send>> + Send + Sync>;

/// Told of each connection accepted (the session counts it as activity).
pub type Touch = Arc<dyn Fn() + Send + Sync>;

/// Why a port could not be exposed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExposeError {
    /// The host address and port are taken (by another program, or another session).
    InUse(String),
    /// Anything else about the address (not one of this host's, not permitted).
    Address(String),
}

impl std::fmt::Display for ExposeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExposeError::InUse(s) | ExposeError::Address(s) => f.write_str(s),
        }
    }
}

#[derive(Default)]
pub struct Ports {
    open: Mutex<BTreeMap<u16, Forward>>,
}

struct Forward {
    info: PortInfo,
    connections: Arc<AtomicU32>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Forward {
    /// Ends the listener and its connections, and returns once its socket is closed (so the
    /// host port can be listened on again at once).
    async fn stop(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Drop for Forward {
    // The listener's task owns its connections' tasks: aborting it ends them all.
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

impl Ports {
    /// Listens for `spec`. The same guest port exposed already on the address asked for (or
    /// on any, when `spec` names no host port) stays as it is; on another address, the new
    /// listener is made first and the old one closed after, so a failure changes nothing.
    pub async fn expose(&self, spec: &PortSpec, target: Target, touch: Touch) -> Result<PortInfo, ExposeError> {
        let bind = spec.bind();
        if let Some(f) = self.open.lock().unwrap().get(&spec.guest_port) {
            let same_port = spec.host_port.is_none_or(|p| p == 0 || p == f.info.host_port);
            if f.info.bind == bind && same_port {
                return Ok(PortInfo { connections: f.connections.load(Ordering::Relaxed), ..f.info.clone() });
            }
        }
        let addr = SocketAddr::new(bind, spec.host_port.unwrap_or(0));
        let listener = std::net::TcpListener::bind(addr).map_err(|e| match e.kind() {
            std::io::ErrorKind::AddrInUse => ExposeError::InUse(format!("host port {addr} is in use")),
            _ => ExposeError::Address(format!("cannot listen on {addr}: {e}")),
        })?;
        let fail = |e: std::io::Error| ExposeError::Address(format!("{addr}: {e}"));
        listener.set_nonblocking(true).map_err(fail)?;
        let listener = TcpListener::from_std(listener).map_err(fail)?;
        let host_port = listener.local_addr().map_err(fail)?.port();
        let info = PortInfo { guest_port: spec.guest_port, host_port, bind, connections: 0 };
        let connections = Arc::new(AtomicU32::new(0));
        let task = tokio::spawn(serve(listener, spec.guest_port, target, touch, connections.clone()));
        let forward = Forward { info: info.clone(), connections, task: Some(task) };
        let old = self.open.lock().unwrap().insert(spec.guest_port, forward);
        if let Some(old) = old {
            old.stop().await;
        }
        Ok(info)
    }

    /// Stops listening for `guest_port` (its connections end) and returns once the host port
    /// is free. Whether it was exposed.
    pub async fn unexpose(&self, guest_port: u16) -> bool {
        let old = self.open.lock().unwrap().remove(&guest_port);
        match old {
            Some(f) => {
                f.stop().await;
                true
            }
            None => false,
        }
    }

    /// Stops every listener.
    pub async fn close_all(&self) {
        let all = std::mem::take(&mut *self.open.lock().unwrap());
        for f in all.into_values() {
            f.stop().await;
        }
    }

    pub fn is_open(&self, guest_port: u16) -> bool {
        self.open.lock().unwrap().contains_key(&guest_port)
    }

    /// Connections carried now, over every port (a session with one open is not idle).
    pub fn connections(&self) -> u32 {
        self.open.lock().unwrap().values().map(|f| f.connections.load(Ordering::Relaxed)).sum()
    }

    /// The exposed ports, with the connections each carries now.
    pub fn list(&self) -> Vec<PortInfo> {
        let open = self.open.lock().unwrap();
        open.values()
            .map(|f| PortInfo { connections: f.connections.load(Ordering::Relaxed), ..f.info.clone() })
            .collect()
    }
}

async fn serve(listener: TcpListener, guest_port: u16, target: Target, touch: Touch, open: Arc<AtomicU32>) {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (client, _) = match accepted {
                    Ok(c) => c,
                    Err(e) => {
                        // Descriptors exhausted, say: wait a little rather than spin.
                        tracing::debug!("exposed port {guest_port}: accept: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                touch();
                if connections.len() >= MAX_CONNECTIONS_PER_PORT {
                    reset(client);
                    continue;
                }
                let (open, target) = (open.clone(), target.clone());
                open.fetch_add(1, Ordering::Relaxed);
                // The VM is looked up in the connection's own task: waking a suspended session
                // takes a restore, and other connections are accepted meanwhile.
                connections.spawn(async move {
                    match target().await {
                        Some(dialer) => {
                            if let Err(e) = carry(client, &dialer, guest_port).await {
                                tracing::debug!("exposed port {guest_port}: {e}");
                            }
                        }
                        // No VM runs: the client hears so at once.
                        None => reset(client),
                    }
                    open.fetch_sub(1, Ordering::Relaxed);
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// Closes with RST: the client learns at once that there is nothing there.
fn reset(client: TcpStream) {
    let _ = client.set_zero_linger();
}

/// One connection: a stream to the agent's forward port naming `guest_port`, its answer, then
/// the bytes both ways.
async fn carry(client: TcpStream, dialer: &Dialer, guest_port: u16) -> Result<(), String> {
    let _ = client.set_nodelay(true);
    let handshake = async {
        let mut guest = dialer.dial(FORWARD_VSOCK_PORT).await?;
        guest
            .write_all(&ForwardRequest { port: guest_port }.to_line())
            .await
            .map_err(|e| format!("sending the request: {e}"))?;
        let reply = read_reply(&mut guest).await?;
        Ok::<_, String>((guest, reply))
    };
    let (guest, reply) = match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            reset(client);
            return Err(e);
        }
        Err(_) => {
            reset(client);
            return Err(format!("the guest did not answer within {HANDSHAKE_TIMEOUT:?}"));
        }
    };
    if !reply.ok {
        reset(client);
        return Err(reply.reason.unwrap_or_else(|| "refused by the guest".into()));
    }
    relay(client, guest).await.map_err(|e| e.to_string())
}

/// The agent's answer line, read byte by byte so none of the connection's bytes is taken.
async fn read_reply(guest: &mut UnixStream) -> Result<ForwardReply, String> {
    let mut line = Vec::with_capacity(32);
    loop {
        let mut byte = [0u8; 1];
        match guest.read(&mut byte).await {
            Ok(0) => return Err("the guest closed the stream without an answer (no agent forward port?)".into()),
            Ok(_) if byte[0] == b'\n' => break,
            Ok(_) if line.len() + 1 >= MAX_FORWARD_LINE => {
                return Err(format!("the guest's answer is longer than {MAX_FORWARD_LINE} bytes"))
            }
            Ok(_) => line.push(byte[0]),
            Err(e) => return Err(format!("reading the guest's answer: {e}")),
        }
    }
    serde_json::from_slice(&line).map_err(|e| format!("the guest's answer is not understood: {e}"))
}

/// Carries bytes both ways until the guest side ends, or — once the client has finished
/// sending — the guest side has been silent for [`HALF_CLOSED_LINGER`].
async fn relay(client: TcpStream, guest: UnixStream) -> std::io::Result<()> {
    let (mut cr, mut cw) = client.into_split();
    let (mut gr, mut gw) = guest.into_split();
    let mut up = vec![0u8; 64 * 1024];
    let mut down = vec![0u8; 64 * 1024];
    let mut client_open = true;
    loop {
        tokio::select! {
            r = cr.read(&mut up), if client_open => match r? {
                0 => client_open = false,
                n => gw.write_all(&up[..n]).await?,
            },
            r = gr.read(&mut down) => match r? {
                0 => {
                    let _ = cw.shutdown().await;
                    return Ok(());
                }
                n => cw.write_all(&down[..n]).await?,
            },
            () = tokio::time::sleep(HALF_CLOSED_LINGER), if !client_open => return Ok(()),
        }
    }
}
