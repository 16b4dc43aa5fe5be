//! Graceful shutdown of a static group, PyTorch's order over our process
//! group:
//!
//! 1. a barrier: every worker has reached shutdown;
//! 2. users released, owners drained (within the deadline; what is still
//!    referenced then is reported by name);
//! 3. rounds of "idle here, sum the calls in flight over the group" until
//!    the sum is zero, with new outgoing work held at the agent's gate from
//!    the moment a round's count is read (see `agent/gate.rs`).
//!
//! A non-graceful shutdown gives up the process group, so that the others'
//! next collective fails at once naming this worker, instead of timing out.

use std::sync::Arc;
use std::time::Duration;

use rallypoint_collectives::{ProcessGroup, ReduceOp};
use tokio::time::Instant;

use crate::agent::{AgentInner, Group};
use crate::error::{Error, Result};
use crate::transport::{BoxFuture, FOREVER};

/// A static group: its process group.
pub(crate) struct StaticGroup(pub(crate) ProcessGroup);

impl Group for StaticGroup {
    fn graceful<'a>(
        &'a self,
        agent: &'a Arc<AgentInner>,
        deadline: Option<Instant>,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(graceful(agent, &self.0, deadline))
    }

    fn abandon(&self) {
        self.0
            .abort("the RPC agent shut down without waiting for the others");
    }
}

async fn graceful(a: &Arc<AgentInner>, pg: &ProcessGroup, deadline: Option<Instant>) -> Result<()> {
    let left =
        |d: Option<Instant>| d.map_or(FOREVER, |d| d.saturating_duration_since(Instant::now()));
    let fail = |m: String| Error::ShutdownIncomplete {
        worker: a.me.name.clone(),
        message: m,
    };
    // 1. Everyone has reached shutdown.
    pg.with_timeout(left(deadline))
        .barrier()
        .await
        .map_err(|e| {
            a.group_left(&e);
            fail(format!("waiting for every worker to reach shutdown: {e}"))
        })?;
    // 2. Users released, owners drained.
    if !a.release_and_drain(deadline, true).await {
        tracing::warn!(worker = %a.me.name, "RRefs still referenced when shutdown stopped waiting");
    }
    // 3. No call in flight anywhere.
    a.gate.close();
    loop {
        a.wait_idle(deadline).await;
        let mut n = [a.gate.count() as u64];
        let r = pg
            .with_timeout(left(deadline))
            .all_reduce(&mut n, ReduceOp::Sum)
            .await;
        if let Err(e) = r {
            a.gate.verdict(true);
            a.group_left(&e);
            return Err(fail(format!(
                "waiting for every worker's calls to finish: {e}"
            )));
        }
        a.gate.verdict(n[0] == 0);
        if n[0] == 0 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}
