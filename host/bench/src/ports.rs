//! `vmctl bench ports`: a guest server reached through an exposed port, beside the same server
//! program on the host reached directly, in one run. Both are one Python script
//! ([`SERVER_PY`]) on 127.0.0.1 — the guest's through the session's exposed port (host
//! listener, vsock, the agent's forward port, the guest's loopback), the host's straight — and
//! one client, this process, times both the same way:
//!
//! - **Connection set-up**: `--connects` sequential connect → one byte each way → close;
//!   medians and p90s, and their ratio (exposed / direct).
//! - **Throughput**: one connection that receives `--size-mib` MiB; MiB/s and the ratio.
//!
//! Needs the standard bundle (python3 in the guest) and python3 on the host.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use umbra_api::methods::StartParams;
use umbra_api::ports::PortSpec;
use umbra_api::BackendChoice;
use umbra_runtime::session::{ExecRequest, Session};

use crate::boot::ms;

#[derive(Args, Debug)]
pub struct PortsBenchArgs {
    #[arg(long, default_value = "standard")]
    bundle: String,
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendChoice,
    /// Sequential connections timed for the set-up latency.
    #[arg(long, default_value_t = 200)]
    connects: usize,
    /// MiB received on the throughput connection.
    #[arg(long, default_value_t = 256)]
    size_mib: u64,
    /// Guest memory, MiB.
    #[arg(long, default_value_t = 1024)]
    memory: u32,
    #[arg(long, default_value_t = 120, env = "UMBRA_BOOT_TIMEOUT_SECS")]
    boot_timeout: u64,
}

/// The guest port the server listens on.
const GUEST_PORT: u16 = 7007;

/// `python3 -c SERVER_PY PORT`: per connection, the first byte says what to do — `x`: send one
/// byte back, then close; `d` followed by an 8-byte big-endian length: send that many bytes,
/// then close.
const SERVER_PY: &str = r#"
import socket, sys, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(128)
block = b"u" * (1 << 20)
def serve(c):
    try:
        op = c.recv(1)
        if op == b"x":
            c.sendall(b"y")
        elif op == b"d":
            n = b""
            while len(n) < 8:
                n += c.recv(8 - len(n))
            left = int.from_bytes(n, "big")
            while left > 0:
                k = min(left, len(block))
                c.sendall(block[:k]); left -= k
        try:
            c.shutdown(socket.SHUT_WR)
            c.recv(1)
        except OSError:
            pass
    finally:
        c.close()
print("listening", flush=True)
while True:
    c, _ = s.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
"#;

pub async fn ports(args: PortsBenchArgs) -> anyhow::Result<()> {
    let manager =
        crate::boot::bench_manager(args.memory, args.boot_timeout, &args.bundle, args.backend, serde_json::json!({}))?;
    // The direct anchor: the same server on the host.
    let direct_port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let mut host_server = tokio::process::Command::new("python3")
        .args(["-c", SERVER_PY, &direct_port.to_string()])
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("start python3 on the host")?;
    let start = StartParams {
        name: "bench-ports".into(),
        ports: vec![PortSpec { guest_port: GUEST_PORT, host_port: None, bind: None }],
        ..Default::default()
    };
    let session = manager.start(start).await?;
    let result = measure(&args, &session, direct_port).await;
    let _ = manager.delete("bench-ports").await;
    let _ = host_server.kill().await;
    result
}

async fn measure(args: &PortsBenchArgs, session: &Arc<Session>, direct: u16) -> anyhow::Result<()> {
    let exposed = session.ports().first().map(|p| p.host_port).context("the session has no exposed port")?;
    // The guest's server runs while this holds its process.
    let req = ExecRequest {
        argv: vec!["python3".into(), "-c".into(), SERVER_PY.into(), GUEST_PORT.to_string()],
        ..Default::default()
    };
    let _server = session.spawn(req).await?;
    for (port, what) in [(direct, "the host's server"), (exposed, "the guest's server")] {
        let deadline = Instant::now() + Duration::from_secs(60);
        while one_byte(port).await.is_err() {
            if Instant::now() > deadline {
                bail!("{what} did not answer on 127.0.0.1:{port} within 60 s");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    println!(
        "ports      one client on the host: direct = a server on the host; exposed = the same server in the guest, \
         through its exposed port ({} backend)",
        session.info().vm.map(|v| v.backend).unwrap_or_default()
    );
    let (d50, d90) = connects(direct, args.connects).await?;
    let (e50, e90) = connects(exposed, args.connects).await?;
    println!(
        "connect    {} sequential connect + 1 byte each way: direct median {:.2} ms (p90 {:.2}), exposed median {:.2} ms \
         (p90 {:.2}); exposed/direct {:.2}x",
        args.connects,
        ms(d50),
        ms(d90),
        ms(e50),
        ms(e90),
        ms(e50) / ms(d50)
    );
    let bytes = args.size_mib << 20;
    let direct_rate = download(direct, bytes).await?;
    let exposed_rate = download(exposed, bytes).await?;
    println!(
        "throughput {} MiB on one connection: direct {direct_rate:.0} MiB/s, exposed {exposed_rate:.0} MiB/s; \
         exposed/direct {:.2}x",
        args.size_mib,
        exposed_rate / direct_rate
    );
    Ok(())
}

async fn one_byte(port: u16) -> anyhow::Result<()> {
    let mut c = TcpStream::connect(("127.0.0.1", port)).await?;
    c.set_nodelay(true)?;
    c.write_all(b"x").await?;
    let mut b = [0u8; 1];
    c.read_exact(&mut b).await?;
    if &b != b"y" {
        bail!("unexpected answer {b:?}");
    }
    Ok(())
}

/// Median and p90 of `n` sequential connect → byte → byte → close.
async fn connects(port: u16, n: usize) -> anyhow::Result<(Duration, Duration)> {
    let mut times = Vec::with_capacity(n);
    for _ in 0..n.max(1) {
        let t = Instant::now();
        tokio::time::timeout(Duration::from_secs(30), one_byte(port)).await.context("a connection took 30 s")??;
        times.push(t.elapsed());
    }
    times.sort();
    Ok((times[times.len() / 2], times[times.len() * 9 / 10]))
}

/// MiB/s of receiving `bytes` on one connection.
async fn download(port: u16, bytes: u64) -> anyhow::Result<f64> {
    let mut c = TcpStream::connect(("127.0.0.1", port)).await?;
    let t = Instant::now();
    c.write_all(b"d").await?;
    c.write_all(&bytes.to_be_bytes()).await?;
    let mut buf = vec![0u8; 1 << 20];
    let mut got = 0u64;
    while got < bytes {
        let n =
            tokio::time::timeout(Duration::from_secs(60), c.read(&mut buf)).await.context("no bytes for 60 s")??;
        if n == 0 {
            bail!("the server closed after {got} of {bytes} bytes");
        }
        got += n as u64;
    }
    Ok(bytes as f64 / (1024.0 * 1024.0) / t.elapsed().as_secs_f64())
}
