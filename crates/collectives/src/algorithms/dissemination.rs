//! Dissemination barrier: `⌈lg n⌉` rounds of one signal out and one in,
//! the small-group barrier (up to `Options::dissemination_max_ranks` ranks,
//! where every rank ends up connected to `⌈lg n⌉` peers each way).

use crate::error::Result;
use crate::op::OpCtx;

/// Dissemination barrier: in round `k` rank `r` signals `r + 2^k` and waits for
/// `r − 2^k`; after `⌈lg n⌉` rounds everyone has heard from everyone.
pub(crate) async fn barrier_dissemination(cx: &OpCtx) -> Result<()> {
    let (n, r) = (cx.n(), cx.me());
    let mut k = 0;
    while (1usize << k) < n {
        let d = 1 << k;
        cx.send::<u8>((r + d) % n, k, &[]).await?;
        cx.recv_copy::<u8>((r + n - d) % n, k, &mut []).await?;
        k += 1;
    }
    Ok(())
}
