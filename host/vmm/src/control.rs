//! The control socket: requests to a running VMM, one per connection, one JSON line each way
//! (`umbra_contract::control`: `{"snapshot":{}}` with two descriptors attached (SCM_RIGHTS),
//! the state file then the memory file, both open for writing and empty; `{"ok":{…}}` or
//! `{"error":"why"}` back).
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

/// Bounds a request line; far above any real one.
const MAX_REQUEST: usize = 4096;
/// How long a client may take to send its request, and the vCPUs to pause.
const PATIENCE: Duration = Duration::from_secs(5);

use umbra_contract::control::{ControlReply, ControlRequest, Phases, SnapshotTaken};

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
        let Ok(mut stream) = stream else { continue };
        let reply = match read_request(&stream) {
            Err(e) => Err(Failure::Refused(e)),
            Ok((ControlRequest::Snapshot {}, files)) => match <[File; 2]>::try_from(files) {
                Ok([state, memory]) => snapshotter.take(&state, &memory),
                Err(files) => Err(Failure::Refused(format!(
                    "a snapshot request carries two files (state, memory), this one {}",
                    files.len()
                ))),
            },
        };
        let (answer, exit) = match reply {
            Ok(taken) => (ControlReply::Ok(taken), Some(VmExit::Snapshotted)),
            Err(Failure::Refused(e)) => (ControlReply::Error(e), None),
            Err(Failure::Broken(e)) => {
                let why = format!("snapshot failed after the VM was paused: {e}");
                (ControlReply::Error(why.clone()), Some(VmExit::Internal(why)))
            }
        };
        let line = serde_json::to_string(&answer).unwrap_or_else(|_| r#"{"error":"unprintable reply"}"#.into());
        let _ = writeln!(stream, "{line}");
        if let Some(exit) = exit {
            let _ = exits.send(exit);
            return;
        }
    }
}

/// One request line and the descriptors that came with it (at most two are kept; more close).
fn read_request(stream: &UnixStream) -> Result<(ControlRequest, Vec<File>), String> {
    use vmm_sys_util::sock_ctrl_msg::ScmSocket;
    stream.set_read_timeout(Some(PATIENCE)).map_err(|e| format!("control socket: {e}"))?;
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
        let mut at = std::time::Instant::now();
        let mut lap = || {
            let ms = at.elapsed().as_millis() as u64;
            at = std::time::Instant::now();
            ms
        };
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
        let phases_ms = Phases { vcpus: vcpus_ms, devices: devices_ms, memory: memory_ms, state: lap() };
        Ok(SnapshotTaken { memory_bytes, phases_ms })
    }
}
