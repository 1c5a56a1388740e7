//! `wait_for_agent` against real Unix sockets: a stand-in hybrid vsock socket that records when
//! the runtime first knocks (and then hangs up, as a backend does when nothing listens in the
//! guest), and a stand-in guest that announces readiness — or never does.

use std::os::unix::net::UnixStream;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{wait_for_agent, Helpers};
use crate::backend::children::Supervised;
use crate::backend::console::ConsoleCopier;
use crate::backend::rundir::{self, new_vm_id, RunDir};
use crate::backend::VmError;

/// Starts a hybrid socket at the run directory's vsock socket that notes the time of the first connection and
/// closes every connection unanswered.
fn knock_recorder(run: &RunDir) -> Arc<Mutex<Option<Instant>>> {
    let first = Arc::new(Mutex::new(None));
    let listener = std::os::unix::net::UnixListener::bind(rundir::vsock_socket(run.path())).unwrap();
    let seen = first.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            seen.lock().unwrap().get_or_insert_with(Instant::now);
            // Read the CONNECT line, then hang up without an answer.
            let _ = std::io::BufRead::read_line(&mut std::io::BufReader::new(&conn), &mut String::new());
        }
    });
    first
}

async fn boot(announce_after: Option<Duration>, timeout: Duration) -> (Instant, Option<Instant>, VmError) {
    let run = RunDir::create(&new_vm_id()).unwrap();
    let first_knock = knock_recorder(&run);
    let ready_path = rundir::vsock_port_socket(run.path(), 1025);
    let ready = tokio::net::UnixListener::bind(&ready_path).unwrap();
    let mut sleep = Command::new("sleep");
    sleep.arg("60");
    let children = vec![Supervised::spawn("stand-in VMM", sleep).unwrap()];
    let vsock = rundir::vsock_socket(run.path());
    let mut helpers = Helpers { children, folders: None, guest: "stand-in VMM", describe_exit: |_| None, vsock };
    let copier = ConsoleCopier::start(std::io::empty(), run.join("console.log")).unwrap();
    let started = Instant::now();
    if let Some(after) = announce_after {
        std::thread::spawn(move || {
            std::thread::sleep(after);
            let _ = UnixStream::connect(ready_path);
        });
    }
    let err = wait_for_agent(&run, ready, &mut helpers, &copier, timeout).await.err().expect("no agent here");
    let knock = *first_knock.lock().unwrap();
    (started, knock, err)
}

#[tokio::test]
async fn the_runtime_knocks_only_after_the_agent_announced_itself() {
    let (started, knock, err) = boot(Some(Duration::from_millis(400)), Duration::from_secs(2)).await;
    let knock = knock.expect("the runtime connected after the announcement");
    assert!(knock - started >= Duration::from_millis(400), "knocked {:?} after launch", knock - started);
    match err {
        VmError::BootTimeout { last_error, .. } => {
            assert!(last_error.contains("closed without a reply"), "{last_error}")
        }
        other => panic!("expected a boot timeout, got {other}"),
    }
}

#[tokio::test]
async fn an_agent_that_never_announces_is_polled_after_half_the_timeout() {
    let (started, knock, _) = boot(None, Duration::from_secs(2)).await;
    let knock = knock.expect("the runtime fell back to polling");
    assert!(knock - started >= Duration::from_secs(1), "knocked {:?} after launch", knock - started);
}

#[tokio::test]
async fn a_boot_timeout_names_the_helpers_and_what_they_did() {
    let (_, _, err) = boot(None, Duration::from_millis(300)).await;
    let text = err.to_string();
    assert!(
        text.contains("stand-in VMM (pid") && text.contains("running") && text.contains("console: 0 bytes"),
        "{text}"
    );
}
