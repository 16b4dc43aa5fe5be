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

/// The least work of a split shared-memory all-reduce (`shm/ops.rs`),
/// without the stages between, in rounds of the library's size here
/// (`split_round_bytes`): each round, every thread copies the parts
/// of the round the others sum into its half, sums its own `1/n` part from
/// the other `n − 1` threads' halves into its buffer (8 KiB blocks, as the
/// library does) and copies each summed block into its half, then copies
/// the other parts out of the others' halves. Optimistic: the halves it
/// reads are written once, before the clock starts, and only read (so no
/// thread waits for another, and they stay in cache, where a rank's peers
/// rewrite theirs every round). f32 `bytes` per second of the slowest
/// thread (best of 3): the algbw no such all-reduce passes here.
pub(crate) fn reduce_ceiling(n: usize, bytes: usize) -> f64 {
    let slot = split_round_bytes(n, Options::default().shm_slot_bytes) / 4;
    let count = bytes / 4;
    // As the library's `BLOCK_BYTES` (private to it; `shm/ops.rs`).
    let block = (8 << 10) / 4;
    let halves: Vec<Vec<f32>> = (0..n).map(|_| vec![1.0f32; slot]).collect();
    let secs = slowest_thread(n, |me, start| {
        let mut user = vec![1.0f32; count];
        let mut half = vec![0.0f32; slot];
        start.wait();
        let t = Instant::now();
        for round in user.chunks_mut(slot) {
            let len = round.len();
            let part = |k: usize| len * k / n..len * (k + 1) / n;
            let h = &mut half[..len];
            for k in (0..n).filter(|&k| k != me) {
                h[part(k)].copy_from_slice(std::hint::black_box(&round[part(k)]));
            }
            let mine = part(me);
            for at in mine.clone().step_by(block) {
                let b = at..(at + block).min(mine.end);
                for k in (0..n).filter(|&k| k != me) {
                    let src = std::hint::black_box(&halves[k][b.clone()]);
                    f32::reduce(ReduceOp::Sum, &mut round[b.clone()], src);
                }
                h[b.clone()].copy_from_slice(&round[b]);
            }
            for k in (0..n).filter(|&k| k != me) {
                round[part(k)].copy_from_slice(std::hint::black_box(&halves[k][part(k)]));
            }
        }
        std::hint::black_box((&user, &half));
        t.elapsed().as_secs_f64()
    });
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

/// Four halves (two per thread) that the threads hand over by the
/// meeting protocol: a thread writes its half `h` of a round before it
/// arrives at the round's stage, and the other reads it only after; the
/// half is next written two rounds on, after the other has arrived at the
/// round between (so after it read).
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
