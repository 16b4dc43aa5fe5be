//! Shared memory for groups whose ranks are all on one host.
//!
//! Which groups run here is decided in `plan`: those whose members are
//! all on this host.
//!
//! **Attaching.** At a group's first collective its rank 0 creates an
//! anonymous memory file ([`sys`]) and publishes `shm/<group id>` =
//! "`<pid> <fd>`"; the others open it through `/proc/<pid>/fd/<fd>` and check
//! that its header carries this group's nonce (from the generation and the
//! group id), so another job or an earlier round can never attach. The file
//! has no name: a rank killed at any moment leaves nothing in `/dev/shm`.
//!
//! **Running.** Every rank has a slot of two halves in the region
//! ([`arena`]). An operation runs in rounds: each rank writes its part of the
//! round into its half, all meet at a stage, each reads what it needs from
//! every half, and the next round uses the other half. A rank writes into a
//! half again only two rounds later, after every rank has arrived at the
//! stage of the round between, which it does only after reading, so one
//! stage per round suffices (two for the split all-reduce). See [`ops`].
//!
//! **Waiting.** A rank spins briefly ([`SPIN`]; not when the host has
//! fewer CPUs than the region has ranks, see [`spin_for`]), yields for a while
//! ([`YIELD`]: the core to a peer that shares it, the worker to another
//! task), then sleeps on the futex of a rank that has not arrived, in
//! slices of [`SLICE`] on a blocking thread (the operation's task stays
//! free). Between slices it checks what ends the wait early: an abort (from
//! the region, where any local rank marks it, or from the router), and the
//! rank it waits for: dropped the group (marked in the region), died (its
//! pidfd is readable), or, before it ever mapped the region, unreachable
//! (a TCP probe is refused). So a dead rank is named within a slice.
//!
//! **Mismatches.** Before an operation's first stage each rank writes its
//! call into its control line; after that stage every rank compares every
//! call with its own. So every rank of a mismatched operation fails in that
//! operation, naming both calls, whatever the kinds.
//!
//! **Order.** Operations of a group use the region one at a time in the
//! order of their sequence numbers (`op::Turn`), so `*_async` operations
//! started together run one after another here as on every rank.

pub(crate) mod arena;
mod cpus;
pub(crate) mod ops;
pub(crate) mod sys;

use std::sync::Arc;
use std::time::Duration;

use rallypoint_sync::MutexExt;
use tokio::time::Instant;

pub(crate) use arena::{Arena, Presence};

use crate::element::Element;
use crate::error::{Error, Result};
use crate::frame::{Algo, Desc, Header, HIST_NONE};
use crate::hash::stable_hash;
use crate::op::OpCtx;
use crate::transport::HearsAborts;
use arena::AttachError;

/// The largest world that uses shared memory: every stage reads every rank's
/// word, so a flat region stops paying off well before a thousand ranks.
pub const MAX_RANKS: usize = 64;
/// How long a waiter spins on the stage words before it yields, when the
/// host has a CPU for every rank of the region (see [`spin_for`]).
pub const SPIN: Duration = Duration::from_micros(20);
/// How long it then yields (the core and its worker) before it sleeps.
pub const YIELD: Duration = Duration::from_millis(1);
/// A sleeper's longest nap between its checks.
pub const SLICE: Duration = Duration::from_millis(50);
/// How long a rank that found the region aborted waits for the reason.
const REASON_WAIT: Duration = Duration::from_secs(2);

/// How long a waiter in a region of `ranks` spins: [`SPIN`], or not at all
/// when the host gives the job fewer CPUs than the region has ranks
/// ([`cpus::host_cpus`]: online, less a cgroup's CPU set or quota). Then a
/// rank waited for is often one that shares the waiter's core, and it
/// cannot run while the waiter spins: at 4 ranks on 2 cores, not spinning
/// made a 64 MiB all-reduce about 10% faster and a barrier about 5 µs
/// instead of 25–50 (`docs/benchmarks.md`). Spins when the count is unknown.
fn spin_for(ranks: usize) -> Duration {
    if shares_cores(ranks) {
        Duration::ZERO
    } else {
        SPIN
    }
}

/// Whether a region of `ranks` has more ranks than the host gives the job
/// CPUs ([`cpus::host_cpus`]), so that ranks take turns on cores. `false`
/// when the count is unknown.
pub(crate) fn shares_cores(ranks: usize) -> bool {
    matches!(cpus::host_cpus(), Some(cpus) if ranks > cpus)
}

pub(crate) async fn attach(cx: &OpCtx, pids: Arc<[u32]>) -> Result<Option<Arc<Arena>>> {
    let (n, me, id) = (cx.n(), cx.me(), cx.comm_id());
    if n < 2 {
        return Ok(None);
    }
    let sh = cx.sh();
    let key = format!("shm/{id:016x}");
    let nonce = stable_hash(&[sh.cfg.nonce, id]);
    let setup = |reason: String| Error::Setup {
        group: cx.group_name(),
        reason,
    };
    let arena = if me == 0 {
        let round = |slot| ops::split_round_bytes(n, slot);
        let a = Arena::create(n, cx.opts().shm_slot_bytes, round, nonce)
            .map_err(|e| setup(format!("creating shared memory: {e}")))?;
        let v = format!("{} {}", std::process::id(), a.raw_fd());
        sh.store()
            .set(&key, v.as_bytes())
            .await
            .map_err(|e| setup(format!("publishing the shared memory: {e}")))?;
        a
    } else {
        cx.note_waiting("rank 0 to create the group's shared memory".into());
        let creator = pids.first().copied();
        // A store wait of a slice, not a sleep: the key is read the moment
        // rank 0 publishes it (a sleep cost a fresh group's first op up to
        // a slice, most of a torchft generation's set-up on one host), and
        // between slices rank 0's death still ends the wait. (A wait that
        // times out is cancelled on the store's side: CANCEL_WAIT.)
        while !sh.store().check(&[&key]).await.unwrap_or(false) {
            check_absent(cx, 0, creator)?;
            let t = std::time::Instant::now();
            if sh.store().wait_timeout(&[&key], SLICE).await.is_err() {
                // A store that fails at once must not make this a spin.
                tokio::time::sleep(SLICE.saturating_sub(t.elapsed())).await;
            }
        }
        let v = sh
            .store()
            .get_now(&key)
            .await
            .map_err(|e| setup(format!("reading {key}: {e}")))?;
        let v = String::from_utf8_lossy(&v).into_owned();
        let (pid, fd) = v
            .split_once(' ')
            .and_then(|(p, f)| Some((p.parse().ok()?, f.parse().ok()?)))
            .ok_or_else(|| setup(format!("bad {key} {v:?} in the store")))?;
        match Arena::attach(pid, fd, n, me, nonce) {
            Ok(a) => a,
            Err(e) => return Err(attach_failed(cx, pid, e).await),
        }
    };
    for k in 0..n {
        if let Some(&p) = pids.get(k) {
            arena.watch_pid(p);
        }
    }
    let arena = Arc::new(arena);
    sh.add_hearer(id, &arena);
    tracing::info!(
        group = %cx.group_name(),
        ranks = n,
        slot_kib = arena.slot >> 10,
        "every rank of the group is on this host: collectives run over shared memory"
    );
    Ok(Some(arena))
}

/// The transport tells the region of its group's aborts (marked there, so
/// its sleepers wake) and of this rank's kill.
impl HearsAborts for Arena {
    fn aborted(&self, from_seq: u64) {
        self.abort(from_seq);
    }

    fn killed(&self) {
        self.set_presence(Presence::Killed);
    }
}

/// Why rank 0's region (of process `pid`) could not be opened: the usual
/// reason is that rank 0 left the group (having failed, when the group's
/// abort says why) or died before this rank came; else the system refused.
async fn attach_failed(cx: &OpCtx, pid: u32, e: AttachError) -> Error {
    let until = Instant::now() + REASON_WAIT;
    let ended = || sys::pid_ended(pid).unwrap_or(false) && pid != std::process::id();
    let reason = e.text;
    // A closed descriptor reads as no such file, or as whatever reused its
    // number (another file: not ours; a socket: ENXIO). Anything else is
    // the system's: a refusal (another user, `/proc` mounted `hidepid`),
    // too many open files, no memory.
    let gone = matches!(e.errno, None | Some(libc::ENOENT) | Some(libc::ENXIO));
    if !gone {
        return Error::Setup {
            group: cx.group_name(),
            reason: format!(
                "rank 0's shared memory: {reason} (ranks must be able to open each other's /proc/<pid>/fd; `Options::shared_memory = false` uses TCP)"
            ),
        };
    }
    loop {
        if let Some(e) = cx.known_abort().await {
            return e;
        }
        if Instant::now() >= until {
            let what = if ended() {
                "its process ended"
            } else {
                "it left the group"
            };
            return cx.gone(
                0,
                format!("{what} before this rank mapped its shared memory ({reason})"),
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// One operation's use of the region: rounds of writes, a stage, and reads.
pub(crate) struct Round<'a> {
    pub a: &'a Arc<Arena>,
    cx: &'a OpCtx,
    at: arena::Cursor,
    compared: bool,
    ended: bool,
}

impl Drop for Round<'_> {
    fn drop(&mut self) {
        if !self.ended {
            self.a.cursor.locked().broken = true;
        }
    }
}

impl<'a> Round<'a> {
    /// Waits for this operation's turn and writes its call.
    pub async fn begin(a: &'a Arc<Arena>, cx: &'a OpCtx) -> Result<Round<'a>> {
        // What a timeout names while this op waits (else "the operation to
        // start"); the op's later waits name their own.
        cx.wait_note(
            "the group's earlier ops to end (shared-memory ops take the region in order)".into(),
            None,
        );
        cx.turn().wait(cx.seq()).await;
        let at = *a.cursor.locked();
        // After a failed op (whose abort may still be on its way here).
        if let Some(e) = cx.sh().aborted_for(cx.comm_id(), Some(cx.seq())) {
            return Err(e);
        }
        // Marked in the region before its TCP frame reaches us: an op whose
        // arrivals are all in (the others' from before they failed) would
        // otherwise complete without waiting, the one place the mark is read.
        if let Some(by) = a.aborted_by(cx.seq()) {
            return Err(abort_reason(a, cx, by).await);
        }
        if at.broken {
            return Err(Error::Aborted {
                group: cx.group_name(),
                reason: "an earlier operation failed part-way on this rank".into(),
                by: None,
            });
        }
        let call = Header::Want {
            comm: cx.comm_id(),
            seq: cx.seq(),
            step: 0,
            desc: shm_desc(cx.desc()),
        };
        a.set_call(at.ops, &call.encode());
        Ok(Round {
            a,
            cx,
            at,
            compared: false,
            ended: false,
        })
    }

    /// Elements of `T` that fit in a half.
    pub fn fits<T>(&self) -> usize {
        self.a.slot / std::mem::size_of::<T>()
    }

    /// Rank `k`'s half of this round as `len` elements of `T`, to read.
    ///
    /// The slice borrows the round, and [`Round::stage`] takes the round
    /// mutably, so no view outlives the stage that ends what it promises.
    ///
    /// # Safety
    ///
    /// No rank writes the elements read until the next stage.
    pub unsafe fn view<T: Element>(&self, k: usize, len: usize) -> &[T] {
        let p = self.half_for::<T>(k, len);
        // SAFETY: inside rank k's half, aligned (`half_for`); the caller
        // vouches that nobody writes it while the slice lives.
        unsafe { std::slice::from_raw_parts(p as *const T, len) }
    }

    /// Rank `k`'s half of this round as `len` elements of `T`, to write.
    /// Borrowed from the round, as [`Round::view`].
    ///
    /// # Safety
    ///
    /// No rank reads the elements written until the next stage, and this
    /// rank holds no other view of them.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn view_mut<T: Element>(&self, k: usize, len: usize) -> &mut [T] {
        let p = self.half_for::<T>(k, len);
        // SAFETY: as in `view`, and the caller vouches for exclusive use.
        unsafe { std::slice::from_raw_parts_mut(p as *mut T, len) }
    }

    /// Where rank `k`'s half starts, checked to hold `len` elements of `T`
    /// (halves are aligned to a cache line, beyond any element's alignment).
    fn half_for<T: Element>(&self, k: usize, len: usize) -> *mut u8 {
        assert!(
            len * std::mem::size_of::<T>() <= self.a.slot,
            "a view of {len} elements is larger than a half"
        );
        self.a.data(k, self.at.half)
    }

    /// Moves to the next round (the other half).
    pub fn next(&mut self) {
        self.at.half ^= 1;
    }

    /// Meets every rank at the next stage: what this rank wrote before is
    /// visible to all after. The first stage compares the calls.
    pub async fn stage(&mut self) -> Result<()> {
        let sh = self.cx.sh();
        sh.count_frame();
        if sh.is_dead() {
            return Err(self.cx.killed());
        }
        self.at.stage = self.at.stage.wrapping_add(1);
        let s = self.at.stage;
        self.a.arrive(s);
        self.wait_all(s).await?;
        if !self.compared {
            self.compared = true;
            self.compare()?;
        }
        Ok(())
    }

    /// The operation is done here: the next one starts where it ended.
    pub fn end(mut self) {
        self.at.ops += 1;
        *self.a.cursor.locked() = self.at;
        self.ended = true;
    }

    fn compare(&self) -> Result<()> {
        let me = self.a.me;
        let mine = shm_desc(self.cx.desc());
        for k in (0..self.a.n).filter(|&k| k != me) {
            let theirs = Header::decode(&self.a.call(k, self.at.ops));
            let bad = |reason: String| Error::Protocol {
                group: self.cx.group_name(),
                rank: k,
                reason,
            };
            match theirs {
                Ok(Header::Want {
                    comm, seq, desc, ..
                }) if comm == self.cx.comm_id() => {
                    if seq != self.cx.seq() {
                        let them = self.cx.world(k) as u32;
                        if let Some(e) =
                            self.cx
                                .sh()
                                .steps_apart(comm, self.cx.seq(), them, seq, desc)
                        {
                            return Err(e);
                        }
                    }
                    let call = |d: Desc| Desc {
                        hist: HIST_NONE,
                        ..d
                    };
                    if seq != self.cx.seq() || call(desc) != call(mine) {
                        return Err(Error::Mismatch {
                            group: self.cx.group_name(),
                            seq: self.cx.seq(),
                            rank_a: me,
                            desc_a: mine.to_string(),
                            rank_b: k,
                            desc_b: if seq == self.cx.seq() {
                                desc.to_string()
                            } else {
                                format!("{desc} as op #{seq}")
                            },
                        });
                    }
                }
                Ok(h) => return Err(bad(format!("its call in shared memory is {h:?}"))),
                Err(e) => return Err(bad(format!("its call in shared memory: {e}"))),
            }
        }
        Ok(())
    }

    async fn wait_all(&self, s: u32) -> Result<()> {
        let t0 = std::time::Instant::now();
        let spin = spin_for(self.a.n);
        let (mut spins, mut spinning) = (0u32, true);
        while let Some(k) = self.a.missing(s) {
            if spinning {
                spins += 1;
                if !spin.is_zero() && (spins % 64 != 0 || t0.elapsed() < spin) {
                    std::hint::spin_loop();
                    continue;
                }
                spinning = false;
            }
            if t0.elapsed() < spin + YIELD {
                // Give the core to a peer on it (another process), and the
                // worker to another task (a rank in this process).
                std::thread::yield_now();
                tokio::task::yield_now().await;
                continue;
            }
            self.cx.wait_note(
                format!("rank {k} to reach stage {s} in shared memory"),
                Some((k, s)),
            );
            // Every rank not yet here, not only the one slept on: a dead
            // rank behind a slow one is named within a slice.
            for j in (0..self.a.n).filter(|&j| j != self.a.me && !self.a.arrived(j, s)) {
                if let Err(e) = self.check(j).await {
                    // It may have arrived, finished and left (or died)
                    // since it was looked at: its stage, stored before, is
                    // visible now.
                    if !self.a.arrived(j, s) {
                        return Err(e);
                    }
                }
            }
            let a = self.a.clone();
            let _ = tokio::task::spawn_blocking(move || a.sleep_on(k, s, SLICE)).await;
        }
        Ok(())
    }

    /// What ends a wait for rank `k` early: an abort, or `k` gone.
    async fn check(&self, k: usize) -> Result<()> {
        let (cx, sh) = (self.cx, self.cx.sh());
        if sh.is_dead() {
            return Err(cx.killed());
        }
        if let Some(e) = sh.aborted_for(cx.comm_id(), Some(cx.seq())) {
            return Err(e);
        }
        if let Some(by) = self.a.aborted_by(cx.seq()) {
            return Err(self.abort_reason(by).await);
        }
        let world = cx.world(k);
        let pid = match self.a.presence(k) {
            Presence::Left => return Err(cx.gone(k, "it dropped the group".into())),
            Presence::Killed => return Err(cx.gone(k, "it died (killed)".into())),
            Presence::Here => self.a.pid(k),
            Presence::Absent => {
                let pid = sh.host_pid(world);
                return check_absent(cx, k, pid);
            }
        };
        match pid {
            Some(p) if self.a.pid_ended(p) => Err(cx.gone(k, format!("its process ({p}) ended"))),
            _ => Ok(()),
        }
    }

    async fn abort_reason(&self, by: usize) -> Error {
        abort_reason(self.a, self.cx, by).await
    }
}

/// The group's abort, marked in the region `a` by rank `by`: its reason
/// arrives by TCP or is in the store's record (waited for, bounded).
async fn abort_reason(a: &Arena, cx: &OpCtx, by: usize) -> Error {
    let until = Instant::now() + REASON_WAIT;
    loop {
        if let Some(e) = cx.known_abort().await {
            return e;
        }
        // An aborter that left with no reason sent or recorded was cut
        // off (its runtime shut down mid-operation, say): it is gone.
        let gone = match a.presence(by) {
            Presence::Left | Presence::Killed => true,
            _ => a.pid(by).is_some_and(|p| a.pid_ended(p)),
        };
        if gone || Instant::now() >= until {
            let what = if gone {
                "it left"
            } else {
                "its reason never arrived"
            };
            return cx.gone(
                by,
                format!("it marked the group aborted mid-operation and {what}"),
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Whether group rank `k`, which has not mapped the region (process `pid`,
/// if known), is gone: its process ended, or a TCP probe of it was
/// refused (it died before it came); or whether the group is aborted.
/// Otherwise it is merely late.
fn check_absent(cx: &OpCtx, k: usize, pid: Option<u32>) -> Result<()> {
    let sh = cx.sh();
    if sh.is_dead() {
        return Err(cx.killed());
    }
    if let Some(e) = sh.aborted_for(cx.comm_id(), Some(cx.seq())) {
        return Err(e);
    }
    let world = cx.world(k);
    if let Some(reason) = sh.gone_reason(world) {
        return Err(cx.gone(k, reason));
    }
    if let Some(p) = pid.filter(|&p| p != std::process::id()) {
        if sys::pidfd(p).map_or(true, |fd| sys::ended(&fd)) {
            return Err(cx.gone(
                k,
                format!("its process ({p}) ended before it mapped the group's shared memory"),
            ));
        }
    }
    sh.probe(world, cx.deadline);
    Ok(())
}

/// The call shared-memory operations record and compare (its history is
/// recorded, for `Shared::steps_apart`, but not compared: every rank
/// compares every other's call at every op here, so the first mismatch is
/// found where it is).
fn shm_desc(d: Desc) -> Desc {
    Desc {
        algo: Algo::Shm,
        ..d
    }
}
