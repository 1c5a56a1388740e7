//! Network egress end to end: real guests under `vmctl run`, the agent's proxies, DNS and
//! nftables redirect inside, the host's egress proxy deciding by name.
//!
//! Network safety: every server here is started by the test on 127.0.0.1 and stopped with it.
//! The guest reaches them only as `allowed.test` (or `denied.test`), overridden to 127.0.0.1
//! with `--resolve`, and 127.0.0.1 is reachable only through `--allow-cidr 127.0.0.1/32`. No
//! name here is ever resolved by DNS: every name the host is asked for is either refused by
//! the policy before resolution or overridden.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use umbra_tests::{test_bundle, workspace_bin, TempDir};

const BODY: &str = "hello from the host\n";

/// A plain HTTP server on 127.0.0.1 answering every request with [`BODY`]; counts requests.
fn http_server() -> (u16, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = hits.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let counter = counter.clone();
            std::thread::spawn(move || {
                let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                // The request head, up to its blank line.
                loop {
                    line.clear();
                    match reader.read_line(&mut line) {
                        Ok(0) | Err(_) => return,
                        Ok(_) if line == "\r\n" || line == "\n" => break,
                        Ok(_) => {}
                    }
                }
                counter.fetch_add(1, Ordering::SeqCst);
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{BODY}",
                    BODY.len()
                );
            });
        }
    });
    (port, hits)
}

/// A process the test owns: killed when dropped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn wait_listening(port: u16) {
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("nothing listens on 127.0.0.1:{port}");
}

fn run_ok(cmd: &mut Command) {
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A test CA and a certificate for `allowed.test` and `other.test` it signed, in `dir` (ca.pem,
/// cert.pem, key.pem).
fn test_pki(dir: &Path) {
    let openssl = || {
        let mut c = Command::new("openssl");
        c.current_dir(dir);
        c
    };
    run_ok(openssl().args(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"]).args([
        "-subj",
        "/CN=Umbra test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    ]));
    run_ok(
        openssl()
            .args(["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=allowed.test"])
            .args(["-keyout", "key.pem", "-out", "cert.csr"]),
    );
    std::fs::write(dir.join("ext.cnf"), "subjectAltName=DNS:allowed.test,DNS:other.test\n").unwrap();
    run_ok(openssl().args(["x509", "-req", "-in", "cert.csr", "-CA", "ca.pem", "-CAkey", "ca.key"]).args([
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
        "-out",
        "cert.pem",
    ]));
}

/// `openssl s_server -WWW` on 127.0.0.1, serving the files in `dir`.
fn tls_server(dir: &Path) -> (Server, u16) {
    let port = free_port();
    let child = Command::new("openssl")
        .current_dir(dir)
        .args(["s_server", "-quiet", "-accept"])
        .arg(format!("127.0.0.1:{port}"))
        .args(["-cert", "cert.pem", "-key", "key.pem", "-WWW"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("openssl s_server (apt: openssl)");
    let server = Server(child);
    wait_listening(port);
    (server, port)
}

/// A bare git repository with one commit, served over dumb HTTP by Python's http.server.
fn git_server(dir: &Path) -> (Server, u16) {
    let work = dir.join("work");
    std::fs::create_dir_all(&work).unwrap();
    let git = |d: &Path| {
        let mut c = Command::new("git");
        c.current_dir(d).env("GIT_CONFIG_NOSYSTEM", "1").env("HOME", dir);
        c
    };
    run_ok(git(&work).args(["init", "-q", "-b", "main"]));
    std::fs::write(work.join("README"), "cloned through the egress proxy\n").unwrap();
    run_ok(git(&work).args(["add", "README"]));
    run_ok(git(&work).args(["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first"]));
    let served = dir.join("srv");
    std::fs::create_dir_all(&served).unwrap();
    run_ok(git(dir).args(["clone", "-q", "--bare", "work", "srv/repo.git"]));
    run_ok(git(&served.join("repo.git")).args(["update-server-info"]));
    let port = free_port();
    let child = Command::new("python3")
        .args(["-m", "http.server", "--bind", "127.0.0.1", "--directory"])
        .arg(&served)
        .arg(port.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let server = Server(child);
    wait_listening(port);
    (server, port)
}

/// An HTTPS server on 127.0.0.1 (the `dir` of [`test_pki`]) that logs each request (host, path,
/// `Authorization`, `X-Token`) to `dir/requests.log`. `/open/…` answers anyone; everything else
/// wants `value` as a Bearer token or a Basic password (401 asking for Basic otherwise, as a git
/// host does) and then serves `dir/srv` (a dumb-HTTP git repository) or says `authenticated`.
fn secret_server(dir: &Path, value: &str) -> (Server, u16) {
    const SERVER: &str = r#"
import base64, functools, http.server, ssl, sys
port, root, value, log = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
class H(http.server.SimpleHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'
    def reply(self, code, body, extra=()):
        self.send_response(code)
        for k, v in extra: self.send_header(k, v)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        auth = self.headers.get('Authorization') or ''
        with open(log, 'a') as f:
            f.write(f"{self.headers.get('Host')} {self.path} auth={auth} x-token={self.headers.get('X-Token')}\n")
        if self.path.startswith('/open/'):
            return self.reply(200, b'open\n')
        ok = auth == 'Bearer ' + value
        if auth.startswith('Basic '):
            ok = base64.b64decode(auth[6:]).decode(errors='replace').split(':', 1)[-1] == value
        if not ok:
            return self.reply(401, b'', [('WWW-Authenticate', 'Basic realm="test"')])
        if self.path.startswith('/repo.git/'):
            return super().do_GET()
        self.reply(200, b'authenticated\n')
    def log_message(self, *args): pass
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain('cert.pem', 'key.pem')
srv = http.server.ThreadingHTTPServer(('127.0.0.1', port), functools.partial(H, directory=root))
srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
srv.serve_forever()
"#;
    let port = free_port();
    let child = Command::new("python3")
        .current_dir(dir)
        .args(["-c", SERVER, &port.to_string()])
        .arg(dir.join("srv"))
        .arg(value)
        .arg(dir.join("requests.log"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let server = Server(child);
    wait_listening(port);
    (server, port)
}

/// An HTTP CONNECT proxy on 127.0.0.1 that wants `user:pass` (407 otherwise) and logs each
/// CONNECT target to `log`, as a company's proxy would be.
fn connect_proxy(log: &Path) -> (Server, u16) {
    const PROXY: &str = r#"
import base64, select, socket, socketserver, sys
port, log = int(sys.argv[1]), sys.argv[2]
want = 'Basic ' + base64.b64encode(b'user:pass').decode()
class H(socketserver.StreamRequestHandler):
    def handle(self):
        line = self.rfile.readline().decode()
        headers = {}
        while True:
            h = self.rfile.readline().decode()
            if h.strip() == '': break
            k, _, v = h.partition(':')
            headers[k.strip().lower()] = v.strip()
        with open(log, 'a') as f:
            f.write(line.strip() + ' auth=' + str(headers.get('proxy-authorization') == want) + '\n')
        if headers.get('proxy-authorization') != want:
            self.wfile.write(b'HTTP/1.1 407 Proxy Authentication Required\r\n\r\n'); return
        host, _, p = line.split()[1].rpartition(':')
        up = socket.create_connection((host.strip('[]'), int(p)))
        self.wfile.write(b'HTTP/1.1 200 Connection established\r\n\r\n'); self.wfile.flush()
        socks = [self.connection, up]
        while True:
            ready, _, _ = select.select(socks, [], [], 60)
            if not ready: return
            for r in ready:
                data = r.recv(65536)
                if not data: return
                (up if r is self.connection else self.connection).sendall(data)
class S(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
S(('127.0.0.1', port), H).serve_forever()
"#;
    let port = free_port();
    let child = Command::new("python3")
        .args(["-c", PROXY, &port.to_string()])
        .arg(log)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let server = Server(child);
    wait_listening(port);
    (server, port)
}

fn vmctl_run(flavor: &str, network: &[&str], script: &str, mounts: &[String]) -> Output {
    vmctl_run_with(flavor, network, script, mounts, &[])
}

fn vmctl_run_with(flavor: &str, network: &[&str], script: &str, mounts: &[String], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(workspace_bin("vmctl"));
    c.envs(env.iter().copied());
    c.args(["run", "--json", "--timeout", "240", "--bundle"]).arg(test_bundle(flavor)).args(network);
    for m in mounts {
        c.args(["--mount", m]);
    }
    c.args(["--", "sh", "-c", script]);
    c.output().unwrap()
}

/// The events of a `vmctl run --json`, and the command's stdout and stderr joined.
struct Run {
    events: Vec<serde_json::Value>,
    stdout: String,
    stderr: String,
    code: Option<i32>,
}

fn parse(out: Output) -> Run {
    let mut run = Run { events: Vec::new(), stdout: String::new(), stderr: String::new(), code: out.status.code() };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        match v["event"].as_str() {
            Some("stdout") => run.stdout.push_str(v["data"].as_str().unwrap_or("")),
            Some("stderr") => run.stderr.push_str(v["data"].as_str().unwrap_or("")),
            _ => {}
        }
        run.events.push(v);
    }
    run.stderr.push_str(&String::from_utf8_lossy(&out.stderr));
    run
}

impl Run {
    fn egress(&self, name: &str) -> Vec<&serde_json::Value> {
        self.events.iter().filter(|e| e["event"] == "egress" && e["name"] == name).collect()
    }
    fn explain(&self) -> String {
        format!("exit {:?}\nstdout:\n{}\nstderr:\n{}\nevents: {:#?}", self.code, self.stdout, self.stderr, self.events)
    }
}

fn allow(port_cidr: bool) -> Vec<&'static str> {
    let mut v = vec!["--allow-domain", "allowed.test", "--resolve", "allowed.test:127.0.0.1"];
    if port_cidr {
        v.extend(["--allow-cidr", "127.0.0.1/32"]);
    }
    v
}

/// The minimal image, with busybox's static `nc`, which knows nothing of proxies: the
/// transparent path (fake-IP DNS, the nftables redirect) carries it to an allowed name, and a
/// denied name fails at once, in the guest's resolver.
#[test]
fn allowlist_transparent_path_and_denied_names_in_the_minimal_image() {
    let (port, hits) = http_server();
    let get = |name: &str, path: &str| {
        format!("printf 'GET /{path} HTTP/1.0\\r\\nHost: {name}\\r\\n\\r\\n' | nc -w 20 {name} {port}")
    };
    let script = format!(
        "t0=$(cut -d' ' -f1 /proc/uptime)
         {denied}; echo denied-exit=$?
         t1=$(cut -d' ' -f1 /proc/uptime)
         echo denied-took=$(awk \"BEGIN {{print $t1 - $t0}}\")
         {allowed} && echo transparent-ok
         ls /sys/class/net",
        denied = get("denied.test", "denied"),
        allowed = get("allowed.test", "transparent"),
    );
    let run = parse(vmctl_run("minimal", &allow(true), &script, &[]));
    let why = run.explain();
    assert_eq!(run.code, Some(0), "{why}");
    assert!(run.stdout.contains(&format!("{BODY}transparent-ok")), "{why}");
    assert!(run.stdout.contains("HTTP/1.1 200 OK"), "{why}");
    assert!(!run.stdout.contains("denied-exit=0"), "{why}");
    assert!(run.stderr.contains("bad address 'denied.test'"), "a clear error in the guest: {why}");
    assert_eq!(hits.load(Ordering::SeqCst), 1, "exactly the allowed request reached the server: {why}");
    // The guest has no interface but lo.
    assert!(run.stdout.trim_end().ends_with("\nlo"), "{why}");
    // Fails fast: no timeout, the refusal comes straight back.
    let took: f64 = run
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("denied-took="))
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no timing: {why}"));
    assert!(took < 2.0, "the denied request took {took} s: {why}");

    let denied = run.egress("denied.test");
    assert!(!denied.is_empty(), "the host records the denied name: {why}");
    assert!(denied.iter().all(|e| e["allowed"] == false), "{why}");
    assert!(denied[0]["reason"].as_str().unwrap().contains("allowlist"), "{why}");
    let allowed: Vec<_> = run.egress("allowed.test").into_iter().filter(|e| e["port"] == port).collect();
    assert_eq!(allowed.len(), 1, "{why}");
    assert_eq!(allowed[0]["allowed"], true, "{why}");
    assert_eq!(allowed[0]["via"], "transparent", "{why}");
    assert!(allowed[0]["address"].as_str().unwrap().starts_with("127.0.0.1"), "{why}");
    let closed: Vec<_> = run.events.iter().filter(|e| e["event"] == "egress_closed").collect();
    assert!(
        closed.iter().any(|e| e["bytes_received"].as_u64().unwrap_or(0) >= BODY.len() as u64),
        "closed connections report the bytes each way: {why}"
    );
}

/// Without the CIDR allow a name that resolves to 127.0.0.1 is refused; without any network
/// flag (`vmctl run`'s default, none) nothing resolves and nothing connects.
#[test]
fn loopback_needs_a_cidr_and_the_default_is_no_network() {
    let (port, hits) = http_server();
    let script = format!("echo | nc -w 20 allowed.test {port}; echo exit=$?");
    let run = parse(vmctl_run("minimal", &allow(false), &script, &[]));
    let why = run.explain();
    assert!(!run.stdout.contains("exit=0"), "{why}");
    let refused = run.egress("allowed.test");
    assert!(refused.iter().any(|e| e["allowed"] == false), "{why}");
    let reason = refused.iter().find_map(|e| e["reason"].as_str()).unwrap_or_default().to_string();
    assert!(reason.contains("loopback") && reason.contains("CIDR"), "{reason}: {why}");

    let run = parse(vmctl_run("minimal", &[], &script, &[]));
    let why = run.explain();
    assert!(!run.stdout.contains("exit=0"), "{why}");
    assert!(run.egress("allowed.test").iter().all(|e| e["allowed"] == false), "{why}");
    assert_eq!(hits.load(Ordering::SeqCst), 0, "{why}");
}

/// The standard image: curl over HTTPS through the proxy variables and transparently, git
/// clone over HTTP, then guest root flushing the nftables rules, adding routes and addresses
/// and trying to make an interface, after which the proxy is still the only way out.
#[test]
fn https_git_and_guest_root_in_the_standard_image() {
    let pki = TempDir::new("egress-pki");
    test_pki(&pki.0);
    std::fs::write(pki.0.join("file.txt"), "a file served over TLS\n").unwrap();
    let (_tls, tls_port) = tls_server(&pki.0);
    let repo = TempDir::new("egress-git");
    let (_git, git_port) = git_server(&repo.0);
    let (escape_port, escape_hits) = http_server();
    let ca = format!("{}:pki:ro", pki.0.display());
    let script = format!(
        "set -u
         CA=/sessions/run/mnt/pki/ca.pem
         curl -sS --max-time 30 --cacert $CA https://allowed.test:{tls_port}/file.txt && echo https-proxy-ok
         curl -sS --max-time 30 --noproxy '*' --cacert $CA https://allowed.test:{tls_port}/file.txt && echo https-transparent-ok
         curl -sS --max-time 10 --cacert $CA https://denied.test:{tls_port}/file.txt; echo curl-denied-exit=$?
         git clone -q http://allowed.test:{git_port}/repo.git /tmp/repo && cat /tmp/repo/README && echo git-ok
         # Guest root tries to route around the proxy.
         nft flush ruleset && echo flushed
         nft list ruleset | grep -c redirect; true
         ip route add default dev lo 2>&1; ip route add 10.0.0.0/8 dev lo 2>&1
         ip addr add 10.0.2.15/24 dev lo 2>&1
         ip link add umbra0 type dummy 2>&1 && echo made-dummy
         ip link add umbra1 type veth peer name umbra2 2>&1 && echo made-veth
         curl -sS --max-time 5 --noproxy '*' http://allowed.test:{escape_port}/; echo escape-name-exit=$?
         curl -sS --max-time 5 --noproxy '*' http://127.0.0.1:{escape_port}/; echo escape-loopback-exit=$?
         curl -sS --max-time 5 --noproxy '*' http://10.0.2.2:{escape_port}/; echo escape-gateway-exit=$?
         curl -sS --max-time 30 --cacert $CA https://allowed.test:{tls_port}/file.txt && echo proxy-still-ok
         echo interfaces: $(ls /sys/class/net)"
    );
    let run = parse(vmctl_run("standard", &allow(true), &script, &[ca]));
    let why = run.explain();
    assert_eq!(run.code, Some(0), "{why}");
    for want in ["https-proxy-ok", "https-transparent-ok", "git-ok", "flushed", "proxy-still-ok"] {
        assert!(run.stdout.contains(want), "{want}: {why}");
    }
    assert!(run.stdout.contains("cloned through the egress proxy"), "{why}");
    assert!(!run.stdout.contains("curl-denied-exit=0"), "{why}");
    for exit in ["escape-name-exit=0", "escape-loopback-exit=0", "escape-gateway-exit=0"] {
        assert!(!run.stdout.contains(exit), "{exit}: {why}");
    }
    assert_eq!(escape_hits.load(Ordering::SeqCst), 0, "nothing reached the host once the rules were gone: {why}");
    // Whatever root made, nothing it made leads anywhere: no device reaches the host.
    let interfaces = run.stdout.lines().find_map(|l| l.strip_prefix("interfaces: ")).unwrap_or_default();
    for name in interfaces.split_whitespace() {
        assert!(["lo", "umbra0", "umbra1", "umbra2"].contains(&name), "unexpected interface {name}: {why}");
    }
    assert!(run.egress("denied.test").iter().all(|e| e["allowed"] == false), "{why}");
    let via: Vec<_> = run.egress("allowed.test").iter().filter_map(|e| e["via"].as_str()).map(String::from).collect();
    assert!(via.iter().any(|v| v == "http") && via.iter().any(|v| v == "transparent"), "{via:?}: {why}");
}

/// Secrets: curl, Python's requests, Node's fetch and git each authenticate to the bound host
/// with a value they only saw as a placeholder; the same placeholder sent to another allowed
/// host arrives unchanged; a client pinning the other host's key works (its TLS is end to end,
/// `--tls-passthrough` inside a `*.test` binding); the value shows in no event. Every connection leaves through an authenticating HTTP proxy
/// (`HTTPS_PROXY` in vmctl's environment), as behind a company's.
#[test]
fn secrets_reach_only_their_hosts_in_the_standard_image() {
    let pki = TempDir::new("egress-secrets");
    test_pki(&pki.0);
    // A dumb-HTTP repository under srv/repo.git.
    let (_unused, _) = git_server(&pki.0);
    drop(_unused);
    let value = format!("real-secret-{}", std::process::id());
    let (_server, port) = secret_server(&pki.0, &value);
    let proxy_log = pki.0.join("proxy.log");
    let (_proxy, proxy_port) = connect_proxy(&proxy_log);
    let https_proxy = format!("http://user:pass@127.0.0.1:{proxy_port}");
    let pin = {
        let out = Command::new("sh")
            .current_dir(&pki.0)
            .args(["-c", "openssl x509 -in cert.pem -pubkey -noout | openssl pkey -pubin -outform der | openssl dgst -sha256 -binary | base64"])
            .output()
            .unwrap();
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    };
    let test_ca = std::fs::read_to_string(pki.0.join("ca.pem")).unwrap();
    let script = format!(
        "set -u
         echo \"placeholder=$TOKEN\"
         cat > /tmp/test-ca.pem <<'PEM'
{test_ca}PEM
         curl -sS --fail --max-time 30 -H \"Authorization: Bearer $TOKEN\" https://allowed.test:{port}/curl && echo curl-ok
         python3 -c \"import os, requests; r = requests.get('https://allowed.test:{port}/requests', headers={{'Authorization': 'Bearer ' + os.environ['TOKEN']}}, timeout=30); r.raise_for_status(); print('requests-ok')\"
         node -e \"fetch('https://allowed.test:{port}/fetch', {{headers: {{authorization: 'Bearer ' + process.env.TOKEN}}}}).then(r => {{ if (!r.ok) process.exit(1); console.log('fetch-ok') }}, e => {{ console.error(e); process.exit(1) }})\"
         git clone -q \"https://x-access-token:$TOKEN@allowed.test:{port}/repo.git\" /tmp/clone && cat /tmp/clone/README && echo git-ok
         curl -sS --fail --max-time 30 --cacert /tmp/test-ca.pem -H \"X-Token: $TOKEN\" https://other.test:{port}/open/other && echo other-ok
         curl -sS --fail --max-time 30 --cacert /tmp/test-ca.pem --pinnedpubkey 'sha256//{pin}' https://other.test:{port}/open/pinned && echo pinned-ok
         curl -sS --max-time 30 --pinnedpubkey 'sha256//{pin}' https://allowed.test:{port}/open/pinned-bound; echo pinned-bound-exit=$?"
    );
    let network = [
        "--allow-domain",
        "allowed.test",
        "--allow-domain",
        "other.test",
        "--resolve",
        "allowed.test:127.0.0.1",
        "--resolve",
        "other.test:127.0.0.1",
        "--allow-cidr",
        "127.0.0.1/32",
        "--secret",
        "TOKEN@allowed.test=UMBRA_TEST_TOKEN",
        // A wildcard binding covers other.test too; passthrough keeps its TLS end to end, so
        // everything below about other.test holds as if nothing were bound to it.
        "--secret",
        "WILD@*.test=UMBRA_TEST_TOKEN",
        "--tls-passthrough",
        "other.test",
    ];
    let trust = pki.0.join("ca.pem").display().to_string();
    let mut args: Vec<&str> = network.to_vec();
    args.extend(["--trust-ca", &trust]);
    let env = [("UMBRA_TEST_TOKEN", value.as_str()), ("HTTPS_PROXY", https_proxy.as_str()), ("NO_PROXY", "")];
    let out = vmctl_run_with("standard", &args, &script, &[], &env);
    let raw = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let run = parse(out);
    let why = run.explain();
    assert_eq!(run.code, Some(0), "{why}");
    for want in ["curl-ok", "requests-ok", "fetch-ok", "git-ok", "other-ok", "pinned-ok"] {
        assert!(run.stdout.contains(want), "{want}: {why}");
    }
    assert!(run.stdout.contains("cloned through the egress proxy"), "{why}");
    // The bound host is intercepted: a client pinning the real key refuses the proxy's.
    assert!(!run.stdout.contains("pinned-bound-exit=0"), "{why}");
    let placeholder = run.stdout.lines().find_map(|l| l.strip_prefix("placeholder=")).unwrap_or_default().to_string();
    assert!(placeholder.starts_with("umbra-secret-"), "{why}");
    let log = std::fs::read_to_string(pki.0.join("requests.log")).unwrap();
    // What each server got: the value where bound, the placeholder elsewhere.
    for path in ["/curl", "/requests", "/fetch"] {
        let line = log.lines().find(|l| l.contains(&format!(" {path} "))).unwrap_or_else(|| panic!("{path}: {log}"));
        assert!(line.contains(&format!("auth=Bearer {value}")), "{line}");
    }
    assert!(log.lines().any(|l| l.contains("/repo.git/") && l.contains("auth=Basic ")), "{log}");
    let other = log.lines().find(|l| l.contains("/open/other")).unwrap_or_else(|| panic!("{log}"));
    assert!(other.contains(&format!("x-token={placeholder}")), "{other}");
    assert!(!log.lines().any(|l| l.starts_with("other.test") && l.contains(&value)), "{log}");
    // The events say where each secret went, never its value.
    assert!(!raw.contains(&value), "the value is in vmctl's output: {why}");
    let used = |host: &str| {
        run.events.iter().any(|e| e["event"] == "secret_used" && e["host"] == host && e["name"] == "TOKEN")
    };
    assert!(used("allowed.test") && !used("other.test"), "{why}");
    assert!(run.events.iter().any(|e| e["event"] == "tls_intercepted" && e["host"] == "allowed.test"), "{why}");
    assert!(!run.events.iter().any(|e| e["event"] == "tls_intercepted" && e["host"] == "other.test"), "{why}");
    // Every connection went through the proxy, authenticated, to the pinned address.
    let log = std::fs::read_to_string(&proxy_log).unwrap_or_default();
    // (The test's own check that the proxy listens sends no request line.)
    let tunnels: Vec<&str> = log.lines().filter(|l| !l.starts_with(" auth=")).collect();
    assert!(tunnels.len() >= 7, "{log}");
    assert!(tunnels.iter().all(|l| *l == format!("CONNECT 127.0.0.1:{port} HTTP/1.1 auth=True")), "{log}");
    let through = format!("through the upstream proxy 127.0.0.1:{proxy_port}");
    assert!(
        run.egress("allowed.test").iter().any(|e| e["address"].as_str().is_some_and(|a| a.ends_with(&through))),
        "{why}"
    );
}

/// A running session's policy changes apply to its next connection, and survive a restart of
/// its VM: none, then an allowlist, then none again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_sessions_policy_change_applies_to_new_connections() {
    use umbra_api::methods::StartParams;
    use umbra_api::session::{NetworkMode, NetworkPolicy};
    use umbra_runtime::session::ExecRequest;

    let (port, hits) = http_server();
    let dir = TempDir::new("egress-live");
    let m = umbra_tests::session_manager(&dir);
    let s = m.start(StartParams { name: "live".into(), ..Default::default() }).await.unwrap();
    assert_eq!(s.info().settings.network.mode, NetworkMode::None, "sessions default to no network");
    let fetch = || async {
        let script = format!("printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 20 allowed.test {port}");
        let req = ExecRequest { argv: vec!["sh".into(), "-c".into(), script], ..Default::default() };
        let out = s.spawn(req).await.unwrap().output().await;
        (
            out.exit.code,
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, _, err) = fetch().await;
    assert_ne!(code, Some(0), "{err}");

    let allow = NetworkPolicy {
        mode: NetworkMode::Allowlist,
        allow_domains: vec!["allowed.test".into()],
        allow_cidrs: vec!["127.0.0.1/32".into()],
        resolve: [("allowed.test".to_string(), "127.0.0.1".parse().unwrap())].into(),
        ..Default::default()
    };
    s.set_network(allow.clone()).unwrap();
    let (code, out, err) = fetch().await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.ends_with(BODY), "{out}");
    assert_eq!(s.info().settings.network, allow, "kept in the session's settings");

    // Malformed policies are refused and change nothing.
    let bad = NetworkPolicy { allow_cidrs: vec!["10.0.0.0/99".into()], ..allow.clone() };
    assert!(s.set_network(bad).is_err());
    assert_eq!(s.info().settings.network, allow);

    s.set_network(NetworkPolicy::default()).unwrap();
    // The guest may still hold the name's fake address (5 s TTL): the host refuses anyway.
    let (code, _, err) = fetch().await;
    assert_ne!(code, Some(0), "{err}");
    assert_eq!(hits.load(Ordering::SeqCst), 1, "only the request made while allowed arrived");
    m.delete("live").await.unwrap();
}

/// Over umbrad's socket: a running session's network moves only within its merged policy.
/// The daemon's configuration (the admin's) allows `allowed.test` and 127.0.0.1/32; one session
/// narrows that to `none` in its start. `session.set_network` cannot widen either session
/// beyond its ceiling (the error names it, nothing changes, the guest still cannot connect),
/// and can still move within it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_network_over_the_socket_stays_within_the_merged_policy() {
    use umbra_api::methods::*;
    use umbra_api::session::{NetworkMode, NetworkPolicy, SettingsPatch};
    use umbra_api::ErrorCode;
    use umbra_tests::daemon::{boot_timeout_secs, process_output, TestDaemon};

    let (port, hits) = http_server();
    let daemon = TestDaemon::start(
        "egress-ceiling",
        serde_json::json!({ "policy": { "network": {
            "mode": "allowlist",
            "allow_domains": ["allowed.test"],
            "allow_cidrs": ["127.0.0.1/32"],
            "resolve": { "allowed.test": "127.0.0.1" },
        } } }),
    );
    let (client, mut inbox) = daemon.client().await;
    let boot = Duration::from_secs(boot_timeout_secs() + 30);
    let start = |name: &str, policy: Option<umbra_policy::SandboxPolicy>| StartParams {
        name: name.into(),
        settings: SettingsPatch { policy, ..Default::default() },
        ..Default::default()
    };
    let set = |name: &str, network: NetworkPolicy| SetNetworkParams { name: name.into(), network };
    let allowlist = |domains: &[&str], cidrs: &[&str]| NetworkPolicy {
        mode: NetworkMode::Allowlist,
        allow_domains: domains.iter().map(|d| d.to_string()).collect(),
        allow_cidrs: cidrs.iter().map(|c| c.to_string()).collect(),
        resolve: [("allowed.test".to_string(), "127.0.0.1".parse().unwrap())].into(),
        ..Default::default()
    };
    let admin = allowlist(&["allowed.test"], &["127.0.0.1/32"]);

    // The admin's allowlist: the session starts with it; any and wider lists are refused.
    let info = tokio::time::timeout(boot, client.call::<SessionStart>(start("wide", None))).await.unwrap().unwrap();
    assert_eq!(info.settings.network, admin);
    let e = client.call::<SessionSetNetwork>(set("wide", NetworkPolicy { mode: NetworkMode::Any, ..admin.clone() }));
    let e = e.await.unwrap_err();
    assert_eq!(e.code, ErrorCode::PermissionDenied, "{e:?}");
    assert!(e.message.contains("ceiling") && e.message.contains("mode any is wider than mode allowlist"), "{e:?}");
    assert!(e.message.contains("domains allowed.test") && e.message.contains("cidrs 127.0.0.1/32"), "{e:?}");
    let e = client.call::<SessionSetNetwork>(set("wide", allowlist(&["allowed.test", "*.example.com"], &[])));
    let e = e.await.unwrap_err();
    assert!(e.message.contains("the domain *.example.com is not in the allowlist"), "{e:?}");
    let e = client.call::<SessionSetNetwork>(set("wide", allowlist(&["allowed.test"], &["127.0.0.0/8"])));
    let e = e.await.unwrap_err();
    assert!(e.message.contains("the range 127.0.0.0/8 is not in allow_cidrs"), "{e:?}");
    let now = client.call::<SessionGet>(SessionRef { name: "wide".into() }).await.unwrap();
    assert_eq!(now.settings.network, admin, "a refused change changes nothing");
    // Within the ceiling: narrower is fine, and so is back to the ceiling itself.
    let narrowed = client.call::<SessionSetNetwork>(set("wide", NetworkPolicy::default())).await.unwrap();
    assert_eq!(narrowed.settings.network.mode, NetworkMode::None);
    client.call::<SessionSetNetwork>(set("wide", admin.clone())).await.unwrap();

    // A session whose start says `none`: merged with the admin's, `none` is its ceiling.
    let none = umbra_policy::SandboxPolicy { network: Some(NetworkPolicy::default()), ..Default::default() };
    let info =
        tokio::time::timeout(boot, client.call::<SessionStart>(start("shut", Some(none)))).await.unwrap().unwrap();
    assert_eq!(info.settings.network.mode, NetworkMode::None);
    let e = client.call::<SessionSetNetwork>(set("shut", admin.clone())).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::PermissionDenied, "{e:?}");
    assert!(e.message.contains("ceiling (network mode none)"), "{e:?}");
    // The guest still has no network.
    client.call::<EventsSubscribe>(SubscribeParams { session: Some("shut".into()) }).await.unwrap();
    let script = format!("printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 10 allowed.test {port}");
    let spawn =
        SpawnParams { session: "shut".into(), argv: vec!["sh".into(), "-c".into(), script], ..Default::default() };
    let p = client.call::<ProcessSpawn>(spawn).await.unwrap();
    let (_, _, exit) = process_output(&client, &mut inbox, "shut", p.process, Duration::from_secs(60)).await;
    assert_ne!(exit.code, Some(0));
    assert_eq!(hits.load(Ordering::SeqCst), 0, "nothing reached the host's server");

    for name in ["wide", "shut"] {
        client.call::<SessionDelete>(SessionRef { name: name.into() }).await.unwrap();
    }
}

/// The number of file descriptors this process has open.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// A guest opening 10,000 connections at once gets some and is refused the rest; the host (this
/// process runs the session and its egress proxy) holds a bounded number of descriptors, gives
/// them back when the guest lets go, and the session carries on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_guest_connections_hold_a_bounded_number_of_host_fds() {
    use umbra_api::methods::StartParams;
    use umbra_api::session::{NetworkMode, NetworkPolicy, SettingsPatch};
    use umbra_runtime::session::ExecRequest;

    // Room for everything the bound allows, so a refusal below is the bound, not EMFILE.
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit read or write one `struct rlimit` through valid pointers.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = lim.rlim_max.min(65536);
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
    }
    // A server that holds every connection until its client closes.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let held = Arc::new(AtomicUsize::new(0));
    let counter = held.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let counter = counter.clone();
            tokio::spawn(async move {
                counter.fetch_add(1, Ordering::SeqCst);
                let mut sink = [0u8; 64];
                while let Ok(n) = tokio::io::AsyncReadExt::read(&mut s, &mut sink).await {
                    if n == 0 {
                        break;
                    }
                }
                counter.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });

    let dir = TempDir::new("egress-flood");
    let m = umbra_tests::session_manager_for(&dir, "standard", 1024);
    let policy = NetworkPolicy {
        mode: NetworkMode::Allowlist,
        allow_domains: vec!["allowed.test".into()],
        allow_cidrs: vec!["127.0.0.1/32".into()],
        resolve: [("allowed.test".to_string(), "127.0.0.1".parse().unwrap())].into(),
        ..Default::default()
    };
    let settings = SettingsPatch { network: Some(policy), ..Default::default() };
    let s = m.start(StartParams { name: "flood".into(), settings, ..Default::default() }).await.unwrap();
    let baseline = open_fds();

    let peak = Arc::new(AtomicUsize::new(0));
    let sampling = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let (peak, sampling) = (peak.clone(), sampling.clone());
        std::thread::spawn(move || {
            while sampling.load(Ordering::SeqCst) {
                peak.fetch_max(open_fds(), Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let flood = format!(
        "import resource, socket, time
resource.setrlimit(resource.RLIMIT_NOFILE, (12000, 12000))
addr = socket.gethostbyname('allowed.test')
socks = []
for _ in range(10000):
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex((addr, {port}))
    socks.append(s)
time.sleep(5)
print(len(socks))
"
    );
    let req = ExecRequest {
        argv: vec!["python3".into(), "-c".into(), flood],
        timeout: Some(Duration::from_secs(300)),
        ..Default::default()
    };
    let out = s.spawn(req).await.unwrap().output().await;
    let during = peak.load(Ordering::SeqCst);
    let held_peak = held.load(Ordering::SeqCst);
    assert_eq!(out.exit.code, Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "10000");

    // The bound: 2,048 guest streams at once, each a Unix socket and a TCP socket here, plus
    // the test server's end of each.
    let bound = baseline + 3 * 2048 + 256;
    assert!(during <= bound, "{during} fds open at the peak, bound {bound} (baseline {baseline})");
    // Given back once the guest's program has ended (its sockets closed).
    let mut now = open_fds();
    for _ in 0..150 {
        if now <= baseline + 64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        now = open_fds();
    }
    sampling.store(false, Ordering::SeqCst);
    sampler.join().unwrap();
    assert!(now <= baseline + 64, "{now} fds still open 15 s later (baseline {baseline})");

    // The session carries on: a new connection works.
    let script =
        format!("import socket; s = socket.create_connection(('allowed.test', {port}), timeout=30); print('again')");
    let out = s
        .spawn(ExecRequest { argv: vec!["python3".into(), "-c".into(), script], ..Default::default() })
        .await
        .unwrap()
        .output()
        .await;
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "again", "{}", String::from_utf8_lossy(&out.stderr));
    eprintln!("flood: baseline {baseline} fds, peak {during}, after {now}; server held {held_peak} at the end");
    m.delete("flood").await.unwrap();
}

/// An sshd of the test's on 127.0.0.1:`port`, with host key `host_key` and `authorized` as the
/// only authorized keys, serving git (as root). From the cache, where `scripts/install-deps`
/// unpacks it (a system sshd is never installed).
fn sshd(dir: &Path, host_key: &Path, authorized: &Path) -> (Server, u16) {
    let root = umbra_tests::cache_dir().join("sshd");
    let bin = root.join("usr/sbin/sshd");
    assert!(bin.exists(), "no sshd at {} (run scripts/install-deps as root)", bin.display());
    std::fs::create_dir_all("/run/sshd").unwrap();
    let port = free_port();
    let child = Command::new(&bin)
        .current_dir(dir)
        .env("LD_LIBRARY_PATH", root.join("usr/lib/x86_64-linux-gnu"))
        .args(["-D", "-e", "-f", "/dev/null", "-p", &port.to_string(), "-h"])
        .arg(host_key)
        .args(["-o", "ListenAddress=127.0.0.1", "-o", "StrictModes=no", "-o", "UsePAM=no"])
        .args(["-o", "PermitRootLogin=prohibit-password", "-o", "PasswordAuthentication=no", "-o", "PidFile=none"])
        .arg("-o")
        .arg(format!("AuthorizedKeysFile={}", authorized.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join(format!("sshd-{port}.log"))).unwrap())
        .spawn()
        .unwrap();
    let server = Server(child);
    wait_listening(port);
    (server, port)
}

/// Git over SSH with a key only the host holds (issue 30): the guest's SSH_AUTH_SOCK reaches the
/// session's agent on the host, which signs the login to the host the key was given for —
/// known by its host key from ~/.ssh/known_hosts — and refuses the same key to another server;
/// the key never appears in the guest; each signature and refusal is an event.
#[test]
fn git_over_ssh_with_a_host_held_key_only_to_its_host() {
    let dir = TempDir::new("egress-ssh");
    let keygen = |name: &str, comment: &str| {
        run_ok(
            Command::new("ssh-keygen")
                .args(["-q", "-t", "ed25519", "-N", "", "-C", comment, "-f"])
                .arg(dir.0.join(name)),
        )
    };
    keygen("deploy", "deploy-key");
    keygen("host-git", "host");
    keygen("host-other", "host");
    std::fs::copy(dir.0.join("deploy.pub"), dir.0.join("authorized_keys")).unwrap();
    // A bare repository at srv/repo.git (git_server's HTTP server is not needed).
    drop(git_server(&dir.0).0);
    let repo = dir.0.join("srv/repo.git");
    let (_git_sshd, git_port) = sshd(&dir.0, &dir.0.join("host-git"), &dir.0.join("authorized_keys"));
    let (_other_sshd, other_port) = sshd(&dir.0, &dir.0.join("host-other"), &dir.0.join("authorized_keys"));
    // vmctl's HOME: known_hosts names git.test's key (not other.test's).
    let home = dir.0.join("home");
    std::fs::create_dir_all(home.join(".ssh")).unwrap();
    let host_pub = std::fs::read_to_string(dir.0.join("host-git.pub")).unwrap();
    let mut f = host_pub.split_whitespace();
    let (kind, data) = (f.next().unwrap(), f.next().unwrap());
    std::fs::write(home.join(".ssh/known_hosts"), format!("[git.test]:{git_port} {kind} {data}\n")).unwrap();
    let private = std::fs::read_to_string(dir.0.join("deploy")).unwrap();
    let secret_line = private.lines().nth(1).unwrap().to_string();

    let ssh = "ssh -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o BatchMode=yes";
    let script = format!(
        "set -u
         echo \"sock=$SSH_AUTH_SOCK\"
         ssh-add -l
         GIT_SSH_COMMAND='{ssh}' git clone -q ssh://root@git.test:{git_port}{repo} /tmp/a && cat /tmp/a/README && echo ssh-git-ok
         GIT_SSH_COMMAND='{ssh}' git clone -q ssh://root@other.test:{other_port}{repo} /tmp/b; echo other-exit=$?
         grep -rl -- '{secret_line}' /etc /run /root /tmp 2>/dev/null; echo searched",
        repo = repo.display()
    );
    let key = format!("deploy={}@git.test", dir.0.join("deploy").display());
    let args = [
        "--allow-domain",
        "git.test",
        "--allow-domain",
        "other.test",
        "--resolve",
        "git.test:127.0.0.1",
        "--resolve",
        "other.test:127.0.0.1",
        "--allow-cidr",
        "127.0.0.1/32",
        "--ssh-key",
        &key,
    ];
    let home_env = home.display().to_string();
    let out = vmctl_run_with("standard", &args, &script, &[], &[("HOME", home_env.as_str())]);
    let run = parse(out);
    let why = run.explain();
    assert_eq!(run.code, Some(0), "{why}");
    assert!(run.stdout.contains("sock=/run/umbra/ssh-agent.sock"), "{why}");
    assert!(run.stdout.contains("deploy (ED25519)"), "the agent lists the key by name: {why}");
    assert!(run.stdout.contains("cloned through the egress proxy") && run.stdout.contains("ssh-git-ok"), "{why}");
    assert!(!run.stdout.contains("other-exit=0"), "the key logged in to another server: {why}");
    assert!(run.stdout.contains("searched") && !run.stdout.contains("/tmp/") && !run.stdout.contains("/etc/"), "{why}");
    let signed: Vec<_> = run.events.iter().filter(|e| e["event"] == "ssh_signed").collect();
    assert!(!signed.is_empty() && signed.iter().all(|e| e["key"] == "deploy" && e["host"] == "git.test"), "{why}");
    assert!(
        run.events.iter().any(|e| e["event"] == "ssh_refused"
            && e["key"] == "deploy"
            && e["reason"].as_str().is_some_and(|r| r.contains("not one of git.test"))),
        "{why}"
    );
}
