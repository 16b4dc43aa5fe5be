//! Groups that span hosts: shared memory within each host, TCP between.
//!
//! When a group's members are on several hosts and some host has two or
//! more of them (see `plan`), all_reduce, broadcast and barrier run
//! in two levels over two kinds of internal groups, formed from the group
//! without any message (their ids derive from the group's):
//!
//! - `local`: the members on this host (over shared memory);
//! - `leaders`: each host's first member (over TCP).
//!
//! | op | steps |
//! |---|---|
//! | all_reduce | reduce to the host's leader (local); all_reduce among leaders; broadcast from the leader (local) |
//! | broadcast | on the root's host, broadcast from the root (local); among leaders from the root's host's; on the other hosts, from the leader (local) |
//! | barrier | barrier (local); barrier among leaders; barrier (local) |
//!
//! Why these: the bytes that cross hosts are one buffer per host, not one per
//! rank, and every step within a host is a single pass over shared memory.
//! The other collectives (gathers, scatters, all-to-all, whose bytes mostly
//! cross hosts anyway) run over TCP among all members, as do point-to-point
//! messages.
//!
//! **One op, one failure.** An internal step is not an op of its own to the
//! user: it takes the group op's deadline and call (so the members of an
//! internal group compare the group's call, and a mismatch names the group's
//! ranks and op number), and a failing step does not abort its internal
//! group by itself. It fails the group's op, whose abort (recorded and told
//! as for any op) aborts this rank's internal groups from the step the
//! failed op began ([`ChildLink`]). So a rank blocked in a step on another
//! host learns of the failure from the group's abort, and every error names
//! group ranks: a step's error is lifted (ranks mapped, the group's op
//! named), or replaced by the group's abort when there is one (a step that
//! found a rank gone that exited on being told is not blamed on it).
//!
//! Steps take their turn in the group's op order, so `*_async` ops run their
//! steps in order. Their internal op numbers follow from the group op's
//! (two per op within a host, one among hosts: see [`ChildLink`]), so that a
//! rank that called a flat op where the others called a two-level one never
//! runs a later op's step as theirs.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::element::{Element, ReduceOp};
use crate::error::{Error, Result};
use crate::flat;
use crate::hash::stable_hash;
use crate::op::{Comm, OpCtx};
use crate::shm::{self, Arena};
use crate::transport::{ChildLink, Members};

/// How long a rank whose step failed because an internal group was aborted
/// waits for the group's abort (the cause) to arrive.
const CAUSE_WAIT: Duration = Duration::from_secs(2);

/// One internal group: its state here, its members' group ranks (in its own
/// rank order), its link to the group's aborts, and its shared memory.
struct Level {
    comm: Arc<Comm>,
    ranks: Vec<usize>,
    link: Arc<ChildLink>,
    /// For messages: "step within this host" or "step among hosts".
    what: &'static str,
    /// What a point in the step is: a shared-memory "stage" or a TCP "step".
    unit: &'static str,
    /// The process ids of the members, on this host's level (whose steps
    /// run over shared memory); `None` on the leaders' (over TCP).
    pids: Option<Arc<[u32]>>,
    /// The level's region, attached at its first step.
    arena: tokio::sync::OnceCell<Option<Arc<Arena>>>,
}

/// A group's two levels, as this rank sees them.
pub(crate) struct TwoLevel {
    /// Each host's members (group ranks), hosts ordered by first member.
    hosts: Vec<Vec<usize>>,
    /// This rank's host.
    host: usize,
    /// The members on this host, when there are two or more.
    local: Option<Level>,
    /// The leaders, on a leader.
    leaders: Option<Level>,
}

impl TwoLevel {
    /// Forms the internal groups of `cx`'s group (no messages: ids derive
    /// from the group's); `local_pids`: the process ids of this host's
    /// members.
    pub(crate) fn new(cx: &OpCtx, hosts: Vec<Vec<usize>>, local_pids: Arc<[u32]>) -> TwoLevel {
        let me = cx.me();
        let host = hosts
            .iter()
            .position(|h| h.contains(&me))
            .expect("this rank is on a host");
        // `width`: the internal ops each op of the group owns (see
        // `ChildLink`): two stages within a host, one step among hosts.
        let level = |tag: u64, ranks: Vec<usize>, what: &'static str, width: u64| -> Level {
            let id = stable_hash(&[cx.comm_id(), 0x7477_6f6c_6576_656c, tag]) | 1;
            let members = Members {
                name: format!("{}/{what}", cx.group_name()),
                ranks: ranks.iter().map(|&k| cx.world(k)).collect(),
            };
            let rank = ranks.iter().position(|&k| k == me).expect("a member");
            let comm = cx.comm().internal(id, members, rank);
            let link = Arc::new(ChildLink::new(id, cx.comm_id(), width));
            cx.sh().add_child(cx.comm_id(), link.clone());
            let on_host = what == "host";
            Level {
                comm,
                ranks,
                link,
                what: if on_host {
                    "step within this host"
                } else {
                    "step among hosts"
                },
                unit: if on_host { "stage" } else { "step" },
                pids: on_host.then(|| local_pids.clone()),
                arena: tokio::sync::OnceCell::new(),
            }
        };
        let mine = &hosts[host];
        let local = (mine.len() >= 2).then(|| level(host as u64, mine.clone(), "host", 2));
        let leaders = (mine[0] == me).then(|| {
            let ranks: Vec<usize> = hosts.iter().map(|h| h[0]).collect();
            level(u64::MAX, ranks, "leaders", 1)
        });
        TwoLevel {
            hosts,
            host,
            local,
            leaders,
        }
    }

    pub(crate) fn hosts(&self) -> usize {
        self.hosts.len()
    }

    /// Waits for the op's turn; returns the first internal op it owns on
    /// each level (`local` on this host's group, `leaders` on the leaders'),
    /// 0 on a level this rank is not in. An op the group's abort fails has
    /// no steps (the abort did not reach them, which had not begun).
    async fn steps(&self, cx: &OpCtx) -> Result<(u64, u64)> {
        cx.wait_note(
            "the group's earlier ops to end (two-level ops take their steps in order)".into(),
            None,
        );
        cx.turn().wait(cx.seq()).await;
        // A link refuses only once the group's abort (which fails this op)
        // is in place.
        let aborted = || {
            cx.sh()
                .aborted_for(cx.comm_id(), Some(cx.seq()))
                .unwrap_or_else(|| Error::Aborted {
                    group: cx.group_name(),
                    reason: "the group was aborted".into(),
                    by: None,
                })
        };
        let mut firsts = [0u64; 2];
        for (f, l) in firsts.iter_mut().zip([&self.local, &self.leaders]) {
            if let Some(l) = l {
                *f = l.link.steps_of(cx.seq()).ok_or_else(aborted)?;
            }
        }
        Ok((firsts[0], firsts[1]))
    }
}

/// Ends step `sub` of level `l` with its result, lifted to the group's
/// terms when it failed.
async fn ended<R>(cx: &OpCtx, l: &Level, sub: OpCtx, r: Result<R>) -> Result<R> {
    match r {
        Ok(v) => {
            sub.step_done();
            Ok(v)
        }
        Err(e) => {
            let waiting = sub.waiting_rank();
            sub.step_failed();
            // Should the op's deadline pass while the cause is looked for,
            // its timeout names whom the step waited for.
            if let Some((k, at)) = waiting {
                let g = l.ranks.get(k).copied().unwrap_or(k);
                cx.wait_note(l.waiting_for(g, at), Some((g, at)));
            }
            Err(lift(cx, l, e, waiting).await)
        }
    }
}

impl Level {
    /// Step `seq` of this level, with the group op's call and deadline.
    fn step(&self, cx: &OpCtx, seq: u64) -> OpCtx {
        cx.wait_note(format!("the {}", self.what), None);
        let s = self
            .comm
            .step_ctx(seq, cx.desc(), cx.deadline, cx.timeout());
        if cx.may_post() {
            // SAFETY: a step runs within its op's future, on the op's
            // buffer, so it is dropped when the op's is: never leaked.
            unsafe { s.allow_posting() }
        } else {
            s
        }
    }

    /// The level's shared memory for step `s`: the host's members attach
    /// it at their first step; the leaders' level (and a step failed as it
    /// began, which runs over TCP) has none.
    async fn arena(&self, s: &OpCtx) -> Result<Option<Arc<Arena>>> {
        match &self.pids {
            Some(pids) if !s.is_doomed() => self
                .arena
                .get_or_try_init(|| shm::attach(s, pids.clone()))
                .await
                .cloned(),
            _ => Ok(None),
        }
    }

    /// "rank g (in the step among hosts, at step 2)": group rank `g`.
    fn waiting_for(&self, g: usize, at: u32) -> String {
        format!("rank {g} (in the {}, at {} {at})", self.what, self.unit)
    }
}

/// Runs a step's body within the op's deadline: a step that times out ends
/// as a step, before the op's own deadline could drop it part-way (which
/// would abort the internal group as if the step had been cancelled).
async fn within<R>(s: &OpCtx, body: impl std::future::Future<Output = Result<R>>) -> Result<R> {
    match tokio::time::timeout_at(s.deadline, body).await {
        Ok(r) => r,
        Err(_) => Err(s.timed_out()),
    }
}

/// A step's error in the group's terms: the group's abort when there is
/// one (the cause), else the same error with the group's ranks, name and
/// op.
async fn lift(cx: &OpCtx, l: &Level, e: Error, waiting: Option<(usize, u32)>) -> Error {
    let g = |k: usize| l.ranks.get(k).copied().unwrap_or(k);
    if let Error::Timeout { .. } = e {
        // The op's deadline has passed: no waiting for causes.
        if let Some(e) = cx.sh().aborted_for(cx.comm_id(), Some(cx.seq())) {
            return e;
        }
        return Error::Timeout {
            group: cx.group_name(),
            op: cx.op_name(),
            timeout: cx.timeout(),
            waiting_for: match waiting {
                Some((k, at)) => l.waiting_for(g(k), at),
                None => format!("the {} to start", l.what),
            },
        };
    }
    let until = (Instant::now() + CAUSE_WAIT).min(cx.deadline);
    loop {
        // The abort that fails this op, told, or recorded in the store.
        if let Some(e) = cx.sh().aborted_for(cx.comm_id(), Some(cx.seq())) {
            return e;
        }
        if let Some(e) = cx.known_abort().await {
            return e;
        }
        // An internal group aborted: by this rank's group abort, which
        // brings its cause; wait a little for it.
        if !e.is_aborted() || Instant::now() >= until {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let group = cx.group_name();
    match e {
        Error::PeerGone { rank, reason, .. } => Error::PeerGone {
            group,
            op: cx.op_name(),
            rank: g(rank),
            reason,
        },
        Error::ConnectionLost { rank, reason, .. } => Error::ConnectionLost {
            group,
            op: cx.op_name(),
            rank: g(rank),
            reason,
        },
        Error::Mismatch {
            rank_a,
            desc_a,
            rank_b,
            desc_b,
            ..
        } => Error::Mismatch {
            group,
            seq: cx.seq(),
            rank_a: g(rank_a),
            desc_a,
            rank_b: g(rank_b),
            desc_b,
        },
        Error::Protocol { rank, reason, .. } => Error::Protocol {
            group,
            rank: g(rank),
            reason,
        },
        Error::Aborted { reason, by, .. } => Error::Aborted {
            group,
            reason,
            by: by.map(g),
        },
        e => e,
    }
}

/// The reduce op every step runs (a mean is a sum, divided at the end).
fn summing(op: ReduceOp) -> ReduceOp {
    if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    }
}

pub(crate) async fn all_reduce<T: Element>(
    t: &TwoLevel,
    cx: &OpCtx,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let (ls, ds) = t.steps(cx).await?;
    let sop = summing(op);
    if let Some(l) = &t.local {
        let s = l.step(cx, ls);
        let r = within(&s, async {
            flat::reduce(&s, l.arena(&s).await?.as_ref(), buf, 0, sop).await
        })
        .await;
        ended(cx, l, s, r).await?;
    }
    if let Some(l) = &t.leaders {
        let s = l.step(cx, ds);
        let r = within(&s, async {
            flat::all_reduce(&s, l.arena(&s).await?.as_ref(), buf, sop).await
        })
        .await;
        ended(cx, l, s, r).await?;
        if op == ReduceOp::Avg {
            T::divide(buf, cx.n());
        }
    }
    if let Some(l) = &t.local {
        let s = l.step(cx, ls + 1);
        let r = within(&s, async {
            flat::broadcast(&s, l.arena(&s).await?.as_ref(), buf, 0).await
        })
        .await;
        ended(cx, l, s, r).await?;
    }
    Ok(())
}

pub(crate) async fn broadcast<T: Element>(
    t: &TwoLevel,
    cx: &OpCtx,
    buf: &mut [T],
    root: usize,
) -> Result<()> {
    let (ls, ds) = t.steps(cx).await?;
    let root_host = t
        .hosts
        .iter()
        .position(|h| h.contains(&root))
        .expect("the root is on a host");
    let on_root_host = t.host == root_host;
    if let (true, Some(l)) = (on_root_host, &t.local) {
        let from = l.ranks.iter().position(|&k| k == root).expect("a member");
        let s = l.step(cx, ls);
        let r = within(&s, async {
            flat::broadcast(&s, l.arena(&s).await?.as_ref(), buf, from).await
        })
        .await;
        ended(cx, l, s, r).await?;
    }
    if let Some(l) = &t.leaders {
        let s = l.step(cx, ds);
        let r = within(&s, async {
            flat::broadcast(&s, l.arena(&s).await?.as_ref(), buf, root_host).await
        })
        .await;
        ended(cx, l, s, r).await?;
    }
    if let (false, Some(l)) = (on_root_host, &t.local) {
        let s = l.step(cx, ls);
        let r = within(&s, async {
            flat::broadcast(&s, l.arena(&s).await?.as_ref(), buf, 0).await
        })
        .await;
        ended(cx, l, s, r).await?;
    }
    Ok(())
}

pub(crate) async fn barrier(t: &TwoLevel, cx: &OpCtx) -> Result<()> {
    let (ls, ds) = t.steps(cx).await?;
    if let Some(l) = &t.local {
        let s = l.step(cx, ls);
        let r = within(&s, async {
            flat::barrier(&s, l.arena(&s).await?.as_ref()).await
        })
        .await;
        ended(cx, l, s, r).await?;
    }
    if let Some(l) = &t.leaders {
        let s = l.step(cx, ds);
        let r = within(&s, async {
            flat::barrier(&s, l.arena(&s).await?.as_ref()).await
        })
        .await;
        ended(cx, l, s, r).await?;
    }
    if let Some(l) = &t.local {
        let s = l.step(cx, ls + 1);
        let r = within(&s, async {
            flat::barrier(&s, l.arena(&s).await?.as_ref()).await
        })
        .await;
        ended(cx, l, s, r).await?;
    }
    Ok(())
}
