//! Lane-(a) tests: the muxer driven synchronously over guest memory and real Unix sockets, the
//! hostile-guest cases, and the device with its worker thread.

use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vm_memory::{ByteValued, Bytes, GuestAddress};

use super::connection::{BUF_ALLOC, REQUEST_TIMEOUT, SHUTDOWN_TIMEOUT};
use super::muxer::{VsockMuxer, CONNECT_LINE_TIMEOUT, MAX_CONNECTIONS};
use super::packet::{op, shutdown, VsockPacketHeader, HDR_SIZE, MAX_PKT_DATA};
use super::test_utils::*;

const NEXT: u16 = virtio_bindings::bindings::virtio_ring::VRING_DESC_F_NEXT as u16;

fn muxer(dir: &TempDir) -> VsockMuxer {
    VsockMuxer::new(GUEST_CID, &dir.socket()).unwrap()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

// ---- host-initiated connections -------------------------------------------------------------

#[test]
fn host_connect_reaches_the_guest_and_gets_ok() {
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);

    let mut host = UnixStream::connect(dir.socket()).unwrap();
    host.write_all(b"CONNECT 1024\n").unwrap();
    poll_until(&mut m, |m| m.connection_count() == 1);
    d.post_rx(2);
    let pkts = d.recv(&mut m);
    assert_eq!(pkts.len(), 1);
    let req = pkts[0].hdr;
    assert_eq!((req.src_cid(), req.dst_cid()), (2, GUEST_CID));
    assert_eq!((req.src_port(), req.dst_port()), (1 << 30, 1024));
    assert_eq!((req.type_(), req.op(), req.len()), (1, op::REQUEST, 0));
    assert_eq!(req.buf_alloc(), BUF_ALLOC);

    d.send(&mut m, &guest_hdr(op::RESPONSE, 1024, 1 << 30), &[]);
    assert_eq!(read_line(&mut host), "OK 1073741824\n");

    // A second connection gets the next host port.
    let (_host2, port2) = connect_established(&mut m, &mut d, 1024, BUF_ALLOC);
    assert_eq!(port2, (1 << 30) + 1);
}

#[test]
fn bytes_after_the_connect_line_belong_to_the_stream() {
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);
    let mut host = UnixStream::connect(dir.socket()).unwrap();
    // Split across writes, and pipelined data right behind the newline.
    host.write_all(b"CONN").unwrap();
    m.poll_host(10);
    host.write_all(b"ECT 77\nhello").unwrap();
    poll_until(&mut m, |m| m.connection_count() == 1);
    d.post_rx(1);
    let req = d.recv(&mut m)[0].hdr;
    d.send(&mut m, &guest_hdr(op::RESPONSE, 77, req.src_port()), &[]);
    assert_eq!(read_line(&mut host), format!("OK {}\n", req.src_port()));
    let got = d.pump_until(&mut m, Duration::from_secs(5), |p| p.iter().any(|p| p.hdr.op() == op::RW));
    let data: Vec<u8> = got.iter().filter(|p| p.hdr.op() == op::RW).flat_map(|p| p.data.clone()).collect();
    assert_eq!(data, b"hello");
}

#[test]
fn malformed_overlong_and_slow_connect_lines_are_closed() {
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);

    for line in [&b"HELLO 1024\n"[..], b"CONNECT\n", b"CONNECT x\n", b"CONNECT 1 2\n", &[b'7'; 40][..]] {
        let mut host = UnixStream::connect(dir.socket()).unwrap();
        host.write_all(line).unwrap();
        m.poll_host(10);
        assert!(reads_eof(&mut host), "{:?}", String::from_utf8_lossy(line));
    }
    // A host that stops mid-line is dropped at the deadline.
    let mut slow = UnixStream::connect(dir.socket()).unwrap();
    slow.write_all(b"CONNECT 10").unwrap();
    m.poll_host(10);
    m.process_timeouts(Instant::now() + CONNECT_LINE_TIMEOUT + Duration::from_millis(1));
    assert!(reads_eof(&mut slow));
    assert_eq!(m.counters().host_refused, 6);
    assert_eq!(m.connection_count(), 0);
    d.post_rx(1);
    assert!(d.recv(&mut m).is_empty(), "the guest heard nothing");
}

#[test]
fn guest_rst_to_a_request_closes_the_host_stream() {
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);
    let mut host = UnixStream::connect(dir.socket()).unwrap();
    host.write_all(b"CONNECT 1024\n").unwrap();
    poll_until(&mut m, |m| m.connection_count() == 1);
    d.post_rx(1);
    let req = d.recv(&mut m)[0].hdr;
    // Nobody listens on 1024 yet.
    d.send(&mut m, &guest_hdr(op::RST, 1024, req.src_port()), &[]);
    assert_eq!(m.connection_count(), 0);
    assert_eq!(read_line(&mut host), "", "closed without a reply");
}

#[test]
fn an_unanswered_request_times_out_with_rst() {
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);
    let mut host = UnixStream::connect(dir.socket()).unwrap();
    host.write_all(b"CONNECT 1024\n").unwrap();
    poll_until(&mut m, |m| m.connection_count() == 1);
    d.post_rx(1);
    assert_eq!(d.recv(&mut m)[0].hdr.op(), op::REQUEST);
    m.process_timeouts(Instant::now() + REQUEST_TIMEOUT + Duration::from_millis(1));
    assert!(reads_eof(&mut host));
    d.post_rx(1);
    let pkts = d.recv(&mut m);
    assert_eq!(pkts.len(), 1);
    assert_eq!(pkts[0].hdr.op(), op::RST);
    assert_eq!(m.connection_count(), 0);
    assert_eq!(m.counters().timeouts, 1);
}

// ---- data and flow control ------------------------------------------------------------------

#[test]
fn host_to_guest_data_respects_the_guest_credit() {
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);
    let guest_credit = 16 * 1024;
    let (mut host, port) = connect_established(&mut m, &mut d, 1024, guest_credit);

    let sent = pattern(100 * 1024, 7);
    host.write_all(&sent).unwrap();
    let mut received = Vec::new();
    let mut guest_fwd = 0u32;
    let mut credit_requests = 0;
    let end = Instant::now() + Duration::from_secs(10);
    while received.len() < sent.len() {
        assert!(Instant::now() < end, "stalled at {} bytes", received.len());
        d.post_rx(8);
        m.poll_host(5);
        for p in d.recv(&mut m) {
            assert_eq!((p.hdr.src_port(), p.hdr.dst_port()), (port, 1024));
            match p.hdr.op() {
                op::RW => {
                    received.extend_from_slice(&p.data);
                    assert!(p.data.len() <= RX_DATA_SIZE as usize);
                    assert!(received.len() as u32 - guest_fwd <= guest_credit, "the device overran the guest credit");
                }
                op::CREDIT_REQUEST => {
                    // The device only asks once it has used all the credit.
                    assert_eq!(received.len() as u32 - guest_fwd, guest_credit);
                    credit_requests += 1;
                    guest_fwd = received.len() as u32;
                    let mut upd = guest_hdr(op::CREDIT_UPDATE, 1024, port);
                    upd.set_buf_alloc(guest_credit).set_fwd_cnt(guest_fwd);
                    d.send(&mut m, &upd, &[]);
                }
                other => panic!("unexpected op {other}"),
            }
        }
    }
    assert_eq!(received, sent);
    assert!(credit_requests >= 100 / 16, "credit was exhausted {credit_requests} times");
}

#[test]
fn guest_to_host_data_beyond_the_credit_flows_with_credit_updates() {
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);
    let (host, port) = connect_established(&mut m, &mut d, 1024, BUF_ALLOC);

    // A slow host reader, so the device must buffer and the guest must wait for credit.
    let total = 3 * BUF_ALLOC as usize + 12345;
    let reader = std::thread::spawn(move || {
        let mut host = host;
        let mut got = Vec::new();
        let mut buf = [0u8; 8192];
        while got.len() < total {
            let n = host.read(&mut buf).unwrap();
            assert!(n > 0, "EOF after {} bytes", got.len());
            got.extend_from_slice(&buf[..n]);
            std::thread::sleep(Duration::from_micros(200));
        }
        got
    });

    let data = pattern(total, 3);
    let (mut sent, mut peer_buf_alloc, mut peer_fwd) = (0usize, BUF_ALLOC, 0u32);
    let mut updates = 0;
    let end = Instant::now() + Duration::from_secs(30);
    while sent < total {
        assert!(Instant::now() < end, "stalled at {sent} bytes");
        let credit = peer_buf_alloc as usize - (sent as u32).wrapping_sub(peer_fwd) as usize;
        if credit > 0 {
            let n = credit.min(MAX_PKT_DATA).min(total - sent).min(40_000);
            d.send(&mut m, &guest_hdr(op::RW, 1024, port), &data[sent..sent + n]);
            sent += n;
        } else {
            m.poll_host(5);
        }
        d.post_rx(2);
        for p in d.recv(&mut m) {
            assert_eq!(p.hdr.op(), op::CREDIT_UPDATE, "{:?}", p.hdr);
            updates += 1;
            peer_buf_alloc = p.hdr.buf_alloc();
            peer_fwd = p.hdr.fwd_cnt();
        }
    }
    assert_eq!(m.counters().credit_violations, 0);
    // Drive the remaining flush.
    let end = Instant::now() + Duration::from_secs(30);
    while !reader.is_finished() {
        assert!(Instant::now() < end);
        m.poll_host(5);
    }
    assert_eq!(reader.join().unwrap(), data);
    assert!(updates > 0);
}

#[test]
fn a_guest_that_ignores_our_credit_is_reset() {
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);
    let (mut host, port) = connect_established(&mut m, &mut d, 1024, BUF_ALLOC);

    // The host never reads; the guest keeps sending anyway.
    let chunk = pattern(MAX_PKT_DATA, 1);
    let mut sent = 0usize;
    let mut reset = false;
    d.post_rx(4);
    for _ in 0..64 {
        d.send(&mut m, &guest_hdr(op::RW, 1024, port), &chunk);
        sent += chunk.len();
        let pkts = d.recv(&mut m);
        if pkts.iter().any(|p| p.hdr.op() == op::RST) {
            reset = true;
            break;
        }
    }
    assert!(reset, "no RST after {sent} bytes");
    assert_eq!(m.counters().credit_violations, 1);
    assert_eq!(m.connection_count(), 0);
    // Everything but the offending packet was accepted: what the kernel socket took, plus at
    // most BUF_ALLOC held by the device, which the reset discards.
    let mut got = Vec::new();
    host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    host.read_to_end(&mut got).unwrap();
    let accepted = sent - chunk.len();
    assert!(accepted > got.len(), "the device buffered some ({accepted} accepted, host got {})", got.len());
    assert!(accepted <= got.len() + BUF_ALLOC as usize, "{accepted} accepted, host got {}", got.len());
    assert_eq!(got, pattern(MAX_PKT_DATA, 1).repeat(got.len().div_ceil(MAX_PKT_DATA))[..got.len()]);
}

// ---- guest-initiated connections ------------------------------------------------------------

#[test]
fn guest_connects_to_a_host_listener() {
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);
    let listener = UnixListener::bind(format!("{}_5000", dir.socket().display())).unwrap();

    let mut req = guest_hdr(op::REQUEST, 40000, 5000);
    req.set_buf_alloc(64 * 1024);
    d.send(&mut m, &req, &[]);
    let (mut host, _) = listener.accept().unwrap();
    d.post_rx(1);
    let pkts = d.recv(&mut m);
    assert_eq!(pkts.len(), 1);
    let resp = pkts[0].hdr;
    assert_eq!((resp.op(), resp.src_port(), resp.dst_port(), resp.dst_cid()), (op::RESPONSE, 5000, 40000, GUEST_CID));

    d.send(&mut m, &guest_hdr(op::RW, 40000, 5000), b"ping");
    assert_eq!(read_exactly(&mut host, 4), b"ping");
    host.write_all(b"pong").unwrap();
    let got = d.pump_until(&mut m, Duration::from_secs(5), |p| !p.is_empty());
    assert_eq!(got[0].hdr.op(), op::RW);
    assert_eq!(got[0].data, b"pong");
}

#[test]
fn guest_connect_to_a_missing_listener_is_reset() {
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);
    d.send(&mut m, &guest_hdr(op::REQUEST, 40001, 5001), &[]);
    d.post_rx(1);
    let pkts = d.recv(&mut m);
    assert_eq!(pkts.len(), 1);
    let rst = pkts[0].hdr;
    assert_eq!(
        (rst.op(), rst.src_port(), rst.dst_port(), rst.src_cid(), rst.dst_cid()),
        (op::RST, 5001, 40001, 2, GUEST_CID)
    );
    assert_eq!(m.connection_count(), 0);
    assert_eq!(m.counters().guest_refused, 1);
}

// ---- closing --------------------------------------------------------------------------------

#[test]
fn host_close_becomes_a_full_shutdown_and_the_guest_rst_ends_it() {
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);
    let (host, port) = connect_established(&mut m, &mut d, 1024, BUF_ALLOC);
    drop(host);
    let got = d.pump_until(&mut m, Duration::from_secs(5), |p| !p.is_empty());
    assert_eq!(got[0].hdr.op(), op::SHUTDOWN);
    assert_eq!(got[0].hdr.flags(), shutdown::BOTH);
    d.send(&mut m, &guest_hdr(op::RST, 1024, port), &[]);
    assert_eq!(m.connection_count(), 0);
}

#[test]
fn a_guest_that_never_finishes_a_shutdown_is_reset() {
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);
    let (host, _) = connect_established(&mut m, &mut d, 1024, BUF_ALLOC);
    drop(host);
    let got = d.pump_until(&mut m, Duration::from_secs(5), |p| !p.is_empty());
    assert_eq!(got[0].hdr.op(), op::SHUTDOWN);
    m.process_timeouts(Instant::now() + SHUTDOWN_TIMEOUT + Duration::from_millis(1));
    d.post_rx(1);
    assert_eq!(d.recv(&mut m)[0].hdr.op(), op::RST);
    assert_eq!(m.connection_count(), 0);
    assert_eq!(m.counters().timeouts, 1);
}

#[test]
fn host_half_close_is_a_send_shutdown_and_the_other_direction_goes_on() {
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);
    let (mut host, port) = connect_established(&mut m, &mut d, 1024, BUF_ALLOC);
    host.write_all(b"last words").unwrap();
    host.shutdown(Shutdown::Write).unwrap();
    let got = d.pump_until(&mut m, Duration::from_secs(5), |p| p.iter().any(|p| p.hdr.op() == op::SHUTDOWN));
    let rw: Vec<u8> = got.iter().filter(|p| p.hdr.op() == op::RW).flat_map(|p| p.data.clone()).collect();
    assert_eq!(rw, b"last words", "data comes before the shutdown");
    let sd = got.iter().find(|p| p.hdr.op() == op::SHUTDOWN).unwrap();
    assert_eq!(sd.hdr.flags(), shutdown::SEND);

    d.send(&mut m, &guest_hdr(op::RW, 1024, port), b"reply");
    assert_eq!(read_exactly(&mut host, 5), b"reply");
    // The guest closes: RST to the guest, EOF to the host.
    let mut sd = guest_hdr(op::SHUTDOWN, 1024, port);
    sd.set_flags(shutdown::BOTH);
    d.send(&mut m, &sd, &[]);
    d.post_rx(1);
    assert_eq!(d.recv(&mut m)[0].hdr.op(), op::RST);
    assert!(reads_eof(&mut host));
    assert_eq!(m.connection_count(), 0);
}

#[test]
fn guest_send_shutdown_gives_the_host_eof_and_the_host_can_still_write() {
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);
    let (mut host, port) = connect_established(&mut m, &mut d, 1024, BUF_ALLOC);
    d.send(&mut m, &guest_hdr(op::RW, 1024, port), b"bye");
    let mut sd = guest_hdr(op::SHUTDOWN, 1024, port);
    sd.set_flags(shutdown::SEND);
    d.send(&mut m, &sd, &[]);
    let mut got = Vec::new();
    host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    host.read_to_end(&mut got).unwrap();
    assert_eq!(got, b"bye");
    host.write_all(b"still here").unwrap();
    let pkts = d.pump_until(&mut m, Duration::from_secs(5), |p| !p.is_empty());
    assert_eq!(pkts[0].data, b"still here");
    // Data after the guest promised to send no more is a protocol violation.
    d.send(&mut m, &guest_hdr(op::RW, 1024, port), b"oops");
    d.post_rx(1);
    assert_eq!(d.recv(&mut m)[0].hdr.op(), op::RST);
    assert_eq!(m.counters().protocol_violations, 1);
}

#[test]
fn guest_close_flushes_what_the_host_has_not_read_then_resets() {
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);
    let (mut host, port) = connect_established(&mut m, &mut d, 1024, BUF_ALLOC);
    // Fill the kernel socket buffer so the device must hold some bytes itself.
    let data = pattern(200 * 1024 + 40 * 1024, 9);
    let mut sent = 0;
    while sent < data.len() {
        let n = (data.len() - sent).min(MAX_PKT_DATA);
        d.send(&mut m, &guest_hdr(op::RW, 1024, port), &data[sent..sent + n]);
        sent += n;
    }
    let mut sd = guest_hdr(op::SHUTDOWN, 1024, port);
    sd.set_flags(shutdown::BOTH);
    d.send(&mut m, &sd, &[]);
    let reader = std::thread::spawn(move || {
        let mut got = Vec::new();
        host.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        host.read_to_end(&mut got).unwrap();
        got
    });
    let got = d.pump_until(&mut m, Duration::from_secs(10), |p| p.iter().any(|p| p.hdr.op() == op::RST));
    assert!(got.iter().any(|p| p.hdr.op() == op::RST));
    assert_eq!(reader.join().unwrap(), data, "every byte reached the host before the close");
    assert_eq!(m.connection_count(), 0);
}

// ---- hostile guests ---------------------------------------------------------------------------

/// After each abuse the device must still serve a well-formed exchange.
fn assert_still_works(m: &mut VsockMuxer, d: &mut Driver<'_>) {
    d.send(m, &guest_hdr(op::REQUEST, 999, 1), &[]);
    d.post_rx(1);
    let pkts = d.recv(m);
    assert_eq!(pkts.len(), 1, "{pkts:?}");
    assert_eq!(pkts[0].hdr.op(), op::RST);
    assert_eq!(pkts[0].hdr.dst_port(), 999);
}

#[test]
fn unroutable_and_unsupported_packets() {
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);
    d.post_rx(8);

    // Not from the guest's CID, or not to the host: dropped without a word.
    let mut spoofed = guest_hdr(op::REQUEST, 1, 2);
    spoofed.set_src_cid(4);
    d.send(&mut m, &spoofed, &[]);
    let mut elsewhere = guest_hdr(op::REQUEST, 1, 2);
    elsewhere.set_dst_cid(5);
    d.send(&mut m, &elsewhere, &[]);
    assert!(d.recv(&mut m).is_empty());
    assert_eq!(m.counters().tx_misaddressed, 2);

    // Wrong socket type, unknown op, data for no connection: RST. An RST for no connection: nothing.
    let mut seqpacket = guest_hdr(op::REQUEST, 10, 20);
    seqpacket.set_type(2);
    d.send(&mut m, &seqpacket, &[]);
    d.send(&mut m, &guest_hdr(0, 11, 20), &[]);
    d.send(&mut m, &guest_hdr(42, 12, 20), &[]);
    d.send(&mut m, &guest_hdr(op::RW, 13, 20), b"data");
    d.send(&mut m, &guest_hdr(op::RST, 14, 20), &[]);
    let pkts = d.recv(&mut m);
    let rst_to: Vec<u32> = pkts
        .iter()
        .map(|p| {
            assert_eq!(p.hdr.op(), op::RST);
            p.hdr.dst_port()
        })
        .collect();
    assert_eq!(rst_to, [10, 11, 12, 13]);
    assert_eq!(m.counters().tx_unsupported, 3);
}

#[test]
fn an_unknown_op_on_a_live_connection_resets_it() {
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);
    let (mut host, port) = connect_established(&mut m, &mut d, 1024, BUF_ALLOC);
    d.send(&mut m, &guest_hdr(99, 1024, port), &[]);
    d.post_rx(1);
    assert_eq!(d.recv(&mut m)[0].hdr.op(), op::RST);
    assert!(reads_eof(&mut host));
    assert_eq!(m.connection_count(), 0);
}

#[test]
fn a_header_split_across_descriptors_is_fine() {
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);
    let (mut host, port) = connect_established(&mut m, &mut d, 1024, BUF_ALLOC);
    let mut hdr = guest_hdr(op::RW, 1024, port);
    hdr.set_len(10);
    let mut bytes = hdr.as_slice().to_vec();
    bytes.extend_from_slice(b"0123456789");
    // 44 + 10 bytes in pieces of 7, 30, 10, 0, 7 at scattered addresses.
    let pieces = [7usize, 30, 10, 0, 7];
    let mut descs = Vec::new();
    let mut at = 0;
    for (i, len) in pieces.iter().enumerate() {
        let addr = SCRATCH + i as u64 * 0x1000;
        mem.write_slice(&bytes[at..at + len], GuestAddress(addr)).unwrap();
        descs.push((addr, *len as u32, 0, 0));
        at += len;
    }
    d.tx.publish_raw(&descs, true);
    d.run_tx(&mut m);
    assert_eq!(read_exactly(&mut host, 10), b"0123456789");
    assert_eq!(m.counters().tx_malformed, 0);
}

/// Publishes `descs` on the tx queue, runs tx, and checks the chain came back as malformed.
fn expect_malformed(d: &mut Driver<'_>, m: &mut VsockMuxer, descs: &[(u64, u32, u16, u16)], link: bool, what: &str) {
    let before = m.counters().tx_malformed;
    d.tx.publish_raw(descs, link);
    let used = d.run_tx(m);
    assert_eq!(used.len(), 1, "{what}: the chain comes back");
    assert_eq!(m.counters().tx_malformed, before + 1, "{what}: counted as malformed");
}

#[test]
fn malformed_tx_chains_are_dropped_and_the_device_goes_on() {
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);
    let (mut host, port) = connect_established(&mut m, &mut d, 1024, BUF_ALLOC);
    let buf = SCRATCH;
    let write_hdr = |hdr: &VsockPacketHeader| mem.write_slice(hdr.as_slice(), GuestAddress(buf)).unwrap();
    let mut rw = guest_hdr(op::RW, 1024, port);

    // A header shorter than 44 bytes, whole or split.
    write_hdr(&rw);
    expect_malformed(&mut d, &mut m, &[(buf, 40, 0, 0)], true, "short header");
    expect_malformed(&mut d, &mut m, &[(buf, 20, 0, 0), (buf + 20, 20, 0, 0)], true, "short split header");
    // `len` larger than the data in the chain.
    rw.set_len(100);
    write_hdr(&rw);
    expect_malformed(&mut d, &mut m, &[(buf, 44, 0, 0), (buf + 44, 99, 0, 0)], true, "len past the chain");
    // `len` over the 64 KiB cap, even with the bytes present.
    rw.set_len(MAX_PKT_DATA as u32 + 1);
    write_hdr(&rw);
    expect_malformed(
        &mut d,
        &mut m,
        &[(buf, 44, 0, 0), (buf + 44, MAX_PKT_DATA as u32 + 1, 0, 0)],
        true,
        "len over the cap",
    );
    rw.set_len(u32::MAX);
    write_hdr(&rw);
    expect_malformed(&mut d, &mut m, &[(buf, 44, 0, 0)], true, "len u32::MAX");
    // A device-writable descriptor in a tx chain.
    rw.set_len(4);
    write_hdr(&rw);
    expect_malformed(&mut d, &mut m, &[(buf, 44, 0, 0), (buf + 44, 4, WRITE, 0)], true, "writable in tx");
    // Outside guest memory, wrapping the address space, straddling the end.
    expect_malformed(&mut d, &mut m, &[(buf, 44, 0, 0), (48 << 20, 4, 0, 0)], true, "beyond memory");
    expect_malformed(&mut d, &mut m, &[(u64::MAX - 10, 44, 0, 0)], true, "address wraps");
    expect_malformed(&mut d, &mut m, &[((48 << 20) - 20, 44, 0, 0)], true, "straddles the end");
    // Descriptor loops: virtio-queue would stop at the queue size; the chain cap stops us sooner.
    let at = d.tx.next_head(1);
    expect_malformed(&mut d, &mut m, &[(buf, 44, NEXT, at)], false, "self loop");
    let at = d.tx.next_head(2);
    expect_malformed(&mut d, &mut m, &[(buf, 20, NEXT, at + 1), (buf + 20, 24, NEXT, at)], false, "two-cycle");
    // A NEXT index beyond the table ends the chain there: 44 bytes of header, 4 of data missing.
    let at = d.tx.next_head(1);
    expect_malformed(&mut d, &mut m, &[(buf, 44, NEXT, at.wrapping_add(1000))], false, "next out of range");
    // A head index beyond the queue: nothing to walk, and add_used refuses it.
    let before = m.counters().tx_malformed;
    d.tx.publish_head(300);
    m.process_tx(&mem, &mut d.tx.queue);
    assert!(d.tx.take_used().is_empty());
    assert_eq!(m.counters().tx_malformed, before + 1);

    // None of it reached the host, and the connection still works.
    d.send(&mut m, &guest_hdr(op::RW, 1024, port), b"ok");
    assert_eq!(read_exactly(&mut host, 2), b"ok");
    assert_eq!(m.connection_count(), 1);
    assert_still_works(&mut m, &mut d);
}

#[test]
fn a_lying_avail_index_stalls_nothing_and_panics_nothing() {
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);
    // Claims 1000 new buffers in a 256-entry ring: virtio-queue refuses to iterate.
    d.tx.set_avail_idx(1000);
    assert!(!m.process_tx(&mem, &mut d.tx.queue));
    d.rx.set_avail_idx(1000);
    assert!(!m.process_rx(&mem, &mut d.rx.queue));
}

#[test]
fn bad_rx_buffers_are_dropped_and_the_packet_goes_in_the_next() {
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);
    d.send(&mut m, &guest_hdr(op::RW, 7, 8), b"x"); // owes an RST
    let slot = SCRATCH + 0x10_0000;
    // Read-only descriptor, too short for a header, out of memory, then a good one.
    d.rx.publish_raw(&[(slot, 44, 0, 0), (slot + 44, 100, WRITE, 0)], true);
    d.rx.publish_raw(&[(slot, 43, WRITE, 0)], true);
    d.rx.publish_raw(&[(48 << 20, 100, WRITE, 0)], true);
    d.post_rx(1);
    let pkts = d.recv(&mut m);
    assert_eq!(d.rx_dropped, 3);
    assert_eq!(m.counters().rx_malformed, 3);
    assert_eq!(pkts.len(), 1);
    assert_eq!(pkts[0].hdr.op(), op::RST);
}

#[test]
fn a_header_only_rx_buffer_carries_control_packets() {
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);
    d.send(&mut m, &guest_hdr(op::RW, 7, 8), b"x");
    let slot = SCRATCH + 0x10_0000;
    d.rx.publish_raw(&[(slot, HDR_SIZE as u32, WRITE, 0)], true);
    d.recv(&mut m);
    let used = {
        let mut hdr = VsockPacketHeader::default();
        mem.read_slice(hdr.as_mut_slice(), GuestAddress(slot)).unwrap();
        hdr
    };
    assert_eq!(used.op(), op::RST);
}

#[test]
fn withheld_rx_buffers_pause_tx_instead_of_growing_a_queue() {
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);
    // 256 unroutable packets, each owing an RST, and no rx buffers.
    for i in 0..256 {
        d.queue_packet(&guest_hdr(op::CREDIT_UPDATE, 10_000 + i, 1), &[]);
    }
    assert_eq!(d.run_tx(&mut m).len(), 256);
    for i in 0..10 {
        d.queue_packet(&guest_hdr(op::CREDIT_UPDATE, 20_000 + i, 1), &[]);
    }
    assert_eq!(d.run_tx(&mut m).len(), 0, "tx pauses while 256 replies are owed");
    assert!(!m.has_deferred_work(), "and does not spin");
    d.post_rx(64);
    assert_eq!(d.recv(&mut m).len(), 64);
    assert!(m.has_deferred_work());
    assert_eq!(d.run_tx(&mut m).len(), 10, "tx resumes once rx drained some");
}

#[test]
fn a_connection_flood_stops_at_the_cap() {
    raise_fd_limit(4 * MAX_CONNECTIONS as u64 + 256);
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);
    let listener = UnixListener::bind(format!("{}_6000", dir.socket().display())).unwrap();
    listener.set_nonblocking(true).unwrap();
    let mut accepted = Vec::new();
    let flood = MAX_CONNECTIONS + 50;
    for i in 0..flood {
        d.send(&mut m, &guest_hdr(op::REQUEST, 50_000 + i as u32, 6000), &[]);
        while let Ok((s, _)) = listener.accept() {
            accepted.push(s);
        }
    }
    assert_eq!(m.connection_count(), MAX_CONNECTIONS);
    let mut responses = 0;
    let mut rsts = 0;
    while responses + rsts < flood {
        d.post_rx(64);
        let pkts = d.recv(&mut m);
        assert!(!pkts.is_empty());
        for p in pkts {
            match p.hdr.op() {
                op::RESPONSE => responses += 1,
                op::RST => rsts += 1,
                other => panic!("op {other}: {:?} after {responses}+{rsts}", p.hdr),
            }
        }
    }
    assert_eq!((responses, rsts), (MAX_CONNECTIONS, 50));
    assert_eq!(m.counters().guest_refused, 50);
    // Host connections over the cap are closed at once.
    let mut host = UnixStream::connect(dir.socket()).unwrap();
    host.write_all(b"CONNECT 1024\n").unwrap();
    m.poll_host(10);
    assert!(reads_eof(&mut host));
    // Room again once one ends.
    d.send(&mut m, &guest_hdr(op::RST, 50_000, 6000), &[]);
    assert_eq!(m.connection_count(), MAX_CONNECTIONS - 1);
}

fn raise_fd_limit(want: u64) {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into `lim`, which lives across the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 && lim.rlim_cur < want {
        lim.rlim_cur = want.min(lim.rlim_max);
        // SAFETY: setrlimit reads one valid rlimit.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
    }
}

#[test]
fn reset_drops_connections_and_keeps_the_listener() {
    let dir = TempDir::new();
    let mem = guest_memory();
    let mut m = muxer(&dir);
    let mut d = Driver::new(&mem);
    let (mut host, _) = connect_established(&mut m, &mut d, 1024, BUF_ALLOC);
    m.reset();
    assert!(reads_eof(&mut host));
    assert_eq!(m.connection_count(), 0);
    let mut d2 = Driver::new(&mem);
    connect_established(&mut m, &mut d2, 1024, BUF_ALLOC);
}

// ---- the device and its worker ----------------------------------------------------------------

mod device {
    use super::*;
    use crate::devices::virtio::test_utils::CountingInterrupt;
    use crate::devices::virtio::vsock::Vsock;
    use crate::devices::virtio::{device_type, ActiveQueue, VirtioDevice};
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    #[test]
    fn identity_config_and_cid_checks() {
        let dir = TempDir::new();
        let dev = Vsock::new(0x1234_5678, dir.socket()).unwrap();
        assert_eq!(dev.device_type(), device_type::VSOCK);
        assert_eq!(dev.queue_max_sizes(), &[256, 256, 256]);
        assert_eq!(dev.avail_features(), 0);
        let mut cfg = [0xffu8; 12];
        dev.read_config(0, &mut cfg);
        assert_eq!(cfg, [0x78, 0x56, 0x34, 0x12, 0, 0, 0, 0, 0, 0, 0, 0]);
        let mut hi = [0xffu8; 2];
        dev.read_config(2, &mut hi);
        assert_eq!(hi, [0x34, 0x12]);
        dev.read_config(u64::MAX, &mut hi);
        assert_eq!(hi, [0, 0]);

        assert!(Vsock::new(9, dir.socket()).is_err(), "the path is taken");
        for cid in [0, 1, 2, u64::from(u32::MAX), 1 << 32] {
            assert!(Vsock::new(cid, dir.path().join(format!("c{cid}"))).is_err(), "cid {cid}");
        }
        drop(dev);
        assert!(!dir.socket().exists(), "the socket file goes with the device");
    }

    fn active_queues(d: &Driver<'_>) -> (Vec<ActiveQueue>, EventFd, EventFd) {
        let mk = |queue| ActiveQueue { queue, notify: EventFd::new(EFD_NONBLOCK).unwrap() };
        let rx = mk(d.rx.device_queue());
        let tx = mk(d.tx.device_queue());
        // The event queue is never used; any valid ring will do.
        let ev = mk(d.rx.device_queue());
        let (rx_kick, tx_kick) = (rx.notify.try_clone().unwrap(), tx.notify.try_clone().unwrap());
        (vec![rx, tx, ev], rx_kick, tx_kick)
    }

    fn wait_rx(d: &mut Driver<'_>) -> Vec<RxPacket> {
        let end = Instant::now() + Duration::from_secs(5);
        loop {
            let pkts = d.collect_rx();
            if !pkts.is_empty() {
                return pkts;
            }
            assert!(Instant::now() < end, "the worker delivered nothing");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    #[test]
    fn the_worker_serves_a_host_connection_and_reset_stops_it() {
        let dir = TempDir::new();
        let mem = guest_memory();
        let mut dev = Vsock::new(GUEST_CID, dir.socket()).unwrap();
        let interrupt = Arc::new(CountingInterrupt::default());

        for round in 0..2 {
            let mut d = Driver::new(&mem);
            d.post_rx(8);
            let (queues, rx_kick, tx_kick) = active_queues(&d);
            dev.activate(mem.clone(), interrupt.clone(), 0, queues).unwrap();
            assert!(dev.activate(mem.clone(), interrupt.clone(), 0, active_queues(&d).0).is_err());

            let mut host = UnixStream::connect(dir.socket()).unwrap();
            host.write_all(b"CONNECT 1024\n").unwrap();
            let req = wait_rx(&mut d)[0].hdr;
            assert_eq!(req.op(), op::REQUEST);
            assert!(interrupt.0.load(Ordering::SeqCst) > 0);
            d.queue_packet(&guest_hdr(op::RESPONSE, 1024, req.src_port()), &[]);
            tx_kick.write(1).unwrap();
            assert_eq!(read_line(&mut host), format!("OK {}\n", req.src_port()), "round {round}");

            host.write_all(b"over the worker").unwrap();
            let data = wait_rx(&mut d);
            assert_eq!(data[0].data, b"over the worker");
            let _ = rx_kick.write(1);

            assert!(dev.reset());
            assert!(reads_eof(&mut host), "reset drops connections");
        }
        drop(dev);
        assert!(!dir.socket().exists());
    }

    #[test]
    fn a_suspension_for_a_fork_keeps_the_connections_a_reset_drops() {
        let dir = TempDir::new();
        let mem = guest_memory();
        let mut dev = Vsock::new(GUEST_CID, dir.socket()).unwrap();
        let interrupt = Arc::new(CountingInterrupt::default());
        let mut d = Driver::new(&mem);
        d.post_rx(8);
        let (queues, _, tx_kick) = active_queues(&d);
        dev.activate(mem.clone(), interrupt.clone(), 0, queues).unwrap();
        let mut host = UnixStream::connect(dir.socket()).unwrap();
        host.write_all(b"CONNECT 1024\n").unwrap();
        let req = wait_rx(&mut d)[0].hdr;
        d.queue_packet(&guest_hdr(op::RESPONSE, 1024, req.src_port()), &[]);
        tx_kick.write(1).unwrap();
        assert_eq!(read_line(&mut host), format!("OK {}\n", req.src_port()));

        assert_eq!(dev.suspend().unwrap(), crate::devices::virtio::persist::DeviceState::Stateless);
        host.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        let mut byte = [0u8; 1];
        let err = host.read(&mut byte).expect_err("no end of file: the connection stays");
        assert!(matches!(err.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut), "{err}");
        // The next activation carries on with it; a reset then drops it.
        dev.activate(mem.clone(), interrupt.clone(), 0, active_queues(&d).0).unwrap();
        assert!(dev.reset());
        assert!(reads_eof(&mut host), "reset drops connections");
    }

    /// An event queue at SCRATCH with its buffers after it, each filled with 0xff.
    fn event_ring(mem: &vm_memory::GuestMemoryMmap) -> Ring<'_> {
        let ring = Ring::new(mem, SCRATCH, SCRATCH + 0x1_0000);
        mem.write_slice(&[0xff; 0x100], GuestAddress(SCRATCH + 0x1_0000)).unwrap();
        ring
    }

    #[test]
    fn a_transport_reset_takes_the_first_buffer_with_room() {
        use crate::devices::virtio::vsock::worker::post_transport_reset;
        let mem = guest_memory();
        let mut ev = event_ring(&mem);
        let mut queue = ev.device_queue();
        assert!(!post_transport_reset(&mem, &mut queue), "no buffer posted: nothing used");
        let read_only = ev.publish_raw(&[(SCRATCH + 0x1_0000, 8, 0, 0)], true);
        let too_small = ev.publish_raw(&[(SCRATCH + 0x1_0010, 2, WRITE, 0)], true);
        let good = ev.publish_raw(&[(SCRATCH + 0x1_0020, 8, WRITE, 0)], true);
        assert!(post_transport_reset(&mem, &mut queue));
        assert_eq!(ev.take_used(), vec![(read_only, 0), (too_small, 0), (good, 4)]);
        let event: [u8; 8] = mem.read_obj(GuestAddress(SCRATCH + 0x1_0020)).unwrap();
        assert_eq!(event, [0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff], "le32 id 0 (TRANSPORT_RESET), nothing more");
        let untouched: [u8; 8] = mem.read_obj(GuestAddress(SCRATCH + 0x1_0000)).unwrap();
        assert_eq!(untouched, [0xff; 8]);
    }

    #[test]
    fn a_restored_device_announces_the_reset_once() {
        let dir = TempDir::new();
        let mem = guest_memory();
        let mut dev = Vsock::new(GUEST_CID, dir.socket()).unwrap();
        let interrupt = Arc::new(CountingInterrupt::default());
        dev.queue_transport_reset();
        for round in 0..2 {
            let d = Driver::new(&mem);
            let mut ev = event_ring(&mem);
            let head = ev.publish_raw(&[(SCRATCH + 0x1_0000, 4, WRITE, 0)], true);
            let (mut queues, _, _) = active_queues(&d);
            queues[2] = ActiveQueue { queue: ev.device_queue(), notify: EventFd::new(EFD_NONBLOCK).unwrap() };
            dev.activate(mem.clone(), interrupt.clone(), 0, queues).unwrap();
            let end = Instant::now() + Duration::from_millis(if round == 0 { 5000 } else { 200 });
            let mut used = Vec::new();
            while used.is_empty() && Instant::now() < end {
                used = ev.take_used();
                std::thread::sleep(Duration::from_millis(2));
            }
            if round == 0 {
                assert_eq!(used, vec![(head, 4)], "the restore's activation tells the driver");
                assert!(interrupt.0.load(Ordering::SeqCst) > 0);
            } else {
                assert!(used.is_empty(), "a later activation (a driver reload) does not: {used:?}");
            }
            assert!(dev.reset());
        }
    }

    #[test]
    fn host_connections_wait_until_the_driver_has_handled_the_reset() {
        let dir = TempDir::new();
        let mem = guest_memory();
        let mut dev = Vsock::new(GUEST_CID, dir.socket()).unwrap();
        let interrupt = Arc::new(CountingInterrupt::default());
        dev.queue_transport_reset();
        let mut d = Driver::new(&mem);
        d.post_rx(8);
        let mut ev = event_ring(&mem);
        ev.publish_raw(&[(SCRATCH + 0x1_0000, 4, WRITE, 0)], true);
        let (mut queues, _, _) = active_queues(&d);
        let event_kick = EventFd::new(EFD_NONBLOCK).unwrap();
        queues[2] = ActiveQueue { queue: ev.device_queue(), notify: event_kick.try_clone().unwrap() };
        dev.activate(mem.clone(), interrupt, 0, queues).unwrap();

        // Posted at once; a host connection made now is not passed to the guest yet.
        let end = Instant::now() + Duration::from_secs(5);
        while ev.take_used().is_empty() {
            assert!(Instant::now() < end, "the reset event was never posted");
            std::thread::sleep(Duration::from_millis(2));
        }
        let mut host = UnixStream::connect(dir.socket()).unwrap();
        host.write_all(b"CONNECT 1024\n").unwrap();
        std::thread::sleep(Duration::from_millis(100));
        assert!(d.collect_rx().is_empty(), "no request reaches a driver still handling the reset");

        // The driver re-posts its event buffer and kicks: now the connection goes through.
        event_kick.write(1).unwrap();
        let req = wait_rx(&mut d)[0].hdr;
        assert_eq!(req.op(), op::REQUEST);
        assert!(dev.reset());
    }
}
