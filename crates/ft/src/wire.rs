//! The workers' protocol: JSON lines over TCP.
//!
//! One connection per worker process, one JSON object per `\n`-terminated
//! line (at most [`MAX_LINE`] bytes), requests answered in order. Every
//! request has `"op"` ([`Request`]); every answer has `"ok"`, and `"error"`
//! when it is false ([`answer_ok`], [`answer_error`]). A line that is not
//! a request, or too long, is answered `ok: false` naming the problem and
//! the connection is closed (the server's business, not this module's).

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufRead, AsyncBufReadExt};

/// The longest line either side accepts (1 MiB).
pub const MAX_LINE: usize = 1 << 20;

fn yes() -> bool {
    true
}

fn minute() -> u64 {
    60_000
}

/// A worker's request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// The first request of a connection: which group rank it is.
    Hello {
        group_rank: u64,
        group_world_size: u64,
        #[serde(default)]
        pid: u32,
    },
    /// Join this step's quorum.
    Quorum {
        step: i64,
        /// This rank's checkpoint metadata (its transport's `host:port`).
        metadata: String,
        #[serde(default)]
        shrink_only: bool,
        #[serde(default = "yes")]
        init_sync: bool,
        #[serde(default)]
        commit_failures: i64,
        #[serde(default = "minute")]
        timeout_ms: u64,
        /// The line of this rank's state: the id of the quorum of its last
        /// commit, carried by heals and checkpoints (`crate::results`);
        /// none when not known.
        #[serde(default)]
        line: Option<i64>,
    },
    /// This rank's vote on committing `step`, from a state of `line`.
    ShouldCommit {
        step: i64,
        vote: bool,
        #[serde(default = "minute")]
        timeout_ms: u64,
        #[serde(default)]
        line: Option<i64>,
    },
    /// Something the manager counts in its status.
    Report(Report),
    /// "This worker is alive", every 100 ms or so from a thread of its
    /// own; never answered. Once a connection has beaten, a silence of
    /// the manager's worker keep-alive closes it: the worker is stopped
    /// (SIGSTOP) or hung, and its group leaves the quorum.
    Beat,
}

/// A `report` request's content.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Report {
    /// This rank healed: `bytes` in `seconds` from `sources`.
    Heal {
        step: i64,
        bytes: u64,
        seconds: f64,
        #[serde(default)]
        sources: Vec<String>,
    },
    /// `step` was not committed.
    NotCommitted { step: i64, reason: String },
}

/// Why a line is no request.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("a request line longer than {MAX_LINE} bytes")]
    TooLong,
    #[error("a request line that is not UTF-8")]
    NotUtf8,
    #[error("a request that is not valid: {0} (a request is one JSON object with \"op\": hello, quorum, should_commit, report or beat)")]
    Invalid(String),
    #[error("reading the connection: {0}")]
    Io(#[from] std::io::Error),
}

/// Decodes one line (without its `\n`).
pub fn decode(line: &[u8]) -> Result<Request, WireError> {
    if line.len() > MAX_LINE {
        return Err(WireError::TooLong);
    }
    let text = std::str::from_utf8(line).map_err(|_| WireError::NotUtf8)?;
    serde_json::from_str(text).map_err(|e| WireError::Invalid(e.to_string()))
}

/// Encodes a request as one line (with its `\n`).
pub fn encode(req: &Request) -> String {
    let mut s = serde_json::to_string(req).expect("a request encodes");
    s.push('\n');
    s
}

/// An `ok: true` answer with `fields` (an object) beside it, as a line.
pub fn answer_ok(fields: serde_json::Value) -> String {
    let mut v = match fields {
        serde_json::Value::Object(m) => m,
        _ => serde_json::Map::new(),
    };
    v.insert("ok".into(), true.into());
    let mut s = serde_json::Value::Object(v).to_string();
    s.push('\n');
    s
}

/// An `ok: false` answer naming the problem, as a line.
pub fn answer_error(error: &str) -> String {
    let mut s = serde_json::json!({ "ok": false, "error": error }).to_string();
    s.push('\n');
    s
}

/// Reads the next line (without its `\n`) into `buf`, at most [`MAX_LINE`]
/// bytes; `Ok(false)` at the end of the stream (a last line without its
/// `\n` is still a line). Cancel-safe: bytes read stay in `buf`, so a
/// call cancelled midway is resumed by the next with the same `buf`.
pub async fn read_line<R: AsyncBufRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
) -> Result<bool, WireError> {
    loop {
        let chunk = r.fill_buf().await?;
        if chunk.is_empty() {
            return Ok(!buf.is_empty());
        }
        let (used, done) = match chunk.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (chunk.len(), false),
        };
        let take = if done { used - 1 } else { used };
        if buf.len() + take > MAX_LINE {
            return Err(WireError::TooLong);
        }
        buf.extend_from_slice(&chunk[..take]);
        r.consume(used);
        if done {
            return Ok(true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn requests_decode_with_their_defaults() {
        let r = decode(br#"{"op":"hello","group_rank":1,"group_world_size":2,"pid":7}"#).unwrap();
        assert_eq!(
            r,
            Request::Hello {
                group_rank: 1,
                group_world_size: 2,
                pid: 7
            }
        );
        let r = decode(br#"{"op":"quorum","step":3,"metadata":"h:1"}"#).unwrap();
        assert_eq!(
            r,
            Request::Quorum {
                step: 3,
                metadata: "h:1".into(),
                shrink_only: false,
                init_sync: true,
                commit_failures: 0,
                timeout_ms: 60_000,
                line: None
            }
        );
        let r = decode(br#"{"op":"report","kind":"not_committed","step":2,"reason":"nan"}"#);
        assert_eq!(
            r.unwrap(),
            Request::Report(Report::NotCommitted {
                step: 2,
                reason: "nan".into()
            })
        );
        let r = decode(
            br#"{"op":"report","kind":"heal","step":2,"bytes":10,"seconds":0.5,"sources":["a:1"]}"#,
        );
        assert!(matches!(
            r.unwrap(),
            Request::Report(Report::Heal { bytes: 10, .. })
        ));
    }

    #[test]
    fn bad_requests_are_errors_naming_the_problem() {
        let e = decode(br#"{"op":"fly"}"#).unwrap_err().to_string();
        assert!(e.contains("fly") && e.contains("hello"), "{e}");
        let e = decode(br#"{"op":"quorum"}"#).unwrap_err().to_string();
        assert!(e.contains("step"), "{e}");
        let e = decode(b"not json").unwrap_err().to_string();
        assert!(e.contains("not valid"), "{e}");
        let e = decode(&[0xff, 0xfe]).unwrap_err().to_string();
        assert!(e.contains("UTF-8"), "{e}");
        let e = decode(br#"{"op":"hello","group_rank":-1,"group_world_size":2}"#);
        assert!(e.is_err());
        let e = decode(br#"{"op":"hello","group_rank":0,"group_world_size":2,"x":1}"#);
        assert!(e.unwrap_err().to_string().contains("x"));
    }

    #[tokio::test]
    async fn lines_are_capped_and_split() {
        let mut input: Vec<u8> = b"{\"a\":1}\nsecond".to_vec();
        input.extend(std::iter::repeat_n(b'x', 10));
        let mut r = tokio::io::BufReader::with_capacity(4, &input[..]);
        let mut buf = Vec::new();
        assert!(read_line(&mut r, &mut buf).await.unwrap());
        assert_eq!(buf, b"{\"a\":1}");
        buf.clear();
        assert!(read_line(&mut r, &mut buf).await.unwrap());
        assert_eq!(buf.len(), 16);
        buf.clear();
        assert!(!read_line(&mut r, &mut buf).await.unwrap());

        let long = vec![b'x'; MAX_LINE + 1];
        let mut r = tokio::io::BufReader::new(&long[..]);
        let e = read_line(&mut r, &mut Vec::new()).await.unwrap_err();
        assert!(e.to_string().contains("longer than"), "{e}");
        let mut exact = vec![b'x'; MAX_LINE];
        exact.push(b'\n');
        let mut r = tokio::io::BufReader::new(&exact[..]);
        assert!(read_line(&mut r, &mut Vec::new()).await.unwrap());
    }

    #[test]
    fn answers_carry_ok_and_error() {
        let a: serde_json::Value =
            serde_json::from_str(&answer_ok(serde_json::json!({"commit": true}))).unwrap();
        assert_eq!(a, serde_json::json!({"ok": true, "commit": true}));
        let a: serde_json::Value = serde_json::from_str(&answer_error("why")).unwrap();
        assert_eq!(a, serde_json::json!({"ok": false, "error": "why"}));
    }

    fn request() -> impl Strategy<Value = Request> {
        let text = "[a-z0-9:.]{0,12}";
        prop_oneof![
            (any::<u64>(), any::<u64>(), any::<u32>()).prop_map(|(r, w, p)| Request::Hello {
                group_rank: r,
                group_world_size: w,
                pid: p
            }),
            (
                any::<i64>(),
                text,
                any::<bool>(),
                any::<bool>(),
                any::<i64>(),
                (any::<u64>(), any::<Option<i64>>())
            )
                .prop_map(|(s, m, so, is, cf, (t, l))| Request::Quorum {
                    step: s,
                    metadata: m,
                    shrink_only: so,
                    init_sync: is,
                    commit_failures: cf,
                    timeout_ms: t,
                    line: l
                }),
            (
                any::<i64>(),
                any::<bool>(),
                any::<u64>(),
                any::<Option<i64>>()
            )
                .prop_map(|(s, v, t, l)| Request::ShouldCommit {
                    step: s,
                    vote: v,
                    timeout_ms: t,
                    line: l,
                }),
            (
                any::<i64>(),
                any::<u64>(),
                (0u32..4_000_000).prop_map(|x| f64::from(x) / 4.0),
                proptest::collection::vec(text, 0..3)
            )
                .prop_map(|(s, b, t, src)| Request::Report(Report::Heal {
                    step: s,
                    bytes: b,
                    seconds: t,
                    sources: src
                })),
            (any::<i64>(), ".{0,20}")
                .prop_map(|(s, r)| Request::Report(Report::NotCommitted { step: s, reason: r })),
        ]
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn every_valid_request_round_trips(req in request()) {
            let line = encode(&req);
            prop_assert!(line.ends_with('\n') && !line[..line.len() - 1].contains('\n'));
            let back = decode(line.trim_end_matches('\n').as_bytes()).unwrap();
            prop_assert_eq!(back, req);
        }
    }
}
