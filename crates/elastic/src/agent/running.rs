//! The running phase and what follows a failure: watching the workers and
//! the rendezvous, stopping the group, recording the failure in the run store.

use super::policy::StopReason;
use super::*;
use crate::multiprocessing::stacks;

impl Agent {
    /// Workers run: wait for their exits, what the rendezvous watch sees
    /// ([`watcher`]: no polling), and signals, until the policy acts.
    pub(super) async fn running(&self, run: &mut Run<'_>) -> Vec<Action> {
        let r = run.round.as_mut().expect("running in a round");
        let workers = r.workers.as_mut().expect("workers started");
        let watch = r.watch.as_mut().expect("watched from the join");
        loop {
            let event = tokio::select! {
                ok = workers.watch() => match ok {
                    true => Event::WorkersSucceeded,
                    false => Event::WorkerFailed,
                },
                s = run.signals.recv() => Event::Signal(s),
                o = watch.next() => Event::Checked(o),
            };
            if event == Event::WorkersSucceeded {
                self.emit(AgentEvent::WorkersSucceeded {
                    round: r.info.round,
                    duration: r.started.elapsed(),
                });
            }
            let actions = self.decide(&mut run.policy, event);
            if !actions.is_empty() {
                return actions;
            }
        }
    }

    /// Stops the group: `signal`, the grace, SIGKILL, orphans. A second signal
    /// cuts the grace short. Then collects how the workers ended.
    pub(super) async fn stop(&self, run: &mut Run<'_>, signal: i32) -> Vec<Action> {
        if let Some(budget) = self.spec.stack_dump {
            self.read_stacks(run, budget).await;
        }
        let r = run.round.as_mut().expect("stopping a round");
        let Some(workers) = r.workers.as_mut() else {
            return self.decide(&mut run.policy, Event::Stopped { failure: None });
        };
        let hurry = Notify::new();
        let stuck = {
            let stopping = workers.stop(signal, self.spec.shutdown_timeout, &hurry);
            tokio::pin!(stopping);
            loop {
                tokio::select! {
                    stuck = &mut stopping => break stuck,
                    s = run.signals.recv() => {
                        if self.decide(&mut run.policy, Event::Signal(s)).contains(&Action::Kill) {
                            hurry.notify_one();
                        }
                    }
                }
            }
        };
        if !stuck.is_empty() {
            self.emit(AgentEvent::StopIncomplete { pids: stuck });
        }
        let result = workers.outcome();
        self.finish_workers(&result);
        let mut failures = self.failure_records(r, &result);
        failures.sort_by(|a, b| a.time.total_cmp(&b.time));
        for f in &failures {
            self.emit(AgentEvent::WorkerFailed(Box::new(f.clone())));
        }
        let failure = failures.first().cloned().map(Box::new);
        r.failures = failures;
        self.decide(&mut run.policy, Event::Stopped { failure })
    }

    /// Before a stop: reads the Python stacks of the workers still running
    /// (see [`stacks`]), within `budget`, into the round and an event. A
    /// second signal meanwhile (Kill) stops waiting: the reads go on in the
    /// background and their results are dropped.
    async fn read_stacks(&self, run: &mut Run<'_>, budget: Duration) {
        let r = run.round.as_mut().expect("stopping a round");
        let Some(workers) = r.workers.as_mut() else {
            return;
        };
        let why = stop_reason(run.policy.phase(), workers);
        let base = r.ranks.base_rank;
        let targets = workers.stack_targets(|local| base + local);
        if targets.is_empty() {
            return;
        }
        let t0 = Instant::now();
        let header = format!("before it was stopped: {why}");
        let reading = tokio::task::spawn_blocking(move || stacks::dump(targets, budget, &header));
        tokio::pin!(reading);
        let read = loop {
            tokio::select! {
                read = &mut reading => break read.ok(),
                s = run.signals.recv() => {
                    if self.decide(&mut run.policy, Event::Signal(s)).contains(&Action::Kill) {
                        break None;
                    }
                }
            }
        };
        let Some(read) = read else {
            return;
        };
        self.emit(AgentEvent::StacksDumped {
            round: r.info.round,
            why,
            workers: read
                .iter()
                .map(|w| {
                    let error = w.stacks.as_ref().err().cloned();
                    (w.target.rank, w.target.pid, w.written.clone(), error)
                })
                .collect(),
            took: t0.elapsed(),
        });
        r.stopped = read;
    }

    /// Kills whatever carries this agent's mark: descendants of workers that
    /// left their process group (`setsid`, double forks).
    pub(super) fn kill_marked(&self) {
        if let Some(mark) = &self.spec.mark {
            let left = crate::multiprocessing::watchdog::kill_marked(
                mark,
                crate::multiprocessing::KILL_WAIT,
            );
            if !left.is_empty() {
                self.emit(AgentEvent::StopIncomplete { pids: left });
            }
        }
    }

    /// Records the round's failures in the run store and counts the round once,
    /// job-wide. One bounded attempt; the policy retries within `lost_grace`.
    pub(super) async fn record_failure(&self, run: &mut Run<'_>) -> Vec<Action> {
        let r = run.round.as_ref().expect("a failed round");
        let store = &*r.info.run_store;
        let record = async {
            let n =
                run_store::record_failure(store, r.info.round, r.info.rank, &r.failures).await?;
            let finishing = run_store::finishing(store, r.info.round).await?;
            Ok::<_, StoreError>((n, finishing))
        };
        let event = tokio::select! {
            n = tokio::time::timeout(CHECK_TIMEOUT, record) => match n {
                Ok(Ok((n, finishing))) => Event::FailureRecorded { failed_rounds: n, finishing },
                Ok(Err(e)) => Event::FailureNotRecorded(e.to_string()),
                Err(_) => Event::FailureNotRecorded(format!("no answer within {CHECK_TIMEOUT:?}")),
            },
            s = run.signals.recv() => Event::Signal(s),
        };
        if let Event::FailureNotRecorded(_) = event {
            // Do not hammer a store that just failed.
            tokio::time::sleep(self.spec.monitor_interval).await;
        }
        if let Event::FailureRecorded { failed_rounds, .. } = event {
            run.failed_rounds = failed_rounds;
            self.status.send_modify(|s| s.failed_rounds = failed_rounds);
        }
        self.decide(&mut run.policy, event)
    }

    pub(super) fn finish_workers(&self, result: &RunResult) {
        self.status.send_modify(|s| {
            for w in &mut s.workers {
                w.state = match result.exits.get(&w.local_rank) {
                    Some(&e) => WorkerState::Ended(e),
                    None => WorkerState::Unknown,
                };
            }
        });
    }

    pub(super) fn failure_records(&self, r: &Round, result: &RunResult) -> Vec<FailureRecord> {
        result
            .failures
            .values()
            .map(|f| {
                let exit = match f.exit {
                    Exit::Code(c) => format!("exit code {c}"),
                    Exit::Signal(s) => format!("signal {}", signal_name(s)),
                };
                let traceback = f
                    .error
                    .as_ref()
                    .and_then(|e| e.callstack.clone())
                    .or_else(|| {
                        let (_, tb, path) = f.stderr_traceback.as_ref()?;
                        Some(format!(
                            "(the last traceback in {}; the worker wrote no error file)\n{tb}",
                            path.display()
                        ))
                    })
                    .map(|t| {
                        let mut cut = t.len().saturating_sub(TRACEBACK_MAX);
                        while !t.is_char_boundary(cut) {
                            cut += 1;
                        }
                        t[cut..].to_owned()
                    })
                    .unwrap_or_default();
                FailureRecord {
                    time: f
                        .timestamp
                        .duration_since(UNIX_EPOCH)
                        .map_or(0.0, |d| d.as_secs_f64()),
                    host: self.spec.hostname.clone(),
                    group_rank: r.info.rank,
                    rank: r.ranks.base_rank + f.local_rank,
                    local_rank: f.local_rank,
                    round: r.info.round,
                    pid: f.pid,
                    exitcode: f.exit.code(),
                    exit,
                    message: f.message(),
                    traceback,
                    error_file: match f.error {
                        Some(_) => f.error_file.display().to_string(),
                        None => NOT_AVAILABLE.to_owned(),
                    },
                }
            })
            .collect()
    }
}

/// Why the agent is stopping the group, for the stack dumps.
fn stop_reason(phase: &Phase, workers: &mut ProcessContext) -> String {
    let Phase::Stopping { why, .. } = phase else {
        return "the agent stopped the group".to_owned();
    };
    match why {
        StopReason::WorkerFailed => match workers.first_failure() {
            Some((local_rank, exit)) => {
                format!("local rank {local_rank} on this node failed ({exit})")
            }
            None => "a worker on this node failed".to_owned(),
        },
        StopReason::Reform => "the group re-forms (nodes joined or a member died)".to_owned(),
        StopReason::FailedElsewhere(Some(f)) => {
            format!("rank {} on {} failed ({})", f.rank, f.host, f.exit)
        }
        StopReason::FailedElsewhere(None) => "another node failed".to_owned(),
        StopReason::MemberLostAfterClose => "a member died after the run was closed".to_owned(),
        StopReason::MemberLostFixedGroup => {
            "a member died and the static group cannot re-form".to_owned()
        }
        StopReason::LostRendezvous => "the rendezvous store was lost".to_owned(),
        StopReason::Signal(s) => format!("rally run received {}", signal_name(*s)),
    }
}
