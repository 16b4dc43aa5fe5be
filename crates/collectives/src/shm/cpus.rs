//! How many CPUs the ranks on this host can run on at once: the CPUs
//! online, fewer where the cgroup this process is in (as its container
//! sees it, at `/sys/fs/cgroup`) limits them by a CPU set or a quota.
//!
//! Not this process's affinity: a rank pinned to one CPU (as the
//! benchmark pins them) still has peers on the others. Read once.

use std::sync::OnceLock;

/// The CPUs the host gives this job's processes, or `None` if not even the
/// count online can be read.
pub(crate) fn host_cpus() -> Option<usize> {
    static CPUS: OnceLock<Option<usize>> = OnceLock::new();
    *CPUS.get_or_init(|| {
        // SAFETY: sysconf has no preconditions.
        let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
        let online = usize::try_from(online).ok().filter(|&n| n > 0)?;
        let read = |p: &str| std::fs::read_to_string(p).ok();
        let set = read("/sys/fs/cgroup/cpuset.cpus.effective").and_then(|s| cpu_list_len(&s));
        let quota = read("/sys/fs/cgroup/cpu.max")
            .and_then(|s| quota_cpus(&s))
            .or_else(|| {
                let q = read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")?;
                let p = read("/sys/fs/cgroup/cpu/cpu.cfs_period_us")?;
                quota_cpus(&format!("{} {}", q.trim(), p.trim()))
            });
        Some(
            [Some(online), set, quota]
                .into_iter()
                .flatten()
                .min()
                .unwrap_or(online),
        )
    })
}

/// CPUs in a list such as `0-3,8,10-11` (`None` if empty or not one).
fn cpu_list_len(s: &str) -> Option<usize> {
    let mut n = 0;
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        n += match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                b.checked_sub(a)? + 1
            }
            None => part.parse::<usize>().map(|_| 1).ok()?,
        };
    }
    (n > 0).then_some(n)
}

/// Whole CPUs a quota of `"<quota> <period>"` allows, rounded up (`None`
/// for `max`, `-1` or anything unreadable).
fn quota_cpus(s: &str) -> Option<usize> {
    let mut it = s.split_whitespace();
    let (q, p): (i64, i64) = (it.next()?.parse().ok()?, it.next()?.parse().ok()?);
    (q > 0 && p > 0).then(|| (q as u64).div_ceil(p as u64).max(1) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_and_quotas_read_as_the_kernel_writes_them() {
        assert_eq!(cpu_list_len("0-3\n"), Some(4));
        assert_eq!(cpu_list_len("0-1,4,6-7"), Some(5));
        assert_eq!(cpu_list_len("5"), Some(1));
        assert_eq!(cpu_list_len("\n"), None);
        assert_eq!(cpu_list_len("3-1"), None);
        assert_eq!(quota_cpus("max 100000\n"), None);
        assert_eq!(quota_cpus("200000 100000\n"), Some(2));
        assert_eq!(quota_cpus("150000 100000"), Some(2));
        assert_eq!(quota_cpus("50000 100000"), Some(1));
        assert_eq!(quota_cpus("-1 100000"), None);
    }

    #[test]
    fn this_host_has_at_least_one() {
        assert!(host_cpus().is_some_and(|n| n >= 1));
    }
}
