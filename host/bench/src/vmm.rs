//! `vmctl bench vmm`: the Umbra VMM's own costs, each beside an anchor measured in the same run.
//!
//! - Bare guest (any KVM, including kvm_pvm): `umbra-vmm` launch → first serial byte → exit for
//!   a guest that prints one byte and resets, median of N, beside a native process spawn →
//!   exit (`/bin/true`); and umbra-vmm's resident memory excluding guest memory (RSS minus the
//!   resident pages of the guest-memory memfd mapping), read from /proc/PID/smaps while a bare
//!   guest spins.
//! - Linux (hardware KVM only, e.g. inside the nested lane): launch → agent ready on the `kvm`
//!   backend beside the `qemu` backend booting the same bundle, as a ratio.
//! - Both beside Firecracker when a binary is found ([`crate::anchor_firecracker`]): the same
//!   bare guest, and the same kernel and initramfs to agent ready, runs interleaved.
//! - Restore (hardware KVM): one snapshot of the booted guest, then process launch → restored
//!   guest's agent answered, beside launch → agent ready for a boot in the same harness, and
//!   beside Firecracker restoring its own snapshot of the same guest (interleaved). Before the
//!   snapshot, N live forks of the same running guest: each fork's pause beside the snapshot's.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use umbra_runtime::backend::{kvm, BackendKind, BootImage, KvmKind, VmSpec};
use umbra_vmm::bare::BareGuest;

use crate::boot::{median, median_boot_time, ms};
use crate::paths;

#[derive(Args, Debug)]
pub struct VmmBenchArgs {
    /// Runs of the bare-guest launch → exit measurement.
    #[arg(long, default_value_t = 20)]
    runs: usize,
    /// Runs of each backend's Linux boot (hardware KVM only).
    #[arg(long, default_value_t = 5)]
    boot_runs: usize,
    #[arg(long, default_value = "minimal")]
    bundle: String,
}

/// One bare run: (launch → first console byte, launch → exit).
fn bare_once(vmm: &Path, elf: &Path) -> anyhow::Result<(Duration, Duration)> {
    let t = Instant::now();
    let mut child = Command::new(vmm)
        .arg("--kernel")
        .arg(elf)
        .args(["--memory", "32", "--no-rng"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("start umbra-vmm")?;
    let mut first = [0u8; 1];
    let mut stdout = child.stdout.take().expect("piped");
    let n = stdout.read(&mut first).context("read the guest console")?;
    let first_byte = t.elapsed();
    let status = child.wait()?;
    let exited = t.elapsed();
    if n != 1 || !status.success() {
        let mut err = String::new();
        child.stderr.take().expect("piped").read_to_string(&mut err)?;
        bail!("the bare guest did not print and reset ({status}): {err}");
    }
    Ok((first_byte, exited))
}

/// (total RSS, RSS of the guest-memory mapping) in KiB, from /proc/PID/smaps. Guest memory is
/// told apart by its name (`memfd:umbra-guest-memory`, or `[anon:umbra-guest-memory]` for the
/// anonymous memory of a VM without shared folders), not by "shared memory": where the binary
/// itself lives on a tmpfs (the nested lane's initramfs), its pages count as shared memory too.
/// Where the kernel cannot name anonymous memory (before 5.17, or without CONFIG_ANON_VMA_NAME),
/// the unnamed anonymous mapping of exactly `guest_bytes` is the guest's.
fn rss_kib(pid: u32, guest_bytes: u64) -> Option<(u64, u64)> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    let (mut total, mut guest, mut in_guest) = (0, 0, false);
    for line in smaps.lines() {
        if let Some(kib) = line.strip_prefix("Rss:") {
            let kib: u64 = kib.trim().trim_end_matches("kB").trim().parse().ok()?;
            total += kib;
            if in_guest {
                guest += kib;
            }
        } else if line.split_whitespace().next().is_some_and(|f| f.contains('-') && !f.ends_with(':')) {
            // A mapping header: "start-end perms offset dev inode [path]".
            let mut fields = line.split_whitespace();
            let size = fields.next().and_then(|range| {
                let (a, b) = range.split_once('-')?;
                Some(u64::from_str_radix(b, 16).ok()? - u64::from_str_radix(a, 16).ok()?)
            });
            let unnamed = fields.nth(4).is_none();
            in_guest = line.contains(umbra_vmm::vstate::memory::NAME) || (unnamed && size == Some(guest_bytes));
        }
    }
    Some((total, guest))
}

/// umbra-vmm's RSS without guest memory, for a spinning guest of `memory_mib`.
fn rss_without_guest(vmm: &Path, elf: &Path, memory_mib: u32) -> anyhow::Result<(u64, u64)> {
    let mut child = Command::new(vmm)
        .arg("--kernel")
        .arg(elf)
        .args(["--memory", &memory_mib.to_string(), "--no-rng"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("start umbra-vmm")?;
    let mut first = [0u8; 1];
    child.stdout.take().expect("piped").read_exact(&mut first).context("read the guest console")?;
    std::thread::sleep(Duration::from_millis(200));
    let rss = rss_kib(child.id(), u64::from(memory_mib) << 20);
    let _ = child.kill();
    let _ = child.wait();
    match rss {
        Some((total, guest)) => Ok((total.saturating_sub(guest), total)),
        None => bail!("cannot read /proc/{}/smaps", child.id()),
    }
}

fn spawn_anchor(runs: usize) -> anyhow::Result<Duration> {
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t = Instant::now();
        Command::new("/bin/true").status().context("run /bin/true")?;
        times.push(t.elapsed());
    }
    Ok(median(times))
}

fn temp_elf(guest: &BareGuest, tag: &str) -> anyhow::Result<PathBuf> {
    let path = std::env::temp_dir().join(format!("umbra-bench-{tag}-{}.elf", std::process::id()));
    std::fs::write(&path, guest.to_elf())?;
    Ok(path)
}

async fn linux_boots(args: &VmmBenchArgs, firecracker: Option<&Path>) -> anyhow::Result<()> {
    let dir = crate::bundle_dir(&args.bundle)?;
    let image = BootImage::from_bundle_dir(&dir, &paths::extracted_dir())?;
    let runs = args.boot_runs.max(1);
    let mut medians = Vec::new();
    for backend in [BackendKind::Qemu, BackendKind::Kvm] {
        let m = median_boot_time(backend, &image, runs).await?;
        println!("{:<40} median {:>8.1} ms", format!("linux: {} launch -> agent ready", backend.name()), ms(m));
        medians.push(m);
    }
    println!(
        "ratio umbra-vmm / qemu (launch -> agent ready, bundle {}): {:.2}",
        image.version,
        medians[1].as_secs_f64() / medians[0].as_secs_f64()
    );
    let Some(fc) = firecracker else { return Ok(()) };
    // Interleaved with umbra-vmm again, so both see the same machine.
    let memory_mib = umbra_runtime::backend::VmSpec::new(image.clone()).memory_mib;
    let scratch = std::env::temp_dir().join(format!("umbra-bench-fc-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    let measured = async {
        for run in 0..runs {
            for fc_turn in [run % 2 == 1, run % 2 == 0] {
                if fc_turn {
                    theirs.push(crate::anchor_firecracker::linux_once(fc, &image, memory_mib, &scratch).await?);
                } else {
                    ours.push(median_boot_time(BackendKind::Kvm, &image, 1).await?);
                }
            }
        }
        anyhow::Ok(())
    }
    .await;
    let _ = std::fs::remove_dir_all(&scratch);
    measured?;
    let (ours, theirs) = (median(ours), median(theirs));
    println!("{:<40} median {:>8.1} ms", "linux: firecracker launch -> agent ready", ms(theirs));
    println!("{:<40} median {:>8.1} ms", "linux: kvm (interleaved with it)", ms(ours));
    println!(
        "ratio umbra-vmm / firecracker (launch -> agent ready, same kernel and initramfs): {:.2}",
        ours.as_secs_f64() / theirs.as_secs_f64()
    );
    Ok(())
}

/// umbra-vmm as the restore rows run it: unjailed (as Firecracker runs here), with a control
/// socket, in its own directory; killed when dropped.
struct UmbraVmm {
    child: std::process::Child,
    dir: PathBuf,
}

impl Drop for UmbraVmm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl UmbraVmm {
    /// Starts `vmm` for `spec` in `dir`, booting or, with `restore`, resuming a snapshot.
    fn start(vmm: &Path, spec: &VmSpec, dir: &Path, restore: Option<(&Path, Prefault)>) -> anyhow::Result<UmbraVmm> {
        for stale in ["vsock.sock", "control.sock"] {
            let _ = std::fs::remove_file(dir.join(stale));
        }
        let mut cfg = kvm::vm_config(spec, &dir.join("vsock.sock"), None, false)?;
        cfg.control = Some(dir.join("control.sock"));
        std::fs::write(dir.join("vm.json"), serde_json::to_string(&cfg)?)?;
        let mut cmd = Command::new(vmm);
        cmd.arg("--config").arg(dir.join("vm.json"));
        if let Some((snapshot, prefault)) = restore {
            cmd.arg("--restore").arg(snapshot).arg("--prefault").arg(prefault.arg());
        }
        let log = std::fs::File::create(dir.join("umbra-vmm.log"))?;
        let child = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(log).spawn().context("start umbra-vmm")?;
        Ok(UmbraVmm { child, dir: dir.to_path_buf() })
    }

    /// Waits until the agent answers the handshake.
    async fn agent(&mut self) -> anyhow::Result<umbra_runtime::agent::AgentClient> {
        let t = Instant::now();
        let uds = self.dir.join("vsock.sock");
        while t.elapsed() < Duration::from_secs(60) {
            if let Some(status) = self.child.try_wait()? {
                let log = std::fs::read_to_string(self.dir.join("umbra-vmm.log")).unwrap_or_default();
                bail!("umbra-vmm exited ({status}) before its agent answered: {log}");
            }
            let connect = umbra_runtime::agent::AgentClient::connect_hybrid_vsock(&uds, umbra_proto::AGENT_VSOCK_PORT);
            if let Ok(Ok(agent)) = tokio::time::timeout(Duration::from_secs(2), connect).await {
                return Ok(agent);
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        bail!("umbra-vmm's agent did not answer within 60 s")
    }

    /// The phases of a restore, from the line umbra-vmm prints before its guest runs.
    fn restore_phases(&self) -> anyhow::Result<RestorePhases> {
        let log = std::fs::read_to_string(self.dir.join("umbra-vmm.log"))?;
        log.lines().find_map(RestorePhases::parse).with_context(|| format!("no restore line in umbra-vmm's log: {log}"))
    }
}

/// How umbra-vmm is told to map a snapshot's memory (its `--prefault`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Prefault {
    Data,
    None,
}

impl Prefault {
    fn arg(self) -> &'static str {
        match self {
            Prefault::Data => "data",
            Prefault::None => "none",
        }
    }
}

/// `umbra-vmm: restored in N ms (state A ms, …, threads E ms)`: launch until the vCPUs go, and
/// the phases of `Machine::restore` and `Machine::run` within it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct RestorePhases {
    to_run: u64,
    state: u64,
    memory: u64,
    vcpus: u64,
    devices: u64,
    threads: u64,
}

impl RestorePhases {
    fn parse(line: &str) -> Option<Self> {
        let rest = line.strip_prefix("umbra-vmm: restored in ")?;
        let numbers: Vec<u64> = rest
            .split(|c: char| !c.is_ascii_digit())
            .filter(|w| !w.is_empty())
            .map(|w| w.parse().ok())
            .collect::<Option<_>>()?;
        let [to_run, state, memory, vcpus, devices, threads] = numbers[..] else { return None };
        Some(Self { to_run, state, memory, vcpus, devices, threads })
    }
}

/// One variant's restores: launch → agent ready, and where umbra-vmm's part went.
#[derive(Default)]
struct Restores {
    ready: Vec<Duration>,
    phases: Vec<RestorePhases>,
}

impl Restores {
    fn median_of(&self, f: impl Fn(&RestorePhases) -> u64) -> u64 {
        let mut v: Vec<u64> = self.phases.iter().map(f).collect();
        v.sort_unstable();
        v.get(v.len() / 2).copied().unwrap_or(0)
    }

    /// The rows of one variant; `anchor` is Firecracker's median to set it beside.
    fn print(&self, label: &str, boot: Duration, anchor: Option<Duration>) {
        let ready = median(self.ready.clone());
        let ratio = match anchor {
            Some(fc) => format!("ratio umbra-vmm / firecracker {:.2}", ready.as_secs_f64() / fc.as_secs_f64()),
            None => format!("ratio restore / boot {:.3}", ready.as_secs_f64() / boot.as_secs_f64()),
        };
        println!("{:<40} median {:>8.1} ms   {ratio}", format!("linux: umbra-vmm restore ({label})"), ms(ready));
        let to_run = self.median_of(|p| p.to_run);
        println!(
            "  launch -> guest runs {to_run} ms (state {} ms, memory {} ms, vcpus {} ms, devices {} ms, \
             threads {} ms); guest runs -> agent ready {:.0} ms",
            self.median_of(|p| p.state),
            self.median_of(|p| p.memory),
            self.median_of(|p| p.vcpus),
            self.median_of(|p| p.devices),
            self.median_of(|p| p.threads),
            ms(ready) - to_run as f64
        );
    }
}

/// Restore → agent ready for umbra-vmm, beside its own boot and beside Firecracker's restore.
async fn linux_restores(vmm: &Path, image: &BootImage, runs: usize, firecracker: Option<&Path>) -> anyhow::Result<()> {
    let spec = VmSpec::new(image.clone());
    let scratch = std::env::temp_dir().join(format!("umbra-bench-restore-{}", std::process::id()));
    let (boot_dir, restore_dir, snap, fc_dir) =
        (scratch.join("boot"), scratch.join("restore"), scratch.join("snapshot"), scratch.join("fc"));
    for d in [&boot_dir, &restore_dir, &snap, &fc_dir] {
        std::fs::create_dir_all(d)?;
    }
    let measured = async {
        // The snapshot: a booted guest whose agent answered. Live forks of it first: each
        // pause beside the full snapshot's, of the same guest in the same run.
        let mut original = UmbraVmm::start(vmm, &spec, &boot_dir, None)?;
        original.agent().await?;
        let mut fork_pauses = Vec::new();
        for i in 0..runs.max(1) {
            let fork_dir = scratch.join(format!("fork-{i}"));
            std::fs::create_dir_all(&fork_dir)?;
            let state = std::fs::File::create(fork_dir.join("state"))?;
            let memory = std::fs::File::create(fork_dir.join("memory"))?;
            let (_, phases, paused) = kvm::request_fork(&boot_dir.join("control.sock"), &state, &memory, || Ok(()))?;
            anyhow::ensure!(original.child.try_wait()?.is_none(), "umbra-vmm ended after a live fork");
            println!("{:<40} {:>8.1} ms ({phases})", format!("linux: umbra-vmm live fork {i}, paused"), ms(paused));
            fork_pauses.push(paused);
            let _ = std::fs::remove_dir_all(&fork_dir);
        }
        original.agent().await.context("the agent after the live forks")?;
        let (state, memory) = (std::fs::File::create(snap.join("state"))?, std::fs::File::create(snap.join("memory"))?);
        let t = Instant::now();
        let (bytes, phases) = kvm::request_snapshot(&boot_dir.join("control.sock"), &state, &memory)?;
        let snapshot_pause = t.elapsed();
        let status = original.child.wait()?;
        anyhow::ensure!(status.code() == Some(6), "umbra-vmm ended with {status} after the snapshot, not 6");
        println!(
            "{:<40} {:>8.1} ms ({} MiB of {} MiB guest memory written; {phases})",
            "linux: umbra-vmm snapshot",
            ms(snapshot_pause),
            bytes >> 20,
            spec.memory_mib
        );
        let fork_pause = median(fork_pauses);
        println!(
            "{:<40} median {:>8.1} ms, {:.2}x the full snapshot's pause",
            "linux: umbra-vmm live fork pause",
            ms(fork_pause),
            ms(fork_pause) / ms(snapshot_pause).max(0.001)
        );
        drop(original);
        let fc_snap = match firecracker {
            Some(fc) => Some(crate::anchor_firecracker::snapshot_linux(fc, image, spec.memory_mib, &fc_dir).await?),
            None => None,
        };
        let (mut boots, mut data, mut lazy, mut fc_restores) =
            (Vec::new(), Restores::default(), Restores::default(), Vec::new());
        for run in 0..runs {
            let t = Instant::now();
            UmbraVmm::start(vmm, &spec, &boot_dir, None)?.agent().await?;
            boots.push(t.elapsed());
            // Interleaved, each going first in turn: umbra-vmm prefaulting the memory file's
            // data, umbra-vmm letting the guest fault pages in, Firecracker.
            for turn in 0..3 {
                match ((run + turn) % 3, &fc_snap, firecracker) {
                    (2, Some(s), Some(fc)) => fc_restores.push(crate::anchor_firecracker::restore_once(fc, s).await?),
                    (2, _, _) => {}
                    (variant, _, _) => {
                        let (prefault, into) =
                            if variant == 0 { (Prefault::Data, &mut data) } else { (Prefault::None, &mut lazy) };
                        let t = Instant::now();
                        let mut restored = UmbraVmm::start(vmm, &spec, &restore_dir, Some((&snap, prefault)))?;
                        restored.agent().await?;
                        into.ready.push(t.elapsed());
                        into.phases.push(restored.restore_phases()?);
                    }
                }
            }
        }
        let boot = median(boots);
        println!("{:<40} median {:>8.1} ms", "linux: umbra-vmm launch -> agent ready", ms(boot));
        let anchor = (!fc_restores.is_empty()).then(|| median(fc_restores.iter().map(|r| r.ready).collect()));
        data.print("prefault data", boot, anchor);
        lazy.print("prefault none", boot, anchor);
        if let Some(theirs) = anchor {
            let loaded = median(fc_restores.iter().map(|r| r.loaded).collect());
            println!("{:<40} median {:>8.1} ms", "linux: firecracker restore -> agent ready", ms(theirs));
            println!(
                "  launch -> snapshot loaded and resumed {:.0} ms; resumed -> agent ready {:.0} ms",
                ms(loaded),
                ms(theirs) - ms(loaded)
            );
        }
        anyhow::Ok(())
    }
    .await;
    let _ = std::fs::remove_dir_all(&scratch);
    measured
}

pub async fn vmm(args: VmmBenchArgs) -> anyhow::Result<()> {
    let vmm = kvm::find_vmm().context("umbra-vmm not found (build it next to vmctl or set UMBRA_VMM_BIN)")?;
    let kvm_kind = KvmKind::detect();
    if kvm_kind == KvmKind::Absent {
        bail!("no usable /dev/kvm");
    }
    let runs = args.runs.max(1);
    println!("umbra-vmm {} · /dev/kvm: {kvm_kind:?} · {runs} runs", vmm.display());
    let firecracker = crate::anchor_firecracker::find();
    match &firecracker {
        Some(fc) => println!("anchor: Firecracker {}", fc.display()),
        None => println!("anchor: no Firecracker binary (set UMBRA_FIRECRACKER_BIN): its rows are left out"),
    }

    let reset = temp_elf(&BareGuest::new().print("x").reset(), "reset")?;
    let spin = temp_elf(&BareGuest::new().print("x").spin(), "spin")?;
    let result = (|| -> anyhow::Result<()> {
        let anchor = spawn_anchor(runs)?;
        let (mut first, mut exit, mut fc_first, mut fc_exit) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for run in 0..runs {
            // Interleaved, each going first in turn: a machine that slows down slows both.
            for fc_turn in [run % 2 == 1, run % 2 == 0] {
                match (&firecracker, fc_turn) {
                    (Some(fc), true) => {
                        let (f, e) = crate::anchor_firecracker::bare_once(fc, &reset, &std::env::temp_dir())?;
                        fc_first.push(f);
                        fc_exit.push(e);
                    }
                    (_, false) => {
                        let (f, e) = bare_once(&vmm, &reset)?;
                        first.push(f);
                        exit.push(e);
                    }
                    (None, true) => {}
                }
            }
        }
        let (first, exit) = (median(first), median(exit));
        println!("{:<40} median {:>8.2} ms", "anchor: native spawn -> exit (/bin/true)", ms(anchor));
        println!("{:<40} median {:>8.2} ms", "bare guest: launch -> first serial byte", ms(first));
        println!(
            "{:<40} median {:>8.2} ms   ratio {:.1}x the anchor",
            "bare guest: launch -> exit",
            ms(exit),
            exit.as_secs_f64() / anchor.as_secs_f64()
        );
        if !fc_first.is_empty() {
            let (ff, fe) = (median(fc_first), median(fc_exit));
            println!(
                "{:<40} median {:>8.2} ms   ratio umbra-vmm / firecracker {:.2}",
                "firecracker: launch -> first serial byte",
                ms(ff),
                first.as_secs_f64() / ff.as_secs_f64()
            );
            println!(
                "{:<40} median {:>8.2} ms   ratio umbra-vmm / firecracker {:.2}",
                "firecracker: launch -> exit",
                ms(fe),
                exit.as_secs_f64() / fe.as_secs_f64()
            );
        }
        for mib in [32, 512] {
            let (own, total) = rss_without_guest(&vmm, &spin, mib)?;
            println!(
                "{:<40} {:>8.2} MiB (RSS {:.2} MiB incl. touched guest memory)",
                format!("umbra-vmm RSS excl. guest memory ({mib} MiB guest)"),
                own as f64 / 1024.0,
                total as f64 / 1024.0
            );
        }
        Ok(())
    })();
    let _ = std::fs::remove_file(&reset);
    let _ = std::fs::remove_file(&spin);
    result?;

    if kvm_kind == KvmKind::Hardware {
        linux_boots(&args, firecracker.as_deref()).await?;
        let image = BootImage::from_bundle_dir(&crate::bundle_dir(&args.bundle)?, &paths::extracted_dir())?;
        linux_restores(&vmm, &image, args.boot_runs.max(1), firecracker.as_deref()).await
    } else {
        println!("linux boot comparison skipped: /dev/kvm is kvm_pvm, which cannot boot Linux (run it in scripts/nested-lane)");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::RestorePhases;

    #[test]
    fn the_restore_line_umbra_vmm_prints_parses_back() {
        let phases = umbra_vmm::machine::RestorePhases { state: 3, memory: 41, vcpus: 7, devices: 2, threads: 9 };
        let line = format!("umbra-vmm: restored in 60 ms ({phases})");
        let parsed = RestorePhases::parse(&line).expect("the line parses");
        assert_eq!(parsed, RestorePhases { to_run: 60, state: 3, memory: 41, vcpus: 7, devices: 2, threads: 9 });
        assert_eq!(RestorePhases::parse("umbra-vmm: restored in 60 ms (state 3 ms)"), None);
        assert_eq!(RestorePhases::parse("umbra-vmm: the guest halted"), None);
    }
}
