//! The guest's one nftables rule, written as netlink messages (NETLINK_NETFILTER, subsystem
//! NFNL_SUBSYS_NFTABLES), the equivalent of
//!
//! ```text
//! table ip umbra {
//!     chain out {
//!         type nat hook output priority -100; policy accept;
//!         meta l4proto tcp ip daddr != 127.0.0.0/8 redirect to :PORT
//!     }
//! }
//! ```
//!
//! Every TCP connection a guest process opens to a non-loopback IPv4 address is redirected to
//! the agent's transparent listener on 127.0.0.1:PORT, which reads where it was going with
//! `getsockopt(SO_ORIGINAL_DST)`.
//!
//! One atomic batch (NFNL_MSG_BATCH_BEGIN … NFNL_MSG_BATCH_END) makes it idempotent, as
//! `nft -f` does with "table; delete table; table { … }": create the table if missing, delete it
//! (with whatever an earlier run left in it), create it again with the chain and the rule. Each
//! message inside the batch asks for an acknowledgement; the kernel applies all of them or none.
//!
//! Messages: `nlmsghdr` (type `NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_*`), then `nfgenmsg`
//! (`u8 family` = NFPROTO_IPV4, `u8 version` = 0, `be16 res_id` = 0), then attributes. nf_tables
//! integers are big-endian (NLA_BE32). The rule's expressions, in the kernel's register machine
//! (what `nft --debug=netlink` prints for the rule above):
//!
//! ```text
//! [ meta load l4proto => reg 1 ]
//! [ cmp eq reg 1 0x00000006 ]
//! [ payload load 4b @ network header + 16 => reg 1 ]
//! [ bitwise reg 1 = ( reg 1 & 0x000000ff ) ^ 0x00000000 ]
//! [ cmp neq reg 1 0x0000007f ]
//! [ immediate reg 1 <port, big-endian, 2 bytes> ]
//! [ redir proto_min reg 1 ]
//! ```

use nix::sys::socket::SockProtocol;

use super::netlink::{Builder, NetlinkError, Socket, NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE};

pub const TABLE: &str = "umbra";
pub const CHAIN: &str = "out";

// linux/netfilter/nfnetlink.h
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10; // NLMSG_MIN_TYPE
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFNETLINK_V0: u8 = 0;
const NFPROTO_UNSPEC: u8 = 0;
const NFPROTO_IPV4: u8 = 2;

// enum nf_tables_msg_types
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_DELTABLE: u16 = 2;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_NEWRULE: u16 = 6;

// enum nft_table_attributes / nft_chain_attributes / nft_hook_attributes
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_POLICY: u16 = 5;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
const NF_INET_LOCAL_OUT: u32 = 3;
/// NF_IP_PRI_NAT_DST: where destination NAT runs.
const NF_IP_PRI_NAT_DST: i32 = -100;
const NF_ACCEPT: u32 = 1;

// enum nft_rule_attributes, nft_list_attributes, nft_expr_attributes, nft_data_attributes
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_DATA_VALUE: u16 = 1;

/// The first 16-byte register (nft's "reg 1"; NFT_REG_VERDICT is 0).
const NFT_REG_1: u32 = 1;

// expressions' attributes
const NFTA_META_DREG: u16 = 1;
const NFTA_META_KEY: u16 = 2;
const NFT_META_L4PROTO: u32 = 16;
const NFTA_CMP_SREG: u16 = 1;
const NFTA_CMP_OP: u16 = 2;
const NFTA_CMP_DATA: u16 = 3;
const NFT_CMP_EQ: u32 = 0;
const NFT_CMP_NEQ: u32 = 1;
const NFTA_PAYLOAD_DREG: u16 = 1;
const NFTA_PAYLOAD_BASE: u16 = 2;
const NFTA_PAYLOAD_OFFSET: u16 = 3;
const NFTA_PAYLOAD_LEN: u16 = 4;
const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
/// Offset of the destination address in the IPv4 header.
const IPV4_DADDR_OFFSET: u32 = 16;
const NFTA_BITWISE_SREG: u16 = 1;
const NFTA_BITWISE_DREG: u16 = 2;
const NFTA_BITWISE_LEN: u16 = 3;
const NFTA_BITWISE_MASK: u16 = 4;
const NFTA_BITWISE_XOR: u16 = 5;
const NFTA_IMMEDIATE_DREG: u16 = 1;
const NFTA_IMMEDIATE_DATA: u16 = 2;
const NFTA_REDIR_REG_PROTO_MIN: u16 = 1;

const IPPROTO_TCP: u8 = 6;

fn msg_type(msg: u16) -> u16 {
    (NFNL_SUBSYS_NFTABLES << 8) | msg
}

fn nfgenmsg(family: u8, res_id: u16) -> [u8; 4] {
    let id = res_id.to_be_bytes();
    [family, NFNETLINK_V0, id[0], id[1]]
}

/// One expression of a rule: `NFTA_LIST_ELEM { NFTA_EXPR_NAME, NFTA_EXPR_DATA { … } }`.
fn expr(b: &mut Builder, name: &str, data: impl FnOnce(&mut Builder)) {
    b.nest(NFTA_LIST_ELEM, |b| {
        b.attr_str(NFTA_EXPR_NAME, name);
        b.nest(NFTA_EXPR_DATA, data);
    });
}

/// `NFTA_DATA_VALUE` inside a nest of type `ty` (how cmp, bitwise and immediate carry bytes).
fn data_value(b: &mut Builder, ty: u16, value: &[u8]) {
    b.nest(ty, |b| {
        b.attr(NFTA_DATA_VALUE, value);
    });
}

/// The batch that (re)creates the table with its redirecting rule.
pub fn redirect_batch(port: u16, first_seq: u32) -> Builder {
    let mut b = Builder::new(first_seq);
    let ip = nfgenmsg(NFPROTO_IPV4, 0);

    b.begin(NFNL_MSG_BATCH_BEGIN, 0, &nfgenmsg(NFPROTO_UNSPEC, NFNL_SUBSYS_NFTABLES), "batch begin");
    b.end();

    // "table ip umbra" (a no-op if it exists), then delete it with its contents: the fresh
    // table below is then the only state, however often this runs.
    b.begin(msg_type(NFT_MSG_NEWTABLE), NLM_F_ACK | NLM_F_CREATE, &ip, format!("create table ip {TABLE}"));
    b.attr_str(NFTA_TABLE_NAME, TABLE);
    b.end();
    b.begin(msg_type(NFT_MSG_DELTABLE), NLM_F_ACK, &ip, format!("delete table ip {TABLE}"));
    b.attr_str(NFTA_TABLE_NAME, TABLE);
    b.end();
    b.begin(msg_type(NFT_MSG_NEWTABLE), NLM_F_ACK | NLM_F_CREATE, &ip, format!("create table ip {TABLE}"));
    b.attr_str(NFTA_TABLE_NAME, TABLE);
    b.end();

    b.begin(
        msg_type(NFT_MSG_NEWCHAIN),
        NLM_F_ACK | NLM_F_CREATE,
        &ip,
        format!("create chain ip {TABLE} {CHAIN} (type nat hook output priority -100)"),
    );
    b.attr_str(NFTA_CHAIN_TABLE, TABLE);
    b.attr_str(NFTA_CHAIN_NAME, CHAIN);
    b.nest(NFTA_CHAIN_HOOK, |b| {
        b.attr_be32(NFTA_HOOK_HOOKNUM, NF_INET_LOCAL_OUT);
        b.attr_be32(NFTA_HOOK_PRIORITY, NF_IP_PRI_NAT_DST as u32);
    });
    b.attr_be32(NFTA_CHAIN_POLICY, NF_ACCEPT);
    b.attr_str(NFTA_CHAIN_TYPE, "nat");
    b.end();

    b.begin(
        msg_type(NFT_MSG_NEWRULE),
        NLM_F_ACK | NLM_F_CREATE | NLM_F_APPEND,
        &ip,
        format!("add rule ip {TABLE} {CHAIN} meta l4proto tcp ip daddr != 127.0.0.0/8 redirect to :{port}"),
    );
    b.attr_str(NFTA_RULE_TABLE, TABLE);
    b.attr_str(NFTA_RULE_CHAIN, CHAIN);
    b.nest(NFTA_RULE_EXPRESSIONS, |b| {
        // meta l4proto tcp
        expr(b, "meta", |b| {
            b.attr_be32(NFTA_META_KEY, NFT_META_L4PROTO);
            b.attr_be32(NFTA_META_DREG, NFT_REG_1);
        });
        expr(b, "cmp", |b| {
            b.attr_be32(NFTA_CMP_SREG, NFT_REG_1);
            b.attr_be32(NFTA_CMP_OP, NFT_CMP_EQ);
            data_value(b, NFTA_CMP_DATA, &[IPPROTO_TCP]);
        });
        // ip daddr != 127.0.0.0/8
        expr(b, "payload", |b| {
            b.attr_be32(NFTA_PAYLOAD_DREG, NFT_REG_1);
            b.attr_be32(NFTA_PAYLOAD_BASE, NFT_PAYLOAD_NETWORK_HEADER);
            b.attr_be32(NFTA_PAYLOAD_OFFSET, IPV4_DADDR_OFFSET);
            b.attr_be32(NFTA_PAYLOAD_LEN, 4);
        });
        expr(b, "bitwise", |b| {
            b.attr_be32(NFTA_BITWISE_SREG, NFT_REG_1);
            b.attr_be32(NFTA_BITWISE_DREG, NFT_REG_1);
            b.attr_be32(NFTA_BITWISE_LEN, 4);
            data_value(b, NFTA_BITWISE_MASK, &[255, 0, 0, 0]);
            data_value(b, NFTA_BITWISE_XOR, &[0, 0, 0, 0]);
        });
        expr(b, "cmp", |b| {
            b.attr_be32(NFTA_CMP_SREG, NFT_REG_1);
            b.attr_be32(NFTA_CMP_OP, NFT_CMP_NEQ);
            data_value(b, NFTA_CMP_DATA, &[127, 0, 0, 0]);
        });
        // redirect to :port — the port goes through a register, in network byte order (the
        // kernel loads 16 bits from the register as a __be16)
        expr(b, "immediate", |b| {
            b.attr_be32(NFTA_IMMEDIATE_DREG, NFT_REG_1);
            data_value(b, NFTA_IMMEDIATE_DATA, &port.to_be_bytes());
        });
        expr(b, "redir", |b| {
            b.attr_be32(NFTA_REDIR_REG_PROTO_MIN, NFT_REG_1);
        });
    });
    b.end();

    b.begin(NFNL_MSG_BATCH_END, 0, &nfgenmsg(NFPROTO_UNSPEC, NFNL_SUBSYS_NFTABLES), "batch end");
    b.end();
    b
}

/// Installs (or replaces) the redirecting rule in the calling thread's network namespace.
/// Needs CAP_NET_ADMIN and a kernel with nf_tables, NAT and redirect support.
pub fn install_redirect(port: u16) -> Result<(), NetlinkError> {
    let socket = Socket::open(SockProtocol::NetlinkNetFilter)?;
    socket.transact(&redirect_batch(port, 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_batch_is_framed_and_every_change_is_acked() {
        let b = redirect_batch(3129, 100);
        let bytes = b.bytes();
        // Walk the messages: types in order, lengths consistent.
        let mut types = Vec::new();
        let mut rest = bytes;
        while !rest.is_empty() {
            let len = u32::from_ne_bytes(rest[0..4].try_into().unwrap()) as usize;
            assert!(len >= 20 && len % 4 == 0 && len <= rest.len());
            types.push(u16::from_ne_bytes(rest[4..6].try_into().unwrap()));
            rest = &rest[len..];
        }
        assert_eq!(
            types,
            [
                NFNL_MSG_BATCH_BEGIN,
                msg_type(NFT_MSG_NEWTABLE),
                msg_type(NFT_MSG_DELTABLE),
                msg_type(NFT_MSG_NEWTABLE),
                msg_type(NFT_MSG_NEWCHAIN),
                msg_type(NFT_MSG_NEWRULE),
                NFNL_MSG_BATCH_END
            ]
        );
        // The batch markers address the nftables subsystem (res_id, big-endian).
        assert_eq!(&bytes[16..20], &[0, 0, 0, 10]);
        // Five acknowledged messages, seq 101..=105 (the batch begin took 100).
        let seqs: Vec<u32> = b.acked().iter().map(|(s, _)| *s).collect();
        assert_eq!(seqs, [101, 102, 103, 104, 105]);
        // The port is in the rule, big-endian: 3129 = 0x0c39.
        assert!(bytes.windows(2).any(|w| w == [0x0c, 0x39]));
        assert!(b.acked()[4].1.contains("redirect to :3129"));
    }
}
