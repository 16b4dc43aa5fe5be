//! Seeded fault schedules over the real group (feature `faults`).
//!
//! Each seed makes one scenario: 2–5 ranks in this process, over shared
//! memory (rounds of 512 bytes; in half of those, the ranks spread over two
//! or three hosts, so all_reduce, broadcast and barrier run in two levels)
//! or over loopback TCP (half the seeds each;
//! three in four of those with a receive window of at most 2 KiB, so flow
//! control keeps ranks out of credit all the time),
//! a random program of collectives (kind, type, size, root, reduce operator
//! and algorithm) and exchanges of point-to-point messages (each rank sends
//! to the rank `shift` ahead and receives from the one `shift` behind); in
//! some scenarios consecutive ops are started two at a time with their
//! `*_async` forms; and at most one fault:
//!
//! - a **mismatch**: one rank calls something else at one op (another kind,
//!   size, type, root or operator; a message of another size or type);
//! - a **kill**: one rank dies as a SIGKILLed process does when it is about to
//!   send its `k`-th frame, or right after set-up (dead before its first op);
//! - a **break**: one rank, about to send its `k`-th frame over TCP, writes
//!   part of it (inside the header, inside the payload, or all of it) and
//!   resets the connection, living on; its send reports success, as a
//!   write into a socket that a reset then empties does. Drawn from a
//!   generator of its own, in half of the scenarios that would have had no
//!   fault, so every other seed's scenario is what it was before breaks.
//!
//! Every rank runs the program until its first error and then drops its group
//! (its process exits), so bystanders that exit on being told are part of
//! every schedule. The seed fixes the program and the fault; the interleaving
//! is the kernel's, so a seed replays the same scenario, not the same order.
//!
//! Invariants, checked on every scenario:
//!
//! 1. No op waits past its deadline, and no error is a timeout: deaths and
//!    mismatches are noticed, not waited out.
//! 2. Without a fault every op succeeds; every op that succeeds, with or
//!    without one, has the right result (up to a mismatch).
//! 3. A mismatch fails every rank, with the mismatch as the cause (both sides
//!    named, or a message's sender and receiver; or, where the only rank that could compare had finished its
//!    program and exited, that rank named as gone), never before the
//!    mismatched op, in it or, at the latest, at the rank's first later op
//!    (begun after it: with ops started two at a time, the one begun with it
//!    may complete) that depends on every rank (barrier, all_reduce, all_gather,
//!    reduce_scatter, all_to_all, and gather or reduce at their root). An op
//!    that depends on some ranks only, such as a broadcast at its root, may
//!    succeed before the news arrives; see the README.
//! 4. A dead rank is named by every survivor that fails, and every survivor
//!    fails at the latest at its first op that depends on every rank after
//!    the one the victim died in; no error ever names a live rank as gone.
//!
//! 5. After a break, no op waits out its deadline (1), and every rank that
//!    fails names the broken connection (`broke part-way`), or names gone
//!    only ranks that finished their program and exited (a rank that needed
//!    a frame lost with the connection may find its sender exited first);
//!    never a rank that had not exited. Without a break (its frame never
//!    came), every op succeeds.
//!
//! Messages bend "never before" in 3 and 4: an abort fails every message
//! not yet received, so a rank still in an exchange when a later op fails
//! fails there, with that failure as the cause; and as it then exits, the
//! collectives it had not finished fail on the others too (still naming the
//! cause). So "before" is checked only for collectives, and only when no
//! rank failed in an exchange.
//!
//! A deviant call that is another number of collectives (an all-gather of
//! varying sizes is two) misaligns every later call: in 3, the error must
//! still name the first mismatch. Where the only ranks that could compare
//! at the mismatch had exited before its frames reached them, a rank may
//! report, after the grace, that later calls diverged (naming the
//! deviant's call), as it may name an exited rank gone (seed 181422: the
//! deviant sent its part of a gather to another root, which had finished).
//!
//! A failing seed prints, besides the scenario and each rank's outcome, the
//! group's debug trace of it (aborts, records, tellings, peers found gone,
//! calls found diverged; each event with its rank), the last
//! [`TRACE_LINES`] lines: a seed that fails once in thousands of runs may
//! not fail again when replayed. (Tasks of the previous scenario that were
//! still ending may add a line or two at the top.)
//!
//! `RALLY_SIM_TRACE=1` prints the trace of a replayed seed that passes.
//!
//! `RALLY_SIM_SEEDS=n` runs n seeds (default 2,000 in CI, about 10 s) from
//! `RALLY_SIM_FIRST` (default 0), as in the agent's and RPC's simulators;
//! `RALLY_SIM_SEED=s cargo nextest run -p rallypoint-collectives --all-features
//! sim::replay --no-capture` replays one.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use fastrand::Rng;
use rallypoint_collectives::{
    AllReduceAlgorithm, BroadcastAlgorithm, Element, Error, Options, ProcessGroup, ReduceOp,
};

use crate::harness::{data, group_each, opts};

/// The op timeout: far above anything a scenario needs, so a timeout means a
/// hang (invariant 1).
const TIMEOUT: Duration = Duration::from_secs(20);

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Barrier,
    AllReduce(ReduceOp, Option<AllReduceAlgorithm>),
    Broadcast(usize, Option<BroadcastAlgorithm>),
    Reduce(usize, ReduceOp),
    AllGather,
    Gather(usize),
    Scatter(usize),
    ReduceScatter(ReduceOp),
    AllToAll,
    /// Point-to-point: rank `r` sends its input to `r + shift` (tag: the op's
    /// index) and receives from `r − shift`, the receive posted first.
    Exchange(usize),
    /// all_gather_varying: rank `r` gives [`varying_len`] elements.
    AllGatherV,
}

/// Rank `r`'s length in an all_gather_varying of `count`: differs by rank,
/// sometimes 0.
fn varying_len(count: usize, r: usize) -> usize {
    (count * (r + 1) + 3 * r) % (count + 5)
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Ty {
    I32,
    F32,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Op {
    kind: Kind,
    ty: Ty,
    /// Elements per rank (per chunk for the chunked ops).
    count: usize,
}

impl Op {
    /// Every collective has one; kept as the place to say so should one
    /// be added without.
    fn has_async(&self) -> bool {
        true
    }

    fn without_algorithm(mut self) -> Op {
        self.kind = match self.kind {
            Kind::AllReduce(o, _) => Kind::AllReduce(o, None),
            Kind::Broadcast(r, _) => Kind::Broadcast(r, None),
            k => k,
        };
        self
    }

    /// Whether this rank's result depends on every rank (so the op cannot
    /// complete here while any rank is aborted or dead).
    fn depends_on_all(&self, rank: usize) -> bool {
        match self.kind {
            Kind::Barrier
            | Kind::AllReduce(..)
            | Kind::AllGather
            | Kind::ReduceScatter(_)
            | Kind::AllToAll
            | Kind::AllGatherV => true,
            Kind::Reduce(root, _) | Kind::Gather(root) => root == rank,
            Kind::Broadcast(..) | Kind::Scatter(_) | Kind::Exchange(_) => false,
        }
    }

    /// Whether this is a collective (takes a sequence number of the group).
    fn collective(&self) -> bool {
        !matches!(self.kind, Kind::Exchange(_))
    }

    /// The group sequence numbers it takes: all_gather_varying takes two
    /// (the lengths' all-gather, then the data's).
    fn seqs(&self) -> usize {
        match self.kind {
            Kind::Exchange(_) => 0,
            Kind::AllGatherV => 2,
            _ => 1,
        }
    }
}

#[derive(Debug, Clone)]
enum Fault {
    None,
    /// Rank `rank` calls `op` instead at index `at`.
    Mismatch {
        at: usize,
        rank: usize,
        op: Op,
    },
    /// Rank `rank` dies when about to send its `frame`-th data frame
    /// (`None`: right after set-up).
    Kill {
        rank: usize,
        frame: Option<u64>,
    },
    /// Rank `rank`, when about to send its `frame`-th data frame over TCP,
    /// writes its first `after` bytes and resets the connection, living on.
    Break {
        rank: usize,
        frame: u64,
        after: u64,
    },
}

#[derive(Debug)]
struct Scenario {
    n: usize,
    program: Vec<Op>,
    fault: Fault,
    /// Ops are started two at a time with their `*_async` forms, then
    /// awaited in order.
    async_pairs: bool,
    /// Over shared memory (every rank is in this process, on one host), or TCP.
    shm: bool,
    /// The receive window (flow control): over TCP, often a few segments or
    /// less, so ranks wait for each other's credit all the time.
    window: usize,
    /// With shared memory, in half the scenarios, each rank's host (2 or 3
    /// hosts): all_reduce, broadcast and barrier then run in two levels.
    hosts: Option<Vec<usize>>,
}

fn reduce_op(rng: &mut Rng) -> ReduceOp {
    [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min][rng.usize(..3)]
}

fn random_op(rng: &mut Rng, n: usize) -> Op {
    let kind = match rng.usize(..11) {
        0 => Kind::Barrier,
        1 => Kind::AllReduce(
            reduce_op(rng),
            [
                None,
                Some(AllReduceAlgorithm::Ring),
                Some(AllReduceAlgorithm::RecursiveDoubling),
                Some(AllReduceAlgorithm::Tree),
            ][rng.usize(..4)],
        ),
        2 => Kind::Broadcast(
            rng.usize(..n),
            [
                None,
                Some(BroadcastAlgorithm::Tree),
                Some(BroadcastAlgorithm::Chain),
            ][rng.usize(..3)],
        ),
        3 => Kind::Reduce(rng.usize(..n), reduce_op(rng)),
        4 => Kind::AllGather,
        5 => Kind::Gather(rng.usize(..n)),
        6 => Kind::Scatter(rng.usize(..n)),
        7 => Kind::ReduceScatter(reduce_op(rng)),
        8 => Kind::AllToAll,
        9 => Kind::AllGatherV,
        _ => Kind::Exchange(rng.usize(1..n)),
    };
    // Mostly small; some cut into several segments (see `sim_opts`).
    let count = if rng.bool() {
        rng.usize(1..=16)
    } else {
        rng.usize(17..=700)
    };
    Op {
        kind,
        ty: if rng.bool() { Ty::I32 } else { Ty::F32 },
        count,
    }
}

/// The same op with one thing changed: kind, size, type, root or operator.
/// A message exchange changes only its size or type, and stays one (a
/// message to another rank than the one that waits for it is waited for
/// until the timeout: point-to-point has no order to compare against).
fn mutate(rng: &mut Rng, op: Op, n: usize) -> Op {
    loop {
        let mut m = op;
        let what = rng.usize(..5);
        if !op.collective() && !matches!(what, 1 | 2) {
            continue;
        }
        // Lengths may differ by rank in all_gather_varying: not a mismatch.
        if op.kind == Kind::AllGatherV && what == 1 {
            continue;
        }
        match what {
            0 => {
                m.kind = random_op(rng, n).kind;
                if !m.collective() {
                    continue;
                }
            }
            1 => m.count = op.count + rng.usize(1..=40),
            2 => m.ty = if op.ty == Ty::I32 { Ty::F32 } else { Ty::I32 },
            3 => {
                let other = |r: usize, rng: &mut Rng| (r + rng.usize(1..n)) % n;
                m.kind = match op.kind {
                    Kind::Broadcast(r, a) => Kind::Broadcast(other(r, rng), a),
                    Kind::Reduce(r, o) => Kind::Reduce(other(r, rng), o),
                    Kind::Gather(r) => Kind::Gather(other(r, rng)),
                    Kind::Scatter(r) => Kind::Scatter(other(r, rng)),
                    k => k,
                }
            }
            _ => {
                let other = |o: ReduceOp, rng: &mut Rng| loop {
                    let x = reduce_op(rng);
                    if x != o {
                        return x;
                    }
                };
                m.kind = match op.kind {
                    Kind::AllReduce(o, a) => Kind::AllReduce(other(o, rng), a),
                    Kind::Reduce(r, o) => Kind::Reduce(r, other(o, rng)),
                    Kind::ReduceScatter(o) => Kind::ReduceScatter(other(o, rng)),
                    k => k,
                }
            }
        }
        // A barrier carries no size or type, and an algorithm may be the one
        // the size chooses anyway: such changes change nothing.
        let same_barrier = matches!(m.kind, Kind::Barrier) && matches!(op.kind, Kind::Barrier);
        if m.without_algorithm() != op.without_algorithm() && !same_barrier {
            return m;
        }
    }
}

fn scenario(seed: u64) -> Scenario {
    let mut rng = Rng::with_seed(seed);
    let n = rng.usize(2..=5);
    let program: Vec<Op> = (0..rng.usize(1..=10))
        .map(|_| random_op(&mut rng, n))
        .collect();
    let fault = match rng.usize(..10) {
        0..=2 => Fault::None,
        3..=6 => {
            let at = rng.usize(..program.len());
            Fault::Mismatch {
                at,
                rank: rng.usize(..n),
                op: mutate(&mut rng, program[at], n),
            }
        }
        _ => Fault::Kill {
            rank: rng.usize(..n),
            frame: (rng.u8(..8) != 0).then(|| rng.u64(..60)),
        },
    };
    // Drawn apart, so that every other seed's scenario stays as it was.
    let mut brk = Rng::with_seed(seed ^ 0xb4ea_c0de);
    let fault = match fault {
        Fault::None if brk.bool() => Fault::Break {
            rank: brk.usize(..n),
            frame: brk.u64(..40),
            // In the header, in the payload, or after the whole frame.
            after: [brk.u64(..40), brk.u64(40..200), u64::MAX][brk.usize(..3)],
        },
        f => f,
    };
    let async_pairs = rng.usize(..10) < 3;
    let shm = rng.bool();
    let window = [Options::default().receive_window, 2048, 512, 1][rng.usize(..4)];
    let hosts = (shm && rng.bool()).then(|| {
        let k = rng.usize(2..=3);
        (0..n).map(|_| rng.usize(..k)).collect()
    });
    Scenario {
        n,
        program,
        fault,
        async_pairs,
        shm,
        window,
        hosts,
    }
}

fn sim_opts(shm: bool, window: usize) -> Options {
    Options {
        shared_memory: shm,
        receive_window: window,
        // Rounds of 512 bytes: buffers of a few hundred elements take several.
        shm_slot_bytes: 512,
        timeout: TIMEOUT,
        // Small segments and thresholds, so small buffers take every path:
        // segmented rings and chains, trees, recursive doubling.
        segment_bytes: 512,
        small_bytes: 256,
        // Notice a peer that never connected soon (the default is 250 ms).
        probe_after: Duration::from_millis(20),
        ..opts()
    }
}

/// One rank's result of one op: the buffer it returned (empty for a barrier
/// or a non-root's gather), as i64 for comparison.
type Out = Vec<i64>;

fn to_i64<T: Element>(v: &[T]) -> Out {
    // The test values are small integers, exact in every type.
    v.iter()
        .map(|x| format!("{x:?}").parse::<f64>().expect("a number") as i64)
        .collect()
}

/// Runs `op` as rank `rank` of op index `i`.
fn run<'a>(
    pg: &'a ProcessGroup,
    seed: u64,
    i: usize,
    op: Op,
) -> Pin<Box<dyn Future<Output = Result<Out, Error>> + Send + 'a>> {
    match op.ty {
        Ty::I32 => Box::pin(run_typed::<i32>(pg, seed, i, op)),
        Ty::F32 => Box::pin(run_typed::<f32>(pg, seed, i, op)),
    }
}

type Running<'a> = Pin<Box<dyn Future<Output = Result<Out, Error>> + Send + 'a>>;

/// Starts `op` with its `*_async` form (see [`Op::has_async`]): the
/// sequence number is taken now.
fn start_async<'a>(pg: &ProcessGroup, seed: u64, i: usize, op: Op) -> Running<'a> {
    match op.ty {
        Ty::I32 => start_typed::<i32>(pg, seed, i, op),
        Ty::F32 => start_typed::<f32>(pg, seed, i, op),
    }
}

fn start_typed<'a, T: Element>(pg: &ProcessGroup, seed: u64, i: usize, op: Op) -> Running<'a> {
    let (r, c) = (pg.rank(), op.count);
    match op.kind {
        Kind::AllReduce(o, a) => {
            let pg = a.map_or_else(|| pg.clone(), |a| pg.with_all_reduce_algorithm(a));
            let w = pg.all_reduce_async(input::<T>(seed, i, r, c), o);
            Box::pin(async move { w.wait().await.map(|b| to_i64(&b)) })
        }
        Kind::Broadcast(root, a) => {
            let pg = a.map_or_else(|| pg.clone(), |a| pg.with_broadcast_algorithm(a));
            let w = pg.broadcast_async(input::<T>(seed, i, r, c), root);
            Box::pin(async move { w.wait().await.map(|b| to_i64(&b)) })
        }
        Kind::AllGather => {
            let w = pg.all_gather_async(input::<T>(seed, i, r, c));
            Box::pin(async move { w.wait().await.map(|b| to_i64(&b)) })
        }
        Kind::Barrier => {
            let w = pg.barrier_async();
            Box::pin(async move { w.wait().await.map(|()| Vec::new()) })
        }
        Kind::Reduce(root, o) => {
            let w = pg.reduce_async(input::<T>(seed, i, r, c), root, o);
            Box::pin(async move {
                w.wait()
                    .await
                    .map(|b| if r == root { to_i64(&b) } else { Vec::new() })
            })
        }
        Kind::Gather(root) => {
            let w = pg.gather_async(input::<T>(seed, i, r, c), root);
            Box::pin(async move {
                w.wait()
                    .await
                    .map(|g| g.map_or_else(Vec::new, |g| to_i64(&g)))
            })
        }
        Kind::Scatter(root) => {
            let n = pg.size();
            let all = (r == root).then(|| input::<T>(seed, i, root, c * n));
            let w = pg.scatter_async(all, c, root);
            Box::pin(async move { w.wait().await.map(|b| to_i64(&b)) })
        }
        Kind::ReduceScatter(o) => {
            let w = pg.reduce_scatter_async(input::<T>(seed, i, r, c * pg.size()), o);
            Box::pin(async move { w.wait().await.map(|b| to_i64(&b)) })
        }
        Kind::AllToAll => {
            let w = pg.all_to_all_async(input::<T>(seed, i, r, c * pg.size()));
            Box::pin(async move { w.wait().await.map(|b| to_i64(&b)) })
        }
        Kind::AllGatherV => {
            let w = pg.all_gather_varying_async(input::<T>(seed, i, r, varying_len(c, r)));
            Box::pin(async move {
                w.wait()
                    .await
                    .map(|v| v.iter().flat_map(|b| to_i64(b)).collect())
            })
        }
        Kind::Exchange(shift) => {
            let n = pg.size();
            let rx = pg.recv_async::<T>(c, (r + n - shift) % n, i as u32);
            let tx = pg.send_async(input::<T>(seed, i, r, c), (r + shift) % n, i as u32);
            Box::pin(async move {
                tx.wait().await?;
                rx.wait().await.map(|b| to_i64(&b))
            })
        }
    }
}

/// Rank `rank`'s input to op `i`: `len` small values.
fn input<T: Element>(seed: u64, i: usize, rank: usize, len: usize) -> Vec<T> {
    data(seed ^ ((i as u64 + 1) << 32), rank, len)
}

async fn run_typed<T: Element>(
    pg: &ProcessGroup,
    seed: u64,
    i: usize,
    op: Op,
) -> Result<Out, Error> {
    let (n, r, c) = (pg.size(), pg.rank(), op.count);
    match op.kind {
        Kind::Barrier => pg.barrier().await.map(|()| Vec::new()),
        Kind::AllReduce(o, a) => {
            let pg = match a {
                Some(a) => pg.with_all_reduce_algorithm(a),
                None => pg.clone(),
            };
            let mut b = input::<T>(seed, i, r, c);
            pg.all_reduce(&mut b, o).await.map(|()| to_i64(&b))
        }
        Kind::Broadcast(root, a) => {
            let pg = match a {
                Some(a) => pg.with_broadcast_algorithm(a),
                None => pg.clone(),
            };
            let mut b = input::<T>(seed, i, r, c);
            pg.broadcast(&mut b, root).await.map(|()| to_i64(&b))
        }
        Kind::Reduce(root, o) => {
            let mut b = input::<T>(seed, i, r, c);
            pg.reduce(&mut b, root, o)
                .await
                .map(|()| if r == root { to_i64(&b) } else { Vec::new() })
        }
        Kind::AllGather => {
            let mut out = vec![T::from_i8(0); c * n];
            pg.all_gather(&input::<T>(seed, i, r, c), &mut out)
                .await
                .map(|()| to_i64(&out))
        }
        Kind::Gather(root) => pg
            .gather(&input::<T>(seed, i, r, c), root)
            .await
            .map(|g| g.map_or_else(Vec::new, |g| to_i64(&g))),
        Kind::Scatter(root) => {
            let all = input::<T>(seed, i, root, c * n);
            let mut out = vec![T::from_i8(0); c];
            pg.scatter((r == root).then_some(&all[..]), &mut out, root)
                .await
                .map(|()| to_i64(&out))
        }
        Kind::ReduceScatter(o) => {
            let mut out = vec![T::from_i8(0); c];
            pg.reduce_scatter(&input::<T>(seed, i, r, c * n), &mut out, o)
                .await
                .map(|()| to_i64(&out))
        }
        Kind::AllToAll => {
            let mut out = vec![T::from_i8(0); c * n];
            pg.all_to_all(&input::<T>(seed, i, r, c * n), &mut out)
                .await
                .map(|()| to_i64(&out))
        }
        Kind::AllGatherV => pg
            .all_gather_varying(&input::<T>(seed, i, r, varying_len(c, r)))
            .await
            .map(|v| v.iter().flat_map(|b| to_i64(b)).collect()),
        Kind::Exchange(shift) => {
            // The receive is posted first, so that a send larger than the
            // receive window does not wait for it (see the README).
            let rx = pg.recv_async::<T>(c, (r + n - shift) % n, i as u32);
            pg.send(&input::<T>(seed, i, r, c), (r + shift) % n, i as u32)
                .await?;
            rx.wait().await.map(|b| to_i64(&b))
        }
    }
}

/// What rank `r` must get from op `i` when every rank called `op`.
fn expected(seed: u64, i: usize, op: Op, n: usize, r: usize) -> Out {
    match op.ty {
        Ty::I32 => expected_typed::<i32>(seed, i, op, n, r),
        Ty::F32 => expected_typed::<f32>(seed, i, op, n, r),
    }
}

fn expected_typed<T: Element>(seed: u64, i: usize, op: Op, n: usize, r: usize) -> Out {
    let c = op.count;
    let reduce_all = |o: ReduceOp, len: usize| {
        let mut acc = input::<T>(seed, i, 0, len);
        for q in 1..n {
            T::reduce(o, &mut acc, &input::<T>(seed, i, q, len));
        }
        acc
    };
    match op.kind {
        Kind::Barrier => Vec::new(),
        Kind::AllReduce(o, _) => to_i64(&reduce_all(o, c)),
        Kind::Broadcast(root, _) => to_i64(&input::<T>(seed, i, root, c)),
        Kind::Reduce(root, o) if r == root => to_i64(&reduce_all(o, c)),
        Kind::Reduce(..) => Vec::new(),
        Kind::AllGather => (0..n)
            .flat_map(|q| to_i64(&input::<T>(seed, i, q, c)))
            .collect(),
        Kind::Gather(root) if r == root => (0..n)
            .flat_map(|q| to_i64(&input::<T>(seed, i, q, c)))
            .collect(),
        Kind::Gather(_) => Vec::new(),
        Kind::Scatter(root) => to_i64(&input::<T>(seed, i, root, c * n)[r * c..(r + 1) * c]),
        Kind::ReduceScatter(o) => to_i64(&reduce_all(o, c * n)[r * c..(r + 1) * c]),
        Kind::AllToAll => (0..n)
            .flat_map(|q| to_i64(&input::<T>(seed, i, q, c * n)[r * c..(r + 1) * c]))
            .collect(),
        Kind::Exchange(shift) => to_i64(&input::<T>(seed, i, (r + n - shift) % n, c)),
        Kind::AllGatherV => (0..n)
            .flat_map(|q| to_i64(&input::<T>(seed, i, q, varying_len(c, q))))
            .collect(),
    }
}

/// A rank's run: the results of the ops it finished, then its error if any.
struct Run {
    done: Vec<Out>,
    error: Option<Error>,
    killed: bool,
    /// Its connection was broken by a `Break` fault.
    broke: bool,
}

async fn play(seed: u64, s: &Scenario) -> Vec<Run> {
    let pgs = group_each(s.n, |r| Options {
        host_id: s.hosts.as_ref().map(|h| format!("host{}", h[r])),
        ..sim_opts(s.shm, s.window)
    })
    .await;
    match s.fault {
        Fault::Kill { rank, frame } => match frame {
            None => pgs[rank].kill(),
            Some(k) => pgs[rank].kill_at_frame(k),
        },
        Fault::Break { rank, frame, after } => pgs[rank].break_at_frame(frame, after),
        _ => {}
    }
    let tasks: Vec<_> = pgs
        .into_iter()
        .map(|pg| {
            let mut program = s.program.clone();
            if let Fault::Mismatch { at, rank, op } = s.fault {
                if rank == pg.rank() {
                    program[at] = op;
                }
            }
            let async_pairs = s.async_pairs;
            tokio::spawn(async move {
                let mut done = Vec::new();
                let mut i = 0;
                while i < program.len() {
                    let mut started = Vec::new();
                    if async_pairs
                        && i + 1 < program.len()
                        && program[i].has_async()
                        && program[i + 1].has_async()
                    {
                        // Both take their sequence numbers now, in order.
                        started.push(start_async(&pg, seed, i, program[i]));
                        started.push(start_async(&pg, seed, i + 1, program[i + 1]));
                    } else {
                        started.push(run(&pg, seed, i, program[i]));
                    }
                    i += started.len();
                    for op in started {
                        match op.await {
                            Ok(out) => done.push(out),
                            Err(e) => {
                                return Run {
                                    done,
                                    error: Some(e),
                                    killed: pg.killed(),
                                    broke: pg.broke(),
                                }
                            }
                        }
                    }
                }
                // Dropping `pg` here is the process exiting.
                Run {
                    done,
                    error: None,
                    killed: pg.killed(),
                    broke: pg.broke(),
                }
            })
        })
        .collect();
    let mut runs = Vec::new();
    for t in tasks {
        runs.push(t.await.expect("a rank panicked"));
    }
    runs
}

/// The first index at or after `from` whose op depends on every rank, as
/// rank `r` calls it (its program's length if none).
fn first_all_dependent(program: &[Op], from: usize, r: usize) -> usize {
    (from..program.len())
        .find(|&i| program[i].depends_on_all(r))
        .unwrap_or(program.len())
}

/// Ranks named as gone in `text`.
fn named_gone(text: &str) -> Vec<usize> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(" is gone") {
        let head = &rest[..at];
        if let Some(num) = head.rsplit("rank ").next() {
            if let Ok(r) = num.trim().parse() {
                out.push(r);
            }
        }
        rest = &rest[at + 1..];
    }
    out
}

fn check(seed: u64, s: &Scenario, runs: &[Run]) -> Result<(), String> {
    let n = s.n;
    let len = s.program.len();
    // With ops started two at a time, the op after the fault's may have
    // begun (and sent its frames) everywhere before the news arrived.
    let in_flight = usize::from(s.async_pairs);
    // Invariant 1.
    for (r, run) in runs.iter().enumerate() {
        if let Some(e @ Error::Timeout { .. }) = &run.error {
            return Err(format!("rank {r} timed out: {e}"));
        }
    }
    let program_of = |r: usize| -> Vec<Op> {
        let mut p = s.program.clone();
        if let Fault::Mismatch { at, rank, op } = s.fault {
            if rank == r {
                p[at] = op;
            }
        }
        p
    };
    // A rank that failed in an exchange (aborts fail messages) and exited
    // leaves the collectives it had not finished to fail elsewhere.
    let cascade = runs.iter().enumerate().any(|(q, run)| {
        run.error.is_some()
            && !run.killed
            && program_of(q)
                .get(run.done.len())
                .is_some_and(|o| !o.collective())
    });
    // Invariant 2: results, for ops every rank called alike.
    let alike = |i: usize| !matches!(s.fault, Fault::Mismatch { at, .. } if at <= i);
    for (r, run) in runs.iter().enumerate() {
        if run.killed {
            continue;
        }
        for (i, out) in run.done.iter().enumerate() {
            if alike(i) && *out != expected(seed, i, s.program[i], n, r) {
                return Err(format!(
                    "rank {r}: op {i} ({:?}) returned a wrong result",
                    s.program[i]
                ));
            }
        }
    }
    match &s.fault {
        Fault::None => {
            for (r, run) in runs.iter().enumerate() {
                if let Some(e) = &run.error {
                    return Err(format!("rank {r} failed with no fault: {e}"));
                }
            }
        }
        Fault::Mismatch { at, .. } => {
            // Invariant 3.
            for (r, run) in runs.iter().enumerate() {
                let failed_at = run.done.len();
                let p = program_of(r);
                let bound = if p[*at].depends_on_all(r) {
                    *at
                } else {
                    first_all_dependent(&p, *at + 1 + in_flight, r)
                };
                match &run.error {
                    None if bound < len => {
                        return Err(format!(
                            "rank {r} finished every op, though op {bound} depends on every rank after the mismatch at op {at}"
                        ))
                    }
                    None => {}
                    Some(e) => {
                        let t = e.to_string();
                        if failed_at < *at && p[failed_at].collective() && !cascade {
                            return Err(format!("rank {r} failed at op {failed_at}, before the mismatch at op {at}: {t}"));
                        }
                        if failed_at > bound {
                            return Err(format!("rank {r} failed only at op {failed_at}, after op {bound} that depends on every rank: {t}"));
                        }
                        // A rank that finished its program and exited can
                        // be all another rank knows: it needed that rank, in
                        // its own view of the mismatched op, and found it gone.
                        let exited = |g: &usize| {
                            runs[*g].error.is_none() && runs[*g].done.len() == len
                        };
                        let gone = named_gone(&t);
                        // The mismatch named is this one: its op, and the
                        // deviant's call as one side.
                        let deviant = match &s.fault {
                            Fault::Mismatch { rank, .. } => *rank,
                            _ => unreachable!(),
                        };
                        // Collectives are numbered in the group without the
                        // messages; a message's mismatch names its sender
                        // and receiver, one of them the deviant.
                        // all_gather_varying takes two numbers; a type
                        // changed in one shows at its second (the data's).
                        let seq: usize = s.program[..*at].iter().map(Op::seqs).sum();
                        let at_seq = |q: usize| t.contains(&format!("at op #{q}:"));
                        // A deviant call that takes another count of numbers
                        // (all_gather_varying takes two) misaligns every
                        // later call. Calls carry their history, so a later
                        // clash is known as a consequence: the error names
                        // the first mismatch (every rank is alive here to
                        // report it, so never "diverged before" a later op).
                        let names_it = if s.program[*at].collective() {
                            t.contains("mismatched collectives")
                                && (at_seq(seq)
                                    || (s.program[*at].kind == Kind::AllGatherV && at_seq(seq + 1))
                                )
                                && t.contains(&format!("rank {deviant} called"))
                        } else {
                            t.contains("mismatched message")
                                && t.contains(&format!("of tag {at} "))
                                && (t.contains(&format!("rank {deviant} sent"))
                                    || t.contains(&format!("rank {deviant} expected")))
                        };
                        // Where the ranks that could compare at the mismatch
                        // exited before its frames reached them, the
                        // others can know only that later calls diverged
                        // (the README's fallback, after the grace): the
                        // deviant's calls named so, and some rank exited.
                        let diverged_after_exit = t.contains("diverged before op #")
                            && t.contains(&format!("rank {deviant} called"))
                            && (0..n).any(|g| exited(&g));
                        let explained = names_it
                            || diverged_after_exit
                            || (!gone.is_empty() && gone.iter().all(exited));
                        if !explained {
                            return Err(format!("rank {r}'s error names neither the mismatch nor a rank that exited: {t}"));
                        }
                    }
                }
            }
        }
        Fault::Break { rank: breaker, .. } => {
            // Invariant 5.
            if !runs[*breaker].broke {
                if let Some((r, e)) = runs
                    .iter()
                    .enumerate()
                    .find_map(|(r, run)| Some((r, run.error.as_ref()?)))
                {
                    return Err(format!(
                        "no connection was broken, yet rank {r} failed: {e}"
                    ));
                }
                return Ok(());
            }
            // A rank that finished its program exited: one that needed a
            // frame it lost with the connection may find it gone first.
            let finished = |g: &usize| runs[*g].error.is_none() && runs[*g].done.len() == len;
            for (r, run) in runs.iter().enumerate() {
                let Some(e) = &run.error else { continue };
                let t = e.to_string();
                let gone = named_gone(&t);
                if let Some(g) = gone.iter().find(|g| !finished(g)) {
                    return Err(format!(
                        "rank {r}'s error names rank {g} gone, which had not exited: {t}"
                    ));
                }
                if gone.is_empty() && !t.contains("broke part-way") {
                    return Err(format!("rank {r}'s error names neither the broken connection nor a rank that exited: {t}"));
                }
            }
        }
        Fault::Kill { rank: victim, .. } => {
            // Invariant 4. The op the victim died in (it may also not have
            // died: its program ended before its frame came).
            let vrun = &runs[*victim];
            if !vrun.killed {
                if vrun.error.is_some() || runs.iter().any(|r| r.error.is_some()) {
                    return Err("the victim was never killed, yet a rank failed".into());
                }
                return Ok(());
            }
            let died_in = vrun.done.len();
            for (r, run) in runs.iter().enumerate() {
                if r == *victim {
                    continue;
                }
                let bound = first_all_dependent(&s.program, died_in + 1 + in_flight, r);
                let failed_at = run.done.len();
                match &run.error {
                    None if bound < len => {
                        return Err(format!(
                            "survivor {r} finished every op, though op {bound} depends on every rank after rank {victim} died in op {died_in}"
                        ))
                    }
                    None => {}
                    Some(e) => {
                        let t = e.to_string();
                        if failed_at < died_in && s.program[failed_at].collective() && !cascade {
                            return Err(format!("survivor {r} failed at op {failed_at}, before rank {victim} died in op {died_in}: {t}"));
                        }
                        if failed_at > bound {
                            return Err(format!("survivor {r} failed only at op {failed_at}, after op {bound} that depends on every rank: {t}"));
                        }
                        let gone = named_gone(&t);
                        if !gone.contains(victim) {
                            return Err(format!("survivor {r}'s error does not name rank {victim} as gone: {t}"));
                        }
                        if let Some(b) = gone.iter().find(|&&g| g != *victim) {
                            return Err(format!("survivor {r}'s error names live rank {b} as gone: {t}"));
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Lines of trace a failing seed prints.
const TRACE_LINES: usize = 400;

/// The debug trace of the scenario running (see the module docs).
static TRACE: std::sync::Mutex<Vec<u8>> = std::sync::Mutex::new(Vec::new());

struct TraceWriter;

impl std::io::Write for TraceWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut t = TRACE.lock().unwrap_or_else(|e| e.into_inner());
        t.extend_from_slice(buf);
        // Bounded: a scenario that traces without end keeps its latest
        // 2–4 MiB (whole lines: each write is one).
        if t.len() > 4 << 20 {
            let cut = t.len() - (2 << 20);
            t.drain(..cut);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Starts tracing the group's debug events into [`TRACE`], emptied.
fn trace_start() {
    static INIT: std::sync::Once = std::sync::Once::new();
    INIT.call_once(|| {
        let _ = tracing_subscriber::fmt()
            .with_env_filter("rallypoint_collectives=debug")
            .with_writer(|| TraceWriter)
            .with_timer(tracing_subscriber::fmt::time::uptime())
            .with_ansi(false)
            .with_target(false)
            .try_init();
    });
    TRACE.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

/// The last [`TRACE_LINES`] lines of the trace.
fn trace_tail() -> String {
    let t = TRACE.lock().unwrap_or_else(|e| e.into_inner());
    let text = String::from_utf8_lossy(&t);
    let lines: Vec<&str> = text.lines().collect();
    let from = lines.len().saturating_sub(TRACE_LINES);
    lines[from..].join("\n")
}

async fn one(seed: u64) -> Result<(), String> {
    trace_start();
    let s = scenario(seed);
    // A hang is caught by the op timeout (invariant 1); this bounds the test.
    let runs = tokio::time::timeout(TIMEOUT * 2, play(seed, &s))
        .await
        .map_err(|_| format!("the scenario hung past {:?}", TIMEOUT * 2))?;
    check(seed, &s, &runs).map_err(|e| {
        let mut t = format!("{e}\n  scenario: {s:?}\n  runs:\n");
        for (r, run) in runs.iter().enumerate() {
            t += &format!(
                "    rank {r}: {} ops done, killed {}, error: {:?}\n",
                run.done.len(),
                run.killed,
                run.error.as_ref().map(ToString::to_string)
            );
        }
        t + "  trace:\n" + &trace_tail()
    })
}

fn replay_command(seed: u64) -> String {
    format!(
        "RALLY_SIM_SEED={seed} cargo nextest run -p rallypoint-collectives --all-features sim::replay --no-capture"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_schedules_of_mismatches_and_deaths_keep_the_promises() {
    let seeds: u64 = std::env::var("RALLY_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    let base: u64 = std::env::var("RALLY_SIM_FIRST")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let mut failed = Vec::new();
    for seed in base..base + seeds {
        if let Err(e) = one(seed).await {
            eprintln!(
                "seed {seed} FAILED: {e}\n  replay: {}",
                replay_command(seed)
            );
            failed.push(seed);
        }
    }
    assert!(failed.is_empty(), "seeds {failed:?} failed (see above)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay() {
    let Some(seed) = std::env::var("RALLY_SIM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    else {
        return;
    };
    eprintln!("{:#?}", scenario(seed));
    let r = one(seed).await;
    // `RALLY_SIM_TRACE=1`: the trace of a seed that passed, too.
    if r.is_ok() && std::env::var_os("RALLY_SIM_TRACE").is_some() {
        eprintln!("trace:\n{}", trace_tail());
    }
    if let Err(e) = r {
        panic!("seed {seed}: {e}");
    }
}
