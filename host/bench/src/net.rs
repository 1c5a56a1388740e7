//! `vmctl bench net`: network egress from a guest, beside the same client on the host, in one
//! run. The servers are vmctl's own, on 127.0.0.1 (started and stopped here); the guest reaches
//! them as `bench.test`, overridden to 127.0.0.1 and allowed by an explicit CIDR — no name is
//! resolved by DNS and no packet goes anywhere else.
//!
//! - **Download**: `curl` fetches `--size-mib` MiB (default 1 GiB) over HTTP, in the guest
//!   through the transparent path (`--noproxy '*'`: fake-IP DNS, the nftables redirect, the
//!   agent, vsock, the host proxy) and through the HTTP proxy, and on the host straight from the
//!   server (the anchor). Throughput from curl's own `time_total`; the ratio is guest / host.
//! - **Connection set-up**: `--connects` sequential connect → one byte each way → close, by a
//!   Python client, in the guest (by name, so each includes its DNS lookup, and by the name's
//!   fake address, without it) and on the host to 127.0.0.1. Medians and p90s.
//! - **Concurrent connections**: the guest opens `--concurrent` connections (default 1,000),
//!   exchanges a byte on each and holds them all open at once; the server counts how many it
//!   held at the peak. Errors are counted, not hidden.
//!
//! - **HTTPS, intercepted vs passthrough**: `--https-requests` GETs by Python's `http.client`
//!   to two TLS servers of vmctl's (certificates from a "public" test CA the proxy is told to
//!   trust): `bench.test`, which a secret is bound to (so the proxy ends the guest's TLS,
//!   verifies the server's and puts the secret in the `Authorization` header), and `pass.test`,
//!   which it carries end to end. Each on one kept-alive connection and with a new connection
//!   per request; medians, p90s, requests per second, and intercepted / passthrough.
//!
//! Needs the standard bundle (curl and python3 in the guest) and curl and python3 on the host.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use umbra_api::methods::StartParams;
use umbra_api::session::{NetworkMode, NetworkPolicy};
use umbra_runtime::session::{ExecRequest, Session};

use umbra_api::BackendChoice;

#[derive(Args, Debug)]
pub struct NetBenchArgs {
    #[arg(long, default_value = "standard")]
    bundle: String,
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendChoice,
    /// Size of the download, MiB.
    #[arg(long, default_value_t = 1024)]
    size_mib: u64,
    /// Sequential connections timed for the set-up latency.
    #[arg(long, default_value_t = 200)]
    connects: usize,
    /// Connections held open at once by the guest.
    #[arg(long, default_value_t = 1000)]
    concurrent: usize,
    /// HTTPS requests timed per path (intercepted, passthrough) and way (kept alive, new
    /// connection each).
    #[arg(long, default_value_t = 200)]
    https_requests: usize,
    /// Guest memory, MiB.
    #[arg(long, default_value_t = 1024)]
    memory: u32,
    #[arg(long, default_value_t = 120, env = "UMBRA_BOOT_TIMEOUT_SECS")]
    boot_timeout: u64,
}

const NAME: &str = "bench.test";
/// A name no secret is bound to: its TLS is end to end.
const PASS_NAME: &str = "pass.test";
const COMMAND_TIMEOUT: Duration = Duration::from_secs(900);

/// Times `n` connect → byte → byte → close to (host, port); prints the median and p90 in ms.
const CONNECT_PY: &str = r#"
import socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
times = []
for _ in range(n):
    t = time.perf_counter()
    s = socket.create_connection((host, port), timeout=30)
    s.sendall(b"x")
    assert s.recv(1) == b"x"
    s.close()
    times.append(time.perf_counter() - t)
times.sort()
print("%.3f %.3f" % (times[len(times) // 2] * 1000, times[len(times) * 9 // 10] * 1000))
"#;

/// Opens `n` connections, a byte each way on each, all held open at once; prints "ok errors".
const HOLD_PY: &str = r#"
import resource, socket, sys
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, n + 64)), hard))
addr = socket.gethostbyname(host)
held, errors = [], 0
for _ in range(n):
    try:
        s = socket.create_connection((addr, port), timeout=30)
        s.sendall(b"x")
        if s.recv(1) != b"x":
            raise OSError("no echo")
        held.append(s)
    except OSError as e:
        errors += 1
        if errors <= 3:
            print("error:", e)
# All open now: each answers once more before any is closed.
for s in held:
    s.sendall(b"y")
ok = sum(1 for s in held if s.recv(1) == b"y")
print(ok, errors + len(held) - ok)
"#;

/// `n` HTTPS GETs to (host, port), trusting the session's bundle and `/tmp/bench-ca.pem`, on one
/// kept-alive connection (`keep`) or a new one each (`new`), with `Authorization: Bearer
/// $BENCH_TOKEN`; prints median and p90 in ms and requests per second.
const HTTPS_PY: &str = r#"
import http.client, os, ssl, sys, time
host, port, n, way = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ctx = ssl.create_default_context(cafile=os.environ.get('SSL_CERT_FILE'))
ctx.load_verify_locations(sys.argv[5])
# The host's anchor connects to 127.0.0.1, not to a name in the certificate.
ctx.check_hostname = len(sys.argv) < 7
headers = {'Authorization': 'Bearer ' + os.environ.get('BENCH_TOKEN', 'none')}
times, conn = [], None
start = time.perf_counter()
for _ in range(n):
    t = time.perf_counter()
    if conn is None or way == 'new':
        if conn is not None:
            conn.close()
        conn = http.client.HTTPSConnection(host, port, context=ctx, timeout=30)
    conn.request('GET', '/', headers=headers)
    r = conn.getresponse()
    body = r.read()
    assert r.status == 200 and body == b'ok', (r.status, body)
    times.append(time.perf_counter() - t)
total = time.perf_counter() - start
times.sort()
print('%.3f %.3f %.1f' % (times[len(times) // 2] * 1000, times[len(times) * 9 // 10] * 1000, n / total))
"#;

/// vmctl's HTTPS servers: one per name, certificates of a test CA made here (`ca_pem`); each
/// answers every request on a connection with `ok`, and records whether the secret's value
/// (and never its placeholder) arrived.
struct HttpsServers {
    ca_pem: String,
    intercepted: u16,
    passthrough: u16,
    saw_value: Arc<AtomicUsize>,
}

const BENCH_SECRET: &str = "bench-secret-value";

async fn https_servers() -> anyhow::Result<HttpsServers> {
    let ca = umbra_runtime::egress::SessionCa::generate("bench public side")?;
    let saw_value = Arc::new(AtomicUsize::new(0));
    let mut ports = Vec::new();
    for name in [NAME, PASS_NAME] {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        ports.push(listener.local_addr()?.port());
        let acceptor = tokio_rustls::TlsAcceptor::from(ca.server_config(name)?);
        let saw = saw_value.clone();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, saw) = (acceptor.clone(), saw.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else { return };
                    let mut r = BufReader::new(tls);
                    loop {
                        let mut head = String::new();
                        loop {
                            let mut line = String::new();
                            match r.read_line(&mut line).await {
                                Ok(0) | Err(_) => return,
                                Ok(_) if line == "\r\n" => break,
                                Ok(_) => head.push_str(&line),
                            }
                        }
                        if head.contains(BENCH_SECRET) {
                            saw.fetch_add(1, Ordering::Relaxed);
                        }
                        if r.get_mut().write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok").await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
    }
    Ok(HttpsServers { ca_pem: ca.pem().to_string(), intercepted: ports[0], passthrough: ports[1], saw_value })
}

fn three(out: &str) -> anyhow::Result<(f64, f64, f64)> {
    let v: Vec<f64> = out.split_whitespace().map(str::parse).collect::<Result<_, _>>().context("parse")?;
    match v[..] {
        [a, b, c] => Ok((a, b, c)),
        _ => bail!("expected three numbers, got {out:?}"),
    }
}

/// vmctl's servers: HTTP (`GET /N` answers N bytes) and echo (each byte back; counts the
/// connections open at once).
struct Servers {
    http: u16,
    echo: u16,
    open: Arc<AtomicUsize>,
    peak: Arc<AtomicUsize>,
}

async fn servers() -> anyhow::Result<Servers> {
    let http = TcpListener::bind("127.0.0.1:0").await?;
    let echo = TcpListener::bind("127.0.0.1:0").await?;
    let (open, peak) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let s = Servers {
        http: http.local_addr()?.port(),
        echo: echo.local_addr()?.port(),
        open: open.clone(),
        peak: peak.clone(),
    };
    tokio::spawn(async move {
        while let Ok((stream, _)) = http.accept().await {
            tokio::spawn(serve_http(stream));
        }
    });
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = echo.accept().await {
            let (open, peak) = (open.clone(), peak.clone());
            tokio::spawn(async move {
                let now = open.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(now, Ordering::SeqCst);
                let mut b = [0u8; 1];
                while let Ok(1) = stream.read(&mut b).await {
                    if stream.write_all(&b).await.is_err() {
                        break;
                    }
                }
                open.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    Ok(s)
}

async fn serve_http(stream: tokio::net::TcpStream) {
    let mut reader = BufReader::new(stream);
    let mut request = String::new();
    if reader.read_line(&mut request).await.is_err() {
        return;
    }
    let mut line = String::new();
    loop {
        line.clear();
        match reader.read_line(&mut line).await {
            Ok(0) | Err(_) => return,
            Ok(_) if line.trim().is_empty() => break,
            Ok(_) => {}
        }
    }
    let size: u64 = request.split_whitespace().nth(1).and_then(|p| p.trim_start_matches('/').parse().ok()).unwrap_or(0);
    let mut stream = reader.into_inner();
    let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n");
    if stream.write_all(head.as_bytes()).await.is_err() {
        return;
    }
    let chunk = vec![0u8; 256 * 1024];
    let mut left = size;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        if stream.write_all(&chunk[..n]).await.is_err() {
            return;
        }
        left -= n as u64;
    }
    let _ = stream.shutdown().await;
}

/// Runs `argv` in the guest; its stdout, or an error with its stderr.
async fn guest(session: &Arc<Session>, argv: &[&str], env: &[(&str, &str)]) -> anyhow::Result<String> {
    let req = ExecRequest {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        timeout: Some(COMMAND_TIMEOUT),
        ..Default::default()
    };
    let out = session.spawn(req).await?.output().await;
    if out.exit.code != Some(0) {
        bail!("{argv:?} in the guest: {:?}: {}", out.exit, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `argv` on the host; its stdout.
async fn host(argv: &[&str]) -> anyhow::Result<String> {
    let out = tokio::process::Command::new(argv[0])
        .args(&argv[1..])
        .output()
        .await
        .with_context(|| format!("run {} on the host", argv[0]))?;
    if !out.status.success() {
        bail!("{argv:?} on the host: {}: {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// curl's bytes and seconds → MiB/s.
fn curl_rate(out: &str) -> anyhow::Result<f64> {
    let mut it = out.split_whitespace();
    let (Some(bytes), Some(secs)) = (it.next(), it.next()) else { bail!("curl printed {out:?}") };
    let (bytes, secs): (f64, f64) = (bytes.parse()?, secs.parse()?);
    Ok(bytes / (1024.0 * 1024.0) / secs)
}

fn two(out: &str) -> anyhow::Result<(f64, f64)> {
    let v: Vec<f64> = out.split_whitespace().map(str::parse).collect::<Result<_, _>>().context("parse")?;
    match v[..] {
        [a, b] => Ok((a, b)),
        _ => bail!("expected two numbers, got {out:?}"),
    }
}

pub async fn net(args: NetBenchArgs) -> anyhow::Result<()> {
    let s = servers().await?;
    let tls = https_servers().await?;
    // The proxy trusts the test CA upstream (as a company's CA would be, `trust_ca`).
    let ca_file = std::env::temp_dir().join(format!("umbra-bench-ca-{}.pem", std::process::id()));
    std::fs::write(&ca_file, &tls.ca_pem)?;
    let extra = serde_json::json!({ "trust_ca": [ca_file] });
    let manager = crate::boot::bench_manager(args.memory, args.boot_timeout, &args.bundle, args.backend, extra)?;
    let policy = NetworkPolicy {
        mode: NetworkMode::Allowlist,
        allow_domains: vec![NAME.into(), PASS_NAME.into()],
        allow_cidrs: vec!["127.0.0.1/32".into()],
        resolve: [(NAME.to_string(), "127.0.0.1".parse()?), (PASS_NAME.to_string(), "127.0.0.1".parse()?)].into(),
        ..Default::default()
    };
    let settings = umbra_api::session::SettingsPatch { network: Some(policy), ..Default::default() };
    let secret = umbra_api::secrets::SecretSpec {
        name: "BENCH_TOKEN".into(),
        value: Some(umbra_api::secrets::SecretValue::new(BENCH_SECRET)),
        from_env: None,
        hosts: vec![NAME.into()],
        inject: vec![umbra_api::secrets::Inject::Header],
    };
    let start = StartParams { name: "bench-net".into(), settings, secrets: vec![secret], ..Default::default() };
    let session = manager.start(start).await?;
    let result = async {
        measure(&args, &s, &session).await?;
        measure_https(&args, &tls, &session).await
    }
    .await;
    let _ = manager.delete("bench-net").await;
    let _ = std::fs::remove_file(&ca_file);
    result
}

async fn measure_https(args: &NetBenchArgs, tls: &HttpsServers, session: &Arc<Session>) -> anyhow::Result<()> {
    let n = args.https_requests.to_string();
    // The test CA, for the guest's end-to-end connections (the intercepted ones present the
    // session CA's certificates, which the guest trusts already).
    let ca_write = format!("cat > /tmp/bench-ca.pem <<'PEM'\n{}PEM\n", tls.ca_pem);
    guest(session, &["sh", "-c", &ca_write], &[]).await?;
    let host_ca = std::env::temp_dir().join(format!("umbra-bench-ca-host-{}.pem", std::process::id()));
    std::fs::write(&host_ca, &tls.ca_pem)?;
    let host_ca = host_ca.display().to_string();
    println!("https      {} requests each; intercepted = {NAME} (a secret bound), passthrough = {PASS_NAME}", n);
    for way in ["keep", "new"] {
        let label = if way == "keep" { "kept-alive connection" } else { "new connection each" };
        let (i50, i90, irps) = three(
            &guest(
                session,
                &["python3", "-c", HTTPS_PY, NAME, &tls.intercepted.to_string(), &n, way, "/tmp/bench-ca.pem"],
                &[],
            )
            .await?,
        )?;
        let (p50, p90, prps) = three(
            &guest(
                session,
                &["python3", "-c", HTTPS_PY, PASS_NAME, &tls.passthrough.to_string(), &n, way, "/tmp/bench-ca.pem"],
                &[],
            )
            .await?,
        )?;
        // The anchor: the same client on the host, straight to the server.
        let port = tls.passthrough.to_string();
        let (h50, h90, hrps) =
            three(&host(&["python3", "-c", HTTPS_PY, "127.0.0.1", &port, &n, way, &host_ca, "no-name"]).await?)?;
        println!("https      {label}");
        println!("             host (anchor)      median {h50:>7.3} ms  p90 {h90:>7.3} ms  {hrps:>7.1} req/s");
        println!("             guest passthrough  median {p50:>7.3} ms  p90 {p90:>7.3} ms  {prps:>7.1} req/s");
        println!(
            "             guest intercepted  median {i50:>7.3} ms  p90 {i90:>7.3} ms  {irps:>7.1} req/s   intercepted/passthrough latency {:.2}",
            i50 / p50
        );
    }
    let _ = std::fs::remove_file(&host_ca);
    let saw = tls.saw_value.load(Ordering::Relaxed);
    println!("https      the intercepted server got the secret's value in {saw} requests");
    if saw < 2 * args.https_requests {
        bail!("the secret reached the intercepted server in {saw} of {} requests", 2 * args.https_requests);
    }
    Ok(())
}

async fn measure(args: &NetBenchArgs, s: &Servers, session: &Arc<Session>) -> anyhow::Result<()> {
    let bytes = args.size_mib * 1024 * 1024;
    let w = "%{size_download} %{time_total}\n";
    let url_guest = format!("http://{NAME}:{}/{bytes}", s.http);
    let url_host = format!("http://127.0.0.1:{}/{bytes}", s.http);
    println!(
        "vmctl bench net: {} MiB download, {} set-ups, {} held connections",
        args.size_mib, args.connects, args.concurrent
    );

    let host_rate = curl_rate(&host(&["curl", "-sS", "-o", "/dev/null", "-w", w, &url_host]).await?)?;
    let transparent = curl_rate(
        &guest(session, &["curl", "-sS", "--noproxy", "*", "-o", "/dev/null", "-w", w, &url_guest], &[]).await?,
    )?;
    let proxied = curl_rate(&guest(session, &["curl", "-sS", "-o", "/dev/null", "-w", w, &url_guest], &[]).await?)?;
    println!("download   host (anchor)      {host_rate:>9.1} MiB/s");
    println!("download   guest transparent  {transparent:>9.1} MiB/s   ratio {:.3}", transparent / host_rate);
    println!("download   guest HTTP proxy   {proxied:>9.1} MiB/s   ratio {:.3}", proxied / host_rate);

    let port = s.echo.to_string();
    let n = args.connects.to_string();
    let (h50, h90) = two(&host(&["python3", "-c", CONNECT_PY, "127.0.0.1", &port, &n]).await?)?;
    let (g50, g90) = two(&guest(session, &["python3", "-c", CONNECT_PY, NAME, &port, &n], &[]).await?)?;
    let fake =
        guest(session, &["python3", "-c", "import socket; print(socket.gethostbyname('bench.test'))"], &[]).await?;
    let (f50, f90) = two(&guest(session, &["python3", "-c", CONNECT_PY, fake.trim(), &port, &n], &[]).await?)?;
    println!("set-up     host (anchor)      median {h50:>7.3} ms  p90 {h90:>7.3} ms");
    println!("set-up     guest by name      median {g50:>7.3} ms  p90 {g90:>7.3} ms   ratio {:.1}", g50 / h50);
    println!("set-up     guest by address   median {f50:>7.3} ms  p90 {f90:>7.3} ms   ratio {:.1}", f50 / h50);

    let held = guest(session, &["python3", "-c", HOLD_PY, NAME, &port, &args.concurrent.to_string()], &[]).await?;
    for line in held.lines().filter(|l| l.starts_with("error:")) {
        println!("concurrent {line}");
    }
    let (ok, errors) = two(held.lines().last().unwrap_or_default())?;
    let peak = s.peak.load(Ordering::SeqCst);
    println!("concurrent {} asked: {ok} held and answering, {errors} errors; server peak {peak} open", args.concurrent);
    if errors > 0.0 || (ok as usize) < args.concurrent {
        bail!("{errors} of {} concurrent connections failed", args.concurrent);
    }
    // Every connection closes once the guest's program has ended.
    for _ in 0..100 {
        if s.open.load(Ordering::SeqCst) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("after      {} still open on the server", s.open.load(Ordering::SeqCst));
    Ok(())
}
