//! Flow control: a rank that falls behind files at most its receive window
//! from each peer, rather than everything they send.
//!
//! Each test runs over TCP (shared memory makes every rank of an op wait for
//! every other, so nobody runs ahead there). With `receive_window: 0` (no
//! flow control, as before it existed) the first two tests fail: rank 1 files
//! all 64 MiB and rank 0 finishes every op while rank 1 sleeps.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rallypoint_collectives::{Error, Options, ProcessGroup, ReduceOp};

use crate::harness::{group, opts};

const WINDOW: usize = 4 << 20;
const MIB_F32: usize = (1 << 20) / 4;
const OPS: usize = 64;

fn flow_opts() -> Options {
    Options {
        shared_memory: false,
        receive_window: WINDOW,
        timeout: Duration::from_secs(60),
        ..opts()
    }
}

/// What rank 1 may have filed at most while it runs no op: the window
/// (rank 0 counts what it sent and rank 1 has not taken, so this holds
/// whatever the scheduling).
const BOUND: u64 = WINDOW as u64;

/// Watches rank 1 while it takes nothing for `for_`: the most it had filed.
async fn peak_while_idle(pg: &ProcessGroup, for_: Duration) -> u64 {
    let until = tokio::time::Instant::now() + for_;
    let mut peak = 0;
    while tokio::time::Instant::now() < until {
        peak = peak.max(pg.received_ahead_bytes());
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    peak
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_behind_stops_a_broadcast_root_at_its_window() {
    let pgs = group(2, flow_opts()).await;
    let sent = Arc::new(AtomicUsize::new(0));
    let (root, sent_by_root) = (pgs[0].clone(), sent.clone());
    let rooted = tokio::spawn(async move {
        for i in 0..OPS {
            let mut buf = vec![i as f32; MIB_F32];
            root.broadcast(&mut buf, 0).await?;
            sent_by_root.fetch_add(1, Ordering::SeqCst);
        }
        Ok::<_, Error>(())
    });
    // A root only sends, so without a bound it finishes all 64 MiB in well
    // under this while rank 1 files them.
    let peak = peak_while_idle(&pgs[1], Duration::from_secs(1)).await;
    let done_early = sent.load(Ordering::SeqCst);
    assert!(
        peak <= BOUND,
        "rank 1 filed {peak} bytes with a window of {WINDOW}"
    );
    assert!(
        done_early < OPS,
        "the root finished all {OPS} broadcasts while rank 1 took none"
    );
    for i in 0..OPS {
        let mut buf = vec![0f32; MIB_F32];
        pgs[1].broadcast(&mut buf, 0).await.unwrap();
        assert!(buf.iter().all(|&x| x == i as f32), "broadcast #{i}");
    }
    rooted.await.unwrap().unwrap();
    assert_eq!(sent.load(Ordering::SeqCst), OPS);
    assert_eq!(
        pgs[1].received_ahead_bytes(),
        0,
        "everything filed was taken"
    );
    // Credit is back: both go on as usual.
    let sums: Vec<_> = pgs
        .iter()
        .map(|pg| {
            let pg = pg.clone();
            tokio::spawn(async move {
                let mut x = [1u64];
                pg.all_reduce(&mut x, ReduceOp::Sum).await.map(|_| x[0])
            })
        })
        .collect();
    for t in sums {
        assert_eq!(t.await.unwrap().unwrap(), 2);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_to_a_rank_behind_wait_at_its_window_and_one_it_waits_for_is_let_through() {
    let pgs = group(2, flow_opts()).await;
    let sent = Arc::new(AtomicUsize::new(0));
    let (sender, counted) = (pgs[0].clone(), sent.clone());
    let bulk = tokio::spawn(async move {
        for i in 0..OPS {
            sender.send(&vec![i as u32; MIB_F32], 1, 7).await?;
            counted.fetch_add(1, Ordering::SeqCst);
        }
        Ok::<_, Error>(())
    });
    let peak = peak_while_idle(&pgs[1], Duration::from_secs(1)).await;
    assert!(
        peak <= BOUND,
        "rank 1 filed {peak} bytes with a window of {WINDOW}"
    );
    assert!(sent.load(Ordering::SeqCst) < OPS, "the sender never waited");
    // Rank 0 is out of credit; a message on another tag, sent now, is one
    // rank 1 waits for, so it asks for it and gets it without credit.
    let urgent = {
        let pg = pgs[0].clone();
        tokio::spawn(async move { pg.send(&[42u32; 3], 1, 9).await })
    };
    let mut got = [0u32; 3];
    pgs[1].recv(&mut got, 0, 9).await.unwrap();
    assert_eq!(got, [42; 3]);
    urgent.await.unwrap().unwrap();
    for i in 0..OPS {
        let mut buf = vec![0u32; MIB_F32];
        pgs[1].recv(&mut buf, 0, 7).await.unwrap();
        assert!(buf.iter().all(|&x| x == i as u32), "message #{i}");
    }
    bulk.await.unwrap().unwrap();
    assert_eq!(pgs[1].received_ahead_bytes(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_collectives_in_flight_together_get_through_without_credit() {
    // Every op is started at once on both ranks; frames of later ops fill
    // rank 1's window while it waits for earlier ones, which it asks for.
    let o = Options {
        receive_window: 1 << 20,
        ..flow_opts()
    };
    let pgs = group(2, o).await;
    let n = 24;
    let works: Vec<Vec<_>> = pgs
        .iter()
        .map(|pg| {
            (0..n)
                .map(|i| {
                    pg.broadcast_async(vec![(i + 1) as f32 * f32::from(pg.rank() == 0); MIB_F32], 0)
                })
                .collect()
        })
        .collect();
    for (r, ws) in works.into_iter().enumerate() {
        for (i, w) in ws.into_iter().enumerate() {
            let got = w.wait().await.unwrap();
            assert!(
                got.iter().all(|&x| x == (i + 1) as f32),
                "rank {r}, op #{i}"
            );
        }
    }
    assert_eq!(pgs[1].received_ahead_bytes(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_out_of_credit_past_its_timeout_says_so() {
    let o = Options {
        timeout: Duration::from_secs(1),
        ..flow_opts()
    };
    let pgs = group(2, o).await;
    let mut failed = None;
    for i in 0..OPS {
        let mut buf = vec![i as f32; MIB_F32];
        if let Err(e) = pgs[0].broadcast(&mut buf, 0).await {
            failed = Some((i, e));
            break;
        }
    }
    let (i, e) = failed.expect("rank 1 took nothing, yet all 64 broadcasts returned");
    assert!(i > 0, "the first broadcast fits the window");
    let s = e.to_string();
    assert!(matches!(e, Error::Timeout { .. }), "{s}");
    assert!(
        s.contains("out of credit") && s.contains("receive_window"),
        "{s}"
    );
    drop(pgs);
}

/// Two ranks that each send the other more than the window: blocking sends
/// first (each waits for the other to take, as with any bounded buffering:
/// unsafe under MPI and NCCL too) time out saying so; with the receives
/// posted first (`recv_async`) both go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exchange_larger_than_the_window_needs_its_receives_posted_first() {
    let o = Options {
        timeout: Duration::from_secs(2),
        ..flow_opts()
    };
    let pgs = group(2, o).await;
    let big = 4 * MIB_F32 * 4; // 16 MiB of u32, four windows
    let tasks: Vec<_> = pgs
        .iter()
        .map(|pg| {
            let pg = pg.clone();
            tokio::spawn(async move {
                let peer = 1 - pg.rank();
                let posted = pg.recv_async::<u32>(big, peer, 5);
                pg.send(&vec![pg.rank() as u32 + 10; big], peer, 5).await?;
                let got = posted.wait().await?;
                assert!(got.iter().all(|&x| x == peer as u32 + 10));
                Ok::<_, Error>(())
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let tasks: Vec<_> = pgs
        .iter()
        .map(|pg| {
            let pg = pg.clone();
            tokio::spawn(async move {
                let peer = 1 - pg.rank();
                pg.send(&vec![1u32; big], peer, 6).await
            })
        })
        .collect();
    // The first to time out says why; its abort then fails the other (or
    // the other times out too: the abort dropped what it had filed, which
    // gave its peer credit back for a moment).
    let mut errors = Vec::new();
    for t in tasks {
        errors.push(t.await.unwrap().unwrap_err().to_string());
    }
    assert!(errors.iter().all(|e| e.contains("timed out")), "{errors:?}");
    assert!(
        errors.iter().any(|e| e.contains("out of credit")),
        "{errors:?}"
    );
}
