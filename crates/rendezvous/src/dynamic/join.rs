//! One node's join, as store I/O: [`state::Join`] decides, and `join` performs
//! the store operation each [`Step`] asks for (one small method per step) and
//! reports what happened as an [`Event`], until the node is a member of a
//! round or the join fails.
//!
//! Before the first step the node leaves its last round, if any (said first,
//! so no member counts it dead) and moves the round pointer on; after the last
//! it gets its rank (arrival 1 assigns them all), the job store's address, its
//! census standing and its heartbeat.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use rallypoint_store::PrefixStore;
use rallypoint_store::Store;
use tokio::time::Instant;

use super::state::{self, Event, Join, JoinFailure, Step};
use super::{mark_changed, Beat, Bootstrap, DynamicRendezvous, Node, ABANDONED};
use crate::api::{BootstrapStoreInfo, RendezvousError, RendezvousInfo};

impl DynamicRendezvous {
    pub(super) async fn join(&self) -> Result<RendezvousInfo, RendezvousError> {
        let started = Instant::now();
        let mut node = self.node.lock().await;
        let round = self.move_on(&mut node).await?;
        // The decisions are the state machine's; this loop does the store I/O
        // each step asks for and reports back what happened.
        let (mut machine, mut step) = Join::start(
            self.bounds,
            self.timing.join,
            self.timing.last_call,
            round,
            started.into_std(),
        );
        loop {
            let r = format!("r{}", machine.round());
            let event = match step {
                Step::Arrive { round } => self.arrive(round).await?,
                Step::Announce {
                    marks_min,
                    completes_with,
                } => self.announce(&r, marks_min, completes_with).await?,
                Step::WaitMin { until } => {
                    let until = until.map(Instant::from_std);
                    match self.wait_key(&format!("{r}/min"), until).await? {
                        true => Event::MinReached,
                        false => Event::TimedOut,
                    }
                }
                Step::WaitComplete { until } => self.wait_complete(&r, until).await?,
                Step::Complete { members } => self.complete(&r, members).await?,
                Step::CountWaiting => {
                    mark_changed(&*self.store, &r, "waiting")
                        .await
                        .map_err(self.err())?;
                    Event::Counted
                }
                Step::WaitReform { until } => {
                    let until = until.map(Instant::from_std);
                    match self.wait_key(&format!("{r}/reform"), until).await? {
                        true => Event::Reformed,
                        false => Event::TimedOut,
                    }
                }
                Step::Fail(JoinFailure::Timeout { round }) => {
                    return Err(self.timeout_error(round, started).await)
                }
                Step::Fail(JoinFailure::Closed) => return Err(self.closed_error(false)),
                Step::Fail(JoinFailure::GracefulExit) => return Err(self.closed_error(true)),
                Step::Member {
                    round,
                    index,
                    members,
                } => {
                    let deadline = machine
                        .deadline()
                        .map_or(started + self.timing.join, Instant::from_std);
                    match self.rank_in(round, index, members, deadline).await? {
                        Some(rank) => {
                            let bootstrap = self.bootstrap_for(round, rank, deadline).await?;
                            return Ok(self
                                .become_member(&mut node, round, rank, members, bootstrap)
                                .await);
                        }
                        None => Event::Abandoned,
                    }
                }
            };
            step = machine.on(event, std::time::Instant::now());
        }
    }

    /// Leaves the last round for the next, if this node was a member of one,
    /// and returns the round to join: members of a round move to the next and
    /// let late arrivals follow.
    async fn move_on(&self, node: &mut Node) -> Result<u64, RendezvousError> {
        // Said first, so a member still in the last round (slow to stop its
        // workers) does not count this node dead.
        if let (Some((round, rank, _)), Some(_)) = (node.member_of, &node.heartbeat) {
            let _ = self.store.set(&format!("r{round}/left/{rank}"), b"1").await;
        }
        if let Some(h) = node.heartbeat.take() {
            h.abort();
        }
        let pointer = {
            let v = self
                .store
                .compare_set("round", b"", b"0")
                .await
                .map_err(self.err())?;
            String::from_utf8_lossy(&v).parse::<u64>().unwrap_or(0)
        };
        let Some((r, _, _)) = node.member_of.take() else {
            return Ok(pointer);
        };
        // The other members see a member coming back as a node waiting
        // (PyTorch's wait list) and re-form too.
        mark_changed(&*self.store, &format!("r{r}"), "waiting")
            .await
            .map_err(self.err())?;
        self.store
            .set(&format!("r{r}/reform"), b"1")
            .await
            .map_err(self.err())?;
        let next = (r + 1).max(pointer);
        let _ = self
            .store
            .compare_set(
                "round",
                r.to_string().as_bytes(),
                next.to_string().as_bytes(),
            )
            .await;
        Ok(next)
    }

    /// [`Step::Arrive`]: takes an arrival index in `round` and publishes this
    /// node's id under it, unless the run is closed.
    async fn arrive(&self, round: u64) -> Result<Event, RendezvousError> {
        if self.closed().await? {
            return Ok(Event::Closed);
        }
        let index = self
            .store
            .add(&format!("r{round}/join"), 1)
            .await
            .map_err(self.err())? as usize;
        self.store
            .set(&format!("r{round}/node/{index}"), self.node_id.as_bytes())
            .await
            .map_err(self.err())?;
        Ok(Event::Arrived { index })
    }

    /// [`Step::Announce`]: marks the last call begun and, for the last
    /// possible arrival, completes the round.
    async fn announce(
        &self,
        r: &str,
        marks_min: bool,
        completes_with: Option<usize>,
    ) -> Result<Event, RendezvousError> {
        if marks_min {
            self.store
                .set(&format!("{r}/min"), b"1")
                .await
                .map_err(self.err())?;
        }
        if let Some(k) = completes_with {
            self.store
                .compare_set(&format!("{r}/complete"), b"", k.to_string().as_bytes())
                .await
                .map_err(self.err())?;
        }
        Ok(Event::Announced)
    }

    /// [`Step::WaitComplete`]: the round completed with its member count, or
    /// the last call ended with that many arrivals.
    async fn wait_complete(
        &self,
        r: &str,
        until: std::time::Instant,
    ) -> Result<Event, RendezvousError> {
        let until = Some(Instant::from_std(until));
        if self.wait_key(&format!("{r}/complete"), until).await? {
            return Ok(Event::Completed {
                members: self.members(r).await?,
            });
        }
        let arrivals = self
            .store
            .add(&format!("{r}/join"), 0)
            .await
            .map_err(self.err())?
            .max(0) as usize;
        Ok(Event::LastCallEnded { arrivals })
    }

    /// [`Step::Complete`]: completes the round with `members` (the first
    /// writer wins) and reads the count it completed with.
    async fn complete(&self, r: &str, members: usize) -> Result<Event, RendezvousError> {
        self.store
            .compare_set(
                &format!("{r}/complete"),
                b"",
                members.to_string().as_bytes(),
            )
            .await
            .map_err(self.err())?;
        Ok(Event::Completed {
            members: self.members(r).await?,
        })
    }

    /// A member of `round` with `rank`: counted in the census, keeping alive,
    /// given the round's job store.
    async fn become_member(
        &self,
        node: &mut Node,
        round: u64,
        rank: usize,
        members: usize,
        bootstrap: BootstrapStoreInfo,
    ) -> RendezvousInfo {
        // Arrival 1 counted every member in (crate::census), once per run; a
        // node found dead in an earlier round (partitioned for an expiry)
        // counts itself in again. Not a reason to fail the join: one the
        // store did not take now is taken up at the next join or the leave.
        let old = node.standing.take();
        node.unsettled.extend(old);
        if let Err(e) = node.settle(&*self.store).await {
            tracing::warn!(error = %e, "could not reconcile this node's census standing; will at its leave");
        }
        let standing = crate::census::Standing::new(round, rank);
        node.standing = Some(standing.clone());
        node.counted_in = true;
        node.member_of = Some((round, rank, members));
        let beating = Arc::new(std::sync::atomic::AtomicBool::new(true));
        node.beating = Some(beating.clone());
        node.health = crate::Health::default();
        node.heartbeat = Some(self.keepalive.spawn(Beat {
            store: self.store.clone(),
            namespace: format!("rally.rendezvous.{}/", self.run_id),
            round,
            rank,
            members,
            timing: self.timing,
            beating,
            health: node.health.clone(),
            standing,
        }));
        let job: Arc<dyn Store> = Arc::new(PrefixStore::new(
            format!("torch.rendezvous.{}.{round}", self.run_id),
            self.base.clone(),
        ));
        RendezvousInfo {
            round,
            run_store: self.run_store_of_run(),
            store: job,
            rank,
            world_size: members,
            bootstrap,
        }
    }

    /// Where workers of `round` reach the job's store.
    async fn bootstrap_for(
        &self,
        round: u64,
        rank: usize,
        deadline: Instant,
    ) -> Result<BootstrapStoreInfo, RendezvousError> {
        let advertise = match &self.bootstrap {
            Bootstrap::Agent(info) => return Ok(info.clone()),
            Bootstrap::Worker { advertise } => advertise,
        };
        let key = format!("r{round}/master");
        if rank == 0 {
            let port = std::net::TcpListener::bind(("0.0.0.0", 0))
                .and_then(|l| l.local_addr())
                .map_err(|e| RendezvousError::State {
                    run_id: self.run_id.clone(),
                    reason: format!("no free port for the job's store: {e}"),
                })?
                .port();
            let value = format!("{advertise}:{port}");
            self.store
                .set(&key, value.as_bytes())
                .await
                .map_err(self.err())?;
            return Ok(BootstrapStoreInfo {
                master_addr: advertise.clone(),
                master_port: port,
            });
        }
        if !self.wait_key(&key, Some(deadline)).await? {
            return Err(RendezvousError::State {
                run_id: self.run_id.clone(),
                reason: format!("rank 0 of round {round} never published the job's store address"),
            });
        }
        let v = self.store.get_now(&key).await.map_err(self.err())?;
        let v = String::from_utf8_lossy(&v);
        v.rsplit_once(':')
            .and_then(|(h, p)| Some((h.to_owned(), p.parse().ok()?)))
            .map(|(master_addr, master_port)| BootstrapStoreInfo {
                master_addr,
                master_port,
            })
            .ok_or_else(|| RendezvousError::State {
                run_id: self.run_id.clone(),
                reason: format!("round {round} published an invalid store address {v:?}"),
            })
    }

    /// The error a join ends with when the run is closed: a spare was never
    /// needed, which is not a failure.
    fn closed_error(&self, spare: bool) -> RendezvousError {
        let run_id = self.run_id.clone();
        match spare {
            true => RendezvousError::GracefulExit { run_id },
            false => RendezvousError::Closed { run_id },
        }
    }

    /// How many nodes arrived in round `round`, and the ids of the first 16.
    async fn arrivals(&self, round: u64) -> (usize, Vec<String>) {
        let arrived = self
            .store
            .add(&format!("r{round}/join"), 0)
            .await
            .unwrap_or(0)
            .max(0) as usize;
        let mut ids = Vec::new();
        for i in 1..=arrived.min(16) {
            if let Ok(v) = self.store.get_now(&format!("r{round}/node/{i}")).await {
                ids.push(String::from_utf8_lossy(&v).into_owned());
            }
        }
        (arrived, ids)
    }

    async fn timeout_error(&self, round: u64, started: Instant) -> RendezvousError {
        let (arrived, mut joined) = self.arrivals(round).await;
        // The last round's nodes that did not come back: the ones this
        // round waited for in vain (a host lost, say).
        let lost = match round.checked_sub(1) {
            Some(last) => self.arrivals(last).await.1,
            None => Vec::new(),
        }
        .into_iter()
        .filter(|id| !joined.contains(id))
        .collect();
        if arrived > 16 {
            joined.push(format!("and {} more", arrived - 16));
        }
        RendezvousError::Timeout {
            run_id: self.run_id.clone(),
            waited: started.elapsed(),
            joined,
            expected: format!("{}..={} nodes", self.bounds.min, self.bounds.max),
            lost,
        }
    }

    /// How long a completed round may take to get its ranks before its members
    /// give it up: a member that stopped between its steps (after taking an
    /// arrival index, before publishing its id; or arrival 1, before assigning)
    /// would otherwise make the others wait for a phantom until the join deadline.
    fn assign_grace(&self) -> Duration {
        self.timing.keep_alive * self.timing.max_misses
    }

    /// Gives up round `round`: its ranks are never assigned (first writer wins
    /// `assigned`), waiting nodes are released, and the next round is opened.
    /// `None` if the round was assigned after all.
    async fn abandon(&self, round: u64) -> Result<Option<()>, RendezvousError> {
        let r = format!("r{round}");
        let v = self
            .store
            .compare_set(&format!("{r}/assigned"), b"", ABANDONED)
            .await
            .map_err(self.err())?;
        if v != ABANDONED {
            return Ok(None);
        }
        tracing::warn!(
            round,
            "a member of the round stopped before it got its ranks; re-forming without it"
        );
        self.store
            .set(&format!("{r}/reform"), b"1")
            .await
            .map_err(self.err())?;
        let _ = self
            .store
            .compare_set(
                "round",
                round.to_string().as_bytes(),
                (round + 1).to_string().as_bytes(),
            )
            .await;
        Ok(Some(()))
    }

    /// Member of `round` with arrival `index` of `members`: learns its rank, or
    /// `None` if the round was abandoned (see [`Self::assign_grace`]).
    async fn rank_in(
        &self,
        round: u64,
        index: usize,
        members: usize,
        deadline: Instant,
    ) -> Result<Option<usize>, RendezvousError> {
        let r = format!("r{round}");
        if index == 1 {
            let grace = (Instant::now() + self.assign_grace()).min(deadline);
            return self.assign(round, members, grace).await;
        }
        // Arrival 1 assigns; twice the grace, so its own give-up comes first.
        let key = format!("{r}/assigned");
        let until = (Instant::now() + 2 * self.assign_grace()).min(deadline);
        if !self.wait_key(&key, Some(until)).await? && self.abandon(round).await?.is_some() {
            return Ok(None);
        }
        if self.store.get_now(&key).await.map_err(self.err())? == ABANDONED {
            return Ok(None);
        }
        self.read_number(
            &format!("{r}/rank/{index}"),
            &format!("rank of arrival {index} in round {round}"),
        )
        .await
        .map(Some)
    }

    /// Arrival 1 of `round`: reads the members' ids, assigns every rank (kept
    /// across rounds), counts new nodes into the census and writes it all at
    /// once; its own rank, or `None` if the round was abandoned meanwhile or a
    /// member's id did not come by `grace`.
    async fn assign(
        &self,
        round: u64,
        members: usize,
        grace: Instant,
    ) -> Result<Option<usize>, RendezvousError> {
        let r = format!("r{round}");
        let keys: Vec<String> = (1..=members).map(|i| format!("{r}/node/{i}")).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        // Every member publishes its id right after arriving; one that has
        // not within the grace stopped: abandon the round.
        match self
            .store
            .wait_timeout(&refs, grace.saturating_duration_since(Instant::now()))
            .await
        {
            Ok(()) => {}
            Err(e) if e.is_timeout() => {
                if self.abandon(round).await?.is_some() {
                    return Ok(None);
                }
            }
            Err(e) => return Err(self.err()(e)),
        }
        let nodes: Vec<String> = self
            .store
            .multi_get(&refs)
            .await
            .map_err(self.err())?
            .into_iter()
            .map(|v| String::from_utf8_lossy(&v).into_owned())
            .collect();
        // The run's nodes: one key read and written once per round by
        // arrival 1 alone, `node=rank` for the last round's members and
        // `node=` for nodes counted in before. It keeps ranks across
        // rounds, and arrival 1 counts the members it does not list into
        // the census (crate::census), first, so a crash before the write
        // can only count a node twice.
        let table = self.store.get_now("ranks").await.map_err(self.err())?;
        let table = String::from_utf8_lossy(&table);
        let known: Vec<(&str, Option<usize>)> = table
            .lines()
            .filter_map(|l| {
                let (n, r) = l.rsplit_once('=')?;
                Some((n, r.parse().ok()))
            })
            .collect();
        let previous: HashMap<String, usize> = known
            .iter()
            .filter_map(|&(n, r)| Some((n.to_owned(), r?)))
            .collect();
        let ranks = state::assign_ranks(&nodes, &previous);
        let listed: std::collections::HashSet<&str> = known.iter().map(|k| k.0).collect();
        let new = nodes
            .iter()
            .filter(|n| !listed.contains(n.as_str()))
            .count();
        crate::census::joined_many(&*self.store, new)
            .await
            .map_err(self.err())?;
        let rank_keys: Vec<String> = (1..=members).map(|i| format!("{r}/rank/{i}")).collect();
        let values: Vec<String> = ranks.iter().map(usize::to_string).collect();
        let mut table_out = String::new();
        for (n, v) in nodes.iter().zip(&values) {
            table_out.push_str(n);
            table_out.push('=');
            table_out.push_str(v);
            table_out.push('\n');
        }
        let members_now: std::collections::HashSet<&str> =
            nodes.iter().map(String::as_str).collect();
        for (n, _) in known.iter().filter(|k| !members_now.contains(k.0)) {
            table_out.push_str(n);
            table_out.push_str("=\n");
        }
        let table = table_out;
        let mut pairs: Vec<(&str, &[u8])> = rank_keys
            .iter()
            .zip(&values)
            .map(|(k, v)| (k.as_str(), v.as_bytes()))
            .collect();
        pairs.push(("ranks", table.as_bytes()));
        // Every heartbeat counter exists before anyone watches it, so a
        // member that never beats is seen to stop like any other.
        let beats: Vec<String> = (0..members).map(|m| format!("{r}/hb/{m}")).collect();
        pairs.extend(beats.iter().map(|k| (k.as_str(), &b"0"[..])));
        self.store.multi_set(&pairs).await.map_err(self.err())?;
        let won = self
            .store
            .compare_set(&format!("{r}/assigned"), b"", b"1")
            .await
            .map_err(self.err())?;
        // Others may have given the round up while we assigned.
        Ok((won != ABANDONED).then_some(ranks[0]))
    }
}
