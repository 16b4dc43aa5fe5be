//! How a group runs its collectives: its plan, decided at its first.
//!
//! At set-up every rank of a world of two or more publishes
//! `host/<rank>` = "`<pid> <host>`" ([`host_entry`]), where `<host>` is this
//! host's identity (host name, boot id and PID namespace;
//! [`crate::Options::host_id`] or `RALLY_HOST_ID` overrides it) or
//! `off-<rank>` when [`crate::Options::shared_memory`] is off or this
//! process cannot share memory. At a group's first collective each member
//! reads its members' entries (a group of 2 to [`TWO_LEVEL_MAX_RANKS`]):
//!
//! - every member on one host (and at most [`shm::MAX_RANKS`]): the group
//!   runs its collectives over shared memory ([`Plan::Shm`]; the region is
//!   attached here);
//! - several hosts, some with two or more members: all_reduce, broadcast
//!   and barrier run in two levels ([`Plan::TwoLevel`], see `two_level`);
//! - else over TCP ([`Plan::Tcp`]).
//!
//! So in a world that spans hosts, a subgroup within one host (the usual
//! per-node group) still shares memory. Every member reads the same keys, so
//! every member decides the same. Point-to-point messages stay on TCP.
//!
//! The plan lives with the group's handle ([`PlanCell`]) and is handed down
//! to the ops (`dispatch`): nothing below this layer looks it up.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::op::OpCtx;
use crate::shm::{self, sys, Arena, MAX_RANKS, SLICE};
use crate::two_level::TwoLevel;

/// This host's identity: equal on two ranks exactly when they can share
/// memory. `None` when a part cannot be read (then this rank shares none).
fn host_key(host_id: Option<&str>) -> Option<String> {
    if let Some(id) = host_id {
        return Some(format!("id:{id}"));
    }
    if let Ok(id) = std::env::var("RALLY_HOST_ID") {
        return Some(format!("id:{id}"));
    }
    let read = |p: &str| Some(std::fs::read_to_string(p).ok()?.trim().to_owned());
    let pid_ns = std::fs::read_link("/proc/self/ns/pid").ok()?;
    let parts = [
        read("/proc/sys/kernel/hostname")?,
        read("/proc/sys/kernel/random/boot_id")?,
        pid_ns.display().to_string(),
    ];
    (!parts.iter().any(String::is_empty)).then(|| parts.join("/"))
}

/// What rank `rank` publishes at set-up (see the module docs).
pub(crate) fn host_entry(rank: usize, enabled: bool, host_id: Option<&str>) -> String {
    let host = enabled
        .then(sys::supported)
        .unwrap_or(false)
        .then(|| host_key(host_id))
        .flatten()
        .unwrap_or_else(|| format!("off-{rank}"));
    format!("{} {host}", std::process::id())
}

/// How a group runs its collectives, decided at its first.
#[derive(Clone)]
pub(crate) enum Plan {
    Tcp,
    /// Every member on this host.
    Shm(Arc<Arena>),
    /// Members on several hosts, some sharing one (see `two_level`).
    TwoLevel(Arc<TwoLevel>),
}

impl Plan {
    /// The group's region, for the ops that run flat.
    pub(crate) fn arena(&self) -> Option<&Arc<Arena>> {
        match self {
            Plan::Shm(a) => Some(a),
            _ => None,
        }
    }
}

/// The largest group that looks for a two-level plan (every member reads
/// every member's host entry once).
pub const TWO_LEVEL_MAX_RANKS: usize = 256;

/// What the members' host entries say: every member on one host (their
/// process ids, in group-rank order), several hosts (each host's members,
/// in group-rank order, hosts ordered by their first member), or nothing
/// to share (a member that shares nothing, or no host with two members).
enum Layout {
    OneHost(Arc<[u32]>),
    /// `local_pids`: the process ids of this rank's host's members.
    Hosts {
        hosts: Vec<Vec<usize>>,
        local_pids: Arc<[u32]>,
    },
    Apart,
}

/// Reads `cx`'s group's host entries and lays them out. Waits for the
/// members' entries, within the op's deadline.
async fn decide(cx: &OpCtx) -> Result<Layout> {
    let sh = cx.sh();
    let members: Vec<usize> = (0..cx.n()).map(|k| cx.world(k)).collect();
    let unread: Vec<usize> = {
        let hosts = sh.hosts.lock();
        members
            .iter()
            .copied()
            .filter(|r| !hosts.contains_key(r))
            .collect()
    };
    if !unread.is_empty() {
        read_hosts(cx, &unread).await?;
    }
    let hosts = sh.hosts.lock();
    let mut by_host: Vec<(&str, Vec<usize>)> = Vec::new();
    for (k, r) in members.iter().enumerate() {
        let host = hosts[r].1.as_str();
        if host.starts_with("off-") {
            return Ok(Layout::Apart);
        }
        match by_host.iter_mut().find(|(h, _)| *h == host) {
            Some((_, ks)) => ks.push(k),
            None => by_host.push((host, vec![k])),
        }
    }
    if by_host.len() == 1 {
        if members.len() > MAX_RANKS {
            return Ok(Layout::Apart);
        }
        let pids = members.iter().map(|r| hosts[r].0).collect();
        return Ok(Layout::OneHost(pids));
    }
    let shares = by_host.iter().any(|(_, ks)| ks.len() >= 2);
    let fits = by_host.iter().all(|(_, ks)| ks.len() <= MAX_RANKS);
    if !(shares && fits) {
        return Ok(Layout::Apart);
    }
    let by_host: Vec<Vec<usize>> = by_host.into_iter().map(|(_, ks)| ks).collect();
    let me = cx.me();
    let mine = by_host
        .iter()
        .find(|ks| ks.contains(&me))
        .expect("this rank is on a host");
    let local_pids = mine.iter().map(|&k| hosts[&members[k]].0).collect();
    Ok(Layout::Hosts {
        hosts: by_host,
        local_pids,
    })
}

/// Group ranks of world ranks `ranks`, for a message ("0, 2, 3"; the first
/// eight, then how many more).
fn group_ranks(cx: &OpCtx, ranks: &[usize]) -> String {
    let mut s: Vec<String> = ranks
        .iter()
        .take(8)
        .map(|r| cx.group_rank_of(*r).to_string())
        .collect();
    if ranks.len() > 8 {
        s.push(format!("and {} more", ranks.len() - 8));
    }
    s.join(", ")
}

/// Reads the `host/<rank>` entries of world ranks `ranks` into the
/// transport's cache, waiting for them within the op's deadline.
async fn read_hosts(cx: &OpCtx, ranks: &[usize]) -> Result<()> {
    let sh = cx.sh();
    let keys: Vec<String> = ranks.iter().map(|r| format!("host/{r}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let never = "which never published its address or host: it never formed the group (not started, or died during set-up)";
    // Who is missing is looked up once, in the last second before the op's
    // deadline, for its timeout message: it takes a look per key, and every
    // rank waiting here looking every second made O(n²) requests a second
    // (65k at 256 ranks) for a message that is seldom shown.
    let look_at = cx
        .deadline
        .checked_sub(Duration::from_secs(1))
        .unwrap_or(cx.deadline);
    let mut looked = false;
    for slice in 0u32.. {
        if sh.store().check(&refs).await.unwrap_or(false) {
            break;
        }
        if slice == 0 {
            cx.note_waiting(format!("some of ranks {}, {never}", group_ranks(cx, ranks)));
        }
        if !looked && Instant::now() >= look_at {
            looked = true;
            let mut missing = Vec::new();
            for (k, r) in refs.iter().zip(ranks) {
                if !sh.store().check(&[k]).await.unwrap_or(false) {
                    missing.push(cx.group_rank_of(*r).to_string());
                }
            }
            let who = match missing.len() {
                1 => format!("rank {}", missing[0]),
                _ => format!("ranks {}", missing.join(", ")),
            };
            cx.note_waiting(format!("{who}, {never}"));
        }
        if sh.is_dead() {
            return Err(cx.killed());
        }
        if let Some(e) = sh.aborted_for(cx.comm_id(), Some(cx.seq())) {
            return Err(e);
        }
        tokio::time::sleep(SLICE).await;
    }
    let vals = sh
        .store()
        .multi_get(&refs)
        .await
        .map_err(|e| Error::Setup {
            group: cx.group_name(),
            reason: format!("reading the ranks' hosts: {e}"),
        })?;
    let mut hosts = sh.hosts.lock();
    for (r, v) in ranks.iter().zip(vals) {
        let v = String::from_utf8_lossy(&v).into_owned();
        let (pid, host) = v.split_once(' ').unwrap_or(("", ""));
        hosts.insert(*r, (pid.parse().unwrap_or(0), host.to_owned()));
    }
    Ok(())
}

/// A group's plan, decided once, at its first collective.
pub(crate) type PlanCell = tokio::sync::OnceCell<Plan>;

/// How op `cx` runs: by its group's plan (`cell`), decided (and its region
/// attached) at the group's first collective; over TCP when it is a
/// message, or failed as it began.
pub(crate) async fn plan_for(cx: &OpCtx, cell: &PlanCell) -> Result<Plan> {
    if cx.is_p2p() || cx.is_doomed() {
        return Ok(Plan::Tcp);
    }
    if let Some(p) = cell.get() {
        return Ok(p.clone());
    }
    // Every op of the group decides the same; the first to get here decides.
    cell.get_or_try_init(|| async {
        if !(2..=TWO_LEVEL_MAX_RANKS).contains(&cx.n()) || !cx.opts().shared_memory {
            return Ok(Plan::Tcp);
        }
        Ok(match decide(cx).await? {
            Layout::OneHost(pids) => match shm::attach(cx, pids).await? {
                Some(a) => Plan::Shm(a),
                None => Plan::Tcp,
            },
            Layout::Hosts { hosts, local_pids } => {
                let t = TwoLevel::new(cx, hosts, local_pids);
                tracing::info!(
                    group = %cx.group_name(),
                    hosts = t.hosts(),
                    "the group spans hosts: all_reduce, broadcast and barrier run over shared memory within each host and TCP between"
                );
                Plan::TwoLevel(Arc::new(t))
            }
            Layout::Apart => Plan::Tcp,
        })
    })
    .await
    .cloned()
}
