//! Routing for egress, over rtnetlink (the same encoder as the nftables rule):
//!
//! - `lo` gets the address 198.18.0.1/15 (label `lo:umbra`). On a loopback device the kernel
//!   makes the prefix route a *local* one, like 127.0.0.0/8: every fake address the DNS server
//!   hands out (198.18.0.0/15) is reachable at once, and the nat rule redirects the connection
//!   before it could reach a socket bound there.
//! - A local default route, `ip route add local 0.0.0.0/0 dev lo`: every other IPv4 address is
//!   local too. A TCP connection to an address literal (a program that never asked our DNS) is
//!   then redirected like a fake one and the host decides on the literal; UDP or ICMP to such
//!   an address is answered by the guest's own stack at once (a connected UDP socket gets
//!   ECONNREFUSED) instead of vanishing into a route that leads nowhere. Nothing leaves the
//!   guest: the only interface is `lo`.

use std::net::Ipv4Addr;

use nix::sys::socket::SockProtocol;

use super::netlink::{Builder, NetlinkError, Socket, NLM_F_ACK, NLM_F_CREATE, NLM_F_REPLACE};

// linux/rtnetlink.h
const RTM_NEWADDR: u16 = 20;
const RTM_NEWROUTE: u16 = 24;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const IFA_LABEL: u16 = 3;
const RTA_OIF: u16 = 4;
const RT_TABLE_MAIN: u8 = 254;
const RTPROT_STATIC: u8 = 4;
const RT_SCOPE_UNIVERSE: u8 = 0;
const RT_SCOPE_HOST: u8 = 254;
const RTN_LOCAL: u8 = 2;
const AF_INET: u8 = libc::AF_INET as u8;

/// `struct ifaddrmsg { u8 family, prefixlen, flags, scope; u32 index; }`
fn ifaddrmsg(prefix_len: u8, index: u32) -> [u8; 8] {
    let mut m = [0u8; 8];
    m[0] = AF_INET;
    m[1] = prefix_len;
    m[3] = RT_SCOPE_UNIVERSE;
    m[4..8].copy_from_slice(&index.to_ne_bytes());
    m
}

/// `struct rtmsg { u8 family, dst_len, src_len, tos, table, protocol, scope, type; u32 flags; }`
fn rtmsg_local(dst_len: u8) -> [u8; 12] {
    [AF_INET, dst_len, 0, 0, RT_TABLE_MAIN, RTPROT_STATIC, RT_SCOPE_HOST, RTN_LOCAL, 0, 0, 0, 0]
}

pub fn address_message(addr: Ipv4Addr, prefix_len: u8, index: u32, label: &str, seq: u32) -> Builder {
    let mut b = Builder::new(seq);
    b.begin(
        RTM_NEWADDR,
        NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
        &ifaddrmsg(prefix_len, index),
        format!("add address {addr}/{prefix_len} to {label}"),
    );
    b.attr(IFA_LOCAL, &addr.octets());
    b.attr(IFA_ADDRESS, &addr.octets());
    b.attr_str(IFA_LABEL, label);
    b.end();
    b
}

pub fn local_default_route_message(index: u32, seq: u32) -> Builder {
    let mut b = Builder::new(seq);
    b.begin(
        RTM_NEWROUTE,
        NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
        &rtmsg_local(0),
        "add route local 0.0.0.0/0 dev lo",
    );
    b.attr_u32(RTA_OIF, index);
    b.end();
    b
}

/// Gives `lo` the fake range and makes every IPv4 address local (see the module's comment).
/// Idempotent (NLM_F_REPLACE). Needs CAP_NET_ADMIN; acts on the calling thread's namespace.
pub fn setup_loopback(fake_addr: Ipv4Addr, prefix_len: u8) -> Result<(), NetlinkError> {
    let index = nix::net::if_::if_nametoindex("lo").map_err(|e| NetlinkError::Io(e.into()))?;
    let socket = Socket::open(SockProtocol::NetlinkRoute)?;
    socket.transact(&address_message(fake_addr, prefix_len, index, "lo:umbra", 1))?;
    socket.transact(&local_default_route_message(index, 2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_and_route_messages() {
        let b = address_message(Ipv4Addr::new(198, 18, 0, 1), 15, 1, "lo:umbra", 9);
        let bytes = b.bytes();
        assert_eq!(u16::from_ne_bytes(bytes[4..6].try_into().unwrap()), RTM_NEWADDR);
        assert_eq!(&bytes[16..20], &[AF_INET, 15, 0, 0]);
        assert!(bytes.windows(4).any(|w| w == [198, 18, 0, 1]));
        let b = local_default_route_message(1, 10);
        let bytes = b.bytes();
        assert_eq!(bytes.len(), 16 + 12 + 8);
        assert_eq!(bytes[16 + 7], RTN_LOCAL);
    }
}
