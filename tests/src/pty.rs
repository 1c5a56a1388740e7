//! Driving a program on a pseudo-terminal as a person at a terminal would: Python's `pty`
//! forks it, and each time its output shows the next step's text, that step's keys are typed.

use std::path::Path;

const DRIVER: &str = r#"
import json, os, pty, select, sys, time
pid, fd = pty.fork()
if pid == 0:
    os.execv(sys.argv[1], sys.argv[1:])
steps = json.loads(os.environ["PTY_STEPS"])
out, start = b'', time.time()
while time.time() - start < 60:
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
_, status = os.waitpid(pid, 0)
sys.stdout.write(out.decode(errors='replace'))
sys.exit(os.waitstatus_to_exitcode(status))
"#;

/// Runs `program args` on a pseudo-terminal with `env` added, typing each step's keys once its
/// text has shown (at most 60 s in all); what the terminal showed (without `\r`) followed by
/// the driver's own errors, and the program's exit status.
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
        .output()
        .await
        .expect("python3 runs");
    let shown = String::from_utf8_lossy(&out.stdout).replace('\r', "") + &String::from_utf8_lossy(&out.stderr);
    (shown, out.status.code().unwrap_or(-1))
}
