//! One operation in flight ([`OpCtx`]), over its group's state ([`Comm`]):
//! what every algorithm, over TCP or shared memory, is written against.
//!
//! An op has a group, a sequence number (collectives) or a message number
//! (point-to-point), its call ([`Desc`]), a deadline, and a note of whom it
//! waits for, which its timeout names. It sends and receives frames keyed by
//! (group, number, step) through the transport, and it ends in one of three
//! ways ([`OpCtx::finish`]): done; failed, which aborts the group and returns
//! once the other members have been told (bounded); or dropped unfinished,
//! which aborts the group too, since peers would otherwise wait for frames
//! that will never come. Ops that share one resource take it in order of
//! their numbers ([`Turn`]).
//!
//! This layer knows nothing of how a group runs its ops (which plan, which
//! transport): the layers above hand that down.

mod comm;
mod turn;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rallypoint_sync::MutexExt;
use tokio::time::{timeout_at, Instant};

pub(crate) use comm::Comm;
pub(crate) use turn::Turn;

use crate::element::{bytes_of, bytes_of_mut, Buf, DType, Element, ReduceOp};
use crate::error::{Error, Result};
use crate::frame::{Desc, Header};
use crate::options::{pipeline_segment, Options};
use crate::transport::{Fail, Key, Origin, Shared};

/// Runs an op's body within its deadline and ends it (see [`OpCtx::finish`]):
/// every operation, blocking or `*_async`, goes through here.
pub(crate) async fn drive<R>(
    cx: &OpCtx,
    body: impl std::future::Future<Output = Result<R>>,
) -> Result<R> {
    cx.finish(timeout_at(cx.deadline, body).await).await
}

/// One operation in flight: its group, sequence number and descriptor, its
/// deadline, and whom it is waiting for (for the timeout message). Dropping it
/// unfinished aborts the group, since peers would otherwise wait for frames that
/// will never come.
pub(crate) struct OpCtx {
    comm: Arc<Comm>,
    seq: u64,
    desc: Desc,
    p2p: bool,
    timeout: Duration,
    pub(crate) deadline: Instant,
    waiting: Mutex<Option<(usize, u32, bool)>>,
    /// What the op waits for when that is not a rank's step (set-up).
    note: Mutex<Option<String>>,
    /// The rank and stage a note is about (shared memory).
    noted: Mutex<Option<(usize, u32)>>,
    done: AtomicBool,
    /// The op's result when it was doomed as it began (a mismatch found then,
    /// or its group already aborted for it), whatever the body did: every
    /// send and receive of an op the group's abort fails fails at once.
    doomed: Mutex<Option<Error>>,
    /// Whether the op's future is dropped before its buffers' borrows end
    /// (it cannot be leaked), so that it may post receives into them (see
    /// `algorithms/posted.rs`).
    posting: bool,
}

impl OpCtx {
    /// Op `seq` of `comm`, described by `desc`, due within `timeout`.
    pub(crate) fn new(
        comm: Arc<Comm>,
        desc: Desc,
        seq: u64,
        p2p: bool,
        timeout: Duration,
    ) -> OpCtx {
        OpCtx {
            comm,
            seq,
            desc,
            p2p,
            timeout,
            deadline: Instant::now() + timeout,
            waiting: Mutex::new(None),
            note: Mutex::new(None),
            noted: Mutex::new(None),
            done: AtomicBool::new(false),
            doomed: Mutex::new(None),
            posting: false,
        }
    }

    /// Whether the op failed as it began (see [`OpCtx::doom`]): it runs
    /// over TCP, whose first send or receive fails it.
    pub(crate) fn is_doomed(&self) -> bool {
        self.doomed.locked().is_some()
    }

    /// A two-level step that succeeded (see `two_level`).
    pub(crate) fn step_done(self) {
        self.done.store(true, Ordering::Relaxed);
        self.comm.sh().end_seq(self.comm.id, self.seq);
    }

    /// A two-level step that failed: the group op's abort aborts this
    /// internal group, not the step.
    pub(crate) fn step_failed(self) {
        self.done.store(true, Ordering::Relaxed);
    }

    /// The rank (of this op's group) and step the op last waited for.
    pub(crate) fn waiting_rank(&self) -> Option<(usize, u32)> {
        self.waiting
            .locked()
            .map(|(r, step, _)| (r, step))
            .or(*self.noted.locked())
    }

    /// The group's abort as this rank knows it: told, or recorded.
    pub(crate) async fn known_abort(&self) -> Option<Error> {
        let sh = self.sh();
        if let Some(e) = sh.aborted(self.comm.id) {
            return Some(e);
        }
        let record = sh.abort_record(self.comm.id).await?;
        Some(Error::Aborted {
            group: self.group_name(),
            reason: record.into(),
            by: None,
        })
    }

    /// The error of an op on a rank killed by fault injection.
    pub(crate) fn killed(&self) -> Error {
        Error::Aborted {
            group: self.group_name(),
            reason: "this rank was killed (fault injection)".into(),
            by: None,
        }
    }

    /// Whether the op is a point-to-point message (which never runs over
    /// shared memory or in two levels).
    pub(crate) fn is_p2p(&self) -> bool {
        self.p2p
    }

    /// Ends an op that never ran, without aborting the group: one begun
    /// only to take its number after an earlier part failed (the group is
    /// aborted for it already).
    pub(crate) fn never_ran(self) {
        self.done.store(true, Ordering::Relaxed);
    }

    pub(crate) fn op_name(&self) -> String {
        self.name()
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The op's timeout error, as its deadline passes.
    pub(crate) fn timed_out(&self) -> Error {
        self.timeout_error()
    }

    pub(crate) fn sh(&self) -> &Arc<Shared> {
        self.comm.sh()
    }

    pub(crate) fn comm(&self) -> &Arc<Comm> {
        &self.comm
    }

    /// The group rank of world rank `w`, for messages.
    pub(crate) fn group_rank_of(&self, w: usize) -> usize {
        self.comm.members.group_rank(w)
    }

    pub(crate) fn comm_id(&self) -> u64 {
        self.comm.id
    }

    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }

    pub(crate) fn desc(&self) -> Desc {
        self.desc
    }

    pub(crate) fn opts(&self) -> &Options {
        &self.comm.opts
    }

    pub(crate) fn turn(&self) -> &Turn {
        &self.comm.turn
    }

    pub(crate) fn group_name(&self) -> String {
        self.comm.members.name.clone()
    }

    /// Rank `k` (of the group) is gone, for `reason`.
    pub(crate) fn gone(&self, k: usize, reason: String) -> Error {
        self.error(Fail::Gone {
            rank: self.world(k),
            reason,
        })
    }

    /// What the op waits for, for its timeout message, when that is not a
    /// rank's step.
    pub(crate) fn note_waiting(&self, what: String) {
        *self.note.locked() = Some(what);
    }

    /// [`OpCtx::note_waiting`], in place of a rank's step; `rank`: the rank
    /// (of the group) and stage the note is about, if one.
    pub(crate) fn wait_note(&self, what: String, rank: Option<(usize, u32)>) {
        *self.waiting.locked() = None;
        *self.noted.locked() = rank;
        self.note_waiting(what);
    }

    pub(crate) fn n(&self) -> usize {
        self.comm.members.ranks.len()
    }

    pub(crate) fn me(&self) -> usize {
        self.comm.rank
    }

    /// Segment length in elements of `T`.
    pub(crate) fn seg<T: Element>(&self) -> usize {
        (self.comm.opts.segment_bytes / std::mem::size_of::<T>()).max(1)
    }

    /// Segment length in elements of `T` for a pipelined op (ring, chain)
    /// over a buffer of `total` elements, the same on every rank (see
    /// [`Options::segment_bytes`] and [`pipeline_segment`]).
    pub(crate) fn seg_for<T: Element>(&self, total: usize) -> usize {
        pipeline_segment(
            total,
            std::mem::size_of::<T>(),
            self.n(),
            self.comm.opts.segment_bytes,
        )
    }

    pub(crate) fn check_steps(&self, phases: usize, stride: usize) -> Result<()> {
        if phases
            .checked_mul(stride)
            .is_none_or(|s| s > u32::MAX as usize)
        {
            return Err(Error::Invalid(format!(
                "{}: {phases} phases of {stride} segments do not fit in a frame's step field; use a larger segment size",
                self.desc
            )));
        }
        Ok(())
    }

    /// This op fails with `e` at its first await, once its group's abort is
    /// recorded and told: every send and receive of an op the abort fails
    /// fails at once, so no frame of it is sent.
    pub(crate) fn doom(self, e: Error) -> OpCtx {
        self.done.store(true, Ordering::Relaxed);
        *self.doomed.locked() = Some(e);
        self
    }

    /// The first collective this op's failure fails: itself, or, for a
    /// message, the next collective this rank begins. The ones before go on,
    /// here and elsewhere: run one after another, this rank has sent all
    /// their frames; an earlier `*_async` op still running here goes on
    /// sending its own (and one dropped unfinished aborts from itself). What
    /// needs a dead rank fails on its own.
    fn abort_from(&self) -> u64 {
        if self.p2p {
            self.comm.next_seq()
        } else {
            self.seq
        }
    }

    /// The sequence number aborts compare with (none for point-to-point).
    fn collective_seq(&self) -> Option<u64> {
        (!self.p2p).then_some(self.seq)
    }

    fn name(&self) -> String {
        if self.p2p {
            format!("{} (message #{})", self.desc, self.seq)
        } else {
            format!("{} (op #{})", self.desc, self.seq)
        }
    }

    pub(crate) fn world(&self, grank: usize) -> usize {
        self.comm.members.ranks[grank]
    }

    pub(crate) fn error(&self, f: Fail) -> Error {
        let group = self.comm.members.name.clone();
        match f {
            Fail::Aborted(e) => e,
            Fail::Gone { rank, reason } | Fail::Unanswered { rank, reason } => Error::PeerGone {
                group,
                op: self.name(),
                rank: self.comm.members.group_rank(rank),
                reason: self.where_(rank, reason),
            },
            Fail::Refused { rank, reason } => Error::Protocol {
                group,
                rank: self.comm.members.group_rank(rank),
                reason,
            },
            Fail::Secret { rank, reason } => Error::JobSecret {
                group,
                rank: self.comm.members.group_rank(rank),
                reason,
            },
            Fail::Lost { rank, reason } => Error::ConnectionLost {
                group,
                op: self.name(),
                rank: self.comm.members.group_rank(rank),
                reason,
            },
            Fail::Timeout => self.timeout_error(),
        }
    }

    /// `reason` with where world rank `rank` listened, when this rank knows
    /// and the reason does not say: the host of a rank that died.
    fn where_(&self, rank: usize, reason: String) -> String {
        match self.sh().known_addr(rank) {
            Some(a) if !reason.contains(&a.ip().to_string()) => {
                format!("{reason} (it listened at {a})")
            }
            _ => reason,
        }
    }

    fn timeout_error(&self) -> Error {
        let waiting = *self.waiting.locked();
        let waiting_for = match waiting {
            Some((r, _, _)) if self.comm.sh().awaiting_address(self.world(r)) => format!(
                "rank {r}, which never published its address: it never formed the group (not started, or died during set-up)"
            ),
            Some((r, step, false)) => format!("rank {r} (step {step})"),
            Some((r, step, true))
                if self.comm.sh().held_by(
                    self.world(r),
                    self.comm.id,
                    self.seq,
                    self.p2p,
                    self.desc.root,
                ) =>
            {
                format!(
                "rank {r} to take step {step}: this rank is out of credit with it (its operations have not taken the last Options::receive_window bytes sent to it) and it has not asked for this op's frames: it has not reached this op"
            )
            }
            Some((r, step, true)) => format!("rank {r} to take step {step}"),
            None => self
                .note
                .locked()
                .clone()
                .unwrap_or_else(|| "the operation to start".into()),
        };
        Error::Timeout {
            group: self.comm.members.name.clone(),
            op: self.name(),
            timeout: self.timeout,
            waiting_for,
        }
    }

    pub(crate) fn set_waiting(&self, r: usize, step: u32, sending: bool) {
        *self.waiting.locked() = Some((r, step, sending));
    }

    pub(crate) async fn send<T: Element>(&self, to: usize, step: u32, data: &[T]) -> Result<()> {
        self.set_waiting(to, step, true);
        let bytes = bytes_of(data);
        let h = Header::Data {
            comm: self.comm.id,
            seq: self.seq,
            step,
            desc: self.desc,
            len: bytes.len() as u64,
        };
        self.comm
            .sh()
            .send(self.world(to), &h, bytes, step as usize, self.deadline)
            .await
            .map_err(|f| self.error(f))
    }

    /// The key of this op's frame from `from` at `step`.
    pub(crate) fn key(&self, from: usize, step: u32) -> Key {
        Key {
            comm: self.comm.id,
            src: self.world(from) as u32,
            p2p: self.p2p,
            tag: if self.p2p { self.desc.root } else { 0 },
            seq: self.seq,
            step,
        }
    }

    /// Whether the op may post receives into its buffers: its future is
    /// dropped before their borrows end (see `algorithms/posted.rs`).
    pub(crate) fn may_post(&self) -> bool {
        self.posting && !self.p2p
    }

    /// Lets the op post receives into its buffers.
    ///
    /// # Safety
    ///
    /// The op's future must be dropped (or run to completion) before the
    /// borrows of the buffers it is given end: it is never leaked. True of a
    /// future owned by a task that owns the buffers (`*_async`), and of one
    /// run within a blocking call ([`crate::blocking::BlockingGroup`]).
    pub(crate) unsafe fn allow_posting(mut self) -> OpCtx {
        self.posting = true;
        self
    }

    async fn recv(&self, from: usize, step: u32, elems: usize, dtype: DType) -> Result<Buf> {
        self.set_waiting(from, step, false);
        let key = self.key(from, step);
        let f = self
            .comm
            .sh()
            .recv(key, (!self.p2p).then_some(self.desc), self.deadline)
            .await
            .map_err(|f| self.error(f))?;
        if self.p2p && (f.desc.dtype != dtype || f.desc.count != self.desc.count) {
            return Err(Error::MessageMismatch {
                group: self.comm.members.name.clone(),
                tag: self.desc.root,
                seq: self.seq,
                sender: from,
                sent: format!("{} x {}", f.desc.dtype, f.desc.count),
                receiver: self.me(),
                expected: format!("{} x {}", self.desc.dtype, self.desc.count),
            });
        }
        self.check_len(from, step, f.buf.len(), elems * dtype.size())?;
        Ok(f.buf)
    }

    /// A frame from `from` at `step` of `got` bytes where `want` were due.
    pub(crate) fn check_len(&self, from: usize, step: u32, got: usize, want: usize) -> Result<()> {
        if got != want {
            return Err(Error::Protocol {
                group: self.comm.members.name.clone(),
                rank: from,
                reason: format!(
                    "sent {got} bytes for step {step} of {}; expected {want}",
                    self.name()
                ),
            });
        }
        Ok(())
    }

    pub(crate) async fn recv_copy<T: Element>(
        &self,
        from: usize,
        step: u32,
        out: &mut [T],
    ) -> Result<()> {
        let b = self.recv(from, step, out.len(), T::DTYPE).await?;
        bytes_of_mut(out).copy_from_slice(b.bytes());
        Ok(())
    }

    pub(crate) async fn recv_reduce<T: Element>(
        &self,
        from: usize,
        step: u32,
        out: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let b = self.recv(from, step, out.len(), T::DTYPE).await?;
        T::reduce(op, out, b.typed());
        Ok(())
    }

    /// Ends the operation with the algorithm's result (or its deadline). A
    /// failure aborts the group and returns once the other members have been
    /// told (bounded), so a rank that exits on the error does not leave them to
    /// find only that it, too, is gone.
    pub(crate) async fn finish<R>(
        &self,
        r: Result<Result<R>, tokio::time::error::Elapsed>,
    ) -> Result<R> {
        let doomed = self.doomed.locked().take();
        if let Some(e) = doomed {
            self.told().await;
            return Err(e);
        }
        match r {
            Ok(Ok(v)) => {
                self.done.store(true, Ordering::Relaxed);
                if !self.p2p {
                    self.comm.sh().end_seq(self.comm.id, self.seq);
                }
                // An abort raised while the op ran (a peer's frame for it that
                // did not match, say) fails it even though its part is done,
                // once recorded and told like any failure (this rank may exit
                // on the error: simulator seed 973).
                match self
                    .comm
                    .sh()
                    .aborted_for(self.comm.id, self.collective_seq())
                {
                    Some(e) => {
                        self.told().await;
                        Err(e)
                    }
                    None => Ok(v),
                }
            }
            Ok(Err(e)) => Err(self.fail_told(e).await),
            Err(_) => Err(self.fail_told(self.timeout_error()).await),
        }
    }

    /// Waits (bounded) until the other members have been told of the
    /// group's abort, unless the group's options say not to
    /// ([`Options::tell_before_failing`](crate::Options)).
    async fn told(&self) {
        if self.comm.opts.tell_before_failing {
            self.comm.sh().told(self.comm.id).await;
        }
    }

    /// Fails the group with `e` and returns `e` once the others have been
    /// told (bounded), so a rank that exits on the error does not leave them
    /// to find only that it, too, is gone.
    async fn fail_told(&self, e: Error) -> Error {
        let e = self.explain(e).await;
        let e = self.fail(e);
        self.told().await;
        e
    }

    /// A timeout while calls found diverged are held is explained by them.
    ///
    /// A member found gone may be a bystander that exited on being told of an
    /// abort (or whose process ended before the telling reached us, or that
    /// finished its part of calls found diverged here): the group's abort
    /// (once the grace of calls found diverged has settled, see
    /// `transport/diverged.rs`), or else its record in the store, names the
    /// cause.
    async fn explain(&self, e: Error) -> Error {
        let (sh, id, seq) = (self.comm.sh(), self.comm.id, self.collective_seq());
        let held = || seq.and_then(|s| sh.give_up_diverged(id, s));
        if matches!(e, Error::Timeout { .. }) {
            return held().unwrap_or(e);
        }
        // A rank gone, or a connection lost with a rank that lives on, may
        // be the trace of a failure elsewhere (a rank that exited on being
        // told): the cause is then the abort, or its record.
        if !matches!(e, Error::PeerGone { .. } | Error::ConnectionLost { .. }) {
            return e;
        }
        if let Some(a) = sh.aborted_for(id, seq) {
            return a;
        }
        sh.settle_diverged(id, self.deadline).await;
        if Instant::now() >= self.deadline {
            if let Some(d) = held() {
                return d;
            }
        }
        if let Some(a) = sh.aborted_for(id, seq) {
            return a;
        }
        let record = self.comm.sh().abort_record(self.comm.id).await;
        tracing::debug!(
            rank = self.comm.sh().cfg.rank,
            op = %self.name(),
            found = record.is_some(),
            "a peer gone: looked for the abort's record"
        );
        match record {
            Some(record) => Error::Aborted {
                group: self.comm.members.name.clone(),
                reason: record.into(),
                by: None,
            },
            None => e,
        }
    }

    /// Aborts the group with `e` (unless it is aborted already) and returns
    /// `e`; the other members are told in the background.
    pub(crate) fn fail(&self, e: Error) -> Error {
        self.done.store(true, Ordering::Relaxed);
        // The group's abort is in place for this op already: nothing to add
        // (and a provisional one must stay so, see `transport/diverged.rs`).
        if !self.p2p
            && self
                .comm
                .sh()
                .aborted_for(self.comm.id, Some(self.seq))
                .is_some()
        {
            return e;
        }
        let from = self.abort_from();
        if e.is_aborted() {
            // A message fails under any abort of its group: when one is
            // recorded, that is why, and widening it to the collectives this
            // rank had not begun when the message began would fail ones the
            // abort leaves to finish.
            if self.p2p && self.comm.sh().aborted_for(self.comm.id, None).is_some() {
                return e;
            }
            // Usually recorded already, from this op or an earlier one (then
            // this changes nothing); not when it came from the store, or from
            // a later op (then it widens to this one).
            self.comm
                .sh()
                .abort(self.comm.id, e.clone(), Origin::Passed(None), from);
            return e;
        }
        let reason = Error::Aborted {
            group: self.comm.members.name.clone(),
            reason: e.to_string().into(),
            by: None,
        };
        self.comm
            .sh()
            .abort(self.comm.id, reason, Origin::Here, from);
        e
    }
}

impl Drop for OpCtx {
    fn drop(&mut self) {
        // The turn passes at the end, after any abort: the next op must
        // see it before it touches the shared memory.
        struct PassTurn<'a>(&'a OpCtx);
        impl Drop for PassTurn<'_> {
            fn drop(&mut self) {
                if !self.0.p2p {
                    self.0.comm.turn.done(self.0.seq);
                }
            }
        }
        let _turn = PassTurn(self);
        if !self.done.load(Ordering::Relaxed) {
            let reason = Error::Aborted {
                group: self.comm.members.name.clone(),
                reason: format!(
                    "rank {} dropped {} before it finished",
                    self.me(),
                    self.name()
                )
                .into(),
                by: None,
            };
            let from = self.abort_from();
            self.comm
                .sh()
                .abort(self.comm.id, reason, Origin::Here, from);
        }
    }
}
