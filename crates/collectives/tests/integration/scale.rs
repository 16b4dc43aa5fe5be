//! A 1,024-rank group in one process over real TCP.

use std::time::Instant;

use crate::harness::{each, group, opts};

/// Raises the soft descriptor limit to the hard one (a 1,024-rank group in one
/// process holds about three thousand sockets).
fn raise_fd_limit() {
    // SAFETY: plain libc calls on a local struct.
    unsafe {
        let mut l = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 {
            l.rlim_cur = l.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn barrier_of_1024_ranks_in_one_process() {
    raise_fd_limit();
    let t0 = Instant::now();
    let pgs = group(1024, opts()).await;
    let formed = t0.elapsed();
    let got = each(&pgs, |pg| async move { pg.barrier().await }).await;
    let first = t0.elapsed();
    for g in got {
        g.unwrap();
    }
    let got = each(&pgs, |pg| async move { pg.barrier().await }).await;
    for g in got {
        g.unwrap();
    }
    eprintln!(
        "1024 ranks: formed in {formed:?}, first barrier done at {first:?}, second at {:?}",
        t0.elapsed()
    );
    // And data moves at that scale too.
    let got = each(&pgs, |pg| async move {
        let mut x = [1u32];
        pg.all_reduce(&mut x, rallypoint_collectives::ReduceOp::Sum)
            .await
            .map(|()| x[0])
    })
    .await;
    for g in got {
        assert_eq!(g.unwrap(), 1024);
    }
}
