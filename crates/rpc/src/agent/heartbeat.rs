//! The heartbeat: a worker that calls wait on and that stays silent past the
//! deadline is gone (see [`crate::RpcBackendOptions::heartbeat`]).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rallypoint_sync::MutexExt;
use tokio::time::Instant;

use super::AgentInner;
use crate::transport::Outgoing;
use crate::wire::{self, Envelope};

impl AgentInner {
    /// Sends a heartbeat to `to` (a probe when `answer`), in the background,
    /// bounded by the heartbeat deadline.
    pub(super) fn beat(self: &Arc<Self>, to: u32, answer: bool) {
        let Ok(env) = wire::encode(&Envelope::Heartbeat { answer }) else {
            return;
        };
        let Ok(t) = self.transport().cloned() else {
            return;
        };
        let bound = self.heartbeat.max(Duration::from_millis(100));
        self.rt.spawn(async move {
            let msg = Outgoing {
                env,
                bulk: Vec::new(),
            };
            let _ = tokio::time::timeout(bound, t.send(to, msg)).await;
        });
    }

    /// Starts the heartbeat: each worker that calls are waiting on and that
    /// was not heard from for a quarter of the deadline is probed (at most
    /// once per quarter), and one silent for the whole deadline (counted
    /// from the later of the last thing heard and the oldest call waiting
    /// on it) is gone. Checked every eighth of the deadline, at least every
    /// 250 ms, so a death is named at most that late.
    pub(crate) fn start_heartbeat(self: &Arc<Self>) {
        if self.heartbeat.is_zero() {
            return;
        }
        let weak = Arc::downgrade(self);
        let tick = (self.heartbeat / 8).clamp(Duration::from_millis(5), Duration::from_millis(250));
        let probe_every = self.heartbeat / 4;
        self.rt.spawn(async move {
            let mut every = tokio::time::interval(tick);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let Some(a) = weak.upgrade() else {
                    return;
                };
                if a.closed.load(Ordering::SeqCst) {
                    return;
                }
                a.check_heartbeats(probe_every);
            }
        });
    }

    pub(super) fn check_heartbeats(self: &Arc<Self>, probe_after: Duration) {
        let mut waited: HashMap<u32, Instant> = HashMap::new();
        for p in self.pending.locked().values() {
            let e = waited.entry(p.to).or_insert(p.since);
            *e = (*e).min(p.since);
        }
        waited.remove(&self.me.id);
        if waited.is_empty() {
            return;
        }
        let now = Instant::now();
        let below = self.transport().ok().cloned();
        for (peer, since) in waited {
            let mut last = since;
            if let Some(h) = self.heard.locked().get(&peer) {
                last = last.max(*h);
            }
            if let Some(h) = below.as_ref().and_then(|t| t.heard_from(peer)) {
                last = last.max(Instant::from_std(h));
            }
            let silent = now.saturating_duration_since(last);
            if silent >= self.heartbeat {
                let reason = format!(
                    "nothing was heard from it for {:.1} s while calls waited on it (heartbeat deadline {} s): it is stopped, cut off or its host is down",
                    silent.as_secs_f64(),
                    self.heartbeat.as_secs_f64()
                );
                tracing::warn!(worker = %self.me.name, peer = %self.name_of(peer), "{reason}");
                self.peer_gone(peer, &reason, false);
            } else if silent >= probe_after {
                let mut probed = self.probed.locked();
                let due = probed
                    .get(&peer)
                    .is_none_or(|t| now.saturating_duration_since(*t) >= probe_after);
                if due {
                    probed.insert(peer, now);
                    drop(probed);
                    self.beat(peer, true);
                }
            }
        }
    }
}
