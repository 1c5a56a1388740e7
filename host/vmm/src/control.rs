//! The control socket: requests to a running VMM, one per connection, one JSON line each way
//! (`umbra_contract::control`: `{"snapshot":{}}` with two descriptors attached (SCM_RIGHTS),
//! the state file then the memory file, both open for writing and empty; `{"ok":{…}}` or
//! `{"error":"why"}` back).
//!
//! A fork (`{"fork":{}}`, the same two files) is a snapshot the VM survives: the guest pauses
//! while its vCPUs, devices and interrupt controllers are read, and its memory is made
//! copy-on-write (below); the VMM says `{"paused":…}`, waits for the caller's `{"resume":{}}`
//! (the caller copies the session disk meanwhile, which must match the memory), starts every
//! device again over the same queues and lets the vCPUs go. The files are complete when the
//! `{"ok":…}` comes. Memory only this process maps (anonymous, or a restore's private
//! mapping) is copied by a child process: `fork()` gives it the guest's pages as they were at
//! the pause, copy-on-write, for the price of copying page tables, and it writes the memory
//! file while the guest runs on. Memory a vhost-user backend maps too (a memfd, with shared
//! folders) would not be copy-on-write in the child, so it is pre-copied instead: the devices
//! stop first (the guest runs on; its I/O waits), KVM's dirty-page log starts, the memory is
//! written while the vCPUs run, and the vCPUs pause only to have the pages they wrote meanwhile
//! written again and their state read. With the devices stopped nothing but the vCPUs (and KVM
//! on their behalf, which logs it too) writes guest memory.
//!
//! The caller creates the files and hands them over: no VMM thread opens a path (the filters
//! forbid `openat`), and in a jail there would be no path to open. A snapshot pauses every vCPU
//! at an instruction boundary (kicked out of KVM_RUN), stops every device between batches,
//! writes both files and ends the VM with exit status 6: the VM it was taken of does not run on,
//! so nothing can change between the files and a restore. A request refused before the pause
//! (malformed, without its two files, a device that cannot be snapshotted) leaves the VM
//! running; a failure after it ends the VM with an internal error saying what failed.

use std::fs::File;
use std::io::Write;
use std::os::fd::FromRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::Duration;

use crate::bus::IoBus;
use crate::exit::VmExit;
use crate::snapshot::{self, SnapshotState, VcpuState, VmState};
use crate::vstate::vcpu::kick;
use crate::vstate::vm::Vm;
use vm_memory::GuestMemoryBackend;

/// Bounds a request line; far above any real one.
const MAX_REQUEST: usize = 4096;
/// How long a client may take to send its request, and the vCPUs to pause.
const PATIENCE: Duration = Duration::from_secs(5);

use umbra_contract::control::{ControlReply, ControlRequest, Phases, SnapshotTaken};

/// How long a fork waits for the caller's `resume` (it copies the session disk meanwhile);
/// past it, or when the caller hangs up, the guest runs again and the fork fails.
const RESUME_PATIENCE: Duration = Duration::from_secs(300);

/// Where paused vCPUs wait to run again after a live fork.
#[derive(Default)]
pub struct Resume {
    generation: std::sync::Mutex<u64>,
    changed: std::sync::Condvar,
}

impl Resume {
    /// The current pause's number, read by a vCPU as it pauses.
    pub fn generation(&self) -> u64 {
        *self.generation.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Blocks until the pause numbered `seen` ends (for ever after a snapshot, which ends the VM).
    pub fn wait_past(&self, seen: u64) {
        let guard = self.generation.lock().unwrap_or_else(|p| p.into_inner());
        drop(self.changed.wait_while(guard, |g| *g == seen));
    }

    fn wake(&self) {
        *self.generation.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        self.changed.notify_all();
    }
}

/// What taking a snapshot needs of the running machine.
pub struct Snapshotter {
    pub vm: Arc<Vm>,
    pub bus: Arc<IoBus>,
    /// Set, with a kick, to make every vCPU pause.
    pub pause: Arc<AtomicBool>,
    /// The vCPU threads, in vCPU order.
    pub vcpus: Vec<libc::pthread_t>,
    /// Where each paused vCPU sends its state.
    pub states: Receiver<VcpuState>,
    pub memory_size: u64,
    /// Lets the paused vCPUs go after a fork.
    pub resume: Arc<Resume>,
}

/// Why a snapshot failed, and whether the VM can go on.
enum Failure {
    /// Refused before anything was paused: the VM runs on.
    Refused(String),
    /// Failed after the pause: the VM cannot go on.
    Broken(String),
}

/// Serves the control socket until a snapshot ends the VM; `exits` is where the machine learns
/// how its VM ended.
pub fn serve(listener: UnixListener, snapshotter: Snapshotter, exits: Sender<VmExit>) {
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        // A fork leaves the VM running; a snapshot ends it.
        let mut live = false;
        let reply = match read_request(&stream, PATIENCE) {
            Err(e) => Err(Failure::Refused(e)),
            Ok((ControlRequest::Resume {}, _)) => {
                Err(Failure::Refused("a resume comes on a fork's connection, after its pause".into()))
            }
            Ok((request, files)) => match (<[File; 2]>::try_from(files), request) {
                (Ok([state, memory]), ControlRequest::Fork {}) => {
                    live = true;
                    snapshotter.fork(&stream, &state, &memory)
                }
                (Ok([state, memory]), _) => snapshotter.take(&state, &memory),
                (Err(files), _) => Err(Failure::Refused(format!(
                    "a snapshot or fork request carries two files (state, memory), this one {}",
                    files.len()
                ))),
            },
        };
        let (answer, exit) = match reply {
            Ok(taken) if live => (ControlReply::Ok(taken), None),
            Ok(taken) => (ControlReply::Ok(taken), Some(VmExit::Snapshotted)),
            Err(Failure::Refused(e)) => (ControlReply::Error(e), None),
            Err(Failure::Broken(e)) => {
                let why = format!("snapshot failed after the VM was paused: {e}");
                (ControlReply::Error(why.clone()), Some(VmExit::Internal(why)))
            }
        };
        send(&stream, &answer);
        if let Some(exit) = exit {
            let _ = exits.send(exit);
            return;
        }
    }
}

/// Writes one reply line; a caller that hung up misses it.
fn send(mut stream: &UnixStream, reply: &ControlReply) {
    let line = serde_json::to_string(reply).unwrap_or_else(|_| r#"{"error":"unprintable reply"}"#.into());
    let _ = writeln!(stream, "{line}");
}

/// One request line and the descriptors that came with it (at most two are kept; more close).
fn read_request(stream: &UnixStream, patience: Duration) -> Result<(ControlRequest, Vec<File>), String> {
    use vmm_sys_util::sock_ctrl_msg::ScmSocket;
    stream.set_read_timeout(Some(patience)).map_err(|e| format!("control socket: {e}"))?;
    let mut buf = vec![0u8; MAX_REQUEST];
    let mut fds = [-1; 2];
    let mut iov = [libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() }];
    // SAFETY: the iovec covers exactly `buf`, which recvmsg may overwrite.
    let (len, count) =
        unsafe { stream.recv_with_fds(&mut iov, &mut fds) }.map_err(|e| format!("reading the request: {e}"))?;
    // SAFETY: recvmsg gave us the first `count` descriptors; each is owned here from now on.
    let files: Vec<File> = fds[..count.min(2)].iter().map(|&fd| unsafe { File::from_raw_fd(fd) }).collect();
    let line = std::str::from_utf8(&buf[..len]).map_err(|_| "a request that is not UTF-8".to_string())?;
    let Some(line) = line.strip_suffix('\n') else {
        return Err(format!("a request is one line of at most {MAX_REQUEST} bytes, in one message"));
    };
    let shown: String = line.chars().take(200).collect();
    let request = serde_json::from_str(line).map_err(|e| format!("bad request {shown:?}: {e}"))?;
    Ok((request, files))
}

impl Snapshotter {
    fn take(&self, state_file: &File, memory_file: &File) -> Result<SnapshotTaken, Failure> {
        // Each phase's milliseconds go back with the answer: where a long pause goes.
        let mut lap = laps(std::time::Instant::now());
        let broken = |e: String| Failure::Broken(e);
        let vcpus = self.pause_vcpus()?;
        let vcpus_ms = lap();
        // Devices stopped before the interrupt controllers are read: nothing raises an
        // interrupt after that (what they raised while stopping is in their saved status).
        let devices = self.bus.quiesce().map_err(broken)?;
        let devices_ms = lap();
        let vm = VmState::capture(&self.vm.fd).map_err(|e| broken(e.to_string()))?;
        let serial = Some(self.bus.serial_state());
        let memory_bytes = snapshot::memory::dump_to(&self.vm.memory, self.memory_size, memory_file)
            .map_err(|e| broken(e.to_string()))?;
        let memory_ms = lap();
        let vmm = env!("CARGO_PKG_VERSION").into();
        let state = SnapshotState { vmm, memory_size: self.memory_size, vm, vcpus, devices, serial };
        snapshot::file::write_to(&state, state_file).map_err(|e| broken(e.to_string()))?;
        let phases_ms = Phases {
            vcpus: vcpus_ms,
            devices: devices_ms,
            memory: memory_ms,
            state: lap(),
            paused: 0,
            devices_held: 0,
        };
        Ok(SnapshotTaken { memory_bytes, phases_ms })
    }

    /// Every vCPU out of KVM_RUN at an instruction boundary, its state read (in vCPU order).
    fn pause_vcpus(&self) -> Result<Vec<VcpuState>, Failure> {
        self.pause.store(true, Ordering::Release);
        let broken = |e: String| Failure::Broken(e);
        let mut vcpus = Vec::with_capacity(self.vcpus.len());
        for thread in &self.vcpus {
            kick(*thread).map_err(|e| broken(e.to_string()))?;
        }
        for _ in &self.vcpus {
            let state = self.states.recv_timeout(PATIENCE).map_err(|_| broken("a vCPU did not pause".into()))?;
            vcpus.push(state);
        }
        vcpus.sort_by_key(|v| v.id);
        Ok(vcpus)
    }

    /// Lets the paused vCPUs run again.
    fn run_vcpus(&self) {
        self.pause.store(false, Ordering::Release);
        self.resume.wake();
    }

    /// A live fork (see the module's comment): `stream` is the caller's connection, which
    /// gets the `paused` line and says `resume`.
    fn fork(&self, stream: &UnixStream, state_file: &File, memory_file: &File) -> Result<SnapshotTaken, Failure> {
        match self.vm.memory.iter().any(|r| r.flags() & libc::MAP_SHARED != 0) {
            true => self.fork_precopy(stream, state_file, memory_file),
            false => self.fork_cow(stream, state_file, memory_file),
        }
    }

    /// Private memory: vCPUs and devices pause together, a forked child gets guest memory
    /// copy-on-write and writes it while the guest runs on; the pause is the state's capture,
    /// the `fork()` and the caller's disk copy.
    fn fork_cow(&self, stream: &UnixStream, state_file: &File, memory_file: &File) -> Result<SnapshotTaken, Failure> {
        let paused_at = std::time::Instant::now();
        let mut lap = laps(paused_at);
        let vcpus = self.pause_vcpus()?;
        let vcpus_ms = lap();
        let devices = match self.bus.suspend() {
            Ok(devices) => devices,
            Err(e) => {
                self.run_vcpus();
                return Err(Failure::Refused(format!("a device could not stop for the fork: {e}")));
            }
        };
        let devices_ms = lap();
        let serial = Some(self.bus.serial_state());
        let captured = VmState::capture(&self.vm.fd)
            .map_err(|e| e.to_string())
            .and_then(|vm| Copier::start(&self.vm.memory, self.memory_size, memory_file).map(|copier| (vm, copier)));
        let memory_ms = lap();
        let resumed = match captured {
            Ok(_) => {
                send_paused(stream, paused_at);
                await_resume(stream)
            }
            Err(_) => Ok(()),
        };
        // Whatever happened, the guest runs on: the devices first, so no vCPU finds one stopped.
        self.bus.resume().map_err(|e| Failure::Broken(format!("a device did not start again after the fork: {e}")))?;
        self.run_vcpus();
        let paused = paused_at.elapsed().as_millis().max(1) as u64;
        let (vm, copier) = captured.map_err(|e| Failure::Refused(format!("the fork's capture failed: {e}")))?;
        resumed.map_err(Failure::Refused)?;
        let vmm = env!("CARGO_PKG_VERSION").into();
        let state = SnapshotState { vmm, memory_size: self.memory_size, vm, vcpus, devices, serial };
        snapshot::file::write_to(&state, state_file).map_err(|e| Failure::Refused(e.to_string()))?;
        let state_ms = lap();
        let memory_bytes = copier.wait().map_err(Failure::Refused)?;
        let memory_ms = memory_ms + lap();
        let phases_ms = Phases {
            vcpus: vcpus_ms,
            devices: devices_ms,
            memory: memory_ms,
            state: state_ms,
            paused,
            devices_held: paused,
        };
        Ok(SnapshotTaken { memory_bytes, phases_ms })
    }

    /// Memory a vhost-user backend maps too (a memfd): a child would not see it copy-on-write.
    /// The devices stop first (nothing but the vCPUs and KVM writes guest memory then), KVM's
    /// dirty-page log starts, the caller copies the disk and umbra-vmm copies guest memory while
    /// the guest runs on; then the vCPUs pause only to have the pages written meanwhile copied
    /// again and the state read.
    fn fork_precopy(
        &self,
        stream: &UnixStream,
        state_file: &File,
        memory_file: &File,
    ) -> Result<SnapshotTaken, Failure> {
        let held_at = std::time::Instant::now();
        let mut lap = laps(held_at);
        let suspended =
            self.bus.suspend().map_err(|e| Failure::Refused(format!("a device could not stop for the fork: {e}")))?;
        let devices_ms = lap();
        let precopied = self.vm.set_dirty_logging(true).map_err(|e| e.to_string()).and_then(|()| {
            // The caller copies the disk (in its own process) while guest memory is copied here.
            send_paused(stream, held_at);
            let copied = snapshot::memory::write_to(&self.vm.memory, self.memory_size, memory_file);
            await_resume(stream)?;
            copied.map_err(|e| e.to_string())
        });
        let precopy_ms = lap();
        let bytes = match precopied {
            Ok(bytes) => bytes,
            Err(e) => {
                let _ = self.vm.set_dirty_logging(false);
                self.bus
                    .resume()
                    .map_err(|r| Failure::Broken(format!("{e}; and a device did not start again: {r}")))?;
                return Err(Failure::Refused(format!("the fork's memory copy failed: {e}")));
            }
        };
        let paused_at = std::time::Instant::now();
        let vcpus = self.pause_vcpus()?;
        let vcpus_ms = lap();
        let captured = self
            .vm
            .take_dirty_pages()
            .map_err(|e| e.to_string())
            .and_then(|pages| {
                snapshot::memory::rewrite_pages(&self.vm.memory, self.memory_size, memory_file, &pages)
                    .map_err(|e| e.to_string())
            })
            .and_then(|rewritten| VmState::capture(&self.vm.fd).map(|vm| (vm, rewritten)).map_err(|e| e.to_string()));
        let logging_off = self.vm.set_dirty_logging(false);
        let serial = Some(self.bus.serial_state());
        let devices = self.bus.transport_states(suspended);
        let dirty_ms = lap();
        self.bus.resume().map_err(|e| Failure::Broken(format!("a device did not start again after the fork: {e}")))?;
        self.run_vcpus();
        let paused = paused_at.elapsed().as_millis().max(1) as u64;
        let devices_held = held_at.elapsed().as_millis() as u64;
        logging_off.map_err(|e| Failure::Broken(format!("KVM's dirty-page log did not stop: {e}")))?;
        let (vm, _rewritten) = captured.map_err(|e| Failure::Refused(format!("the fork's capture failed: {e}")))?;
        // Durable now that the guest runs again.
        memory_file.sync_all().map_err(|e| Failure::Refused(format!("sync the memory file: {e}")))?;
        let vmm = env!("CARGO_PKG_VERSION").into();
        let state = SnapshotState { vmm, memory_size: self.memory_size, vm, vcpus, devices, serial };
        snapshot::file::write_to(&state, state_file).map_err(|e| Failure::Refused(e.to_string()))?;
        let phases_ms = Phases {
            vcpus: vcpus_ms,
            devices: devices_ms,
            memory: precopy_ms + dirty_ms,
            state: lap(),
            paused,
            devices_held,
        };
        Ok(SnapshotTaken { memory_bytes: bytes, phases_ms })
    }
}

/// Tells the caller the fork's devices are stopped: it copies what must match (the disk).
fn send_paused(stream: &UnixStream, since: std::time::Instant) {
    send(stream, &ControlReply::Paused(umbra_contract::control::ForkPaused { ms: since.elapsed().as_millis() as u64 }));
}

/// Waits for the caller's `resume` (its copy is done), at most [`RESUME_PATIENCE`].
fn await_resume(stream: &UnixStream) -> Result<(), String> {
    match read_request(stream, RESUME_PATIENCE) {
        Ok((ControlRequest::Resume {}, _)) => Ok(()),
        Ok((other, _)) => Err(format!("the caller sent {other:?} where a resume was due")),
        Err(e) => Err(format!("no resume from the caller: {e}")),
    }
}

/// Milliseconds since `from`, then since the previous call.
fn laps(from: std::time::Instant) -> impl FnMut() -> u64 {
    let mut at = from;
    move || {
        let ms = at.elapsed().as_millis() as u64;
        at = std::time::Instant::now();
        ms
    }
}

impl Drop for Copier {
    /// A fork that failed after its copier started still reaps it (once it has written).
    fn drop(&mut self) {
        if self.pid > 0 {
            let _ = self.reap();
        }
    }
}

/// A child process writing the memory file from its copy-on-write view of guest memory as it
/// was when it was forked; it reports the bytes written (or why it failed) on a pipe.
struct Copier {
    pid: libc::pid_t,
    report: File,
}

impl Copier {
    fn start(memory: &crate::vstate::memory::GuestMemory, size: u64, file: &File) -> Result<Copier, String> {
        let mut fds = [-1; 2];
        // SAFETY: pipe2 writes two descriptors into the array it is given.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(format!("a pipe for the memory copier: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: both descriptors are new and owned here from now on.
        let (report, mut child_end) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
        // SAFETY: fork() in a threaded process: the child runs only this thread. glibc's fork
        // resets the allocator's locks in the child, so it may allocate; it touches guest memory
        // (its own copy-on-write view), the memory file and the pipe, and leaves with _exit,
        // running no destructor and no other thread's code. It keeps this thread's seccomp
        // filter.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(format!("fork the memory copier: {}", std::io::Error::last_os_error()));
        }
        if pid == 0 {
            use std::os::fd::AsRawFd;
            // The child holds nothing but what it writes: a host peer whose guest connection
            // closes meanwhile sees its end at once, not when the copy is done. It dies with
            // the VMM.
            close_all_but(&[file.as_raw_fd(), child_end.as_raw_fd()]);
            // SAFETY: prctl(PR_SET_PDEATHSIG) takes a signal number and no pointers.
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
            let copied = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                snapshot::memory::dump_to(memory, size, file)
            }));
            let (code, report) = match copied {
                Ok(Ok(bytes)) => (0, [b"o".as_slice(), &bytes.to_le_bytes()].concat()),
                Ok(Err(e)) => (1, format!("e{e}").into_bytes()),
                Err(_) => (1, b"ethe copy panicked".to_vec()),
            };
            let _ = child_end.write_all(&report);
            // SAFETY: ends the child at once, as fork's child must.
            unsafe { libc::_exit(code) };
        }
        drop(child_end);
        Ok(Copier { pid, report })
    }

    /// Waits for the copy; returns the bytes of memory written.
    fn wait(mut self) -> Result<u64, String> {
        let result = self.reap();
        self.pid = 0;
        result
    }

    fn reap(&mut self) -> Result<u64, String> {
        use std::io::Read;
        let mut report = Vec::new();
        let read = (&mut self.report).take(4096).read_to_end(&mut report);
        let mut status = 0;
        loop {
            // SAFETY: waits for our own child; `status` is written by the call.
            let waited = unsafe { libc::waitpid(self.pid, &mut status, 0) };
            if waited == self.pid {
                break;
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(format!("waiting for the memory copier: {e}"));
            }
        }
        if libc::WIFSIGNALED(status) {
            return Err(format!("the memory copier was killed by signal {}", libc::WTERMSIG(status)));
        }
        read.map_err(|e| format!("the memory copier's report: {e}"))?;
        match report.split_first() {
            Some((b'o', bytes)) if bytes.len() == 8 => Ok(u64::from_le_bytes(bytes.try_into().expect("eight bytes"))),
            Some((b'e', why)) => Err(format!("writing the memory file: {}", String::from_utf8_lossy(why))),
            _ => Err(format!("the memory copier ended with status {status} and no report")),
        }
    }
}

/// Closes every descriptor above stderr except `keep` (in a forked child).
fn close_all_but(keep: &[std::os::fd::RawFd]) {
    let mut keep: Vec<u32> = keep.iter().map(|&fd| fd as u32).collect();
    keep.sort_unstable();
    let mut from = 3u32;
    for fd in keep.into_iter().chain(std::iter::once(u32::MAX)) {
        if fd > from {
            // SAFETY: close_range closes descriptors by number; none of them is used after
            // (the caller keeps the ones it uses).
            unsafe { libc::syscall(libc::SYS_close_range, from, fd - 1, 0) };
        }
        from = fd.saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestAddress};

    #[test]
    fn the_copier_writes_memory_as_it_was_when_forked_while_the_guest_writes_on() {
        let size = 8u64 << 20;
        let memory = crate::vstate::memory::anonymous(size as usize).unwrap();
        memory.write_slice(&[0xaa; 4096], GuestAddress(0x1000)).unwrap();
        memory.write_slice(&[0xbb; 4096], GuestAddress(size - 4096)).unwrap();
        let dir = std::env::temp_dir().join(format!("umbra-copier-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("memory");
        let file = File::options().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        let copier = Copier::start(&memory, size, &file).unwrap();
        // The running guest: its writes after the fork are not the fork's.
        memory.write_slice(&[0xcc; 4096], GuestAddress(0x1000)).unwrap();
        memory.write_slice(&[0xdd; 4096], GuestAddress(0x3000)).unwrap();
        assert_eq!(copier.wait().unwrap(), 2 * 4096, "two pages of data, the rest holes");
        let written = std::fs::read(&path).unwrap();
        assert_eq!(written.len() as u64, size);
        assert!(written[0x1000..0x2000].iter().all(|&b| b == 0xaa));
        assert!(written[0x3000..0x4000].iter().all(|&b| b == 0));
        assert!(written[size as usize - 4096..].iter().all(|&b| b == 0xbb));

        // A copier that fails says why (a file opened read-only cannot be written).
        let read_only = File::open(&path).unwrap();
        let e = Copier::start(&memory, size, &read_only).unwrap().wait().unwrap_err();
        assert!(e.contains("writing the memory file"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
