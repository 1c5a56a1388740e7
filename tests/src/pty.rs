//! Driving a program on a pseudo-terminal as a person at a terminal would: Python's `pty`
//! forks it, and each time its output shows the next step's text, that step's keys are typed.

use std::path::Path;

const DRIVER: &str = r#"
import json, os, pty, select, signal, sys, time
pid, fd = pty.fork()
if pid == 0:
    os.execv(sys.argv[1], sys.argv[1:])
steps = json.loads(os.environ["PTY_STEPS"])
limit = float(os.environ["PTY_LIMIT_SECS"])
out, deadline = b'', time.time() + limit
while time.time() < deadline:
    if steps and steps[0][0].encode() in out:
        os.write(fd, steps.pop(0)[1].encode())
    if fd in select.select([fd], [], [], 1)[0]:
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
# The program closed its terminal or the time is up: it gets until the deadline to exit, then
# it is killed, so a program waiting for keys that never come fails the test, never hangs it.
status = None
while status is None and time.time() < deadline:
    done, st = os.waitpid(pid, os.WNOHANG)
    if done:
        status = os.waitstatus_to_exitcode(st)
    else:
        time.sleep(0.05)
sys.stdout.write(out.decode(errors='replace'))
if status is None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    waiting = repr(steps[0][0]) if steps else 'its exit'
    sys.stderr.write(f"\npty driver: killed after {limit:.0f} s, still waiting for {waiting}\n")
    sys.exit(124)
sys.exit(status)
"#;

/// How long a program on a terminal gets for all its steps and its exit: ample on a loaded
/// 2-core machine booting guests under QEMU's emulation.
pub const LIMIT: std::time::Duration = std::time::Duration::from_secs(120);

/// Runs `program args` on a pseudo-terminal with `env` added, typing each step's keys once its
/// text has shown; what the terminal showed (without `\r`) followed by the driver's own errors,
/// and the program's exit status. A program still running after [`LIMIT`] is killed: status 124,
/// and the output names the step whose text never showed.
pub async fn on_a_terminal(
    program: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    steps: &[(&str, &str)],
) -> (String, i32) {
    let out = tokio::process::Command::new("python3")
        .args(["-c", DRIVER])
        .arg(program)
        .args(args)
        .envs(env.iter().copied())
        .env("PTY_STEPS", serde_json::to_string(steps).expect("steps serialize"))
        .env("PTY_LIMIT_SECS", LIMIT.as_secs().to_string())
        .kill_on_drop(true)
        .output()
        .await
        .expect("python3 runs");
    let shown = String::from_utf8_lossy(&out.stdout).replace('\r', "") + &String::from_utf8_lossy(&out.stderr);
    (shown, out.status.code().unwrap_or(-1))
}
