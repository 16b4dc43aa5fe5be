//! The end of a run: the exit barrier, the verdict published or read, the
//! rendezvous closed and left, the linger of a node serving a store others
//! use, and the outcome.

use super::*;

impl Agent {
    /// Local workers succeeded: say that the round is finishing, then wait for
    /// every node, while still watching for a failure elsewhere or a lost store,
    /// and for signals. The round's job store stays up (other nodes' workers may
    /// still use it).
    pub(super) async fn barrier(&self, run: &mut Run<'_>) -> Vec<Action> {
        let r = run.round.as_mut().expect("a round");
        let _ = bounded(run_store::mark_finishing(&*r.info.run_store, r.info.round)).await;
        let prefix = format!("rally.agent/r{}/terminal_state", r.info.round);
        let wait = rallypoint_store::util::barrier(
            &*r.info.store,
            r.info.world_size,
            &prefix,
            self.spec.exit_barrier_timeout,
            None,
        );
        tokio::pin!(wait);
        let watch = r.watch.as_mut().expect("watched from the join");
        loop {
            let event = tokio::select! {
                done = &mut wait => match done {
                    Ok(()) => Event::BarrierPassed,
                    Err(e) => {
                        // What the rendezvous says decides (the policy's table):
                        // a failure published meanwhile is never a timeout.
                        let seen = watcher::observe(&*self.handler, &*r.info.run_store, r.info.round).await;
                        if e.is_timeout() {
                            self.emit(AgentEvent::ExitBarrierTimedOut { error: e.to_string() });
                        }
                        Event::BarrierFailed {
                            error: e.to_string(),
                            timed_out: e.is_timeout(),
                            seen,
                        }
                    }
                },
                s = run.signals.recv() => Event::Signal(s),
                o = watch.next() => Event::Checked(o),
            };
            let actions = self.tell_notes(self.decide(&mut run.policy, event), None);
            if !actions.is_empty() {
                return actions;
            }
        }
    }

    /// Writes the verdict; answers with what the store holds afterwards.
    pub(super) async fn publish(&self, run: &mut Run<'_>, p: &policy::Publish) -> Vec<Action> {
        let event = match self.run_store(run) {
            None => Event::NotPublished("no run store".into()),
            Some(store) => match bounded(run_store::publish(&*store, p)).await {
                Some(Ok(closed)) => Event::Published(closed),
                Some(Err(e)) => Event::NotPublished(e.to_string()),
                None => Event::NotPublished(format!("no answer within {CHECK_TIMEOUT:?}")),
            },
        };
        if let Event::NotPublished(error) = &event {
            self.emit(AgentEvent::CleanupFailed {
                what: "publishing the verdict",
                error: error.clone(),
            });
        }
        self.decide(&mut run.policy, event)
    }

    /// Reads the verdict after the run closed while this node joined.
    pub(super) async fn read_verdict(&self, run: &mut Run<'_>) -> Vec<Action> {
        let event = match self.run_store(run) {
            // No run store to read (a backend without one before a round).
            None => Event::VerdictRead(None),
            Some(store) => match bounded(run_store::read_verdict(&*store)).await {
                Some(Ok(v)) => Event::VerdictRead(v),
                Some(Err(e)) => Event::NotPublished(e.to_string()),
                None => Event::NotPublished(format!("no answer within {CHECK_TIMEOUT:?}")),
            },
        };
        self.decide(&mut run.policy, event)
    }

    /// Closes the rendezvous so no node starts another round.
    pub(super) async fn close_rendezvous(&self, run: &mut Run<'_>) -> Vec<Action> {
        let error = match bounded(self.handler.set_closed()).await {
            Some(Ok(())) => None,
            Some(Err(e)) => Some(e.to_string()),
            None => Some(format!("no answer within {CHECK_TIMEOUT:?}")),
        };
        if let Some(error) = error {
            self.emit(AgentEvent::CleanupFailed {
                what: "closing the rendezvous",
                error,
            });
        }
        self.decide(&mut run.policy, Event::RendezvousClosed)
    }

    /// Leaves the rendezvous for good (after it read the verdict): stops
    /// keeping alive and counts this node out of the run, so a host lingering
    /// for it stops waiting.
    pub(super) async fn mark_finished(&self, run: &mut Run<'_>, _round: u64) -> Vec<Action> {
        if let Some(Err(e)) = bounded(self.handler.leave()).await {
            self.emit(AgentEvent::CleanupFailed {
                what: "leaving the rendezvous",
                error: e.to_string(),
            });
        }
        self.decide(&mut run.policy, Event::MarkedFinished)
    }

    /// Keeps this node's stores up until every other node of the run left or
    /// was found dead ([`RendezvousHandler::remaining`] is 0), or `bound`
    /// passed; a signal cuts it short. After the exit barrier, a rendezvous
    /// host that has ended ends it too: the host leaves only once the others
    /// have (or its own bound passed), so nobody is left to need our stores.
    pub(super) async fn linger(
        &self,
        run: &mut Run<'_>,
        bound: Option<Duration>,
        after_barrier: bool,
        serves: bool,
    ) -> Vec<Action> {
        let Some(store) = self.run_store(run) else {
            return self.decide(&mut run.policy, Event::Lingered(None));
        };
        let until = bound.map(|b| tokio::time::Instant::now() + b);
        let mut said = false;
        let mut left = false;
        let mut unreachable_since: Option<Instant> = None;
        let mut everyone_out_since: Option<Instant> = None;
        // By then every other node has stopped its workers on its own. A job
        // store's host waits as long: the others' workers use its store, not
        // the rendezvous one, and stop only once they lose the rendezvous.
        let give_up = if self.handler.hosts_store() || serves {
            self.limits().linger_after_failure
        } else {
            self.spec.lost_grace
        };
        loop {
            // A store that does not answer now may be stalled: keep it up and
            // look again. A node that serves no store the others use gives up
            // after `lost_grace` (nobody can count itself out of a store that
            // is gone); the rendezvous host, and a job store's host, wait
            // until the others, who cannot reach the rendezvous either, have
            // stopped their workers on their own, and a job store's host
            // also until no client is connected to its store (the others may
            // reach the rendezvous, and run on, when this node does not).
            // The bound, if any, still ends the wait.
            //
            // A lingering node runs no workers: it counts itself out of the
            // run first (when the store answers; an ending that could not
            // reach it skipped that), or two nodes that linger, the
            // rendezvous host and a job store's host, wait for each other
            // forever (both alive, both still beating).
            if !left {
                left = matches!(bounded(self.handler.leave()).await, Some(Ok(())));
            }
            let remaining = bounded(self.handler.remaining()).await.and_then(Result::ok);
            // Clients of this node's job store: other nodes' workers, still
            // using it (a client whose host died or was cut off is closed by
            // TCP keep-alive). While any is connected the store stays: the
            // rendezvous may be out of reach from here only, and the census
            // may count a node out that is back from a partition but has not
            // beaten yet (its first beat counts it in again).
            let clients = run
                .round
                .as_ref()
                .and_then(|r| r.server.as_ref())
                .or(run.kept_store.as_ref())
                .map_or(0, |s| s.stats().open);
            // With everyone counted out, a client still connected is such a
            // node about to beat, or one outside the run: waited for at most
            // `lost_grace`.
            if remaining == Some(0) {
                let since = *everyone_out_since.get_or_insert_with(Instant::now);
                if clients == 0 || since.elapsed() >= self.spec.lost_grace {
                    break;
                }
            } else {
                everyone_out_since = None;
            }
            if remaining.is_some() {
                unreachable_since = None;
            } else if (unreachable_since.get_or_insert_with(Instant::now).elapsed() >= give_up
                && clients == 0)
                || (after_barrier && self.handler.store_host_ended().await)
            {
                break;
            }
            if let (false, Some(n)) = (said, remaining) {
                said = true;
                self.emit(AgentEvent::HostLingering {
                    nodes_left: n,
                    rendezvous_store: self.handler.hosts_store(),
                    job_store: run.round.as_ref().is_some_and(|r| r.server.is_some())
                        || run.kept_store.is_some(),
                });
            }
            let nap = tokio::time::sleep(LINGER_POLL);
            tokio::select! {
                _ = nap => {}
                s = run.signals.recv() => return self.decide(&mut run.policy, Event::Signal(s)),
                _ = async {
                    match until {
                        Some(b) => tokio::time::sleep_until(b).await,
                        None => std::future::pending().await,
                    }
                } => break,
            }
        }
        let seen = bounded(run_store::read_verdict(&*store))
            .await
            .and_then(Result::ok)
            .flatten();
        self.decide(&mut run.policy, Event::Lingered(seen))
    }

    /// The end: turn the verdict into the outcome, leave the rendezvous (never
    /// closing it: the policy closed it if, and only if, a verdict was
    /// published), and release the round.
    pub(super) async fn finish(&self, verdict: Verdict, run: &mut Run<'_>) -> Outcome {
        let mut round = run.round.take();
        let stopped = round
            .as_mut()
            .map(|r| std::mem::take(&mut r.stopped))
            .unwrap_or_default();
        let attempts = round.as_ref().map_or(0, |r| r.info.round + 1);
        let store = self.run_store(run);
        let outcome = match verdict {
            Verdict::Succeeded { barrier, .. } => Outcome::Succeeded { attempts, barrier },
            Verdict::Failed {
                why: Failure::StartFailed(e),
                ..
            } => Outcome::Error(e),
            Verdict::Failed { why, root } => {
                let failures = match &store {
                    Some(s) => bounded(run_store::failed_rounds(&**s))
                        .await
                        .and_then(Result::ok)
                        .unwrap_or(0)
                        .max(run.failed_rounds),
                    None => run.failed_rounds,
                };
                Outcome::Failed {
                    reason: self.reason(&why),
                    root_cause: root,
                    failures,
                    stopped,
                }
            }
            Verdict::Signaled(signal) => Outcome::Signaled { signal, stopped },
            Verdict::NotNeeded => Outcome::NotNeeded,
            Verdict::JoinFailed(e) => match run.join_error.take() {
                Some(e) => Outcome::Rendezvous(e),
                None => Outcome::Error(e),
            },
        };
        if let Some(Err(e)) = bounded(self.handler.leave()).await {
            self.emit(AgentEvent::CleanupFailed {
                what: "leaving the rendezvous",
                error: e.to_string(),
            });
        }
        if let Some(r) = round {
            self.end_round(r).await;
        }
        if let Some(s) = run.kept_store.take() {
            s.shutdown().await;
        }
        outcome
    }

    pub(super) fn reason(&self, why: &Failure) -> String {
        match why {
            Failure::OutOfRestarts { failed_rounds } => format!(
                "workers failed {failed_rounds} time(s); --max-restarts is {}",
                self.spec.max_restarts
            ),
            Failure::AfterClose => {
                "workers failed after the run was closed (no more rounds to restart in)".into()
            }
            Failure::MemberLostAfterClose => {
                "a node died after the run was closed (no more rounds to replace it)".into()
            }
            Failure::FixedGroupFinished => format!(
                "workers failed after another node's workers had finished, and the {} rendezvous cannot restart without them",
                self.handler.backend()
            ),
            Failure::FixedGroupStart(e) => format!(
                "the group could not start ({e}), and the {} rendezvous cannot re-form",
                self.handler.backend()
            ),
            Failure::MemberLostFixedGroup => format!(
                "a node stopped keeping alive, and the {} rendezvous cannot re-form without it",
                self.handler.backend()
            ),
            Failure::Unrecorded => format!(
                "workers failed and the run store did not take the failure for {:?}",
                self.spec.lost_grace
            ),
            Failure::Elsewhere => "another node ended the run after a failure".into(),
            Failure::LostRendezvous { during } => format!(
                "lost the rendezvous host during {during}: its store stopped answering for {:?}",
                self.spec.lost_grace
            ),
            Failure::StartFailed(e) => e.clone(),
            Failure::Unpublished(e) => {
                format!("the run's verdict could not be read or written (outcome unknown): {e}")
            }
        }
    }
}
