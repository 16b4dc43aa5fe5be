//! The manager as a service: the workers' endpoint, the store, the round
//! and the lighthouse client, wired together.
//!
//! * One **core task** owns the [`crate::round::Round`], the
//!   lighthouse client and the status books. Everything reaches it as a
//!   message (a connection's hello, call or end; a lighthouse answer; a
//!   link change; the agent's calls), it feeds the round, and it carries
//!   out the round's actions: answers go to the rank's connection, a
//!   lighthouse call runs in a task of its own that reports back. It
//!   ticks the round at its next deadline.
//! * One **task per worker connection**: a reader task splits lines (1 MiB
//!   cap) while the connection task answers requests in order, one at a
//!   time, so a connection that ends while its call waits is seen at once
//!   (the reader hits the end), which stops the group's round.
//! * The **store** (`rallypoint_store::server`) for the cross-replica
//!   process groups, on the bind address's IP, any port.

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rallypoint_auth::{JobSecret, RefusalCounts, Refusals, Service};
use rallypoint_lighthouse::proto::Quorum;
use rallypoint_store::server::{Server as StoreServer, ServerConfig, ServerHandle};
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use crate::lighthouse::{self, Lighthouse, Link, Options};
use crate::round::{Action, Event, QuorumCall, Rank, Round, Setup};
use crate::status::{Books, FtEvent, Status};
use crate::wire::{self, Request, WireError};

/// How to start a manager.
#[derive(Clone, Debug)]
pub struct Config {
    /// The replica group's id, sent to the lighthouse as given.
    pub replica_id: String,
    /// The lighthouse: `http://host:port` or `host:port`.
    pub lighthouse: String,
    /// Where the workers' endpoint listens (the store takes the same IP,
    /// any port).
    pub bind: SocketAddr,
    /// The host other groups reach this manager and its store by; by
    /// default the bind IP, or if that is unspecified the local address
    /// on the route to the lighthouse.
    pub advertise_host: Option<String>,
    /// W, the group's number of ranks.
    pub world_size: usize,
    pub heartbeat_interval: Duration,
    /// How long a (re)connection to the lighthouse is retried.
    pub connect_timeout: Duration,
    /// A worker connection that has beaten ([`wire::Request::Beat`]) and
    /// then says nothing for this long is closed, as if the worker died:
    /// a stopped or hung worker takes its group out of the quorum within
    /// this (the manager's own heartbeats would otherwise keep it in).
    pub worker_keep_alive: Duration,
    /// The job secret (issue 49): proven to the lighthouse, and asked of
    /// every worker connection before its hello. By default the process's,
    /// else `RALLY_JOB_SECRET_FILE`'s ([`rallypoint_auth::job_secret`]).
    pub secret: Option<rallypoint_auth::JobSecret>,
    /// How long the lighthouse may refuse this group's id as held by
    /// another live process before [`Status::id_refused`] says so for
    /// good: above the lighthouse's heartbeat timeout
    /// ([`crate::status::ID_HELD_GRACE`] by default).
    pub id_held_grace: Duration,
}

impl Config {
    /// Defaults: bind `0.0.0.0:0`, heartbeats every 100 ms, a 60 s
    /// connect timeout.
    pub fn new(replica_id: &str, lighthouse: &str, world_size: usize) -> Config {
        Config {
            replica_id: replica_id.to_owned(),
            lighthouse: lighthouse.to_owned(),
            bind: SocketAddr::from(([0, 0, 0, 0], 0)),
            advertise_host: None,
            world_size,
            heartbeat_interval: Duration::from_millis(100),
            connect_timeout: Duration::from_secs(60),
            worker_keep_alive: WORKER_KEEP_ALIVE,
            secret: rallypoint_auth::job_secret().ok().flatten(),
            id_held_grace: crate::status::ID_HELD_GRACE,
        }
    }
}

/// Why a manager did not start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Config(String),
    #[error("binding the manager's workers' endpoint on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("starting the manager's store: {0}")]
    Store(rallypoint_store::StoreError),
    #[error("finding the local address on the route to the lighthouse at {lighthouse}: {source}")]
    Route {
        lighthouse: String,
        source: std::io::Error,
    },
}

/// A running manager. Dropping it without [`Manager::shutdown`] leaves its
/// tasks running until the runtime ends.
pub struct Manager {
    address: String,
    store_address: String,
    core: mpsc::UnboundedSender<Msg>,
    status: watch::Receiver<Status>,
    events: broadcast::Sender<FtEvent>,
    accept: JoinHandle<()>,
    core_task: JoinHandle<()>,
    store: ServerHandle,
    refusals: Arc<Refusals>,
}

enum Msg {
    Hello {
        rank: u64,
        world_size: u64,
        answers: mpsc::UnboundedSender<String>,
        reply: oneshot::Sender<Result<(Rank, String), String>>,
    },
    Call {
        rank: Rank,
        req: Request,
        /// The calling connection's answers (which connection it is).
        answers: mpsc::UnboundedSender<String>,
    },
    Gone {
        rank: Rank,
        answers: mpsc::UnboundedSender<String>,
    },
    Lighthouse {
        call: u64,
        result: Result<Quorum, String>,
    },
    Link(Link),
    WorkersStopped(String),
    SetWorldSize(usize),
    Shutdown(oneshot::Sender<()>),
}

impl Manager {
    /// Binds the workers' endpoint and the store and starts serving; the
    /// lighthouse is connected at the first hello.
    pub async fn start(config: Config) -> Result<Manager, Error> {
        let target = lighthouse::target_of(&config.lighthouse).map_err(Error::Config)?;
        if config.world_size == 0 {
            return Err(Error::Config(
                "a replica group needs at least one rank".into(),
            ));
        }
        let host = advertise_host(&config, &target).await?;
        let listener = TcpListener::bind(config.bind)
            .await
            .map_err(|source| Error::Bind {
                addr: config.bind,
                source,
            })?;
        let port = listener.local_addr().map_err(|source| Error::Bind {
            addr: config.bind,
            source,
        })?;
        let store_bind = SocketAddr::new(config.bind.ip(), 0);
        // Without the job secret: the workers reach it with PyTorch's own
        // TCPStore (an open item of issue 49's).
        let store_config = ServerConfig {
            secret: None,
            ..ServerConfig::default()
        };
        let store = StoreServer::bind(store_bind, store_config)
            .await
            .map_err(Error::Store)?;
        let store_port = store.local_addr().port();
        let store = store.spawn();
        let address = join_host_port(&host, port.port());
        let store_address = join_host_port(&host, store_port);

        let (core_tx, core_rx) = mpsc::unbounded_channel();
        let (link_tx, mut link_rx) = mpsc::unbounded_channel();
        let forward = core_tx.clone();
        tokio::spawn(async move {
            while let Some(l) = link_rx.recv().await {
                if forward.send(Msg::Link(l)).is_err() {
                    break;
                }
            }
        });
        let client = Lighthouse::new(
            Options {
                lighthouse: config.lighthouse.clone(),
                replica_id: config.replica_id.clone(),
                heartbeat_interval: config.heartbeat_interval,
                connect_timeout: config.connect_timeout,
                secret: config.secret.clone(),
            },
            link_tx,
        )
        .map_err(Error::Config)?;
        let books = Books::new(&config.replica_id, client.url(), config.id_held_grace);
        let status = books.status();
        let events = books.events();
        let setup = Setup {
            replica_id: config.replica_id.clone(),
            address: address.clone(),
            store_address: store_address.clone(),
            lighthouse: client.url().to_owned(),
            world_size: config.world_size,
        };
        let core = Core {
            round: Round::new(setup),
            lighthouse: Arc::new(client),
            books,
            answers: BTreeMap::new(),
            tx: core_tx.clone(),
        };
        let core_task = tokio::spawn(core.run(core_rx));
        let refusals = Arc::new(Refusals::new());
        let guard = Guard {
            secret: config.secret.clone(),
            refusals: refusals.clone(),
        };
        let accept = tokio::spawn(accept(
            listener,
            core_tx.clone(),
            config.worker_keep_alive,
            guard,
        ));
        tracing::info!(replica_id = %config.replica_id, %address, %store_address, "ft manager started");
        Ok(Manager {
            address,
            store_address,
            core: core_tx,
            status,
            events,
            accept,
            core_task,
            store,
            refusals,
        })
    }

    /// The workers' endpoint, `host:port` (also the `address` the
    /// lighthouse sees).
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Worker connections refused by the job-secret handshake, by reason.
    pub fn secret_refusals(&self) -> RefusalCounts {
        self.refusals.snapshot()
    }

    /// The store of the cross-replica process groups, `host:port`.
    pub fn store_address(&self) -> &str {
        &self.store_address
    }

    /// The agent saw the group's workers stop: every waiting call fails
    /// with `reason` and the lighthouse connection is dropped at once.
    pub fn workers_stopped(&self, reason: &str) {
        let _ = self.core.send(Msg::WorkersStopped(reason.to_owned()));
    }

    /// The group's number of ranks from the next hellos on.
    pub fn set_world_size(&self, n: usize) {
        let _ = self.core.send(Msg::SetWorldSize(n));
    }

    /// The status, updated as things happen.
    pub fn status(&self) -> watch::Receiver<Status> {
        self.status.clone()
    }

    /// The events from now on.
    pub fn events(&self) -> broadcast::Receiver<FtEvent> {
        self.events.subscribe()
    }

    /// Stops serving: closes the workers' connections, the lighthouse
    /// connection and the store.
    pub async fn shutdown(self) {
        let (tx, rx) = oneshot::channel();
        if self.core.send(Msg::Shutdown(tx)).is_ok() {
            let _ = rx.await;
        }
        self.accept.abort();
        let _ = self.accept.await;
        let _ = self.core_task.await;
        self.store.shutdown().await;
    }
}

/// `host:port`, with brackets around an IPv6 host.
fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The host to advertise (see [`Config::advertise_host`]).
async fn advertise_host(config: &Config, target: &str) -> Result<String, Error> {
    if let Some(h) = &config.advertise_host {
        return Ok(h.clone());
    }
    if !config.bind.ip().is_unspecified() {
        return Ok(config.bind.ip().to_string());
    }
    let route = |source| Error::Route {
        lighthouse: config.lighthouse.clone(),
        source,
    };
    let to = tokio::net::lookup_host(target)
        .await
        .map_err(route)?
        .next()
        .ok_or_else(|| route(std::io::Error::other("the name resolves to no address")))?;
    let ip = rallypoint_store::host::source_addr_towards(to)
        .ok_or_else(|| route(std::io::Error::other("no route to it")))?;
    // A lighthouse on this host (`rally run --ft-serve-lighthouse`) is
    // reached over loopback, which other hosts cannot use to reach this
    // manager's store: advertise this host's own address then.
    if ip.is_loopback() {
        return Ok(rallypoint_store::host::advertised_addr());
    }
    Ok(ip.to_string())
}

/// The label workers and the manager prove the job secret under.
pub const SERVICE: Service = Service::new("ft-manager");

/// What the accept loop asks of a worker connection before its hello.
#[derive(Clone)]
struct Guard {
    secret: Option<JobSecret>,
    refusals: Arc<Refusals>,
}

impl Guard {
    /// Whether the connection from `peer` proved the secret (or none is asked).
    async fn admits(&self, stream: &mut TcpStream, peer: SocketAddr) -> bool {
        let Some(secret) = &self.secret else {
            return true;
        };
        let deadline = std::time::Instant::now() + rallypoint_auth::io::SERVER_DEADLINE;
        let proof =
            rallypoint_auth::io::tokio::server_handshake(stream, peer, secret, SERVICE, deadline);
        match proof.await {
            Ok(()) => true,
            Err(refusal) => {
                self.refusals.count(&refusal);
                tracing::warn!("ft manager: {refusal}");
                false
            }
        }
    }
}

async fn accept(
    listener: TcpListener,
    core: mpsc::UnboundedSender<Msg>,
    keep_alive: Duration,
    guard: Guard,
) {
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((mut stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    let (core, guard) = (core.clone(), guard.clone());
                    conns.spawn(async move {
                        if guard.admits(&mut stream, peer).await {
                            serve(stream, core, keep_alive).await;
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!("accepting a worker connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

/// The default [`Config::worker_keep_alive`]: `rally lighthouse`'s default
/// keep-alive, so a stopped worker's group goes as fast as a stopped
/// manager's would.
pub const WORKER_KEEP_ALIVE: Duration = Duration::from_secs(1);

/// The most requests one connection may send ahead of their answers.
const MAX_QUEUED: usize = 64;

/// A line from the reader task.
type Line = Result<Vec<u8>, WireError>;

async fn read_lines(rd: tokio::net::tcp::OwnedReadHalf, lines: mpsc::Sender<Line>) {
    let mut rd = BufReader::new(rd);
    loop {
        let mut buf = Vec::new();
        let line = match wire::read_line(&mut rd, &mut buf).await {
            Ok(true) => Ok(buf),
            Ok(false) => return,
            Err(e) => Err(e),
        };
        let end = line.is_err();
        if lines.send(line).await.is_err() || end {
            return;
        }
    }
}

/// One worker connection: requests answered in order, one at a time; a
/// connection that has beaten and then goes silent for `keep_alive` is
/// closed.
async fn serve(stream: TcpStream, core: mpsc::UnboundedSender<Msg>, keep_alive: Duration) {
    let (rd, mut wr) = stream.into_split();
    let (line_tx, mut lines) = mpsc::channel(4);
    let reader = tokio::spawn(read_lines(rd, line_tx));
    let (answers_tx, mut answers) = mpsc::unbounded_channel::<String>();
    let mut rank: Option<Rank> = None;
    let mut queue: VecDeque<Request> = VecDeque::new();
    let mut busy = false;
    // Set by the first beat: from then on, silence is a stop.
    let mut beating = false;
    let silence = tokio::time::sleep(keep_alive);
    tokio::pin!(silence);
    'conn: loop {
        tokio::select! {
            () = &mut silence, if beating => {
                tracing::warn!(
                    ?rank,
                    "a worker said nothing for {keep_alive:?} (stopped or hung): closing its connection, so its group leaves the quorum"
                );
                break;
            }
            line = lines.recv() => match line {
                None => break,
                Some(Ok(l)) => match wire::decode(&l) {
                    Ok(Request::Beat) => {
                        beating = true;
                        silence.as_mut().reset(tokio::time::Instant::now() + keep_alive);
                    }
                    Ok(_) if queue.len() >= MAX_QUEUED => {
                        let e = format!("more than {MAX_QUEUED} requests waiting on one connection (requests are answered one at a time, in order)");
                        let _ = wr.write_all(wire::answer_error(&e).as_bytes()).await;
                        break;
                    }
                    Ok(req) => {
                        silence.as_mut().reset(tokio::time::Instant::now() + keep_alive);
                        queue.push_back(req);
                    }
                    Err(e) => {
                        let _ = wr.write_all(wire::answer_error(&e.to_string()).as_bytes()).await;
                        break;
                    }
                },
                Some(Err(e)) => {
                    let _ = wr.write_all(wire::answer_error(&e.to_string()).as_bytes()).await;
                    break;
                }
            },
            Some(a) = answers.recv() => {
                busy = false;
                if wr.write_all(a.as_bytes()).await.is_err() {
                    break;
                }
            }
        }
        while !busy {
            let Some(req) = queue.pop_front() else { break };
            match (rank, req) {
                (
                    None,
                    Request::Hello {
                        group_rank,
                        group_world_size,
                        ..
                    },
                ) => {
                    let (reply, answer) = oneshot::channel();
                    let hello = Msg::Hello {
                        rank: group_rank,
                        world_size: group_world_size,
                        answers: answers_tx.clone(),
                        reply,
                    };
                    if core.send(hello).is_err() {
                        break 'conn;
                    }
                    let (line, ok) = match answer.await {
                        Ok(Ok((r, line))) => {
                            rank = Some(r);
                            (line, true)
                        }
                        Ok(Err(e)) => (wire::answer_error(&e), false),
                        Err(_) => break 'conn,
                    };
                    if wr.write_all(line.as_bytes()).await.is_err() || !ok {
                        break 'conn;
                    }
                }
                (None, _) => {
                    let e = "the first request of a connection must be hello";
                    let _ = wr.write_all(wire::answer_error(e).as_bytes()).await;
                    break 'conn;
                }
                (Some(_), Request::Hello { .. }) => {
                    let e = "hello twice on one connection";
                    let _ = wr.write_all(wire::answer_error(e).as_bytes()).await;
                    break 'conn;
                }
                (Some(r), req) => {
                    busy = true;
                    let call = Msg::Call {
                        rank: r,
                        req,
                        answers: answers_tx.clone(),
                    };
                    if core.send(call).is_err() {
                        break 'conn;
                    }
                }
            }
        }
    }
    reader.abort();
    if let Some(rank) = rank {
        let _ = core.send(Msg::Gone {
            rank,
            answers: answers_tx,
        });
    }
}

/// The core task's state.
struct Core {
    round: Round,
    lighthouse: Arc<Lighthouse>,
    books: Books,
    /// Each held rank's connection's answers.
    answers: BTreeMap<Rank, mpsc::UnboundedSender<String>>,
    tx: mpsc::UnboundedSender<Msg>,
}

impl Core {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Msg>) {
        loop {
            let deadline = self
                .round
                .next_deadline()
                .map(tokio::time::Instant::from_std);
            let msg = tokio::select! {
                m = rx.recv() => m,
                _ = sleep_until(deadline) => {
                    let now = std::time::Instant::now();
                    self.feed(Event::Tick { now });
                    continue;
                }
            };
            let Some(msg) = msg else { return };
            match msg {
                Msg::Shutdown(done) => {
                    self.feed(Event::WorkersStopped {
                        reason: "the manager shut down".into(),
                    });
                    self.lighthouse.drop_connection("the manager shut down");
                    let _ = done.send(());
                    return;
                }
                m => self.handle(m),
            }
        }
    }

    fn handle(&mut self, msg: Msg) {
        match msg {
            Msg::Hello {
                rank,
                world_size,
                answers,
                reply,
            } => self.hello(rank, world_size, answers, reply),
            Msg::Call { rank, req, answers } => {
                // Only the connection that holds the rank speaks for it: a
                // stopped worker's rank was released (and may be held by
                // its replacement already).
                if self
                    .answers
                    .get(&rank)
                    .is_some_and(|a| a.same_channel(&answers))
                {
                    self.call(rank, req);
                } else {
                    let e = format!("this connection no longer holds group rank {rank}: the group's workers were stopped");
                    let _ = answers.send(wire::answer_error(&e));
                }
            }
            Msg::Gone { rank, answers } => {
                // Only the connection that holds the rank speaks for it.
                if self
                    .answers
                    .get(&rank)
                    .is_some_and(|a| a.same_channel(&answers))
                {
                    self.feed(Event::RankGone { rank });
                    self.answers.remove(&rank);
                }
            }
            Msg::Lighthouse { call, result } => match result {
                // A stale answer (the round was stopped since) does not
                // change what the status shows.
                Ok(quorum) if self.round.awaits(call) => {
                    let members = quorum.participants.iter().map(|p| p.replica_id.clone());
                    let max_step = crate::results::max_step(&quorum.participants);
                    self.books
                        .quorum(quorum.quorum_id, members.collect(), max_step.unwrap_or(0));
                    self.feed(Event::LighthouseAnswered { call, quorum });
                }
                Ok(_) => {}
                Err(error) if self.round.awaits(call) => {
                    self.books.error(&error);
                    self.feed(Event::LighthouseFailed { call, error });
                }
                Err(_) => {}
            },
            Msg::Link(Link::Up) => self.books.connected(true),
            Msg::Link(Link::Lost(e)) => self.books.lost(e),
            Msg::Link(Link::IdHeld(e)) => self.books.id_held(&e, std::time::Instant::now()),
            Msg::WorkersStopped(reason) => {
                // Refusals of the id before the stop do not count towards
                // the next workers' (a restart takes a while).
                self.books.id_not_held();
                self.feed(Event::WorkersStopped { reason });
                // Every rank is released (see `round`): the old
                // connections no longer speak for the group.
                self.answers.clear();
            }
            Msg::SetWorldSize(n) => self.feed(Event::SetWorldSize(n)),
            Msg::Shutdown(_) => unreachable!("handled by run"),
        }
    }

    fn hello(
        &mut self,
        rank: u64,
        world_size: u64,
        answers: mpsc::UnboundedSender<String>,
        reply: oneshot::Sender<Result<(Rank, String), String>>,
    ) {
        let actions = self.round.handle(Event::Hello { rank, world_size });
        let mut reply = Some(reply);
        for a in actions {
            match a {
                Action::Welcome { rank } => {
                    let s = self.round.setup();
                    let line = wire::answer_ok(serde_json::json!({
                        "replica_id": s.replica_id,
                        "store_address": s.store_address,
                        "lighthouse": s.lighthouse,
                    }));
                    self.answers.insert(rank, answers.clone());
                    if let Some(r) = reply.take() {
                        let _ = r.send(Ok((rank, line)));
                    }
                }
                Action::HelloRefused { error } => {
                    if let Some(r) = reply.take() {
                        let _ = r.send(Err(error));
                    }
                }
                a => self.act(a),
            }
        }
    }

    fn call(&mut self, rank: Rank, req: Request) {
        let now = std::time::Instant::now();
        let event = match req {
            Request::Quorum {
                step,
                metadata,
                shrink_only,
                init_sync,
                commit_failures,
                timeout_ms,
                line,
            } => Event::Quorum {
                rank,
                call: QuorumCall {
                    step,
                    metadata,
                    shrink_only,
                    init_sync,
                    commit_failures,
                    timeout: Duration::from_millis(timeout_ms),
                    line,
                },
                now,
            },
            Request::ShouldCommit {
                step,
                vote,
                timeout_ms,
                line,
            } => Event::Vote {
                rank,
                step,
                line,
                vote,
                timeout: Duration::from_millis(timeout_ms),
                now,
            },
            Request::Report(r) => {
                self.books.report(rank, &r);
                self.send(rank, wire::answer_ok(serde_json::json!({})));
                return;
            }
            Request::Hello { .. } => unreachable!("hello is the connection's"),
            Request::Beat => unreachable!("beats are the connection's"),
        };
        self.feed(event);
    }

    fn feed(&mut self, event: Event) {
        for a in self.round.handle(event) {
            self.act(a);
        }
    }

    fn send(&self, rank: Rank, line: String) {
        if let Some(a) = self.answers.get(&rank) {
            let _ = a.send(line);
        }
    }

    fn act(&mut self, action: Action) {
        match action {
            Action::Welcome { .. } | Action::HelloRefused { .. } => {
                unreachable!("only from a hello")
            }
            Action::Connect => self.lighthouse.connect(),
            Action::CallLighthouse {
                call,
                member,
                deadline,
            } => {
                let lh = self.lighthouse.clone();
                let tx = self.tx.clone();
                let deadline = tokio::time::Instant::from_std(deadline);
                tokio::spawn(async move {
                    let result = lh.quorum(member, deadline).await;
                    let _ = tx.send(Msg::Lighthouse { call, result });
                });
            }
            Action::AnswerQuorum { rank, result } => {
                let line = wire::answer_ok(serde_json::json!({ "quorum": result }));
                self.send(rank, line);
            }
            Action::AnswerCommit { rank, commit } => {
                if commit && rank == 0 {
                    self.books.committed();
                }
                self.send(
                    rank,
                    wire::answer_ok(serde_json::json!({ "commit": commit })),
                );
            }
            Action::Fail { rank, error } => self.send(rank, wire::answer_error(&error)),
            Action::DropConnection { reason } => {
                // The status first: whoever sees the drop sees it there too.
                self.books.connected(false);
                self.lighthouse.drop_connection(&reason);
            }
        }
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_advertised_host_is_given_or_bound_or_on_the_route_to_the_lighthouse() {
        let mut c = Config::new("g", "http://127.0.0.1:9", 1);
        c.advertise_host = Some("node7".into());
        assert_eq!(advertise_host(&c, "127.0.0.1:9").await.unwrap(), "node7");
        c.advertise_host = None;
        c.bind = "127.0.0.2:0".parse().unwrap();
        assert_eq!(
            advertise_host(&c, "127.0.0.1:9").await.unwrap(),
            "127.0.0.2"
        );
        // Unspecified: the local address the kernel routes to the
        // lighthouse from (a UDP connect sends nothing); for a lighthouse
        // on loopback (served on this host) that would be loopback, which
        // other hosts cannot reach the store at: this host's address.
        c.bind = "0.0.0.0:0".parse().unwrap();
        let here = rallypoint_store::host::advertised_addr();
        assert_eq!(advertise_host(&c, "127.0.0.1:9").await.unwrap(), here);
        assert_ne!(here, "127.0.0.1");
    }

    #[test]
    fn ipv6_hosts_get_brackets() {
        assert_eq!(join_host_port("::1", 5), "[::1]:5");
        assert_eq!(join_host_port("[::1]", 5), "[::1]:5");
        assert_eq!(join_host_port("h", 5), "h:5");
    }

    #[tokio::test]
    async fn bad_configs_are_refused_naming_the_problem() {
        let e = Manager::start(Config::new("g", "ftp://x", 1))
            .await
            .err()
            .unwrap();
        assert!(e.to_string().contains("ftp://x"), "{e}");
        let mut c = Config::new("g", "http://127.0.0.1:9", 0);
        c.bind = "127.0.0.1:0".parse().unwrap();
        let e = Manager::start(c).await.err().unwrap();
        assert!(e.to_string().contains("at least one rank"), "{e}");
    }
}
