//! The guest's DNS server (UDP and TCP; 127.0.0.53:53 in a guest, `/etc/resolv.conf` points at
//! it). Messages are parsed and built with `hickory-proto`.
//!
//! - `A name`: the host is asked whether the name may be used (a `resolve` egress request).
//!   Allowed: one A record with the name's fake address ([`super::fakeip`]), TTL
//!   [`ANSWER_TTL`]. Denied: REFUSED. Not found: NXDOMAIN. The host unreachable or busy:
//!   SERVFAIL.
//! - `localhost` and `*.localhost` (RFC 6761): 127.0.0.1, without asking the host.
//! - `PTR` of a fake address: the name it stands for.
//! - Anything else (AAAA, MX, TXT, …): an empty NOERROR answer. The guest has no IPv6 route, so
//!   programs fall back to the A record.
//! - Not a standard query: NOTIMP; several questions or an unparsable one: FORMERR. Responses
//!   and messages too short for a header are dropped (never answered: no loops).

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::rdata::{A, PTR};
use hickory_proto::rr::{DNSClass, Name, RData, Record, RecordType};
use hickory_proto::serialize::binary::BinEncodable;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UdpSocket};
use tokio::sync::Semaphore;
use umbra_proto::egress::{EgressRefusal, MAX_EGRESS_NAME};

use super::egress::Egress;
use super::fakeip::is_fake;

/// TTL of every answer. Short, so a policy change shows soon; the fake address itself stays
/// the name's as long as it is in the table.
pub const ANSWER_TTL: u32 = 5;
/// Largest UDP query read (EDNS clients may send up to 4096; queries are small).
const MAX_UDP: usize = 4096;
/// A DNS-over-TCP connection idle this long is closed.
const TCP_IDLE: Duration = Duration::from_secs(10);

pub async fn serve_udp(socket: UdpSocket, egress: Arc<Egress>) {
    let socket = Arc::new(socket);
    let mut buf = vec![0u8; MAX_UDP];
    loop {
        let (n, peer) = match socket.recv_from(&mut buf).await {
            Ok(r) => r,
            Err(e) => {
                // ICMP errors from earlier answers (ECONNREFUSED) and the like: keep serving.
                tracing::debug!("dns: udp receive: {e}");
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            }
        };
        let query = buf[..n].to_vec();
        let (socket, egress) = (socket.clone(), egress.clone());
        tokio::spawn(async move {
            if let Some(answer) = answer(&egress, &query).await {
                let _ = socket.send_to(&answer, peer).await;
            }
        });
    }
}

pub async fn serve_tcp(listener: TcpListener, egress: Arc<Egress>) {
    let connections = Arc::new(Semaphore::new(egress.limits.dns_tcp));
    super::accept::accept_loop("DNS (TCP)", listener, move |mut stream| {
        let (egress, connections) = (egress.clone(), connections.clone());
        async move {
            let Ok(_permit) = connections.try_acquire() else { return };
            loop {
                let mut len = [0u8; 2];
                match tokio::time::timeout(TCP_IDLE, stream.read_exact(&mut len)).await {
                    Ok(Ok(_)) => {}
                    _ => return,
                }
                let mut query = vec![0u8; u16::from_be_bytes(len) as usize];
                match tokio::time::timeout(TCP_IDLE, stream.read_exact(&mut query)).await {
                    Ok(Ok(_)) => {}
                    _ => return,
                }
                let Some(answer) = answer(&egress, &query).await else { return };
                let mut framed = Vec::with_capacity(answer.len() + 2);
                framed.extend_from_slice(&(answer.len() as u16).to_be_bytes());
                framed.extend_from_slice(&answer);
                if stream.write_all(&framed).await.is_err() {
                    return;
                }
            }
        }
    })
    .await
}

/// The answer to one query message, or None when it must not be answered.
pub async fn answer(egress: &Egress, query: &[u8]) -> Option<Vec<u8>> {
    if query.len() < 12 {
        return None;
    }
    let id = u16::from_be_bytes([query[0], query[1]]);
    let message = match Message::from_vec(query) {
        Ok(m) => m,
        Err(_) => {
            // Bit 7 of byte 2 is QR: never answer a response.
            if query[2] & 0x80 != 0 {
                return None;
            }
            return encode(&Message::error_msg(id, OpCode::Query, ResponseCode::FormErr));
        }
    };
    if message.message_type() != MessageType::Query {
        return None;
    }
    let mut response = Message::new();
    response
        .set_id(id)
        .set_message_type(MessageType::Response)
        .set_op_code(message.op_code())
        .set_recursion_desired(message.recursion_desired())
        .set_recursion_available(true);
    if message.op_code() != OpCode::Query {
        response.set_response_code(ResponseCode::NotImp);
        return encode(&response);
    }
    let [question] = message.queries() else {
        response.set_response_code(ResponseCode::FormErr);
        return encode(&response);
    };
    response.add_query(question.clone());
    let qname = question.name();
    if question.query_class() != DNSClass::IN {
        return encode(&response);
    }
    let name = normalise(qname);
    match question.query_type() {
        RecordType::A if name == "localhost" || name.ends_with(".localhost") => {
            response.add_answer(Record::from_rdata(qname.clone(), ANSWER_TTL, RData::A(A(Ipv4Addr::LOCALHOST))));
        }
        RecordType::A if !name.is_empty() && name.len() <= MAX_EGRESS_NAME => match egress.resolve(&name).await {
            Ok(()) => {
                let ip = egress.fake_ips.address_for(&name);
                response.add_answer(Record::from_rdata(qname.clone(), ANSWER_TTL, RData::A(A(ip))));
            }
            Err(f) => {
                tracing::debug!("dns: {name}: {f}");
                response.set_response_code(match f.refusal {
                    EgressRefusal::Denied => ResponseCode::Refused,
                    EgressRefusal::NotFound => ResponseCode::NXDomain,
                    EgressRefusal::Unreachable | EgressRefusal::Busy | EgressRefusal::BadRequest => {
                        ResponseCode::ServFail
                    }
                });
            }
        },
        RecordType::PTR => {
            if let Some(target) =
                reverse_v4(&name).filter(|ip| is_fake(*ip)).and_then(|ip| egress.fake_ips.name_for(ip))
            {
                if let Ok(target) = Name::from_ascii(format!("{target}.")) {
                    response.add_answer(Record::from_rdata(qname.clone(), ANSWER_TTL, RData::PTR(PTR(target))));
                }
            }
        }
        // AAAA and every other type: no records (NOERROR, empty).
        _ => {}
    }
    encode(&response)
}

/// A query name as the host wants it: ASCII (punycode), lowercase, without the final dot.
fn normalise(name: &Name) -> String {
    let s = name.to_ascii().to_ascii_lowercase();
    s.strip_suffix('.').unwrap_or(&s).to_string()
}

/// `d.c.b.a.in-addr.arpa` → a.b.c.d
fn reverse_v4(name: &str) -> Option<Ipv4Addr> {
    let rest = name.strip_suffix(".in-addr.arpa")?;
    let mut octets = [0u8; 4];
    let parts: Vec<&str> = rest.split('.').collect();
    if parts.len() != 4 {
        return None;
    }
    for (i, p) in parts.iter().rev().enumerate() {
        octets[i] = p.parse().ok()?;
    }
    Some(Ipv4Addr::from(octets))
}

fn encode(m: &Message) -> Option<Vec<u8>> {
    match m.to_bytes() {
        Ok(b) => Some(b),
        Err(e) => {
            tracing::warn!("dns: cannot encode an answer: {e}");
            None
        }
    }
}

/// A query for tests: id, name, type.
#[cfg(test)]
pub fn query(id: u16, name: &str, ty: RecordType) -> Vec<u8> {
    let mut m = Message::new();
    m.set_id(id).set_message_type(MessageType::Query).set_op_code(OpCode::Query).set_recursion_desired(true);
    m.add_query(hickory_proto::op::Query::query(Name::from_ascii(name).unwrap(), ty));
    m.to_bytes().unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::egress::{EgressTarget, Limits};
    use crate::net::fakeip::FakeIps;

    /// An egress whose host is a Unix socket that answers `resolve` from a fixed table.
    async fn egress_with_host(answers: &'static [(&'static str, &'static str)]) -> (Arc<Egress>, std::path::PathBuf) {
        use tokio::io::{AsyncBufReadExt, BufReader};
        let dir = std::env::temp_dir().join(format!("umbra-dns-test-{}-{:p}", std::process::id(), answers));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("egress.sock");
        let _ = std::fs::remove_file(&path);
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            loop {
                let Ok((s, _)) = listener.accept().await else { return };
                tokio::spawn(async move {
                    let mut r = BufReader::new(s);
                    let mut line = String::new();
                    r.read_line(&mut line).await.unwrap();
                    let req: serde_json::Value = serde_json::from_str(&line).unwrap();
                    let name = req["name"].as_str().unwrap().to_string();
                    let reply = answers.iter().find(|(n, _)| *n == name).map(|(_, r)| *r).unwrap_or("{\"ok\":true}");
                    r.get_mut().write_all(format!("{reply}\n").as_bytes()).await.unwrap();
                });
            }
        });
        let egress =
            Arc::new(Egress::new(EgressTarget::Unix(path.clone()), Limits::default(), Arc::new(FakeIps::new(100))));
        (egress, dir)
    }

    fn parse(bytes: &[u8]) -> Message {
        Message::from_vec(bytes).unwrap()
    }

    #[tokio::test]
    async fn answers_by_the_hosts_decision() {
        let (egress, dir) = egress_with_host(&[
            ("denied.test", "{\"ok\":false,\"refusal\":\"denied\",\"reason\":\"no\"}"),
            ("missing.test", "{\"ok\":false,\"refusal\":\"not_found\",\"reason\":\"no\"}"),
        ])
        .await;
        let a = parse(&answer(&egress, &query(1, "Allowed.Test.", RecordType::A)).await.unwrap());
        assert_eq!((a.id(), a.response_code()), (1, ResponseCode::NoError));
        let RData::A(A(ip)) = *a.answers()[0].data() else { panic!("{a:?}") };
        assert!(is_fake(ip));
        assert_eq!(egress.fake_ips.name_for(ip).as_deref(), Some("allowed.test"));
        let again = parse(&answer(&egress, &query(2, "allowed.test.", RecordType::A)).await.unwrap());
        assert_eq!(again.answers()[0].data(), a.answers()[0].data(), "stable");

        let r = parse(&answer(&egress, &query(3, "denied.test.", RecordType::A)).await.unwrap());
        assert_eq!((r.response_code(), r.answers().len()), (ResponseCode::Refused, 0));
        let r = parse(&answer(&egress, &query(4, "missing.test.", RecordType::A)).await.unwrap());
        assert_eq!(r.response_code(), ResponseCode::NXDomain);
        let r = parse(&answer(&egress, &query(5, "allowed.test.", RecordType::AAAA)).await.unwrap());
        assert_eq!((r.response_code(), r.answers().len()), (ResponseCode::NoError, 0));
        let r = parse(&answer(&egress, &query(6, "localhost.", RecordType::A)).await.unwrap());
        assert_eq!(r.answers()[0].data(), &RData::A(A(Ipv4Addr::LOCALHOST)));

        // Reverse lookup of a fake address.
        let o = ip.octets();
        let rev = format!("{}.{}.{}.{}.in-addr.arpa.", o[3], o[2], o[1], o[0]);
        let r = parse(&answer(&egress, &query(7, &rev, RecordType::PTR)).await.unwrap());
        assert_eq!(r.answers()[0].data(), &RData::PTR(PTR(Name::from_ascii("allowed.test.").unwrap())));

        // Garbage: FORMERR when it looks like a query, nothing when it looks like a response.
        let mut junk = vec![0u8; 12];
        junk.extend_from_slice(&[0xff; 20]);
        junk[4..6].copy_from_slice(&1u16.to_be_bytes());
        let r = parse(&answer(&egress, &junk).await.unwrap());
        assert_eq!(r.response_code(), ResponseCode::FormErr);
        junk[2] |= 0x80;
        assert!(answer(&egress, &junk).await.is_none());
        assert!(answer(&egress, &[1, 2, 3]).await.is_none());
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn no_host_is_servfail() {
        let egress = Egress::new(
            EgressTarget::Unix("/nonexistent/umbra-egress.sock".into()),
            Limits::default(),
            Arc::new(FakeIps::new(10)),
        );
        let r = parse(&answer(&egress, &query(9, "example.com.", RecordType::A)).await.unwrap());
        assert_eq!(r.response_code(), ResponseCode::ServFail);
    }

    #[test]
    fn reverse_names() {
        assert_eq!(reverse_v4("5.0.18.198.in-addr.arpa"), Some(Ipv4Addr::new(198, 18, 0, 5)));
        assert_eq!(reverse_v4("0.18.198.in-addr.arpa"), None);
        assert_eq!(reverse_v4("x.0.18.198.in-addr.arpa"), None);
    }
}
