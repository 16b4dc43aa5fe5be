//! Heals as replicas report them (`POST /v1/heal`), for `/status` and
//! `/metrics`.
//!
//! The lighthouse tells a replica whom to heal from but never sees the
//! transfer, so the healed replica reports it afterwards
//! (`rallypoint.ft.RallyTransport` does, best-effort, on a daemon thread):
//!
//! ```text
//! POST /v1/heal
//! {"replica_id": "train_1", "step": 42, "bytes": 1048576, "seconds": 0.12,
//!  "sources": ["10.0.0.1:4100"], "quorum_id": 7}
//! ```
//!
//! `replica_id` is the full id the lighthouse knows or the name torchft's
//! `Manager` was given (before its `:uuid4`), resolved by
//! [`Lighthouse::resolve_replica`](crate::machine::Lighthouse::resolve_replica);
//! `sources` may be spelled `source` (one string); `quorum_id` is
//! optional. [`parse`] checks every field and says what is wrong; the
//! service answers `400` for a malformed report, `413` for a body over
//! [`MAX_BODY`], `422` for a replica it does not know, and `200` with the
//! resolved id otherwise.
//!
//! [`Heals`] keeps the last [`KEPT`] reports, the last one of each replica
//! (at most [`REPLICAS_KEPT`] replicas, the oldest forgotten first), and
//! counters: reports, bytes, the sum and the largest of the seconds, and a
//! histogram of the seconds over [`BUCKETS`].

use std::collections::{BTreeMap, VecDeque};

use serde_json::{json, Value};

/// Largest body of a heal report, in bytes (a report is a few hundred).
pub const MAX_BODY: usize = 64 << 10;
/// Reports kept in `/status`'s `heals.last`.
pub const KEPT: usize = 32;
/// Replicas whose last heal `/status` keeps.
pub const REPLICAS_KEPT: usize = 1024;
/// Sources a report may name.
pub const MAX_SOURCES: usize = 64;
/// Longest source (or replica id) accepted, in bytes.
const MAX_TEXT: usize = 1024;
/// Upper bounds of the heal-time histogram's buckets, in seconds.
pub const BUCKETS: [f64; 10] = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0];

/// One heal, as reported.
#[derive(Clone, Debug, PartialEq)]
pub struct Heal {
    /// The id the replica has at the lighthouse (resolved from the report's).
    pub replica_id: String,
    /// The step whose state it received.
    pub step: i64,
    /// Tensor bytes received.
    pub bytes: u64,
    /// From its first request to the last byte.
    pub seconds: f64,
    /// Who served it (`host:port` of their transports).
    pub sources: Vec<String>,
    /// The quorum that asked for the heal, if reported.
    pub quorum_id: Option<i64>,
    /// When the lighthouse got the report (unix seconds).
    pub at: f64,
}

/// A report's fields before its replica id is resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    pub replica_id: String,
    pub step: i64,
    pub bytes: u64,
    pub seconds: f64,
    pub sources: Vec<String>,
    pub quorum_id: Option<i64>,
}

/// Parses and checks a report's JSON body; the error says which field is
/// wrong and how.
pub fn parse(body: &[u8]) -> Result<Report, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
    let Value::Object(o) = &v else {
        return Err("the body is not a JSON object".into());
    };
    const FIELDS: [&str; 7] = [
        "replica_id",
        "step",
        "bytes",
        "seconds",
        "sources",
        "source",
        "quorum_id",
    ];
    if let Some(k) = o.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(format!("unknown field {k:?} (fields: {FIELDS:?})"));
    }
    let replica_id = text(o.get("replica_id"), "replica_id")?;
    let step = o
        .get("step")
        .and_then(Value::as_i64)
        .filter(|s| *s >= 0)
        .ok_or("step must be an integer >= 0")?;
    let bytes = o
        .get("bytes")
        .and_then(Value::as_u64)
        .ok_or("bytes must be an integer >= 0")?;
    let seconds = o
        .get("seconds")
        .and_then(Value::as_f64)
        .filter(|s| s.is_finite() && *s >= 0.0)
        .ok_or("seconds must be a finite number >= 0")?;
    let sources = match (o.get("sources"), o.get("source")) {
        (Some(Value::Array(a)), None) => {
            if a.len() > MAX_SOURCES {
                return Err(format!("{} sources, more than {MAX_SOURCES}", a.len()));
            }
            a.iter()
                .map(|s| text(Some(s), "each of sources"))
                .collect::<Result<Vec<_>, _>>()?
        }
        (None, Some(s)) => vec![text(Some(s), "source")?],
        (None, None) => Vec::new(),
        _ => {
            return Err(
                "sources must be an array of strings, or source one string (not both)".into(),
            )
        }
    };
    let quorum_id = match o.get("quorum_id") {
        None | Some(Value::Null) => None,
        Some(q) => Some(q.as_i64().ok_or("quorum_id must be an integer")?),
    };
    Ok(Report {
        replica_id,
        step,
        bytes,
        seconds,
        sources,
        quorum_id,
    })
}

/// A non-empty string of at most [`MAX_TEXT`] bytes.
fn text(v: Option<&Value>, what: &str) -> Result<String, String> {
    match v {
        Some(Value::String(s)) if s.is_empty() => Err(format!("{what} is empty")),
        Some(Value::String(s)) if s.len() > MAX_TEXT => Err(format!(
            "{what} has {} bytes, more than {MAX_TEXT}",
            s.len()
        )),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(format!("{what} must be a string")),
        None => Err(format!("{what} is missing")),
    }
}

/// The heals reported since the service started.
#[derive(Clone, Debug, Default)]
pub struct Heals {
    last: VecDeque<Heal>,
    /// The last heal of each replica, and when it was recorded (an order).
    by_replica: BTreeMap<String, (u64, Heal)>,
    recorded: u64,
    bytes: u64,
    seconds_sum: f64,
    seconds_max: f64,
    /// Reports per bucket of [`BUCKETS`] (not cumulative), then above them.
    buckets: [u64; BUCKETS.len() + 1],
}

impl Heals {
    /// Records one heal.
    pub fn record(&mut self, heal: Heal) {
        self.recorded += 1;
        self.bytes = self.bytes.saturating_add(heal.bytes);
        self.seconds_sum += heal.seconds;
        self.seconds_max = self.seconds_max.max(heal.seconds);
        let b = BUCKETS
            .iter()
            .position(|le| heal.seconds <= *le)
            .unwrap_or(BUCKETS.len());
        self.buckets[b] += 1;
        self.by_replica
            .insert(heal.replica_id.clone(), (self.recorded, heal.clone()));
        if self.by_replica.len() > REPLICAS_KEPT {
            let oldest = self
                .by_replica
                .iter()
                .min_by_key(|(_, (n, _))| *n)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                self.by_replica.remove(&k);
            }
        }
        self.last.push_back(heal);
        while self.last.len() > KEPT {
            self.last.pop_front();
        }
    }

    /// `/status`'s `heals` object.
    pub fn to_json(&self) -> Value {
        let by_replica: serde_json::Map<String, Value> = self
            .by_replica
            .iter()
            .map(|(k, (_, h))| (k.clone(), heal_json(h)))
            .collect();
        json!({
            "total": self.recorded,
            "bytes_total": self.bytes,
            "seconds_sum": self.seconds_sum,
            "seconds_max": self.seconds_max,
            "last": self.last.iter().rev().map(heal_json).collect::<Vec<_>>(),
            "by_replica": by_replica,
        })
    }

    /// The heal metrics in Prometheus' text format (names prefixed
    /// `rally_lighthouse_`).
    pub fn metrics(&self, out: &mut String) {
        use std::fmt::Write as _;
        let p = "rally_lighthouse_";
        let _ = writeln!(out, "# HELP {p}heals_total heals reported by replicas");
        let _ = writeln!(out, "# TYPE {p}heals_total counter");
        let _ = writeln!(out, "{p}heals_total {}", self.recorded);
        let _ = writeln!(out, "# HELP {p}heal_bytes_total tensor bytes healed");
        let _ = writeln!(out, "# TYPE {p}heal_bytes_total counter");
        let _ = writeln!(out, "{p}heal_bytes_total {}", self.bytes);
        let _ = writeln!(out, "# HELP {p}heal_seconds_max the longest heal reported");
        let _ = writeln!(out, "# TYPE {p}heal_seconds_max gauge");
        let _ = writeln!(out, "{p}heal_seconds_max {}", self.seconds_max);
        let _ = writeln!(
            out,
            "# HELP {p}heal_seconds time of a heal, from its first request to its last byte"
        );
        let _ = writeln!(out, "# TYPE {p}heal_seconds histogram");
        let mut cumulative = 0;
        for (le, n) in BUCKETS.iter().zip(self.buckets) {
            cumulative += n;
            let _ = writeln!(out, "{p}heal_seconds_bucket{{le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(
            out,
            "{p}heal_seconds_bucket{{le=\"+Inf\"}} {}",
            self.recorded
        );
        let _ = writeln!(out, "{p}heal_seconds_sum {}", self.seconds_sum);
        let _ = writeln!(out, "{p}heal_seconds_count {}", self.recorded);
    }
}

fn heal_json(h: &Heal) -> Value {
    json!({
        "replica_id": h.replica_id, "step": h.step, "bytes": h.bytes,
        "seconds": h.seconds, "sources": h.sources, "quorum_id": h.quorum_id,
        "at": h.at,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heal(id: &str, bytes: u64, seconds: f64) -> Heal {
        Heal {
            replica_id: id.into(),
            step: 3,
            bytes,
            seconds,
            sources: vec!["h:1".into()],
            quorum_id: None,
            at: 0.0,
        }
    }

    #[test]
    fn reports_parse_or_say_which_field_is_wrong() {
        let r = parse(br#"{"replica_id":"r1","step":4,"bytes":100,"seconds":0.5,"source":"h:1"}"#)
            .unwrap();
        assert_eq!(
            (r.step, r.bytes, r.sources),
            (4, 100, vec!["h:1".to_owned()])
        );
        let r = parse(br#"{"replica_id":"r1","step":0,"bytes":0,"seconds":0,"sources":["a:1","b:2"],"quorum_id":9}"#)
            .unwrap();
        assert_eq!((r.sources.len(), r.quorum_id), (2, Some(9)));
        for (body, says) in [
            (&b"{"[..], "not JSON"),
            (b"[1]", "not a JSON object"),
            (
                br#"{"step":1,"bytes":1,"seconds":1}"#,
                "replica_id is missing",
            ),
            (
                br#"{"replica_id":"","step":1,"bytes":1,"seconds":1}"#,
                "replica_id is empty",
            ),
            (
                br#"{"replica_id":"r","step":-1,"bytes":1,"seconds":1}"#,
                "step",
            ),
            (
                br#"{"replica_id":"r","step":1,"bytes":-5,"seconds":1}"#,
                "bytes",
            ),
            (
                br#"{"replica_id":"r","step":1,"bytes":1,"seconds":"x"}"#,
                "seconds",
            ),
            (
                br#"{"replica_id":"r","step":1,"bytes":1,"seconds":1,"sources":[1]}"#,
                "each of sources",
            ),
            (
                br#"{"replica_id":"r","step":1,"bytes":1,"seconds":1,"source":"a","sources":[]}"#,
                "not both",
            ),
            (
                br#"{"replica_id":"r","step":1,"bytes":1,"seconds":1,"extra":1}"#,
                "unknown field \"extra\"",
            ),
            (
                br#"{"replica_id":"r","step":1,"bytes":1,"seconds":1,"quorum_id":"q"}"#,
                "quorum_id",
            ),
        ] {
            let e = parse(body).unwrap_err();
            assert!(e.contains(says), "{}: {e}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn the_book_counts_keeps_the_last_and_bounds_what_it_keeps() {
        let mut h = Heals::default();
        h.record(heal("a", 10, 0.02));
        h.record(heal("b", 5, 3.0));
        h.record(heal("a", 1, 100.0));
        let j = h.to_json();
        assert_eq!(j["total"], 3);
        assert_eq!(j["bytes_total"], 16);
        assert_eq!(j["seconds_max"], 100.0);
        assert_eq!(j["last"][0]["bytes"], 1, "newest first");
        assert_eq!(j["by_replica"]["a"]["bytes"], 1, "a's last heal");
        let mut m = String::new();
        h.metrics(&mut m);
        for line in [
            "rally_lighthouse_heals_total 3",
            "rally_lighthouse_heal_bytes_total 16",
            "rally_lighthouse_heal_seconds_bucket{le=\"0.01\"} 0",
            "rally_lighthouse_heal_seconds_bucket{le=\"0.05\"} 1",
            "rally_lighthouse_heal_seconds_bucket{le=\"5\"} 2",
            "rally_lighthouse_heal_seconds_bucket{le=\"60\"} 2",
            "rally_lighthouse_heal_seconds_bucket{le=\"+Inf\"} 3",
            "rally_lighthouse_heal_seconds_sum 103.02",
            "rally_lighthouse_heal_seconds_count 3",
        ] {
            assert!(m.lines().any(|l| l == line), "{line:?} in\n{m}");
        }
        for i in 0..(REPLICAS_KEPT + KEPT + 5) {
            h.record(heal(&format!("r{i}"), 1, 0.0));
        }
        assert_eq!(h.last.len(), KEPT);
        assert_eq!(h.by_replica.len(), REPLICAS_KEPT);
        assert!(
            !h.by_replica.contains_key("a"),
            "the oldest forgotten first"
        );
    }
}
