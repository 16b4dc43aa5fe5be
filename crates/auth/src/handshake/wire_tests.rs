use proptest::prelude::*;

use super::*;

fn hello() -> Hello {
    Hello {
        label: "store".into(),
        nonce: std::array::from_fn(|i| i as u8),
    }
}

fn challenge() -> Reply {
    Reply::Challenge {
        nonce: [0xaa; NONCE_LEN],
        proof: [0xbb; PROOF_LEN],
        key_id: KeyId([1, 2, 3, 4]),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn messages_are_byte_exact() {
    let h = hello().encode();
    assert_eq!(
        hex(&h),
        format!(
            "{}05{}{}",
            hex(b"RALLYAU1"),
            hex(b"store"),
            hex(&hello().nonce)
        )
    );
    let c = challenge().encode();
    assert_eq!(c.len(), CHALLENGE_LEN);
    assert_eq!(
        hex(&c),
        format!(
            "{}00{}{}01020304",
            hex(MAGIC),
            "aa".repeat(32),
            "bb".repeat(32)
        )
    );
    let w = Reply::WrongService {
        label: "rpc".into(),
    }
    .encode();
    assert_eq!(hex(&w), format!("{}0103{}", hex(MAGIC), hex(b"rpc")));
    let p = Proof {
        proof: [0xcc; PROOF_LEN],
        key_id: KeyId([9, 8, 7, 6]),
    };
    assert_eq!(hex(&p.encode()), format!("{}09080706", "cc".repeat(32)));
    assert_eq!(Verdict::Admitted.encode(), [0]);
    assert_eq!(Verdict::Refused.encode(), [1]);
}

/// Every proper prefix of `bytes` decodes as incomplete, needing more than it has and no more
/// than the whole; the whole decodes to `expected`, taking all of it.
fn check_prefixes<T: PartialEq + std::fmt::Debug>(
    bytes: &[u8],
    decode: fn(&[u8]) -> Result<Frame<T>, DecodeError>,
    expected: T,
) {
    for k in 0..bytes.len() {
        match decode(&bytes[..k]) {
            Ok(Frame::Incomplete { need, exact }) => {
                assert!(need > k && need <= bytes.len(), "prefix {k}: need {need}");
                assert!(!exact || need == bytes.len(), "prefix {k}: exact {need}");
            }
            other => panic!("prefix {k} of {}: {other:?}", bytes.len()),
        }
    }
    assert_eq!(decode(bytes), Ok(Frame::Complete(expected, bytes.len())));
    // Bytes after a message are not its own.
    let mut more = bytes.to_vec();
    more.extend_from_slice(b"next");
    assert!(matches!(decode(&more), Ok(Frame::Complete(_, n)) if n == bytes.len()));
}

#[test]
fn every_prefix_of_every_message_is_incomplete() {
    check_prefixes(&hello().encode(), Hello::decode, hello());
    check_prefixes(&challenge().encode(), Reply::decode, challenge());
    let wrong = Reply::WrongService {
        label: "lighthouse".into(),
    };
    check_prefixes(&wrong.encode(), Reply::decode, wrong);
    let proof = Proof {
        proof: [3; PROOF_LEN],
        key_id: KeyId([0; 4]),
    };
    check_prefixes(&proof.encode(), Proof::decode, proof);
    check_prefixes(
        &Verdict::Refused.encode(),
        Verdict::decode,
        Verdict::Refused,
    );
}

#[test]
fn pytorch_tcpstore_and_http_are_invalid_at_their_first_byte() {
    // PyTorch's TCPStore client opens with VALIDATE: command 0, then the magic 0x3C85F7CE (LE).
    let tcpstore = [0x00, 0xce, 0xf7, 0x85, 0x3c];
    let http = b"GET / HTTP/1.1\r\nHost: 10.0.0.1\r\n\r\n";
    for bytes in [&tcpstore[..], &http[..]] {
        for k in 1..=bytes.len() {
            assert!(
                matches!(
                    Hello::decode(&bytes[..k]),
                    Err(DecodeError::BadMagic { .. })
                ),
                "{k}"
            );
            assert!(matches!(
                Reply::decode(&bytes[..k]),
                Err(DecodeError::BadMagic { .. })
            ));
        }
    }
    let e = Hello::decode(&tcpstore).unwrap_err().to_string();
    assert!(e.contains(r#""\x00\xce\xf7\x85<""#), "{e}");
    assert!(e.contains("TCPStore"), "{e}");
    let e = Hello::decode(http).unwrap_err().to_string();
    assert!(e.contains(r#""GET / HTTP/1.1\r\n""#), "{e}");
    assert!(e.contains("an HTTP request?"), "{e}");
}

#[test]
fn bad_lengths_labels_kinds_and_verdicts_are_invalid() {
    let mut h = hello().encode();
    h[8] = 0;
    assert_eq!(Hello::decode(&h), Err(DecodeError::BadLabelLength(0)));
    h[8] = 33;
    assert_eq!(Hello::decode(&h), Err(DecodeError::BadLabelLength(33)));
    // A bad label byte is found as soon as it arrives, before the nonce.
    let mut h = hello().encode();
    h[10] = b'T';
    assert_eq!(
        Hello::decode(&h[..11]),
        Err(DecodeError::BadLabel(b"sT".to_vec()))
    );
    let mut c = challenge().encode();
    c[8] = 2;
    assert_eq!(Reply::decode(&c[..9]), Err(DecodeError::BadReplyKind(2)));
    assert_eq!(Verdict::decode(&[2]), Err(DecodeError::BadVerdict(2)));
    assert!(is_valid_label(b"a-b_c.9"));
    assert!(!is_valid_label(b""));
    assert!(!is_valid_label(&[b'a'; 33]));
    assert!(is_valid_label(&[b'a'; 32]));
}

/// A decoder's answer to arbitrary bytes is sane: what it takes is within them and encodes
/// back to the same bytes; what it needs is more than it has.
fn check_arbitrary<T>(
    bytes: &[u8],
    decode: fn(&[u8]) -> Result<Frame<T>, DecodeError>,
    encode: fn(&T) -> Vec<u8>,
) -> Result<(), TestCaseError> {
    match decode(bytes) {
        Ok(Frame::Complete(msg, n)) => {
            prop_assert!(n <= bytes.len());
            prop_assert_eq!(encode(&msg), bytes[..n].to_vec());
        }
        Ok(Frame::Incomplete { need, .. }) => prop_assert!(need > bytes.len()),
        Err(_) => {}
    }
    Ok(())
}

/// Arbitrary bytes, and arbitrary bytes after a valid start (so decoders get past the magic).
fn bytes() -> impl Strategy<Value = Vec<u8>> {
    let tail = proptest::collection::vec(any::<u8>(), 0..100);
    (0..4usize, tail).prop_map(|(start, tail)| {
        let head: &[u8] = match start {
            0 => b"",
            1 => b"RALLYAU1",
            2 => b"RALLYAU1\x00",
            _ => b"RALLYAU1\x01",
        };
        [head, &tail[..]].concat()
    })
}

proptest! {
    #[test]
    fn decoders_never_panic_and_answer_sanely(bytes in bytes()) {
        check_arbitrary(&bytes, Hello::decode, Hello::encode)?;
        check_arbitrary(&bytes, Reply::decode, Reply::encode)?;
        check_arbitrary(&bytes, Proof::decode, Proof::encode)?;
        check_arbitrary(&bytes, Verdict::decode, |v| v.encode())?;
    }

    #[test]
    fn hellos_round_trip(label in "[a-z0-9._-]{1,32}", nonce in any::<[u8; 32]>()) {
        let hello = Hello { label, nonce };
        let bytes = hello.encode();
        prop_assert_eq!(Hello::decode(&bytes), Ok(Frame::Complete(hello, bytes.len())));
    }
}
