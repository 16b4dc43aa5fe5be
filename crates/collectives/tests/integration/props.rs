//! Property tests: each algorithm against the reference on random groups,
//! lengths, segment sizes and full-range data.

use std::sync::OnceLock;

use proptest::prelude::*;
use rallypoint_collectives::{AllReduceAlgorithm, BroadcastAlgorithm, Options, ReduceOp};

use crate::harness::{each, group, opts};

fn rt() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    })
}

fn words(seed: u64, rank: usize, len: usize) -> Vec<i64> {
    let mut rng = fastrand::Rng::with_seed(seed.wrapping_add(rank as u64 * 7919));
    (0..len).map(|_| rng.i64(..)).collect()
}

fn fold(inputs: &[Vec<i64>], op: ReduceOp) -> Vec<i64> {
    let mut acc = inputs[0].clone();
    for x in &inputs[1..] {
        <i64 as rallypoint_collectives::Element>::reduce(op, &mut acc, x);
    }
    acc
}

/// TCP with segments of `seg_words` words, or, when `seg_words` is odd,
/// shared memory with halves of as many words (at least 64 bytes a rank),
/// where the forced algorithm does not apply: every op has one there.
fn seg_opts(seg_words: usize) -> Options {
    Options {
        segment_bytes: seg_words * 8,
        shared_memory: seg_words % 2 == 1,
        shm_slot_bytes: seg_words * 8,
        ..opts()
    }
}

const INT_OPS: [ReduceOp; 7] = [
    ReduceOp::Sum,
    ReduceOp::Product,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::Band,
    ReduceOp::Bor,
    ReduceOp::Bxor,
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn all_reduce_algorithms(n in 1usize..=9, len in 0usize..200, seg in 1usize..40, seed: u64,
                             op in prop::sample::select(INT_OPS.to_vec()),
                             algo in prop::sample::select(vec![AllReduceAlgorithm::Ring, AllReduceAlgorithm::RecursiveDoubling, AllReduceAlgorithm::Tree])) {
        let got = rt().block_on(async {
            let pgs = group(n, seg_opts(seg)).await;
            each(&pgs, |pg| {
                let mut buf = words(seed, pg.rank(), len);
                async move { pg.with_all_reduce_algorithm(algo).all_reduce(&mut buf, op).await.map(|()| buf) }
            }).await
        });
        let want = fold(&(0..n).map(|r| words(seed, r, len)).collect::<Vec<_>>(), op);
        for g in got {
            prop_assert_eq!(g.unwrap(), want.clone());
        }
    }

    #[test]
    fn broadcast_algorithms(n in 1usize..=9, len in 0usize..200, seg in 1usize..40, seed: u64, root_pick: usize,
                            algo in prop::sample::select(vec![BroadcastAlgorithm::Tree, BroadcastAlgorithm::Chain])) {
        let root = root_pick % n;
        let got = rt().block_on(async {
            let pgs = group(n, seg_opts(seg)).await;
            each(&pgs, |pg| {
                let mut buf = words(seed, pg.rank(), len);
                async move { pg.with_broadcast_algorithm(algo).broadcast(&mut buf, root).await.map(|()| buf) }
            }).await
        });
        for g in got {
            prop_assert_eq!(g.unwrap(), words(seed, root, len));
        }
    }

    #[test]
    fn ring_all_gather_with_varying_sizes(lens in prop::collection::vec(0usize..60, 1..=9), seg in 1usize..20, seed: u64) {
        let n = lens.len();
        let lens2 = lens.clone();
        let got = rt().block_on(async {
            let pgs = group(n, seg_opts(seg)).await;
            each(&pgs, move |pg| {
                let input = words(seed, pg.rank(), lens2[pg.rank()]);
                async move { pg.all_gather_varying(&input).await }
            }).await
        });
        let want: Vec<Vec<i64>> = (0..n).map(|r| words(seed, r, lens[r])).collect();
        for g in got {
            prop_assert_eq!(g.unwrap(), want.clone());
        }
    }

    #[test]
    fn reduce_scatter_reduce_and_all_to_all(n in 1usize..=9, k in 0usize..30, seg in 1usize..20, seed: u64, root_pick: usize,
                                            op in prop::sample::select(INT_OPS.to_vec())) {
        let root = root_pick % n;
        let got = rt().block_on(async {
            let pgs = group(n, seg_opts(seg)).await;
            each(&pgs, |pg| {
                let input = words(seed, pg.rank(), k * pg.size());
                async move {
                    let mut rs = vec![0; k];
                    pg.reduce_scatter(&input, &mut rs, op).await?;
                    let mut red = input.clone();
                    pg.reduce(&mut red, root, op).await?;
                    let mut a2a = vec![0; input.len()];
                    pg.all_to_all(&input, &mut a2a).await?;
                    Ok::<_, rallypoint_collectives::Error>((rs, red, a2a))
                }
            }).await
        });
        let inputs: Vec<Vec<i64>> = (0..n).map(|r| words(seed, r, k * n)).collect();
        let total = fold(&inputs, op);
        for (r, g) in got.into_iter().enumerate() {
            let (rs, red, a2a) = g.unwrap();
            prop_assert_eq!(&rs[..], &total[r * k..(r + 1) * k]);
            prop_assert_eq!(&red, if r == root { &total } else { &inputs[r] });
            let want: Vec<i64> = (0..n).flat_map(|j| inputs[j][r * k..(r + 1) * k].to_vec()).collect();
            prop_assert_eq!(a2a, want);
        }
    }
}
