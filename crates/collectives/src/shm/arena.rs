//! One group's shared-memory region: layout, the stage words ranks meet on,
//! and the liveness of the ranks that map it.
//!
//! ```text
//! 0        header: magic, nonce, ranks, slot bytes, split round, abort word
//! 4096     one 128-byte control line per rank:
//!            stage (futex word), waiters, state, pid, call (48 bytes)
//! page     per rank, two halves of `slot` bytes each (rank-major), each
//!          aligned to a cache line
//! ```
//!
//! Ranks meet at *stages*: each rank's stage word counts the stages it has
//! reached, and a rank waits until every other word has reached its own.
//! Before the first stage of an operation a rank writes its call (the frame
//! header a TCP frame would carry) into its control line, in one of two
//! places by the parity of the operation's number in the region; the stage
//! word's release store publishes it with everything else the rank wrote.
//!
//! A waiter spins briefly, then sleeps on the word of a rank that has not
//! arrived (`FUTEX_WAIT` with a time slice); a rank that arrives wakes its
//! word only when someone sleeps on it (`waiters`), so the common case is
//! one store and no system call.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};
use std::sync::Mutex;
use std::time::Duration;

use rallypoint_sync::MutexExt;

use super::sys;
use crate::frame::HEADER_LEN;

const MAGIC: u64 = u64::from_le_bytes(*b"rallyshm");
const HEAD: usize = 4096;
const CTL: usize = 128;
const PAGE: usize = 4096;
const LINE: usize = 64;

/// The first bytes of the region.
#[repr(C)]
struct Head {
    magic: AtomicU64,
    nonce: AtomicU64,
    n: AtomicU64,
    slot: AtomicU64,
    /// Bytes per rank a round of a split all-reduce moves: chosen once, by
    /// the creator, since every rank must run the same rounds and ranks in
    /// different cgroups could count different CPUs (see `ops::split_round_bytes`).
    split_round: AtomicU64,
    /// 0, or the rank that aborted the group plus one.
    abort: AtomicU32,
    /// The first operation (in the group's numbering) the abort fails;
    /// earlier ones go on, as over TCP. Only ever lowered.
    abort_from: AtomicU64,
}

/// A rank's control line.
#[repr(C)]
struct Ctl {
    stage: AtomicU32,
    waiters: AtomicU32,
    state: AtomicU32,
    pid: AtomicU32,
    /// The calls of this rank's last two operations (by their number's
    /// parity): a rank may write its next call before a slower one has
    /// compared the last, but never two ahead.
    call: [[AtomicU64; HEADER_LEN / 8]; 2],
}

const _: () = assert!(std::mem::size_of::<Ctl>() <= CTL);
const _: () = assert!(std::mem::size_of::<Head>() <= HEAD);

/// Where a rank is in the region's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Presence {
    /// It has not mapped the region yet.
    Absent,
    Here,
    /// It dropped the group.
    Left,
    /// Fault injection: it died.
    Killed,
}

impl Presence {
    fn code(self) -> u32 {
        self as u32
    }
    fn from_code(c: u32) -> Presence {
        match c {
            1 => Presence::Here,
            2 => Presence::Left,
            3 => Presence::Killed,
            _ => Presence::Absent,
        }
    }
}

/// Where this rank's next operation starts: its next stage, and the half of
/// every slot its next round writes. Every rank runs the same rounds, so the
/// cursors agree.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Cursor {
    pub stage: u32,
    pub half: usize,
    /// Operations run in the region.
    pub ops: u64,
    /// An operation stopped part-way here: the stages are out of step with
    /// the other ranks' (the group is aborted), so no later one may start.
    pub broken: bool,
}

/// Why a region could not be attached: a system error (`errno`), or
/// (`None`) a file that is not this group's region.
#[derive(Debug)]
pub(crate) struct AttachError {
    pub errno: Option<i32>,
    pub text: String,
}

/// A mapped region, as one rank.
pub(crate) struct Arena {
    base: *mut u8,
    len: usize,
    fd: OwnedFd,
    pub n: usize,
    pub me: usize,
    /// Bytes per half slot.
    pub slot: usize,
    /// Bytes per rank per round of a split all-reduce (at most `slot`), as
    /// the creator chose them.
    pub split_round: usize,
    data_at: usize,
    pub cursor: Mutex<Cursor>,
    pidfds: Mutex<HashMap<u32, Option<OwnedFd>>>,
}

// SAFETY: the mapping is shared memory whose words are accessed atomically,
// and whose data halves are accessed under the stage protocol (one writer,
// readers only after the writer's release store).
unsafe impl Send for Arena {}
// SAFETY: as for `Send` (above).
unsafe impl Sync for Arena {}

fn layout(n: usize, slot: usize) -> (usize, usize) {
    let data_at = (HEAD + n * CTL).next_multiple_of(PAGE);
    (data_at, data_at + 2 * n * slot)
}

impl Arena {
    /// Creates the region for `n` ranks with halves of `slot` bytes (at
    /// least 64 per rank, rounded up to a cache line) and split all-reduce
    /// rounds of `split_round(slot)` bytes (at most `slot`), as rank 0.
    pub fn create(
        n: usize,
        slot: usize,
        split_round: impl FnOnce(usize) -> usize,
        nonce: u64,
    ) -> io::Result<Arena> {
        let slot = slot.max(64 * n).next_multiple_of(LINE);
        let round = split_round(slot).clamp(1, slot);
        let (data_at, len) = layout(n, slot);
        let fd = sys::memfd(len)?;
        let base = sys::map(&fd, len)?;
        let a = Arena::new(base, len, fd, (n, 0), (slot, round), data_at);
        let h = a.head();
        h.nonce.store(nonce, Relaxed);
        h.n.store(n as u64, Relaxed);
        h.slot.store(slot as u64, Relaxed);
        h.split_round.store(round as u64, Relaxed);
        h.abort_from.store(u64::MAX, Relaxed);
        h.magic.store(MAGIC, Release);
        a.join();
        Ok(a)
    }

    /// Maps the region rank 0 (process `pid`) created as its descriptor
    /// `fd`, as rank `me`, checking that it is this group's.
    pub fn attach(
        pid: u32,
        fd: i32,
        n: usize,
        me: usize,
        nonce: u64,
    ) -> Result<Arena, AttachError> {
        let sys_err = |what: String, e: io::Error| AttachError {
            errno: e.raw_os_error(),
            text: format!("{what}: {e}"),
        };
        let not_ours = |text: String| AttachError { errno: None, text };
        let fd = sys::open_of(pid, fd).map_err(|e| {
            sys_err(
                format!("opening its shared memory (/proc/{pid}/fd/{fd})"),
                e,
            )
        })?;
        let len = sys::file_len(&fd).map_err(|e| sys_err("fstat".into(), e))? as usize;
        if len < HEAD + n * CTL {
            return Err(not_ours(format!(
                "its descriptor has {len} bytes, too few for {n} ranks: not this group's shared memory"
            )));
        }
        let base =
            sys::map(&fd, len).map_err(|e| sys_err("mapping its shared memory".into(), e))?;
        // SAFETY: at least `HEAD` bytes are mapped.
        let h = unsafe { &*(base as *const Head) };
        let (magic, their_n, their_nonce, slot, round) = (
            h.magic.load(Acquire),
            h.n.load(Relaxed) as usize,
            h.nonce.load(Relaxed),
            h.slot.load(Relaxed) as usize,
            h.split_round.load(Relaxed) as usize,
        );
        let fits = slot % LINE == 0 && layout(n, slot).1 == len && (1..=slot).contains(&round);
        if magic != MAGIC || their_n != n || their_nonce != nonce || !fits {
            // SAFETY: mapped just above, used by nothing else.
            unsafe { sys::unmap(base, len) };
            return Err(not_ours(format!(
                "its descriptor {fd:?} is not this group's shared memory (another job or an earlier round)"
            )));
        }
        let a = Arena::new(base, len, fd, (n, me), (slot, round), layout(n, slot).0);
        a.join();
        Ok(a)
    }

    fn new(
        base: *mut u8,
        len: usize,
        fd: OwnedFd,
        (n, me): (usize, usize),
        (slot, split_round): (usize, usize),
        data_at: usize,
    ) -> Arena {
        Arena {
            base,
            len,
            fd,
            n,
            me,
            slot,
            split_round,
            data_at,
            cursor: Mutex::default(),
            pidfds: Mutex::default(),
        }
    }

    fn join(&self) {
        let c = self.ctl(self.me);
        c.pid.store(std::process::id(), Relaxed);
        c.state.store(Presence::Here.code(), Release);
    }

    /// The descriptor other ranks open (through `/proc`).
    pub fn raw_fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    fn head(&self) -> &Head {
        // SAFETY: the mapping starts with a `Head`, aligned to a page.
        unsafe { &*(self.base as *const Head) }
    }

    fn ctl(&self, k: usize) -> &Ctl {
        assert!(k < self.n);
        // SAFETY: `n` control lines follow the header, each `CTL` bytes, aligned.
        unsafe { &*(self.base.add(HEAD + k * CTL) as *const Ctl) }
    }

    /// Rank `k`'s half `half`: `slot` bytes, aligned to a cache line.
    pub fn data(&self, k: usize, half: usize) -> *mut u8 {
        assert!(k < self.n && half < 2);
        let at = self.data_at + (2 * k + half) * self.slot;
        debug_assert!(at + self.slot <= self.len);
        // SAFETY: inside the mapping (see `layout`).
        unsafe { self.base.add(at) }
    }

    /// Writes this rank's call for operation `op` (counted in the region).
    pub fn set_call(&self, op: u64, call: &[u8; HEADER_LEN]) {
        let slot = &self.ctl(self.me).call[(op % 2) as usize];
        for (w, b) in slot.iter().zip(call.chunks_exact(8)) {
            w.store(u64::from_le_bytes(b.try_into().expect("8 bytes")), Relaxed);
        }
    }

    /// Rank `k`'s call for operation `op`; read after it has arrived at the
    /// operation's first stage.
    pub fn call(&self, k: usize, op: u64) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        let slot = &self.ctl(k).call[(op % 2) as usize];
        for (w, b) in slot.iter().zip(out.chunks_exact_mut(8)) {
            b.copy_from_slice(&w.load(Relaxed).to_le_bytes());
        }
        out
    }

    /// This rank has reached stage `s`.
    pub fn arrive(&self, s: u32) {
        let c = self.ctl(self.me);
        c.stage.store(s, SeqCst);
        if c.waiters.load(SeqCst) > 0 {
            sys::futex_wake(&c.stage);
        }
    }

    /// Whether rank `k` has reached stage `s` (stages wrap).
    pub fn arrived(&self, k: usize, s: u32) -> bool {
        (self.ctl(k).stage.load(Acquire).wrapping_sub(s) as i32) >= 0
    }

    /// The first rank that has not reached stage `s`.
    pub fn missing(&self, s: u32) -> Option<usize> {
        (0..self.n).find(|&k| k != self.me && !self.arrived(k, s))
    }

    /// Sleeps until rank `k` reaches stage `s`, something wakes its word
    /// (an abort, its leaving), or `max` passes. Blocks the calling thread.
    pub fn sleep_on(&self, k: usize, s: u32, max: Duration) {
        let c = self.ctl(k);
        c.waiters.fetch_add(1, SeqCst);
        let seen = c.stage.load(SeqCst);
        if (seen.wrapping_sub(s) as i32) < 0
            && !self.aborted_any()
            && matches!(self.presence(k), Presence::Here | Presence::Absent)
        {
            sys::futex_wait(&c.stage, seen, max);
        }
        c.waiters.fetch_sub(1, SeqCst);
    }

    fn wake_all(&self) {
        for k in 0..self.n {
            sys::futex_wake(&self.ctl(k).stage);
        }
    }

    /// Marks the group aborted in the region from operation `from` on (by
    /// this rank, unless another was first) and wakes every sleeper.
    pub fn abort(&self, from: u64) {
        self.head().abort_from.fetch_min(from, SeqCst);
        let _ = self
            .head()
            .abort
            .compare_exchange(0, self.me as u32 + 1, SeqCst, SeqCst);
        self.wake_all();
    }

    /// The rank that aborted the group in the region, if the abort fails
    /// operation `seq`.
    pub fn aborted_by(&self, seq: u64) -> Option<usize> {
        match self.head().abort.load(SeqCst) {
            0 => None,
            _ if seq < self.head().abort_from.load(SeqCst) => None,
            r => Some(r as usize - 1),
        }
    }

    fn aborted_any(&self) -> bool {
        self.head().abort.load(SeqCst) != 0
    }

    pub fn presence(&self, k: usize) -> Presence {
        Presence::from_code(self.ctl(k).state.load(Acquire))
    }

    /// Marks this rank `p` (left, or killed) and wakes whoever waits on it.
    pub fn set_presence(&self, p: Presence) {
        let c = self.ctl(self.me);
        if Presence::from_code(c.state.load(Acquire)) != Presence::Killed {
            c.state.store(p.code(), SeqCst);
        }
        sys::futex_wake(&c.stage);
    }

    /// Rank `k`'s process id, once it has mapped the region.
    pub fn pid(&self, k: usize) -> Option<u32> {
        (self.presence(k) != Presence::Absent).then(|| self.ctl(k).pid.load(Relaxed))
    }

    /// Opens a pidfd for `pid` now, so that a later check sees this
    /// process even if it ends and its number is reused in between.
    pub fn watch_pid(&self, pid: u32) {
        if pid != std::process::id() && pid != 0 {
            let mut m = self.pidfds.locked();
            m.entry(pid).or_insert_with(|| sys::pidfd(pid).ok());
        }
    }

    /// Whether process `pid` has ended (through a pidfd, opened once). A
    /// process that cannot be checked counts as alive: a wait for it ends
    /// at its deadline, never by naming a live rank gone.
    pub fn pid_ended(&self, pid: u32) -> bool {
        if pid == std::process::id() {
            return false;
        }
        let mut m = self.pidfds.locked();
        if let Some(Some(fd)) = m.get(&pid) {
            return sys::ended(fd);
        }
        match sys::pidfd(pid) {
            Ok(fd) => {
                let ended = sys::ended(&fd);
                m.insert(pid, Some(fd));
                ended
            }
            Err(_) => sys::pid_ended(pid).unwrap_or(false),
        }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        self.set_presence(Presence::Left);
        // SAFETY: the mapping is ours and nothing borrows it past `self`.
        unsafe { sys::unmap(self.base, self.len) };
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn a_second_mapping_sees_the_first_and_only_its_own_group_attaches() {
        // The creator's split round, whatever the attacher would choose.
        let a = Arena::create(2, 1, |slot| slot / 2, 7).unwrap();
        assert_eq!(a.slot, 128);
        assert_eq!(a.split_round, 64);
        let pid = std::process::id();
        assert!(
            Arena::attach(pid, a.raw_fd(), 2, 1, 8).is_err(),
            "wrong nonce"
        );
        assert!(
            Arena::attach(pid, a.raw_fd(), 3, 1, 7).is_err(),
            "wrong size"
        );
        let b = Arena::attach(pid, a.raw_fd(), 2, 1, 7).unwrap();
        assert_eq!(b.split_round, 64);
        // A number that names something else now is refused before it is
        // opened or mapped: a regular file, a pipe, a terminal-like device.
        let file = tempfile::tempfile().unwrap();
        let (rd, _wr) = std::io::pipe().unwrap();
        let null = std::fs::File::open("/dev/null").unwrap();
        use std::os::fd::AsRawFd;
        for (what, fd) in [
            ("file", file.as_raw_fd()),
            ("pipe", rd.as_raw_fd()),
            ("device", null.as_raw_fd()),
        ] {
            let e = Arena::attach(pid, fd, 2, 1, 7).err().expect(what);
            assert!(
                e.text.contains("not a rallypoint memory file"),
                "{what}: {}",
                e.text
            );
        }
        // SAFETY: a page of rank 0's half 1, written by a and read by b.
        unsafe { *a.data(0, 1) = 42 };
        a.arrive(1);
        assert!(b.arrived(0, 1) && !b.arrived(0, 2));
        // SAFETY: the same page, after b saw a's arrival.
        assert_eq!(unsafe { *b.data(0, 1) }, 42);
        assert_eq!(b.missing(1), None);
        assert_eq!(a.missing(1), Some(1));
        b.abort(3);
        assert_eq!(a.aborted_by(2), None, "an op before the abort's goes on");
        assert_eq!(a.aborted_by(3), Some(1));
        drop(b);
        assert_eq!(a.presence(1), Presence::Left);
    }

    #[test]
    fn a_sleeper_wakes_when_the_stage_is_reached() {
        let a = std::sync::Arc::new(Arena::create(2, 1, |slot| slot, 1).unwrap());
        let b = Arena::attach(std::process::id(), a.raw_fd(), 2, 1, 1).unwrap();
        let t = std::thread::spawn(move || {
            let t0 = std::time::Instant::now();
            while !b.arrived(0, 1) {
                b.sleep_on(0, 1, Duration::from_secs(10));
            }
            t0.elapsed()
        });
        std::thread::sleep(Duration::from_millis(50));
        a.arrive(1);
        assert!(t.join().unwrap() < Duration::from_secs(5));
    }
}
