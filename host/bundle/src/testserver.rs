//! A loopback HTTP/1.1 file server whose misbehaviour is programmable per request, and a
//! synthetic bundle to serve: what the download tests and `vmctl bench bundle` run against.
//!
//! It is hand-written over `std::net` rather than built on a server framework because the faults
//! are the point: a body cut short, a connection dropped mid-body, a lying Content-Length, a
//! flipped byte, a trickle, a Range request ignored. Each connection gets a thread and one
//! response (`Connection: close`); every request is recorded (method, path, Range header) so
//! tests can assert what the client asked for.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::manifest::{ArtifactRole, Manifest};
use crate::pack::{pack, PackInput, PackOptions};
use crate::BundleError;

/// How to answer one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// Answer with this status and a short text body.
    Status(u16),
    /// Flip every bit of the byte at this offset of the file.
    CorruptByte(u64),
    /// Send only the first N bytes, without Content-Length, and close: a body that ends early
    /// but cleanly, as a truncated file would.
    Truncate(u64),
    /// Announce the full length, send N body bytes, then close the connection.
    DropAfter(u64),
    /// Announce this Content-Length (then send the real body, cut to it if shorter).
    ContentLength(u64),
    /// Send the body in `chunk`-byte pieces with `delay` between them.
    Slow { chunk: usize, delay: Duration },
    /// Answer a Range request with 200 and the whole body.
    IgnoreRange,
    /// Answer 302 with this `Location`.
    Redirect(String),
}

/// One request as the server saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub range: Option<String>,
}

#[derive(Default)]
struct Shared {
    /// Consumed one per request of the path.
    once: Mutex<HashMap<String, VecDeque<Fault>>>,
    /// Applied to every request of the path (after any one-shot fault is used up).
    always: Mutex<HashMap<String, Vec<Fault>>>,
    log: Mutex<Vec<Request>>,
}

pub struct TestServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl TestServer {
    /// Serves the files under `root` on 127.0.0.1 at a free port.
    pub fn start(root: impl Into<PathBuf>) -> std::io::Result<Self> {
        let root: PathBuf = root.into();
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::default());
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (shared.clone(), stop.clone());
        let accept = std::thread::Builder::new().name("testserver".into()).spawn(move || {
            for conn in listener.incoming() {
                if st.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let (s, root) = (s.clone(), root.clone());
                std::thread::spawn(move || {
                    let _ = serve(conn, &root, &s);
                });
            }
        })?;
        Ok(Self { addr, shared, stop, accept: Some(accept) })
    }

    /// `http://127.0.0.1:<port>/<path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}/{}", self.addr, path.trim_start_matches('/'))
    }

    /// The next request of `path` gets `fault` (queued after earlier one-shot faults).
    pub fn push_fault(&self, path: &str, fault: Fault) {
        self.shared.once.lock().unwrap().entry(norm(path)).or_default().push_back(fault);
    }

    /// Every request of `path` gets these faults (e.g. slow and ignoring Range).
    pub fn set_faults(&self, path: &str, faults: Vec<Fault>) {
        self.shared.always.lock().unwrap().insert(norm(path), faults);
    }

    pub fn requests(&self) -> Vec<Request> {
        self.shared.log.lock().unwrap().clone()
    }

    /// Requests of `path` so far.
    pub fn count(&self, path: &str) -> usize {
        let p = norm(path);
        self.shared.log.lock().unwrap().iter().filter(|r| r.path == p).count()
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(self.addr);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn norm(path: &str) -> String {
    format!("/{}", path.trim_start_matches('/'))
}

fn serve(conn: TcpStream, root: &Path, shared: &Shared) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or("").to_string(), parts.next().unwrap_or("/").to_string());
    let mut range = None;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.trim().eq_ignore_ascii_case("range") {
                range = Some(v.trim().to_string());
            }
        }
    }
    shared.log.lock().unwrap().push(Request { method: method.clone(), path: path.clone(), range: range.clone() });
    let mut faults: Vec<Fault> = shared.always.lock().unwrap().get(&path).cloned().unwrap_or_default();
    if let Some(f) = shared.once.lock().unwrap().get_mut(&path).and_then(VecDeque::pop_front) {
        faults.push(f);
    }
    let mut out = conn;
    if let Some(status) = faults.iter().find_map(|f| if let Fault::Status(s) = f { Some(*s) } else { None }) {
        let body = format!("fault: status {status}\n");
        return write!(
            out,
            "HTTP/1.1 {status} Fault\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
    }
    if let Some(to) = faults.iter().find_map(|f| if let Fault::Redirect(to) = f { Some(to) } else { None }) {
        return write!(out, "HTTP/1.1 302 Found\r\nLocation: {to}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    }
    let rel = path.split('?').next().unwrap_or("").trim_start_matches('/');
    let file_path = root.join(rel);
    let file = if rel.split('/').any(|c| c == "..") { None } else { File::open(&file_path).ok() };
    let (Some(mut file), true) = (file, method == "GET" || method == "HEAD") else {
        return write!(out, "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    };
    let len = file.metadata()?.len();
    let start = range
        .as_deref()
        .filter(|_| !faults.contains(&Fault::IgnoreRange))
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.split_once('-'))
        .and_then(|(s, _)| s.parse::<u64>().ok());
    if start.is_some_and(|s| s >= len) {
        return write!(out, "HTTP/1.1 416 Range Not Satisfiable\r\nContent-Range: bytes */{len}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    }
    let from = start.unwrap_or(0);
    let mut body_len = len - from;
    let mut head = match start {
        Some(s) => format!("HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {s}-{}/{len}\r\n", len - 1),
        None => "HTTP/1.1 200 OK\r\n".to_string(),
    };
    let mut limit = body_len;
    let mut slow = None;
    let mut announce = Some(body_len);
    for f in &faults {
        match f {
            Fault::Truncate(n) => {
                limit = limit.min(n.saturating_sub(from));
                announce = None;
            }
            Fault::DropAfter(n) => limit = limit.min(n.saturating_sub(from)),
            Fault::ContentLength(n) => {
                announce = Some(*n);
                limit = limit.min(*n);
            }
            Fault::Slow { chunk, delay } => slow = Some((*chunk, *delay)),
            _ => {}
        }
    }
    if let Some(n) = announce {
        head.push_str(&format!("Content-Length: {n}\r\n"));
    }
    head.push_str("Content-Type: application/octet-stream\r\nAccept-Ranges: bytes\r\nConnection: close\r\n\r\n");
    out.write_all(head.as_bytes())?;
    if method == "HEAD" {
        return Ok(());
    }
    let corrupt = faults.iter().find_map(|f| if let Fault::CorruptByte(o) = f { Some(*o) } else { None });
    file.seek(SeekFrom::Start(from))?;
    let mut pos = from;
    let mut buf = vec![0u8; slow.map_or(256 * 1024, |(c, _)| c.max(1))];
    body_len = limit;
    while body_len > 0 {
        let want = buf.len().min(body_len as usize);
        let n = file.read(&mut buf[..want])?;
        if n == 0 {
            break;
        }
        if let Some(o) = corrupt.filter(|o| (pos..pos + n as u64).contains(o)) {
            buf[(o - pos) as usize] ^= 0xff;
        }
        out.write_all(&buf[..n])?;
        pos += n as u64;
        body_len -= n as u64;
        if let Some((_, delay)) = slow {
            out.flush()?;
            std::thread::sleep(delay);
        }
    }
    out.flush()?;
    // Closing after the (possibly cut) body: with a Content-Length announced, a short body is a
    // dropped connection to the client; without one, it is the end of the body.
    out.shutdown(std::net::Shutdown::Both)
}

/// Deterministic bytes that compress roughly like a guest image (about 4:1 with zstd -3): text-like
/// "words" from a small vocabulary, dense random stretches, and runs of zeros.
pub fn synthetic_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407) | 1;
    let mut next = move || {
        // xorshift64*
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        x.wrapping_mul(0x2545F4914F6CDD1D)
    };
    let words: Vec<Vec<u8>> = (0..4096)
        .map(|_| {
            let n = 3 + (next() % 10) as usize;
            (0..n).map(|_| b'a' + (next() % 26) as u8).collect()
        })
        .collect();
    let mut out = Vec::with_capacity(len + 64);
    while out.len() < len {
        let r = next() % 256;
        if r == 0 {
            let zeros = 256 + (next() % 2048) as usize;
            out.resize(out.len() + zeros, 0);
        } else if r < 8 {
            // Machine code and other dense data.
            for _ in 0..8 {
                out.extend_from_slice(&next().to_le_bytes());
            }
        } else {
            out.extend_from_slice(&words[(next() % words.len() as u64) as usize]);
            out.push(b' ');
        }
    }
    out.truncate(len);
    out
}

/// Packs a bundle (a kernel and an initramfs of synthetic bytes) into `out_dir`, with
/// `version`, its inputs written to `work`.
pub fn synthetic_bundle(
    work: &Path,
    out_dir: &Path,
    version: &str,
    kernel_bytes: usize,
    initrd_bytes: usize,
    level: i32,
    min_host_version: &str,
) -> Result<Manifest, BundleError> {
    std::fs::create_dir_all(work).map_err(crate::io_err("cannot create", work))?;
    let seed = version.bytes().fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
    let k = work.join(format!("{version}.vmlinux"));
    let i = work.join(format!("{version}.initrd"));
    std::fs::write(&k, synthetic_bytes(kernel_bytes, seed)).map_err(crate::io_err("cannot write", &k))?;
    std::fs::write(&i, synthetic_bytes(initrd_bytes, seed ^ 0xabcdef)).map_err(crate::io_err("cannot write", &i))?;
    let inputs = [
        PackInput { name: "kernel".into(), role: ArtifactRole::Kernel, format: "elf-vmlinux".into(), path: k.clone() },
        PackInput {
            name: "initramfs".into(),
            role: ArtifactRole::Initrd,
            format: "cpio-newc-zstd".into(),
            path: i.clone(),
        },
    ];
    let opts = PackOptions {
        flavor: "minimal",
        arch: crate::Arch::X86_64,
        cmdline: "",
        min_host_version,
        version: Some(version.to_string()),
        zstd_level: level,
        image: None,
    };
    let m = pack(&inputs, &opts, out_dir);
    let _ = std::fs::remove_file(&k);
    let _ = std::fs::remove_file(&i);
    let m = m?;
    // Signed, as every bundle must be; a test about unsigned ones removes the signature.
    crate::sign::sign_dir(out_dir, &test_key())?;
    Ok(m)
}

/// The key synthetic bundles are signed with: fixed, so a test's pull and a test's vmctl agree.
/// Nothing outside the tests trusts it.
pub fn test_key() -> crate::SecretKey {
    crate::SecretKey::from_seed(*b"umbra synthetic test bundles key")
}

/// Trusts [`test_key`] and loopback `http://`: what a pull from a [`TestServer`] needs.
pub fn test_trust() -> crate::Trust {
    crate::Trust { allow_http_loopback: true, ..Default::default() }.key(test_key().public(), "the test key")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_bytes_compress_like_an_image() {
        let raw = synthetic_bytes(4 << 20, 7);
        assert_eq!(raw, synthetic_bytes(4 << 20, 7), "deterministic");
        let z = zstd::encode_all(&raw[..], 3).unwrap();
        let ratio = raw.len() as f64 / z.len() as f64;
        assert!((2.5..6.0).contains(&ratio), "ratio {ratio:.2}");
        eprintln!("ratio {ratio:.2}");
    }
}
