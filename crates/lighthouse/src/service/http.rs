//! The HTTP/1.1 side of the port (beside gRPC, as torchft serves `/status`
//! on its one port): `GET /v1/watch`, `POST /v1/heal`, `GET /status` and
//! `GET /metrics`.
//!
//! `/v1/watch?quorum_id=Q&timeout_ms=T` is the push channel to survivors:
//! it reads the watch board ([`super::watch`]) and answers `200` with JSON as
//! soon as it has something to say about `Q`, or `204` after `T` ms (at most
//! [`MAX_WATCH`]). `/v1/heal` takes a healed replica's report
//! ([`super::heals`]: its body, its checks and its answers; the body is read
//! within [`BODY_DEADLINE`], else `408`). `/status` is the machine's state
//! and the heals as JSON; `/metrics` the same figures in Prometheus' text
//! format. Anything else is `404`, a bad query `400` with the reason, a
//! known path with another method `405`.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use std::sync::atomic::Ordering;

use super::heals::{self, MAX_BODY};
use super::state::{Counters, Refused, Role, Shared};

/// The longest a watch poll may wait before its `204`.
pub const MAX_WATCH: Duration = Duration::from_secs(60);

/// The longest a client may take to send a request's body.
pub const BODY_DEADLINE: Duration = Duration::from_secs(10);

type Body = tonic::body::Body;

/// Serves one HTTP request that is not gRPC.
pub async fn serve<B>(shared: Arc<Shared>, req: Request<B>) -> Response<Body>
where
    B: hyper::body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let path = req.uri().path().to_owned();
    match (req.method(), path.as_str()) {
        (&Method::GET, "/v1/watch") => match watch_query(req.uri().query().unwrap_or("")) {
            Ok((q, t)) => watch(&shared, q, t).await,
            Err(why) => text(StatusCode::BAD_REQUEST, &format!("{why}\n")),
        },
        (&Method::POST, "/v1/heal") => heal(&shared, req).await,
        (&Method::GET, "/status") => json(StatusCode::OK, status_json(&shared)),
        (&Method::GET, "/metrics") => Response::builder()
            .header("content-type", "text/plain; version=0.0.4")
            .body(Body::new(Full::new(Bytes::from(metrics(&shared)))))
            .unwrap_or_default(),
        (_, "/v1/watch" | "/status" | "/metrics") => text(
            StatusCode::METHOD_NOT_ALLOWED,
            &format!("only GET is served at {path}\n"),
        ),
        (_, "/v1/heal") => text(
            StatusCode::METHOD_NOT_ALLOWED,
            "only POST is served at /v1/heal\n",
        ),
        (_, other) => text(
            StatusCode::NOT_FOUND,
            &format!("no {other} here: /v1/watch, /v1/heal, /status and /metrics are\n"),
        ),
    }
}

/// `POST /v1/heal`: reads the body (at most [`MAX_BODY`] bytes, within
/// [`BODY_DEADLINE`]), checks it, resolves its replica and records it.
async fn heal<B>(shared: &Shared, req: Request<B>) -> Response<Body>
where
    B: hyper::body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let too_large = || {
        text(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!("a heal report is at most {MAX_BODY} bytes\n"),
        )
    };
    let declared = req
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return too_large();
    }
    let read = Limited::new(req.into_body(), MAX_BODY).collect();
    let body = match tokio::time::timeout(BODY_DEADLINE, read).await {
        Err(_) => {
            return text(
                StatusCode::REQUEST_TIMEOUT,
                &format!("the body did not arrive within {BODY_DEADLINE:?}\n"),
            )
        }
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => return too_large(),
        Ok(Err(e)) => return text(StatusCode::BAD_REQUEST, &format!("reading the body: {e}\n")),
        Ok(Ok(b)) => b.to_bytes(),
    };
    let report = match heals::parse(&body) {
        Ok(r) => r,
        Err(why) => {
            return text(
                StatusCode::BAD_REQUEST,
                &format!("bad heal report: {why}\n"),
            )
        }
    };
    let at = super::unix_millis() as f64 / 1000.0;
    match shared.heal(report, at) {
        Ok(id) => json(
            StatusCode::OK,
            serde_json::json!({"recorded": true, "replica_id": id}).to_string(),
        ),
        Err(Refused::Held(why)) => text(StatusCode::UNPROCESSABLE_ENTITY, &format!("{why}\n")),
        Err(Refused::Unavailable(why)) => {
            text(StatusCode::SERVICE_UNAVAILABLE, &format!("{why}\n"))
        }
    }
}

/// `quorum_id` (required) and `timeout_ms` (required, capped at
/// [`MAX_WATCH`]) from a query string.
pub fn watch_query(query: &str) -> Result<(i64, Duration), String> {
    let mut quorum_id = None;
    let mut timeout = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "quorum_id" => {
                quorum_id = Some(
                    v.parse::<i64>()
                        .map_err(|_| format!("bad quorum_id {v:?}"))?,
                )
            }
            "timeout_ms" => {
                let ms = v
                    .parse::<u64>()
                    .map_err(|_| format!("bad timeout_ms {v:?}"))?;
                timeout = Some(Duration::from_millis(ms).min(MAX_WATCH));
            }
            _ => return Err(format!("unknown parameter {k:?} (quorum_id, timeout_ms)")),
        }
    }
    Ok((
        quorum_id.ok_or("missing quorum_id")?,
        timeout.ok_or("missing timeout_ms")?,
    ))
}

async fn watch(shared: &Shared, quorum_id: i64, timeout: Duration) -> Response<Body> {
    let mut board = shared.board();
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let answer = board.borrow_and_update().answer(quorum_id);
        if let Some(a) = answer {
            if matches!(a, super::watch::Answer::Dropped { .. }) {
                Counters::add(&shared.counters.aborts_pushed);
            }
            return json(StatusCode::OK, a.to_json());
        }
        match tokio::time::timeout_at(deadline, board.changed()).await {
            Ok(Ok(())) => {}
            // Timed out, or the service is stopping.
            Ok(Err(_)) | Err(_) => {
                return Response::builder()
                    .status(StatusCode::NO_CONTENT)
                    .body(Body::empty())
                    .unwrap_or_default()
            }
        }
    }
}

fn status_json(shared: &Shared) -> String {
    let s = shared.status();
    let c = &shared.counters;
    let participants: Vec<serde_json::Value> = s
        .quorum
        .iter()
        .flat_map(|q| &q.participants)
        .map(|m| {
            serde_json::json!({
                "replica_id": m.replica_id, "address": m.address,
                "store_address": m.store_address, "step": m.step,
                "world_size": m.world_size, "shrink_only": m.shrink_only,
                "commit_failures": m.commit_failures,
            })
        })
        .collect();
    let (role, leader, lost) = match shared.role() {
        Role::Leader { .. } => ("leader", None, None),
        Role::Starting { campaign } => ("starting", Some(campaign), None),
        Role::Standby { leader } => ("standby", Some(leader), None),
        Role::Lost { why } => ("lost", None, Some(why)),
    };
    serde_json::json!({
        "role": role,
        "leader": leader,
        "lost": lost,
        "quorum_id": s.quorum_id,
        "participants": participants,
        "waiting": s.waiting,
        "healthy": s.healthy,
        "heartbeat_timeout_ms": shared.heartbeat_timeout().as_millis() as u64,
        "reason": s.reason,
        "counters": {
            "joins": s.counters.joins,
            "heartbeats": s.counters.heartbeats,
            "drops": s.counters.drops,
            "quorums_issued": s.counters.quorums_issued,
            "aborts": s.counters.aborts,
            "refusals": s.counters.refusals,
            "left": s.counters.left,
            "recalled": s.counters.recalled,
            "aborts_pushed": c.aborts_pushed.load(Ordering::Relaxed),
            "refused_requests": c.refused.load(Ordering::Relaxed),
            "bad_connections": c.bad_connections.load(Ordering::Relaxed),
            "secret_refusals": c.secret_refusals.snapshot().total(),
            "quorum_timeouts": c.timeouts.load(Ordering::Relaxed),
            "sessions": c.sessions.load(Ordering::Relaxed),
            "sessions_open": c.open.load(Ordering::Relaxed),
        },
        "heals": shared.heals().to_json(),
    })
    .to_string()
}

/// Prometheus' text format.
pub fn metrics(shared: &Shared) -> String {
    let s = shared.status();
    let c = &shared.counters;
    let participants = s.quorum.as_ref().map_or(0, |q| q.participants.len());
    let leading = matches!(shared.role(), Role::Leader { .. });
    let rows: [(&str, &str, &str, u64); 17] = [
        (
            "leader",
            "gauge",
            "1 while this lighthouse serves quorums (a standby or a deposed one: 0)",
            u64::from(leading),
        ),
        (
            "quorum_id",
            "gauge",
            "id of the current quorum",
            s.quorum_id.max(0) as u64,
        ),
        (
            "participants",
            "gauge",
            "members of the current quorum",
            participants as u64,
        ),
        (
            "waiting",
            "gauge",
            "replicas waiting in a Quorum call",
            s.waiting.len() as u64,
        ),
        (
            "healthy",
            "gauge",
            "replicas heard from within the heartbeat timeout",
            s.healthy.len() as u64,
        ),
        (
            "joins_total",
            "counter",
            "Quorum requests",
            s.counters.joins,
        ),
        (
            "heartbeats_total",
            "counter",
            "Heartbeat requests",
            s.counters.heartbeats,
        ),
        (
            "drops_total",
            "counter",
            "replicas dropped (connection closed or heartbeat silent)",
            s.counters.drops,
        ),
        (
            "quorums_issued_total",
            "counter",
            "quorums issued",
            s.counters.quorums_issued,
        ),
        (
            "recalled_quorums_total",
            "counter",
            "first quorums issued before the startup grace's end, every member of the quorum the requesters remembered being back",
            s.counters.recalled,
        ),
        (
            "aborts_total",
            "counter",
            "members of a current quorum dropped",
            s.counters.aborts,
        ),
        (
            "quorum_calls_left_total",
            "counter",
            "Quorum calls that ended unanswered (cancelled, deadline) and stopped being participants",
            s.counters.left,
        ),
        (
            "aborts_pushed_total",
            "counter",
            "watch polls answered with a drop",
            c.aborts_pushed.load(Ordering::Relaxed),
        ),
        (
            "refused_requests_total",
            "counter",
            "requests refused (bad input, replica id held elsewhere, protocol errors)",
            c.refused.load(Ordering::Relaxed) + c.bad_connections.load(Ordering::Relaxed),
        ),
        (
            "secret_refusals_total",
            "counter",
            "connections refused by the job-secret handshake (no secret, a wrong one, unfinished)",
            c.secret_refusals.snapshot().total(),
        ),
        (
            "quorum_timeouts_total",
            "counter",
            "Quorum calls that reached their deadline",
            c.timeouts.load(Ordering::Relaxed),
        ),
        (
            "sessions_open",
            "gauge",
            "client connections open",
            c.open.load(Ordering::Relaxed),
        ),
    ];
    let mut out = String::new();
    for (name, kind, help, value) in rows {
        let _ = writeln!(out, "# HELP rally_lighthouse_{name} {help}");
        let _ = writeln!(out, "# TYPE rally_lighthouse_{name} {kind}");
        let _ = writeln!(out, "rally_lighthouse_{name} {value}");
    }
    shared.heals().metrics(&mut out);
    out
}

fn json(status: StatusCode, body: String) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Body::new(Full::new(Bytes::from(body))))
        .unwrap_or_default()
}

fn text(status: StatusCode, body: &str) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "text/plain")
        .body(Body::new(Full::new(Bytes::from(body.to_owned()))))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_queries_parse_or_say_why() {
        assert_eq!(
            watch_query("quorum_id=7&timeout_ms=250"),
            Ok((7, Duration::from_millis(250)))
        );
        assert_eq!(
            watch_query("timeout_ms=999999999&quorum_id=-1"),
            Ok((-1, MAX_WATCH))
        );
        assert!(watch_query("timeout_ms=5")
            .unwrap_err()
            .contains("quorum_id"));
        assert!(watch_query("quorum_id=5")
            .unwrap_err()
            .contains("timeout_ms"));
        assert!(watch_query("quorum_id=x&timeout_ms=5")
            .unwrap_err()
            .contains("bad quorum_id"));
        assert!(watch_query("quorum_id=1&timeout_ms=5&q=2")
            .unwrap_err()
            .contains("unknown"));
    }
}
