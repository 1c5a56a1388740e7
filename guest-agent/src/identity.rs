//! A new identity for a guest restored from a snapshot: every VM restored from one snapshot
//! starts with the same kernel RNG state, the same clock and the same hostname. The host gives
//! each its own: entropy credited to the kernel's pool with an immediate CRNG reseed (so
//! `/dev/urandom`, `getrandom` and `/proc/sys/kernel/random/uuid` diverge at once, not at the
//! next periodic reseed), the wall clock, a hostname, and a fresh `/etc/machine-id` where the
//! image has one.

use umbra_proto::{ErrorBody, ErrorCode, ReidentifyRequest};

/// Bounds on the entropy attachment: enough to reseed, small enough to be cheap.
const ENTROPY: std::ops::RangeInclusive<usize> = 32..=512;

fn io(what: &str, e: impl std::fmt::Display) -> ErrorBody {
    ErrorBody::new(ErrorCode::Io, format!("{what}: {e}"))
}

/// Checks `req` and `entropy` without changing anything.
pub fn validate(req: &ReidentifyRequest, entropy: &[u8]) -> Result<(), ErrorBody> {
    let h = &req.hostname;
    let valid = (1..=64).contains(&h.len())
        && h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        && !h.starts_with(['-', '.']);
    if !valid {
        return Err(ErrorBody::new(
            ErrorCode::BadRequest,
            format!(
                "hostname {:?}: 1–64 letters, digits, '-' and '.', not starting with '-' or '.'",
                crate::text::shown(h)
            ),
        ));
    }
    if !ENTROPY.contains(&entropy.len()) {
        return Err(ErrorBody::new(
            ErrorCode::BadRequest,
            format!("{} bytes of entropy; send {} to {}", entropy.len(), ENTROPY.start(), ENTROPY.end()),
        ));
    }
    Ok(())
}

/// Applies `req` to the machine. Only PID 1 (the guest's agent) may: an agent running as an
/// ordinary process on a host must never change that host's clock or name.
pub fn reidentify(req: &ReidentifyRequest, entropy: &[u8], pid1: bool) -> Result<(), ErrorBody> {
    validate(req, entropy)?;
    if !pid1 {
        return Err(ErrorBody::new(
            ErrorCode::Unsupported,
            "reidentify changes the machine's clock and name: only the guest's PID-1 agent does it",
        ));
    }
    reseed(entropy)?;
    // The file first: the step most likely to fail (a read-only root) fails before the clock
    // and the name have changed.
    let machine_id = std::path::Path::new("/etc/machine-id");
    if machine_id.exists() {
        let mut id = [0u8; 16];
        getrandom(&mut id)?;
        let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
        std::fs::write(machine_id, format!("{hex}\n")).map_err(|e| io("write /etc/machine-id", e))?;
    }
    let secs = (req.unix_time_ms / 1000) as i64;
    let nanos = ((req.unix_time_ms % 1000) * 1_000_000) as i64;
    let now = nix::sys::time::TimeSpec::new(secs, nanos);
    nix::time::clock_settime(nix::time::ClockId::CLOCK_REALTIME, now).map_err(|e| io("set the clock", e))?;
    nix::unistd::sethostname(&req.hostname).map_err(|e| io("set the hostname", e))?;
    Ok(())
}

/// RNDADDENTROPY (`_IOW('R', 0x03, int[2])`) then RNDRESEEDCRNG (`_IO('R', 0x07)`), on
/// /dev/urandom; both need CAP_SYS_ADMIN, which PID 1 has.
fn reseed(entropy: &[u8]) -> Result<(), ErrorBody> {
    use std::os::fd::AsRawFd;
    const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
    const RNDRESEEDCRNG: libc::c_ulong = 0x5207;
    let urandom = std::fs::File::options().write(true).open("/dev/urandom").map_err(|e| io("open /dev/urandom", e))?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }, as u32 words so
    // the ints are aligned.
    let mut info = vec![0u32; 2 + entropy.len().div_ceil(4)];
    info[0] = (entropy.len() * 8) as u32;
    info[1] = entropy.len() as u32;
    for (word, chunk) in info[2..].iter_mut().zip(entropy.chunks(4)) {
        let mut b = [0u8; 4];
        b[..chunk.len()].copy_from_slice(chunk);
        *word = u32::from_ne_bytes(b);
    }
    // SAFETY: `info` is a rand_pool_info whose buf_size bytes follow its header in the same
    // allocation; the kernel reads only those.
    if unsafe { libc::ioctl(urandom.as_raw_fd(), RNDADDENTROPY as _, info.as_ptr()) } < 0 {
        return Err(io("credit the host's entropy (RNDADDENTROPY)", std::io::Error::last_os_error()));
    }
    // SAFETY: RNDRESEEDCRNG takes no argument.
    if unsafe { libc::ioctl(urandom.as_raw_fd(), RNDRESEEDCRNG as _) } < 0 {
        return Err(io("reseed the CRNG (RNDRESEEDCRNG)", std::io::Error::last_os_error()));
    }
    Ok(())
}

fn getrandom(buf: &mut [u8]) -> Result<(), ErrorBody> {
    // SAFETY: getrandom writes at most buf.len() bytes into buf.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n != buf.len() as isize {
        return Err(io("getrandom", std::io::Error::last_os_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(hostname: &str) -> ReidentifyRequest {
        ReidentifyRequest { hostname: hostname.into(), unix_time_ms: 1_900_000_000_000 }
    }

    #[test]
    fn hostnames_and_entropy_are_checked_first() {
        let e = [7u8; 64];
        validate(&req("fork-1.umbra"), &e).unwrap();
        for bad in ["", "-x", ".x", "a b", "a/b", &"x".repeat(65), "\u{e9}"] {
            let err = validate(&req(bad), &e).unwrap_err();
            assert_eq!(err.code, ErrorCode::BadRequest, "{bad:?}");
        }
        assert!(validate(&req("a"), &[0; 31]).unwrap_err().message.contains("31 bytes of entropy"));
        assert!(validate(&req("a"), &[0; 513]).is_err());
    }

    #[test]
    fn an_agent_that_is_not_pid_1_changes_nothing() {
        let before = nix::unistd::gethostname().unwrap();
        let err = reidentify(&req("not-this-host"), &[1; 64], false).unwrap_err();
        assert_eq!(err.code, ErrorCode::Unsupported);
        assert_eq!(nix::unistd::gethostname().unwrap(), before);
    }
}
