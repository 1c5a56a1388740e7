//! Shared folders, guest side, with the agent on the host: ro / rw / rwd / shadow mounts,
//! landlock on spawned processes, and the shadow diff and reset.
//!
//! The agent runs as root in a private mount namespace of its own (unshare in pre_exec), with
//! `--root` standing in for `/` and `--shares-dir` for the virtio-fs share root, which the test
//! fills as the host would. Nothing is mounted in the test's own namespace, so cleaning up is
//! removing a directory. Needs root and a kernel with landlock enabled: without either the
//! tests fail saying so rather than pass without proving anything.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use tokio::net::UnixStream;
use tokio_util::codec::Framed;
use umbra_proto::{
    json_frame, parse_body, ChangeKind, ErrorCode, FrameCodec, FrameKind, Hello, Request, Response, ResponseBody,
    ShadowChange, ShareMode, ShareRequest, SpawnRequest, PROTOCOL_VERSION,
};
use umbra_runtime::agent::{AgentClient, ProcessOutput};
use umbra_tests::{HostAgent, TempDir};

/// A host-side agent in its own mount namespace, over a fake share root.
struct Guest {
    client: AgentClient,
    raw: Framed<UnixStream, FrameCodec>,
    next_id: u32,
    _agent: HostAgent,
    /// The share root as the host fills it: one directory per shared folder.
    host: PathBuf,
    /// What the agent sees as `/`.
    root: PathBuf,
    /// Last: removed after the agent (and its namespace with its mounts) is gone.
    dir: TempDir,
}

impl Guest {
    async fn start(tag: &str) -> Self {
        require_root_and_landlock();
        let dir = TempDir::new(tag);
        let (host, root) = (dir.0.join("host"), dir.0.join("root"));
        std::fs::create_dir_all(&host).unwrap();
        let agent = HostAgent::start_with(|cmd| {
            cmd.arg("--root").arg(&root).arg("--shares-dir").arg(&host);
            // SAFETY: between fork and exec only unshare(2) and mount(2), async-signal-safe
            // syscalls on static strings.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::unshare(libc::CLONE_NEWNS) != 0
                        || libc::mount(
                            std::ptr::null(),
                            c"/".as_ptr(),
                            std::ptr::null(),
                            libc::MS_REC | libc::MS_PRIVATE,
                            std::ptr::null(),
                        ) != 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        })
        .await;
        let ns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/mnt")).unwrap();
        assert_ne!(ns(&agent.pid().to_string()), ns("self"), "the agent must mount in a namespace of its own");
        let client = agent.connect().await;
        let mut raw = Framed::new(UnixStream::connect(&agent.socket).await.unwrap(), FrameCodec::new());
        let hello = Hello {
            protocol: PROTOCOL_VERSION,
            software: "test".into(),
            hostname: None,
            pid1: false,
            capabilities: vec![],
        };
        raw.send(json_frame(FrameKind::Hello, 0, &hello)).await.unwrap();
        let reply: Hello = parse_body(&raw.next().await.unwrap().unwrap().body).unwrap().0;
        assert!(reply.capabilities.iter().any(|c| c == "shares"), "{:?}", reply.capabilities);
        assert_eq!(reply.protocol, PROTOCOL_VERSION);
        Guest { client, raw, next_id: 1, _agent: agent, host, root, dir }
    }

    /// A host folder `name` with `files` (relative path → contents).
    fn host_folder(&self, name: &str, files: &[(&str, &str)]) -> PathBuf {
        let folder = self.host.join(name);
        std::fs::create_dir_all(&folder).unwrap();
        for (path, contents) in files {
            let p = folder.join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, contents).unwrap();
        }
        folder
    }

    /// Sends a request the runtime's client has no method for yet; returns the response.
    async fn call(&mut self, request: Request) -> Response {
        let id = self.next_id;
        self.next_id += 1;
        self.raw.send(json_frame(FrameKind::Request, id, &request)).await.unwrap();
        loop {
            let frame = tokio::time::timeout(Duration::from_secs(10), self.raw.next())
                .await
                .expect("agent answered")
                .expect("connection open")
                .unwrap();
            if frame.kind == FrameKind::Response && frame.id == id {
                return parse_body(&frame.body).unwrap().0;
            }
        }
    }

    async fn share(&mut self, session: &str, name: &str, mode: ShareMode) -> Response {
        self.call(Request::Share(ShareRequest { session: session.into(), name: name.into(), mode })).await
    }

    /// Shares and returns the guest path.
    async fn shared(&mut self, session: &str, name: &str, mode: ShareMode) -> String {
        match self.share(session, name, mode).await {
            Response::Ok(ResponseBody::Shared { path }) => path,
            other => panic!("share {name} as {mode}: {other:?}"),
        }
    }

    async fn diff(&mut self, session: &str, name: &str) -> (Vec<ShadowChange>, bool) {
        match self.call(Request::ShadowDiff { session: session.into(), name: name.into() }).await {
            Response::Ok(ResponseBody::ShadowDiff { changes, truncated }) => (changes, truncated),
            other => panic!("shadow_diff {name}: {other:?}"),
        }
    }

    async fn sh(&self, script: &str) -> ProcessOutput {
        let req = SpawnRequest { argv: vec!["sh".into(), "-c".into(), script.into()], ..Default::default() };
        self.client.spawn(req).unwrap().output().await.unwrap()
    }

    /// Runs `script`, which must succeed.
    async fn ok(&self, script: &str) -> String {
        let out = self.sh(script).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code, Some(0), "{script}: {stderr}");
        String::from_utf8(out.stdout).unwrap()
    }

    /// Runs `script`, which must fail; returns its stderr.
    async fn fails(&self, script: &str) -> String {
        let out = self.sh(script).await;
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_ne!(out.status.code, Some(0), "{script} succeeded: {}", String::from_utf8_lossy(&out.stdout));
        stderr
    }
}

fn error_code(response: Response) -> ErrorCode {
    match response {
        Response::Error(e) => e.code,
        other => panic!("expected an error, got {other:?}"),
    }
}

/// These tests prove kernel enforcement; they must not pass on a machine that cannot enforce.
fn require_root_and_landlock() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "the share tests mount filesystems: run them as root");
    // SAFETY: with a null attr, size 0 and flag 1 (version query) the syscall reads no memory.
    let abi = unsafe { libc::syscall(libc::SYS_landlock_create_ruleset, std::ptr::null::<u8>(), 0usize, 1u32) };
    assert!(
        abi >= 1,
        "landlock is not available on this kernel ({}): the rw-share tests cannot prove anything here",
        std::io::Error::last_os_error()
    );
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

#[tokio::test]
async fn shares_land_under_the_session_and_bad_requests_are_refused() {
    let mut g = Guest::start("shares-layout").await;
    g.host_folder("proj", &[("a.txt", "A")]);
    let path = g.shared("s1", "proj", ShareMode::Rwd).await;
    assert_eq!(Path::new(&path), g.root.canonicalize().unwrap().join("sessions/s1/mnt/proj"));
    assert_eq!(g.ok(&format!("cat {path}/a.txt")).await, "A");
    // The same share again is a no-op.
    assert_eq!(g.shared("s1", "proj", ShareMode::Rwd).await, path);

    for (session, name) in [("s1", "../x"), ("s/1", "proj"), ("s1", ".."), ("s1", ""), ("s1", &*"n".repeat(65))] {
        assert_eq!(error_code(g.share(session, name, ShareMode::Ro).await), ErrorCode::BadRequest, "{session} {name}");
    }
    assert_eq!(error_code(g.share("s1", "missing", ShareMode::Ro).await), ErrorCode::NotFound);
    let shadow_diff = Request::ShadowDiff { session: "s1".into(), name: "proj".into() };
    assert_eq!(error_code(g.call(shadow_diff).await), ErrorCode::BadRequest, "not a shadow share");
    let unknown = Request::Unshare { session: "s2".into(), name: "proj".into() };
    assert_eq!(error_code(g.call(unknown).await), ErrorCode::NotFound);

    let unshare = Request::Unshare { session: "s1".into(), name: "proj".into() };
    assert_eq!(g.call(unshare).await, Response::Ok(ResponseBody::Done));
    g.fails(&format!("test -e {path}/a.txt")).await;
    assert_eq!(read(&g.host.join("proj/a.txt")), "A", "unsharing leaves the host folder alone");
}

#[tokio::test]
async fn ro_share_refuses_writes_in_the_guest() {
    let mut g = Guest::start("shares-ro").await;
    let folder = g.host_folder("docs", &[("readme", "hello")]);
    let path = g.shared("s1", "docs", ShareMode::Ro).await;
    assert_eq!(g.ok(&format!("cat {path}/readme")).await, "hello");
    for script in [
        format!("echo x > {path}/new"),
        format!("echo x >> {path}/readme"),
        format!("rm {path}/readme"),
        format!("mkdir {path}/d"),
    ] {
        let stderr = g.fails(&script).await;
        assert!(stderr.contains("Read-only file system"), "{script}: {stderr}");
    }
    assert_eq!(read(&folder.join("readme")), "hello");
    assert!(!folder.join("new").exists() && !folder.join("d").exists());
}

#[tokio::test]
async fn rw_share_creates_and_modifies_but_landlock_denies_removal() {
    let mut g = Guest::start("shares-rw").await;
    let folder = g.host_folder("work", &[("keep.txt", "v1"), ("sub/inner.txt", "i")]);
    std::fs::create_dir(folder.join("empty")).unwrap();
    let other = g.host_folder("scratch", &[("tmp.txt", "t")]);
    let path = g.shared("s1", "work", ShareMode::Rw).await;
    let rwd = g.shared("s1", "scratch", ShareMode::Rwd).await;

    g.ok(&format!("echo new > {path}/new.txt && echo v2 >> {path}/keep.txt && mkdir {path}/d && echo x > {path}/d/x"))
        .await;
    assert_eq!(read(&folder.join("new.txt")), "new\n");
    assert_eq!(read(&folder.join("keep.txt")), "v1v2\n");
    assert_eq!(read(&folder.join("d/x")), "x\n");

    let shares_root = g.host.canonicalize().unwrap();
    for script in [
        format!("rm {path}/keep.txt"),
        format!("rm {path}/sub/inner.txt"),
        format!("rm -r {path}/d"),
        format!("rmdir {path}/empty"),
        format!("mv {path}/keep.txt {path}/renamed.txt"),
        format!("mv {path}/sub/inner.txt {path}/inner.txt"),
        format!("mv {path}/keep.txt /dev/shm/umbra-stolen-{}", std::process::id()),
        // The same folder through the share root is protected too.
        format!("rm {}/work/keep.txt", shares_root.display()),
    ] {
        let stderr = g.fails(&script).await;
        assert!(
            stderr.contains("Permission denied") || stderr.contains("Operation not permitted"),
            "{script}: {stderr}"
        );
    }
    // A landlocked process cannot unmount or remount its way out either.
    g.fails(&format!("umount {path}")).await;
    g.fails(&format!("mount -o remount,bind {path}")).await;
    for f in ["keep.txt", "sub/inner.txt", "d/x", "new.txt", "empty"] {
        assert!(folder.join(f).exists(), "{f} survived");
    }
    assert!(!folder.join("renamed.txt").exists() && !folder.join("inner.txt").exists());
    let _ = std::fs::remove_file(format!("/dev/shm/umbra-stolen-{}", std::process::id()));

    // A root child restricts itself without no_new_privs (setuid programs keep working); an
    // unprivileged one cannot, so it gets no_new_privs first — and is restricted just the same.
    assert_eq!(g.ok("grep NoNewPrivs /proc/self/status").await, "NoNewPrivs:\t0\n");
    let nobody = |script: &str| SpawnRequest {
        argv: vec!["sh".into(), "-c".into(), script.into()],
        uid: Some(65534),
        gid: Some(65534),
        ..Default::default()
    };
    let out = g.client.spawn(nobody("grep NoNewPrivs /proc/self/status")).unwrap().output().await.unwrap();
    assert_eq!((out.stdout.as_slice(), out.status.code), (&b"NoNewPrivs:\t1\n"[..], Some(0)), "{out:?}");
    std::fs::write(folder.join("world.txt"), "w").unwrap();
    std::fs::set_permissions(&folder, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let out = g.client.spawn(nobody(&format!("rm -f {path}/world.txt"))).unwrap().output().await.unwrap();
    assert_ne!(out.status.code, Some(0), "an unprivileged process may not delete in an rw share either");
    assert!(folder.join("world.txt").exists());

    // Removal elsewhere is untouched: in an rwd share of the same session, and in a directory
    // beside the path to the share.
    g.ok(&format!("rm {rwd}/tmp.txt")).await;
    assert!(!other.join("tmp.txt").exists());
    let beside = g.dir.0.join("beside");
    std::fs::create_dir_all(&beside).unwrap();
    g.ok(&format!("touch {0}/f && rm {0}/f && mkdir {0}/d && rmdir {0}/d", beside.display())).await;
}

#[tokio::test]
async fn mode_changes_remount_and_shadow_changes_are_refused() {
    let mut g = Guest::start("shares-modes").await;
    let folder = g.host_folder("src", &[("a", "1"), ("b", "2"), ("c", "3")]);
    let path = g.shared("s1", "src", ShareMode::Rw).await;
    g.fails(&format!("rm {path}/a")).await;
    // "Enable deletion": rw → rwd. New processes may delete.
    assert_eq!(g.shared("s1", "src", ShareMode::Rwd).await, path);
    g.ok(&format!("rm {path}/a")).await;
    assert!(!folder.join("a").exists());
    // rwd → ro: read-only in place.
    g.shared("s1", "src", ShareMode::Ro).await;
    assert!(g.fails(&format!("echo x > {path}/b")).await.contains("Read-only"));
    // ro → rw: writable again, deletion denied again.
    g.shared("s1", "src", ShareMode::Rw).await;
    g.ok(&format!("echo x > {path}/b")).await;
    g.fails(&format!("rm {path}/c")).await;
    assert_eq!(error_code(g.share("s1", "src", ShareMode::Shadow).await), ErrorCode::BadRequest);
    assert_eq!(read(&folder.join("b")), "x\n");
    assert!(folder.join("c").exists());
}

#[tokio::test]
async fn shadow_keeps_the_host_folder_intact_lists_the_changes_and_resets() {
    let mut g = Guest::start("shares-shadow").await;
    let files = [
        ("keep.txt", "keep"),
        ("change.txt", "before"),
        ("remove.txt", "bye"),
        ("olddir/x", "x"),
        ("olddir/y/z", "z"),
        ("replaced/old", "o"),
        ("nested/deep/file", "f"),
    ];
    let folder = g.host_folder("ws", &files);
    let path = g.shared("s1", "ws", ShareMode::Shadow).await;
    // An rw share elsewhere must not restrict the shadow (deletes there are the point).
    g.host_folder("other", &[]);
    g.shared("s1", "other", ShareMode::Rw).await;

    assert_eq!(g.diff("s1", "ws").await, (vec![], false));
    g.ok(&format!(
        "cd {path} && echo added > added.txt && printf after > change.txt && rm remove.txt && rm -r olddir \
         && mkdir -p newdir/sub && echo n > newdir/sub/n && rm -r replaced && mkdir replaced && echo r > replaced/new \
         && echo d >> nested/deep/file"
    ))
    .await;
    assert_eq!(
        g.ok(&format!("cat {path}/change.txt; echo; ls {path}")).await,
        "after\nadded.txt\nchange.txt\nkeep.txt\nnested\nnewdir\nreplaced\n"
    );

    // The host folder is untouched.
    for (p, contents) in files {
        assert_eq!(read(&folder.join(p)), contents, "{p}");
    }
    assert!(!folder.join("added.txt").exists() && !folder.join("newdir").exists());

    let (changes, truncated) = g.diff("s1", "ws").await;
    assert!(!truncated);
    let summary: Vec<(String, ChangeKind, Option<u64>, bool)> =
        changes.into_iter().map(|c| (c.path, c.kind, c.size, c.is_dir)).collect();
    let want = [
        ("added.txt", ChangeKind::Added, Some(6), false),
        ("change.txt", ChangeKind::Modified, Some(5), false),
        ("nested/deep/file", ChangeKind::Modified, Some(3), false),
        ("newdir", ChangeKind::Added, None, true),
        ("newdir/sub", ChangeKind::Added, None, true),
        ("newdir/sub/n", ChangeKind::Added, Some(2), false),
        ("olddir", ChangeKind::Deleted, None, true),
        ("remove.txt", ChangeKind::Deleted, None, false),
        ("replaced/old", ChangeKind::Deleted, None, false),
        ("replaced/new", ChangeKind::Added, Some(2), false),
    ];
    let want: Vec<_> = want.into_iter().map(|(p, k, s, d)| (p.to_string(), k, s, d)).collect();
    assert_eq!(summary, want);

    let reset = Request::ShadowReset { session: "s1".into(), name: "ws".into() };
    assert_eq!(g.call(reset).await, Response::Ok(ResponseBody::Done));
    assert_eq!(
        g.ok(&format!("cat {path}/change.txt {path}/remove.txt; echo; ls {path}")).await,
        "beforebye\nchange.txt\nkeep.txt\nnested\nolddir\nremove.txt\nreplaced\n"
    );
    assert_eq!(g.diff("s1", "ws").await, (vec![], false));
    // Still a working shadow after the reset.
    g.ok(&format!("rm {path}/keep.txt")).await;
    assert!(folder.join("keep.txt").exists());
    let (changes, _) = g.diff("s1", "ws").await;
    assert_eq!(changes.len(), 1);
    assert_eq!((changes[0].path.as_str(), changes[0].kind), ("keep.txt", ChangeKind::Deleted));

    let unshare = Request::Unshare { session: "s1".into(), name: "ws".into() };
    assert_eq!(g.call(unshare).await, Response::Ok(ResponseBody::Done));
    let diff = Request::ShadowDiff { session: "s1".into(), name: "ws".into() };
    assert_eq!(error_code(g.call(diff).await), ErrorCode::NotFound);
}
