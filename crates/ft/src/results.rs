//! One group rank's view of an issued quorum: torchft's
//! `compute_quorum_results` (its `src/manager.rs`), as a pure function.
//!
//! The lighthouse issues one [`Quorum`] to every replica group in it; each
//! group rank turns it into its own [`QuorumResult`] by torchft's rules:
//!
//! * participants sorted by replica id; this group's index among them is
//!   its `replica_rank`;
//! * `max_step` is the highest step; the participants at it are the
//!   *max participants*, and the cross-replica store of group rank `r` is
//!   `max_participants[r % n]`'s store address (one store per replica,
//!   spread over the group ranks);
//! * the recovering replicas are those not at `max_step`, plus, when
//!   `init_sync` and `max_step == 0`, every replica but that primary;
//! * recovering replica `i` (in rank order) heals from up-to-date replica
//!   `(i + group_rank) % up_to_date`: group rank `r` of every recovering
//!   group reads from a different source when there are several, so the
//!   healing load spreads.
//!
//! Our two changes, both carried in each participant's `data`,
//! `{"metadata": [m0, ..., m(W-1)], "steps": [s0, ..., s(W-1)]}`, which
//! its manager puts in its `QuorumMember` ([`member_data`]):
//!
//! * the source's checkpoint metadata is not asked of its manager
//!   (torchft's `CheckpointMetadata` RPC) but read from the source's
//!   `data`;
//! * **a participant is up to date only if it is whole**: all its ranks
//!   at one step (`steps` all equal). A heal can succeed for some ranks of
//!   a group and fail for others (its source died or answered late): the
//!   group's ranks are then at different steps, and its member's `step` is
//!   the lowest of them ([`member_step`]). Such a group heals every rank
//!   from a whole participant at `max_step`, the max over the whole
//!   participants, even a rank that is ahead: a rank's state at a step is
//!   only worth keeping with its group's other ranks at the same step.
//!   With the max of the ranks' steps (as before), the lagging rank counted
//!   as up to date and took part in its rank's allreduce from an older
//!   state; with per-rank rules, a group whose rank 0 lost its only source
//!   stayed at different steps and never committed again (both found by
//!   `tests/sim.rs`). torchft's manager has the hole: it reports one
//!   rank's step (a `TODO check step`). With no whole participant (a
//!   lone group whose partial heal lost its source) nobody heals, as no
//!   source is sound: the group's votes fail naming the ranks' steps (or
//!   lines, below), every step, until `max_retries` ends the loop or
//!   another group comes to heal from. (The Python `Manager` loads a heal only on a commit, so
//!   a partial heal needs a state that failed to load after the vote.)
//! * **one line of history wins at a step**: `data` also carries each
//!   rank's `line` (`"lines": [l0, ...]`), the id of the quorum in which
//!   its state was committed. The `Manager` sets it at each commit and
//!   keeps it in its own state, so a heal or a checkpoint carries it with
//!   the parameters; `null` when not known (no commit since the worker
//!   started from its own state). A participant is whole only if its
//!   ranks are at one step *and* one line (a heal loaded on some ranks
//!   only, before the vote under `use_async_quorum=False`, leaves them at
//!   one step in two lines). Two groups at one step with one line hold
//!   states committed in the same round, so one state; two lines at one
//!   step are two histories (a group that trained alone under
//!   `min_replicas` 1, or a quorum that formed without the groups ahead
//!   of it under a join timeout of 0 and made their step again). The
//!   up-to-date participants are those at the highest (step, line), a
//!   known line above none and a later quorum's id above an earlier's:
//!   the others heal from them, so a quorum never averages two histories.
//!   torchft compares steps only, and sums the two states as one (found by
//!   `tests/sim.rs`, its kinds (d) and (e)).

use std::collections::BTreeSet;

use rallypoint_lighthouse::proto::{Quorum, QuorumMember};
use serde::{Deserialize, Serialize};

/// One group rank's result of a quorum: the `quorum` answer of the workers'
/// protocol (field names are the wire's).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuorumResult {
    pub quorum_id: i64,
    /// This replica group's id.
    pub replica_id: String,
    /// This group's index among the participants sorted by id.
    pub replica_rank: i64,
    pub replica_world_size: i64,
    /// The participant this group rank heals from, if it heals.
    pub recover_src_replica_rank: Option<i64>,
    /// The source's checkpoint metadata for this group rank.
    pub recover_src_metadata: Option<String>,
    /// The participants healing from this group rank.
    pub recover_dst_replica_ranks: Vec<i64>,
    /// The store of this group rank's cross-replica process group.
    pub store_address: String,
    pub max_step: i64,
    /// This group's index among the participants at `max_step`, if it is one.
    pub max_replica_rank: Option<i64>,
    pub max_world_size: i64,
    /// How many participants heal in this quorum (ours, not torchft's): with
    /// `max_world_size`, the replicas that will hold the step's state if it
    /// commits, what the `Manager` counts against `min_replicas`.
    #[serde(default)]
    pub healing_world_size: i64,
    pub heal: bool,
    pub commit_failures: i64,
    /// The participants' ids, sorted.
    pub replica_ids: Vec<String>,
}

/// Why a quorum gives no result for a group rank.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ResultError {
    #[error("replica {0:?} is not a participant of quorum {1}")]
    NotParticipating(String, i64),
    #[error("the healing source {src:?} of group rank {rank} gave no checkpoint metadata for that rank (its data: {data:?})")]
    NoMetadata {
        src: String,
        rank: usize,
        data: String,
    },
}

/// The `data` of a group's `QuorumMember`: its ranks' checkpoint metadata,
/// steps and lines (module docs), in group-rank order.
pub fn member_data(metadata: &[String], steps: &[i64], lines: &[Option<i64>]) -> String {
    serde_json::json!({ "metadata": metadata, "steps": steps, "lines": lines }).to_string()
}

/// A participant's ranks' lines, as in its `data` (empty when it has none).
fn lines_of(member: &QuorumMember) -> Vec<Option<i64>> {
    serde_json::from_str::<serde_json::Value>(&member.data)
        .ok()
        .and_then(|v| {
            let lines = v.get("lines")?.as_array()?;
            Some(lines.iter().map(serde_json::Value::as_i64).collect())
        })
        .unwrap_or_default()
}

/// A participant's line: its ranks' one line, `None` when not known or
/// when its ranks' lines differ (then it is not whole: [`whole_step`]).
pub fn line_of(member: &QuorumMember) -> Option<i64> {
    let lines = lines_of(member);
    let first = *lines.first()?;
    lines.iter().all(|l| *l == first).then_some(first).flatten()
}

/// Rank `rank`'s checkpoint metadata in a participant's `data`.
pub fn metadata_of(member: &QuorumMember, rank: usize) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(&member.data).ok()?;
    v.get("metadata")?.get(rank)?.as_str().map(str::to_owned)
}

/// The `step` of a group's `QuorumMember`: its ranks' step when they are
/// all at one, else the lowest of them (the group is not whole).
pub fn member_step(steps: &[i64]) -> i64 {
    steps.iter().copied().min().unwrap_or(0)
}

/// The step all of a participant's ranks are at, or `None` when they are
/// at different steps or in different lines (`data` without steps: the
/// member's step).
pub fn whole_step(member: &QuorumMember) -> Option<i64> {
    let lines = lines_of(member);
    if lines.iter().any(|l| Some(l) != lines.first()) {
        return None;
    }
    let steps: Option<Vec<i64>> = serde_json::from_str::<serde_json::Value>(&member.data)
        .ok()
        .and_then(|v| {
            v.get("steps")?
                .as_array()?
                .iter()
                .map(serde_json::Value::as_i64)
                .collect()
        });
    match steps.as_deref() {
        None | Some([]) => Some(member.step),
        Some([first, rest @ ..]) => rest.iter().all(|s| s == first).then_some(*first),
    }
}

/// The quorum's max step: the highest whole participant's, or with none
/// whole, the highest member step (`None` for no participant).
pub fn max_step(participants: &[QuorumMember]) -> Option<i64> {
    let whole = participants.iter().filter_map(whole_step).max();
    whole.or_else(|| participants.iter().map(|p| p.step).max())
}

/// Where a participant stands: its step (`None` when its ranks differ)
/// and its line. The up-to-date participants are at the highest.
type Standing = (Option<i64>, Option<i64>);

/// Group rank `group_rank`'s result of `quorum` for the replica `replica_id`.
pub fn compute(
    replica_id: &str,
    group_rank: usize,
    quorum: &Quorum,
    init_sync: bool,
) -> Result<QuorumResult, ResultError> {
    let mut participants: Vec<&QuorumMember> = quorum.participants.iter().collect();
    participants.sort_by(|a, b| a.replica_id.cmp(&b.replica_id));
    let not_in = || ResultError::NotParticipating(replica_id.to_owned(), quorum.quorum_id);
    let replica_rank = participants
        .iter()
        .position(|p| p.replica_id == replica_id)
        .ok_or_else(not_in)?;

    // Only a whole participant is a source; with none, each counts at
    // its member's step and nobody heals.
    let whole: Vec<Option<i64>> = participants.iter().map(|p| whole_step(p)).collect();
    let none_whole = whole.iter().all(Option::is_none);
    let standing = |i: usize| -> Standing {
        if none_whole {
            (Some(participants[i].step), None)
        } else {
            (whole[i], whole[i].and(line_of(participants[i])))
        }
    };
    let max_step = max_step(&quorum.participants).ok_or_else(not_in)?;
    // The highest line among those at the max step (lines only count
    // between participants at one step).
    let top: Standing = (0..participants.len())
        .map(standing)
        .filter(|(s, _)| *s == Some(max_step))
        .max()
        .ok_or_else(not_in)?;
    let at_max = |i: usize| standing(i) == top;
    let max_participants: Vec<&QuorumMember> = (0..participants.len())
        .filter(|&i| at_max(i))
        .map(|i| participants[i])
        .collect();
    let max_replica_rank = max_participants
        .iter()
        .position(|p| p.replica_id == replica_id)
        .map(|i| i as i64);
    let primary = max_participants[group_rank % max_participants.len()];

    let force_recover = init_sync && max_step == 0;
    // With no whole participant there is no sound source: nobody heals
    // (a heal from a group whose ranks differ would mislabel a state).
    let recovering: Vec<usize> = (0..participants.len())
        .filter(|&i| {
            !none_whole
                && (!at_max(i)
                    || (force_recover && participants[i].replica_id != primary.replica_id))
        })
        .collect();
    let recovering_set: BTreeSet<usize> = recovering.iter().copied().collect();
    let up_to_date: Vec<usize> = (0..participants.len())
        .filter(|i| !recovering_set.contains(i))
        .collect();

    let mut recover_src = None;
    let mut recover_dst = Vec::new();
    for (i, &dst) in recovering.iter().enumerate() {
        let src = up_to_date[(i + group_rank) % up_to_date.len()];
        if src == replica_rank {
            recover_dst.push(dst as i64);
        }
        if dst == replica_rank {
            recover_src = Some(src);
        }
    }
    let recover_src_metadata = match recover_src {
        None => None,
        Some(src) => {
            let p = participants[src];
            Some(
                metadata_of(p, group_rank).ok_or_else(|| ResultError::NoMetadata {
                    src: p.replica_id.clone(),
                    rank: group_rank,
                    data: p.data.clone(),
                })?,
            )
        }
    };
    Ok(QuorumResult {
        quorum_id: quorum.quorum_id,
        replica_id: replica_id.to_owned(),
        replica_rank: replica_rank as i64,
        replica_world_size: participants.len() as i64,
        recover_src_replica_rank: recover_src.map(|s| s as i64),
        recover_src_metadata,
        recover_dst_replica_ranks: recover_dst,
        store_address: primary.store_address.clone(),
        max_step,
        max_replica_rank,
        max_world_size: max_participants.len() as i64,
        healing_world_size: recovering.len() as i64,
        heal: recover_src.is_some(),
        commit_failures: participants
            .iter()
            .map(|p| p.commit_failures)
            .max()
            .unwrap_or(0),
        replica_ids: participants.iter().map(|p| p.replica_id.clone()).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A participant `replica_i` at `step`, its ranks' metadata `m_i_r`.
    fn member(i: usize, step: i64) -> QuorumMember {
        mixed(i, &[step; 4])
    }

    /// A participant `replica_i` whose rank `r` is at `steps[r]`.
    fn mixed(i: usize, steps: &[i64]) -> QuorumMember {
        lined(i, steps, None)
    }

    /// [`mixed`], its last commit made in quorum `line`.
    fn lined(i: usize, steps: &[i64], line: Option<i64>) -> QuorumMember {
        let md: Vec<String> = (0..steps.len()).map(|r| format!("m_{i}_{r}")).collect();
        QuorumMember {
            replica_id: format!("replica_{i}"),
            address: format!("addr_{i}"),
            store_address: format!("store_addr_{i}"),
            step: member_step(steps),
            world_size: 1,
            data: member_data(&md, steps, &vec![line; steps.len()]),
            ..Default::default()
        }
    }

    fn quorum(steps: &[i64]) -> Quorum {
        Quorum {
            quorum_id: 1,
            participants: steps
                .iter()
                .enumerate()
                .map(|(i, &s)| member(i, s))
                .collect(),
            created: None,
        }
    }

    fn r(q: &Quorum, id: &str, rank: usize, init_sync: bool) -> QuorumResult {
        compute(id, rank, q, init_sync).unwrap()
    }

    // torchft's test_compute_quorum_results_first_step.
    #[test]
    fn first_step_with_init_sync_heals_every_non_primary() {
        let q = quorum(&[0, 0]);
        let a = r(&q, "replica_0", 0, true);
        assert!(!a.heal);
        assert_eq!(a.replica_rank, 0);
        assert_eq!(a.recover_src_replica_rank, None);
        assert_eq!(a.recover_src_metadata, None);
        assert_eq!(a.recover_dst_replica_ranks, vec![1]);
        let b = r(&q, "replica_1", 0, true);
        assert!(b.heal);
        assert_eq!(b.replica_rank, 1);
        assert_eq!(b.recover_src_replica_rank, Some(0));
        assert_eq!(b.recover_src_metadata.as_deref(), Some("m_0_0"));
        assert!(b.recover_dst_replica_ranks.is_empty());
        // Group rank 1: the primary (and so the source) is offset.
        let b1 = r(&q, "replica_1", 1, true);
        assert!(!b1.heal);
        assert_eq!(b1.recover_dst_replica_ranks, vec![0]);
        assert_eq!(b1.store_address, "store_addr_1");
        let a1 = r(&q, "replica_0", 1, true);
        assert_eq!(a1.recover_src_metadata.as_deref(), Some("m_1_1"));
    }

    // torchft's test_compute_quorum_results_recovery.
    #[test]
    fn recovery_sources_round_robin_offset_by_group_rank() {
        let q = quorum(&[0, 1, 0, 1, 0]);
        let a = r(&q, "replica_0", 0, true);
        assert!(a.heal);
        assert_eq!(a.recover_src_replica_rank, Some(1));
        assert_eq!(a.recover_src_metadata.as_deref(), Some("m_1_0"));
        assert!(a.recover_dst_replica_ranks.is_empty());
        let b = r(&q, "replica_1", 0, true);
        assert!(!b.heal);
        assert_eq!(b.recover_src_replica_rank, None);
        assert_eq!(b.recover_dst_replica_ranks, vec![0, 4]);
        let d = r(&q, "replica_3", 0, true);
        assert_eq!(d.recover_dst_replica_ranks, vec![2]);
        let b1 = r(&q, "replica_1", 1, true);
        assert_eq!(b1.recover_dst_replica_ranks, vec![2]);
        let a1 = r(&q, "replica_0", 1, true);
        assert_eq!(a1.recover_src_replica_rank, Some(3));
        assert_eq!(a1.recover_src_metadata.as_deref(), Some("m_3_1"));
        assert_eq!(a.max_step, 1);
        assert_eq!(a.max_world_size, 2);
        assert_eq!(a.max_replica_rank, None);
        assert_eq!(b.max_replica_rank, Some(0));
        assert_eq!(d.max_replica_rank, Some(1));
        assert_eq!(a.replica_world_size, 5);
        // The store of group rank r: max_participants[r % 2].
        assert_eq!(a.store_address, "store_addr_1");
        assert_eq!(a1.store_address, "store_addr_3");
        assert_eq!(r(&q, "replica_0", 2, true).store_address, "store_addr_1");
    }

    // torchft's test_compute_quorum_results_skip_init_sync.
    #[test]
    fn without_init_sync_step_zero_does_not_heal() {
        let mut q = quorum(&[0, 0]);
        assert!(!r(&q, "replica_0", 0, true).heal);
        assert!(r(&q, "replica_1", 0, true).heal);
        assert!(!r(&q, "replica_1", 0, false).heal);
        q.participants[0] = member(0, 1);
        assert!(r(&q, "replica_1", 0, false).heal);
    }

    // torchft's test_compute_quorum_results_commit_failures.
    #[test]
    fn commit_failures_is_the_max() {
        let mut q = quorum(&[0, 0]);
        q.participants[1].commit_failures = 2;
        assert_eq!(r(&q, "replica_0", 0, true).commit_failures, 2);
    }

    #[test]
    fn participants_are_sorted_and_ids_listed() {
        let mut q = quorum(&[3, 3, 3]);
        q.participants.reverse();
        let b = r(&q, "replica_1", 0, true);
        assert_eq!(b.replica_rank, 1);
        assert_eq!(b.replica_ids, ["replica_0", "replica_1", "replica_2"]);
        assert_eq!(b.quorum_id, 1);
        assert!(!b.heal);
    }

    #[test]
    fn a_replica_not_in_the_quorum_is_an_error_naming_it() {
        let e = compute("nope", 0, &quorum(&[0]), true).unwrap_err();
        assert!(e.to_string().contains("\"nope\""), "{e}");
    }

    #[test]
    fn a_source_without_metadata_for_the_rank_is_an_error_naming_it() {
        let mut q = quorum(&[5, 0]);
        q.participants[0].data = member_data(&["only_rank_0".into()], &[5], &[None]);
        assert_eq!(
            r(&q, "replica_1", 0, true).recover_src_metadata.as_deref(),
            Some("only_rank_0")
        );
        let e = compute("replica_1", 1, &q, true).unwrap_err();
        assert!(e.to_string().contains("replica_0") && e.to_string().contains("rank 1"));
        q.participants[0].data = String::new();
        assert!(compute("replica_1", 0, &q, true).is_err());
    }

    /// A heal that succeeded for rank 0 of replica_1 and failed for its
    /// rank 1 (found by `tests/sim.rs`): its ranks are at 7 and 4, its
    /// member's step 4. Both its ranks heal from replica_0, the whole one.
    #[test]
    fn a_group_whose_ranks_are_at_different_steps_heals_whole() {
        let q = Quorum {
            quorum_id: 1,
            participants: vec![mixed(0, &[7, 7]), mixed(1, &[7, 4])],
            created: None,
        };
        assert_eq!(q.participants[1].step, 4);
        for rank in 0..2 {
            let res = r(&q, "replica_1", rank, true);
            assert!(res.heal, "rank {rank}: {res:?}");
            assert_eq!(res.recover_src_replica_rank, Some(0));
            let md = format!("m_0_{rank}");
            assert_eq!(res.recover_src_metadata.as_deref(), Some(md.as_str()));
            assert_eq!(
                (res.max_step, res.max_world_size, res.max_replica_rank),
                (7, 1, None)
            );
            let src = r(&q, "replica_0", rank, true);
            assert!(!src.heal);
            assert_eq!(src.recover_dst_replica_ranks, vec![1]);
        }
        // Without steps in its data, a member's ranks are all at its step.
        let mut old = q.clone();
        old.participants[1].data = member_data(&["a".into(), "b".into()], &[], &[]);
        old.participants[1].step = 7;
        assert!(!r(&old, "replica_1", 1, true).heal);
    }

    /// A partial heal whose source then died (found by `tests/sim.rs`):
    /// replica_1's rank 1 reached step 2, its rank 0 stayed at 0, and the
    /// only step-2 rank 0 is gone; replica_0 came back at step 0. The
    /// whole one wins: replica_1 goes back to step 0 on both ranks (its
    /// rank 1's step-2 state is worth nothing without a rank 0 at step
    /// 2). Per-rank rules left its ranks at 0 and 2 for good.
    #[test]
    fn a_rank_ahead_of_every_whole_participant_goes_back_to_them() {
        let q = Quorum {
            quorum_id: 1,
            participants: vec![mixed(0, &[0, 0]), mixed(1, &[0, 2])],
            created: None,
        };
        for rank in 0..2 {
            let res = r(&q, "replica_1", rank, false);
            assert!(res.heal, "rank {rank}: {res:?}");
            assert_eq!(res.max_step, 0);
            assert_eq!(res.recover_src_replica_rank, Some(0));
        }
        // No whole participant: each counts at its member's step, and
        // nobody heals (from the review: A = [3, 5] healing from B = [4, 6]
        // at "step 4" would take B's rank 1 at step 6 and call it 4).
        let lone = Quorum {
            quorum_id: 1,
            participants: vec![mixed(1, &[0, 2])],
            created: None,
        };
        let res = r(&lone, "replica_1", 1, true);
        assert!(!res.heal);
        assert_eq!(res.max_step, 0);
        let two = Quorum {
            quorum_id: 1,
            participants: vec![mixed(0, &[3, 5]), mixed(1, &[4, 6])],
            created: None,
        };
        for (id, rank) in [
            ("replica_0", 0),
            ("replica_0", 1),
            ("replica_1", 0),
            ("replica_1", 1),
        ] {
            let res = r(&two, id, rank, true);
            assert!(!res.heal, "{id} rank {rank}: {res:?}");
            assert!(res.recover_dst_replica_ranks.is_empty());
        }
    }

    /// Two histories at one step (seed 1169 of `tests/sim.rs`: a group
    /// that trained alone under `min_replicas` 1 meets the others at their
    /// step): the later quorum's line is up to date, the other heals from
    /// it; a group whose line is not known heals from a known one; one
    /// line at one step heals nobody.
    #[test]
    fn at_one_step_the_later_line_wins_and_the_other_heals() {
        let q = |lines: [Option<i64>; 3]| Quorum {
            quorum_id: 9,
            participants: (0..3).map(|i| lined(i, &[5, 5], lines[i])).collect(),
            created: None,
        };
        let two = q([Some(4), Some(7), Some(4)]);
        for rank in 0..2 {
            for i in [0, 2] {
                let res = r(&two, &format!("replica_{i}"), rank, true);
                assert!(res.heal, "replica_{i} rank {rank}: {res:?}");
                assert_eq!(res.recover_src_replica_rank, Some(1));
                assert_eq!((res.max_step, res.max_replica_rank), (5, None));
            }
            let src = r(&two, "replica_1", rank, true);
            assert!(!src.heal);
            assert_eq!(src.recover_dst_replica_ranks, vec![0, 2]);
            assert_eq!((src.max_world_size, src.max_replica_rank), (1, Some(0)));
            assert_eq!(src.healing_world_size, 2, "the two others heal");
            assert_eq!(src.store_address, "store_addr_1");
        }
        let unknown = q([None, Some(3), Some(3)]);
        assert!(r(&unknown, "replica_0", 0, true).heal);
        assert!(!r(&unknown, "replica_1", 0, true).heal);
        assert!(!r(&unknown, "replica_2", 0, true).heal);
        let one = q([Some(3), Some(3), Some(3)]);
        for i in 0..3 {
            let res = r(&one, &format!("replica_{i}"), 1, true);
            assert!(!res.heal);
            assert_eq!((res.max_world_size, res.healing_world_size), (3, 0));
        }
        // A line counts only at the max step: a higher line one step
        // behind still heals, from the step ahead.
        let behind = Quorum {
            quorum_id: 9,
            participants: vec![lined(0, &[5, 5], Some(3)), lined(1, &[4, 4], Some(8))],
            created: None,
        };
        assert!(r(&behind, "replica_1", 0, true).heal);
        assert!(!r(&behind, "replica_0", 0, true).heal);
        // Nor does a group whose ranks differ carry one.
        let split = Quorum {
            quorum_id: 9,
            participants: vec![lined(0, &[5, 5], None), lined(1, &[5, 4], Some(8))],
            created: None,
        };
        assert!(r(&split, "replica_1", 0, true).heal);
        assert!(!r(&split, "replica_0", 0, true).heal);
        assert_eq!(line_of(&split.participants[1]), Some(8));
        assert_eq!(line_of(&split.participants[0]), None);
        // Ranks at one step in two lines (a heal loaded before the vote on
        // rank 0 only, under use_async_quorum=False) are not whole: the
        // group heals whole, here from replica_0.
        let mut mixed_lines = lined(1, &[5, 5], Some(8));
        mixed_lines.data = member_data(&["a".into(), "b".into()], &[5, 5], &[Some(8), Some(3)]);
        assert_eq!(line_of(&mixed_lines), None);
        assert_eq!(whole_step(&mixed_lines), None);
        let q = Quorum {
            quorum_id: 9,
            participants: vec![lined(0, &[5, 5], Some(3)), mixed_lines],
            created: None,
        };
        for rank in 0..2 {
            let res = r(&q, "replica_1", rank, true);
            assert!(res.heal, "rank {rank}: {res:?}");
            assert_eq!(res.recover_src_replica_rank, Some(0));
        }
    }

    proptest! {
        /// Every recovering replica gets a source whose same group rank is
        /// up to date and whose metadata is its own rank's, every source
        /// lists it, and the sources of one group rank are spread evenly;
        /// the ranks of one participant may be at different steps.
        #[test]
        fn every_recovering_replica_gets_an_up_to_date_source(
            // Half the participants whole (all ranks at one step).
            by_rank in proptest::collection::vec(
                prop_oneof![
                    (0i64..3).prop_map(|s| vec![s; 4]),
                    proptest::collection::vec(0i64..3, 4),
                ],
                1..7,
            ),
            group_rank in 0usize..4,
            init_sync in any::<bool>(),
            lines in proptest::collection::vec(prop_oneof![Just(None), (1i64..3).prop_map(Some)], 7),
        ) {
            let q = Quorum {
                quorum_id: 1,
                participants: by_rank.iter().enumerate().map(|(i, s)| lined(i, s, lines[i])).collect(),
                created: None,
            };
            // Each participant's step if whole (all its ranks at one).
            let whole: Vec<Option<i64>> = by_rank
                .iter()
                .map(|s| s.iter().all(|x| *x == s[0]).then_some(s[0]))
                .collect();
            let none_whole = whole.iter().all(Option::is_none);
            let steps: Vec<i64> = by_rank
                .iter()
                .zip(&whole)
                .map(|(s, w)| if none_whole { *s.iter().min().unwrap() } else { w.unwrap_or(-1) })
                .collect();
            let all: Vec<QuorumResult> = (0..steps.len())
                .map(|i| r(&q, &format!("replica_{i}"), group_rank, init_sync))
                .collect();
            let max = *steps.iter().max().unwrap();
            // Up to date: at the max step with the highest line there (a
            // line counts only for a whole participant).
            let line = |i: usize| if none_whole || whole[i].is_none() { None } else { lines[i] };
            let top = (0..steps.len()).filter(|&i| steps[i] == max).map(line).max().unwrap();
            let current = |i: usize| steps[i] == max && line(i) == top;
            let mut load = vec![0usize; steps.len()];
            for (i, res) in all.iter().enumerate() {
                prop_assert_eq!(res.max_step, max);
                if none_whole {
                    prop_assert!(!res.heal, "no sound source: nobody heals");
                } else if !current(i) {
                    prop_assert!(res.heal);
                }
                if let Some(src) = res.recover_src_replica_rank {
                    let src = src as usize;
                    prop_assert!(current(src), "the source is up to date");
                    prop_assert!(!all[src].heal, "the source does not heal itself");
                    prop_assert!(all[src].recover_dst_replica_ranks.contains(&(i as i64)));
                    let md = format!("m_{src}_{group_rank}");
                    prop_assert_eq!(res.recover_src_metadata.as_deref(), Some(md.as_str()));
                    load[src] += 1;
                }
                prop_assert_eq!(&res.store_address, &all[0].store_address);
            }
            let sources: Vec<usize> = (0..steps.len()).filter(|&s| !all[s].heal).collect();
            prop_assert!(!sources.is_empty(), "someone is up to date");
            let (lo, hi) = (
                sources.iter().map(|&s| load[s]).min().unwrap(),
                sources.iter().map(|&s| load[s]).max().unwrap(),
            );
            prop_assert!(hi - lo <= 1, "sources spread: {:?}", load);
            // Unless no participant is whole, every participant's ranks
            // end the heal at one step, the max.
            if !none_whole {
                for (i, s) in by_rank.iter().enumerate() {
                    for (rank, own) in s.iter().enumerate() {
                        let res = r(&q, &format!("replica_{i}"), rank, init_sync);
                        let after = if res.heal { res.max_step } else { *own };
                        prop_assert_eq!(after, max, "replica_{} rank {}: {:?}", i, rank, by_rank);
                    }
                }
            }
        }
    }
}
