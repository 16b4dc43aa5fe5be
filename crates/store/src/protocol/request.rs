//! Requests: the server's decoder and the client's encoder.
//!
//! A decoded [`Request`] borrows its keys and values from the input buffer, so the
//! server decodes without copying; it copies only what it stores.

use super::{put_str, run_decoder, Command, Cursor, DecodeError, Decoded, Limits, Stop};

/// One request, as sent on the wire. Keys are raw bytes: PyTorch clients prefix
/// user keys with `/`, and the server treats them as opaque.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request<'a> {
    Validate {
        magic: u32,
    },
    Set {
        key: &'a [u8],
        value: &'a [u8],
    },
    CompareSet {
        key: &'a [u8],
        expected: &'a [u8],
        desired: &'a [u8],
    },
    Get {
        key: &'a [u8],
    },
    Add {
        key: &'a [u8],
        delta: i64,
    },
    Check {
        keys: Vec<&'a [u8]>,
    },
    Wait {
        keys: Vec<&'a [u8]>,
    },
    GetNumKeys,
    DeleteKey {
        key: &'a [u8],
    },
    Append {
        key: &'a [u8],
        value: &'a [u8],
    },
    MultiGet {
        keys: Vec<&'a [u8]>,
    },
    MultiSet {
        pairs: Vec<(&'a [u8], &'a [u8])>,
    },
    CancelWait,
    Ping {
        nonce: u32,
    },
    QueuePush {
        key: &'a [u8],
        value: &'a [u8],
    },
    QueuePop {
        key: &'a [u8],
    },
    QueueLen {
        key: &'a [u8],
    },
    ListKeys,
    Barrier {
        key: &'a [u8],
        world_size: i64,
    },
}

impl Request<'_> {
    /// The command this request carries.
    pub fn command(&self) -> Command {
        match self {
            Request::Validate { .. } => Command::Validate,
            Request::Set { .. } => Command::Set,
            Request::CompareSet { .. } => Command::CompareSet,
            Request::Get { .. } => Command::Get,
            Request::Add { .. } => Command::Add,
            Request::Check { .. } => Command::Check,
            Request::Wait { .. } => Command::Wait,
            Request::GetNumKeys => Command::GetNumKeys,
            Request::DeleteKey { .. } => Command::DeleteKey,
            Request::Append { .. } => Command::Append,
            Request::MultiGet { .. } => Command::MultiGet,
            Request::MultiSet { .. } => Command::MultiSet,
            Request::CancelWait => Command::CancelWait,
            Request::Ping { .. } => Command::Ping,
            Request::QueuePush { .. } => Command::QueuePush,
            Request::QueuePop { .. } => Command::QueuePop,
            Request::QueueLen { .. } => Command::QueueLen,
            Request::ListKeys => Command::ListKeys,
            Request::Barrier { .. } => Command::Barrier,
        }
    }

    /// Appends the wire form of this request to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.command() as u8);
        let keys = |out: &mut Vec<u8>, keys: &[&[u8]]| {
            out.extend_from_slice(&(keys.len() as u64).to_le_bytes());
            for k in keys {
                put_str(out, k);
            }
        };
        match self {
            Request::Validate { magic } => out.extend_from_slice(&magic.to_le_bytes()),
            Request::Ping { nonce } => out.extend_from_slice(&nonce.to_le_bytes()),
            Request::Set { key, value }
            | Request::Append { key, value }
            | Request::QueuePush { key, value } => {
                put_str(out, key);
                put_str(out, value);
            }
            Request::CompareSet {
                key,
                expected,
                desired,
            } => {
                put_str(out, key);
                put_str(out, expected);
                put_str(out, desired);
            }
            Request::Get { key }
            | Request::DeleteKey { key }
            | Request::QueuePop { key }
            | Request::QueueLen { key } => put_str(out, key),
            Request::Add { key, delta } => {
                put_str(out, key);
                out.extend_from_slice(&delta.to_le_bytes());
            }
            Request::Barrier { key, world_size } => {
                put_str(out, key);
                out.extend_from_slice(&world_size.to_le_bytes());
            }
            Request::Check { keys: k }
            | Request::Wait { keys: k }
            | Request::MultiGet { keys: k } => keys(out, k),
            Request::MultiSet { pairs } => {
                out.extend_from_slice(&(pairs.len() as i64).to_le_bytes());
                for (k, v) in pairs {
                    put_str(out, k);
                    put_str(out, v);
                }
            }
            Request::GetNumKeys | Request::CancelWait | Request::ListKeys => {}
        }
    }
}

/// Decodes one request from the front of `buf`.
///
/// Returns [`Decoded::Incomplete`] when `buf` ends inside the request (the caller
/// keeps the bytes and reads more) and an error when the bytes can never form a valid
/// request: an unknown command, or a length or count over `limits`. Limits are
/// checked as soon as a length field is read, so an oversized request is rejected
/// before its body arrives.
pub fn decode_request<'a>(
    buf: &'a [u8],
    limits: &Limits,
) -> Result<Decoded<Request<'a>>, DecodeError> {
    run_decoder(buf, |c| decode_body(c, limits))
}

fn decode_body<'a>(c: &mut Cursor<'a>, l: &Limits) -> Result<Request<'a>, Stop> {
    let code = c.u8()?;
    let cmd = Command::from_code(code).ok_or(DecodeError::UnknownCommand(code))?;
    let key = |c: &mut Cursor<'a>| c.str("key", l.max_key_len);
    let value = |c: &mut Cursor<'a>| c.str("value", l.max_value_len);
    let keys = |c: &mut Cursor<'a>| -> Result<Vec<&'a [u8]>, Stop> {
        let n = c.count("key", l.max_keys)?;
        // Grow as keys arrive rather than trusting the count for an allocation.
        let mut keys = Vec::with_capacity(n.min(64));
        for _ in 0..n {
            keys.push(key(c)?);
        }
        Ok(keys)
    };
    Ok(match cmd {
        Command::Validate => Request::Validate { magic: c.u32()? },
        Command::Set => Request::Set {
            key: key(c)?,
            value: value(c)?,
        },
        Command::CompareSet => Request::CompareSet {
            key: key(c)?,
            expected: value(c)?,
            desired: value(c)?,
        },
        Command::Get => Request::Get { key: key(c)? },
        Command::Add => Request::Add {
            key: key(c)?,
            delta: c.i64()?,
        },
        Command::Check => Request::Check { keys: keys(c)? },
        Command::Wait => Request::Wait { keys: keys(c)? },
        Command::GetNumKeys => Request::GetNumKeys,
        Command::DeleteKey => Request::DeleteKey { key: key(c)? },
        Command::Append => Request::Append {
            key: key(c)?,
            value: value(c)?,
        },
        Command::MultiGet => Request::MultiGet { keys: keys(c)? },
        Command::MultiSet => {
            let count = c.i64()?;
            if count < 0 {
                return Err(DecodeError::NegativeCount {
                    what: "pair",
                    count,
                }
                .into());
            }
            if count as u64 > l.max_keys {
                return Err(DecodeError::TooMany {
                    what: "pair",
                    count: count as u64,
                    max: l.max_keys,
                }
                .into());
            }
            let mut pairs = Vec::with_capacity((count as usize).min(64));
            for _ in 0..count {
                pairs.push((key(c)?, value(c)?));
            }
            Request::MultiSet { pairs }
        }
        Command::CancelWait => Request::CancelWait,
        Command::Ping => Request::Ping { nonce: c.u32()? },
        Command::QueuePush => Request::QueuePush {
            key: key(c)?,
            value: value(c)?,
        },
        Command::QueuePop => Request::QueuePop { key: key(c)? },
        Command::QueueLen => Request::QueueLen { key: key(c)? },
        Command::ListKeys => Request::ListKeys,
        Command::Barrier => Request::Barrier {
            key: key(c)?,
            world_size: c.i64()?,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn encoded(r: &Request) -> Vec<u8> {
        let mut v = Vec::new();
        r.encode(&mut v);
        v
    }

    /// Captures from real torch 2.15 traffic (tcpstore-protocol.md §1–2).
    #[test]
    fn byte_exact_against_captured_traffic() {
        let cases: Vec<(Request, &str)> = vec![
            (Request::Validate { magic: 0x3C85F7CE }, "00 ce f7 85 3c"),
            (Request::Ping { nonce: 0x1f4f }, "0d 4f 1f 00 00"),
            (
                Request::Set {
                    key: b"/k1",
                    value: b"v1",
                },
                "01 0300000000000000 2f6b31 0200000000000000 7631",
            ),
            (
                Request::Wait { keys: vec![b"/k1"] },
                "06 0100000000000000 0300000000000000 2f6b31",
            ),
            (Request::Get { key: b"/k1" }, "03 0300000000000000 2f6b31"),
            (
                Request::Add {
                    key: b"/cnt",
                    delta: -2,
                },
                "04 0400000000000000 2f636e74 feffffffffffffff",
            ),
            (Request::GetNumKeys, "07"),
            (Request::CancelWait, "0c"),
            (Request::ListKeys, "11"),
            (
                Request::Barrier {
                    key: b"/bar",
                    world_size: 1,
                },
                "12 0400000000000000 2f626172 0100000000000000",
            ),
        ];
        for (req, wire) in cases {
            let bytes = hex(wire);
            assert_eq!(encoded(&req), bytes, "encoding {req:?}");
            assert_eq!(
                decode_request(&bytes, &Limits::default()).unwrap(),
                Decoded::Complete(req, bytes.len())
            );
        }
    }

    #[test]
    fn every_prefix_of_a_request_is_incomplete() {
        let req = Request::CompareSet {
            key: b"/key",
            expected: b"old",
            desired: b"new value",
        };
        let bytes = encoded(&req);
        for cut in 0..bytes.len() {
            match decode_request(&bytes[..cut], &Limits::default()).unwrap() {
                Decoded::Incomplete { needed } => assert!(needed > cut && needed <= bytes.len()),
                other => panic!("cut at {cut}: {other:?}"),
            }
        }
    }

    #[test]
    fn rejects_unknown_commands_and_oversized_fields_early() {
        let l = Limits::default();
        assert_eq!(
            decode_request(&[19], &l),
            Err(DecodeError::UnknownCommand(19))
        );
        assert_eq!(
            decode_request(&[0xff], &l),
            Err(DecodeError::UnknownCommand(0xff))
        );
        // A 9001-byte key is refused from its length field alone.
        let mut b = vec![Command::Get as u8];
        b.extend_from_slice(&9001u64.to_le_bytes());
        assert!(matches!(
            decode_request(&b, &l),
            Err(DecodeError::TooLong {
                what: "key",
                len: 9001,
                ..
            })
        ));
        // A 9 MiB value likewise.
        let mut b = vec![Command::Set as u8];
        put_str(&mut b, b"/k");
        b.extend_from_slice(&(9u64 << 20).to_le_bytes());
        assert!(matches!(
            decode_request(&b, &l),
            Err(DecodeError::TooLong { what: "value", .. })
        ));
        // Absurd counts.
        let mut b = vec![Command::Wait as u8];
        b.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            decode_request(&b, &l),
            Err(DecodeError::TooMany { .. })
        ));
        let mut b = vec![Command::MultiSet as u8];
        b.extend_from_slice(&(-1i64).to_le_bytes());
        assert!(matches!(
            decode_request(&b, &l),
            Err(DecodeError::NegativeCount { .. })
        ));
    }

    #[test]
    fn pipelined_requests_decode_one_after_another() {
        let a = Request::Set {
            key: b"/a",
            value: b"1",
        };
        let b = Request::Wait {
            keys: vec![b"/a", b"/b"],
        };
        let mut bytes = encoded(&a);
        bytes.extend(encoded(&b));
        let l = Limits::default();
        let Decoded::Complete(first, n) = decode_request(&bytes, &l).unwrap() else {
            panic!()
        };
        assert_eq!(first, a);
        assert_eq!(
            decode_request(&bytes[n..], &l).unwrap(),
            Decoded::Complete(b, bytes.len() - n)
        );
    }

    fn bytes_strategy(max: usize) -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec(any::<u8>(), 0..max)
    }

    /// Owned form of a request, for generating arbitrary ones.
    #[derive(Debug, Clone)]
    enum Owned {
        Validate(u32),
        Set(Vec<u8>, Vec<u8>),
        CompareSet(Vec<u8>, Vec<u8>, Vec<u8>),
        Get(Vec<u8>),
        Add(Vec<u8>, i64),
        Check(Vec<Vec<u8>>),
        Wait(Vec<Vec<u8>>),
        MultiGet(Vec<Vec<u8>>),
        MultiSet(Vec<(Vec<u8>, Vec<u8>)>),
        Ping(u32),
        QueuePop(Vec<u8>),
        Barrier(Vec<u8>, i64),
        Bare(u8),
    }

    impl Owned {
        fn borrow(&self) -> Request<'_> {
            fn ks(v: &[Vec<u8>]) -> Vec<&[u8]> {
                v.iter().map(Vec::as_slice).collect()
            }
            match self {
                Owned::Validate(m) => Request::Validate { magic: *m },
                Owned::Set(k, v) => Request::Set { key: k, value: v },
                Owned::CompareSet(k, e, d) => Request::CompareSet {
                    key: k,
                    expected: e,
                    desired: d,
                },
                Owned::Get(k) => Request::Get { key: k },
                Owned::Add(k, d) => Request::Add { key: k, delta: *d },
                Owned::Check(k) => Request::Check { keys: ks(k) },
                Owned::Wait(k) => Request::Wait { keys: ks(k) },
                Owned::MultiGet(k) => Request::MultiGet { keys: ks(k) },
                Owned::MultiSet(p) => Request::MultiSet {
                    pairs: p
                        .iter()
                        .map(|(k, v)| (k.as_slice(), v.as_slice()))
                        .collect(),
                },
                Owned::Ping(n) => Request::Ping { nonce: *n },
                Owned::QueuePop(k) => Request::QueuePop { key: k },
                Owned::Barrier(k, w) => Request::Barrier {
                    key: k,
                    world_size: *w,
                },
                Owned::Bare(0) => Request::GetNumKeys,
                Owned::Bare(1) => Request::CancelWait,
                Owned::Bare(_) => Request::ListKeys,
            }
        }
    }

    fn request_strategy() -> impl Strategy<Value = Owned> {
        let k = || bytes_strategy(24);
        prop_oneof![
            any::<u32>().prop_map(Owned::Validate),
            (k(), bytes_strategy(300)).prop_map(|(a, b)| Owned::Set(a, b)),
            (k(), k(), k()).prop_map(|(a, b, c)| Owned::CompareSet(a, b, c)),
            k().prop_map(Owned::Get),
            (k(), any::<i64>()).prop_map(|(a, b)| Owned::Add(a, b)),
            proptest::collection::vec(k(), 0..5).prop_map(Owned::Check),
            proptest::collection::vec(k(), 0..5).prop_map(Owned::Wait),
            proptest::collection::vec(k(), 0..5).prop_map(Owned::MultiGet),
            proptest::collection::vec((k(), k()), 0..5).prop_map(Owned::MultiSet),
            any::<u32>().prop_map(Owned::Ping),
            k().prop_map(Owned::QueuePop),
            (k(), any::<i64>()).prop_map(|(a, b)| Owned::Barrier(a, b)),
            (0u8..3).prop_map(Owned::Bare),
        ]
    }

    proptest! {
        #[test]
        fn encode_then_decode_round_trips(reqs in proptest::collection::vec(request_strategy(), 1..6)) {
            let mut bytes = Vec::new();
            for r in &reqs { r.borrow().encode(&mut bytes); }
            let l = Limits::default();
            let mut at = 0;
            for r in &reqs {
                match decode_request(&bytes[at..], &l).unwrap() {
                    Decoded::Complete(got, n) => { prop_assert_eq!(got, r.borrow()); at += n; }
                    other => prop_assert!(false, "{:?}", other),
                }
            }
            prop_assert_eq!(at, bytes.len());
        }

        /// Arbitrary bytes never panic, and a complete decode never claims more
        /// bytes than it was given; an incomplete one asks for more than it has.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in bytes_strategy(200)) {
            let l = Limits { max_key_len: 64, max_value_len: 128, max_keys: 8 };
            match decode_request(&bytes, &l) {
                Ok(Decoded::Complete(_, n)) => prop_assert!(n >= 1 && n <= bytes.len()),
                Ok(Decoded::Incomplete { needed }) => prop_assert!(needed > bytes.len()),
                Err(_) => {}
            }
        }

        /// Splitting a stream anywhere gives the same requests as decoding it whole.
        #[test]
        fn any_truncation_is_incomplete_not_invalid(r in request_strategy(), frac in 0.0f64..1.0) {
            let mut bytes = Vec::new();
            r.borrow().encode(&mut bytes);
            let cut = ((bytes.len() as f64) * frac) as usize;
            if cut < bytes.len() {
                let got = decode_request(&bytes[..cut], &Limits::default()).unwrap();
                let is_incomplete = matches!(got, Decoded::Incomplete { .. });
                prop_assert!(is_incomplete);
            }
        }
    }
}
