//! Replies: the server's encoders and the client's decoder.
//!
//! Replies carry no command code: the client knows what it asked and therefore which
//! [`ReplyKind`] to decode. Commands without a reply (VALIDATE, SET, APPEND,
//! MULTI_SET, QUEUE_PUSH) have no kind.

use super::{put_str, run_decoder, Cursor, DecodeError, Decoded, Stop};

/// The shape of the reply to a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyKind {
    /// One byte: CHECK, WAIT, CANCEL_WAIT, BARRIER.
    Byte,
    /// An `i64`: ADD, GETNUMKEYS, DELETE_KEY, QUEUE_LEN.
    Int,
    /// One string: GET, COMPARE_SET.
    Str,
    /// A known number of strings: MULTI_GET.
    Strs(usize),
    /// A `u32`: PING.
    Nonce,
    /// `i64` length before the pop, then a string if it was positive: QUEUE_POP.
    Popped,
    /// `i64` count, then that many strings: LIST_KEYS.
    Keys,
}

/// A decoded reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Byte(u8),
    Int(i64),
    Str(Vec<u8>),
    Strs(Vec<Vec<u8>>),
    Nonce(u32),
    /// `None` when the queue was empty.
    Popped(Option<Vec<u8>>),
    Keys(Vec<Vec<u8>>),
}

/// Decodes one reply of the given kind from the front of `buf`. `max_len` caps any
/// string length the server may claim, so a corrupt length cannot make the client
/// wait for (or allocate) gigabytes.
pub fn decode_reply(
    kind: ReplyKind,
    buf: &[u8],
    max_len: u64,
) -> Result<Decoded<Reply>, DecodeError> {
    run_decoder(buf, |c| {
        let str = |c: &mut Cursor<'_>| c.str("reply string", max_len).map(<[u8]>::to_vec);
        Ok(match kind {
            ReplyKind::Byte => Reply::Byte(c.u8()?),
            ReplyKind::Int => Reply::Int(c.i64()?),
            ReplyKind::Str => Reply::Str(str(c)?),
            ReplyKind::Strs(n) => {
                let mut v = Vec::with_capacity(n.min(1024));
                for _ in 0..n {
                    v.push(str(c)?);
                }
                Reply::Strs(v)
            }
            ReplyKind::Nonce => Reply::Nonce(c.u32()?),
            ReplyKind::Popped => {
                if c.i64()? > 0 {
                    Reply::Popped(Some(str(c)?))
                } else {
                    Reply::Popped(None)
                }
            }
            ReplyKind::Keys => {
                let n = c.i64()?;
                if n < 0 {
                    return Err(Stop::Invalid(DecodeError::NegativeCount {
                        what: "key",
                        count: n,
                    }));
                }
                let mut v = Vec::with_capacity((n as usize).min(1024));
                for _ in 0..n {
                    v.push(str(c)?);
                }
                Reply::Keys(v)
            }
        })
    })
}

/// Appends a one-byte reply.
pub fn put_byte(out: &mut Vec<u8>, b: u8) {
    out.push(b);
}

/// Appends an `i64` reply.
pub fn put_int(out: &mut Vec<u8>, v: i64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends a `u32` reply (the PING echo).
pub fn put_nonce(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends a string reply.
pub fn put_value(out: &mut Vec<u8>, v: &[u8]) {
    put_str(out, v);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn captured_replies_decode() {
        // QUEUE_POP "/q" -> 2, "item1"
        let mut b = Vec::new();
        put_int(&mut b, 2);
        put_value(&mut b, b"item1");
        assert_eq!(
            decode_reply(ReplyKind::Popped, &b, 1 << 20).unwrap(),
            Decoded::Complete(Reply::Popped(Some(b"item1".to_vec())), b.len())
        );
        // Empty queue: just an i64 zero.
        assert_eq!(
            decode_reply(ReplyKind::Popped, &0i64.to_le_bytes(), 1 << 20).unwrap(),
            Decoded::Complete(Reply::Popped(None), 8)
        );
        // An absurd string length is refused, not waited for.
        let b = u64::MAX.to_le_bytes();
        assert!(decode_reply(ReplyKind::Str, &b, 1 << 20).is_err());
        assert!(decode_reply(ReplyKind::Keys, &(-5i64).to_le_bytes(), 1 << 20).is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_reply_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64), k in 0usize..7) {
            let kind = [ReplyKind::Byte, ReplyKind::Int, ReplyKind::Str, ReplyKind::Strs(3),
                        ReplyKind::Nonce, ReplyKind::Popped, ReplyKind::Keys][k];
            match decode_reply(kind, &bytes, 32) {
                Ok(Decoded::Complete(_, n)) => prop_assert!(n <= bytes.len()),
                Ok(Decoded::Incomplete { needed }) => prop_assert!(needed > bytes.len()),
                Err(_) => {}
            }
        }

        #[test]
        fn key_lists_round_trip(keys in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..20), 0..10)) {
            let mut b = Vec::new();
            put_int(&mut b, keys.len() as i64);
            for k in &keys { put_value(&mut b, k); }
            prop_assert_eq!(decode_reply(ReplyKind::Keys, &b, 1 << 20).unwrap(),
                            Decoded::Complete(Reply::Keys(keys), b.len()));
        }
    }
}
