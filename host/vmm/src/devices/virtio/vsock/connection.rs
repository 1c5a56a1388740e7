//! One vsock stream between a guest port and a host Unix stream: the connection state machine
//! (virtio 1.2 §5.10.6.4–5.10.6.6) and its two data paths.
//!
//! The two directions are deliberately asymmetric (as in Firecracker):
//! - host → guest bytes are never buffered here. They are read from the Unix stream only when a
//!   guest rx buffer is at hand, and only as many as the guest's advertised credit allows.
//! - guest → host bytes are written straight to the non-blocking Unix stream; what the socket does
//!   not take waits in `tx_buf`, which flow control bounds by [`BUF_ALLOC`], the credit we
//!   advertise. A guest that sends past that credit gets the connection reset, so a slow host
//!   reader costs at most `BUF_ALLOC` bytes and never stalls the device.
//!
//! Nothing in here blocks or touches epoll: the muxer asks [`Connection::wanted_events`] after
//! every change and keeps the registration in step.

use std::io::{self, Read};
use std::net::Shutdown;
use std::num::Wrapping;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use super::packet::{op, shutdown, VsockPacketHeader};
use super::unix_backend::{peer_closed_fully, send_nosignal};

/// Receive buffer we advertise per connection (`buf_alloc`): the most guest bytes we hold for a
/// host reader that is not keeping up.
pub const BUF_ALLOC: u32 = 256 * 1024;
/// Once this many forwarded bytes have not been reported to the guest, a credit update is sent.
const CREDIT_UPDATE_THRESHOLD: u32 = BUF_ALLOC / 2;
/// A host-initiated connection whose REQUEST the guest has not answered by then is reset.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// A shutdown the guest does not complete (or host-bound data not flushed) by then ends in RST.
pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(2);

/// epoll interest bits, as `EventSet` raw values.
pub const EV_IN: u32 = libc::EPOLLIN as u32;
pub const EV_OUT: u32 = libc::EPOLLOUT as u32;
pub const EV_RDHUP: u32 = libc::EPOLLRDHUP as u32;
pub const EV_HUP: u32 = libc::EPOLLHUP as u32;
pub const EV_ERR: u32 = libc::EPOLLERR as u32;

/// A connection's identity: (host port, guest port). The CIDs are fixed per device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnKey {
    pub local_port: u32,
    pub peer_port: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Host-initiated: the REQUEST is queued or sent; the guest has not answered.
    LocalInit,
    /// Data flows, in each direction until that direction is shut down.
    Established,
    /// The host closed its stream entirely; SHUTDOWN(both) is owed or sent to the guest, whose
    /// RST we await.
    LocalClosed,
    /// Over. An RST is owed to the guest; once it is delivered the muxer forgets the connection.
    Dead,
}

/// Control packets owed to the guest.
mod pending {
    pub const REQUEST: u8 = 1;
    pub const RESPONSE: u8 = 1 << 1;
    pub const RST: u8 = 1 << 2;
    pub const SHUTDOWN: u8 = 1 << 3;
    pub const CREDIT_UPDATE: u8 = 1 << 4;
}

#[derive(Debug)]
pub struct Connection {
    key: ConnKey,
    guest_cid: u64,
    state: State,
    /// `None` once the host side is closed; dropping it also removes it from epoll.
    stream: Option<UnixStream>,
    pending: u8,
    /// Flags of the SHUTDOWN owed to the guest.
    shutdown_flags: u32,
    /// epoll reported the stream readable (or hung up) and we have not drained it yet.
    readable: bool,
    /// The host will send no more (we read EOF).
    host_eof: bool,
    /// We shut down the stream's write side (the guest sent SHUTDOWN(SEND) and we flushed).
    host_write_shut: bool,
    /// SHUTDOWN flags the guest has sent.
    peer_shutdown: u32,
    /// Guest bytes the host socket has not taken yet; at most BUF_ALLOC.
    tx_buf: Vec<u8>,
    /// Bytes forwarded to the host stream (our `fwd_cnt`).
    fwd_cnt: Wrapping<u32>,
    /// `fwd_cnt` as last told to the guest.
    fwd_cnt_sent: Wrapping<u32>,
    peer_buf_alloc: u32,
    peer_fwd_cnt: Wrapping<u32>,
    /// Bytes sent to the guest.
    rx_cnt: Wrapping<u32>,
    /// A CREDIT_REQUEST went out and the guest has not granted credit since.
    credit_requested: bool,
    deadline: Option<Instant>,
    /// In the muxer's rx schedule (maintained by the muxer).
    pub queued: bool,
    /// The epoll token and the events currently registered (0: not registered).
    pub token: u64,
    pub registered: u32,
}

/// What a guest packet did to the connection, beyond its own state.
#[derive(Debug, PartialEq, Eq)]
pub enum GuestOutcome {
    Ok,
    /// The guest sent more than the credit we advertised.
    CreditViolation,
    /// A packet that makes no sense in this state; the connection was reset.
    ProtocolViolation,
}

impl Connection {
    fn new(key: ConnKey, guest_cid: u64, stream: UnixStream, state: State, pending: u8, token: u64) -> Self {
        Connection {
            key,
            guest_cid,
            state,
            stream: Some(stream),
            pending,
            shutdown_flags: 0,
            readable: false,
            host_eof: false,
            host_write_shut: false,
            peer_shutdown: 0,
            tx_buf: Vec::new(),
            fwd_cnt: Wrapping(0),
            fwd_cnt_sent: Wrapping(0),
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            rx_cnt: Wrapping(0),
            credit_requested: false,
            deadline: None,
            queued: false,
            token,
            registered: 0,
        }
    }

    /// A host process connected and asked for a guest port: a REQUEST is owed to the guest.
    pub fn new_local_init(key: ConnKey, guest_cid: u64, stream: UnixStream, token: u64, now: Instant) -> Self {
        let mut conn = Self::new(key, guest_cid, stream, State::LocalInit, pending::REQUEST, token);
        conn.deadline = Some(now + REQUEST_TIMEOUT);
        conn
    }

    /// The guest connected and we reached the host service: a RESPONSE is owed to the guest.
    pub fn new_peer_init(
        key: ConnKey,
        guest_cid: u64,
        stream: UnixStream,
        token: u64,
        hdr: &VsockPacketHeader,
    ) -> Self {
        let mut conn = Self::new(key, guest_cid, stream, State::Established, pending::RESPONSE, token);
        conn.peer_buf_alloc = hdr.buf_alloc();
        conn.peer_fwd_cnt = Wrapping(hdr.fwd_cnt());
        conn
    }

    pub fn key(&self) -> ConnKey {
        self.key
    }

    pub fn state(&self) -> State {
        self.state
    }

    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    pub fn stream(&self) -> Option<&UnixStream> {
        self.stream.as_ref()
    }

    /// Host-bound bytes waiting for the host reader.
    pub fn buffered(&self) -> usize {
        self.tx_buf.len()
    }

    /// Ends the connection: the host stream is closed at once and an RST is owed to the guest.
    pub fn kill(&mut self) {
        self.state = State::Dead;
        self.pending = pending::RST;
        self.deadline = None;
        self.readable = false;
        self.tx_buf = Vec::new();
        self.drop_stream();
    }

    /// Closing our only descriptor for the socket also removes it from epoll (epoll(7)), so no
    /// EPOLL_CTL_DEL follows a close: by then the number may name another file.
    fn drop_stream(&mut self) {
        self.stream = None;
        self.registered = 0;
    }

    /// Whether the connection is finished and can be forgotten (its RST, if any, delivered).
    pub fn is_finished(&self) -> bool {
        self.state == State::Dead && self.pending & pending::RST == 0
    }

    /// Bytes the guest may still send us: BUF_ALLOC less what we hold.
    fn our_free_space(&self) -> usize {
        (BUF_ALLOC as usize).saturating_sub(self.tx_buf.len())
    }

    /// Bytes we may still send the guest. A guest reporting a forwarded count beyond what we sent
    /// gets no credit rather than a wrapped-around huge one.
    pub fn peer_credit(&self) -> u32 {
        let in_flight = (self.rx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    fn can_read_host(&self) -> bool {
        self.state == State::Established
            && self.stream.is_some()
            && !self.host_eof
            && self.peer_shutdown & shutdown::RCV == 0
    }

    /// The epoll events the connection needs now.
    pub fn wanted_events(&self) -> u32 {
        if self.stream.is_none() {
            return 0;
        }
        let mut events = 0;
        if !self.tx_buf.is_empty() {
            events |= EV_OUT;
        }
        // Once `readable` is set the bytes wait for a guest rx buffer (or credit); watching IN
        // until they are drained would only spin the level-triggered loop.
        if self.can_read_host() && !self.readable {
            events |= EV_IN | EV_RDHUP;
        }
        events
    }

    /// Whether the connection has a packet for the guest.
    pub fn has_rx_work(&self) -> bool {
        if self.state == State::Dead {
            return self.pending & pending::RST != 0;
        }
        self.pending != 0
            || (self.can_read_host() && self.readable && (self.peer_credit() > 0 || !self.credit_requested))
    }

    /// epoll reported `events` on the host stream.
    pub fn on_host_event(&mut self, events: u32) {
        if self.stream.is_none() {
            return;
        }
        if events & (EV_IN | EV_RDHUP | EV_HUP | EV_ERR) != 0 && self.can_read_host() {
            self.readable = true;
        }
        if events & (EV_OUT | EV_HUP | EV_ERR) != 0 && !self.tx_buf.is_empty() {
            self.flush();
        }
    }

    /// Writes buffered guest bytes to the host stream.
    fn flush(&mut self) {
        let Some(stream) = self.stream.as_ref() else { return };
        let mut written = 0;
        while written < self.tx_buf.len() {
            match send_nosignal(stream, &self.tx_buf[written..]) {
                Ok(0) => break,
                Ok(n) => written += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    self.kill();
                    return;
                }
            }
        }
        self.tx_buf.drain(..written);
        self.fwd_cnt += Wrapping(written as u32);
        if self.tx_buf.is_empty() && self.tx_buf.capacity() > 64 * 1024 {
            // A burst is over; do not keep up to BUF_ALLOC per idle connection.
            self.tx_buf = Vec::new();
        }
        self.after_forward();
    }

    /// After bytes left `tx_buf`: finish a pending guest shutdown, or tell the guest it may send
    /// more.
    fn after_forward(&mut self) {
        if self.tx_buf.is_empty() {
            if self.peer_shutdown == shutdown::BOTH {
                // The guest closed and everything it sent reached the host: done.
                self.kill();
                return;
            }
            if self.peer_shutdown & shutdown::SEND != 0 {
                self.shut_host_write();
            }
        }
        if (self.fwd_cnt - self.fwd_cnt_sent).0 >= CREDIT_UPDATE_THRESHOLD {
            self.pending |= pending::CREDIT_UPDATE;
        }
    }

    fn shut_host_write(&mut self) {
        if !self.host_write_shut {
            self.host_write_shut = true;
            if let Some(s) = &self.stream {
                let _ = s.shutdown(Shutdown::Write);
            }
        }
    }

    /// A packet from the guest for this connection (never OP_RST: the muxer handles those).
    /// `data` is the packet's payload, already copied out of guest memory.
    pub fn on_guest_packet(&mut self, hdr: &VsockPacketHeader, data: &[u8], now: Instant) -> GuestOutcome {
        self.peer_buf_alloc = hdr.buf_alloc();
        self.peer_fwd_cnt = Wrapping(hdr.fwd_cnt());
        if self.peer_credit() > 0 {
            self.credit_requested = false;
        }
        match (self.state, hdr.op()) {
            (State::Dead, _) => GuestOutcome::Ok,
            (State::LocalInit, op::RESPONSE) => {
                self.state = State::Established;
                self.deadline = None;
                self.send_connect_ok();
                GuestOutcome::Ok
            }
            (State::Established, op::RW) => self.on_guest_data(data),
            (State::Established, op::SHUTDOWN) => {
                self.on_guest_shutdown(hdr.flags(), now);
                GuestOutcome::Ok
            }
            (State::Established, op::CREDIT_UPDATE) => GuestOutcome::Ok,
            (State::Established, op::CREDIT_REQUEST) => {
                self.pending |= pending::CREDIT_UPDATE;
                GuestOutcome::Ok
            }
            // The host is gone: data and credit still in flight from the guest are moot, and a
            // guest SHUTDOWN in answer to ours is as good as its RST.
            (State::LocalClosed, op::RW | op::CREDIT_UPDATE | op::CREDIT_REQUEST) => GuestOutcome::Ok,
            (State::LocalClosed, op::SHUTDOWN) => {
                self.kill();
                GuestOutcome::Ok
            }
            _ => {
                self.kill();
                GuestOutcome::ProtocolViolation
            }
        }
    }

    /// Tells the host process its CONNECT succeeded, in the format Firecracker and
    /// vhost-device-vsock use. These bytes are outside flow control; they go to a fresh, empty
    /// socket, so a short write means the socket is broken.
    fn send_connect_ok(&mut self) {
        let line = format!("OK {}\n", self.key.local_port);
        let ok = self.stream.as_ref().is_some_and(|s| send_nosignal(s, line.as_bytes()).is_ok_and(|n| n == line.len()));
        if !ok {
            self.kill();
        }
    }

    fn on_guest_data(&mut self, data: &[u8]) -> GuestOutcome {
        if self.peer_shutdown & shutdown::SEND != 0 || self.host_write_shut {
            self.kill();
            return GuestOutcome::ProtocolViolation;
        }
        if data.is_empty() {
            return GuestOutcome::Ok;
        }
        if data.len() > self.our_free_space() {
            self.kill();
            return GuestOutcome::CreditViolation;
        }
        let mut written = 0;
        if self.tx_buf.is_empty() {
            let Some(stream) = self.stream.as_ref() else { return GuestOutcome::Ok };
            loop {
                match send_nosignal(stream, &data[written..]) {
                    Ok(n) => {
                        written += n;
                        if n == 0 || written == data.len() {
                            break;
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(_) => {
                        // The host reader is gone; nothing can carry on.
                        self.kill();
                        return GuestOutcome::Ok;
                    }
                }
            }
        }
        self.tx_buf.extend_from_slice(&data[written..]);
        self.fwd_cnt += Wrapping(written as u32);
        self.after_forward();
        GuestOutcome::Ok
    }

    fn on_guest_shutdown(&mut self, flags: u32, now: Instant) {
        let new = flags & shutdown::BOTH & !self.peer_shutdown;
        self.peer_shutdown |= flags & shutdown::BOTH;
        if new & shutdown::RCV != 0 {
            // The guest reads no more: stop reading the host, whose writes now fail with EPIPE.
            self.readable = false;
            if let Some(s) = &self.stream {
                let _ = s.shutdown(Shutdown::Read);
            }
        }
        if self.peer_shutdown == shutdown::BOTH {
            if self.tx_buf.is_empty() {
                self.kill();
            } else if self.deadline.is_none() {
                // Flush what the host has not read yet, but not forever.
                self.deadline = Some(now + SHUTDOWN_TIMEOUT);
            }
        } else if new & shutdown::SEND != 0 && self.tx_buf.is_empty() {
            self.shut_host_write();
        }
    }

    /// The host stream reached end of file.
    fn on_host_eof(&mut self, now: Instant) {
        self.host_eof = true;
        self.readable = false;
        if self.stream.as_ref().is_some_and(peer_closed_fully) {
            // Closed, not half-closed: the host can neither send nor receive, so what we hold
            // for it is moot. The guest is told and must answer with RST.
            self.state = State::LocalClosed;
            self.shutdown_flags = shutdown::BOTH;
            self.deadline = Some(now + SHUTDOWN_TIMEOUT);
            self.tx_buf = Vec::new();
            self.drop_stream();
        } else {
            self.shutdown_flags = shutdown::SEND;
        }
        self.pending |= pending::SHUTDOWN;
    }

    /// The deadline passed: whatever the connection was waiting for, it gets an RST.
    pub fn on_timeout(&mut self, now: Instant) -> bool {
        match self.deadline {
            Some(d) if d <= now && self.state != State::Dead => {
                self.kill();
                true
            }
            _ => false,
        }
    }

    /// Builds the next packet for the guest. `room` is the data capacity of the rx buffer at
    /// hand and `scratch` at least that large; data (for OP_RW) is left in `scratch[..len]`.
    pub fn next_rx_packet(
        &mut self,
        room: usize,
        scratch: &mut [u8],
        now: Instant,
    ) -> Option<(VsockPacketHeader, usize)> {
        let (op, len) = self.next_rx_op(room, scratch, now)?;
        let mut hdr = VsockPacketHeader::host_to_guest(self.guest_cid, self.key.local_port, self.key.peer_port, op);
        if op == op::SHUTDOWN {
            hdr.set_flags(self.shutdown_flags);
        }
        hdr.set_buf_alloc(BUF_ALLOC).set_fwd_cnt(self.fwd_cnt.0);
        // Every packet carries our credit, so no separate update is owed any more.
        self.fwd_cnt_sent = self.fwd_cnt;
        self.pending &= !pending::CREDIT_UPDATE;
        Some((hdr, len))
    }

    fn next_rx_op(&mut self, room: usize, scratch: &mut [u8], now: Instant) -> Option<(u16, usize)> {
        if self.state == State::Dead {
            return self.take(pending::RST).then_some((op::RST, 0));
        }
        if self.take(pending::REQUEST) {
            return Some((op::REQUEST, 0));
        }
        if self.take(pending::RESPONSE) {
            return Some((op::RESPONSE, 0));
        }
        if self.can_read_host() && self.readable && room > 0 {
            let credit = self.peer_credit() as usize;
            if credit == 0 {
                if !self.credit_requested {
                    self.credit_requested = true;
                    return Some((op::CREDIT_REQUEST, 0));
                }
            } else if let Some(stream) = self.stream.as_mut() {
                let want = room.min(credit).min(scratch.len());
                match stream.read(&mut scratch[..want]) {
                    Ok(0) => self.on_host_eof(now),
                    Ok(n) => {
                        self.rx_cnt += Wrapping(n as u32);
                        return Some((op::RW, n));
                    }
                    Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => {
                        self.readable = false;
                    }
                    Err(_) => {
                        self.kill();
                        return self.take(pending::RST).then_some((op::RST, 0));
                    }
                }
            }
        }
        if self.take(pending::SHUTDOWN) {
            return Some((op::SHUTDOWN, 0));
        }
        if self.take(pending::CREDIT_UPDATE) {
            return Some((op::CREDIT_UPDATE, 0));
        }
        None
    }

    fn take(&mut self, bit: u8) -> bool {
        let had = self.pending & bit != 0;
        self.pending &= !bit;
        had
    }
}
