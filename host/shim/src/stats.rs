//! `ctr task metrics` / the CRI's stats: cgroup figures read from the guest (its cgroup v2
//! `umbra-commands` group, which holds every process the agent starts: the pod's containers),
//! in the `io.containerd.cgroups.v1.Metrics` message containerd 1.6 decodes. The guest's bytes
//! are untrusted: read bounded, parsed leniently (a malformed figure is a zero).

use containerd_shim::protos::cgroups::metrics::{
    CPUStat, CPUUsage, MemoryEntry, MemoryOomControl, MemoryStat, Metrics, PidsStat,
};
use containerd_shim::protos::protobuf::well_known_types::any::Any;
use containerd_shim::protos::protobuf::Message;
use umbra_runtime::session::Session;

/// The agent's commands cgroup in the guest; each container has its own beneath it.
pub const CGROUP: &str = "/sys/fs/cgroup/umbra-commands";
/// How long a stats request waits for the guest: a guest that does not answer must not hold
/// containerd's metrics walk (which asks task after task).
const DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);
const METRICS_TYPE: &str = "io.containerd.cgroups.v1.Metrics";

/// The value of `key` in a flat-keyed cgroup file (`cpu.stat`, `memory.stat`, `memory.events`).
fn keyed(text: &str, key: &str) -> u64 {
    text.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok()).unwrap_or(0)
}

/// A single-value cgroup file; `max` (no limit) is `u64::MAX`.
fn single(text: &str) -> u64 {
    match text.trim() {
        "max" => u64::MAX,
        t => t.parse().unwrap_or(0),
    }
}

/// The metrics from the files' texts (empty when a file could not be read).
pub fn metrics(files: &Files) -> Metrics {
    let usage_usec = keyed(&files.cpu_stat, "usage_usec");
    let cpu = CPUStat {
        usage: Some(CPUUsage {
            total: usage_usec.saturating_mul(1000),
            user: keyed(&files.cpu_stat, "user_usec").saturating_mul(1000),
            kernel: keyed(&files.cpu_stat, "system_usec").saturating_mul(1000),
            ..Default::default()
        })
        .into(),
        ..Default::default()
    };
    let memory = MemoryStat {
        cache: keyed(&files.memory_stat, "file"),
        rss: keyed(&files.memory_stat, "anon"),
        mapped_file: keyed(&files.memory_stat, "file_mapped"),
        pg_fault: keyed(&files.memory_stat, "pgfault"),
        pg_maj_fault: keyed(&files.memory_stat, "pgmajfault"),
        usage: Some(MemoryEntry {
            usage: single(&files.memory_current),
            limit: single(&files.memory_max),
            failcnt: keyed(&files.memory_events, "max"),
            ..Default::default()
        })
        .into(),
        ..Default::default()
    };
    Metrics {
        pids: Some(PidsStat {
            current: single(&files.pids_current),
            limit: single(&files.pids_max),
            ..Default::default()
        })
        .into(),
        cpu: Some(cpu).into(),
        memory: Some(memory).into(),
        memory_oom_control: Some(MemoryOomControl {
            oom_kill: keyed(&files.memory_events, "oom_kill"),
            ..Default::default()
        })
        .into(),
        ..Default::default()
    }
}

/// The cgroup files [`metrics`] reads.
#[derive(Default)]
pub struct Files {
    pub cpu_stat: String,
    pub memory_stat: String,
    pub memory_current: String,
    pub memory_max: String,
    pub memory_events: String,
    pub pids_current: String,
    pub pids_max: String,
}

async fn read(session: &Session, name: &str) -> String {
    match session.read_file(&format!("{CGROUP}/{name}"), false, 0, 64 * 1024).await {
        Ok((bytes, _)) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(_) => String::new(),
    }
}

/// The guest's OOM kill count so far; `None` when it cannot be read.
pub async fn oom_kills(session: &Session) -> Option<u64> {
    let path = format!("{CGROUP}/memory.events");
    let read = session.read_file(&path, false, 0, 4096);
    let text = tokio::time::timeout(DEADLINE, read).await.ok()?.ok()?.0;
    Some(keyed(&String::from_utf8_lossy(&text), "oom_kill"))
}

/// The pod VM's figures, packed for `StatsResponse`: the files read at once, within
/// [`DEADLINE`] (a file the guest did not give in time counts as empty).
pub async fn of(session: &Session) -> Result<Any, String> {
    let all = async {
        let (cpu_stat, memory_stat, memory_current, memory_max, memory_events, pids_current, pids_max) = tokio::join!(
            read(session, "cpu.stat"),
            read(session, "memory.stat"),
            read(session, "memory.current"),
            read(session, "memory.max"),
            read(session, "memory.events"),
            read(session, "pids.current"),
            read(session, "pids.max"),
        );
        Files { cpu_stat, memory_stat, memory_current, memory_max, memory_events, pids_current, pids_max }
    };
    let files = tokio::time::timeout(DEADLINE, all)
        .await
        .map_err(|_| format!("the guest gave no figures within {DEADLINE:?}"))?;
    let value = metrics(&files).write_to_bytes().map_err(|e| e.to_string())?;
    Ok(Any { type_url: METRICS_TYPE.into(), value, ..Default::default() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_v2_files_become_v1_metrics() {
        let files = Files {
            cpu_stat: "usage_usec 1500\nuser_usec 1000\nsystem_usec 500\n".into(),
            memory_stat: "anon 4096\nfile 8192\nfile_mapped 100\npgfault 7\n".into(),
            memory_current: "12288\n".into(),
            memory_max: "max\n".into(),
            memory_events: "low 0\nhigh 0\nmax 2\noom 1\noom_kill 1\n".into(),
            pids_current: "3\n".into(),
            pids_max: "garbage".into(),
        };
        let m = metrics(&files);
        assert_eq!(m.cpu.usage.total, 1_500_000);
        assert_eq!((m.cpu.usage.user, m.cpu.usage.kernel), (1_000_000, 500_000));
        assert_eq!((m.memory.rss, m.memory.cache, m.memory.pg_fault), (4096, 8192, 7));
        assert_eq!((m.memory.usage.usage, m.memory.usage.limit, m.memory.usage.failcnt), (12288, u64::MAX, 2));
        assert_eq!(m.memory_oom_control.oom_kill, 1);
        assert_eq!((m.pids.current, m.pids.limit), (3, 0));
        // A key only prefixed by another is not it.
        assert_eq!(keyed("oom_kill_x 9\n", "oom_kill"), 0);
    }
}
