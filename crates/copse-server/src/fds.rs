//! File descriptors: every client is one, so `maxclients` is only honest within the process's
//! RLIMIT_NOFILE. At start the soft limit is raised towards the hard limit, as far as
//! `maxclients` plus the server's own descriptors need, and `maxclients` is lowered to what
//! the limit leaves, with a log line saying so (Redis's `adjustOpenFilesLimit`). Otherwise a
//! server out of descriptors fails `accept` silently and new clients time out instead of
//! hearing "max number of clients reached".

use crate::config::{FDS_PER_NETWORK_THREAD, FDS_PER_SHARD_RESERVED, FDS_RESERVED_MIN};

/// Descriptors the server needs besides its clients: those open now (the store's files, the
/// listeners), a shard's slab files not created yet, the network threads' event loops, and a
/// margin for logs, the metrics endpoint and short-lived files.
pub fn reserved_fds(shards: usize, threads: usize) -> u64 {
    let open_now = std::fs::read_dir("/proc/self/fd").map_or(64, |entries| entries.count());
    (open_now
        + shards * FDS_PER_SHARD_RESERVED
        + threads * FDS_PER_NETWORK_THREAD
        + FDS_RESERVED_MIN) as u64
}

/// The soft and hard RLIMIT_NOFILE.
fn nofile_limits() -> std::io::Result<(u64, u64)> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct it is given and nothing else.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // rlim_t is u64 on 64-bit Linux but not on every target this may build for.
    #[allow(clippy::unnecessary_cast)]
    Ok((limit.rlim_cur as u64, limit.rlim_max as u64))
}

/// Raises the soft RLIMIT_NOFILE to `wanted` where the hard limit allows (never lowers it) and
/// returns the soft limit in force afterwards.
pub fn raise_fd_limit(wanted: u64) -> std::io::Result<u64> {
    let (soft, hard) = nofile_limits()?;
    if soft >= wanted {
        return Ok(soft);
    }
    let target = wanted.min(hard);
    let limit = libc::rlimit { rlim_cur: target as libc::rlim_t, rlim_max: hard as libc::rlim_t };
    // SAFETY: setrlimit reads the struct it is given; failure leaves the limits as they were.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
        let err = std::io::Error::last_os_error();
        tracing::warn!(%err, wanted, soft, hard, "cannot raise the open files limit");
        return Ok(soft);
    }
    Ok(target)
}

/// The clients `fd_limit` descriptors leave room for after `reserved` of the server's own.
pub fn clients_max_for(fd_limit: u64, reserved: u64) -> usize {
    usize::try_from(fd_limit.saturating_sub(reserved)).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_is_raised_within_the_hard_limit_and_never_lowered() {
        let (soft, hard) = nofile_limits().unwrap();
        assert_eq!(raise_fd_limit(1).unwrap(), soft, "never lowered");
        let raised = raise_fd_limit(hard.min(soft + 100)).unwrap();
        assert!(raised >= soft && raised <= hard, "{soft} -> {raised} (hard {hard})");
        assert_eq!(nofile_limits().unwrap().0, raised);
        assert!(raise_fd_limit(u64::MAX).unwrap() <= hard);
    }

    #[test]
    fn clients_get_what_the_reserve_leaves() {
        assert_eq!(clients_max_for(1024, 300), 724);
        assert_eq!(clients_max_for(100, 300), 0);
        assert!(reserved_fds(4, 2) >= (4 * FDS_PER_SHARD_RESERVED + FDS_RESERVED_MIN) as u64);
    }
}
