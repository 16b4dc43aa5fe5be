//! What the machine allows, measured in the same run as the collectives:
//! single-thread memcpy, the copies (and sums) a shared-memory all-reduce
//! cannot avoid, and the host's cross-core penalty at this moment.
//!
//! The last one exists because of this VM. Every so often, for seconds at a
//! time, moving cache lines between its two vCPUs gets several times (4–9x)
//! slower while work that stays on one core does not (the host moves or
//! shares the physical cores under them; nothing inside the VM changes).
//! Any collective between ranks on different cores slows in such a period,
//! ours and gloo's alike, so a side measured in one and the other side
//! outside it give a ratio that says nothing about either. [`cross_core`]
//! measures the penalty in a few milliseconds; the bench runs it before and
//! after every side and prints it beside the ratio, so that pairs measured
//! in different conditions can be told apart.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use rallypoint_collectives::{split_round_bytes, Element, Options, ReduceOp};

/// Single-thread memcpy between two fresh buffers of `bytes`, bytes/s (best of 5).
pub(crate) fn memcpy_rate(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t0 = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        best = best.min(t0.elapsed().as_secs_f64());
    }
    bytes as f64 / best
}

/// Runs `work(me)` on `n` threads at once, three times, and returns the
/// slowest thread's seconds, best of the three. `work` prepares what it
/// needs, waits on the barrier it is given, and returns the seconds it took
/// after that.
fn slowest_thread(n: usize, work: impl Fn(usize, &std::sync::Barrier) -> f64 + Sync) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..3 {
        let start = std::sync::Barrier::new(n);
        let slowest = std::thread::scope(|s| {
            let threads: Vec<_> = (0..n)
                .map(|me| {
                    let (start, work) = (&start, &work);
                    s.spawn(move || work(me, start))
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().expect("ceiling thread"))
                .fold(0.0, f64::max)
        });
        best = best.min(slowest);
    }
    best
}

/// `n` threads at once, each copying `bytes` through a half of the
/// library's default slot (1 MiB) and back out, a round at a time (a rank's
/// least work in a shared-memory all-reduce): `bytes` per second of the
/// slowest thread (best of 3), the algbw no such all-reduce passes here.
pub(crate) fn copy_ceiling(n: usize, bytes: usize) -> f64 {
    let slot = Options::default().shm_slot_bytes;
    let secs = slowest_thread(n, |_, start| {
        // Touched before the clock starts, as a rank's are.
        let mut user = vec![1u8; bytes];
        let mut half = vec![0u8; slot];
        start.wait();
        let t = Instant::now();
        for round in user.chunks_mut(slot) {
            let h = &mut half[..round.len()];
            h.copy_from_slice(std::hint::black_box(round));
            round.copy_from_slice(std::hint::black_box(h));
        }
        std::hint::black_box((&user, &half));
        t.elapsed().as_secs_f64()
    });
    bytes as f64 / secs
}

/// The split shared-memory all-reduce (`shm/ops.rs`) as `n` ranks would
/// run it with nothing lost to waiting. One thread per CPU this process may
/// use (at most `n`), each running its ranks (`c`, `c + threads`, ...) back
/// to back through each phase of a round, as ranks that share a core take
/// turns, and meeting the other threads at a spin barrier where the ranks
/// meet at a stage. The same copies and sums in the same rounds
/// (`split_round_bytes`), the halves rewritten by their ranks every round
/// and read on other cores; only the stages cost less (a spin among
/// threads: no process switch, no yield, no sleep). f32 `bytes` per second
/// of the slowest thread (best of 3): the algbw our all-reduce would reach
/// here with perfect waiting.
pub(crate) fn reduce_ceiling(n: usize, bytes: usize) -> f64 {
    let threads = std::thread::available_parallelism()
        .map_or(1, |c| c.get())
        .min(n);
    let per = split_round_bytes(n, Options::default().shm_slot_bytes) / 4;
    let count = bytes / 4;
    // As the library's `BLOCK_BYTES` (private to it; `shm/ops.rs`).
    let block = (8 << 10) / 4;
    let mut store: Vec<Vec<f32>> = (0..2 * n).map(|_| vec![0.0f32; per]).collect();
    let halves = Halves {
        ptr: store.iter_mut().map(|h| h.as_mut_ptr()).collect(),
        len: per,
    };
    let arrived: Vec<AtomicU64> = (0..threads).map(|_| AtomicU64::new(0)).collect();
    let (halves, arrived) = (&halves, &arrived);
    let secs = slowest_thread(threads, |c, start| {
        pin_thread(c);
        let ranks: Vec<usize> = (c..n).step_by(threads).collect();
        let mut users: Vec<Vec<f32>> = ranks.iter().map(|_| vec![1.0f32; count]).collect();
        let meet = || {
            let stage = arrived[c].load(Ordering::Relaxed) + 1;
            arrived[c].store(stage, Ordering::Release);
            for a in arrived {
                while a.load(Ordering::Acquire) < stage {
                    std::hint::spin_loop();
                }
            }
        };
        // Elements `r` of rank `k`'s half `h`, to write and to read.
        // SAFETY: (every use) the ranges a phase writes are written by one
        // rank only and read by none until the next meeting, as in the
        // library (see `Halves`).
        let half = |k: usize, h: usize, r: Range<usize>| unsafe {
            std::slice::from_raw_parts_mut(halves.ptr[2 * k + h].add(r.start), r.len())
        };
        // SAFETY: as above.
        let read = |k: usize, h: usize, r: Range<usize>| unsafe {
            std::slice::from_raw_parts(halves.ptr[2 * k + h].add(r.start) as *const f32, r.len())
        };
        start.wait();
        let t = Instant::now();
        let mut h = 0;
        for at in (0..count).step_by(halves.len) {
            let len = halves.len.min(count - at);
            let part = |k: usize| len * k / n..len * (k + 1) / n;
            for (user, &me) in users.iter().zip(&ranks) {
                let round = &user[at..at + len];
                for k in (0..n).filter(|&k| k != me) {
                    half(me, h, part(k)).copy_from_slice(std::hint::black_box(&round[part(k)]));
                }
            }
            meet();
            for (user, &me) in users.iter_mut().zip(&ranks) {
                let mine = part(me);
                for b0 in mine.clone().step_by(block) {
                    let b = b0..(b0 + block).min(mine.end);
                    let acc = &mut user[at + b.start..at + b.end];
                    for k in (0..n).filter(|&k| k != me) {
                        f32::reduce(
                            ReduceOp::Sum,
                            acc,
                            std::hint::black_box(read(k, h, b.clone())),
                        );
                    }
                    half(me, h, b).copy_from_slice(acc);
                }
            }
            meet();
            for (user, &me) in users.iter_mut().zip(&ranks) {
                for k in (0..n).filter(|&k| k != me) {
                    let q = part(k);
                    user[at + q.start..at + q.end].copy_from_slice(read(k, h, q));
                }
            }
            h ^= 1;
        }
        std::hint::black_box(&users);
        t.elapsed().as_secs_f64()
    });
    drop(store);
    bytes as f64 / secs
}

/// The host's cross-core penalty now: `(crossing, private)` in bytes/s.
///
/// Two threads, on CPUs 0 and 1, do the two-rank shared-memory all-reduce's
/// work on `bytes` of f32 each: copy a round into their own 1 MiB half,
/// meet (spinning), sum the other thread's half into their buffer. So every
/// summed byte was written on the other core (`crossing`). Then the same
/// again, each summing its own previous half instead (`private`): the same
/// instructions, and nothing crosses cores but the meeting. `private /
/// crossing` is about 1 in a normal period and 5–9 in a slow one.
pub(crate) fn cross_core(bytes: usize) -> (f64, f64) {
    let crossing = exchange(bytes, true);
    let private = exchange(bytes, false);
    (bytes as f64 / crossing, bytes as f64 / private)
}

/// Halves (two per rank) that threads hand over by the meeting protocol:
/// a thread writes (a range of) a half `h` of a round before it arrives at
/// the round's meeting, and the others read it only after; the half is next
/// written two rounds on, after every other thread has arrived at a meeting
/// between (so after it read).
struct Halves {
    ptr: Vec<*mut f32>,
    len: usize,
}

// SAFETY: the pointers are only dereferenced under the meeting protocol
// above, which orders every write before every read of the same half.
unsafe impl Sync for Halves {}

fn exchange(bytes: usize, crossing: bool) -> f64 {
    let slot = Options::default().shm_slot_bytes / 4;
    let count = bytes / 4;
    let mut store: Vec<Vec<f32>> = (0..4).map(|_| vec![0.0f32; slot]).collect();
    let halves = Halves {
        ptr: store.iter_mut().map(|h| h.as_mut_ptr()).collect(),
        len: slot,
    };
    let arrived = [AtomicU64::new(0), AtomicU64::new(0)];
    let halves = &halves;
    let secs = slowest_thread(2, |me, start| {
        pin_thread(me);
        let mut user = vec![0.0f32; count];
        start.wait();
        let t = Instant::now();
        let mut h = 0;
        for round in user.chunks_mut(halves.len) {
            let len = round.len();
            // SAFETY: this thread's half `h`, see `Halves`.
            let mine = unsafe { std::slice::from_raw_parts_mut(halves.ptr[2 * me + h], len) };
            mine.copy_from_slice(round);
            let stage = arrived[me].load(Ordering::Relaxed) + 1;
            arrived[me].store(stage, Ordering::Release);
            while arrived[1 - me].load(Ordering::Acquire) < stage {
                std::hint::spin_loop();
            }
            let from = if crossing {
                2 * (1 - me) + h
            } else {
                2 * me + (h ^ 1)
            };
            // SAFETY: written before the stage just passed (or, privately,
            // by this thread a round ago), see `Halves`.
            let theirs = unsafe { std::slice::from_raw_parts(halves.ptr[from], len) };
            f32::reduce(ReduceOp::Sum, round, std::hint::black_box(theirs));
            h ^= 1;
        }
        std::hint::black_box(&user);
        // Both counters end every run equal (the same rounds), so the next
        // of `slowest_thread`'s runs continues from them.
        t.elapsed().as_secs_f64()
    });
    drop(store);
    secs
}

/// Pins the calling thread to the `i`-th (mod their number) of the CPUs it
/// may run on now; says so on stderr when it cannot.
pub(crate) fn pin_thread(i: usize) {
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: a zeroed cpu_set_t is an empty set, filled by the kernel;
    // CPU_ISSET and CPU_SET stay within CPU_SETSIZE.
    unsafe {
        let mut allowed: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, size, &mut allowed) != 0 {
            eprintln!(
                "bench: reading this thread's CPUs failed: {}",
                std::io::Error::last_os_error()
            );
            return;
        }
        let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &allowed))
            .collect();
        if cpus.is_empty() {
            return;
        }
        let cpu = cpus[i % cpus.len()];
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, size, &set) != 0 {
            eprintln!(
                "bench: pinning to CPU {cpu} failed: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}
