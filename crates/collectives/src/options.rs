//! How a group is set up ([`Options`]), and the sizes derived from it.

use std::net::IpAddr;
use std::time::Duration;

use rallypoint_auth::JobSecret;

use crate::hash::stable_hash;

/// gloo's default operation timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// How a group is set up. Every rank must use the same segment size and
/// thresholds (the handshake refuses a peer whose differ).
#[derive(Debug, Clone)]
pub struct Options {
    /// The group's name: its keys live under `rallypoint/collectives/<prefix>/` in
    /// the store. A new group on the same store needs a new prefix.
    pub prefix: String,
    /// Bound on every operation (and on set-up's store waits).
    pub timeout: Duration,
    /// The address peers connect to. Default: the local address of the route to
    /// `MASTER_ADDR` if set, else of the route to this host's name, else loopback.
    pub advertise: Option<IpAddr>,
    /// Largest frame payload; larger buffers are cut into segments and
    /// pipelined. The pipelined algorithms (ring and chain) cut a buffer into
    /// segments of a quarter of each rank's share of it (`bytes / 4n`),
    /// within `[min(256 KiB, segment_bytes), segment_bytes]`: large segments
    /// where a buffer has many (each costs a frame, a wake-up and a hand-off,
    /// so over loopback TCP at 4 ranks a 64 MiB broadcast is about 25% faster
    /// at 1 MiB than at 256 KiB), and at least four per share, so that a
    /// chain or ring of many ranks still pipelines. The other algorithms use
    /// `segment_bytes`. Default 1 MiB (`docs/benchmarks.md`).
    pub segment_bytes: usize,
    /// Buffers up to this size use the latency algorithms (recursive doubling, trees).
    pub small_bytes: usize,
    /// Barriers of more ranks than this use a tree, which needs `n − 1`
    /// connections, rather than dissemination's `n lg n`.
    pub dissemination_max_ranks: usize,
    /// TCP connections to open per peer; segments are spread over them.
    pub streams_per_peer: usize,
    /// How long a receive waits before asking the peer for its part (which
    /// opens a connection if there is none, so a dead peer is noticed by the
    /// refusal, and compares the two calls).
    pub probe_after: Duration,
    /// How long a peer may take to answer a new connection's handshake. A
    /// listener that accepts but never answers is a stopped or hung process,
    /// and its rank is named gone after this.
    pub handshake_timeout: Duration,
    /// A connection whose peer's host stops answering (crashed, partitioned)
    /// fails after about this long: TCP keepalive probes while idle, and
    /// `TCP_USER_TIMEOUT` while data waits unacknowledged. Zero: the kernel's
    /// defaults (minutes).
    pub peer_timeout: Duration,
    /// Ranks that are all on one host (and a world of at most
    /// 64) run collectives over shared memory rather than loopback TCP;
    /// `false` keeps them on TCP. Every rank must agree.
    pub shared_memory: bool,
    /// Bytes of each half of a rank's shared-memory slot: the most a rank
    /// moves per round (at least 64 per rank, rounded up to 64).
    pub shm_slot_bytes: usize,
    /// Credit per peer: the bytes this rank may have sent a peer that the
    /// peer's operations have not taken yet (frames that arrive before their
    /// receive is posted: a broadcast root or a sender of messages runs on
    /// while the peer is behind). Out of credit, a rank sends only frames of
    /// operations the peer has begun or waits in (it asks for them). So a
    /// rank files at most this from each peer for operations it has not
    /// reached. Every rank should use the same; 0: no flow control
    /// (unbounded memory).
    pub receive_window: usize,
    /// This rank's host, as far as shared memory is concerned: ranks with
    /// equal ids share memory. Default: the host name, boot id and PID
    /// namespace (or `RALLY_HOST_ID`). Set it to keep ranks apart that could
    /// share memory (tests of several hosts in one process), never to join
    /// ranks that cannot.
    pub host_id: Option<String>,
    /// A failing operation returns once the other members have been told of
    /// the group's abort (bounded by 2 s), so that a process that exits on
    /// the error leaves them its reason, not merely its absence. `false`:
    /// it returns at once and the telling goes on in the background, for a
    /// process that lives on after a failure (a fault-tolerant job's
    /// generations, `next_generation`): a member that cannot be told (cut
    /// off, its connection stalled) then costs nothing.
    pub tell_before_failing: bool,
    /// The job secret every connection between ranks proves before its
    /// hello (see `transport/conn.rs`): `Ok(None)` runs without one, as
    /// PyTorch's gloo does. Default: [`rallypoint_auth::job_secret`], the
    /// process's secret, else the file `RALLY_JOB_SECRET_FILE` names (`rally
    /// run --job-secret-file` sets it for its workers); an `Err` (that file
    /// unreadable, readable by others, too short) fails forming the group,
    /// with its text. Every rank must hold the same. A lineage's transport
    /// ([`crate::ProcessGroup::next_generation`]) keeps the secret of the
    /// generation that started it.
    pub secret: Result<Option<JobSecret>, String>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            prefix: "default_pg".into(),
            timeout: DEFAULT_TIMEOUT,
            advertise: None,
            segment_bytes: 1 << 20,
            small_bytes: 64 << 10,
            dissemination_max_ranks: 64,
            streams_per_peer: 1,
            probe_after: Duration::from_millis(250),
            handshake_timeout: Duration::from_secs(2),
            peer_timeout: Duration::from_secs(10),
            shared_memory: true,
            shm_slot_bytes: 1 << 20,
            receive_window: 32 << 20,
            host_id: None,
            tell_before_failing: true,
            secret: rallypoint_auth::job_secret(),
        }
    }
}

impl Options {
    /// What the handshake compares: a fixed hash (never `DefaultHasher`, whose
    /// algorithm may change between Rust releases), so ranks built by
    /// different toolchains agree.
    pub(crate) fn layout_hash(&self) -> u64 {
        stable_hash(&[
            self.segment_bytes as u64,
            self.small_bytes as u64,
            self.dissemination_max_ranks as u64,
        ])
    }
}

/// The smallest segment a pipelined op chooses by size (or `segment_bytes`,
/// if that is less).
pub(crate) const MIN_PIPELINE_SEGMENT: usize = 256 << 10;

/// Segment length, in elements of `size` bytes, for a pipelined op over
/// `total` elements on `n` ranks with `segment_bytes` the largest: a
/// quarter of each rank's share, rounded up (so a share is at most four
/// segments), within `[min(MIN_PIPELINE_SEGMENT, segment_bytes),
/// segment_bytes]` in bytes; at least one element.
pub(crate) fn pipeline_segment(total: usize, size: usize, n: usize, segment_bytes: usize) -> usize {
    let size = size.max(1);
    let max = (segment_bytes / size).max(1);
    let min = (MIN_PIPELINE_SEGMENT.min(segment_bytes) / size).clamp(1, max);
    total.div_ceil(4 * n.max(1)).clamp(min, max)
}

/// Which all-reduce algorithm to run (default: chosen by size).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllReduceAlgorithm {
    Ring,
    RecursiveDoubling,
    Tree,
}

/// Which broadcast algorithm to run (default: chosen by size).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BroadcastAlgorithm {
    Tree,
    Chain,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipelined_segments_are_a_quarter_share_within_bounds() {
        const M: usize = 1 << 20;
        let seg = |bytes: usize, n: usize, max: usize| pipeline_segment(bytes / 4, 4, n, max) * 4;
        // Many segments: the largest.
        assert_eq!(seg(64 * M, 4, M), M);
        assert_eq!(seg(16 * M, 4, M), M);
        // Fewer: a quarter of each rank's share, so at most four per share.
        assert_eq!(seg(8 * M, 4, M), M / 2);
        assert_eq!(seg(16 * M, 8, M), M / 2);
        // Never below 256 KiB, nor above the option.
        assert_eq!(seg(M, 4, M), MIN_PIPELINE_SEGMENT);
        assert_eq!(seg(4, 4, M), MIN_PIPELINE_SEGMENT);
        assert_eq!(seg(1 << 30, 2, 4 * M), 4 * M);
        // A small `segment_bytes` (tests cut buffers finely) is used as is.
        assert_eq!(seg(64 * M, 4, 512), 512);
        assert_eq!(pipeline_segment(0, 4, 1, 16), 4);
        // Below one element: one element.
        assert_eq!(pipeline_segment(100, 8, 2, 4), 1);
        // Uneven buffers: every share is at most four segments.
        for (total, n) in [
            ((1 << 20) + 3, 2),
            ((1 << 20) + 3, 3),
            ((3 << 20) + 5, 4),
            (999_999, 7),
        ] {
            let s = pipeline_segment(total, 4, n, M);
            let share = total.div_ceil(n);
            assert!(share.div_ceil(s) <= 4, "{total} on {n}: {s}");
        }
    }

    #[test]
    fn the_layout_hash_never_changes() {
        // FNV-1a vectors computed independently: ranks built by any toolchain,
        // past or future, must agree on them.
        assert_eq!(stable_hash(&[]), 0xcbf2_9ce4_8422_2325);
        assert_eq!(stable_hash(&[0x61]), 0x6926_124a_7b14_33c4);
        // The defaults' hash changes only with a default (with 256 KiB
        // segments it was 0x4136_1f82_2124_e188), and ranks with different
        // defaults refuse each other at the handshake, by name.
        assert_eq!(Options::default().layout_hash(), 0x40f5_f653_0dbb_6b7c);
    }
}
