//! Every op x element type x reduce operator against a naive reference, for 1 to 9
//! ranks and sizes 0, 1, odd and larger than a segment, with every algorithm.

use rallypoint_collectives::{
    bf16, f16, AllReduceAlgorithm, BroadcastAlgorithm, Element, Options, ProcessGroup, ReduceOp,
};

use crate::harness::{data, each, group, opts};

/// The fold of every rank's data in rank order (then the mean for AVG).
fn reference<T: Element>(inputs: &[Vec<T>], op: ReduceOp) -> Vec<T> {
    let mut acc = inputs[0].clone();
    for x in &inputs[1..] {
        T::reduce(op, &mut acc, x);
    }
    if op == ReduceOp::Avg {
        T::divide(&mut acc, inputs.len());
    }
    acc
}

/// Runs every op on one type in one group and compares each rank's result.
async fn check_type<T: Element>(pgs: &[ProcessGroup], len: usize, seed: u64) {
    let n = pgs.len();
    let ctx = |what: &str| format!("{what} {} n={n} len={len}", T::DTYPE);
    let inputs: Vec<Vec<T>> = (0..n).map(|r| data(seed, r, len)).collect();
    let ops: Vec<ReduceOp> = ReduceOp::ALL
        .into_iter()
        .filter(|o| o.supports(T::DTYPE))
        .collect();

    for &op in &ops {
        let want = reference(&inputs, op);
        for algo in [
            None,
            Some(AllReduceAlgorithm::Ring),
            Some(AllReduceAlgorithm::RecursiveDoubling),
            Some(AllReduceAlgorithm::Tree),
        ] {
            let got = each(pgs, |pg| {
                let mut buf = data::<T>(seed, pg.rank(), len);
                async move {
                    let pg = match algo {
                        Some(a) => pg.with_all_reduce_algorithm(a),
                        None => pg,
                    };
                    pg.all_reduce(&mut buf, op).await.map(|()| buf)
                }
            })
            .await;
            for (r, g) in got.into_iter().enumerate() {
                assert_eq!(
                    g.unwrap(),
                    want,
                    "{} all_reduce {op} {algo:?} rank {r}",
                    ctx("")
                );
            }
        }
        // The ring's all-gather pass posts its receives in the `*_async`
        // form (over TCP they land in the buffer itself).
        let got = each(pgs, |pg| {
            let buf = data::<T>(seed, pg.rank(), len);
            let pg = pg.with_all_reduce_algorithm(AllReduceAlgorithm::Ring);
            async move { pg.all_reduce_async(buf, op).wait().await }
        })
        .await;
        for (r, g) in got.into_iter().enumerate() {
            assert_eq!(
                g.unwrap(),
                want,
                "{} all_reduce_async {op} ring rank {r}",
                ctx("")
            );
        }
        let root = n / 2;
        let got = each(pgs, |pg| {
            let mut buf = data::<T>(seed, pg.rank(), len);
            async move { pg.reduce(&mut buf, root, op).await.map(|()| buf) }
        })
        .await;
        for (r, g) in got.into_iter().enumerate() {
            let want = if r == root {
                want.clone()
            } else {
                inputs[r].clone()
            };
            assert_eq!(g.unwrap(), want, "{} reduce {op} rank {r}", ctx(""));
        }
        // reduce_scatter: every rank contributes n chunks of `len`.
        let big: Vec<Vec<T>> = (0..n).map(|r| data(seed + 1, r, len * n)).collect();
        let want_big = reference(&big, op);
        let got = each(pgs, |pg| {
            let input = data::<T>(seed + 1, pg.rank(), len * pg.size());
            async move {
                let mut out = vec![T::from_i8(0); len];
                pg.reduce_scatter(&input, &mut out, op).await.map(|()| out)
            }
        })
        .await;
        for (r, g) in got.into_iter().enumerate() {
            assert_eq!(
                g.unwrap(),
                want_big[r * len..(r + 1) * len],
                "{} reduce_scatter {op} rank {r}",
                ctx("")
            );
        }
    }

    for root in [0, n - 1] {
        for algo in [
            None,
            Some(BroadcastAlgorithm::Tree),
            Some(BroadcastAlgorithm::Chain),
        ] {
            let got = each(pgs, |pg| {
                let mut buf = data::<T>(seed, pg.rank(), len);
                async move {
                    let pg = match algo {
                        Some(a) => pg.with_broadcast_algorithm(a),
                        None => pg,
                    };
                    pg.broadcast(&mut buf, root).await.map(|()| buf)
                }
            })
            .await;
            for (r, g) in got.into_iter().enumerate() {
                assert_eq!(
                    g.unwrap(),
                    inputs[root],
                    "{} broadcast root {root} {algo:?} rank {r}",
                    ctx("")
                );
            }
        }
        // The chain posts every receive in the `*_async` form.
        let got = each(pgs, |pg| {
            let buf = data::<T>(seed, pg.rank(), len);
            let pg = pg.with_broadcast_algorithm(BroadcastAlgorithm::Chain);
            async move { pg.broadcast_async(buf, root).wait().await }
        })
        .await;
        for (r, g) in got.into_iter().enumerate() {
            assert_eq!(
                g.unwrap(),
                inputs[root],
                "{} broadcast_async root {root} chain rank {r}",
                ctx("")
            );
        }
    }

    let concat: Vec<T> = inputs.concat();
    let got = each(pgs, |pg| {
        let input = data::<T>(seed, pg.rank(), len);
        async move {
            let mut out = vec![T::from_i8(0); len * pg.size()];
            pg.all_gather(&input, &mut out).await.map(|()| out)
        }
    })
    .await;
    for (r, g) in got.into_iter().enumerate() {
        assert_eq!(g.unwrap(), concat, "{} all_gather rank {r}", ctx(""));
    }
    let got = each(pgs, |pg| {
        let input = data::<T>(seed, pg.rank(), len);
        async move { pg.all_gather_async(input).wait().await }
    })
    .await;
    for (r, g) in got.into_iter().enumerate() {
        assert_eq!(g.unwrap(), concat, "{} all_gather_async rank {r}", ctx(""));
    }

    // Varying sizes: rank r contributes len + r elements.
    let varying: Vec<Vec<T>> = (0..n).map(|r| data(seed + 2, r, len + r)).collect();
    let got = each(pgs, |pg| {
        let input = data::<T>(seed + 2, pg.rank(), len + pg.rank());
        async move { pg.all_gather_varying(&input).await }
    })
    .await;
    for (r, g) in got.into_iter().enumerate() {
        assert_eq!(
            g.unwrap(),
            varying,
            "{} all_gather_varying rank {r}",
            ctx("")
        );
    }

    let root = n - 1;
    let got = each(pgs, |pg| {
        let input = data::<T>(seed, pg.rank(), len);
        async move { pg.gather(&input, root).await }
    })
    .await;
    for (r, g) in got.into_iter().enumerate() {
        let want = (r == root).then(|| concat.clone());
        assert_eq!(g.unwrap(), want, "{} gather rank {r}", ctx(""));
    }

    let root = 0;
    let got = each(pgs, |pg| {
        let input = data::<T>(seed + 3, pg.rank(), len * pg.size());
        async move {
            let mut out = vec![T::from_i8(0); len];
            let mine = (pg.rank() == root).then_some(&input[..]);
            pg.scatter(mine, &mut out, root).await.map(|()| out)
        }
    })
    .await;
    let scattered = data::<T>(seed + 3, root, len * n);
    for (r, g) in got.into_iter().enumerate() {
        assert_eq!(
            g.unwrap(),
            scattered[r * len..(r + 1) * len],
            "{} scatter rank {r}",
            ctx("")
        );
    }

    let got = each(pgs, |pg| {
        let input = data::<T>(seed + 4, pg.rank(), len * pg.size());
        async move {
            let mut out = vec![T::from_i8(0); input.len()];
            pg.all_to_all(&input, &mut out).await.map(|()| out)
        }
    })
    .await;
    let a2a_in: Vec<Vec<T>> = (0..n).map(|r| data(seed + 4, r, len * n)).collect();
    for (r, g) in got.into_iter().enumerate() {
        let want: Vec<T> = (0..n)
            .flat_map(|j| a2a_in[j][r * len..(r + 1) * len].to_vec())
            .collect();
        assert_eq!(g.unwrap(), want, "{} all_to_all rank {r}", ctx(""));
    }

    if n > 1 {
        // A ring of tagged messages: each rank sends to the next and receives from
        // the previous, twice under two tags, received in the other order.
        let got = each(pgs, |pg| {
            let input = data::<T>(seed, pg.rank(), len);
            async move {
                let (n, r) = (pg.size(), pg.rank());
                let send = pg.send_async(input.clone(), (r + 1) % n, 7);
                let send2 = pg.send_async(input.iter().rev().copied().collect(), (r + 1) % n, 8);
                let mut second = vec![T::from_i8(0); len];
                pg.recv(&mut second, (r + n - 1) % n, 8).await?;
                let mut first = vec![T::from_i8(0); len];
                pg.recv(&mut first, (r + n - 1) % n, 7).await?;
                send.wait().await?;
                send2.wait().await?;
                Ok::<_, rallypoint_collectives::Error>((first, second))
            }
        })
        .await;
        for (r, g) in got.into_iter().enumerate() {
            let (a, b) = g.unwrap();
            let from = &inputs[(r + n - 1) % n];
            assert_eq!(&a, from, "{} send/recv rank {r}", ctx(""));
            assert_eq!(
                b,
                from.iter().rev().copied().collect::<Vec<_>>(),
                "{} send/recv tag 8 rank {r}",
                ctx("")
            );
        }
    }
}

macro_rules! all_types {
    ($pgs:expr, $len:expr, $seed:expr) => {
        check_type::<u8>($pgs, $len, $seed).await;
        check_type::<i8>($pgs, $len, $seed).await;
        check_type::<u16>($pgs, $len, $seed).await;
        check_type::<i16>($pgs, $len, $seed).await;
        check_type::<u32>($pgs, $len, $seed).await;
        check_type::<i32>($pgs, $len, $seed).await;
        check_type::<u64>($pgs, $len, $seed).await;
        check_type::<i64>($pgs, $len, $seed).await;
        check_type::<f16>($pgs, $len, $seed).await;
        check_type::<bf16>($pgs, $len, $seed).await;
        check_type::<f32>($pgs, $len, $seed).await;
        check_type::<f64>($pgs, $len, $seed).await;
    };
}

/// Segments of 16 bytes: 37 elements of any type span several, 300 many.
/// Over shared memory, rounds of the smallest half (64 bytes a rank): the
/// same sizes take several rounds.
fn small_segments(shm: bool) -> Options {
    Options {
        segment_bytes: 16,
        shared_memory: shm,
        shm_slot_bytes: 16,
        ..opts()
    }
}

async fn matrix(n: usize, shm: bool) {
    let pgs = group(n, small_segments(shm)).await;
    for (i, len) in [0usize, 1, 37, 300].into_iter().enumerate() {
        all_types!(&pgs, len, (n * 100 + i) as u64);
    }
}

/// The whole matrix (ops × types × operators × sizes) at `n` ranks, on
/// each transport: `tcp` and `shm` (in one process every rank is on one
/// host, so the default is shared memory).
macro_rules! matrices {
    ($($name:ident: $n:expr;)*) => {
        mod tcp {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::matrix($n, false).await;
                }
            )*
        }
        mod shm {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::matrix($n, true).await;
                }
            )*
        }
    };
}

matrices! {
    matrix_1_rank: 1;
    matrix_2_ranks: 2;
    matrix_3_ranks: 3;
    matrix_4_ranks: 4;
    matrix_5_ranks: 5;
    matrix_6_ranks: 6;
    matrix_7_ranks: 7;
    matrix_8_ranks: 8;
    matrix_9_ranks: 9;
}

/// The default segment size with a buffer of several segments: the path the
/// benchmark measures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_buffers_with_default_segments() {
    for shared_memory in [false, true] {
        let pgs = group(
            3,
            Options {
                shared_memory,
                ..opts()
            },
        )
        .await;
        let len = (3 << 20) / 4 + 5; // ~3 MiB of f32: four segments per rank's chunk
        let inputs: Vec<Vec<f32>> = (0..3).map(|r| data(9, r, len)).collect();
        let want = reference(&inputs, ReduceOp::Sum);
        let got = each(&pgs, |pg| {
            let mut buf = data::<f32>(9, pg.rank(), len);
            async move { pg.all_reduce(&mut buf, ReduceOp::Sum).await.map(|()| buf) }
        })
        .await;
        for g in got {
            assert!(g.unwrap() == want);
        }
        let got = each(&pgs, |pg| {
            let mut buf = data::<f32>(9, pg.rank(), len);
            async move { pg.broadcast(&mut buf, 1).await.map(|()| buf) }
        })
        .await;
        for g in got {
            assert!(g.unwrap() == inputs[1]);
        }
    }
}

/// Over shared memory, 2 to 4 ranks at the default slot: the split
/// all-reduce (each rank sums its part in its own buffer, block by block)
/// and the reduce to a root (the others sum in their halves, their buffers
/// left as they were), for a sum and an average. Inputs whose sums round
/// (so a rank that summed in another order, or kept other bits than it
/// published, would differ): every rank's result equals every other's to
/// the bit, and the reference within rounding. The last round is shorter
/// than the ranks are many, so some parts of it are empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_reductions_in_shared_memory() {
    let inexact = |r: usize, len: usize| -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 2_654_435_761 + r * 97) % 1000) as f32 / 7.0 - 60.0)
            .collect()
    };
    let near = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-3);
    for n in [2, 3, 4] {
        let pgs = group(n, opts()).await;
        let len = (5 << 20) / 4 + 2; // 5 MiB of f32: five 1 MiB rounds, then 2 elements
        let inputs: Vec<Vec<f32>> = (0..n).map(|r| inexact(r, len)).collect();
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let want = reference(&inputs, op);
            let got = each(&pgs, |pg| {
                let mut buf = inexact(pg.rank(), len);
                async move { pg.all_reduce(&mut buf, op).await.map(|()| buf) }
            })
            .await;
            let got: Vec<Vec<f32>> = got.into_iter().map(|g| g.unwrap()).collect();
            for (r, g) in got.iter().enumerate() {
                let same = g
                    .iter()
                    .zip(&got[0])
                    .all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(
                    same,
                    "all_reduce {op}, {n} ranks: rank {r} differs from rank 0"
                );
                assert!(near(g, &want), "all_reduce {op}, {n} ranks, rank {r}");
            }
            assert_eq!(pgs[0].shared_memory(), Some(true));
            let root = n - 1;
            let got = each(&pgs, |pg| {
                let mut buf = inexact(pg.rank(), len);
                async move { pg.reduce(&mut buf, root, op).await.map(|()| buf) }
            })
            .await;
            for (r, g) in got.into_iter().enumerate() {
                let g = g.unwrap();
                if r == root {
                    assert!(near(&g, &want), "reduce {op} to {root}, {n} ranks");
                } else {
                    assert!(g == inputs[r], "reduce {op}: rank {r}'s buffer changed");
                }
            }
        }
    }
}

/// Where the ring cuts its segments by size (default options, a buffer
/// whose quarter-share segments are smaller than `segment_bytes` and each
/// chunk several of them), every op built on it keeps its steps apart from
/// the steps that follow it: a reduce's gather to the root came on the
/// same connection with keys inside the ring's last phase, so a frame of
/// one could be filed under the other's key (a duplicate that dropped the
/// connection, or with several streams the wrong data). 4 ranks, 12 MiB of
/// f32, one and three streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ops_on_the_ring_at_size_chosen_segments_keep_their_steps_apart() {
    let n = 4;
    let len = (3 << 20) + 5;
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| data(11, r, len)).collect();
    let want = reference(&inputs, ReduceOp::Sum);
    for streams in [1, 3] {
        let o = Options {
            shared_memory: false,
            streams_per_peer: streams,
            ..opts()
        };
        let pgs = group(n, o).await;
        for root in [1, 3, 0] {
            let got = each(&pgs, |pg| {
                let mut buf = data::<f32>(11, pg.rank(), len);
                async move { pg.reduce(&mut buf, root, ReduceOp::Sum).await.map(|()| buf) }
            })
            .await;
            let got = got.into_iter().nth(root).unwrap();
            assert!(got.unwrap() == want, "reduce to {root}, {streams} streams");
        }
        let got = each(&pgs, |pg| {
            let mut buf = data::<f32>(11, pg.rank(), len);
            async move { pg.all_reduce(&mut buf, ReduceOp::Sum).await.map(|()| buf) }
        })
        .await;
        for g in got {
            assert!(g.unwrap() == want, "all_reduce, {streams} streams");
        }
        let got = each(&pgs, |pg| {
            let buf = data::<f32>(11, pg.rank(), len);
            async move { pg.all_gather_varying(&buf).await }
        })
        .await;
        for g in got {
            assert!(
                g.unwrap() == inputs,
                "all_gather_varying, {streams} streams"
            );
        }
    }
}

/// Over TCP the `*_async` forms receive large payloads straight into the
/// caller's buffer (posted receives): the same results as the borrowing
/// forms, and each of the three posting ops lands bytes in place. Default
/// segments (four per rank's chunk), uneven chunks, 2 to 4 ranks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn posted_receives_land_in_the_callers_buffer() {
    // Bytes landed per op: all_reduce (the ring's all-gather pass),
    // broadcast (the chain, from 3 ranks), all_gather.
    let mut landed = [0u64; 3];
    for n in 2..=4usize {
        let o = Options {
            shared_memory: false,
            ..opts()
        };
        let pgs = group(n, o).await;
        let len = (1 << 20) + 3; // 4 MiB of f32: 4 segments a chunk, uneven chunks
        let inputs: Vec<Vec<f32>> = (0..n).map(|r| data(5, r, len)).collect();
        let in_place =
            |pgs: &[ProcessGroup]| -> u64 { pgs.iter().map(|p| p.received_in_place_bytes()).sum() };
        let before = in_place(&pgs);
        let got = each(&pgs, |pg| async move {
            let b = data::<f32>(5, pg.rank(), len);
            pg.all_reduce_async(b, ReduceOp::Sum).wait().await
        })
        .await;
        let sum = reference(&inputs, ReduceOp::Sum);
        for (r, g) in got.into_iter().enumerate() {
            assert!(g.unwrap() == sum, "all_reduce_async rank {r} of {n}");
        }
        let after_reduce = in_place(&pgs);
        let got = each(&pgs, |pg| async move {
            let b = data::<f32>(5, pg.rank(), len);
            pg.broadcast_async(b, n - 1).wait().await
        })
        .await;
        for (r, g) in got.into_iter().enumerate() {
            assert!(
                g.unwrap() == inputs[n - 1],
                "broadcast_async rank {r} of {n}"
            );
        }
        let after_cast = in_place(&pgs);
        let got = each(&pgs, |pg| async move {
            let b = data::<f32>(5, pg.rank(), len);
            pg.all_gather_async(b).wait().await
        })
        .await;
        for (r, g) in got.into_iter().enumerate() {
            assert!(
                g.unwrap() == inputs.concat(),
                "all_gather_async rank {r} of {n}"
            );
        }
        let deltas = [
            after_reduce - before,
            after_cast - after_reduce,
            in_place(&pgs) - after_cast,
        ];
        eprintln!(
            "{n} ranks: landed in place (all_reduce, broadcast, all_gather): {deltas:?} bytes"
        );
        for (l, d) in landed.iter_mut().zip(deltas) {
            *l += d;
        }
    }
    // How much lands depends on timing: a frame that arrives before its op
    // posts the receive (the sender ran ahead) is filed and copied as
    // before. None at all, over runs at 2, 3 and 4 ranks, would mean that
    // op's posting is broken.
    for (op, l) in ["all_reduce", "broadcast", "all_gather"].iter().zip(landed) {
        assert!(l > 0, "{op}: nothing landed in place");
    }
}

/// Several streams per peer: segments spread over them arrive by key, not order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_streams_per_peer() {
    let o = Options {
        streams_per_peer: 3,
        segment_bytes: 64,
        shared_memory: false,
        ..opts()
    };
    let pgs = group(4, o).await;
    all_types!(&pgs, 300, 77);
}

#[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug, Clone)]
struct Info {
    name: String,
    devices: Vec<u32>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objects() {
    let pgs = group(3, opts()).await;
    let got = each(&pgs, |pg| async move {
        let me = Info {
            name: format!("worker{}", pg.rank()),
            devices: (0..pg.rank() as u32).collect(),
        };
        let all = pg.all_gather_object(&me).await?;
        let from_root = pg
            .broadcast_object((pg.rank() == 2).then_some(&me), 2)
            .await?;
        Ok::<_, rallypoint_collectives::Error>((all, from_root))
    })
    .await;
    for g in got {
        let (all, root) = g.unwrap();
        assert_eq!(all.len(), 3);
        assert_eq!(
            all[1],
            Info {
                name: "worker1".into(),
                devices: vec![0]
            }
        );
        assert_eq!(root.name, "worker2");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subgroups() {
    let pgs = group(5, opts()).await;
    let got = each(&pgs, |pg| async move {
        let sub = pg.new_group(&[4, 1, 3])?;
        let pair = pg.new_group(&[1, 2])?;
        let alone = pg
            .new_group(&[pg.rank()])?
            .expect("a member of its own group");
        let mut world = [pg.rank() as i64];
        let mut in_sub = [pg.rank() as i64 * 10];
        // Interleave world and subgroup ops: their sequences are independent.
        if let Some(s) = &sub {
            assert_eq!(s.size(), 3);
            s.all_reduce(&mut in_sub, ReduceOp::Sum).await?;
            s.barrier().await?;
        }
        pg.all_reduce(&mut world, ReduceOp::Sum).await?;
        if let Some(p) = &pair {
            let mut x = [p.rank() as u8 + 1];
            p.broadcast(&mut x, 1).await?;
            assert_eq!(x, [2]);
        }
        let mut solo = [5u32];
        alone.all_reduce(&mut solo, ReduceOp::Product).await?;
        assert_eq!(solo, [5]);
        Ok::<_, rallypoint_collectives::Error>((sub.map(|s| (s.rank(), in_sub[0])), world[0]))
    })
    .await;
    for (r, g) in got.into_iter().enumerate() {
        let (sub, world) = g.unwrap();
        assert_eq!(world, 10);
        match r {
            1 => assert_eq!(sub, Some((0, 80))),
            3 => assert_eq!(sub, Some((1, 80))),
            4 => assert_eq!(sub, Some((2, 80))),
            _ => assert_eq!(sub, None),
        }
    }
    // Bad rank lists are refused up front.
    assert!(pgs[0].new_group(&[0, 0]).is_err());
    assert!(pgs[0].new_group(&[5]).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handles_and_order() {
    let pgs = group(4, opts()).await;
    let got = each(&pgs, |pg| async move {
        // Start three operations before waiting on any: each took its sequence
        // number when started, so they pair up across ranks correctly.
        let a = pg.all_reduce_async(vec![1i32; 1000], ReduceOp::Sum);
        let b = pg.broadcast_async(vec![pg.rank() as u16; 10], 3);
        let c = pg.all_gather_async(vec![pg.rank() as u8]);
        let c = c.wait().await?;
        let b = b.wait().await?;
        let a = a.wait().await?;
        Ok::<_, rallypoint_collectives::Error>((a[999], b[0], c))
    })
    .await;
    for g in got {
        assert_eq!(g.unwrap(), (4, 3, vec![0, 1, 2, 3]));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_arguments_are_refused_before_sending() {
    let pgs = group(2, opts()).await;
    let pg = &pgs[0];
    let e = pg.all_reduce(&mut [1i32], ReduceOp::Avg).await.unwrap_err();
    assert!(e.to_string().contains("AVG does not apply to i32"), "{e}");
    let e = pg
        .all_reduce(&mut [1.0f32], ReduceOp::Bxor)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("BXOR"), "{e}");
    let e = pg.broadcast(&mut [1u8], 2).await.unwrap_err();
    assert!(e.to_string().contains("root 2 is not a rank"), "{e}");
    let mut out = [0u8; 3];
    let e = pg.all_gather(&[1u8], &mut out).await.unwrap_err();
    assert!(e.to_string().contains("expected 2"), "{e}");
    // None of this touched the group: it still works.
    let got = each(&pgs, |pg| async move { pg.barrier().await }).await;
    assert!(got.iter().all(|r| r.is_ok()));
}

/// Every collective's `*_async` form, all started at once (each takes its
/// sequence number as it starts), gives what its blocking form gives; bad
/// arguments come back through the work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_async_form_started_together_matches_its_blocking_form() {
    for shared_memory in [false, true] {
        let (n, k) = (3usize, 37usize);
        let o = Options {
            timeout: std::time::Duration::from_secs(20),
            ..small_segments(shared_memory)
        };
        let pgs = group(n, o).await;
        let got = each(&pgs, move |pg| async move {
            let r = pg.rank();
            let mine = |len: usize| data::<i32>(7, r, len);
            let works = (
                pg.barrier_async(),
                pg.all_reduce_async(mine(k), ReduceOp::Sum),
                pg.broadcast_async(mine(k), 1),
                pg.reduce_async(mine(k), 2, ReduceOp::Max),
                pg.all_gather_async(mine(k)),
                pg.all_gather_varying_async(mine(r + 1)),
                pg.gather_async(mine(k), 0),
                pg.scatter_async((r == 1).then(|| mine(k * n)), k, 1),
                pg.reduce_scatter_async(mine(k * n), ReduceOp::Sum),
                pg.all_to_all_async(mine(k * n)),
            );
            // Started in order, awaited in reverse: nothing waits on order.
            let all_to_all = works.9.wait().await.unwrap();
            let reduce_scatter = works.8.wait().await.unwrap();
            let scatter = works.7.wait().await.unwrap();
            let gather = works.6.wait().await.unwrap();
            let varying = works.5.wait().await.unwrap();
            let all_gather = works.4.wait().await.unwrap();
            let reduce = works.3.wait().await.unwrap();
            let broadcast = works.2.wait().await.unwrap();
            let all_reduce = works.1.wait().await.unwrap();
            works.0.wait().await.unwrap();
            // The same ops, blocking, on the same group.
            let mut b = mine(k);
            pg.all_reduce(&mut b, ReduceOp::Sum).await.unwrap();
            assert_eq!(all_reduce, b, "all_reduce rank {r}");
            let mut b = mine(k);
            pg.broadcast(&mut b, 1).await.unwrap();
            assert_eq!(broadcast, b, "broadcast rank {r}");
            let mut b = mine(k);
            pg.reduce(&mut b, 2, ReduceOp::Max).await.unwrap();
            assert_eq!(reduce, b, "reduce rank {r}");
            let mut b = vec![0; k * n];
            pg.all_gather(&mine(k), &mut b).await.unwrap();
            assert_eq!(all_gather, b, "all_gather rank {r}");
            assert_eq!(varying, pg.all_gather_varying(&mine(r + 1)).await.unwrap());
            assert_eq!(gather, pg.gather(&mine(k), 0).await.unwrap());
            let mut b = vec![0; k];
            let all = (r == 1).then(|| mine(k * n));
            pg.scatter(all.as_deref(), &mut b, 1).await.unwrap();
            assert_eq!(scatter, b, "scatter rank {r}");
            let mut b = vec![0; k];
            pg.reduce_scatter(&mine(k * n), &mut b, ReduceOp::Sum)
                .await
                .unwrap();
            assert_eq!(reduce_scatter, b, "reduce_scatter rank {r}");
            let mut b = vec![0; k * n];
            pg.all_to_all(&mine(k * n), &mut b).await.unwrap();
            assert_eq!(all_to_all, b, "all_to_all rank {r}");
            // Against the reference too, for two of them.
            let inputs: Vec<Vec<i32>> = (0..n).map(|q| data(7, q, k)).collect();
            assert_eq!(all_reduce, reference(&inputs, ReduceOp::Sum));
            assert_eq!(varying.len(), n);
            for (q, v) in varying.iter().enumerate() {
                assert_eq!(*v, data::<i32>(7, q, q + 1));
            }
            // Bad arguments fail the work, not the group.
            let bad = pg.reduce_scatter_async(mine(k * n + 1), ReduceOp::Sum);
            assert!(bad
                .wait()
                .await
                .unwrap_err()
                .to_string()
                .contains("equal chunks"));
            if r == 1 {
                let bad = pg.scatter_async::<i32>(None, k, 1);
                assert!(bad
                    .wait()
                    .await
                    .unwrap_err()
                    .to_string()
                    .contains("root must pass"));
            }
            pg.barrier().await.unwrap();
        })
        .await;
        assert_eq!(got.len(), n, "shared_memory {shared_memory}");
    }
}
