//! `umbra-agent container-exec …` ([`ContainerExec::to_argv`]): the agent binary, spawned by the agent as an ordinary
//! process, enters an OCI container and execs its program ([`umbra_proto::container`]). The
//! containerd shim's containers are process trees in the session's VM, each with its own root
//! (its rootfs folder), mounts, hostname and IPC; later processes of the container (`ctr task
//! exec`) join the first one's namespaces. All of it acts on the guest only: the guest is root in
//! its VM, and this is what it could do itself with `unshare` and `chroot`.

use std::ffi::CString;
use std::fs::File;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use anyhow::{bail, Context, Result};
use nix::mount::{mount, MsFlags};
use nix::sched::{setns, unshare, CloneFlags};
use umbra_proto::container::{ContainerExec, ContainerMount, ContainerRlimit};

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Runs the subcommand; never returns (execs, or exits 127 with the reason on stderr, as a
/// shell does for a command it cannot run).
pub fn main(args: &[String]) -> ! {
    let err = match ContainerExec::from_argv(args).map_err(anyhow::Error::msg).and_then(|s| run(&s)) {
        Ok(never) => match never {},
        Err(e) => e,
    };
    eprintln!("umbra: cannot start the container's process: {err:#}");
    std::process::exit(127)
}

/// The agent's commands cgroup (`process/cgroup.rs`), under which each container has its own.
const COMMANDS_CGROUP: &str = "/sys/fs/cgroup/umbra-commands";

/// How long a later process waits for the container's first one to have entered it.
const SETUP_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

fn run(spec: &ContainerExec) -> Result<std::convert::Infallible> {
    if spec.args.is_empty() {
        bail!("the process has no args");
    }
    let root = PathBuf::from(&spec.root);
    // Into the container's cgroup while this is still the VM's mount namespace (the
    // container's own /sys/fs/cgroup is read-only); a later process once the first made it.
    if let Some(pid) = spec.join {
        wait_for_setup(pid)?;
    }
    if let Some(name) = &spec.cgroup {
        join_cgroup(name, spec.join.is_none())?;
    }
    match spec.join {
        Some(pid) => {
            // The mount namespace last: opening the others' files needs this root's /proc.
            let namespaces = [
                ("ipc", CloneFlags::CLONE_NEWIPC),
                ("uts", CloneFlags::CLONE_NEWUTS),
                ("mnt", CloneFlags::CLONE_NEWNS),
            ];
            let files = namespaces
                .iter()
                .map(|(ns, _)| {
                    File::open(format!("/proc/{pid}/ns/{ns}"))
                        .with_context(|| format!("the container's {ns} namespace (process {pid})"))
                })
                .collect::<Result<Vec<_>>>()?;
            for (file, (ns, flag)) in files.iter().zip(namespaces) {
                setns(file, flag).with_context(|| format!("joining the container's {ns} namespace"))?;
            }
        }
        None => {
            unshare(CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWUTS | CloneFlags::CLONE_NEWIPC)
                .context("new namespaces")?;
            // Nothing mounted for the container propagates back to the VM's namespace.
            mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>)
                .context("making mounts private")?;
            let mut dev = false;
            // On a terminal, the container keeps the VM's devpts: its terminal lives there (a
            // new instance would leave it nameless: `tty` says "not a tty").
            let terminal = nix::unistd::isatty(std::io::stdin()).unwrap_or(false);
            for m in &spec.mounts {
                let shared_pts;
                let m = if terminal && m.kind == "devpts" {
                    shared_pts =
                        ContainerMount { kind: "bind".into(), source: "/dev/pts".into(), options: vec![], ..m.clone() };
                    &shared_pts
                } else {
                    m
                };
                if let Err(e) = mount_one(&root, m) {
                    // The container still runs, as crun does with a cgroup v1 mount on v2.
                    eprintln!("umbra: mount {} ({}) skipped: {e:#}", m.destination, m.kind);
                } else if clean(&m.destination).as_deref() == Some(Path::new("dev")) {
                    dev = true;
                }
            }
            if dev {
                populate_dev(&root.join("dev"))?;
            }
            if spec.readonly_root {
                // The root as a mount of its own (its submounts kept), then read-only.
                mount(Some(&root), &root, None::<&str>, MsFlags::MS_BIND | MsFlags::MS_REC, None::<&str>)
                    .context("binding the root")?;
                let flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY;
                mount(None::<&str>, &root, None::<&str>, flags, None::<&str>).context("making the root read-only")?;
            }
            if let Some(name) = &spec.hostname {
                nix::unistd::sethostname(name).context("setting the hostname")?;
            }
        }
    }
    nix::unistd::chroot(&root).with_context(|| format!("chroot into {}", root.display()))?;
    std::env::set_current_dir("/")?;
    for r in &spec.rlimits {
        set_rlimit(r)?;
    }
    if let Some(mask) = spec.umask {
        nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(mask));
    }
    let groups: Vec<nix::unistd::Gid> = spec.additional_gids.iter().map(|&g| nix::unistd::Gid::from_raw(g)).collect();
    nix::unistd::setgroups(&groups).context("setgroups")?;
    nix::unistd::setgid(nix::unistd::Gid::from_raw(spec.gid)).context("setgid")?;
    nix::unistd::setuid(nix::unistd::Uid::from_raw(spec.uid)).context("setuid")?;
    let cwd = if spec.cwd.is_empty() { "/" } else { spec.cwd.as_str() };
    std::env::set_current_dir(cwd).with_context(|| format!("the working directory {cwd}"))?;
    if spec.no_new_privileges {
        nix::sys::prctl::set_no_new_privs().context("no_new_privs")?;
    }
    // The egress proxies the agent gave this process, unless the container sets its own: the
    // VM has no other way out.
    let mut env = spec.env.clone();
    for (k, v) in std::env::vars() {
        let proxy = matches!(k.to_ascii_lowercase().as_str(), "http_proxy" | "https_proxy" | "all_proxy" | "no_proxy");
        if proxy && !env.iter().any(|e| e.split_once('=').is_some_and(|(name, _)| name == k)) {
            env.push(format!("{k}={v}"));
        }
    }
    exec(&spec.args, &env)
}

/// Moves this process into the container's cgroup (making it for the first process). Best
/// effort on a guest without cgroup v2: the container then only lacks `kill --all`.
fn join_cgroup(name: &str, first: bool) -> Result<()> {
    if name.is_empty() || name.contains('/') || name.starts_with('.') {
        bail!("{name:?} is not a cgroup name");
    }
    let dir = Path::new(COMMANDS_CGROUP).join(name);
    if !Path::new(COMMANDS_CGROUP).exists() {
        return Ok(());
    }
    if first {
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e).with_context(|| format!("creating {}", dir.display())),
        }
    }
    std::fs::write(dir.join("cgroup.procs"), "0").with_context(|| format!("joining {}", dir.display()))
}

/// A later process (`ctr task exec`) started right after the first one must not join its
/// namespaces before it made them: wait until it left the VM's mount namespace and its root.
fn wait_for_setup(pid: u32) -> Result<()> {
    let deadline = std::time::Instant::now() + SETUP_WAIT;
    let ns = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/mnt")).ok();
    loop {
        // Its chroot is its last step of entering (after the namespaces and mounts).
        let entered = ns(&pid.to_string()) != ns("1")
            && std::fs::read_link(format!("/proc/{pid}/root")).is_ok_and(|r| r != Path::new("/"));
        if entered {
            return Ok(());
        }
        if !Path::new(&format!("/proc/{pid}")).exists() {
            bail!("the container's first process (pid {pid}) has ended");
        }
        if std::time::Instant::now() >= deadline {
            bail!("the container's first process (pid {pid}) did not enter the container within {SETUP_WAIT:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// A path inside the root, with `.` and `..` refused (an OCI destination is absolute and clean).
fn clean(dest: &str) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in Path::new(dest).components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(n) => out.push(n),
            Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

/// The flags an OCI mount option stands for; anything else is filesystem data.
fn flag(option: &str) -> Option<(MsFlags, bool)> {
    Some(match option {
        "ro" => (MsFlags::MS_RDONLY, true),
        "rw" => (MsFlags::MS_RDONLY, false),
        "nosuid" => (MsFlags::MS_NOSUID, true),
        "suid" => (MsFlags::MS_NOSUID, false),
        "nodev" => (MsFlags::MS_NODEV, true),
        "dev" => (MsFlags::MS_NODEV, false),
        "noexec" => (MsFlags::MS_NOEXEC, true),
        "exec" => (MsFlags::MS_NOEXEC, false),
        "relatime" => (MsFlags::MS_RELATIME, true),
        "noatime" => (MsFlags::MS_NOATIME, true),
        "strictatime" => (MsFlags::MS_STRICTATIME, true),
        "sync" => (MsFlags::MS_SYNCHRONOUS, true),
        "bind" => (MsFlags::MS_BIND, true),
        "rbind" => (MsFlags::MS_BIND | MsFlags::MS_REC, true),
        "private" | "rprivate" | "slave" | "rslave" | "shared" | "rshared" => (MsFlags::empty(), true),
        _ => return None,
    })
}

fn mount_one(root: &Path, m: &ContainerMount) -> Result<()> {
    let rel = clean(&m.destination).with_context(|| format!("{:?} is not a clean absolute path", m.destination))?;
    let target = root.join(&rel);
    let mut flags = MsFlags::empty();
    let mut data = Vec::new();
    for o in &m.options {
        match flag(o) {
            Some((f, true)) => flags |= f,
            Some((f, false)) => flags &= !f,
            None => data.push(o.as_str()),
        }
    }
    let bind = m.kind == "bind" || flags.contains(MsFlags::MS_BIND);
    if bind {
        flags |= MsFlags::MS_BIND;
        let source = std::fs::metadata(&m.source).with_context(|| format!("bind source {}", m.source))?;
        if source.is_dir() {
            std::fs::DirBuilder::new().recursive(true).mode(0o755).create(&target)?;
        } else if !target.exists() {
            std::fs::DirBuilder::new().recursive(true).mode(0o755).create(target.parent().unwrap_or(root))?;
            std::fs::OpenOptions::new().write(true).create(true).truncate(false).mode(0o644).open(&target)?;
        }
        mount(
            Some(m.source.as_str()),
            &target,
            None::<&str>,
            flags & (MsFlags::MS_BIND | MsFlags::MS_REC),
            None::<&str>,
        )?;
        // Read-only and the like take a remount of the bind.
        let rest = flags & !(MsFlags::MS_BIND | MsFlags::MS_REC);
        if !rest.is_empty() {
            mount(None::<&str>, &target, None::<&str>, rest | MsFlags::MS_BIND | MsFlags::MS_REMOUNT, None::<&str>)?;
        }
        return Ok(());
    }
    std::fs::DirBuilder::new().recursive(true).mode(0o755).create(&target)?;
    let data = data.join(",");
    let data = (!data.is_empty()).then_some(data.as_str());
    let source = if m.source.is_empty() { m.kind.as_str() } else { m.source.as_str() };
    let result = mount(Some(source), &target, Some(m.kind.as_str()), flags, data);
    // A v1 `cgroup` mount on the guest's cgroup2-only kernel: the v2 hierarchy instead.
    if result.is_err() && m.kind == "cgroup" {
        mount(Some("cgroup2"), &target, Some("cgroup2"), flags, None::<&str>)?;
        return Ok(());
    }
    Ok(result?)
}

/// What runc puts in a container's fresh `/dev` tmpfs: the usual character devices and links.
fn populate_dev(dev: &Path) -> Result<()> {
    for (name, major, minor) in
        [("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9), ("tty", 5, 0)]
    {
        let path = dev.join(name);
        if path.exists() {
            continue;
        }
        nix::sys::stat::mknod(
            &path,
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o666),
            nix::sys::stat::makedev(major, minor),
        )
        .with_context(|| format!("/dev/{name}"))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))?;
    }
    for (name, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ] {
        let _ = std::os::unix::fs::symlink(target, dev.join(name));
    }
    Ok(())
}

fn set_rlimit(r: &ContainerRlimit) -> Result<()> {
    use nix::sys::resource::{setrlimit, Resource};
    let resource = match r.kind.as_str() {
        "RLIMIT_AS" => Resource::RLIMIT_AS,
        "RLIMIT_CORE" => Resource::RLIMIT_CORE,
        "RLIMIT_CPU" => Resource::RLIMIT_CPU,
        "RLIMIT_DATA" => Resource::RLIMIT_DATA,
        "RLIMIT_FSIZE" => Resource::RLIMIT_FSIZE,
        "RLIMIT_LOCKS" => Resource::RLIMIT_LOCKS,
        "RLIMIT_MEMLOCK" => Resource::RLIMIT_MEMLOCK,
        "RLIMIT_MSGQUEUE" => Resource::RLIMIT_MSGQUEUE,
        "RLIMIT_NICE" => Resource::RLIMIT_NICE,
        "RLIMIT_NOFILE" => Resource::RLIMIT_NOFILE,
        "RLIMIT_NPROC" => Resource::RLIMIT_NPROC,
        "RLIMIT_RSS" => Resource::RLIMIT_RSS,
        "RLIMIT_RTPRIO" => Resource::RLIMIT_RTPRIO,
        "RLIMIT_RTTIME" => Resource::RLIMIT_RTTIME,
        "RLIMIT_SIGPENDING" => Resource::RLIMIT_SIGPENDING,
        "RLIMIT_STACK" => Resource::RLIMIT_STACK,
        other => bail!("unknown rlimit {other}"),
    };
    setrlimit(resource, r.soft, r.hard).with_context(|| format!("{} {} {}", r.kind, r.soft, r.hard))
}

/// `execvpe` with the container's own PATH (from its environment), looked up inside its root.
fn exec(args: &[String], env: &[String]) -> Result<std::convert::Infallible> {
    let path_var = env.iter().find_map(|e| e.strip_prefix("PATH=")).unwrap_or(DEFAULT_PATH);
    let program = &args[0];
    let candidates: Vec<PathBuf> = if program.contains('/') {
        vec![PathBuf::from(program)]
    } else {
        path_var.split(':').filter(|d| !d.is_empty()).map(|d| Path::new(d).join(program)).collect()
    };
    let argv = args.iter().map(|a| CString::new(a.as_str())).collect::<Result<Vec<_>, _>>()?;
    let envp = env.iter().map(|e| CString::new(e.as_str())).collect::<Result<Vec<_>, _>>()?;
    let mut last = nix::errno::Errno::ENOENT;
    for c in &candidates {
        let path = CString::new(c.as_os_str().as_encoded_bytes())?;
        match nix::unistd::execve(&path, &argv, &envp) {
            Ok(never) => match never {},
            // Keep looking past a directory that lacks it or that we may not search.
            Err(e @ (nix::errno::Errno::ENOENT | nix::errno::Errno::ENOTDIR | nix::errno::Errno::EACCES)) => last = e,
            Err(e) => return Err(e).with_context(|| format!("exec {}", c.display())),
        }
    }
    Err(last).with_context(|| format!("exec {program:?} (PATH {path_var})"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destinations_stay_inside_the_root() {
        assert_eq!(clean("/proc").unwrap(), PathBuf::from("proc"));
        assert_eq!(clean("/dev//pts/.").unwrap(), PathBuf::from("dev/pts"));
        assert!(clean("/../../etc").is_none());
        assert!(clean("/dev/../..").is_none());
    }

    #[test]
    fn options_split_into_flags_and_data() {
        assert_eq!(flag("ro"), Some((MsFlags::MS_RDONLY, true)));
        assert_eq!(flag("rw"), Some((MsFlags::MS_RDONLY, false)));
        assert_eq!(flag("rbind"), Some((MsFlags::MS_BIND | MsFlags::MS_REC, true)));
        assert_eq!(flag("mode=755"), None);
        assert_eq!(flag("newinstance"), None);
    }
}
