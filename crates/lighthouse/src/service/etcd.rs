//! `--state etcd://HOST:PORT[/prefix]`: the lighthouse's state in etcd, so
//! that a second lighthouse can take over.
//!
//! Two keys under the prefix (default [`DEFAULT_PREFIX`]):
//!
//! * `<prefix>leader`: who serves. A lighthouse campaigns by creating it
//!   under its own etcd lease in one transaction (`create_revision == 0`);
//!   the one that created it leads, the others stand by. A standby refuses
//!   every `Quorum` and `Heartbeat` call (`UNAVAILABLE`, naming the leader)
//!   and watches the key; when the leader's lease expires (its process
//!   killed, its host gone) etcd deletes the key and the standby campaigns
//!   again. The leader keeps its lease alive every quarter of its TTL; if
//!   no keep-alive was acknowledged for three quarters of the TTL (counted
//!   from when the last acknowledged one was sent) it counts its lease as
//!   lost and stops at once, before etcd can let anyone else lead.
//! * `<prefix>state`: the last quorum issued, its id and members as JSON
//!   ([`encode`], [`decode`]). The leader writes it **before** it answers
//!   any member of a quorum with a new id, in a transaction that holds
//!   only while its lease still owns `<prefix>leader` (fencing: a deposed
//!   leader's write fails, and it answers nobody). So every id a member
//!   ever saw is in etcd, and a lighthouse that takes over goes on above
//!   it: ids never go back, whatever the clocks. Re-issuing the same id
//!   (every step of a steady job) writes nothing.
//!
//! A lighthouse that takes over reads `<prefix>state` and hands it to the
//! machine as [`Event::Restored`](crate::machine::Event::Restored): when the
//! previous quorum's members are all back it is re-issued at once, under
//! its id, without the startup grace.
//!
//! Heal records are not kept in etcd (they are statistics; a takeover
//! starts them afresh).
//!
//! Every etcd call has a deadline ([`Etcd::timeout`]); an etcd that does not
//! answer at start is an error naming its address.

use std::time::{Duration, Instant, SystemTime};

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, PutOptions, Txn, TxnOp, WatchOptions,
};
use serde_json::{json, Value};

use crate::quorum::{Member, Quorum};

/// The key prefix when the URL names none.
pub const DEFAULT_PREFIX: &str = "/rally/lighthouse/";
/// The smallest lease TTL (etcd's own floor is about a second).
pub const MIN_TTL: Duration = Duration::from_secs(2);

/// Where the state lives: `etcd://HOST:PORT[/prefix]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateUrl {
    /// `HOST:PORT`.
    pub endpoint: String,
    /// Ends with `/`.
    pub prefix: String,
}

impl std::str::FromStr for StateUrl {
    type Err = String;

    fn from_str(url: &str) -> Result<StateUrl, String> {
        let rest = url.strip_prefix("etcd://").ok_or_else(|| {
            format!("--state {url:?}: only etcd://HOST:PORT[/prefix] is supported")
        })?;
        let (endpoint, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        let port = endpoint
            .rsplit_once(':')
            .map(|(h, p)| (h, p.parse::<u16>()));
        match port {
            Some((h, Ok(p))) if !h.is_empty() && p > 0 => {}
            _ => return Err(format!("--state {url:?}: {endpoint:?} is not HOST:PORT")),
        }
        let prefix = match path.trim_end_matches('/') {
            "" => DEFAULT_PREFIX.to_owned(),
            p => format!("{p}/"),
        };
        Ok(StateUrl {
            endpoint: endpoint.to_owned(),
            prefix,
        })
    }
}

impl std::fmt::Display for StateUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "etcd://{}{}", self.endpoint, self.prefix)
    }
}

/// What a lighthouse that takes over reads: the last id issued and the
/// last quorum.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Saved {
    pub last_id: i64,
    pub quorum: Option<Quorum>,
    /// That quorum was aborted (a member dropped) after it was issued.
    pub aborted: bool,
}

/// `<prefix>state`'s value for quorum `q` (`aborted`: after a member of it
/// dropped).
pub fn encode(q: &Quorum, aborted: bool) -> String {
    let members: Vec<Value> = q
        .participants
        .iter()
        .map(|m| {
            json!({
                "replica_id": m.replica_id, "address": m.address,
                "store_address": m.store_address, "step": m.step,
                "world_size": m.world_size, "shrink_only": m.shrink_only,
                "commit_failures": m.commit_failures, "data": m.data,
            })
        })
        .collect();
    json!({"last_id": q.id, "members": members, "aborted": aborted}).to_string()
}

/// `<prefix>state`'s value read back; an error says what is wrong with it.
pub fn decode(value: &[u8]) -> Result<Saved, String> {
    let v: Value = serde_json::from_slice(value).map_err(|e| format!("not JSON: {e}"))?;
    let last_id = v["last_id"].as_i64().ok_or("no integer last_id")?;
    let members = v["members"].as_array().ok_or("no members array")?;
    let participants = members
        .iter()
        .map(|m| {
            let s = |k: &str| {
                m[k].as_str()
                    .map(str::to_owned)
                    .ok_or(format!("member without {k}"))
            };
            Ok(Member {
                replica_id: s("replica_id")?,
                address: s("address")?,
                store_address: s("store_address")?,
                step: m["step"].as_i64().ok_or("member without step")?,
                world_size: m["world_size"]
                    .as_u64()
                    .ok_or("member without world_size")?,
                shrink_only: m["shrink_only"].as_bool().unwrap_or(false),
                commit_failures: m["commit_failures"].as_i64().unwrap_or(0),
                data: s("data").unwrap_or_default(),
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    let quorum = (!participants.is_empty()).then(|| Quorum {
        id: last_id,
        participants,
        created: SystemTime::now(),
    });
    let aborted = match &v["aborted"] {
        Value::Null => false,
        a => a.as_bool().ok_or("aborted is not a boolean")?,
    };
    Ok(Saved {
        last_id,
        quorum,
        aborted,
    })
}

/// A campaign's outcome.
#[derive(Debug)]
pub enum Campaign {
    /// This lighthouse leads, under this lease.
    Won { lease: i64 },
    /// Another leads (its `<prefix>leader` value, under its `lease`); the
    /// key's revision, to watch from.
    Held {
        by: String,
        lease: i64,
        revision: i64,
    },
}

/// A client of the etcd holding the state.
#[derive(Clone)]
pub struct Etcd {
    client: Client,
    pub url: StateUrl,
    /// The lease's time to live.
    pub ttl: Duration,
    /// Every call's deadline.
    pub timeout: Duration,
}

impl std::fmt::Debug for Etcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Etcd({}, ttl {:?})", self.url, self.ttl)
    }
}

impl Etcd {
    /// Connects and reads once, so that an etcd that is not there fails
    /// now, within `timeout`, naming its address.
    pub async fn connect(url: StateUrl, ttl: Duration, timeout: Duration) -> Result<Etcd, String> {
        if ttl < MIN_TTL {
            return Err(format!(
                "the state's lease TTL {ttl:?} is below {MIN_TTL:?}"
            ));
        }
        let at = url.endpoint.clone();
        let unreachable = |e: &dyn std::fmt::Display| {
            format!("etcd at {at} did not answer within {timeout:?}: {e}")
        };
        let options = ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_timeout(timeout);
        let endpoint = format!("http://{}", url.endpoint);
        let connect = Client::connect([endpoint], Some(options));
        let client = tokio::time::timeout(timeout, connect)
            .await
            .map_err(|e| unreachable(&e))?
            .map_err(|e| unreachable(&e))?;
        let etcd = Etcd {
            client,
            url,
            ttl,
            timeout,
        };
        etcd.leader().await.map_err(|e| unreachable(&e))?;
        Ok(etcd)
    }

    fn key(&self, name: &str) -> String {
        format!("{}{name}", self.url.prefix)
    }

    /// Runs one call within [`Etcd::timeout`].
    async fn call<T>(
        &self,
        what: &str,
        fut: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, String> {
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(r) => r.map_err(|e| format!("etcd at {}: {what}: {e}", self.url.endpoint)),
            Err(_) => Err(format!(
                "etcd at {}: {what}: no answer within {:?}",
                self.url.endpoint, self.timeout
            )),
        }
    }

    /// Who leads now (`<prefix>leader`'s value) and the key's revision.
    pub async fn leader(&self) -> Result<Option<(String, i64)>, String> {
        let mut c = self.client.clone();
        let r = self
            .call("read the leader", c.get(self.key("leader"), None))
            .await?;
        Ok(r.kvs().first().map(|kv| {
            (
                String::from_utf8_lossy(kv.value()).into_owned(),
                r.header().map_or(0, |h| h.revision()),
            )
        }))
    }

    /// Tries to become the leader, naming itself `me`.
    pub async fn campaign(&self, me: &str) -> Result<Campaign, String> {
        let mut c = self.client.clone();
        let ttl = self.ttl.as_secs().max(1) as i64;
        let lease = self
            .call("grant a lease", c.lease_grant(ttl, None))
            .await?
            .id();
        let key = self.key("leader");
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key.clone(),
                me,
                Some(PutOptions::new().with_lease(lease)),
            )])
            .or_else([TxnOp::get(key, None)]);
        let r = self.call("campaign", c.txn(txn)).await?;
        if r.succeeded() {
            return Ok(Campaign::Won { lease });
        }
        let _ = self
            .call("revoke an unused lease", c.lease_revoke(lease))
            .await;
        let revision = r.header().map_or(0, |h| h.revision());
        let (by, held_by) = r
            .op_responses()
            .into_iter()
            .find_map(|op| match op {
                etcd_client::TxnOpResponse::Get(g) => g
                    .kvs()
                    .first()
                    .map(|kv| (String::from_utf8_lossy(kv.value()).into_owned(), kv.lease())),
                _ => None,
            })
            .unwrap_or_else(|| ("(gone meanwhile)".into(), 0));
        Ok(Campaign::Held {
            by,
            lease: held_by,
            revision,
        })
    }

    /// Ends a predecessor's lease (see `lead.rs`: one at this lighthouse's
    /// own address, which is gone): its leader key goes with it.
    pub async fn revoke(&self, lease: i64) -> Result<(), String> {
        let mut c = self.client.clone();
        match self
            .call("revoke the predecessor's lease", c.lease_revoke(lease))
            .await
        {
            Ok(_) => Ok(()),
            // Expired meanwhile: as good.
            Err(e) if e.contains("lease not found") => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Waits until `<prefix>leader` is deleted after `revision` (its
    /// leader's lease expired or it was revoked), for at most `limit`;
    /// whether it was.
    pub async fn vacated(&self, revision: i64, limit: Duration) -> Result<bool, String> {
        let mut c = self.client.clone();
        let opts = WatchOptions::new().with_start_revision(revision + 1);
        let mut stream = self
            .call("watch the leader", c.watch(self.key("leader"), Some(opts)))
            .await?;
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let msg = match tokio::time::timeout_at(deadline, stream.message()).await {
                Err(_) => return Ok(false),
                Ok(m) => m.map_err(|e| format!("etcd at {}: watch: {e}", self.url.endpoint))?,
            };
            let Some(resp) = msg else {
                return Ok(false);
            };
            if resp
                .events()
                .iter()
                .any(|e| e.event_type() == EventType::Delete)
            {
                return Ok(true);
            }
        }
    }

    /// The state the last leader left, if any.
    pub async fn saved(&self) -> Result<Option<Saved>, String> {
        let mut c = self.client.clone();
        let r = self
            .call("read the state", c.get(self.key("state"), None))
            .await?;
        let Some(kv) = r.kvs().first() else {
            return Ok(None);
        };
        decode(kv.value())
            .map(Some)
            .map_err(|e| format!("{}state in {} is malformed: {e}", self.url.prefix, self.url))
    }

    /// Writes `q` as the last quorum, only while `lease` owns the leader
    /// key; `Ok(false)` when it no longer does (deposed).
    pub async fn save(&self, lease: i64, q: &Quorum, aborted: bool) -> Result<bool, String> {
        let mut c = self.client.clone();
        let txn = Txn::new()
            .when([Compare::lease(self.key("leader"), CompareOp::Equal, lease)])
            .and_then([TxnOp::put(self.key("state"), encode(q, aborted), None)]);
        Ok(self.call("write the state", c.txn(txn)).await?.succeeded())
    }

    /// Keeps `lease` alive until it is lost; returns why. Sends a
    /// keep-alive every quarter of the TTL; the lease counts as lost when
    /// none was acknowledged within three quarters of the TTL from the
    /// sending of the last acknowledged one (etcd expires it no sooner
    /// than a TTL after that), or when etcd says it expired.
    pub async fn keep(&self, lease: i64) -> String {
        let mut c = self.client.clone();
        let (mut keeper, mut acks) =
            match self.call("keep the lease", c.lease_keep_alive(lease)).await {
                Ok(k) => k,
                Err(e) => return e,
            };
        let every = self.ttl / 4;
        let lost_after = self.ttl * 3 / 4;
        let mut acked_sent = Instant::now();
        let mut tick = tokio::time::interval(every);
        loop {
            tick.tick().await;
            let silent = acked_sent.elapsed();
            if silent >= lost_after {
                return format!(
                    "no keep-alive of lease {lease:x} acknowledged by etcd at {} for {silent:?} (TTL {:?})",
                    self.url.endpoint, self.ttl
                );
            }
            let sent = Instant::now();
            let left = lost_after.saturating_sub(silent);
            if !matches!(
                tokio::time::timeout(left, keeper.keep_alive()).await,
                Ok(Ok(()))
            ) {
                continue;
            }
            let left = lost_after.saturating_sub(acked_sent.elapsed());
            match tokio::time::timeout(left, acks.message()).await {
                Ok(Ok(Some(ack))) if ack.ttl() > 0 => acked_sent = sent,
                Ok(Ok(Some(_))) => return format!("etcd says lease {lease:x} expired"),
                Ok(Ok(None)) | Ok(Err(_)) | Err(_) => {}
            }
        }
    }

    /// Gives the lease up (a clean stop), so a standby need not wait out
    /// its TTL.
    pub async fn resign(&self, lease: i64) {
        let mut c = self.client.clone();
        let _ = self.call("revoke the lease", c.lease_revoke(lease)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_urls_parse_or_say_why() {
        let u: StateUrl = "etcd://127.0.0.1:2379".parse().unwrap();
        assert_eq!(
            (u.endpoint.as_str(), u.prefix.as_str()),
            ("127.0.0.1:2379", DEFAULT_PREFIX)
        );
        let u: StateUrl = "etcd://h:1/jobs/a/".parse().unwrap();
        assert_eq!(u.prefix, "/jobs/a/");
        assert_eq!(u.to_string(), "etcd://h:1/jobs/a/");
        for (bad, says) in [
            ("http://h:1", "only etcd://"),
            ("etcd://h", "not HOST:PORT"),
            ("etcd://:1", "not HOST:PORT"),
            ("etcd://h:x/p", "not HOST:PORT"),
        ] {
            let e = bad.parse::<StateUrl>().unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn the_saved_quorum_reads_back() {
        let m = Member {
            replica_id: "r:1".into(),
            address: "http://h:1".into(),
            store_address: "h:2".into(),
            step: 7,
            world_size: 2,
            shrink_only: false,
            commit_failures: 0,
            data: "{}".into(),
        };
        let q = Quorum {
            id: 42,
            participants: vec![m],
            created: SystemTime::now(),
        };
        let back = decode(encode(&q, false).as_bytes()).unwrap();
        assert_eq!(back.last_id, 42);
        assert!(!back.aborted);
        assert!(decode(encode(&q, true).as_bytes()).unwrap().aborted);
        assert!(decode(br#"{"last_id": 1, "members": [], "aborted": 3}"#)
            .unwrap_err()
            .contains("aborted"));
        assert_eq!(back.quorum.unwrap().participants, q.participants);
        assert!(decode(b"{}").unwrap_err().contains("last_id"));
        assert!(decode(b"nope").unwrap_err().contains("not JSON"));
    }
}
