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
//! Our one change: the source's checkpoint metadata is not asked of its
//! manager (torchft's `CheckpointMetadata` RPC) but read from the source
//! participant's `data`, `{"metadata": [m0, ..., m(W-1)]}`, which its
//! manager put in its `QuorumMember` ([`member_data`]).

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

/// The `data` of a group's `QuorumMember`: its ranks' checkpoint metadata.
pub fn member_data(metadata: &[String]) -> String {
    serde_json::json!({ "metadata": metadata }).to_string()
}

/// Rank `rank`'s checkpoint metadata in a participant's `data`.
pub fn metadata_of(member: &QuorumMember, rank: usize) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(&member.data).ok()?;
    v.get("metadata")?.get(rank)?.as_str().map(str::to_owned)
}

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

    let max_step = participants
        .iter()
        .map(|p| p.step)
        .max()
        .ok_or_else(not_in)?;
    let max_participants: Vec<&QuorumMember> = participants
        .iter()
        .copied()
        .filter(|p| p.step == max_step)
        .collect();
    let max_replica_rank = max_participants
        .iter()
        .position(|p| p.replica_id == replica_id)
        .map(|i| i as i64);
    let primary = max_participants[group_rank % max_participants.len()];

    let force_recover = init_sync && max_step == 0;
    let recovering: Vec<usize> = (0..participants.len())
        .filter(|&i| {
            let p = participants[i];
            p.step != max_step || (force_recover && p.replica_id != primary.replica_id)
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
        let md: Vec<String> = (0..4).map(|r| format!("m_{i}_{r}")).collect();
        QuorumMember {
            replica_id: format!("replica_{i}"),
            address: format!("addr_{i}"),
            store_address: format!("store_addr_{i}"),
            step,
            world_size: 1,
            data: member_data(&md),
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
        q.participants[0].step = 1;
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
        q.participants[0].data = member_data(&["only_rank_0".into()]);
        assert_eq!(
            r(&q, "replica_1", 0, true).recover_src_metadata.as_deref(),
            Some("only_rank_0")
        );
        let e = compute("replica_1", 1, &q, true).unwrap_err();
        assert!(e.to_string().contains("replica_0") && e.to_string().contains("rank 1"));
        q.participants[0].data = String::new();
        assert!(compute("replica_1", 0, &q, true).is_err());
    }

    proptest! {
        /// Every recovering replica gets an up-to-date source whose
        /// metadata is its own rank's, every source lists it, and the
        /// sources of one group rank are spread evenly.
        #[test]
        fn every_recovering_replica_gets_an_up_to_date_source(
            steps in proptest::collection::vec(0i64..3, 1..7),
            group_rank in 0usize..4,
            init_sync in any::<bool>(),
        ) {
            let q = quorum(&steps);
            let all: Vec<QuorumResult> = (0..steps.len())
                .map(|i| r(&q, &format!("replica_{i}"), group_rank, init_sync))
                .collect();
            let max = *steps.iter().max().unwrap();
            let mut load = vec![0usize; steps.len()];
            for (i, res) in all.iter().enumerate() {
                prop_assert_eq!(res.max_step, max);
                if steps[i] != max {
                    prop_assert!(res.heal);
                }
                if let Some(src) = res.recover_src_replica_rank {
                    let src = src as usize;
                    prop_assert_eq!(steps[src], max, "the source is up to date");
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
        }
    }
}
