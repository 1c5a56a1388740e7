//! A small netlink encoder and request/acknowledgement loop, enough for the agent's few
//! configuration messages (nftables in [`super::nft`], an address and a route in
//! [`super::iface`]). No crate fits: `rustables` is GPL-3.0 and `nftnl` needs libmnl, which
//! Debian ships only as a shared library while the agent is static.
//!
//! Wire format (`man 7 netlink`, all integers in host byte order unless said otherwise):
//!
//! ```text
//! nlmsghdr:  u32 len (header included) | u16 type | u16 flags | u32 seq | u32 port id
//!            then a fixed family header (rtnetlink: ifaddrmsg / rtmsg; nfnetlink: nfgenmsg)
//!            then attributes, each 4-byte aligned:
//! nlattr:    u16 len (header included, padding not) | u16 type (NLA_F_NESTED for a nest)
//!            | payload | padding to a multiple of 4
//! ```
//!
//! Every request carries `NLM_F_ACK`, so the kernel answers each with an `NLMSG_ERROR` message
//! (error 0 is the acknowledgement). [`Socket::transact`] sends one buffer and reads until every
//! sequence number is accounted for; a non-zero error becomes a [`NetlinkError`] naming the
//! message it answered and, when the kernel gave one (`NETLINK_EXT_ACK`), its own explanation.

use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;

use nix::sys::socket::{self, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType};

pub const NLMSG_HDRLEN: usize = 16;
pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_DONE: u16 = 3;

pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_ACK: u16 = 0x4;
pub const NLM_F_REPLACE: u16 = 0x100;
pub const NLM_F_CREATE: u16 = 0x400;
pub const NLM_F_APPEND: u16 = 0x800;
/// On an NLMSG_ERROR: the echoed request was cut to its header.
const NLM_F_CAPPED: u16 = 0x100;
/// On an NLMSG_ERROR: extended-ack attributes follow the echoed request.
const NLM_F_ACK_TLVS: u16 = 0x200;
/// Extended-ack attribute: the kernel's error message (a NUL-terminated string).
const NLMSGERR_ATTR_MSG: u16 = 1;

pub const NLA_F_NESTED: u16 = 0x8000;

/// How long [`Socket::transact`] waits for each answer of the kernel.
const KERNEL_ANSWER_TIMEOUT: Duration = Duration::from_secs(2);
const NLA_HDRLEN: usize = 4;

/// `SOL_NETLINK` socket options (linux/netlink.h).
const SOL_NETLINK: libc::c_int = 270;
const NETLINK_CAP_ACK: libc::c_int = 10;
const NETLINK_EXT_ACK: libc::c_int = 11;

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// One or more netlink messages built into one buffer (a batch is several).
#[derive(Default)]
pub struct Builder {
    buf: Vec<u8>,
    /// (sequence number, what the message does) for each message that expects an ack.
    acked: Vec<(u32, String)>,
    /// Start of the message being built.
    current: Option<usize>,
    next_seq: u32,
}

impl Builder {
    pub fn new(first_seq: u32) -> Self {
        Self { next_seq: first_seq, ..Default::default() }
    }

    /// Starts a message; `family_header` is its fixed header (nfgenmsg, ifaddrmsg, rtmsg).
    /// `what` names it in errors. Returns its sequence number.
    pub fn begin(&mut self, ty: u16, flags: u16, family_header: &[u8], what: impl Into<String>) -> u32 {
        assert!(self.current.is_none(), "netlink message not ended");
        let seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1);
        let start = self.buf.len();
        self.buf.extend_from_slice(&0u32.to_ne_bytes()); // length, set by end()
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(&(flags | NLM_F_REQUEST).to_ne_bytes());
        self.buf.extend_from_slice(&seq.to_ne_bytes());
        self.buf.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel fills in ours
        self.buf.extend_from_slice(family_header);
        self.pad();
        if flags & NLM_F_ACK != 0 {
            self.acked.push((seq, what.into()));
        }
        self.current = Some(start);
        seq
    }

    /// Ends the message started by [`Self::begin`], writing its length.
    pub fn end(&mut self) {
        let start = self.current.take().expect("netlink message begun");
        let len = (self.buf.len() - start) as u32;
        self.buf[start..start + 4].copy_from_slice(&len.to_ne_bytes());
    }

    fn pad(&mut self) {
        self.buf.resize(align4(self.buf.len()), 0);
    }

    /// An attribute with a raw payload.
    pub fn attr(&mut self, ty: u16, payload: &[u8]) -> &mut Self {
        let len = u16::try_from(NLA_HDRLEN + payload.len()).expect("netlink attribute fits u16");
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(payload);
        self.pad();
        self
    }

    /// A NUL-terminated string attribute (NLA_STRING / NLA_NUL_STRING).
    pub fn attr_str(&mut self, ty: u16, s: &str) -> &mut Self {
        let mut v = Vec::with_capacity(s.len() + 1);
        v.extend_from_slice(s.as_bytes());
        v.push(0);
        self.attr(ty, &v)
    }

    /// A u32 in network byte order (nfnetlink's NLA_BE32).
    pub fn attr_be32(&mut self, ty: u16, v: u32) -> &mut Self {
        self.attr(ty, &v.to_be_bytes())
    }

    /// A u32 in host byte order (rtnetlink's NLA_U32).
    pub fn attr_u32(&mut self, ty: u16, v: u32) -> &mut Self {
        self.attr(ty, &v.to_ne_bytes())
    }

    /// A nested attribute: its members are whatever `fill` adds.
    pub fn nest(&mut self, ty: u16, fill: impl FnOnce(&mut Self)) -> &mut Self {
        let start = self.buf.len();
        self.buf.extend_from_slice(&[0; NLA_HDRLEN]);
        fill(self);
        let len = u16::try_from(self.buf.len() - start).expect("netlink nest fits u16");
        self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
        self.buf[start + 2..start + 4].copy_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
        self
    }

    pub fn bytes(&self) -> &[u8] {
        assert!(self.current.is_none(), "netlink message not ended");
        &self.buf
    }

    pub fn acked(&self) -> &[(u32, String)] {
        &self.acked
    }
}

/// A request the kernel refused.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("{what}: {errno}{}", .message.as_deref().map(|m| format!(" ({m})")).unwrap_or_default())]
    Refused { what: String, errno: nix::errno::Errno, message: Option<String> },
    #[error("netlink: {0}")]
    Io(#[from] std::io::Error),
    #[error("netlink: {0}")]
    Protocol(String),
}

/// A netlink socket of one protocol (NETLINK_ROUTE, NETLINK_NETFILTER), blocking, with a
/// receive timeout so that a kernel that never answers is an error rather than a hang.
pub struct Socket {
    fd: OwnedFd,
}

impl Socket {
    pub fn open(protocol: SockProtocol) -> Result<Self, NetlinkError> {
        let fd = socket::socket(AddressFamily::Netlink, SockType::Raw, SockFlag::SOCK_CLOEXEC, protocol)
            .map_err(|e| NetlinkError::Io(e.into()))?;
        socket::bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0)).map_err(|e| NetlinkError::Io(e.into()))?;
        let timeout = nix::sys::time::TimeVal::from(libc::timeval {
            tv_sec: KERNEL_ANSWER_TIMEOUT.as_secs() as libc::time_t,
            tv_usec: 0,
        });
        socket::setsockopt(&fd, socket::sockopt::ReceiveTimeout, &timeout).map_err(|e| NetlinkError::Io(e.into()))?;
        // Best effort (older kernels lack them): errors carry the kernel's explanation, and
        // acknowledgements do not echo our whole request back.
        for opt in [NETLINK_EXT_ACK, NETLINK_CAP_ACK] {
            let one: libc::c_int = 1;
            // SAFETY: setsockopt reads `size_of::<c_int>()` bytes from a pointer to a live c_int.
            unsafe {
                libc::setsockopt(
                    fd.as_raw_fd(),
                    SOL_NETLINK,
                    opt,
                    (&one as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                );
            }
        }
        Ok(Self { fd })
    }

    /// Sends the messages of `b` in one datagram, then reads acknowledgements until every
    /// message that asked for one is answered. The first refusal is returned (the kernel may
    /// answer several messages of a failed batch; all are read before returning).
    pub fn transact(&self, b: &Builder) -> Result<(), NetlinkError> {
        let kernel = NetlinkAddr::new(0, 0);
        let sent = socket::sendto(self.fd.as_raw_fd(), b.bytes(), &kernel, MsgFlags::empty())
            .map_err(|e| NetlinkError::Io(e.into()))?;
        if sent != b.bytes().len() {
            return Err(NetlinkError::Protocol(format!("sent {sent} of {} bytes", b.bytes().len())));
        }
        let mut pending: Vec<(u32, String)> = b.acked().to_vec();
        let mut first_error: Option<NetlinkError> = None;
        let mut buf = vec![0u8; 64 * 1024];
        while !pending.is_empty() {
            let n = match socket::recv(self.fd.as_raw_fd(), &mut buf, MsgFlags::empty()) {
                Ok(n) => n,
                // After a refusal the rest of a failed batch may go unanswered: the refusal is
                // the answer.
                Err(nix::errno::Errno::EAGAIN) if first_error.is_some() => break,
                Err(nix::errno::Errno::EAGAIN) => {
                    let waiting: Vec<&str> = pending.iter().map(|(_, w)| w.as_str()).collect();
                    return Err(NetlinkError::Protocol(format!(
                        "no answer from the kernel within {KERNEL_ANSWER_TIMEOUT:?} for: {}",
                        waiting.join(", ")
                    )));
                }
                Err(e) => return Err(NetlinkError::Io(e.into())),
            };
            for msg in Messages::new(&buf[..n]) {
                let (ty, flags, seq, payload) = msg?;
                if ty == NLMSG_DONE {
                    continue;
                }
                if ty != NLMSG_ERROR {
                    // Not an answer we asked for (a notification): ignore it.
                    continue;
                }
                let Some(pos) = pending.iter().position(|(s, _)| *s == seq) else { continue };
                let (_, what) = pending.swap_remove(pos);
                let errno = parse_error(payload)?;
                if errno != 0 && first_error.is_none() {
                    first_error = Some(NetlinkError::Refused {
                        what,
                        errno: nix::errno::Errno::from_raw(-errno),
                        message: ext_ack_message(flags, payload),
                    });
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// Iterates over the messages of one received datagram: (type, flags, seq, payload).
struct Messages<'a> {
    rest: &'a [u8],
}

impl<'a> Messages<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self { rest: buf }
    }
}

impl<'a> Iterator for Messages<'a> {
    type Item = Result<(u16, u16, u32, &'a [u8]), NetlinkError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        if self.rest.len() < NLMSG_HDRLEN {
            self.rest = &[];
            return Some(Err(NetlinkError::Protocol("truncated message header".into())));
        }
        let len = u32::from_ne_bytes(self.rest[0..4].try_into().unwrap()) as usize;
        if len < NLMSG_HDRLEN || len > self.rest.len() {
            self.rest = &[];
            return Some(Err(NetlinkError::Protocol(format!("bad message length {len}"))));
        }
        let ty = u16::from_ne_bytes(self.rest[4..6].try_into().unwrap());
        let flags = u16::from_ne_bytes(self.rest[6..8].try_into().unwrap());
        let seq = u32::from_ne_bytes(self.rest[8..12].try_into().unwrap());
        let payload = &self.rest[NLMSG_HDRLEN..len];
        self.rest = &self.rest[align4(len).min(self.rest.len())..];
        Some(Ok((ty, flags, seq, payload)))
    }
}

/// The (negative) errno of an NLMSG_ERROR payload: `struct nlmsgerr { int error; nlmsghdr msg; }`.
fn parse_error(payload: &[u8]) -> Result<i32, NetlinkError> {
    let b: [u8; 4] = payload
        .get(0..4)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| NetlinkError::Protocol("truncated error message".into()))?;
    Ok(i32::from_ne_bytes(b))
}

/// The kernel's explanation from an extended ack, if any: after `struct nlmsgerr` (the error,
/// then the request echoed, whole or capped to its header) come attributes.
fn ext_ack_message(flags: u16, payload: &[u8]) -> Option<String> {
    if flags & NLM_F_ACK_TLVS == 0 {
        return None;
    }
    let echoed = payload.get(4..4 + NLMSG_HDRLEN)?;
    let echoed_len = u32::from_ne_bytes(echoed[0..4].try_into().ok()?) as usize;
    let skip = 4 + if flags & NLM_F_CAPPED != 0 { NLMSG_HDRLEN } else { align4(echoed_len) };
    let mut attrs = payload.get(skip..)?;
    while attrs.len() >= NLA_HDRLEN {
        let len = u16::from_ne_bytes(attrs[0..2].try_into().ok()?) as usize;
        let ty = u16::from_ne_bytes(attrs[2..4].try_into().ok()?) & !NLA_F_NESTED;
        if len < NLA_HDRLEN || len > attrs.len() {
            return None;
        }
        if ty == NLMSGERR_ATTR_MSG {
            let text = &attrs[NLA_HDRLEN..len];
            let text = text.split(|&b| b == 0).next().unwrap_or(text);
            return Some(String::from_utf8_lossy(text).into_owned());
        }
        attrs = attrs.get(align4(len)..)?;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_and_attributes_are_length_prefixed_and_aligned() {
        let mut b = Builder::new(7);
        let seq = b.begin(0x0a00, NLM_F_ACK | NLM_F_CREATE, &[2, 0, 0, 10], "first");
        b.attr_str(1, "umbra");
        b.nest(4, |b| {
            b.attr_be32(1, 3);
            b.attr(2, &[0xab]);
        });
        b.end();
        assert_eq!(seq, 7);
        let bytes = b.bytes();
        // header (16) + nfgenmsg (4) + "umbra\0" attr (4+6 → 12) + nest (4 + 8 + 8 = 20)
        assert_eq!(bytes.len(), 16 + 4 + 12 + 20);
        assert_eq!(u32::from_ne_bytes(bytes[0..4].try_into().unwrap()) as usize, bytes.len());
        assert_eq!(u16::from_ne_bytes(bytes[4..6].try_into().unwrap()), 0x0a00);
        assert_eq!(u16::from_ne_bytes(bytes[6..8].try_into().unwrap()), NLM_F_ACK | NLM_F_CREATE | NLM_F_REQUEST);
        assert_eq!(u32::from_ne_bytes(bytes[8..12].try_into().unwrap()), 7);
        // string attribute: len 10 (header + "umbra\0"), padded to 12
        assert_eq!(&bytes[20..22], &10u16.to_ne_bytes());
        assert_eq!(&bytes[24..30], b"umbra\0");
        assert_eq!(&bytes[30..32], &[0, 0]);
        // nest: len 20, type 4 | NESTED; first member be32 3
        assert_eq!(&bytes[32..34], &20u16.to_ne_bytes());
        assert_eq!(&bytes[34..36], &(4 | NLA_F_NESTED).to_ne_bytes());
        assert_eq!(&bytes[40..44], &[0, 0, 0, 3]);
        // one-byte attribute: len 5, padded to 8
        assert_eq!(&bytes[44..46], &5u16.to_ne_bytes());
        assert_eq!(bytes[48], 0xab);
        assert_eq!(b.acked(), &[(7, "first".to_string())]);
    }

    #[test]
    fn errors_carry_the_kernels_message() {
        // nlmsgerr: error -17, echoed header (capped), then NLMSGERR_ATTR_MSG "exists"
        let mut payload = Vec::new();
        payload.extend_from_slice(&(-17i32).to_ne_bytes());
        payload.extend_from_slice(&(NLMSG_HDRLEN as u32 + 8).to_ne_bytes());
        payload.extend_from_slice(&[0; NLMSG_HDRLEN - 4]);
        payload.extend_from_slice(&11u16.to_ne_bytes());
        payload.extend_from_slice(&NLMSGERR_ATTR_MSG.to_ne_bytes());
        payload.extend_from_slice(b"exists\0\0");
        assert_eq!(parse_error(&payload).unwrap(), -17);
        assert_eq!(ext_ack_message(NLM_F_ACK_TLVS | NLM_F_CAPPED, &payload).as_deref(), Some("exists"));
        assert_eq!(ext_ack_message(0, &payload), None);
        // Garbage never panics.
        for n in 0..payload.len() {
            let _ = ext_ack_message(NLM_F_ACK_TLVS | NLM_F_CAPPED, &payload[..n]);
            let _ = ext_ack_message(NLM_F_ACK_TLVS, &payload[..n]);
        }
        let mut datagram = vec![0u8; 20];
        datagram[0..4].copy_from_slice(&40u32.to_ne_bytes());
        assert!(Messages::new(&datagram).next().unwrap().is_err(), "length beyond the datagram");
    }
}
