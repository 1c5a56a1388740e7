//! Umbra as a containerd runtime (`containerd-shim-umbra-v2`, `docs/kubernetes.md`): Debian's
//! containerd, started by each test on a private socket under its own directory, pulls a
//! busybox image (made with `umoci`, pushed with `skopeo`) from a registry on 127.0.0.1, and
//! `ctr` runs it with `--runtime io.containerd.umbra.v2`: each container's processes run in a
//! microVM booted under QEMU, its rootfs (containerd's overlay snapshot) shared over virtio-fs.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use umbra_tests::daemon::processes_mentioning;
use umbra_tests::registry::Registry;
use umbra_tests::{test_bundle, with_descendants, workspace_bin, TempDir};

const RUNTIME: &str = "io.containerd.umbra.v2";

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// containerd on `<dir>/containerd.sock`, its root and state under `dir`, finding the shim
/// built in this tree first on PATH; killed (with everything mentioning `dir`) on drop.
struct Containerd {
    dir: PathBuf,
    child: Option<Child>,
    image: String,
    user_image: String,
    shim_config: PathBuf,
    _registry: Registry,
}

impl Containerd {
    fn start(tmp: &TempDir, orphan_grace_secs: u64) -> Self {
        let dir = tmp.0.clone();
        let registry = Registry::start(&dir, "registry", false);
        let (image, user_image) = push_busybox(&dir, &registry);
        std::fs::write(
            dir.join("config.toml"),
            format!(
                "version = 2\nroot = \"{d}/root\"\nstate = \"{d}/state\"\n\
                 disabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n[grpc]\n  address = \"{d}/containerd.sock\"\n",
                d = dir.display()
            ),
        )
        .unwrap();
        let shim_config = dir.join("shim.toml");
        std::fs::write(
            &shim_config,
            format!(
                "bundle = \"{}\"\nmemory_mib = 256\nboot_timeout_secs = {}\norphan_grace_secs = {orphan_grace_secs}\n",
                test_bundle("minimal").display(),
                umbra_tests::boot_timeout_secs()
            ),
        )
        .unwrap();
        let mut c = Containerd { dir, child: None, image, user_image, shim_config, _registry: registry };
        c.launch();
        c.ctr(&["images", "pull", "--plain-http", &c.image.clone()]).success();
        c.ctr(&["images", "pull", "--plain-http", &c.user_image.clone()]).success();
        c
    }

    fn launch(&mut self) {
        let shim = workspace_bin("containerd-shim-umbra-v2");
        let path = format!("{}:{}", shim.parent().unwrap().display(), std::env::var("PATH").unwrap_or_default());
        std::fs::create_dir_all(self.dir.join("logs")).unwrap();
        let log = std::fs::File::create(self.dir.join("containerd.log")).unwrap();
        let child = Command::new("containerd")
            .arg("--config")
            .arg(self.dir.join("config.toml"))
            .env("PATH", path)
            .env("UMBRA_SHIM_LOG_DIR", self.dir.join("logs"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("containerd (scripts/install-deps installs it)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.ctr_raw(&["version"]).status.success() {
            assert!(Instant::now() < deadline, "containerd did not answer: {}", self.log());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn log(&self) -> String {
        let mut all = std::fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default();
        for e in std::fs::read_dir(self.dir.join("logs")).into_iter().flatten().flatten() {
            all += &format!("\n--- {}\n{}", e.path().display(), std::fs::read_to_string(e.path()).unwrap_or_default());
        }
        all
    }

    fn ctr_raw(&self, args: &[&str]) -> Output {
        Command::new("ctr")
            .arg("--address")
            .arg(self.dir.join("containerd.sock"))
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    fn ctr(&self, args: &[&str]) -> Ran {
        Ran { out: self.ctr_raw(args), what: format!("ctr {}", args.join(" ")), log: self.log() }
    }

    /// `ctr run` with this runtime and the shim's options; `extra` before the image.
    fn run(&self, extra: &[&str], image: &str, id: &str, command: &[&str]) -> Ran {
        let config = self.shim_config.display().to_string();
        let mut args = vec!["run", "--runtime", RUNTIME, "--runtime-config-path", &config];
        args.extend_from_slice(extra);
        args.push(image);
        args.push(id);
        args.extend_from_slice(command);
        self.ctr(&args)
    }

    /// Waits up to 30 s until `ctr task ls` shows what `done` looks for; `what` names a timeout.
    fn wait_for_tasks(&self, done: impl Fn(&str) -> bool, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !done(&self.ctr(&["task", "ls"]).stdout()) {
            assert!(Instant::now() < deadline, "{what}: {}", self.log());
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The shims and the VM helpers they started (everything carrying this test's directory).
    fn umbra_processes(&self) -> Vec<(u32, String)> {
        processes_mentioning(
            &self.dir,
            &["containerd-shim-umbra-v2", "qemu-system", "umbra-fsd", "virtiofsd", "vhost-device-vsock"],
        )
    }

    fn assert_no_umbra_processes_within(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let left = self.umbra_processes();
            if left.is_empty() {
                return;
            }
            assert!(Instant::now() < deadline, "still running after {limit:?}: {left:#?}\n{}", self.log());
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Mounts under this test's directory (the containers' rootfs).
    fn mounts(&self) -> Vec<String> {
        let dir = self.dir.display().to_string();
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .filter_map(|l| l.split(' ').nth(4).filter(|m| m.starts_with(&dir)).map(str::to_owned))
            .collect()
    }

    fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        self.kill9();
        for (pid, _) in self.umbra_processes() {
            // SAFETY: kill(2) on a pid we just found; a reused pid at worst gets a signal.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        for m in self.mounts().iter().rev() {
            let _ = Command::new("umount").arg("-l").arg(m).status();
        }
    }
}

struct Ran {
    out: Output,
    what: String,
    log: String,
}

impl Ran {
    fn stdout(&self) -> String {
        text(&self.out.stdout)
    }

    fn code(&self) -> Option<i32> {
        self.out.status.code()
    }

    fn success(&self) -> &Self {
        assert!(
            self.out.status.success(),
            "{} failed ({:?}):\nstdout: {}\nstderr: {}\n{}",
            self.what,
            self.out.status,
            self.stdout(),
            text(&self.out.stderr),
            self.log
        );
        self
    }
}

/// A busybox image (`/bin/sh` and friends as links, PATH=/bin), as root and as user 1000:1000
/// in `/home/app`, made with umoci and pushed with skopeo.
fn push_busybox(dir: &Path, registry: &Registry) -> (String, String) {
    let layer = dir.join("layer");
    std::fs::create_dir_all(layer.join("bin")).unwrap();
    std::fs::create_dir_all(layer.join("home/app")).unwrap();
    std::fs::copy("/bin/busybox", layer.join("bin/busybox")).expect("busybox-static (scripts/install-deps)");
    for tool in [
        "sh", "echo", "cat", "id", "ls", "wget", "sleep", "nc", "grep", "hostname", "mknod", "cp", "chmod", "stat",
        "ps", "head", "tail", "mkdir", "mount",
    ] {
        std::os::unix::fs::symlink("busybox", layer.join("bin").join(tool)).unwrap();
    }
    let oci = dir.join("oci");
    let run = |cmd: &mut Command| {
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{cmd:?}: {}", text(&out.stderr));
    };
    run(Command::new("umoci").args(["init", "--layout"]).arg(&oci));
    let image = format!("{}:root", oci.display());
    run(Command::new("umoci").args(["new", "--image", &image]));
    run(Command::new("umoci").args(["insert", "--rootless", "--image", &image]).arg(&layer).arg("/"));
    run(Command::new("umoci").args(["config", "--image", &image, "--config.env", "PATH=/bin", "--config.cmd", "sh"]));
    run(Command::new("umoci").args([
        "config",
        "--image",
        &image,
        "--tag",
        "user",
        "--config.user",
        "1000:1000",
        "--config.workingdir",
        "/home/app",
    ]));
    let mut refs = Vec::new();
    for tag in ["root", "user"] {
        let reference = format!("{}/box:{tag}", registry.addr);
        run(Command::new("skopeo").args([
            "copy",
            "--quiet",
            "--dest-tls-verify=false",
            &format!("oci:{}:{tag}", oci.display()),
            &format!("docker://{reference}"),
        ]));
        refs.push(reference);
    }
    (refs.remove(0), refs.remove(0))
}

#[test]
fn ctr_runs_execs_kills_and_deletes_containers_in_microvms() {
    let tmp = TempDir::new("containerd-run");
    let ctd = Containerd::start(&tmp, 60);

    // The spec's process as runc would run it: args, env, cwd, identity, rlimits,
    // no_new_privs, its own mounts; the exit code comes back.
    let script = "echo out; echo err >&2; id; pwd; echo $GREETING; ulimit -n; grep NoNewPrivs /proc/self/status; \
                  ls /proc/self/ns >/dev/null && echo proc-mounted; exit 7";
    let ran =
        ctd.run(&["--rm", "--env", "GREETING=hello", "--cwd", "/bin"], &ctd.image, "first", &["sh", "-c", script]);
    assert_eq!(ran.code(), Some(7), "{}\n{}", ran.stdout(), ran.log);
    let out = ran.stdout();
    let lines: Vec<&str> = out.lines().map(str::trim).collect();
    assert_eq!(
        lines,
        ["out", "uid=0 gid=0 groups=0", "/bin", "hello", "1024", "NoNewPrivs:\t1", "proc-mounted"],
        "{}",
        ran.log
    );
    assert!(text(&ran.out.stderr).contains("err"), "stderr: {}", text(&ran.out.stderr));

    // The image's user and working directory.
    let ran = ctd.run(&["--rm"], &ctd.user_image, "as-user", &["sh", "-c", "id -u; id -g; pwd"]);
    ran.success();
    assert_eq!(ran.stdout().split_whitespace().collect::<Vec<_>>(), ["1000", "1000", "/home/app"]);

    // Detached: exec into it (same root, its namespaces), list, kill, delete.
    ctd.run(&["-d"], &ctd.image, "long", &["sh", "-c", "echo ready > /ready; exec sleep 1000"]).success();
    // Its rootfs is mounted where only root reaches it (an image's files are not the host
    // users'), nosuid and nodev.
    use std::os::unix::fs::PermissionsExt;
    for dir in std::fs::read_dir("/run/umbra-shim")
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .chain([PathBuf::from("/run/umbra-shim")])
    {
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "{}", dir.display());
    }
    let rootfs_mounts: Vec<String> = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.contains("/run/umbra-shim/") && l.contains("/c-long "))
        .map(str::to_owned)
        .collect();
    assert!(
        !rootfs_mounts.is_empty() && rootfs_mounts.iter().all(|l| l.contains("nosuid") && l.contains("nodev")),
        "{rootfs_mounts:?}"
    );
    let exec = ctd.ctr(&["task", "exec", "--exec-id", "e1", "long", "sh", "-c", "cat /ready; hostname; exit 3"]);
    assert_eq!(exec.code(), Some(3), "{}\n{}", exec.stdout(), exec.log);
    assert!(exec.stdout().starts_with("ready\n"), "{}", exec.stdout());
    let ps = ctd.ctr(&["task", "ps", "long"]);
    ps.success();
    assert!(ps.stdout().lines().count() >= 2, "{}", ps.stdout());
    let ls = ctd.ctr(&["task", "ls"]);
    assert!(ls.stdout().contains("RUNNING"), "{}", ls.stdout());
    // Stats from the guest's cgroup: the two processes (sleep, and the exec's shell gone).
    let metrics = ctd.ctr(&["task", "metrics", "long"]);
    metrics.success();
    let figure = |name: &str| -> u64 {
        let line = metrics.stdout().lines().find(|l| l.starts_with(name)).map(str::to_owned);
        line.and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            .unwrap_or_else(|| panic!("no {name}: {}", metrics.stdout()))
    };
    assert!(figure("pids.current") >= 1, "{}", metrics.stdout());
    assert!(figure("memory.usage_in_bytes") > 0, "{}", metrics.stdout());
    assert!(figure("cpuacct.usage") > 0, "{}", metrics.stdout());
    ctd.ctr(&["task", "kill", "-s", "SIGKILL", "long"]).success();
    ctd.wait_for_tasks(|ls| ls.contains("STOPPED"), "the task did not stop");
    ctd.ctr(&["task", "delete", "long"]).success();
    ctd.ctr(&["container", "delete", "long"]).success();
    assert!(!ctd.ctr(&["task", "ls"]).stdout().contains("long"));
    ctd.assert_no_umbra_processes_within(Duration::from_secs(20));
    assert!(ctd.mounts().is_empty(), "rootfs mounts left: {:?}", ctd.mounts());

    // On a terminal (ctr -t, itself given one by `script`): the process's stdin is a terminal
    // with a name in the container's /dev/pts.
    let sock = ctd.dir.join("containerd.sock");
    let command = format!(
        "ctr --address {} run --rm -t --runtime {RUNTIME} --runtime-config-path {} {} tty sh -c 'tty; echo on-a-tty'",
        sock.display(),
        ctd.shim_config.display(),
        ctd.image
    );
    let out = Command::new("script").args(["-qec", &command, "/dev/null"]).stdin(Stdio::null()).output().unwrap();
    let shown = text(&out.stdout);
    assert!(shown.contains("/dev/pts/") && shown.contains("on-a-tty"), "{shown}\n{}", ctd.log());

    // An OOM kill in the guest is an OOM event for the container (the guest's cgroup limit
    // lowered to 16 MiB from inside, so it comes at once).
    let mut events = Command::new("ctr")
        .arg("--address")
        .arg(&sock)
        .arg("events")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let oom = "mkdir -p /cg; mount -t cgroup2 none /cg; echo 16M > /cg/umbra-commands/memory.max; \
               head -c 64m /dev/zero | tail; echo tail=$?; sleep 3";
    let ran = ctd.run(&["--rm"], &ctd.image, "oom", &["sh", "-c", oom]);
    assert!(ran.stdout().contains("tail=137"), "{}\n{}", ran.stdout(), ran.log);
    let _ = events.kill();
    let seen = text(&events.wait_with_output().unwrap().stdout);
    assert!(seen.lines().any(|l| l.contains("/tasks/oom") && l.contains("\"oom\"")), "{seen}");

    // A read-only root.
    let ran = ctd.run(
        &["--rm", "--read-only"],
        &ctd.image,
        "ro",
        &["sh", "-c", "echo x > /x || echo refused; ls /proc/self >/dev/null && echo proc"],
    );
    assert!(ran.stdout().contains("refused\nproc"), "{}\n{}", ran.stdout(), text(&ran.out.stderr));

    // Handler options that do not load refuse the container, naming what is wrong; no VM.
    let bad = ctd.dir.join("bad.toml");
    std::fs::write(&bad, "memroy_mib = 256\n").unwrap();
    let args = [
        "run",
        "--rm",
        "--runtime",
        RUNTIME,
        "--runtime-config-path",
        bad.to_str().unwrap(),
        &ctd.image,
        "bad",
        "true",
    ];
    let ran = ctd.ctr(&args);
    assert!(!ran.out.status.success());
    assert!(text(&ran.out.stderr).contains("memroy_mib"), "{}", text(&ran.out.stderr));

    // The escape suite's rule for a new channel: the container's rootfs is a host directory
    // shared with a guest that is root. A device node and a setuid file made in it never
    // appear on the host, and the container still runs.
    let hostile = "mknod /node c 1 3; cp /bin/busybox /suid; chmod 4755 /suid; echo hostile-done";
    // Kept (no --rm) so its snapshot, the overlay's upper directory, can be looked at.
    let ran = ctd.run(&[], &ctd.image, "hostile", &["sh", "-c", hostile]);
    assert!(ran.stdout().contains("hostile-done"), "{}\n{}", ran.stdout(), ran.log);
    let find = |args: &[&str]| {
        let out = Command::new("find").arg(ctd.dir.join("root")).args(args).output().unwrap();
        text(&out.stdout)
    };
    assert!(find(&["-name", "suid", "-type", "f"]).contains("/fs/suid"), "the copy is not in the snapshot");
    assert_eq!(find(&["(", "-type", "c", "-o", "-type", "b", "-o", "-perm", "-4000", ")", "-print"]), "");
    ctd.ctr(&["container", "delete", "hostile"]).success();
}

#[test]
fn twenty_containers_start_at_once() {
    let tmp = TempDir::new("containerd-twenty");
    let ctd = Containerd::start(&tmp, 60);
    let started = Instant::now();
    let results: Vec<(usize, Ran)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..20)
            .map(|i| {
                let ctd = &ctd;
                s.spawn(move || {
                    let id = format!("c{i}");
                    (i, ctd.run(&["--rm"], &ctd.image, &id, &["sh", "-c", &format!("echo container-{i}")]))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, ran) in &results {
        ran.success();
        assert_eq!(ran.stdout().trim(), format!("container-{i}"));
    }
    eprintln!("20 containers, each its own microVM, ran in {:?}", started.elapsed());
    ctd.assert_no_umbra_processes_within(Duration::from_secs(30));
    assert!(ctd.mounts().is_empty(), "rootfs mounts left: {:?}", ctd.mounts());
}

#[test]
fn killing_the_shim_or_containerd_leaves_no_vm_behind() {
    let tmp = TempDir::new("containerd-kill");
    let mut ctd = Containerd::start(&tmp, 3);
    let shim_tree = |ctd: &Containerd| {
        let shims: Vec<u32> = ctd
            .umbra_processes()
            .into_iter()
            .filter(|(_, cmd)| cmd.contains("containerd-shim-umbra-v2"))
            .map(|(pid, _)| pid)
            .collect();
        with_descendants(&shims)
    };

    // The shim dies: its VM and helpers go with it, and containerd reports the task gone.
    ctd.run(&["-d"], &ctd.image, "victim", &["sleep", "1000"]).success();
    let tree = shim_tree(&ctd);
    assert!(tree.iter().any(|&p| umbra_tests::comm(p).starts_with("qemu-system")), "no VM under the shim: {tree:?}");
    let shim = *tree.first().unwrap();
    // SAFETY: kill(2) on the shim this test started.
    unsafe { libc::kill(shim as i32, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(20);
    while tree.iter().any(|&p| Path::new(&format!("/proc/{p}")).exists() && umbra_tests::process_state(p) != Some('Z'))
    {
        assert!(Instant::now() < deadline, "processes of the killed shim's VM are left: {tree:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // containerd cleans up after the dead shim (`containerd-shim-umbra-v2 delete`): the task
    // ends, killed.
    ctd.wait_for_tasks(|ls| !ls.contains("RUNNING"), "containerd did not see the task end");
    let _ = ctd.ctr(&["task", "delete", "victim"]);
    ctd.ctr(&["container", "delete", "victim"]).success();
    assert!(ctd.mounts().is_empty(), "rootfs mounts left: {:?}", ctd.mounts());

    // containerd dies and does not come back: after the handler's grace (3 s here) the shim
    // stops its VM, unmounts the rootfs and exits.
    ctd.run(&["-d"], &ctd.image, "orphan", &["sleep", "1000"]).success();
    assert!(!shim_tree(&ctd).is_empty());
    ctd.kill9();
    ctd.assert_no_umbra_processes_within(Duration::from_secs(30));
    assert!(ctd.mounts().is_empty(), "rootfs mounts left: {:?}", ctd.mounts());
}

/// A network namespace of the test's own (`ip netns`), its loopback up; deleted on drop.
struct Netns {
    name: String,
}

impl Netns {
    fn new(tag: &str) -> Self {
        let name = format!("umbra-{tag}-{}", std::process::id());
        let ok = |cmd: &mut Command| assert!(cmd.status().unwrap().success(), "{cmd:?}");
        ok(Command::new("ip").args(["netns", "add", &name]));
        ok(Command::new("ip").args(["-n", &name, "link", "set", "lo", "up"]));
        Netns { name }
    }

    fn path(&self) -> String {
        format!("/var/run/netns/{}", self.name)
    }

    /// `python3 -c code` inside the namespace.
    fn python(&self, code: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name, "python3", "-c", code]);
        cmd
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).status();
    }
}

#[test]
fn a_pods_annotations_decide_its_egress_and_its_ports_reach_the_guest() {
    let tmp = TempDir::new("containerd-net");
    let ctd = Containerd::start(&tmp, 60);
    let pod = Netns::new("pod");
    // An HTTP server on the pod's own loopback: the host's loopback has nothing on this port,
    // so an answer can only come through the pod's namespace.
    let www = ctd.dir.join("www");
    std::fs::create_dir_all(&www).unwrap();
    std::fs::write(www.join("marker"), "reached-through-the-pod\n").unwrap();
    let port = 18080;
    let mut server = pod
        .python(&format!(
            "import http.server,functools; h=functools.partial(http.server.SimpleHTTPRequestHandler, directory='{}'); \
             http.server.ThreadingHTTPServer(('127.0.0.1', {port}), h).serve_forever()",
            www.display()
        ))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let with_ns = format!("network:{}", pod.path());
    let network = serde_json::json!({
        "mode": "allowlist",
        "allow_domains": ["allowed.test"],
        "allow_cidrs": ["127.0.0.1/32"],
        "resolve": {"allowed.test": "127.0.0.1", "denied.test": "127.0.0.1"},
    });
    let annotation = format!("io.umbra.network={network}");
    let script = format!(
        "sleep 1; wget -q -O - http://allowed.test:{port}/marker; echo allowed=$?; \
         wget -q -O - http://denied.test:{port}/marker; echo denied=$?"
    );
    let ran = ctd.run(
        &["--rm", "--with-ns", &with_ns, "--annotation", &annotation],
        &ctd.image,
        "egress",
        &["sh", "-c", &script],
    );
    let out = ran.stdout();
    assert!(out.contains("reached-through-the-pod\nallowed=0"), "{out}\n{}", ran.log);
    assert!(out.contains("denied=1"), "{out}");
    assert!(!out.contains("reached-through-the-pod\ndenied"), "{out}");
    assert!(text(&ran.out.stderr).contains("403"), "{}", text(&ran.out.stderr));

    // No annotation: the handler's default, no network at all.
    let ran = ctd.run(&["--rm", "--with-ns", &with_ns], &ctd.image, "closed", &["sh", "-c", &script]);
    assert!(ran.stdout().contains("allowed=1"), "{}", ran.stdout());

    // Inbound: the pod's port 8080 (in its namespace, on every address) reaches the guest.
    ctd.run(
        &["-d", "--with-ns", &with_ns, "--annotation", "io.umbra.ports=8080"],
        &ctd.image,
        "server",
        &["sh", "-c", "while true; do echo pong-from-the-guest | nc -l -p 8080; done"],
    )
    .success();
    let connect = "import socket; s = socket.create_connection(('127.0.0.1', 8080), timeout=5); print(s.recv(100).decode().strip())";
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = pod.python(connect).output().unwrap();
        if text(&out.stdout).trim() == "pong-from-the-guest" {
            break;
        }
        assert!(Instant::now() < deadline, "no answer through the pod's port: {}\n{}", text(&out.stderr), ctd.log());
        std::thread::sleep(Duration::from_millis(500));
    }
    // Not on the host's own addresses.
    assert!(std::net::TcpStream::connect(("127.0.0.1", 8080)).is_err(), "the pod's port listens on the host");
    ctd.ctr(&["task", "kill", "-s", "SIGKILL", "server"]).success();
    ctd.wait_for_tasks(|ls| !ls.contains("RUNNING"), "the server did not stop");
    ctd.ctr(&["task", "delete", "server"]).success();
    ctd.ctr(&["container", "delete", "server"]).success();
    let _ = server.kill();
    let _ = server.wait();
    ctd.assert_no_umbra_processes_within(Duration::from_secs(20));
}

#[test]
fn a_pods_containers_share_one_vm() {
    let tmp = TempDir::new("containerd-pod");
    let ctd = Containerd::start(&tmp, 60);
    // The CRI marks a pod's containers with its id: one shim, one VM, a rootfs each.
    let pod = "--annotation=io.kubernetes.cri.sandbox-id=pod-a";
    ctd.run(&["-d", pod], &ctd.image, "sandbox", &["sh", "-c", "echo first > /mine; exec sleep 1000"]).success();
    let boot_id = |id: &str| {
        let ran = ctd.ctr(&["task", "exec", "--exec-id", "b", id, "cat", "/proc/sys/kernel/random/boot_id"]);
        ran.success();
        ran.stdout().trim().to_string()
    };
    ctd.run(&["-d", pod], &ctd.image, "app", &["sh", "-c", "echo second > /mine; exec sleep 1000"]).success();
    let vms = |ctd: &Containerd| ctd.umbra_processes().iter().filter(|(_, c)| c.contains("qemu-system")).count();
    assert_eq!(vms(&ctd), 1, "{:#?}", ctd.umbra_processes());
    assert_eq!(boot_id("sandbox"), boot_id("app"));
    // Each sees its own root.
    let mine = |id: &str| ctd.ctr(&["task", "exec", "--exec-id", "m", id, "cat", "/mine"]).stdout();
    assert_eq!((mine("sandbox").trim().to_string(), mine("app").trim().to_string()), ("first".into(), "second".into()));
    // The app goes, and what it started with it (an exec still running); the sandbox (and the
    // VM) stay.
    ctd.ctr(&["task", "exec", "-d", "--exec-id", "bg", "app", "sleep", "777"]).success();
    let ps = |id: &str| ctd.ctr(&["task", "exec", "--exec-id", "ps", id, "ps", "-o", "args"]).stdout();
    assert!(ps("sandbox").contains("sleep 777"), "{}", ps("sandbox"));
    ctd.ctr(&["task", "kill", "-s", "SIGKILL", "app"]).success();
    ctd.wait_for_tasks(|ls| ls.contains("STOPPED"), "the app did not stop");
    ctd.ctr(&["task", "delete", "app"]).success();
    ctd.ctr(&["container", "delete", "app"]).success();
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(mine("sandbox").trim(), "first", "{}", ctd.log());
    assert!(!ps("sandbox").contains("sleep 777"), "the app's exec outlived it: {}", ps("sandbox"));
    assert_eq!(vms(&ctd), 1);
    ctd.ctr(&["task", "kill", "-s", "SIGKILL", "sandbox"]).success();
    ctd.wait_for_tasks(|ls| !ls.contains("RUNNING"), "the sandbox did not stop");
    ctd.ctr(&["task", "delete", "sandbox"]).success();
    ctd.ctr(&["container", "delete", "sandbox"]).success();
    ctd.assert_no_umbra_processes_within(Duration::from_secs(20));
}
