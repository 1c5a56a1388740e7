//! The escape suite (issue 16): from inside a real guest, as root, everything an agent's code
//! could try against the host — through the shares, the devices, the resources, the console,
//! vsock and the network — on every backend this host runs (`UMBRA_TEST_BACKENDS`). Each case
//! asserts that the host is untouched: no host byte outside a share reached the guest, the
//! shares hold their modes, the VMM's memory, descriptors and logs stay bounded, and the agent
//! still answers. The suite prints one summary line per backend with its case counts.

use std::collections::BTreeMap;
use std::future::Future;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::process::Command;
use umbra_api::methods::StartParams;
use umbra_api::session::{FolderSpec, NetworkMode, NetworkPolicy, SettingsPatch};
use umbra_policy::SandboxPolicy;
use umbra_proto::ShareMode;
use umbra_runtime::backend::BackendKind;
use umbra_runtime::session::{ExecRequest, Session};

use umbra_tests::{comm, TempDir};

const SESSION: &str = "esc";
const MEMORY_MIB: u32 = 512;
const DISK_MIB: u64 = 128;

/// What a case saw: `Ok` with a note for the summary, or why the host was not untouched.
type Outcome = Result<String, String>;
type Case<'a> = Pin<Box<dyn Future<Output = Outcome> + Send + 'a>>;

struct Guest {
    s: Arc<Session>,
    canary: String,
}

impl Guest {
    /// Runs `script` with `sh` as root; returns exit code and stdout+stderr. A canary in the
    /// output fails the calling case through [`Guest::clean`].
    async fn sh(&self, script: &str) -> (i32, String) {
        let req = ExecRequest { argv: vec!["sh".into(), "-c".into(), script.into()], ..Default::default() };
        let out = match self.s.spawn(req).await {
            Ok(p) => p.output().await,
            Err(e) => return (-1, format!("spawn failed: {e}")),
        };
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        (out.exit.code.unwrap_or(-1), text)
    }

    fn clean(&self, what: &str, out: &str) -> Result<(), String> {
        if out.contains(&self.canary) {
            return Err(format!("{what}: host content outside the shares reached the guest:\n{out}"));
        }
        Ok(())
    }

    /// The agent answers a command within `limit`. A command killed by a signal is tried again
    /// within the limit: right after a fork bomb or a memory hog is killed, the commands'
    /// cgroup can still be at its memory bound while the dying tasks drain, and the OOM killer
    /// may pick the new command (it picks among the commands, never the agent).
    async fn answers(&self, limit: Duration) -> Result<Duration, String> {
        let started = Instant::now();
        let mut killed = 0;
        loop {
            let left = limit.saturating_sub(started.elapsed());
            match tokio::time::timeout(left, self.sh("echo alive")).await {
                Ok((0, out)) if out == "alive\n" => return Ok(started.elapsed()),
                Ok((-1, out)) if out.is_empty() && killed < 5 => {
                    killed += 1;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Ok(other) => return Err(format!("the agent answered {other:?} (after {killed} killed tries)")),
                Err(_) => return Err(format!("the agent did not answer within {limit:?}")),
            }
        }
    }
}

/// Every file below `root` with its bytes and mode, to compare before and after.
fn snapshot(root: &Path) -> BTreeMap<PathBuf, (Vec<u8>, u32)> {
    use std::os::unix::fs::PermissionsExt;
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let rel = path.strip_prefix(root).unwrap().to_path_buf();
            let bytes = if meta.is_file() { std::fs::read(&path).unwrap() } else { Vec::new() };
            out.insert(rel, (bytes, meta.permissions().mode()));
            if meta.is_dir() {
                stack.push(path);
            }
        }
    }
    out
}

/// The VM's host processes: the helpers the session lists and their children (a jailed
/// umbra-vmm is the child of the process the runtime started).
fn vm_processes(s: &Session) -> Vec<u32> {
    umbra_tests::with_descendants(&s.info().vm.map(|v| v.pids).unwrap_or_default())
}

/// One process's resident memory.
fn rss_mib(pid: u32) -> u64 {
    total_rss_mib(&[pid])
}

fn total_rss_mib(pids: &[u32]) -> u64 {
    pids.iter().map(|p| umbra_tests::rss_kib(*p)).sum::<u64>() / 1024
}

/// What the helpers other than the VMM may grow by while a guest exhausts its memory.
const HELPERS_GROWTH_MIB: u64 = 64;

/// RSS of the VMM processes (QEMU, umbra-vmm), and the anonymous RSS of every other helper,
/// in MiB: virtiofsd and vhost-device-vsock map the guest's memory (shared), and the pages of
/// it they touch while serving I/O are the guest's, not theirs.
fn vmm_and_helpers_rss_mib(pids: &[u32]) -> (u64, u64) {
    let (vmm, helpers): (Vec<u32>, Vec<u32>) =
        pids.iter().partition(|p| ["qemu-system", "umbra-vmm"].iter().any(|n| comm(**p).starts_with(n)));
    let anon_kib = |pid: &u32| {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        status.lines().find_map(|l| l.strip_prefix("RssAnon:")?.split_whitespace().next()?.parse::<u64>().ok())
    };
    (total_rss_mib(&vmm), helpers.iter().filter_map(anon_kib).sum::<u64>() / 1024)
}

fn total_fds(pids: &[u32]) -> usize {
    pids.iter().map(|p| std::fs::read_dir(format!("/proc/{p}/fd")).map_or(0, |d| d.count())).sum()
}

fn all_alive(pids: &[u32]) -> Result<(), String> {
    for p in pids {
        match umbra_tests::process_state(*p) {
            Some(state) if state != 'Z' => {}
            other => return Err(format!("VM process {p} is gone ({other:?})")),
        }
    }
    Ok(())
}

/// A Python script in the guest (the standard image has python3).
fn python(code: &str) -> String {
    format!("python3 - <<'PY'\n{code}\nPY")
}

const HANDLES_PY: &str = r#"
import ctypes, os, struct
libc = ctypes.CDLL(None, use_errno=True)
class FH(ctypes.Structure):
    _fields_ = [("handle_bytes", ctypes.c_uint), ("handle_type", ctypes.c_int), ("f_handle", ctypes.c_ubyte * 128)]
def handle(kind, data):
    h = FH(); h.handle_bytes = len(data); h.handle_type = kind
    for i, b in enumerate(data): h.f_handle[i] = b
    return h
fh = FH(); fh.handle_bytes = 128; mnt = ctypes.c_int()
r = libc.name_to_handle_at(-100, b"/sessions/esc/mnt/rw/keep.txt", ctypes.byref(fh), ctypes.byref(mnt), 0)
print("NAME_TO_HANDLE", r, os.strerror(ctypes.get_errno()))
opened = 0
for d in ("/sessions/esc/mnt/rw", "/sessions/esc/mnt/ro", "/"):
    mfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    tries = []
    if r == 0:
        base = bytes(fh.f_handle[:fh.handle_bytes])
        for n in range(1, 512):
            tries.append(handle(fh.handle_type, struct.pack("<Q", n) + base[8:]))
    # Forged handles of the common kinds (ext4/xfs inode + generation) for the first inodes.
    for kind in (1, 2, 0x81):
        for ino in range(1, 256):
            tries.append(handle(kind, struct.pack("<II", ino, 0)))
    for h in tries:
        fd = libc.open_by_handle_at(mfd, ctypes.byref(h), os.O_RDONLY)
        if fd >= 0:
            opened += 1
            try:
                print(os.read(fd, 4096).decode("latin-1"))
            except OSError:
                pass
            os.close(fd)
print("OPENED", opened)
"#;

const VSOCK_FLOOD_PY: &str = r#"
import collections, errno, select, socket, time
done = refused = other = 0
errors = collections.Counter()
t0 = time.time()
for batch in range(20):
    socks = []
    for i in range(500):
        s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect((2, 5000 + (batch * 500 + i) % 97))
        except BlockingIOError:
            pass
        except OSError as e:
            refused += 1
            errors["connect:" + errno.errorcode.get(e.errno, str(e.errno))] += 1
        socks.append(s)
    deadline = time.time() + 20
    pending = list(socks)
    while pending and time.time() < deadline:
        _, w, _ = select.select([], pending, [], 1)
        for s in w:
            e = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if e in (errno.ECONNRESET, errno.ECONNREFUSED):
                refused += 1
            elif e == 0:
                done += 1
            else:
                other += 1
                errors[errno.errorcode.get(e, str(e))] += 1
            pending.remove(s)
    other += len(pending)
    errors["pending"] += len(pending)
    for s in socks:
        s.close()
print("ATTEMPTS", 10000, "REFUSED", refused, "CONNECTED", done, "OTHER", other, "SECONDS", round(time.time() - t0, 1), dict(errors))
"#;

/// A language server that lies (`lsp.start` runs it): answers for requests nobody made, a
/// request of its own asking for 100 000 settings, 5000 progress tokens begun, 50 000 malformed
/// diagnostics for a file outside its root, then a real `initialize` answer. Asked `evil/huge`,
/// it announces a 100 GB message and streams; as `endless-header`, it never ends its header;
/// as `flood`, it publishes diagnostics for 128 URIs of 64 KiB, then for file after file.
const EVIL_LSP_PY: &str = r#"
import json, sys
mode = sys.argv[1]
out, inp = sys.stdout.buffer, sys.stdin.buffer
def read():
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        c = inp.read(1)
        if not c:
            sys.exit(0)
        head += c
    n = int(head.split(b":")[1].split(b"\r")[0])
    return json.loads(inp.read(n))
def send(m):
    b = json.dumps(m).encode()
    out.write(b"Content-Length: %d\r\n\r\n" % len(b) + b)
    out.flush()
if mode == "endless-header":
    out.write(b"Content-Length: 10")
    while True:
        out.write(b"X" * 65536)
        out.flush()
init = read()
send({"jsonrpc": "2.0", "id": 999, "result": "for nobody"})
send({"jsonrpc": "2.0", "id": "s1", "method": "workspace/configuration", "params": {"items": [{}] * 100000}})
for i in range(5000):
    send({"jsonrpc": "2.0", "method": "$/progress", "params": {"token": i, "value": {"kind": "begin"}}})
bad = [{"range": "x", "message": "m" * 100}] * 50000
send({"jsonrpc": "2.0", "method": "textDocument/publishDiagnostics", "params": {"uri": "file:///etc/shadow", "diagnostics": bad}})
send({"jsonrpc": "2.0", "id": init["id"], "result": {"capabilities": {}}})
while True:
    m = read()
    if m.get("method") == "evil/huge":
        out.write(b"Content-Length: 99999999999\r\n\r\n")
        while True:
            out.write(b"A" * 65536)
            out.flush()
    if m.get("method") == "evil/flood":
        for i in range(128):
            send({"jsonrpc": "2.0", "method": "textDocument/publishDiagnostics",
                  "params": {"uri": "file:///" + "u" * 65536 + str(i), "diagnostics": []}})
        for i in range(100000):
            send({"jsonrpc": "2.0", "method": "textDocument/publishDiagnostics",
                  "params": {"uri": "file:///f/%d" % i, "diagnostics": [{"message": "x" * 4000}] * 10}})
"#;

const PRIVILEGES_PY: &str = r#"
import os
for name, value in (("security.capability", b"\x01\x00\x00\x02\xff\xff\xff\xff" + b"\x00" * 12), ("trusted.x", b"1"), ("security.x", b"1"), ("user.x", b"1")):
    try:
        os.setxattr("sh", name, value)
        print("XATTR", name, "set")
    except OSError as e:
        print("XATTR", name, e.strerror)
for mode in (0o4755, 0o2755, 0o6777):
    try:
        os.close(os.open("created-%o" % mode, os.O_CREAT | os.O_WRONLY, mode))
        print("CREATE", oct(mode), oct(os.stat("created-%o" % mode).st_mode))
    except OSError as e:
        print("CREATE", oct(mode), e.strerror)
# A rename that leaves a whiteout (a 0:0 character device) where the file was.
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
open("wo-from", "w").close()
r = libc.renameat2(-100, b"wo-from", -100, b"wo-to", 4)
print("WHITEOUT", r, os.strerror(ctypes.get_errno()))
"#;

/// Set-id files, device nodes and privileged extended attributes below `root` on the host.
fn privileges_found(root: &Path) -> Vec<String> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let mut found = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            let path = entry.path();
            let Ok(meta) = std::fs::symlink_metadata(&path) else { continue };
            let kind = meta.file_type();
            if meta.mode() & 0o6000 != 0 {
                found.push(format!("{} mode {:o}", path.display(), meta.mode()));
            }
            if kind.is_block_device() || kind.is_char_device() {
                found.push(format!("{} a device {:x}", path.display(), meta.rdev()));
            }
            let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
            for name in [c"security.capability", c"trusted.x", c"security.x"] {
                // SAFETY: a size query (null buffer, size 0) on NUL-terminated strings.
                if unsafe { libc::lgetxattr(c.as_ptr(), name.as_ptr(), std::ptr::null_mut(), 0) } >= 0 {
                    found.push(format!("{} has {name:?}", path.display()));
                }
            }
            if kind.is_dir() {
                stack.push(path);
            }
        }
    }
    found
}

/// Hands the folders to the user a root runtime acts for (`UMBRA_SHARE_OWNER`, as
/// `scripts/escape-suite root` sets it): the guest writes as that user, so the folders must be
/// theirs, as a user's own folders are.
fn give_to_share_owner(root: &Path) {
    let Some((uid, gid)) = umbra_runtime::backend::fsd::share_owner() else { return };
    let mut stack = vec![root.to_path_buf()];
    while let Some(path) = stack.pop() {
        std::os::unix::fs::lchown(&path, Some(uid), Some(gid)).unwrap();
        if std::fs::symlink_metadata(&path).unwrap().is_dir() {
            stack.extend(std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().path()));
        }
    }
}

/// Reads every readable mapping of the VM's processes that hold guest memory (QEMU's, or
/// umbra-vmm's) through `/proc/PID/mem`; returns the bytes read and where `needle` was found.
fn process_memory_holds(vm: &[u32], needle: &[u8]) -> (u64, Vec<String>) {
    use std::os::unix::fs::FileExt;
    let (mut scanned, mut hits) = (0u64, Vec::new());
    for &pid in vm {
        let comm = umbra_tests::comm(pid);
        if !(comm.starts_with("qemu-system") || comm.starts_with("umbra-vmm")) {
            continue;
        }
        let (Ok(maps), Ok(mem)) =
            (std::fs::read_to_string(format!("/proc/{pid}/maps")), std::fs::File::open(format!("/proc/{pid}/mem")))
        else {
            continue;
        };
        let mut buf = vec![0u8; (1 << 20) + needle.len()];
        for line in maps.lines() {
            let mut f = line.split_whitespace();
            let (Some(range), Some(perms)) = (f.next(), f.next()) else { continue };
            let Some((lo, hi)) = range.split_once('-') else { continue };
            let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16)) else { continue };
            if !perms.starts_with('r') {
                continue;
            }
            let mut at = lo;
            while at < hi {
                let want = ((hi - at) as usize).min(buf.len());
                let Ok(n) = mem.read_at(&mut buf[..want], at) else { break };
                if n == 0 {
                    break;
                }
                scanned += n as u64;
                if memchr::memmem::find(&buf[..n], needle).is_some() {
                    hits.push(format!("{comm} {pid} near {at:#x}"));
                }
                at += (n.saturating_sub(needle.len())).max(1) as u64;
            }
        }
    }
    (scanned, hits)
}

/// The regular files below `root` of at most 16 MiB (records, logs; not the disk images).
fn walk_files(root: &Path) -> Vec<std::path::PathBuf> {
    let (mut files, mut stack) = (Vec::new(), vec![root.to_path_buf()]);
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let Ok(meta) = std::fs::symlink_metadata(entry.path()) else { continue };
            if meta.is_dir() {
                stack.push(entry.path());
            } else if meta.is_file() && meta.len() <= 16 << 20 {
                files.push(entry.path());
            }
        }
    }
    files
}

/// The (uid, gid) pairs of everything below `root`.
fn owners_in(root: &Path) -> std::collections::BTreeSet<(u32, u32)> {
    use std::os::unix::fs::MetadataExt;
    let mut owners = std::collections::BTreeSet::new();
    for entry in std::fs::read_dir(root).into_iter().flatten().flatten() {
        if let Ok(meta) = std::fs::symlink_metadata(entry.path()) {
            owners.insert((meta.uid(), meta.gid()));
        }
    }
    owners
}

async fn run_suite(backend: BackendKind) {
    let dir = TempDir::new("escape");
    let canary = format!("HOST-CANARY-{}-{}", std::process::id(), backend.name());
    let secret_value = format!("SECRET-VALUE-{}-{}", std::process::id(), backend.name());
    let (ro, rw) = (dir.0.join("ro"), dir.0.join("rw"));
    std::fs::create_dir_all(ro.join("sub")).unwrap();
    std::fs::create_dir_all(&rw).unwrap();
    std::fs::write(ro.join("README"), "read only\n").unwrap();
    std::fs::write(ro.join("sub/deep"), "deep\n").unwrap();
    std::fs::write(rw.join("keep.txt"), "keep me\n").unwrap();
    let secret = dir.0.join("secret");
    std::fs::write(&secret, format!("{canary}\n")).unwrap();
    // Host-made links out of the share, as a repository could carry them.
    std::os::unix::fs::symlink(&secret, rw.join("abs-link")).unwrap();
    std::os::unix::fs::symlink("../secret", rw.join("rel-link")).unwrap();
    std::os::unix::fs::symlink("/etc/shadow", rw.join("shadow-link")).unwrap();
    // Files the session's `ignore` patterns hide: their bytes must never reach the guest (as
    // root, fanotify refuses the opens; without root, the seccomp open check does).
    std::fs::create_dir_all(rw.join("vault")).unwrap();
    std::fs::write(rw.join("api.key"), format!("{canary} api\n")).unwrap();
    std::fs::write(rw.join("vault/token"), format!("{canary} vault\n")).unwrap();
    std::fs::write(ro.join("ro.key"), format!("{canary} ro\n")).unwrap();
    give_to_share_owner(&ro);
    give_to_share_owner(&rw);
    let (ro_before, rw_before) = (snapshot(&ro), snapshot(&rw));

    // For the case "the folder server's mounts": a folder that is a shared mount before the VM
    // starts, as the containerd shim's pod directory is (root only: it takes mounting).
    let prop = dir.0.join("prop");
    std::fs::create_dir_all(prop.join("sub")).unwrap();
    std::fs::write(prop.join("sub/under"), "under\n").unwrap();
    let mount = |args: &[&str]| Command::new("mount").args(args).status().is_ok_and(|s| s.success());
    // SAFETY: geteuid has no preconditions.
    let prop_shared = unsafe { libc::geteuid() } == 0 && {
        let p = prop.display().to_string();
        mount(&["--bind", &p, &p]) && mount(&["--make-shared", &p])
    };
    let m = umbra_tests::session_manager_for(&dir, "standard", MEMORY_MIB);
    let backend_choice = backend.choice();
    let params = StartParams {
        name: SESSION.into(),
        folders: vec![
            FolderSpec { path: ro.clone(), name: Some("ro".into()), mode: ShareMode::Ro },
            FolderSpec { path: rw.clone(), name: Some("rw".into()), mode: ShareMode::Rw },
        ],
        settings: SettingsPatch {
            backend: Some(backend_choice),
            disk_size_mib: Some(DISK_MIB),
            network: Some(NetworkPolicy { mode: NetworkMode::Any, ..Default::default() }),
            policy: Some(SandboxPolicy { ignore: Some(vec!["*.key".into(), "vault/".into()]), ..Default::default() }),
            // The case "listening ports" makes guest listeners the host exposes.
            auto_expose: Some(true),
            ..Default::default()
        },
        // A secret the guest must never see the value of (the case "a secret's value …").
        secrets: vec![umbra_api::secrets::SecretSpec {
            name: "ESC_TOKEN".into(),
            value: Some(umbra_api::secrets::SecretValue::new(secret_value.clone())),
            from_env: None,
            hosts: vec!["secret-host.test".into()],
            inject: vec![umbra_api::secrets::Inject::Header, umbra_api::secrets::Inject::Basic],
        }],
        ..Default::default()
    };
    let s = m.start(params).await.unwrap_or_else(|e| panic!("{backend:?}: start: {e}"));
    // A VM failure (and restart) during a case is reported with its reason.
    let mut events = m.subscribe();
    let vm_failures = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = vm_failures.clone();
    let watcher = tokio::spawn(async move {
        while let Ok(e) = events.recv().await {
            if let umbra_api::event::EventKind::HeartbeatFailure { reason } = e.kind {
                eprintln!("escape: the session's VM failed: {reason}");
                seen.lock().unwrap().push(reason);
            }
        }
    });
    let g = Guest { s: s.clone(), canary: canary.clone() };
    let vm = vm_processes(&s);
    let info = s.info().vm.unwrap();
    let (rss_boot, fds_boot) = (total_rss_mib(&vm), total_fds(&vm));
    let (vmm_boot, helpers_boot) = vmm_and_helpers_rss_mib(&vm);

    let mut cases: Vec<(&str, Case)> = Vec::new();
    // First: later cases fill the guest's disk and memory, and this one shares a folder more.
    cases.push((
        "the folder server's mounts stay in its namespace, a slave of the host's",
        Box::pin(async {
            // The guest tries to mount over a directory of its share (landlock refuses a confined
            // process; were it allowed, it would be a guest mount, on nothing of the host's).
            let _ = g
                .sh(&format!(
                    "d=/sessions/{SESSION}/mnt/rw/mount-here; mkdir -p $d; mount -t tmpfs none $d; echo tried"
                ))
                .await;
            let fsd = vm_processes(&s)
                .into_iter()
                .find(|p| comm(*p) == "umbra-fsd")
                .ok_or("no umbra-fsd among the VM's processes")?;
            let points = |table: &str| -> Vec<(String, String)> {
                table
                    .lines()
                    .filter_map(|l| {
                        let (left, _) = l.split_once(" - ")?;
                        let fields: Vec<&str> = left.split(' ').collect();
                        Some((fields.get(4)?.to_string(), fields.get(6..).unwrap_or_default().join(" ")))
                    })
                    .collect()
            };
            let theirs = points(&std::fs::read_to_string(format!("/proc/{fsd}/mountinfo")).map_err(|e| e.to_string())?);
            let ours = points(&std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| e.to_string())?);
            // Its own: the staging tmpfs and a bind per folder (where the staging directory is
            // differs when it serves for a share owner), none of them on the host.
            let own: Vec<&(String, String)> =
                theirs.iter().filter(|(p, _)| !ours.iter().any(|(q, _)| q == p)).collect();
            if own.len() < 3 {
                return Err(format!(
                    "expected the staging tmpfs and two folder binds of umbra-fsd's own, found {own:?}"
                ));
            }
            // None can propagate out: a mount in a peer group (`shared:`) would.
            if let Some((point, tags)) = theirs.iter().find(|(_, tags)| tags.contains("shared:")) {
                return Err(format!("a shared mount in umbra-fsd's namespace would propagate out: {point} {tags}"));
            }
            if let Some((point, _)) = ours.iter().find(|(p, _)| p.contains("mount-here")) {
                return Err(format!("the guest's mount is on the host: {point}"));
            }
            // The other way: its namespace is a slave of the host's (the containerd shim's pod
            // directory), so a mount the host makes later beneath a folder that is a shared
            // mount reaches it; the share itself is a private clone, so the guest never sees
            // that mount (which would keep its own flags: writable in a read-only share).
            if !prop_shared {
                return Ok(format!(
                    "{} mounts of umbra-fsd's own, none on the host; (host mounts: not root)",
                    own.len()
                ));
            }
            let run = |args: &[&str]| Command::new("mount").args(args).status().map(|s| s.success()).unwrap_or(false);
            let p = prop.display().to_string();
            let shared =
                s.mount(FolderSpec { path: prop.clone(), name: Some("prop".into()), mode: ShareMode::Ro }).await;
            let sub = prop.join("sub").display().to_string();
            let mounted = run(&["-t", "tmpfs", "-o", "size=1m", "host-later", &sub])
                && std::fs::write(prop.join("sub/over"), "over\n").is_ok();
            let (code, out) = g
                .sh(&format!(
                    "ls /sessions/{SESSION}/mnt/prop/sub; echo x > /sessions/{SESSION}/mnt/prop/sub/new && echo wrote"
                ))
                .await;
            let _ = Command::new("umount").arg(&sub).status();
            let _ = s.unmount("prop").await;
            let _ = Command::new("umount").arg(&p).status();
            shared.map_err(|e| format!("sharing the folder: {e}"))?;
            if !mounted {
                return Err("the host's later mount".into());
            }
            if out.contains("over") || out.contains("wrote") || !out.contains("under") {
                return Err(format!("the guest sees or writes the host's later mount (exit {code}): {out}"));
            }
            Ok(format!(
                "{} mounts of umbra-fsd's own, none on the host; no shared mount in its namespace; a host \
                 mount made later under a shared folder is not in the share",
                own.len()
            ))
        }),
    ));

    cases.push((
        "the host processes a guest talks to are confined",
        Box::pin(async {
            let status = |pid: u32, field: &str| {
                let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
                s.lines().find_map(|l| l.strip_prefix(&format!("{field}:")).map(|v| v.trim().to_string()))
            };
            let named = |prefix: &str| vm.iter().copied().filter(|p| comm(*p).starts_with(prefix)).collect::<Vec<_>>();
            let mut seen = Vec::new();
            // SAFETY: geteuid has no preconditions.
            let root = unsafe { libc::geteuid() } == 0;
            for fsd in named("umbra-fsd") {
                if status(fsd, "Seccomp").as_deref() != Some("2") {
                    return Err(format!("umbra-fsd {fsd} is not filtered"));
                }
                seen.push("umbra-fsd: seccomp");
            }
            for virtiofsd in named("virtiofsd") {
                let seen_by_kernel = umbra_runtime::backend::confinement::Confinement::of(virtiofsd)
                    .ok_or_else(|| format!("virtiofsd {virtiofsd} is gone"))?;
                if seen_by_kernel.seccomp != 2 || !seen_by_kernel.no_new_privs {
                    return Err(format!("virtiofsd runs without its no-privilege filter: {seen_by_kernel:?}"));
                }
                if !seen_by_kernel.own_namespaces.iter().any(|ns| ns == "pid") {
                    return Err(format!("virtiofsd shares the host's pid namespace: {seen_by_kernel:?}"));
                }
                if let Some((uid, _)) = umbra_runtime::backend::fsd::share_owner() {
                    if seen_by_kernel.uid != uid || !seen_by_kernel.own_namespaces.contains(&"user".to_string()) {
                        return Err(format!(
                            "virtiofsd is not the owner in its own user namespace: {seen_by_kernel:?}"
                        ));
                    }
                }
                seen.push("virtiofsd: seccomp, no_new_privs, pid namespace");
            }
            // The device models and the vsock daemon: jailed in every namespace but the user's
            // (which they have too, when the runtime is not root), unprivileged, filtered, and
            // seeing nothing of the host's root.
            for (kind, prefix) in
                [("qemu", "qemu-system"), ("vhost-device-vsock", "vhost-device-vs"), ("umbra-vmm", "umbra-vmm")]
            {
                for pid in named(prefix) {
                    let c = umbra_runtime::backend::confinement::Confinement::of(pid)
                        .ok_or_else(|| format!("{kind} {pid} is gone"))?;
                    // umbra-vmm's jailed process is the child of the one the runtime started.
                    if kind == "umbra-vmm" && c.seccomp != 2 {
                        continue;
                    }
                    let mut want = vec!["mnt", "pid", "net", "ipc", "uts"];
                    if !root {
                        want.push("user");
                    }
                    let missing: Vec<_> = want.iter().filter(|ns| !c.own_namespaces.iter().any(|o| o == *ns)).collect();
                    if !missing.is_empty() {
                        return Err(format!("{kind} {pid} shares the host's {missing:?} namespaces: {c:?}"));
                    }
                    // SAFETY: geteuid has no preconditions.
                    let me = unsafe { libc::geteuid() };
                    let want_uid = if root { 65534 } else { me };
                    if c.uid != want_uid || !c.no_capabilities() || !c.no_new_privs || c.seccomp != 2 {
                        return Err(format!("{kind} {pid} keeps privileges (want uid {want_uid}): {c:?}"));
                    }
                    let names: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/root"))
                        .map_err(|e| e.to_string())?
                        .flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect();
                    if names.iter().any(|n| n == "etc" || n == "home" || n == "proc") {
                        return Err(format!("{kind} {pid} sees the host's root: {names:?}"));
                    }
                    seen.push(match kind {
                        "qemu" => "qemu: jail",
                        "umbra-vmm" => "umbra-vmm: jail",
                        _ => "vhost-device-vsock: jail",
                    });
                }
            }
            if seen.is_empty() {
                return Err("no helper found to check".into());
            }
            seen.dedup();
            Ok(seen.join(", "))
        }),
    ));

    cases.push((
        "ignored files: no byte of them, by any open, or by renaming or linking those shared",
        Box::pin(async {
            // Created on the host while the session runs: refused by name.
            std::fs::write(rw.join("late.key"), format!("{canary} late\n")).unwrap();
            give_to_share_owner(&rw.join("late.key"));
            let (_, out) = g
                .sh("cd /sessions/esc/mnt/rw; cat api.key vault/token late.key ../ro/ro.key 2>&1; \
                     dd if=api.key bs=1 count=64 2>&1; cp api.key /tmp/c 2>&1; cat /tmp/c 2>&1; \
                     sh -c 'exec 3<api.key; cat <&3' 2>&1; echo appended >> api.key 2>&1; \
                     mv api.key stolen 2>&1; ln api.key linked 2>&1; ln -s api.key sym && cat sym 2>&1; \
                     mv vault v2 2>&1; cat v2/token 2>&1; cp -r . /tmp/all 2>&1; grep -r . /tmp/all 2>&1; \
                     echo made > new.key 2>&1; cat new.key 2>&1; ls -la; cat keep.txt ../ro/README; true")
                .await;
            g.clean("ignored", &out)?;
            if !out.contains("keep me") || !out.contains("read only") {
                return Err(format!("files no pattern matches were not readable:\n{out}"));
            }
            for (name, marker) in [("api.key", "api"), ("vault/token", "vault"), ("late.key", "late")] {
                if std::fs::read_to_string(rw.join(name)).ok() != Some(format!("{canary} {marker}\n")) {
                    return Err(format!("the host's {name} changed:\n{out}"));
                }
            }
            if rw.join("stolen").exists() || rw.join("linked").exists() || rw.join("v2").exists() {
                return Err(format!("an ignored entry was renamed or linked:\n{out}"));
            }
            // SAFETY: geteuid has no preconditions.
            let how = if unsafe { libc::geteuid() } == 0 { "fanotify" } else { "open check" };
            Ok(format!("refused ({how})"))
        }),
    ));
    cases.push((
        "share paths: symlinks, .., /proc tricks",
        Box::pin(async {
            let (_, out) = g
                .sh("cd /sessions/esc/mnt/rw; cat abs-link rel-link shadow-link ../secret ../../secret \
                     /sessions/esc/mnt/../secret /proc/1/root/../secret /proc/self/cwd/../secret 2>&1; \
                     ls -la .. / 2>&1; find / -xdev -name secret 2>/dev/null; true")
                .await;
            g.clean("paths", &out)?;
            Ok("no host byte".into())
        }),
    ));
    cases.push((
        "hard links across and out of shares",
        Box::pin(async {
            let (_, out) = g
                .sh("cd /sessions/esc/mnt; ln rw/abs-link rw/h1; ln ro/README rw/h2; ln rw/keep.txt ro/h3; \
                     ln -s /sessions/esc/mnt/ro/README rw/s1 && echo x >> rw/s1; echo rc=$?; \
                     cat rw/h1 rw/h2 2>&1; true")
                .await;
            g.clean("links", &out)?;
            if std::fs::read_to_string(ro.join("README")).unwrap() != "read only\n" || ro.join("h3").exists() {
                return Err(format!("the ro share changed through a link:\n{out}"));
            }
            Ok("refused".into())
        }),
    ));
    cases.push((
        "open_by_handle_at with real and forged handles",
        Box::pin(async {
            let (_, out) = g.sh(&python(HANDLES_PY)).await;
            g.clean("handles", &out)?;
            let opened = out.lines().find_map(|l| l.strip_prefix("OPENED ")).unwrap_or("?").to_string();
            let first = out.lines().find(|l| l.starts_with("NAME_TO_HANDLE")).unwrap_or("no NAME_TO_HANDLE line");
            if opened == "?" {
                return Err(format!("the probe did not run:\n{out}"));
            }
            Ok(format!("{first}; {opened} guest-side opens, none outside the shares"))
        }),
    ));
    cases.push((
        "write to a ro share, after remount and bind tricks",
        Box::pin(async {
            let (_, out) = g
                .sh("for m in $(awk '{print $2}' /proc/mounts); do mount -o remount,rw \"$m\" 2>/dev/null; done; \
                     mkdir -p /mnt/b /mnt/v; mount --bind /sessions/esc/mnt/ro /mnt/b; mount -o remount,rw,bind /mnt/b; \
                     mount -t virtiofs umbra /mnt/v 2>&1; \
                     for d in /sessions/esc/mnt/ro /mnt/b /mnt/v/ro /mnt/v; do \
                       echo pwned > $d/README; echo pwned > $d/new; rm -f $d/README; chmod 777 $d/README; \
                       touch -d 2000-01-01 $d/README; mv $d/sub $d/moved; done 2>&1; true")
                .await;
            g.clean("ro", &out)?;
            if snapshot(&ro) != ro_before {
                return Err(format!("the ro share changed on the host:\n{out}"));
            }
            Ok("host folder byte- and mode-identical".into())
        }),
    ));
    cases.push((
        "delete in a rw (not rwd) share",
        Box::pin(async {
            let (_, out) = g
                .sh("cd /sessions/esc/mnt/rw; rm -f keep.txt; mv keep.txt gone; echo new > keep.txt; \
                     echo edit >> keep.txt; echo RC=$?; true")
                .await;
            g.clean("rw", &out)?;
            let keep = std::fs::read_to_string(rw.join("keep.txt")).unwrap_or_default();
            if !keep.starts_with("keep me") && !keep.starts_with("new") {
                return Err(format!("keep.txt is gone or replaced ({keep:?}):\n{out}"));
            }
            if !rw.join("keep.txt").exists() || rw.join("gone").exists() {
                return Err(format!("a delete or rename went through:\n{out}"));
            }
            Ok("deletes and renames refused, edits land".into())
        }),
    ));
    cases.push((
        "fork bomb",
        Box::pin(async {
            let procs_before = std::fs::read_dir("/proc").unwrap().count();
            let bomb = g.s.spawn(ExecRequest {
                argv: vec!["sh".into(), "-c".into(), "b() { b | b & }; b; sleep 60".into()],
                ..Default::default()
            });
            let _bomb = bomb.await.map_err(|e| format!("spawn the bomb: {e}"))?;
            tokio::time::sleep(Duration::from_secs(15)).await;
            // The agent itself answers at once (new commands join the bomb's cgroup and crawl).
            let started = Instant::now();
            let stat = tokio::time::timeout(Duration::from_secs(15), g.s.stat("/sys/fs/cgroup/umbra-commands", false))
                .await
                .map_err(|_| "during the bomb the agent did not answer a stat within 15 s".to_string())?;
            stat.map_err(|e| format!("stat during the bomb: {e}"))?;
            let during = started.elapsed();
            let count = match g.s.read_file("/sys/fs/cgroup/umbra-commands/pids.current", false, 0, 64).await {
                Ok((bytes, _)) => String::from_utf8_lossy(&bytes).trim().to_string(),
                Err(e) => format!("? ({e})"),
            };
            g.s.kill_all(9).await.map_err(|e| format!("kill_all: {e}"))?;
            let after = g.answers(Duration::from_secs(60)).await?;
            all_alive(&vm)?;
            let procs_after = std::fs::read_dir("/proc").unwrap().count();
            if procs_after > procs_before.saturating_add(16) {
                return Err(format!("host processes grew from {procs_before} to {procs_after}"));
            }
            Ok(format!(
                "{count} tasks in the commands' cgroup; the agent answered in {during:.1?} during, a new command \
                 ran {after:.1?} after kill_all"
            ))
        }),
    ));
    cases.push((
        "memory exhaustion",
        Box::pin(async {
            let (code, out) = g.sh(&python("a = []\nwhile True:\n    a.append(bytearray(16 << 20))")).await;
            let t = g.answers(Duration::from_secs(60)).await?;
            all_alive(&vm)?;
            let rss = total_rss_mib(&vm);
            let (vmm, helpers) = vmm_and_helpers_rss_mib(&vm);
            // The guest may have touched all its memory once; beyond it the VMM holds only its
            // own working set (QEMU's TCG keeps a translation cache; umbra-vmm almost nothing).
            // The other helpers (umbra-fsd, virtiofsd, vhost-device-vsock, their relays) are
            // bounded by what they held at boot: a guest's memory use is not theirs to grow.
            let own = match backend {
                BackendKind::Qemu => 384,
                BackendKind::Kvm => 64,
                BackendKind::Vz => unreachable!("the escape suite runs on Linux backends"),
            };
            if vmm > MEMORY_MIB as u64 + own {
                return Err(format!(
                    "the VMM's host RSS grew from {vmm_boot} to {vmm} MiB, over the guest's {MEMORY_MIB} + {own}"
                ));
            }
            if helpers > helpers_boot + HELPERS_GROWTH_MIB {
                return Err(format!(
                    "the helpers' anonymous host RSS grew from {helpers_boot} to {helpers} MiB (more than {HELPERS_GROWTH_MIB})"
                ));
            }
            let how = if out.contains("MemoryError") { "MemoryError".to_string() } else { format!("exit {code}") };
            Ok(format!(
                "the hog ended ({how}); agent answered in {t:.1?}; VM RSS {rss_boot} → {rss} MiB: VMM \
                 {vmm_boot} → {vmm} (bound {MEMORY_MIB} + {own}), other helpers (anonymous) {helpers_boot} → {helpers}"
            ))
        }),
    ));
    cases.push((
        "a secret's value is nowhere in the guest: environment, files, the VM's memory",
        Box::pin(async {
            // The script carries the value hex-encoded: its own command line must not hold it.
            let hex: String = secret_value.bytes().map(|b| format!("{b:02x}")).collect();
            let (code, out) = g
                .sh(&format!(
                    "echo \"placeholder=$ESC_TOKEN\"; python3 - 2>&1 <<'PY'\n\
                     import os, re\n\
                     v = bytes.fromhex('{hex}')\n\
                     found, errors, scanned = [], [], 0\n\
                     for pid in [p for p in os.listdir('/proc') if p.isdigit()]:\n\
                     \x20   for f in ('environ', 'cmdline'):\n\
                     \x20       try:\n\
                     \x20           if v in open(f'/proc/{{pid}}/{{f}}', 'rb').read(): found.append(f'{{pid}}/{{f}}')\n\
                     \x20       except OSError: pass\n\
                     # Every readable mapping of the agent (PID 1), as a memory dump would hold it.\n\
                     try:\n\
                     \x20   mem = open('/proc/1/mem', 'rb', 0)\n\
                     \x20   for line in open('/proc/1/maps'):\n\
                     \x20       m = re.match(r'([0-9a-f]+)-([0-9a-f]+) r', line)\n\
                     \x20       if not m: continue\n\
                     \x20       lo, hi = int(m.group(1), 16), int(m.group(2), 16)\n\
                     \x20       for at in range(lo, hi, 1 << 20):\n\
                     \x20           try:\n\
                     \x20               mem.seek(at); chunk = mem.read(min(hi - at, (1 << 20) + 4096))\n\
                     \x20           except (OSError, ValueError, OverflowError) as e:\n\
                     \x20               errors.append(f'{{line.split()[0]}}: {{e}}'); break\n\
                     \x20           scanned += len(chunk)\n\
                     \x20           if v in chunk: found.append('agent memory ' + line.split()[0])\n\
                     except OSError as e: errors.append(f'/proc/1/mem: {{e}}')\n\
                     for top in ('/etc', '/run', '/root', '/tmp', '/var', '/home', '/usr/local'):\n\
                     \x20   for d, _, files in os.walk(top):\n\
                     \x20       for name in files:\n\
                     \x20           try:\n\
                     \x20               if v in open(os.path.join(d, name), 'rb').read(): found.append(os.path.join(d, name))\n\
                     \x20           except OSError: pass\n\
                     print(f'agent-bytes-scanned={{scanned}}')\n\
                     print('errors=' + '; '.join(errors[:5]))\n\
                     print('found=' + ','.join(found))\n\
                     PY"
                ))
                .await;
            let placeholder = s.info().secrets.first().map(|i| i.placeholder.clone()).unwrap_or_default();
            if code != 0 || !out.contains(&format!("placeholder={placeholder}")) || placeholder.is_empty() {
                return Err(format!("the guest's $ESC_TOKEN is not the placeholder {placeholder:?}: exit {code}: {out}"));
            }
            if !out.lines().any(|l| l == "found=") {
                return Err(format!("the secret's value is readable in the guest: {out}"));
            }
            // Nor anywhere in the guest's memory: the whole of it, read from the VM's process on
            // the host (commands in this session cannot read the agent's memory themselves).
            let (scanned, hits) = process_memory_holds(&vm, secret_value.as_bytes());
            if scanned < u64::from(MEMORY_MIB) << 20 {
                return Err(format!("read only {} MiB of the VM's memory (its {MEMORY_MIB} MiB expected)", scanned >> 20));
            }
            if !hits.is_empty() {
                return Err(format!("the secret's value is in the VM's memory: {hits:?}"));
            }
            // The same scan finds what the guest does hold: the placeholder.
            if process_memory_holds(&vm, placeholder.as_bytes()).1.is_empty() {
                return Err("the memory scan does not even find the placeholder the guest holds".into());
            }
            // Nor in what the host keeps of the session (its record, its storage).
            let mut host_hits = Vec::new();
            for entry in walk_files(&dir.0) {
                if std::fs::read(&entry).is_ok_and(|b| b.windows(secret_value.len()).any(|w| w == secret_value.as_bytes())) {
                    host_hits.push(entry.display().to_string());
                }
            }
            if !host_hits.is_empty() {
                return Err(format!("the secret's value is in the session's host files: {host_hits:?}"));
            }
            Ok(format!(
                "$ESC_TOKEN is {placeholder}; the value is in no process's environment or command line, no file, \
                 none of the VM process's {} MiB of memory (guest RAM included), and no host file of the session",
                scanned >> 20
            ))
        }),
    ));
    cases.push((
        "no host privilege through a share: set-id files, devices, capabilities",
        Box::pin(async {
            // A set-id file the host already has in the folder: the guest's write lands, and
            // the kernel clears the bits (virtiofsd holds no CAP_FSETID), as for any
            // unprivileged writer.
            use std::os::unix::fs::PermissionsExt;
            let host_setid = rw.join("host-setid");
            std::fs::write(&host_setid, "#!/bin/sh\n").unwrap();
            give_to_share_owner(&host_setid);
            std::fs::set_permissions(&host_setid, std::fs::Permissions::from_mode(0o6755)).unwrap();
            let (_, out) = g
                .sh(&format!(
                    "mkdir -p /sessions/esc/mnt/rw/priv && cd /sessions/esc/mnt/rw/priv && {{ \
                     cp /bin/busybox sh 2>/dev/null || cp /bin/sh sh; chown 0:0 sh; echo chown=$?; \
                     chmod 4755 sh; echo suid=$?; chmod 2755 sh; echo sgid=$?; chmod u+s,g+s sh; \
                     cp -a /bin/su su-copy; echo cp-a=$?; install -m 4755 /bin/true installed; echo install=$?; \
                     mknod disk b 7 0; echo block=$?; chmod 666 disk; mknod null c 1 3; echo char=$?; \
                     mknod whiteout c 0 0; echo whiteout=$?; mkfifo fifo; echo fifo=$?; \
                     mkdir setgid-dir; chmod g+s setgid-dir; echo dir-sgid=$?; \
                     echo 'echo appended' >> ../host-setid; echo host-setid=$?; \
                     {}\n}} 2>&1; true",
                    python(PRIVILEGES_PY)
                ))
                .await;
            g.clean("privileges", &out)?;
            if !out.contains("fifo=0") || !out.contains("XATTR") || !out.contains("WHITEOUT") {
                return Err(format!("the probe did not run:\n{out}"));
            }
            let mode = std::fs::metadata(&host_setid).map(|m| m.permissions().mode()).unwrap_or(0);
            let content = std::fs::read_to_string(&host_setid).unwrap_or_default();
            let _ = std::fs::remove_file(&host_setid);
            if !content.contains("echo appended") {
                return Err(format!("the guest's write to a host set-id file did not land:\n{out}"));
            }
            if mode & 0o6000 != 0 {
                return Err(format!("a host set-id file kept mode {mode:o} after the guest wrote it"));
            }
            let found = privileges_found(&rw.join("priv"));
            if !found.is_empty() {
                return Err(format!("the host folder holds {found:?}:\n{out}"));
            }
            let owner = umbra_runtime::backend::fsd::share_owner();
            let owners = owners_in(&rw.join("priv"));
            if let Some((uid, gid)) = owner {
                if owners.iter().any(|o| *o != (uid, gid)) {
                    return Err(format!("files belong to {owners:?}, not the invoking user {uid}:{gid}"));
                }
            }
            let whiteout = out.lines().find(|l| l.starts_with("WHITEOUT")).unwrap_or_default();
            Ok(format!("no set-id bit, device or capability on the host; owners {owners:?}; {whiteout}"))
        }),
    ));
    cases.push((
        "a read-only folder nested in a writable one",
        Box::pin(async {
            let outer = dir.0.join("outer");
            std::fs::create_dir_all(outer.join("inner")).unwrap();
            std::fs::write(outer.join("inner/data"), "inner\n").unwrap();
            give_to_share_owner(&outer);
            let mount = |path: PathBuf, name: &str, mode| g.s.mount(FolderSpec { path, name: Some(name.into()), mode });
            // As a session's start does: the read-only folder first, then its writable parent.
            mount(outer.join("inner"), "inner", ShareMode::Ro).await.map_err(|e| format!("mount inner: {e}"))?;
            mount(outer.clone(), "outer", ShareMode::Rwd).await.map_err(|e| format!("mount outer: {e}"))?;
            let (_, out) = g
                .sh("cd /sessions/esc/mnt/outer; echo pwned > inner/data; echo new > inner/new; \
                     chmod 777 inner/data; rm -f inner/data; mv inner moved; rm -rf inner; \
                     mount -o remount,rw /sessions/esc/mnt/outer/inner; echo pwned > inner/data; \
                     ls -la inner 2>&1; true")
                .await;
            g.clean("nested", &out)?;
            let data = std::fs::read_to_string(outer.join("inner/data")).unwrap_or_default();
            if data != "inner\n" || outer.join("inner/new").exists() || outer.join("moved").exists() {
                return Err(format!("the ro folder was written through its writable parent ({data:?}):\n{out}"));
            }
            // The other order, a read-only folder added inside a writable one the guest already
            // has (it may hold the folder open through it), is refused. (Swapping a folder while
            // it is not shared is the resume test below: a share re-resolved by path is refused.)
            std::fs::create_dir_all(outer.join("later")).unwrap();
            give_to_share_owner(&outer.join("later"));
            let refusal = match mount(outer.join("later"), "later", ShareMode::Ro).await {
                Ok(_) => return Err("a read-only folder was added inside a writable one the guest has".into()),
                Err(e) => e.to_string(),
            };
            Ok(format!("writes through the parent refused on the host; a later nested share refused: {refusal}"))
        }),
    ));
    cases.push((
        "shadow apply: a change after the review, and .git/config",
        Box::pin(async {
            // Issue 28: a process left running changes a reviewed file and tells git to run a
            // command (core.fsmonitor) after the diff; the apply must write the reviewed bytes only.
            let shadow = dir.0.join("shadow");
            std::fs::create_dir_all(shadow.join(".git")).unwrap();
            std::fs::write(shadow.join("f.txt"), "original\n").unwrap();
            let config = "[core]\n\tbare = false\n";
            std::fs::write(shadow.join(".git/config"), config).unwrap();
            let spec = FolderSpec { path: shadow.clone(), name: Some("shadow".into()), mode: ShareMode::Shadow };
            let info = g.s.mount(spec).await.map_err(|e| format!("mount the shadow folder: {e}"))?;
            let at = info.guest_path;
            let attacker = g.s.spawn(ExecRequest {
                argv: vec![
                    "sh".into(),
                    "-c".into(),
                    format!(
                        "for i in $(seq 600); do [ -e /tmp/go ] && break; sleep 0.1; done; \
                         echo malicious > {at}/f.txt; \
                         printf '\\tfsmonitor = touch /tmp/pwned\\n' >> {at}/.git/config; touch /tmp/done"
                    ),
                ],
                ..Default::default()
            });
            let _attacker = attacker.await.map_err(|e| format!("spawn the detached writer: {e}"))?;
            let (code, out) = g.sh(&format!("echo reviewed > {at}/f.txt")).await;
            if code != 0 {
                return Err(format!("the guest could not write its shadow folder:\n{out}"));
            }
            let reviewed = g.s.shadow_diff("shadow").await.map_err(|e| format!("diff: {e}"))?;
            let listed: Vec<&str> = reviewed.changes.iter().map(|c| c.path.as_str()).collect();
            if listed != ["f.txt"] {
                return Err(format!("the diff lists {listed:?}"));
            }
            let (_, out) = g
                .sh("touch /tmp/go; for i in $(seq 100); do [ -e /tmp/done ] && break; sleep 0.1; done; \
                                 cat /tmp/done && echo WROTE")
                .await;
            if !out.contains("WROTE") {
                return Err(format!("the detached writer did not run:\n{out}"));
            }
            let report =
                g.s.shadow_apply("shadow", Some(&reviewed.changeset), None).await.map_err(|e| format!("apply: {e}"))?;
            let f = std::fs::read_to_string(shadow.join("f.txt")).unwrap_or_default();
            let git = std::fs::read_to_string(shadow.join(".git/config")).unwrap_or_default();
            if report.applied != ["f.txt"] || f != "reviewed\n" || git != config {
                return Err(format!("applied {:?}; f.txt {f:?}; .git/config {git:?}", report.applied));
            }
            // Naming .git/config cannot add it to what was reviewed; a new diff marks it, and
            // it still applies only when named.
            let named = [".git/config".to_owned()];
            if g.s.shadow_apply("shadow", Some(&reviewed.changeset), Some(&named)).await.is_ok() {
                return Err("an apply named a path its change-set does not hold".into());
            }
            if g.s.shadow_apply("shadow", None, None).await.is_ok() {
                return Err("an apply without a change-set went through".into());
            }
            let again = g.s.shadow_diff("shadow").await.map_err(|e| format!("diff: {e}"))?;
            let entry =
                again.changes.iter().find(|c| c.path == ".git/config").ok_or("the new diff lacks .git/config")?;
            let report = g.s.shadow_apply("shadow", Some(&again.changeset), None).await.map_err(|e| e.to_string())?;
            let git = std::fs::read_to_string(shadow.join(".git/config")).unwrap_or_default();
            if git != config || report.applied.iter().any(|p| p.starts_with(".git")) {
                return Err(format!(".git/config was applied unnamed: {report:?}"));
            }
            g.s.unmount("shadow").await.map_err(|e| format!("unmount: {e}"))?;
            Ok(format!(
                "applied only the reviewed f.txt; .git/config marked {:?} ({:?}), skipped",
                entry.risks, entry.applies
            ))
        }),
    ));

    cases.push((
        "fill the session disk and the tmpfs",
        Box::pin(async {
            let (_, out) = g
                .sh("dd if=/dev/zero of=/fill bs=1M 2>&1 | tail -1; dd if=/dev/zero of=/tmp/fill bs=1M 2>&1 | tail -1; \
                     df -m / /tmp | tail -2; sync")
                .await;
            let t = g.answers(Duration::from_secs(60)).await?;
            let storage = g.s.storage_dir().ok_or("the session has no storage directory")?;
            let mut allocated = 0u64;
            for entry in std::fs::read_dir(&storage).map_err(|e| e.to_string())?.flatten() {
                use std::os::unix::fs::MetadataExt;
                allocated += entry.metadata().map_or(0, |m| m.blocks() * 512);
            }
            if allocated > (DISK_MIB + 8) << 20 {
                return Err(format!("the session storage holds {} MiB for a {DISK_MIB} MiB disk", allocated >> 20));
            }
            let (_, _) = g.sh("rm -f /fill /tmp/fill").await;
            let last = out.lines().filter(|l| l.contains("copied") || l.contains("No space")).count();
            Ok(format!(
                "both filled ({last} dd reports); host storage {} MiB; agent answered in {t:.1?}",
                allocated >> 20
            ))
        }),
    ));
    cases.push((
        "flood the console",
        Box::pin(async {
            let (_, _) = g
                .sh("timeout 20 sh -c 'while :; do cat /proc/cpuinfo /proc/meminfo /proc/self/maps; done > /dev/console' \
                     2>/dev/null; true")
                .await;
            let t = g.answers(Duration::from_secs(60)).await?;
            let log = info.run_dir.join("console.log");
            let size = std::fs::metadata(&log).map_err(|e| format!("{}: {e}", log.display()))?.len();
            let cap = match backend {
                BackendKind::Qemu => umbra_runtime::backend::console::CONSOLE_LOG_CAP,
                BackendKind::Kvm => 16 << 20,
                BackendKind::Vz => unreachable!("the escape suite runs on Linux backends"),
            };
            if size > cap + (64 << 10) {
                return Err(format!("the console log is {size} bytes, over its {cap}-byte cap"));
            }
            Ok(format!("console.log {} KiB (cap {} MiB); agent answered in {t:.1?}", size >> 10, cap >> 20))
        }),
    ));
    cases.push((
        "10,000 vsock connections to host ports",
        Box::pin(async {
            // Counted from the case's own start: the folder server holds a descriptor per file
            // the earlier cases looked up, which is not this case's to answer for.
            let before = total_fds(&vm);
            let (_, out) = g.sh(&python(VSOCK_FLOOD_PY)).await;
            if !out.contains("ATTEMPTS 10000") {
                return Err(format!("the flood did not run:\n{out}"));
            }
            let t = g.answers(Duration::from_secs(60)).await?;
            all_alive(&vm)?;
            tokio::time::sleep(Duration::from_secs(1)).await;
            let fds = total_fds(&vm);
            if fds > before + 16 {
                return Err(format!("the VM's host fds grew from {before} to {fds} (at boot {fds_boot})"));
            }
            Ok(format!("{}; host fds {before} → {fds} (at boot {fds_boot}); agent answered in {t:.1?}", out.trim()))
        }),
    ));
    cases.push((
        "egress to private, loopback and metadata addresses",
        Box::pin(async {
            let (_, out) = g
                .sh("for a in 10.1.2.3 172.16.0.1 192.168.1.1 127.0.0.1 169.254.169.254 [::1] [fd00::1]; do \
                       curl -sS -m 10 --noproxy '*' http://$a/ 2>&1 | head -1; echo \"$a rc=$?\"; done")
                .await;
            if out.lines().filter(|l| l.contains("rc=")).count() != 7 {
                return Err(format!("the attempts did not run:\n{out}"));
            }
            // The decision function refuses them before any connect (no packet leaves).
            let policy =
                umbra_runtime::egress::Policy::new(&NetworkPolicy { mode: NetworkMode::Any, ..Default::default() });
            for a in ["10.1.2.3", "172.16.0.1", "192.168.1.1", "127.0.0.1", "169.254.169.254", "::1", "fd00::1"] {
                let addr: std::net::IpAddr = a.parse().unwrap();
                let host = umbra_runtime::egress::HostAddresses::current().map_err(|e| e.to_string())?;
                if policy.check_address(addr, &host).is_ok() {
                    return Err(format!("{a} would be connected to"));
                }
            }
            let (_, _) = g.sh("true").await;
            Ok("all 7 refused by the host's address check".into())
        }),
    ));
    cases.push((
        "egress to a name the allowlist does not list",
        Box::pin(async {
            g.s.set_network(NetworkPolicy {
                mode: NetworkMode::Allowlist,
                allow_domains: vec!["allowed.test".into()],
                ..Default::default()
            })
            .map_err(|e| e.to_string())?;
            let (code, out) = g.sh("curl -sS -m 10 --noproxy '*' http://unlisted.example/ 2>&1").await;
            if code == 0 {
                return Err(format!("curl reached an unlisted name:\n{out}"));
            }
            Ok(format!("refused: {}", out.lines().next().unwrap_or_default()))
        }),
    ));
    cases.push((
        "a network question's process name puts no terminal control before the user",
        Box::pin(async {
            // Mode `ask`: the guest's agent names the process behind a connection, and the
            // question (an event the app shows, a line vmctl prints) carries that name. A
            // process named with escape sequences, line breaks and a bidi override.
            g.s.set_network(NetworkPolicy { mode: NetworkMode::Ask, ask_timeout_secs: Some(2), ..Default::default() })
                .map_err(|e| e.to_string())?;
            let mut events = m.subscribe();
            let code = "import os\n\
                        name = 'curl\\x1b]0;owned\\x07\\x1b[2J\\r\\nallowed by the user \\u202etxt.exe'\n\
                        os.execv('/usr/bin/curl', [name, '-sS', '-m', '20', '--noproxy', '*', 'http://asked.escape.test/'])";
            let (_, out) = g.sh(&format!("{}\necho rc=$?", python(code))).await;
            let restore = NetworkPolicy {
                mode: NetworkMode::Allowlist,
                allow_domains: vec!["allowed.test".into()],
                ..Default::default()
            };
            g.s.set_network(restore).map_err(|e| e.to_string())?;
            if out.contains("rc=0") {
                return Err(format!("the unanswered connection went through:\n{out}"));
            }
            let mut asked = None;
            while let Ok(e) = events.try_recv() {
                if let umbra_api::event::EventKind::PermissionRequest { host: Some(h), process, .. } = e.kind {
                    if h == "asked.escape.test" {
                        asked = Some(process);
                    }
                }
            }
            let process = asked.ok_or_else(|| format!("no question about asked.escape.test:\n{out}"))?;
            let process = process.ok_or("the question names no process (the agent should have found curl)")?;
            let bad = |c: char| c.is_control() || ('\u{202a}'..='\u{202e}').contains(&c) || ('\u{2066}'..='\u{2069}').contains(&c);
            if process.command.chars().any(bad) {
                return Err(format!("a control character reached the question: {:?}", process.command));
            }
            if !process.command.starts_with("curl?]0;owned??[2J??allowed by the user ?txt.exe -sS") {
                return Err(format!("not the process that asked: {:?}", process.command));
            }
            Ok(format!("named as {:?} (pid {:?})", process.command, process.pid))
        }),
    ));
    cases.push((
        "kept processes and terminals: guest output costs the host its bound; forged markers answer no run",
        Box::pin(async {
            use umbra_api::kept::KEPT_OUTPUT_BYTES;
            // 64 MiB from a detached process nobody reads: the host keeps its last 1 MiB.
            let flood = ExecRequest {
                argv: vec!["sh".into(), "-c".into(), "head -c 67108864 /dev/zero | tr '\\0' x".into()],
                ..Default::default()
            };
            let kept = g.s.spawn_kept(flood).await.map_err(|e| e.to_string())?;
            let mut reader = kept.reader(Default::default());
            while let Some(ev) = tokio::time::timeout(Duration::from_secs(120), reader.next())
                .await
                .map_err(|_| "the flood did not end within 120 s".to_string())?
            {
                if matches!(ev, umbra_runtime::session::KeptEvent::Exit(_)) {
                    break;
                }
            }
            let (out, _) = kept.ranges();
            if out.end != 64 << 20 || out.end - out.start > KEPT_OUTPUT_BYTES {
                return Err(format!("the host kept {out:?} of 64 MiB (bound {KEPT_OUTPUT_BYTES})"));
            }
            // A terminal whose guest prints forged markers (another nonce, and one that never
            // ends) before the host's run: the run still gets its own answer, bounded in time.
            let request = umbra_runtime::session::TerminalRequest {
                shell: vec!["/bin/sh".into()],
                cwd: None,
                env: Default::default(),
                size: umbra_proto::TtySize { rows: 24, cols: 80 },
            };
            let term = g.s.open_terminal(request).await.map_err(|e| e.to_string())?;
            // The command itself prints them, so they arrive while the run waits.
            let forge = "printf '\\033]6973;0000000000000000;0;/forged\\007\\033]6973;'; head -c 200000 /dev/zero | tr '\\0' a; cd /tmp";
            let ran = tokio::time::timeout(Duration::from_secs(60), g.s.terminal_run(term.id(), forge, Some(Duration::from_secs(50))))
                .await
                .map_err(|_| "terminal.run did not answer within 60 s".to_string())?
                .map_err(|e| e.to_string())?;
            if ran != (0, "/tmp".to_string()) {
                return Err(format!("terminal.run answered {ran:?}, not the shell's own (0, /tmp)"));
            }
            let (shown, _) = term.ranges();
            if shown.end - shown.start > KEPT_OUTPUT_BYTES {
                return Err(format!("the terminal's scrollback holds {shown:?}"));
            }
            g.s.close_terminal(term.id()).map_err(|e| e.to_string())?;
            Ok(format!("64 MiB flood kept as {out:?}; run answered {ran:?} after forged markers"))
        }),
    ));
    cases.push((
        "listening ports: what the guest opens the host exposes only on loopback, bounded",
        Box::pin(async {
            // 100 listeners on loopback and one on the wildcard, held by a process named with
            // escape sequences; `auto_expose` is on for this session.
            let mut events = m.subscribe();
            let code = "import os, socket, time\n\
                        ls = []\n\
                        for p in range(20000, 20100):\n\
                        \x20   s = socket.socket(); s.bind(('127.0.0.1', p)); s.listen(); ls.append(s)\n\
                        w = socket.socket(); w.bind(('0.0.0.0', 20100)); w.listen(); ls.append(w)\n\
                        print('listening', flush=True)\n\
                        time.sleep(8)";
            let script = format!(
                "cat > /tmp/listen.py <<'PY'\n{code}\nPY\nexec bash -c 'exec -a \"$(printf \"srv\\033]0;owned\\007\")\" python3 /tmp/listen.py'"
            );
            let (rc, out) = g.sh(&script).await;
            if rc != 0 || !out.contains("listening") {
                return Err(format!("the listeners did not run (exit {rc}):\n{out}"));
            }
            let mut opened = 0;
            let mut exposed = 0;
            let mut closed = 0;
            while let Ok(e) = events.try_recv() {
                match e.kind {
                    umbra_api::event::EventKind::PortOpened { port, process, exposed: ex } if (20000..=20100).contains(&port) => {
                        opened += 1;
                        if let Some(info) = ex {
                            exposed += 1;
                            if !info.bind.is_loopback() {
                                return Err(format!("port {port} exposed on {}", info.bind));
                            }
                        }
                        if let Some(p) = process {
                            if p.command.chars().any(|c| c.is_control()) {
                                return Err(format!("a control character in a process name: {:?}", p.command));
                            }
                        }
                    }
                    umbra_api::event::EventKind::PortClosed { port } if (20000..=20100).contains(&port) => closed += 1,
                    _ => {}
                }
            }
            // The program has ended: every automatic exposure with it (within a poll or two).
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            let left = loop {
                let left: Vec<u16> = g.s.ports().iter().map(|p| p.guest_port).filter(|p| (20000..=20100).contains(p)).collect();
                if left.is_empty() || std::time::Instant::now() > deadline {
                    break left;
                }
                tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            };
            if !left.is_empty() {
                return Err(format!("still exposed after the program ended: {left:?}"));
            }
            if opened < 64 || exposed > umbra_runtime::session::ports::MAX_AUTO_EXPOSED {
                return Err(format!("{opened} announced, {exposed} exposed (at most {})", umbra_runtime::session::ports::MAX_AUTO_EXPOSED));
            }
            Ok(format!("{opened} announced, {exposed} exposed on loopback (cap {}), {closed} closed so far, none left", umbra_runtime::session::ports::MAX_AUTO_EXPOSED))
        }),
    ));
    cases.push((
        "egress in any mode to the host's own non-loopback address",
        Box::pin(async {
            use umbra_runtime::egress::{HostAddresses, Policy};
            // A host service the guest must not reach; the test itself listens on 127.0.0.1
            // only. A service bound to 0.0.0.0 would answer on every address below.
            let server = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
            server.set_nonblocking(true).map_err(|e| e.to_string())?;
            let port = server.local_addr().unwrap().port();
            let host = HostAddresses::current().map_err(|e| e.to_string())?;
            let own: Vec<std::net::IpAddr> = host
                .addresses()
                .filter(|a| {
                    !a.is_loopback() && !matches!(a, std::net::IpAddr::V6(v) if v.segments()[0] & 0xffc0 == 0xfe80)
                })
                .collect();
            let target = own.iter().find(|a| a.is_ipv4()).or(own.first()).copied();
            // Any mode, even with a range around the host's address allowed (its LAN): the
            // decision function refuses the host's own addresses. Checked first, so that no
            // connect can be made if it did not.
            let lan: Vec<String> = own.iter().map(|a| format!("{a}/{}", if a.is_ipv4() { 8 } else { 48 })).collect();
            let network = NetworkPolicy { mode: NetworkMode::Any, allow_cidrs: lan.clone(), ..Default::default() };
            let policy = Policy::new(&network);
            for a in own.iter().copied().chain(["0.0.0.0".parse().unwrap(), "::".parse().unwrap()]) {
                if policy.check_address(a, &host).is_ok() {
                    return Err(format!("{a} (this host's) would be connected to"));
                }
            }
            let Some(target) = target else {
                return Ok("no non-loopback interface here: 0.0.0.0 and :: refused at the decision".into());
            };
            g.s.set_network(network).map_err(|e| e.to_string())?;
            let mut events = m.subscribe();
            let url = match target {
                std::net::IpAddr::V4(v4) => format!("http://{v4}:{port}/"),
                std::net::IpAddr::V6(v6) => format!("http://[{v6}]:{port}/"),
            };
            let (code, out) = g.sh(&format!("curl -sS -m 10 --noproxy '*' {url} 2>&1; echo rc=$?")).await;
            if out.contains("rc=0") || code != 0 {
                return Err(format!("curl {url} was not refused:\n{out}"));
            }
            if server.accept().is_ok() {
                return Err("the host's 127.0.0.1 service got a connection".into());
            }
            let mut refusal = None;
            while let Ok(e) = events.try_recv() {
                if let umbra_api::event::EventKind::Egress { name, allowed, reason, .. } = e.kind {
                    if name == target.to_string() {
                        if allowed {
                            return Err(format!("the host allowed a connection to {target}"));
                        }
                        refusal = reason;
                    }
                }
            }
            let reason = refusal.ok_or_else(|| format!("no egress decision for {target}"))?;
            if !reason.contains("address of this host") {
                return Err(format!("refused for another reason: {reason}"));
            }
            Ok(format!("{target} refused at the decision ({reason}); allowed ranges {lan:?}"))
        }),
    ));

    cases.push((
        "outputs: links the guest plants are not followed by the host",
        Box::pin(outputs_links_case(&g, &m, &s, &dir.0, &secret)),
    ));
    cases.push((
        "a lying language server ends itself, not the host",
        Box::pin(async {
            let (code, out) = g.sh(&format!("cat > /tmp/evil-lsp.py <<'PYEOF'\n{EVIL_LSP_PY}\nPYEOF\n")).await;
            if code != 0 {
                return Err(format!("writing the server: {out}"));
            }
            let start = |mode: &str| umbra_api::lsp::LspStartParams {
                session: SESSION.into(),
                folder: "rw".into(),
                command: Some(vec!["python3".into(), "/tmp/evil-lsp.py".into(), mode.into()]),
                ..Default::default()
            };
            let t = Instant::now();
            // The runtime runs in this process: what it holds shows in this RSS.
            let rss_before = rss_mib(std::process::id());
            // Its lies are absorbed, and it starts.
            let info = g.s.lsp_start(start("lies")).await.map_err(|e| format!("lsp.start: {e}"))?;
            // A 100 GB message is refused at its header; the request fails at once, naming it.
            let e =
                g.s.lsp_request(info.server, "evil/huge", serde_json::json!({}), Some(60_000))
                    .await
                    .err()
                    .ok_or("evil/huge was answered")?;
            if !e.to_string().contains("at most") || t.elapsed() > Duration::from_secs(60) {
                return Err(format!("evil/huge: {e} after {:?}", t.elapsed()));
            }
            // A header that never ends, at start.
            let e = g.s.lsp_start(start("endless-header")).await.err().ok_or("an endless header started")?;
            if !e.to_string().contains("header longer") {
                return Err(format!("endless header: {e}"));
            }
            // Diagnostics for file after file: ended at the host's bound.
            let flood = g.s.lsp_start(start("lies")).await.map_err(|e| format!("lsp.start: {e}"))?;
            g.s.lsp_notify(flood.server, "evil/flood", serde_json::json!({})).await.map_err(|e| e.to_string())?;
            let deadline = Instant::now() + Duration::from_secs(120);
            let why = loop {
                match g.s.lsp_request(flood.server, "ping", serde_json::json!({}), Some(2_000)).await {
                    Err(e) if e.to_string().contains("more diagnostics than the host keeps") => break e.to_string(),
                    _ if Instant::now() > deadline => return Err("the flood was not ended within 120 s".into()),
                    _ => {}
                }
            };
            if !g.s.lsp_list().is_empty() {
                return Err(format!("servers left: {:?}", g.s.lsp_list()));
            }
            let grew = rss_mib(std::process::id()).saturating_sub(rss_before);
            if grew > 256 {
                return Err(format!("the host process grew by {grew} MiB"));
            }
            Ok(format!(
                "a 100 GB frame, an endless header, 8 MiB of long URIs and a diagnostics flood each ended \
                 or were ignored by their server; the host grew {grew} MiB ({why:.60})"
            ))
        }),
    ));
    // Last: it leaves the session under approval scope `guest`.
    cases.push((
        "exec gate: execs the rules refuse run none, and the checks stay bounded",
        Box::pin(async {
            let approval = serde_json::json!({
                "mode": "allowlist", "scope": "guest", "timeout_secs": 1,
                "allow": ["sh", "seq", "sleep", "ls", "grep"],
            });
            let patch = SettingsPatch {
                approval: Some(serde_json::from_value(approval).map_err(|e| e.to_string())?),
                ..Default::default()
            };
            g.s.update(&patch, &m.config().session).map_err(|e| e.to_string())?;
            let mut events = m.subscribe();
            // 200 execs nobody answers, at once; and one whose arguments are far past what a
            // check carries.
            let (code, out) = g
                .sh("for i in $(seq 200); do (touch /tmp/gate-ran-$i 2>/dev/null &); done; \
                     /usr/bin/printf %s $(seq 60000) >/dev/null 2>&1; sleep 4; ls /tmp | grep -c gate-ran")
                .await;
            if out.trim() != "0" {
                return Err(format!("exit {code}: {out}"));
            }
            let (mut asked, mut refused, mut longest) = (0, 0, 0);
            loop {
                let e = match events.try_recv() {
                    Ok(e) => e,
                    Err(tokio::sync::broadcast::error::TryRecvError::Lagged(_)) => continue,
                    Err(_) => break,
                };
                match e.kind {
                    umbra_api::event::EventKind::PermissionRequest { command, .. } => {
                        asked += 1;
                        longest = longest.max(command.len());
                    }
                    umbra_api::event::EventKind::PermissionResolved { approved: false, .. } => refused += 1,
                    umbra_api::event::EventKind::PermissionResolved { approved: true, .. } => {
                        return Err("an exec was approved with nobody answering".into())
                    }
                    _ => {}
                }
            }
            if asked == 0 || longest > 2 * umbra_proto::exec_gate::MAX_EXEC_BYTES {
                return Err(format!("{asked} asked, the longest command {longest} bytes"));
            }
            Ok(format!("201 unlisted execs: {asked} asked, {refused} refused in time, none ran; longest request {longest} bytes"))
        }),
    ));
    // UMBRA_ESCAPE_ONLY=<text> runs the cases whose name contains it (for debugging one).
    if let Ok(only) = std::env::var("UMBRA_ESCAPE_ONLY") {
        cases.retain(|(name, _)| name.contains(only.as_str()));
    }
    let total = cases.len();
    let mut failed = Vec::new();
    let mut held = 0;
    for (name, case) in cases {
        let started = Instant::now();
        let outcome = case.await;
        // Whatever the case did, the host side must be whole afterwards.
        let outcome = outcome.and_then(|note| {
            all_alive(&vm)?;
            if snapshot(&ro) != ro_before {
                return Err("the ro share changed on the host".into());
            }
            if std::fs::read_to_string(&secret).unwrap() != format!("{canary}\n") {
                return Err("the host secret changed".into());
            }
            Ok(note)
        });
        match outcome {
            Ok(note) => {
                held += 1;
                eprintln!("escape [{}] {name}: held ({:.1?}): {note}", backend.name(), started.elapsed())
            }
            Err(why) => {
                eprintln!("escape [{}] {name}: FAILED: {why}", backend.name());
                let info = s.info();
                eprintln!(
                    "--- console:\n{}\n--- session: {:?}, {} restarts, last error {:?}",
                    s.console_tail(60).await,
                    info.status,
                    info.restarts,
                    info.last_error
                );
                failed.push(name);
            }
        }
    }
    let rw_after = snapshot(&rw);
    for (path, before) in &rw_before {
        if path.to_str().is_some_and(|p| p != "keep.txt") && rw_after.get(path) != Some(before) {
            failed.push("rw share: a host file other than keep.txt changed");
        }
    }
    m.delete(SESSION).await.unwrap();
    watcher.abort();
    if prop_shared {
        // Its case unmounts what it mounted; this is for a case that failed half-way.
        let _ = Command::new("umount").arg("-l").arg(&prop).status();
    }
    let vm_failures = vm_failures.lock().unwrap().clone();
    if !vm_failures.is_empty() {
        eprintln!("escape [{}]: the VM failed during the suite: {vm_failures:?}", backend.name());
        failed.push("the VM kept running through every case");
    }
    // Straight to the stderr handle, which the test harness does not capture: the summary
    // shows in every run's log, passing or not.
    let _ = writeln!(
        std::io::stderr(),
        "\nescape suite [{}]: {total} cases, {held} held, {} failed",
        backend.name(),
        total - held
    );
    assert!(failed.is_empty(), "{backend:?}: failed cases: {failed:?}");
}

/// The guest plants, in its `outputs/`, a link to the host secret, a link to the host
/// directory holding it, and a directory it swaps for such a link. The host's outputs watcher
/// must report none of them (only the marker file written after them), and a fork's copy of
/// the folder (the beneath-only copy, run here as a fork would; forks need KVM) must carry the
/// links as links and no host byte.
async fn outputs_links_case(
    g: &Guest,
    m: &umbra_runtime::session::SessionManager,
    s: &Session,
    host_dir: &Path,
    secret: &Path,
) -> Outcome {
    use umbra_api::event::EventKind;
    use umbra_runtime::share::tree;
    let mut events = m.subscribe();
    let script = format!(
        "set -e; cd /sessions/{SESSION}/mnt/outputs; ln -s {secret} planted-secret.txt; ln -s {host} planted-dir; \
         mkdir swapped; mv swapped swapped.real; ln -s {host} swapped; echo ok > planted-marker.txt; \
         cat planted-secret.txt planted-dir/secret 2>&1 || true",
        secret = secret.display(),
        host = host_dir.display(),
    );
    let (code, out) = g.sh(&script).await;
    g.clean("following the planted links in the guest", &out)?;
    if code != 0 {
        return Err(format!("planting the links failed ({code}): {out}"));
    }
    // The marker's event says the watcher has handled everything written before it.
    let mut reported = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, events.recv()).await {
            Ok(Ok(e)) => {
                if let EventKind::OutputsFileCreated { path, host_path } = e.kind {
                    if path == "planted-marker.txt" {
                        break;
                    }
                    reported.push((path, host_path));
                }
            }
            Ok(Err(tokio::sync::broadcast::error::RecvError::Lagged(_))) => {}
            Ok(Err(e)) => return Err(format!("the event bus ended: {e}")),
            Err(_) => return Err("no outputs_file_created for the marker within 30 s".into()),
        }
    }
    if let Some(r) = reported.iter().find(|(p, _)| p.starts_with("planted") || p.starts_with("swapped")) {
        return Err(format!("the outputs watcher reported a planted link: {r:?}"));
    }
    let outputs = s.storage_dir().ok_or("the session has no storage")?.join("outputs");
    let copy_to = host_dir.join("outputs-fork-copy");
    let root = tree::open_root(&outputs).map_err(|e| e.to_string())?;
    let copied = tree::copy(&root, &outputs, &copy_to, tree::TreeLimits::GUEST_TREE).map_err(|e| e.to_string())?;
    let canary = std::fs::read(secret).map_err(|e| e.to_string())?;
    for (path, (bytes, _)) in snapshot(&copy_to) {
        if !bytes.is_empty() && bytes.windows(canary.len()).any(|w| w == canary.as_slice()) {
            return Err(format!("the fork copy holds host bytes in {}", path.display()));
        }
    }
    for link in ["planted-secret.txt", "planted-dir", "swapped"] {
        let meta = std::fs::symlink_metadata(copy_to.join(link)).map_err(|e| format!("{link}: {e}"))?;
        if !meta.file_type().is_symlink() {
            return Err(format!("the fork copy made {link} a {:?}, not a link", meta.file_type()));
        }
    }
    Ok(format!(
        "watcher reported only the marker; fork copy: {} entries, {} bytes, links kept as links",
        copied.entries, copied.bytes
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_a_guest_root_tries_reaches_the_host() {
    for backend in umbra_tests::backends() {
        run_suite(backend).await;
    }
}

/// A nested folder found again by path after a restart showed the host (issue 28, fourth
/// reproduction): two sessions over one repository; while the first is stopped, the second's
/// guest root replaces the first's read-only folder with a link to a host directory outside
/// every share, then with another directory. The resume refuses, naming the folder, until the
/// folder is back; no host byte reaches either guest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_folder_replaced_while_its_session_is_stopped_is_refused_at_resume() {
    for backend in umbra_tests::backends() {
        let dir = TempDir::new("escape-pinned");
        let canary = format!("HOST-CANARY-PINNED-{}", std::process::id());
        let (outer, hostonly) = (dir.0.join("outer"), dir.0.join("hostonly"));
        std::fs::create_dir_all(outer.join("inner")).unwrap();
        std::fs::create_dir_all(&hostonly).unwrap();
        std::fs::write(outer.join("inner/data"), "inner\n").unwrap();
        std::fs::write(hostonly.join("leak"), format!("{canary}\n")).unwrap();
        give_to_share_owner(&outer);
        let m = umbra_tests::session_manager(&dir);
        let start = |name: &str, folders: Vec<FolderSpec>| StartParams {
            name: name.into(),
            folders,
            settings: SettingsPatch {
                backend: Some(backend.choice()),
                disk_size_mib: Some(DISK_MIB),
                ..Default::default()
            },
            ..Default::default()
        };
        let folder =
            |path: &Path, name: &str, mode| FolderSpec { path: path.to_path_buf(), name: Some(name.into()), mode };
        let pinned = m
            .start(start(
                "pinned",
                vec![folder(&outer, "outer", ShareMode::Rwd), folder(&outer.join("inner"), "inner", ShareMode::Ro)],
            ))
            .await
            .unwrap_or_else(|e| panic!("{backend:?}: start: {e}"));
        let g = Guest { s: pinned.clone(), canary: canary.clone() };
        let (_, out) = g.sh("echo pwned > /sessions/pinned/mnt/outer/inner/data; mv /sessions/pinned/mnt/outer/inner /sessions/pinned/mnt/outer/x; true").await;
        assert_eq!(std::fs::read_to_string(outer.join("inner/data")).unwrap(), "inner\n", "{out}");
        m.stop("pinned").await.unwrap();

        let other = m.start(start("other", vec![folder(&outer, "repo", ShareMode::Rwd)])).await.unwrap();
        let og = Guest { s: other.clone(), canary: canary.clone() };
        for swap in [format!("ln -s {} inner", hostonly.display()), "mkdir inner".to_string()] {
            let (code, out) = og
                .sh(&format!("cd /sessions/other/mnt/repo && {{ [ -e inner.old ] || mv inner inner.old; }} && rm -rf inner && {swap}"))
                .await;
            assert_eq!(code, 0, "{backend:?}: the other guest could not swap the folder ({swap}): {out}");
            let refused = match m.resume("pinned").await {
                Ok(s) => {
                    let (_, out) =
                        g.sh("cat /sessions/pinned/mnt/inner/leak 2>&1; ls /sessions/pinned/mnt/inner").await;
                    g.clean("resumed", &out).unwrap();
                    panic!("{backend:?}: resumed over a swapped folder ({swap}): {:?}", s.info().folders);
                }
                Err(e) => e.to_string(),
            };
            assert!(refused.contains("inner"), "{backend:?}: the refusal does not name the folder: {refused}");
            eprintln!("escape [{}] pinned folder, {swap}: refused: {refused}", backend.name());
        }
        // The folder put back, the session resumes with it.
        let (code, out) = og.sh("cd /sessions/other/mnt/repo && rm -rf inner && mv inner.old inner").await;
        assert_eq!(code, 0, "{out}");
        m.delete("other").await.unwrap();
        let s = m.resume("pinned").await.unwrap_or_else(|e| panic!("{backend:?}: resume with the folder back: {e}"));
        let (code, out) = Guest { s, canary: canary.clone() }.sh("cat /sessions/pinned/mnt/inner/data").await;
        assert_eq!((code, out.as_str()), (0, "inner\n"));
        m.delete("pinned").await.unwrap();
    }
}
