//! A process's stdio on containerd's FIFOs: output written as the agent sends it (the agent's
//! credit holds a process that writes faster than its reader drains), input read on a thread
//! of its own (opening a FIFO blocks until its writer comes, which may be never).

use std::io::Read;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::unix::pipe;

use umbra_api::EventKind;
use umbra_runtime::session::{Exec, ExecControl};

/// containerd's FIFO paths for one process (empty: not wanted).
#[derive(Debug, Clone, Default)]
pub struct Stdio {
    pub stdin: String,
    pub stdout: String,
    pub stderr: String,
    pub terminal: bool,
}

/// Opens a FIFO for writing without waiting for its reader (read-write, as containerd's own
/// shims do: `ctr run -d` gives FIFOs that nobody may ever read); `None` when there is none.
fn writer(path: &str) -> Option<pipe::Sender> {
    if path.is_empty() {
        return None;
    }
    match pipe::OpenOptions::new().read_write(true).open_sender(path) {
        Ok(f) => Some(f),
        Err(e) => {
            tracing::warn!("opening {path}: {e}");
            None
        }
    }
}

/// Feeds the stdin FIFO to the process until its writer closes it.
fn feed_stdin(path: String, control: ExecControl) {
    let handle = tokio::runtime::Handle::current();
    std::thread::spawn(move || {
        let Ok(mut fifo) = std::fs::File::open(&path) else { return };
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match fifo.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if handle.block_on(control.write_stdin(buf[..n].to_vec())).is_err() {
                        return;
                    }
                }
            }
        }
        let _ = handle.block_on(control.close_stdin());
    });
}

/// Streams the process's output to its FIFOs until it exits; returns its exit status as
/// containerd reports it (the code, or 128 + the signal; 255 when its VM went away).
pub async fn pump(mut exec: Exec, stdio: &Stdio) -> u32 {
    if !stdio.stdin.is_empty() {
        feed_stdin(stdio.stdin.clone(), exec.control());
    }
    let (mut out, mut err) = (writer(&stdio.stdout), writer(&stdio.stderr));
    while let Some(event) = exec.next_event().await {
        match event.kind {
            EventKind::Stdout { data, .. } => write(&mut out, &data).await,
            EventKind::Stderr { data, .. } => write(&mut err, &data).await,
            EventKind::Exit(exit) => {
                if exit.lost {
                    tracing::warn!("process {} was lost: {}", exit.process, exit.reason.unwrap_or_default());
                    return 255;
                }
                // The guest's numbers, bounded: a code is 0..=255, a signal 1..=127.
                return match (exit.code, exit.signal) {
                    (Some(c), _) => c.clamp(0, 255) as u32,
                    (None, Some(s)) => 128 + s.clamp(0, 127) as u32,
                    (None, None) => 255,
                };
            }
            _ => {}
        }
    }
    255
}

/// How long output waits for a FIFO's reader to make room before that stream is given up:
/// the process's exit comes after its output, so a FIFO nobody reads must not hold it back.
const STALLED_READER: Duration = Duration::from_secs(10);

async fn write(file: &mut Option<pipe::Sender>, data: &umbra_api::Data) {
    if let (Some(f), Ok(bytes)) = (file.as_mut(), data.to_bytes()) {
        match tokio::time::timeout(STALLED_READER, f.write_all(&bytes)).await {
            Ok(Ok(())) => {}
            // A reader that went away (ctr detached) loses the output, not the process.
            Ok(Err(_)) | Err(_) => {
                tracing::warn!(
                    "a stdio FIFO took no output for {STALLED_READER:?}: the rest of this stream is dropped"
                );
                *file = None;
            }
        }
    }
}
