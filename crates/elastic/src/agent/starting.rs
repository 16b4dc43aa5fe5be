//! The starting phase: ranks, the job store (hosted or joined), the workers
//! spawned; the rendezvous is watched meanwhile.

use super::*;

/// Set in the workers' environment when they reach the job store through
/// this node's proxy (a job secret): the store's own host, which
/// `MASTER_ADDR` (the proxy, on loopback) no longer is. Backends that pick
/// their interface by the route to the store (the `rally` backend) use it.
pub const JOB_STORE_HOST: &str = "RALLY_JOB_STORE_HOST";

impl Agent {
    /// Ranks, the job store, then the workers; the rendezvous is watched
    /// meanwhile, so a member lost after the round formed re-forms the group at
    /// once instead of costing the store's timeout.
    pub(super) async fn start(&self, run: &mut Run<'_>, run_logs: &RunLogs) -> Vec<Action> {
        let mut watch = run
            .round
            .as_mut()
            .and_then(|r| r.watch.take())
            .expect("watched from the join");
        let r = run.round.as_ref().expect("started after a join");
        let prefix = format!("rally.agent/r{}", r.info.round);
        let setup = async {
            let ranks = ranks::assign(
                &*r.info.store,
                &prefix,
                r.info.rank,
                r.info.world_size,
                &self.spec.role,
                self.spec.local_world_size,
            )
            .await
            .map_err(|e| format!("rank assignment failed: {e}"))?;
            let job = self
                .job_store(&r.info, &prefix)
                .await
                .map_err(|e| format!("job store: {e}"))?;
            Ok::<_, String>((ranks, job))
        };
        let setup = async {
            tokio::pin!(setup);
            loop {
                tokio::select! {
                    s = &mut setup => return Ok(s),
                    s = run.signals.recv() => return Err(self.decide(&mut run.policy, Event::Signal(s))),
                    o = watch.next() => {
                        let seen = Event::Checked(o);
                        let actions = self.tell_notes(self.decide(&mut run.policy, seen), None);
                        if !actions.is_empty() {
                            return Err(actions);
                        }
                    }
                }
            }
        };
        let setup = setup.await;
        let r = run.round.as_mut().expect("started after a join");
        r.watch = Some(watch);
        let setup = match setup {
            Ok(s) => s,
            Err(actions) => return actions,
        };
        let (ranks, (master_addr, master_port, server)) = match setup {
            Ok(s) => s,
            Err(e) => {
                return self.decide(
                    &mut run.policy,
                    Event::StartFailed(policy::StartError::Store(e)),
                )
            }
        };
        r.ranks = ranks;
        let hosts_job_store = server.is_some();
        r.server = server;
        let event = match self.proxy(r, &master_addr, master_port).await {
            Ok(()) => {
                match self.spawn_workers(r, run_logs, &master_addr, master_port, run.failed_rounds)
                {
                    Ok(()) => Event::Started { hosts_job_store },
                    Err(e) => Event::StartFailed(policy::StartError::Local(e)),
                }
            }
            Err(e) => Event::StartFailed(policy::StartError::Local(e)),
        };
        if let Event::StartFailed(policy::StartError::Local(e)) = &event {
            // The failure others read as the root cause.
            r.failures = vec![self.start_failure(r, e)];
        }
        self.decide(&mut run.policy, event)
    }

    /// Where this round's workers find their store. With an agent store, the node
    /// with rank 0 hosts a fresh server for every round, so no attempt ever reads
    /// keys an earlier one left (PyTorch reuses one server across attempts, and a
    /// restarted gloo group can read its peers' stale addresses); the others learn
    /// its address from the round's store.
    pub(super) async fn job_store(
        &self,
        info: &RendezvousInfo,
        prefix: &str,
    ) -> Result<(String, u16, Option<ServerHandle>), StoreError> {
        if !self.handler.use_agent_store() || self.handler.job_store_at_bootstrap() {
            return Ok((
                info.bootstrap.master_addr.clone(),
                info.bootstrap.master_port,
                None,
            ));
        }
        let key = format!("{prefix}/job_store");
        if info.rank == 0 {
            let host = &info.bootstrap.master_addr;
            let addr = match &self.spec.local_addr {
                Some(a) => a.clone(),
                None if rallypoint_store::host::is_loopback_name(host) => host.clone(),
                None => rallypoint_store::host::advertised_addr(),
            };
            let server = Server::bind_any(0, ServerConfig::default()).await?;
            let port = server.local_addr().port();
            let handle = server.spawn();
            info.store
                .set(&key, format!("{addr}\n{port}").as_bytes())
                .await?;
            return Ok((addr, port, Some(handle)));
        }
        let v = info.store.get(&key).await?;
        let s = String::from_utf8_lossy(&v);
        let (addr, port) = s
            .split_once('\n')
            .and_then(|(a, p)| Some((a.to_owned(), p.parse().ok()?)))
            .ok_or_else(|| StoreError::UnexpectedReply {
                op: "job store address",
                addr: key.clone(),
                reply: format!("{s:?}"),
            })?;
        Ok((addr, port, None))
    }

    /// With a job secret on and an agent store, the loopback proxy to the job
    /// store at `addr:port` for this round's workers
    /// ([`rallypoint_store::proxy`]): they get its address as their
    /// `MASTER_ADDR`/`MASTER_PORT`.
    async fn proxy(&self, r: &mut Round, addr: &str, port: u16) -> Result<(), String> {
        r.proxy = None;
        let secret = rallypoint_store::secret::process_secret();
        let (Some(secret), true) = (secret, self.handler.use_agent_store()) else {
            return Ok(());
        };
        let upstream = match addr.contains(':') && !addr.starts_with('[') {
            true => format!("[{addr}]:{port}"),
            false => format!("{addr}:{port}"),
        };
        let proxy = rallypoint_store::proxy::Proxy::start(&upstream, secret)
            .await
            .map_err(|e| format!("cannot serve the workers' store proxy: {e}"))?;
        r.proxy = Some(proxy);
        Ok(())
    }

    /// Starts the local workers with torchrun's environment.
    pub(super) fn spawn_workers(
        &self,
        r: &mut Round,
        run_logs: &RunLogs,
        master_addr: &str,
        master_port: u16,
        failed_rounds: u64,
    ) -> Result<(), String> {
        let spec = &self.spec;
        let info = &r.info;
        // Behind the job secret, the workers reach the job store through
        // this node's proxy; events and logs still name the store itself.
        let (store_addr, store_port) = match &r.proxy {
            Some(p) => (p.local_addr().ip().to_string(), p.local_addr().port()),
            None => (master_addr.to_owned(), master_port),
        };
        let ctx = ranks::WorkerContext {
            role: &spec.role,
            local_world_size: spec.local_world_size,
            group_rank: info.rank,
            group_world_size: info.world_size,
            ranks: r.ranks,
            master_addr: &store_addr,
            master_port: store_port,
            restart_count: info.round,
            max_restarts: spec.max_restarts,
            run_id: self.handler.run_id(),
            use_agent_store: self.handler.use_agent_store(),
            virtual_local_rank: spec.virtual_local_rank,
        };
        let n = spec.local_world_size;
        let base = r.ranks.base_rank;
        let start = StartSpec {
            name: spec.role.clone(),
            entrypoint: spec.entrypoint.clone(),
            args: (0..n)
                .map(|lr| {
                    let args = spec
                        .args
                        .iter()
                        .map(|a| match a.to_str() {
                            Some(s) if s.contains("${local_rank}") => {
                                OsString::from(s.replace("${local_rank}", &lr.to_string()))
                            }
                            _ => a.clone(),
                        })
                        .collect();
                    (lr, args)
                })
                .collect(),
            envs: (0..n)
                .map(|lr| {
                    let mut env = ranks::worker_env(&ctx, lr);
                    if r.proxy.is_some() {
                        // MASTER_ADDR names the proxy: where the store
                        // really is, for choosing an interface.
                        env.insert(JOB_STORE_HOST.into(), master_addr.to_owned());
                    }
                    if let Some(mark) = &spec.mark {
                        env.insert(
                            crate::multiprocessing::watchdog::MARK_ENV.into(),
                            mark.clone(),
                        );
                    }
                    (lr, env)
                })
                .collect(),
            global_ranks: (0..n).map(|lr| (lr, base + lr)).collect(),
            bindings: spec.numa.iter().cloned().enumerate().collect(),
        };
        let logs = run_logs
            .attempt(info.round.min(u32::MAX as u64) as u32, n)
            .map_err(|e| e.to_string())?;
        let mut workers = start_processes(&start, &spec.logs, &logs)
            .map_err(|e| format!("cannot start workers: {e}"))?;
        workers.set_mark(spec.mark.clone());
        let pids = workers.pids();
        r.workers = Some(workers);
        r.started = Instant::now();
        self.emit(AgentEvent::WorkersStarted {
            round: info.round,
            group_rank: info.rank,
            group_world_size: info.world_size,
            world_size: r.ranks.world_size,
            ranks: base..base + n,
            pids: pids.values().copied().collect(),
            master_addr: master_addr.to_owned(),
            master_port,
            restarts_used: failed_rounds,
        });
        self.status.send_modify(|s| {
            s.round = info.round;
            s.group_rank = info.rank;
            s.nodes = info.world_size;
            s.world_size = r.ranks.world_size;
            s.failed_rounds = failed_rounds;
            s.workers = (0..n)
                .map(|lr| WorkerStatus {
                    local_rank: lr,
                    rank: base + lr,
                    pid: pids.get(&lr).copied().unwrap_or(0),
                    state: WorkerState::Running,
                })
                .collect();
        });
        Ok(())
    }

    /// The failure record of a start that failed on this node.
    pub(super) fn start_failure(&self, r: &Round, error: &str) -> FailureRecord {
        FailureRecord {
            time: now_secs(),
            host: self.spec.hostname.clone(),
            group_rank: r.info.rank,
            rank: r.ranks.base_rank,
            local_rank: 0,
            round: r.info.round,
            pid: 0,
            exitcode: 1,
            exit: "not started".into(),
            message: error.to_owned(),
            traceback: String::new(),
            error_file: NOT_AVAILABLE.to_owned(),
        }
    }
}
