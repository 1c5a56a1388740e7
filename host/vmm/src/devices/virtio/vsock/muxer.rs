//! The vsock muxer: everything the device does, as plain synchronous calls.
//!
//! It owns the host listener, the connections (keyed by host port and guest port), and one
//! epoll set over the listener and every host socket. Three entry points move things along —
//! [`VsockMuxer::process_tx`] (guest packets in), [`VsockMuxer::process_rx`] (packets to the guest
//! out) and [`VsockMuxer::handle_host_events`] (Unix socket readiness) — plus
//! [`VsockMuxer::process_timeouts`]. The worker thread calls them when eventfds or the epoll fd
//! fire; lane-(a) tests and the fuzz target call them directly over a `GuestMemoryMmap`.
//!
//! Packets owed to the guest wait in two bounded places: a connection's own pending flags (one
//! of each kind at most; the rx schedule holds each connection at most once) and the control
//! queue of RSTs for packets that match no connection. Only guest tx fills the control queue,
//! so when it is full tx processing pauses until rx drains it: the guest cannot grow it by
//! withholding rx buffers.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::time::{Duration, Instant};

use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::connection::{ConnKey, Connection, GuestOutcome};
use super::packet::{op, RxBuffer, TxPacket, VsockPacketHeader, HOST_CID, MAX_PKT_DATA, TYPE_STREAM};
use super::unix_backend::{connect_nonblocking, ConnectLine, HostListener, PendingConnect};

/// Connections (in any state, including those waiting to deliver their RST) per device.
pub const MAX_CONNECTIONS: usize = 1024;
/// Accepted host connections that have not finished their CONNECT line.
pub const MAX_PENDING_CONNECTS: usize = 64;
/// How long a host process may take to send its CONNECT line.
pub const CONNECT_LINE_TIMEOUT: Duration = Duration::from_secs(5);
/// RSTs for unmatched guest packets waiting for rx buffers; tx pauses when it is full.
const CONTROL_QUEUE_CAP: usize = 256;
/// Chains handled per `process_tx` / `process_rx` call (the largest queue), so a guest refilling
/// as fast as we consume cannot keep the device in one loop.
const CHAINS_PER_CALL: usize = 256;
const ACCEPTS_PER_EVENT: usize = 32;
const EVENTS_PER_POLL: usize = 64;
/// After accept() fails for lack of descriptors the listener stays readable; stop watching it
/// for this long instead of spinning.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// Host-initiated connections get host ports from [1 << 30, 1 << 31), as in Firecracker.
const LOCAL_PORT_FIRST: u32 = 1 << 30;
const LOCAL_PORT_LAST: u32 = (1 << 31) - 1;

const LISTENER_TOKEN: u64 = 0;

/// What the device dropped or refused, for tests and diagnostics.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct VsockCounters {
    /// Tx chains that were not a well-formed packet.
    pub tx_malformed: u64,
    /// Tx packets not from the guest's CID or not to the host.
    pub tx_misaddressed: u64,
    /// Tx packets of another socket type or an unknown operation (answered with RST).
    pub tx_unsupported: u64,
    /// Rx chains that could not hold a packet.
    pub rx_malformed: u64,
    /// Connections reset because the guest sent past its credit.
    pub credit_violations: u64,
    /// Connections reset because the guest sent a packet that makes no sense in their state.
    pub protocol_violations: u64,
    /// Connections reset on a timeout.
    pub timeouts: u64,
    /// Host connections closed: malformed CONNECT line, or over a limit.
    pub host_refused: u64,
    /// Guest connection requests answered with RST (no host listener, or over the limit).
    pub guest_refused: u64,
}

/// The vsock device's state: host sockets, connections, and what is owed to the guest.
#[derive(Debug)]
pub struct VsockMuxer {
    guest_cid: u64,
    listener: HostListener,
    listener_backoff: Option<Instant>,
    epoll: Epoll,
    next_token: u64,
    pending: HashMap<u64, PendingConnect>,
    conns: HashMap<ConnKey, Connection>,
    conn_tokens: HashMap<u64, ConnKey>,
    /// Host ports handed to host-initiated connections, and to which.
    host_ports: HashMap<u32, ConnKey>,
    last_local_port: u32,
    /// Connections with something for the guest, each at most once, served round-robin.
    rx_ready: VecDeque<ConnKey>,
    /// RSTs answering guest packets that match no connection.
    control: VecDeque<VsockPacketHeader>,
    /// Per-call budgets ran out with work left: call again without waiting.
    tx_more: bool,
    rx_more: bool,
    tx_paused: bool,
    scratch: Vec<u8>,
    counters: VsockCounters,
}

impl VsockMuxer {
    /// Binds the hybrid vsock socket at `uds_path` for a guest with CID `guest_cid`.
    pub fn new(guest_cid: u64, uds_path: &Path) -> io::Result<Self> {
        Self::with_listener(guest_cid, HostListener::bind(uds_path)?)
    }

    /// The muxer around a listener bound earlier.
    pub fn with_listener(guest_cid: u64, listener: HostListener) -> io::Result<Self> {
        let epoll = Epoll::new()?;
        epoll.ctl(ControlOperation::Add, listener.as_raw_fd(), EpollEvent::new(EventSet::IN, LISTENER_TOKEN))?;
        Ok(VsockMuxer {
            guest_cid,
            listener,
            listener_backoff: None,
            epoll,
            next_token: LISTENER_TOKEN + 1,
            pending: HashMap::new(),
            conns: HashMap::new(),
            conn_tokens: HashMap::new(),
            host_ports: HashMap::new(),
            last_local_port: LOCAL_PORT_FIRST - 1,
            rx_ready: VecDeque::new(),
            control: VecDeque::new(),
            tx_more: false,
            rx_more: false,
            tx_paused: false,
            scratch: vec![0; MAX_PKT_DATA],
            counters: VsockCounters::default(),
        })
    }

    pub fn guest_cid(&self) -> u64 {
        self.guest_cid
    }

    pub fn uds_path(&self) -> &Path {
        self.listener.path()
    }

    pub fn counters(&self) -> &VsockCounters {
        &self.counters
    }

    /// Connections in any state.
    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }

    /// Whether the last calls stopped with work left that no new event will announce.
    pub fn has_deferred_work(&self) -> bool {
        self.tx_more || self.rx_more || (self.tx_paused && self.control.len() < CONTROL_QUEUE_CAP)
    }

    /// The earliest connection, CONNECT-line or back-off deadline.
    pub fn next_deadline(&self) -> Option<Instant> {
        let conns = self.conns.values().filter_map(Connection::deadline);
        let pending = self.pending.values().map(|p| p.deadline);
        conns.chain(pending).chain(self.listener_backoff).min()
    }

    /// Drops every connection (the guest driver is gone); the listener stays.
    pub fn reset(&mut self) {
        for (_, conn) in self.conns.drain() {
            Self::deregister(&self.epoll, &conn);
        }
        for (_, p) in self.pending.drain() {
            let _ = self.epoll.ctl(ControlOperation::Delete, p.stream.as_raw_fd(), EpollEvent::default());
        }
        self.conn_tokens.clear();
        self.host_ports.clear();
        self.rx_ready.clear();
        self.control.clear();
        self.tx_more = false;
        self.rx_more = false;
        self.tx_paused = false;
    }

    // ---- guest → device -------------------------------------------------------------------

    /// Consumes packets the guest queued on the tx queue. Returns whether used buffers were
    /// added (the caller then interrupts the guest).
    pub fn process_tx(&mut self, mem: &GuestMemoryMmap, queue: &mut Queue) -> bool {
        let now = Instant::now();
        let mut used = false;
        self.tx_more = false;
        self.tx_paused = false;
        for _ in 0..CHAINS_PER_CALL {
            if self.control.len() >= CONTROL_QUEUE_CAP {
                self.tx_paused = true;
                return used;
            }
            let Some(chain) = queue.pop_descriptor_chain(mem) else { return used };
            let head = chain.head_index();
            match TxPacket::parse(mem, chain) {
                Ok(pkt) => self.on_guest_packet(mem, &pkt, now),
                Err(_) => self.counters.tx_malformed += 1,
            }
            // Whatever became of it, the buffer goes back; the device wrote nothing into it.
            // (add_used refuses an out-of-range head index; there is nothing more to do then.)
            let _ = queue.add_used(mem, head, 0);
            used = true;
        }
        self.tx_more = true;
        used
    }

    fn on_guest_packet(&mut self, mem: &GuestMemoryMmap, pkt: &TxPacket, now: Instant) {
        let hdr = &pkt.hdr;
        if hdr.src_cid() != self.guest_cid || hdr.dst_cid() != HOST_CID {
            // Nobody to answer: the guest has one CID and the host is the only peer.
            self.counters.tx_misaddressed += 1;
            return;
        }
        let key = ConnKey { local_port: hdr.dst_port(), peer_port: hdr.src_port() };
        let op = hdr.op();
        if hdr.type_() != TYPE_STREAM || !op::is_known(op) {
            self.counters.tx_unsupported += 1;
            if op != op::RST {
                self.refuse(key);
            }
            return;
        }
        if !self.conns.contains_key(&key) {
            match op {
                op::REQUEST => self.guest_connect(key, hdr),
                op::RST => {}
                _ => self.enqueue_rst(key),
            }
            return;
        }
        if op == op::RST {
            self.remove_connection(key);
            return;
        }
        let data: &[u8] = if op == op::RW {
            match pkt.read_data(mem, &mut self.scratch) {
                Ok(d) => d,
                Err(_) => {
                    self.counters.tx_malformed += 1;
                    return;
                }
            }
        } else {
            &[]
        };
        if let Some(conn) = self.conns.get_mut(&key) {
            match conn.on_guest_packet(hdr, data, now) {
                GuestOutcome::Ok => {}
                GuestOutcome::CreditViolation => self.counters.credit_violations += 1,
                GuestOutcome::ProtocolViolation => self.counters.protocol_violations += 1,
            }
        }
        self.after_conn_change(key);
    }

    /// Answers an unacceptable packet with RST, through its connection if it has one.
    fn refuse(&mut self, key: ConnKey) {
        match self.conns.get_mut(&key) {
            Some(conn) => {
                conn.kill();
                self.after_conn_change(key);
            }
            None => self.enqueue_rst(key),
        }
    }

    fn enqueue_rst(&mut self, key: ConnKey) {
        // process_tx checks for room before taking a packet, and a packet adds at most one.
        if self.control.len() < CONTROL_QUEUE_CAP {
            self.control.push_back(VsockPacketHeader::host_to_guest(
                self.guest_cid,
                key.local_port,
                key.peer_port,
                op::RST,
            ));
        }
    }

    /// The guest asks for host port `key.local_port`: connect to `<uds_path>_<port>`.
    fn guest_connect(&mut self, key: ConnKey, hdr: &VsockPacketHeader) {
        if self.conns.len() >= MAX_CONNECTIONS {
            self.counters.guest_refused += 1;
            self.enqueue_rst(key);
            return;
        }
        match connect_nonblocking(&self.listener.port_path(key.local_port)) {
            Ok(stream) => {
                let token = self.new_token();
                let conn = Connection::new_peer_init(key, self.guest_cid, stream, token, hdr);
                self.insert_connection(conn);
            }
            Err(_) => {
                self.counters.guest_refused += 1;
                self.enqueue_rst(key);
            }
        }
    }

    // ---- device → guest -------------------------------------------------------------------

    /// Fills rx buffers with what is owed to the guest. Returns whether used buffers were added.
    pub fn process_rx(&mut self, mem: &GuestMemoryMmap, queue: &mut Queue) -> bool {
        let now = Instant::now();
        let mut used = false;
        self.rx_more = false;
        for _ in 0..CHAINS_PER_CALL {
            if self.control.is_empty() && self.rx_ready.is_empty() {
                return used;
            }
            let Some(chain) = queue.pop_descriptor_chain(mem) else { return used };
            let head = chain.head_index();
            let buffer = match RxBuffer::parse(mem, chain) {
                Ok(b) => b,
                Err(_) => {
                    self.counters.rx_malformed += 1;
                    let _ = queue.add_used(mem, head, 0);
                    used = true;
                    continue;
                }
            };
            match self.fill_rx_buffer(mem, &buffer, now) {
                Some(len) => {
                    let _ = queue.add_used(mem, head, len);
                    used = true;
                }
                None if buffer.data_capacity() == 0 && !self.rx_ready.is_empty() => {
                    // Only data is owed and this buffer has no room for any: the guest's loss.
                    self.counters.rx_malformed += 1;
                    let _ = queue.add_used(mem, head, 0);
                    used = true;
                }
                None => {
                    // Nothing to say after all (e.g. the readable socket had no bytes): give the
                    // buffer back to the ring untouched.
                    queue.go_to_previous_position();
                    return used;
                }
            }
        }
        self.rx_more = !(self.control.is_empty() && self.rx_ready.is_empty());
        used
    }

    /// Writes one packet into `buffer`; returns its used length, or None if nobody had one.
    fn fill_rx_buffer(&mut self, mem: &GuestMemoryMmap, buffer: &RxBuffer, now: Instant) -> Option<u32> {
        if let Some(mut hdr) = self.control.pop_front() {
            // A write into a checked buffer only fails if memory vanished; the RST is then lost,
            // which the guest survives (its socket times out).
            return Some(buffer.write_packet(mem, &mut hdr, &[]).unwrap_or(0));
        }
        // Each connection gets one turn per buffer; one that has more goes to the back.
        for _ in 0..self.rx_ready.len() {
            let Some(key) = self.rx_ready.pop_front() else { break };
            let Some(conn) = self.conns.get_mut(&key) else { continue };
            conn.queued = false;
            let room = buffer.data_capacity();
            let written = conn.next_rx_packet(room, &mut self.scratch[..room], now).map(|(mut hdr, n)| {
                buffer.write_packet(mem, &mut hdr, &self.scratch[..n]).unwrap_or_else(|_| {
                    // The bytes are gone from the host socket and did not reach the guest: the
                    // stream cannot continue.
                    conn.kill();
                    0
                })
            });
            self.after_conn_change(key);
            if written.is_some() {
                return written;
            }
        }
        None
    }

    // ---- host sockets ---------------------------------------------------------------------

    /// Handles whatever host socket events are ready, without waiting.
    pub fn handle_host_events(&mut self) -> bool {
        self.poll_host(0)
    }

    /// Waits up to `timeout_ms` (-1: forever) for host socket events and handles them. Returns
    /// whether there were any.
    pub fn poll_host(&mut self, timeout_ms: i32) -> bool {
        let mut events = [EpollEvent::default(); EVENTS_PER_POLL];
        let n = match self.epoll.wait(timeout_ms, &mut events) {
            Ok(n) => n,
            Err(_) => return false,
        };
        let now = Instant::now();
        for ev in &events[..n] {
            self.dispatch(ev.data(), ev.events(), now);
        }
        n > 0
    }

    fn dispatch(&mut self, token: u64, events: u32, now: Instant) {
        if token == LISTENER_TOKEN {
            self.accept_host_connections(now);
        } else if self.pending.contains_key(&token) {
            self.continue_connect(token, now);
        } else if let Some(&key) = self.conn_tokens.get(&token) {
            if let Some(conn) = self.conns.get_mut(&key) {
                conn.on_host_event(events);
            }
            self.after_conn_change(key);
        }
        // Otherwise the event is stale: its connection ended earlier in this batch.
    }

    fn accept_host_connections(&mut self, now: Instant) {
        for _ in 0..ACCEPTS_PER_EVENT {
            let stream = match self.listener.accept() {
                Ok(Some(stream)) => stream,
                Ok(None) => return,
                Err(e) => {
                    if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)) {
                        let _ =
                            self.epoll.ctl(ControlOperation::Delete, self.listener.as_raw_fd(), EpollEvent::default());
                        self.listener_backoff = Some(now + ACCEPT_BACKOFF);
                    }
                    return;
                }
            };
            if self.pending.len() >= MAX_PENDING_CONNECTS || self.conns.len() >= MAX_CONNECTIONS {
                // Closing at once tells the host process there is no room (it sees no OK).
                self.counters.host_refused += 1;
                continue;
            }
            let token = self.new_token();
            let interest = EpollEvent::new(EventSet::IN | EventSet::READ_HANG_UP, token);
            if self.epoll.ctl(ControlOperation::Add, stream.as_raw_fd(), interest).is_err() {
                self.counters.host_refused += 1;
                continue;
            }
            self.pending.insert(token, PendingConnect::new(stream, now + CONNECT_LINE_TIMEOUT));
            // The line is usually there already.
            self.continue_connect(token, now);
        }
    }

    fn continue_connect(&mut self, token: u64, now: Instant) {
        let Some(p) = self.pending.get_mut(&token) else { return };
        let port = match p.read_line() {
            ConnectLine::Incomplete => return,
            ConnectLine::Port(port) => Some(port),
            ConnectLine::Invalid => None,
        };
        let Some(p) = self.pending.remove(&token) else { return };
        let _ = self.epoll.ctl(ControlOperation::Delete, p.stream.as_raw_fd(), EpollEvent::default());
        let Some(peer_port) = port else {
            self.counters.host_refused += 1;
            return;
        };
        let local_port = match self.allocate_local_port(peer_port) {
            Some(port) if self.conns.len() < MAX_CONNECTIONS => port,
            _ => {
                self.counters.host_refused += 1;
                return;
            }
        };
        let key = ConnKey { local_port, peer_port };
        let token = self.new_token();
        self.host_ports.insert(local_port, key);
        self.insert_connection(Connection::new_local_init(key, self.guest_cid, p.stream, token, now));
    }

    fn allocate_local_port(&mut self, peer_port: u32) -> Option<u32> {
        // At most MAX_CONNECTIONS ports are taken, so this finds one well within the range.
        for _ in 0..=MAX_CONNECTIONS {
            self.last_local_port =
                if self.last_local_port >= LOCAL_PORT_LAST { LOCAL_PORT_FIRST } else { self.last_local_port + 1 };
            let port = self.last_local_port;
            if !self.host_ports.contains_key(&port)
                && !self.conns.contains_key(&ConnKey { local_port: port, peer_port })
            {
                return Some(port);
            }
        }
        None
    }

    /// Ends connections and CONNECT lines whose time is up, and resumes accepting after a
    /// back-off.
    pub fn process_timeouts(&mut self, now: Instant) {
        let expired: Vec<ConnKey> =
            self.conns.values().filter(|c| c.deadline().is_some_and(|d| d <= now)).map(Connection::key).collect();
        for key in expired {
            if let Some(conn) = self.conns.get_mut(&key) {
                if conn.on_timeout(now) {
                    self.counters.timeouts += 1;
                }
            }
            self.after_conn_change(key);
        }
        let late: Vec<u64> = self.pending.iter().filter(|(_, p)| p.deadline <= now).map(|(&t, _)| t).collect();
        for token in late {
            if let Some(p) = self.pending.remove(&token) {
                let _ = self.epoll.ctl(ControlOperation::Delete, p.stream.as_raw_fd(), EpollEvent::default());
                self.counters.host_refused += 1;
            }
        }
        if self.listener_backoff.is_some_and(|t| t <= now) {
            let interest = EpollEvent::new(EventSet::IN, LISTENER_TOKEN);
            if self.epoll.ctl(ControlOperation::Add, self.listener.as_raw_fd(), interest).is_ok() {
                self.listener_backoff = None;
            } else {
                self.listener_backoff = Some(now + ACCEPT_BACKOFF);
            }
        }
    }

    // ---- bookkeeping ----------------------------------------------------------------------

    fn new_token(&mut self) -> u64 {
        self.next_token += 1;
        self.next_token
    }

    fn insert_connection(&mut self, conn: Connection) {
        let key = conn.key();
        self.conn_tokens.insert(conn.token, key);
        self.conns.insert(key, conn);
        self.after_conn_change(key);
    }

    /// After anything touched a connection: forget it if it is finished, else bring its epoll
    /// registration and rx scheduling in line with its state.
    fn after_conn_change(&mut self, key: ConnKey) {
        let Some(conn) = self.conns.get_mut(&key) else { return };
        if conn.is_finished() {
            self.remove_connection(key);
            return;
        }
        Self::sync_interest(&self.epoll, conn);
        if !conn.queued && conn.has_rx_work() {
            conn.queued = true;
            self.rx_ready.push_back(key);
        }
    }

    fn sync_interest(epoll: &Epoll, conn: &mut Connection) {
        let want = conn.wanted_events();
        if want == conn.registered {
            return;
        }
        let Some(fd) = conn.stream().map(AsRawFd::as_raw_fd) else {
            conn.registered = 0;
            return;
        };
        let event = EpollEvent::new(EventSet::from_bits_truncate(want), conn.token);
        let result = match (conn.registered, want) {
            (0, _) => epoll.ctl(ControlOperation::Add, fd, event),
            (_, 0) => epoll.ctl(ControlOperation::Delete, fd, event),
            _ => epoll.ctl(ControlOperation::Modify, fd, event),
        };
        match result {
            Ok(()) => conn.registered = want,
            // A socket we cannot watch cannot be served.
            Err(_) => conn.kill(),
        }
    }

    fn deregister(epoll: &Epoll, conn: &Connection) {
        if conn.registered != 0 {
            if let Some(stream) = conn.stream() {
                let _ = epoll.ctl(ControlOperation::Delete, stream.as_raw_fd(), EpollEvent::default());
            }
        }
    }

    fn remove_connection(&mut self, key: ConnKey) {
        let Some(conn) = self.conns.remove(&key) else { return };
        Self::deregister(&self.epoll, &conn);
        self.conn_tokens.remove(&conn.token);
        if self.host_ports.get(&key.local_port) == Some(&key) {
            self.host_ports.remove(&key.local_port);
        }
        if conn.queued {
            self.rx_ready.retain(|k| *k != key);
        }
        // Dropping `conn` closes the host stream: the host process reads EOF.
    }
}

/// The epoll fd over all host sockets: readable when [`VsockMuxer::handle_host_events`] has work.
impl AsRawFd for VsockMuxer {
    fn as_raw_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }
}
