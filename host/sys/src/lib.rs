//! Linux facts shared by the host processes (runtime, umbra-vmm, umbra-fsd).

use std::path::Path;

#[cfg(target_os = "linux")]
pub mod pidns;

/// The flags of the mount holding `path` that the kernel locks when a user namespace gets a copy
/// of it (read-only, noexec, the atime mode), as `MS_*` flags: a remount of a bind of it there
/// must keep them, so a jail starts its remount flags from these. Only a system call: safe
/// between fork and exec.
#[cfg(target_os = "linux")]
pub fn locked_mount_flags(path: &std::ffi::CStr) -> std::io::Result<libc::c_ulong> {
    // SAFETY: statvfs fills the struct it is given from a NUL-terminated path.
    let st = unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(path.as_ptr(), &mut st) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        st
    };
    let mut flags = 0;
    for (st_flag, ms_flag) in [
        (libc::ST_RDONLY, libc::MS_RDONLY),
        (libc::ST_NOEXEC, libc::MS_NOEXEC),
        (libc::ST_NOATIME, libc::MS_NOATIME),
        (libc::ST_NODIRATIME, libc::MS_NODIRATIME),
        (libc::ST_RELATIME, libc::MS_RELATIME),
    ] {
        if st.f_flag & st_flag != 0 {
            flags |= ms_flag;
        }
    }
    Ok(flags)
}

/// Whether the Unix socket at `path` is listening, from /proc/net/unix.
///
/// The socket file appears at bind(), before listen(): a client connecting in between is
/// refused, and QEMU or umbra-vmm connect to a vhost-user socket exactly once. Probing by
/// connecting is not an option either: virtiofsd and vhost-device-vsock serve one frontend
/// and would take the probe for it.
pub fn unix_socket_listening(path: &Path) -> bool {
    std::fs::read_to_string("/proc/net/unix").is_ok_and(|table| table_lists_listening(&table, path))
}

/// [`unix_socket_listening`] in the network namespace of process `pid` (the table lists only
/// its own namespace's sockets, and a jailed helper has a namespace of its own).
pub fn unix_socket_listening_in(pid: u32, path: &Path) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/net/unix")).is_ok_and(|table| table_lists_listening(&table, path))
}

/// Raises this process's open-file soft limit to its hard limit. Each guest connection costs
/// the host a socket or two (umbra-vmm's vsock device holds up to ~1100, the egress proxy two
/// per connection), and the usual soft limit is 1024; children inherit the raised limit.
pub fn raise_nofile_limit() {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit read and write the rlimit struct we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// The `Flags` column holds `__SO_ACCEPTCON` once the socket listens.
fn table_lists_listening(table: &str, path: &Path) -> bool {
    const SO_ACCEPTCON: u32 = 1 << 16;
    let path = path.to_string_lossy();
    table.lines().skip(1).any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        fields.len() >= 8
            && fields[7] == path
            && u32::from_str_radix(fields[3], 16).is_ok_and(|flags| flags & SO_ACCEPTCON != 0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    #[test]
    fn parses_the_flags_column() {
        let table = "Num       RefCount Protocol Flags    Type St Inode Path\n\
                     0000000000000000: 00000002 00000000 00010000 0001 01 123 /run/a.sock\n\
                     0000000000000000: 00000002 00000000 00000000 0001 01 124 /run/b.sock\n";
        assert!(table_lists_listening(table, Path::new("/run/a.sock")));
        assert!(!table_lists_listening(table, Path::new("/run/b.sock")), "bound, not listening");
        assert!(!table_lists_listening(table, Path::new("/run/c.sock")));
        assert!(!table_lists_listening("", Path::new("/run/a.sock")));
    }

    #[test]
    fn a_real_listener_is_seen_and_a_removed_one_is_not() {
        let dir = std::env::temp_dir().join(format!("umbra-sys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("l.sock");
        let listener = UnixListener::bind(&path).unwrap();
        assert!(unix_socket_listening(&path));
        drop(listener);
        std::fs::remove_file(&path).unwrap();
        assert!(!unix_socket_listening(&path));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// What a shared folder is, whatever its path: its device and inode when it was first shared.
/// The runtime records it with the session; umbra-fsd opens the folder without following links
/// and refuses to serve anything else under that path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FolderIdentity {
    pub dev: u64,
    pub ino: u64,
}
