//! Guest-wide requests: stats, mounts, shutdown.

use std::fs;
use std::path::Path;

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use umbra_proto::{ErrorBody, ErrorCode, MountRequest, Stats};

use crate::text::shown;

pub fn stats(agent_processes: u32, uptime_ms: u64) -> Stats {
    let meminfo = fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| -> u64 {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    let loadavg = fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut load = [0u32; 3];
    for (slot, v) in load.iter_mut().zip(loadavg.split_whitespace()) {
        *slot = (v.parse::<f64>().unwrap_or(0.0) * 100.0).round() as u32;
    }
    let processes = fs::read_dir("/proc")
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter(|e| e.file_name().to_str().is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit())))
                .count() as u32
        })
        .unwrap_or(0);
    Stats {
        mem_total_kib: field("MemTotal"),
        mem_available_kib: field("MemAvailable"),
        load_x100: load,
        processes,
        agent_processes,
        uptime_ms,
    }
}

pub fn mount_fs(req: &MountRequest) -> Result<(), ErrorBody> {
    let target = Path::new(&req.target);
    if !target.is_absolute() {
        return Err(ErrorBody::new(
            ErrorCode::BadRequest,
            format!("mount target {} is not absolute", shown(&req.target)),
        ));
    }
    fs::create_dir_all(target).map_err(|e| crate::files::io_error("cannot create mount point", &req.target, e))?;
    if req.bind {
        let source = Path::new(&req.source);
        if !source.is_absolute() {
            return Err(ErrorBody::new(
                ErrorCode::BadRequest,
                format!("bind source {} is not absolute", shown(&req.source)),
            ));
        }
        return crate::shares::bind(source, target, req.read_only).map_err(|e| {
            ErrorBody::new(ErrorCode::Io, format!("cannot bind {} on {}: {e}", shown(&req.source), shown(&req.target)))
        });
    }
    let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    if req.read_only {
        flags |= MsFlags::MS_RDONLY;
    }
    mount(Some(req.source.as_str()), target, Some(req.fs_type.as_str()), flags, None::<&str>).map_err(|e| {
        let (fs_type, source, target) = (shown(&req.fs_type), shown(&req.source), shown(&req.target));
        ErrorBody::new(ErrorCode::Io, format!("cannot mount {fs_type} {source} on {target}: {e}"))
    })
}

pub fn unmount(path: &str) -> Result<(), ErrorBody> {
    if !Path::new(path).is_absolute() {
        return Err(ErrorBody::new(ErrorCode::BadRequest, format!("unmount path {} is not absolute", shown(path))));
    }
    umount2(path, MntFlags::empty())
        .map_err(|e| ErrorBody::new(ErrorCode::Io, format!("cannot unmount {}: {e}", shown(path))))
}

/// Lifts the open-file limit. The kernel starts PID 1 with 1024 (soft) / 4096 (hard), which a
/// busy guest exhausts quickly: the agent holds three pipe ends per process and a socket per
/// connection. Children inherit the raised limit; 2^16 keeps it modest for programs that loop
/// over every possible fd.
pub fn raise_fd_limit() {
    const WANTED: libc::rlim_t = 1 << 16;
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one `struct rlimit` through a pointer valid for the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return;
    }
    // As root (PID 1) the hard limit may be raised too; failing that, soft = hard.
    let wanted = libc::rlimit { rlim_cur: WANTED.max(lim.rlim_max), rlim_max: WANTED.max(lim.rlim_max) };
    let fallback = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
    // SAFETY: setrlimit reads one `struct rlimit` through a pointer valid for the call.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &wanted) } != 0 {
        // SAFETY: as above.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &fallback) };
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn unmount_wants_an_absolute_path() {
        assert_eq!(super::unmount("relative/mnt").unwrap_err().code, umbra_proto::ErrorCode::BadRequest);
    }

    #[test]
    fn stats_read_real_proc() {
        let s = super::stats(0, 1);
        assert!(s.mem_total_kib > 0 && s.mem_available_kib <= s.mem_total_kib);
        assert!(s.processes >= 1);
    }
}
