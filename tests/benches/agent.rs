//! Agent benchmarks over a Unix socket, each beside an anchor measured in the same run:
//!   exec round-trip (spawn `true` → exit event)  vs  native fork/exec/wait of `true`, rounds
//!                                                   alternating
//!   stdout throughput through the agent           vs  the same producer into a plain pipe
//!   an exec under the exec gate (approval scope guest), allowlisted in the agent and asked of
//!   the host (answered at once)                    vs  the same loop with no gate
//!
//! Run with `scripts/bench` (builds the release agent first). Prints medians and ratios.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use umbra_proto::SpawnRequest;
use umbra_runtime::agent::ProcessEvent;
use umbra_tests::HostAgent;

const EXEC_ROUNDS: usize = 200;
const THROUGHPUT_BYTES: u64 = 512 << 20;
const THROUGHPUT_ROUNDS: usize = 5;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn producer() -> Vec<String> {
    vec!["head".into(), "-c".into(), THROUGHPUT_BYTES.to_string(), "/dev/zero".into()]
}

fn mib_per_s(d: Duration) -> f64 {
    (THROUGHPUT_BYTES as f64 / (1 << 20) as f64) / d.as_secs_f64()
}

fn main() {
    // `cargo bench` passes --bench; ignore arguments.
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let agent = HostAgent::start().await;
        let client = agent.connect().await;

        // Rounds alternate native and agent, so a load that comes and goes on a shared
        // machine weighs on both sides alike.
        let mut native = Vec::with_capacity(EXEC_ROUNDS);
        let mut via_agent = Vec::with_capacity(EXEC_ROUNDS);
        for _ in 0..EXEC_ROUNDS {
            let t = Instant::now();
            assert!(Command::new("true").status().unwrap().success());
            native.push(t.elapsed());

            let t = Instant::now();
            let out = client
                .spawn(SpawnRequest { argv: vec!["true".into()], ..Default::default() })
                .unwrap()
                .output()
                .await
                .unwrap();
            assert_eq!(out.status.code, Some(0));
            via_agent.push(t.elapsed());
        }
        let (n, a) = (median(native), median(via_agent));
        println!(
            "exec round-trip   agent {:>9.1?}   native fork/exec {:>9.1?}   ratio {:.2}x",
            a,
            n,
            a.as_secs_f64() / n.as_secs_f64()
        );

        let mut pipe = Vec::new();
        let mut through = Vec::new();
        for _ in 0..THROUGHPUT_ROUNDS {
            let t = Instant::now();
            let mut child = Command::new("head").args(&producer()[1..]).stdout(Stdio::piped()).spawn().unwrap();
            let mut out = child.stdout.take().unwrap();
            let mut buf = vec![0u8; 64 * 1024];
            let mut total = 0u64;
            loop {
                let n = out.read(&mut buf).unwrap();
                if n == 0 {
                    break;
                }
                total += n as u64;
            }
            child.wait().unwrap();
            assert_eq!(total, THROUGHPUT_BYTES);
            pipe.push(t.elapsed());

            let t = Instant::now();
            let mut p = client.spawn(SpawnRequest { argv: producer(), ..Default::default() }).unwrap();
            let mut total = 0u64;
            while let Some(ev) = p.next_event().await {
                match ev {
                    ProcessEvent::Stdout(b) => total += b.len() as u64,
                    ProcessEvent::Exit(_) => break,
                    _ => {}
                }
            }
            assert_eq!(total, THROUGHPUT_BYTES);
            through.push(t.elapsed());
        }
        let (p, a) = (median(pipe), median(through));
        println!(
            "stdout throughput agent {:>7.0} MiB/s   plain pipe {:>7.0} MiB/s   ratio {:.2}",
            mib_per_s(a),
            mib_per_s(p),
            mib_per_s(a) / mib_per_s(p)
        );

        exec_gate(&client).await;
    });
}

const GATED_EXECS: usize = 500;
const GATE_ROUNDS: usize = 5;

/// A shell running `/bin/true` GATED_EXECS times: with no gate, with the gate letting `true`
/// through in the agent, and with every `true` asked of the host (this bench answers at once).
/// Rounds interleave the three; medians per exec.
async fn exec_gate(client: &umbra_runtime::agent::AgentClient) {
    let mut checks = client.exec_checks().expect("the checks are this bench's");
    let answerer = client.clone();
    tokio::spawn(async move {
        while let Some(check) = checks.recv().await {
            answerer.exec_answer(check.check, true).await.unwrap();
        }
    });
    let script = format!("i=0; while [ $i -lt {GATED_EXECS} ]; do /bin/true; i=$((i+1)); done");
    let run = |gate: Option<umbra_proto::ExecGate>| {
        let spawn = SpawnRequest {
            argv: vec!["sh".into(), "-c".into(), script.clone()],
            exec_gate: gate,
            ..Default::default()
        };
        async move {
            let t = Instant::now();
            let out = client.spawn(spawn).unwrap().output().await.unwrap();
            assert_eq!(out.status.code, Some(0));
            t.elapsed() / GATED_EXECS as u32
        }
    };
    let listed = umbra_proto::ExecGate { allow: vec!["true".into()], deny: vec![] };
    let asked = umbra_proto::ExecGate::default();
    let (mut off, mut local, mut host) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..GATE_ROUNDS {
        off.push(run(None).await);
        local.push(run(Some(listed.clone())).await);
        host.push(run(Some(asked.clone())).await);
    }
    let (off, local, host) = (median(off), median(local), median(host));
    let more = |d: Duration| d.saturating_sub(off);
    println!(
        "exec under the gate  off {:>7.1?}   allowlisted {:>7.1?} (+{:.1?}, {:.2}x)   asked of the host {:>7.1?} (+{:.1?}, {:.2}x)   per exec",
        off,
        local,
        more(local),
        local.as_secs_f64() / off.as_secs_f64(),
        host,
        more(host),
        host.as_secs_f64() / off.as_secs_f64()
    );
}
