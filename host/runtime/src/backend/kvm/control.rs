//! umbra-vmm's control socket (umbra_vmm::control): where the runtime asks a running VMM for
//! a snapshot, handing over the files to write.

use std::path::{Path, PathBuf};

use umbra_contract::control::{ControlReply, ControlRequest};

use crate::backend::rundir::VSOCK_DIR;

/// How long a snapshot request may wait for umbra-vmm's answer (it pauses the guest, asks
/// virtiofsd for its state and writes the memory file: seconds, tens under nested emulation).
const SNAPSHOT_ANSWER: std::time::Duration = std::time::Duration::from_secs(300);

/// The control socket of the umbra-vmm whose run directory is `run`: in the VM's vsock
/// directory, because a jailed VMM sees nothing else.
pub fn control_socket(run: &Path) -> PathBuf {
    run.join(VSOCK_DIR).join("control.sock")
}

/// Asks the umbra-vmm whose control socket is `control` for a snapshot (umbra_vmm::control):
/// hands over `state` and `memory`, empty files open for writing, and returns the memory bytes
/// written and where the pause went (umbra-vmm's phases). The VM then ends with status 6.
pub fn request_snapshot(
    control: &Path,
    state: &std::fs::File,
    memory: &std::fs::File,
) -> Result<(u64, String), ControlError> {
    let stream = send_request(control, &ControlRequest::Snapshot {}, state, memory)?;
    match read_reply(&stream)? {
        ControlReply::Ok(taken) => Ok((taken.memory_bytes, taken.phases_ms.to_string())),
        ControlReply::Error(e) => Err(ControlError::Refused(e)),
        ControlReply::Paused(_) => Err(ControlError::Refused("a paused answer to a snapshot".into())),
    }
}

/// A live fork (umbra_vmm::control): like [`request_snapshot`], but the VM runs on. While its
/// guest is paused, `during_pause` copies what must match the fork point (the session disk);
/// the guest runs again when it returns, and the files are complete when this returns: the
/// memory bytes written, where the time went (the pause first) and the pause.
pub fn request_fork(
    control: &Path,
    state: &std::fs::File,
    memory: &std::fs::File,
    during_pause: impl FnOnce() -> Result<(), String>,
) -> Result<(u64, String, std::time::Duration), ControlError> {
    use std::io::Write;
    let stream = send_request(control, &ControlRequest::Fork {}, state, memory)?;
    let mut reader = std::io::BufReader::new(&stream);
    match read_reply_from(&mut reader)? {
        ControlReply::Paused(_) => {}
        ControlReply::Error(e) => return Err(ControlError::Refused(e)),
        ControlReply::Ok(_) => return Err(ControlError::Refused("a fork answered before its pause".into())),
    }
    // Whatever the copy did, the guest must run again: resume is sent either way.
    let copied = during_pause();
    let line = serde_json::to_string(&ControlRequest::Resume {}).expect("a request serialises") + "\n";
    (&stream).write_all(line.as_bytes()).map_err(ControlError::Send)?;
    let taken = match read_reply_from(&mut reader)? {
        ControlReply::Ok(taken) => taken,
        ControlReply::Error(e) => return Err(ControlError::Refused(e)),
        ControlReply::Paused(_) => return Err(ControlError::Refused("a second paused answer".into())),
    };
    copied.map_err(|e| ControlError::Refused(format!("the copy during the pause failed: {e}")))?;
    let paused = std::time::Duration::from_millis(taken.phases_ms.paused);
    Ok((taken.memory_bytes, taken.phases_ms.to_string(), paused))
}

fn read_reply(stream: &std::os::unix::net::UnixStream) -> Result<ControlReply, ControlError> {
    read_reply_from(&mut std::io::BufReader::new(stream))
}

fn read_reply_from(reader: &mut impl std::io::BufRead) -> Result<ControlReply, ControlError> {
    let mut reply = String::new();
    reader.read_line(&mut reply).map_err(ControlError::NoAnswer)?;
    serde_json::from_str::<ControlReply>(&reply).map_err(|source| ControlError::BadAnswer { reply, source })
}

/// Connects to `control` and sends `request` with the two files.
fn send_request(
    control: &Path,
    request: &ControlRequest,
    state: &std::fs::File,
    memory: &std::fs::File,
) -> Result<std::os::unix::net::UnixStream, ControlError> {
    use std::os::fd::AsRawFd;
    let stream = std::os::unix::net::UnixStream::connect(control)
        .map_err(|source| ControlError::Connect { socket: control.to_path_buf(), source })?;
    // A VMM that never answers must not hold the caller's thread for ever.
    stream.set_read_timeout(Some(SNAPSHOT_ANSWER)).map_err(ControlError::Send)?;
    let line = serde_json::to_string(request).expect("a request serialises") + "\n";
    let line = line.as_bytes();
    let fds = [state.as_raw_fd(), memory.as_raw_fd()];
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of_val(&fds) as u32) } as usize;
    let mut control_buf = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec { iov_base: line.as_ptr() as *mut libc::c_void, iov_len: line.len() };
    // SAFETY: a zeroed msghdr is valid; every pointer set below outlives the sendmsg call, the
    // control buffer is 8-byte aligned and CMSG_SPACE bytes long, and the one cmsghdr written
    // into it (by CMSG_FIRSTHDR/CMSG_DATA) carries exactly the two descriptors.
    let sent = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control_buf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(&fds) as u32) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(cmsg).cast::<i32>(), fds.len());
        libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
    };
    if sent != line.len() as isize {
        return Err(ControlError::Send(std::io::Error::last_os_error()));
    }
    Ok(stream)
}

/// Why a snapshot request through the control socket failed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("cannot connect to the VMM's control socket {}: {source}", socket.display())]
    Connect { socket: PathBuf, source: std::io::Error },
    #[error("cannot send the snapshot request: {0}")]
    Send(#[source] std::io::Error),
    #[error("no answer from the VMM's control socket: {0}")]
    NoAnswer(#[source] std::io::Error),
    #[error("the VMM refused the snapshot: {0}")]
    Refused(String),
    #[error("the VMM answered {reply:?}: {source}")]
    BadAnswer { reply: String, source: serde_json::Error },
}
