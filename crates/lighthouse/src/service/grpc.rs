//! torchft's `LighthouseService` over the machine: `Quorum` joins and waits
//! for an issued quorum that contains the requester (bounded by the call's
//! `grpc-timeout`, else [`DEFAULT_QUORUM_WAIT`]); `Heartbeat` records that the
//! replica is alive. Each call knows its connection ([`Conn`], put in the
//! request's extensions by the accept loop), which is the machine's session.
//!
//! Errors are gRPC statuses with a message a person can act on:
//! `INVALID_ARGUMENT` for a request the service cannot place (no requester,
//! an empty or oversized replica id), `ALREADY_EXISTS` for a replica id held
//! by another live process (also ending a waiting call whose id another
//! process took while it was silent), `DEADLINE_EXCEEDED` naming who the quorum
//! still waits for, `UNAVAILABLE` from a standby (`--state etcd://`: it
//! names the leader) or a lighthouse that lost its lease. The accept loop
//! logs and counts every refusal once.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tonic::{Request, Response, Status};

use super::state::{Counters, Refused, Shared};
use super::wire::{self, Encoded, Issued};
use crate::machine::{self, Session};
use crate::proto;

/// How long a `Quorum` call without a `grpc-timeout` waits (torchft's
/// managers always send one: their `quorum_timeout`, 60 s by default).
pub const DEFAULT_QUORUM_WAIT: Duration = Duration::from_secs(60);

/// How long a `Heartbeat` waits for a starting lighthouse's first campaign
/// (`--state`) before it is refused; a `Quorum` call waits within its own
/// deadline.
const SETTLE_WAIT: Duration = Duration::from_secs(2);

/// Longest replica id accepted, in bytes (torchft's are `name:uuid4`).
pub const MAX_REPLICA_ID: usize = 1024;

/// The connection a request arrived on.
#[derive(Clone, Copy, Debug)]
pub struct Conn {
    /// The machine's session: one per accepted connection.
    pub session: Session,
    /// The peer's address, for logs.
    pub peer: SocketAddr,
}

/// The gRPC handlers.
pub struct Grpc {
    pub shared: Arc<Shared>,
}

#[tonic::async_trait]
impl proto::LighthouseService for Grpc {
    /// The generated server's `Quorum`; the accept loop routes `Quorum`
    /// calls to [`QuorumCall`], which writes the answer encoded once, so
    /// this one serves only a caller that reaches the generated server some
    /// other way. Same rules, same answer.
    async fn quorum(
        &self,
        req: Request<proto::LighthouseQuorumRequest>,
    ) -> Result<Response<proto::LighthouseQuorumResponse>, Status> {
        let issued = join_and_wait(&self.shared, req).await?;
        Ok(Response::new(proto::LighthouseQuorumResponse {
            quorum: Some(wire::to_proto(issued.quorum.clone())),
        }))
    }

    async fn heartbeat(
        &self,
        req: Request<proto::LighthouseHeartbeatRequest>,
    ) -> Result<Response<proto::LighthouseHeartbeatResponse>, Status> {
        let conn = conn(&req)?;
        let replica_id = req.into_inner().replica_id;
        check_replica_id(&replica_id)?;
        self.shared.settled(SETTLE_WAIT).await;
        self.shared
            .heartbeat(conn.session, replica_id.clone())
            .map_err(refused)?;
        Ok(Response::new(proto::LighthouseHeartbeatResponse {}))
    }
}

/// `Quorum` as the accept loop serves it: the same rules as
/// [`Grpc::quorum`], answered with the bytes encoded once per issued quorum.
#[derive(Clone)]
pub struct QuorumCall {
    pub shared: Arc<Shared>,
}

impl tonic::server::UnaryService<proto::LighthouseQuorumRequest> for QuorumCall {
    type Response = Encoded;
    type Future = BoxFuture<'static, Result<Response<Encoded>, Status>>;

    fn call(&mut self, req: Request<proto::LighthouseQuorumRequest>) -> Self::Future {
        let shared = self.shared.clone();
        Box::pin(async move {
            let issued = join_and_wait(&shared, req).await?;
            Ok(Response::new(issued.answer.clone()))
        })
    }
}

type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// A `Quorum` call: join, then wait (bounded by the call's `grpc-timeout`)
/// for an issued quorum that contains the requester.
async fn join_and_wait(
    shared: &Arc<Shared>,
    req: Request<proto::LighthouseQuorumRequest>,
) -> Result<Arc<Issued>, Status> {
    let conn = conn(&req)?;
    let wait = grpc_timeout(&req)?.unwrap_or(DEFAULT_QUORUM_WAIT);
    let req = req.into_inner();
    let requester = req.requester.ok_or_else(|| {
        Status::invalid_argument("quorum request without a requester (QuorumMember)")
    })?;
    check_replica_id(&requester.replica_id)?;
    let remembered = req.last_quorum.and_then(check_last_quorum);
    let member = wire::member(requester);
    let replica_id = member.replica_id.clone();
    let started = tokio::time::Instant::now();
    shared.settled(wait).await;
    let wait = wait.saturating_sub(started.elapsed());
    let mut waiting = shared
        .join(conn.session, member, remembered)
        .map_err(refused)?;
    match tokio::time::timeout(wait, &mut waiting.rx).await {
        Ok(Ok(Ok(issued))) => Ok(issued),
        Ok(Ok(Err(r))) => Err(refused(r)),
        Ok(Err(_)) => Err(Status::unavailable("the lighthouse is stopping")),
        Err(_) => {
            Counters::add(&shared.counters.timeouts);
            let s = shared.status();
            Err(Status::deadline_exceeded(format!(
                "no quorum with replica {replica_id} within {wait:?}: waiting {:?}, healthy {:?}; {}",
                s.waiting, s.healthy, s.reason
            )))
        }
    }
}

fn conn<T>(req: &Request<T>) -> Result<Conn, Status> {
    req.extensions()
        .get::<Conn>()
        .copied()
        .ok_or_else(|| Status::internal("request without a connection (a defect of the service)"))
}

/// A refusal as its status: `ALREADY_EXISTS` for a replica id held by
/// another live process, `UNAVAILABLE` from a lighthouse that does not
/// serve (a standby, or one that lost its lease: ask again, or the other).
fn refused(r: Refused) -> Status {
    match r {
        Refused::Held(reason) => already_exists(&reason),
        Refused::Unavailable(reason) => Status::unavailable(reason),
    }
}

/// The machine's refusal: a replica id held by another live process.
fn already_exists(reason: &str) -> Status {
    Status::already_exists(format!(
        "{reason} (each replica group needs its own id; torchft's Manager adds a uuid to it)"
    ))
}

fn check_replica_id(id: &str) -> Result<(), Status> {
    if id.is_empty() {
        return Err(Status::invalid_argument("empty replica_id"));
    }
    if id.len() > MAX_REPLICA_ID {
        return Err(Status::invalid_argument(format!(
            "replica_id of {} bytes, more than {MAX_REPLICA_ID}",
            id.len()
        )));
    }
    Ok(())
}

/// Our extension's `last_quorum`, if every member is a valid replica id.
/// It is a hint (it can only shorten the startup grace), so an invalid one
/// is ignored with a warning, not refused: refusing would fail the group's
/// every retry, since its client sends the same memory again.
fn check_last_quorum(q: proto::LastQuorum) -> Option<machine::Remembered> {
    if let Some(e) = q
        .replica_ids
        .iter()
        .find_map(|id| check_replica_id(id).err())
    {
        tracing::warn!(
            quorum_id = q.quorum_id,
            "a quorum request's last_quorum is ignored: {}",
            e.message()
        );
        return None;
    }
    Some(wire::remembered(q))
}

/// The call's `grpc-timeout` header, if any.
fn grpc_timeout<T>(req: &Request<T>) -> Result<Option<Duration>, Status> {
    let Some(v) = req.metadata().get("grpc-timeout") else {
        return Ok(None);
    };
    let text = v.to_str().unwrap_or("");
    parse_grpc_timeout(text)
        .map(Some)
        .ok_or_else(|| Status::invalid_argument(format!("malformed grpc-timeout header {text:?}")))
}

/// gRPC's `TimeoutValue TimeoutUnit`: at most 8 digits, then one of
/// `H M S m u n`.
pub fn parse_grpc_timeout(text: &str) -> Option<Duration> {
    if !text.is_ascii() {
        return None;
    }
    let (digits, unit) = text.split_at(text.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// Unix time in milliseconds: the first quorum id of a service started now,
/// so that a restarted service never reuses an id.
pub fn unix_millis() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_parse() {
        assert_eq!(parse_grpc_timeout("5S"), Some(Duration::from_secs(5)));
        assert_eq!(parse_grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(
            parse_grpc_timeout("99999999n"),
            Some(Duration::from_nanos(99_999_999))
        );
        for bad in ["", "S", "5", "5s", "123456789S", "-5S", "5 S", "é"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad:?}");
        }
    }
}
