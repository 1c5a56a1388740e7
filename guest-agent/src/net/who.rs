//! Which guest process opened a connection the agent accepted: the socket whose local address
//! is the connection's peer address (`/proc/net/tcp`, `/proc/net/tcp6`), then the process with
//! a descriptor for that socket (`/proc/<pid>/fd`). Done only when the host asks (network mode
//! `ask` names the process in its question), so no connection pays for the scan otherwise.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;

use umbra_proto::egress::EgressProcess;
use umbra_proto::ListeningPort;

/// The process holding the other end of a connection whose peer address is `peer`, read from
/// `proc` (`/proc`). Empty when it cannot be found.
pub fn process_of(proc: &Path, peer: SocketAddr) -> EgressProcess {
    let Some(inode) = socket_inode(proc, peer) else {
        return EgressProcess::default();
    };
    let Some(&pid) = holders(proc, BTreeSet::from([inode])).get(&inode) else {
        return EgressProcess::default();
    };
    describe(proc, pid)
}

/// The most ports one `listening` answer lists.
pub const MAX_LISTENING: usize = 256;

/// The TCP ports listened on at a loopback or wildcard address — what an exposed port reaches —
/// with the process holding each; sockets held by `own` (the agent's pid) are left out. One
/// entry per port, lowest first.
pub fn listening(proc: &Path, own: u32) -> Vec<ListeningPort> {
    let mut sockets: Vec<(u16, u64)> = Vec::new();
    for table in ["tcp", "tcp6"] {
        let Ok(text) = std::fs::read_to_string(proc.join("net").join(table)) else { continue };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // State 0A: LISTEN.
            let (Some(local), Some("0A"), Some(inode)) = (f.get(1), f.get(3).copied(), f.get(9)) else { continue };
            let Some((addr, port)) = local.split_once(':') else { continue };
            let (Ok(port), Ok(inode)) = (u16::from_str_radix(port, 16), inode.parse::<u64>()) else { continue };
            if reachable_by_loopback(addr) {
                sockets.push((port, inode));
            }
        }
    }
    if sockets.is_empty() {
        return Vec::new();
    }
    let holders = holders(proc, sockets.iter().map(|&(_, inode)| inode).collect());
    // The agent's own sockets out first: a program's listener sharing a port with one of them
    // (on another address) is still listed.
    let mut ports: BTreeMap<u16, u64> = BTreeMap::new();
    for (port, inode) in sockets.into_iter().filter(|(_, inode)| holders.get(inode) != Some(&own)) {
        ports.entry(port).or_insert(inode);
    }
    ports
        .into_iter()
        .take(MAX_LISTENING)
        .map(|(port, inode)| ListeningPort { port, process: holders.get(&inode).map(|&pid| describe(proc, pid)) })
        .collect()
}

/// A `/proc/net/tcp{,6}` local address (hex, 32-bit words in host order) that 127.0.0.1 or
/// ::1 reaches: loopback, or the wildcard.
fn reachable_by_loopback(hex: &str) -> bool {
    let words: Vec<u32> =
        (0..hex.len() / 8).filter_map(|i| u32::from_str_radix(&hex[i * 8..i * 8 + 8], 16).ok()).collect();
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
    // The forward listener connects to 127.0.0.1, then ::1 (`crate::forward`): other loopback
    // addresses (127.0.0.2) are not reached.
    let v4_reached = |b: &[u8]| b == [127, 0, 0, 1] || b == [0, 0, 0, 0];
    match bytes.len() {
        4 => v4_reached(&bytes),
        16 => {
            let v6 = std::net::Ipv6Addr::from(<[u8; 16]>::try_from(bytes.as_slice()).unwrap_or_default());
            v6.is_loopback() || v6.is_unspecified() || v6.to_ipv4_mapped().is_some_and(|v4| v4_reached(&v4.octets()))
        }
        _ => false,
    }
}

/// For each of `inodes`, the lowest pid with a descriptor for it.
fn holders(proc: &Path, mut inodes: BTreeSet<u64>) -> BTreeMap<u64, u32> {
    let mut found = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir(proc) else { return found };
    let mut pids: Vec<u32> = dir.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).collect();
    pids.sort_unstable();
    for pid in pids {
        let Ok(fds) = std::fs::read_dir(proc.join(pid.to_string()).join("fd")) else { continue };
        for fd in fds.flatten() {
            let Ok(link) = std::fs::read_link(fd.path()) else { continue };
            let inode = link.to_str().and_then(|l| l.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok());
            if let Some(inode) = inode.filter(|i| inodes.remove(i)) {
                found.insert(inode, pid);
            }
        }
        if inodes.is_empty() {
            break;
        }
    }
    found
}

/// A process by its command line (or its name, when it has none), tidied.
fn describe(proc: &Path, pid: u32) -> EgressProcess {
    let dir = proc.join(pid.to_string());
    let mut command = std::fs::read(dir.join("cmdline"))
        .map(|raw| {
            let args: Vec<String> = raw
                .split(|&b| b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            args.join(" ")
        })
        .unwrap_or_default();
    if command.is_empty() {
        command = std::fs::read_to_string(dir.join("comm")).unwrap_or_default().trim_end().to_string();
    }
    EgressProcess { pid: Some(pid), command }.tidy()
}

/// The inode of the TCP socket whose local address is `addr`.
fn socket_inode(proc: &Path, addr: SocketAddr) -> Option<u64> {
    let v6_text = |v6: std::net::Ipv6Addr| -> String {
        v6.octets().chunks(4).map(|w| format!("{:08X}", u32::from_ne_bytes([w[0], w[1], w[2], w[3]]))).collect()
    };
    let port = addr.port();
    // A v4 peer of a dual-stack listener shows as ::ffff:a.b.c.d: its own socket is in `tcp`
    // (an IPv4 socket) or in `tcp6` under the mapped address (an IPv6 socket that connected
    // to one); both are tried.
    let candidates: Vec<(&str, String)> = match addr.ip() {
        IpAddr::V4(v4) => vec![
            ("tcp", format!("{:08X}:{port:04X}", u32::from_ne_bytes(v4.octets()))),
            ("tcp6", format!("{}:{port:04X}", v6_text(v4.to_ipv6_mapped()))),
        ],
        IpAddr::V6(v6) => {
            let mut c = vec![("tcp6", format!("{}:{port:04X}", v6_text(v6)))];
            if let Some(v4) = v6.to_ipv4_mapped() {
                c.push(("tcp", format!("{:08X}:{port:04X}", u32::from_ne_bytes(v4.octets()))));
            }
            c
        }
    };
    candidates.into_iter().find_map(|(table, want)| {
        let text = std::fs::read_to_string(proc.join("net").join(table)).ok()?;
        text.lines().skip(1).find_map(|line| {
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...
            let fields: Vec<&str> = line.split_whitespace().collect();
            (fields.get(1) == Some(&want.as_str())).then(|| fields.get(9)?.parse().ok()).flatten().filter(|&i| i != 0)
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_process_that_connected() {
        // A real connection in this process: the test is the process that "connected".
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_accepted, peer) = listener.accept().unwrap();
        assert_eq!(peer, client.local_addr().unwrap());
        let found = process_of(Path::new("/proc"), peer);
        assert_eq!(found.pid, Some(std::process::id()));
        assert!(found.command.contains("umbra_agent"), "{found:?}");

        let listener = std::net::TcpListener::bind("[::1]:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_accepted, peer) = listener.accept().unwrap();
        assert_eq!(peer, client.local_addr().unwrap());
        assert_eq!(process_of(Path::new("/proc"), peer).pid, Some(std::process::id()));

        // Listening: this process's loopback listeners, unless it is the one left out.
        let wildcard = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
        let external = wildcard.local_addr().unwrap().port();
        let mine = listener.local_addr().unwrap().port();
        let ports = listening(Path::new("/proc"), 0);
        for port in [mine, external] {
            let p = ports.iter().find(|p| p.port == port).unwrap_or_else(|| panic!("{port}: {ports:?}"));
            assert_eq!(p.process.as_ref().and_then(|p| p.pid), Some(std::process::id()));
        }
        let others = listening(Path::new("/proc"), std::process::id());
        assert!(!others.iter().any(|p| p.port == mine || p.port == external), "{others:?}");

        // Nobody's socket: nothing claimed.
        drop(client);
        let gone: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert_eq!(process_of(Path::new("/proc"), gone), EgressProcess::default());
    }
}
