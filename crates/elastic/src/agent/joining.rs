//! The rendezvous phase: joining the next round (ending the previous one),
//! with signals, progress notes, and a probe of the run store that fails the
//! join once the store has not answered for `lost_grace`.

use super::*;

impl Agent {
    /// Joins the next round (ending the previous one). The previous round's job
    /// store stays up until the join ends: a member that has not yet noticed the
    /// re-form still runs workers on it, and a store gone under them would read
    /// as their failure. When the join forms no round (the run closed while
    /// this node re-joined: others may still be finishing on that store), it
    /// stays until the run ends, and this node lingers for its clients.
    pub(super) async fn join(&self, run: &mut Run<'_>) -> Vec<Action> {
        let previous = match run.round.take() {
            Some(mut r) => {
                let server = r.server.take();
                self.end_round(r).await;
                server
            }
            None => None,
        };
        let actions = self.join_next(run).await;
        if run.round.is_none() {
            run.kept_store = previous.or(run.kept_store.take());
        } else {
            for server in [previous, run.kept_store.take()].into_iter().flatten() {
                server.shutdown().await;
            }
        }
        actions
    }

    /// Joins the next round, noting progress every 10 s; a signal aborts it.
    pub(super) async fn join_next(&self, run: &mut Run<'_>) -> Vec<Action> {
        let started = Instant::now();
        let run_id = self.handler.run_id().to_owned();
        self.emit(AgentEvent::RendezvousStarted {
            run_id: run_id.clone(),
        });
        let handler = self.handler.clone();
        let mut join = tokio::spawn(async move { handler.next_rendezvous().await });
        let mut note =
            tokio::time::interval_at(tokio::time::Instant::now() + PROGRESS_EVERY, PROGRESS_EVERY);
        // The run store, probed while the join waits: the join itself would
        // wait out the store client's retries and the join timeout.
        let probed = run
            .last_run_store
            .clone()
            .or_else(|| self.handler.run_store());
        let mut probe =
            tokio::time::interval_at(tokio::time::Instant::now() + JOIN_PROBE, JOIN_PROBE);
        let mut unreachable_since: Option<Instant> = None;
        let joined = loop {
            tokio::select! {
                r = &mut join => break r,
                _ = probe.tick(), if probed.is_some() => {
                    let store = probed.as_ref().expect("probed only with a store");
                    let answer = tokio::time::timeout(
                        JOIN_PROBE,
                        store.check(&[run_store::keys::CLOSED]),
                    )
                    .await;
                    let error = match answer {
                        Ok(Ok(_)) => None,
                        Ok(Err(e)) => Some(e.to_string()),
                        Err(_) => Some(format!("no answer within {JOIN_PROBE:?}")),
                    };
                    match error {
                        None => unreachable_since = None,
                        Some(e) => {
                            let since = *unreachable_since.get_or_insert_with(Instant::now);
                            if since.elapsed() >= self.spec.lost_grace {
                                join.abort();
                                let at = self
                                    .handler
                                    .endpoint()
                                    .map_or(String::new(), |e| format!(" at {e}"));
                                let error = format!(
                                    "the rendezvous store{at} of run {run_id} stopped answering for {:?} while joining (--rdzv-lost-timeout): {e}",
                                    since.elapsed()
                                );
                                self.emit(AgentEvent::RendezvousFailed { error: error.clone() });
                                return self.decide(&mut run.policy, Event::JoinFailed(error));
                            }
                        }
                    }
                }
                s = run.signals.recv() => {
                    // Dropping the join mid-way is safe: the rendezvous never
                    // waits for a node that stopped between its steps.
                    join.abort();
                    return self.decide(&mut run.policy, Event::Signal(s));
                }
                _ = note.tick() => self.emit(AgentEvent::RendezvousWaiting {
                    run_id: run_id.clone(),
                    waited: started.elapsed(),
                }),
            }
        };
        let event = match joined {
            Ok(Ok(info)) => {
                self.emit(AgentEvent::RendezvousCompleted {
                    run_id,
                    round: info.round,
                    group_rank: info.rank,
                    group_world_size: info.world_size,
                    duration: started.elapsed(),
                });
                let e = Event::Joined {
                    round: info.round,
                    nodes: info.world_size,
                };
                run.last_run_store = Some(info.run_store.clone());
                let watch = watcher::Watch::spawn(
                    self.handler.clone(),
                    info.run_store.clone(),
                    info.round,
                    self.spec.monitor_interval,
                );
                run.round = Some(Round {
                    watch: Some(watch),
                    info,
                    ranks: ranks::NodeRanks::default(),
                    server: None,
                    proxy: None,
                    workers: None,
                    started: Instant::now(),
                    failures: Vec::new(),
                    stopped: Vec::new(),
                });
                e
            }
            Ok(Err(e)) => {
                let event = match &e {
                    RendezvousError::GracefulExit { .. } | RendezvousError::Closed { .. } => {
                        Event::JoinClosed
                    }
                    other => {
                        self.emit(AgentEvent::RendezvousFailed {
                            error: other.to_string(),
                        });
                        Event::JoinFailed(other.to_string())
                    }
                };
                run.join_error = Some(e);
                event
            }
            Err(e) => Event::JoinFailed(format!("the rendezvous task failed: {e}")),
        };
        self.decide(&mut run.policy, event)
    }
}
