//! The handshake's four messages: their bytes, encoders and decoders, with no I/O.
//!
//! ```text
//! HELLO      client -> server   MAGIC (8) | label length L (u8, 1..=32) | label (L) | Nc (32)
//! REPLY      server -> client   MAGIC (8) | kind (u8) | body
//!              kind 0 CHALLENGE      Ns (32) | Ps (32) | server key id (4)     77 bytes in all
//!              kind 1 WRONG SERVICE  label length L (u8) | the server's label (L)
//! PROOF      client -> server   Pc (32) | client key id (4)                    36 bytes
//! VERDICT    server -> client   0 = admitted, 1 = refused                       1 byte
//! ```
//!
//! A label is 1 to 32 bytes of `a-z 0-9 . _ -`. Every decoder takes the bytes received so far
//! and answers [`Frame::Incomplete`] with the length the message needs (exact, or a lower bound
//! until its length byte has arrived), [`Frame::Complete`] with the message and the bytes it
//! took, or a [`DecodeError`] as soon as a byte cannot be ours: the magic is checked byte by
//! byte, so a peer speaking another protocol (PyTorch's TCPStore client begins with `00`, an HTTP
//! request with `GET `) is refused at its first byte, not after a timeout.

use std::fmt;

use crate::secret::{KeyId, KEY_ID_LEN};

/// The first 8 bytes of a HELLO and of the server's REPLY: the protocol and its version.
pub const MAGIC: &[u8; 8] = b"RALLYAU1";
/// The length of a nonce.
pub const NONCE_LEN: usize = 32;
/// The length of a proof (an HMAC-SHA256 tag).
pub const PROOF_LEN: usize = 32;
/// The longest service label.
pub const MAX_LABEL_LEN: usize = 32;
/// The REPLY kind of a CHALLENGE.
pub const KIND_CHALLENGE: u8 = 0;
/// The REPLY kind of a refusal for a service this listener is not.
pub const KIND_WRONG_SERVICE: u8 = 1;
/// The VERDICT that admits the client.
pub const ADMITTED: u8 = 0;
/// The VERDICT that refuses it.
pub const REFUSED: u8 = 1;

/// How many bytes of a stranger's message an error keeps, to be shown in a log line.
pub const SHOWN: usize = 16;

/// The length of a CHALLENGE reply.
pub const CHALLENGE_LEN: usize = MAGIC.len() + 1 + NONCE_LEN + PROOF_LEN + KEY_ID_LEN;
/// The length of a PROOF.
pub const PROOF_MSG_LEN: usize = PROOF_LEN + KEY_ID_LEN;
/// The length of a VERDICT.
pub const VERDICT_LEN: usize = 1;

/// A nonce: 32 bytes from the OS random source, fresh for every handshake.
pub type Nonce = [u8; NONCE_LEN];
/// A proof: an HMAC-SHA256 tag.
pub type Tag = [u8; PROOF_LEN];

/// The client's first message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The service the client means to reach.
    pub label: String,
    /// The client's nonce, Nc.
    pub nonce: Nonce,
}

/// The server's answer to a HELLO.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// The server's nonce and its proof.
    Challenge {
        /// Ns.
        nonce: Nonce,
        /// Ps = HMAC(K, "rally server" | label | Nc | Ns).
        proof: Tag,
        /// The server's key id.
        key_id: KeyId,
    },
    /// The client asked for another service; this one is `label`.
    WrongService {
        /// The server's own label.
        label: String,
    },
}

/// The client's answer to a CHALLENGE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proof {
    /// Pc = HMAC(K, "rally client" | label | Ns | Nc).
    pub proof: Tag,
    /// The client's key id, so that a server can log whose secret differs.
    pub key_id: KeyId,
}

/// The server's last word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The connection may carry the service's own protocol from the next byte.
    Admitted,
    /// The server will close the connection.
    Refused,
}

/// What a decoder made of the bytes so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame<T> {
    /// More bytes are needed: the message is `need` bytes long (at least, unless `exact`).
    Incomplete {
        /// The message's length, as far as is known.
        need: usize,
        /// Whether `need` is its length, not a lower bound.
        exact: bool,
    },
    /// A whole message, and how many bytes it took.
    Complete(T, usize),
}

/// Bytes that are not this handshake.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The first bytes are not [`MAGIC`].
    #[error(
        "its first bytes {} are not the handshake's magic \"RALLYAU1\"{}",
        Escaped(got),
        guess_peer(got)
    )]
    BadMagic {
        /// The bytes received (the first [`SHOWN`] at most).
        got: Vec<u8>,
    },
    /// A label length of 0 or over [`MAX_LABEL_LEN`].
    #[error("its service label length {0} is not in 1..={MAX_LABEL_LEN}")]
    BadLabelLength(u8),
    /// A label with a byte outside `a-z 0-9 . _ -`.
    #[error("its service label {} has bytes outside a-z 0-9 . _ -", Escaped(.0))]
    BadLabel(Vec<u8>),
    /// A REPLY kind other than 0 or 1.
    #[error("its reply kind {0} is neither 0 (challenge) nor 1 (wrong service)")]
    BadReplyKind(u8),
    /// A VERDICT other than 0 or 1.
    #[error("its verdict {0} is neither 0 (admitted) nor 1 (refused)")]
    BadVerdict(u8),
}

/// Whether `label` is a valid service label.
pub const fn is_valid_label(label: &[u8]) -> bool {
    if label.is_empty() || label.len() > MAX_LABEL_LEN {
        return false;
    }
    let mut i = 0;
    while i < label.len() {
        let b = label[i];
        if !(b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'_' || b == b'-') {
            return false;
        }
        i += 1;
    }
    true
}

impl Hello {
    /// Its bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(MAGIC.len() + 1 + self.label.len() + NONCE_LEN);
        out.extend_from_slice(MAGIC);
        put_label(&mut out, &self.label);
        out.extend_from_slice(&self.nonce);
        out
    }

    /// Decodes a HELLO from the start of `buf`.
    pub fn decode(buf: &[u8]) -> Result<Frame<Hello>, DecodeError> {
        let head = MAGIC.len() + 1;
        check_magic(buf)?;
        let Some(&len) = buf.get(MAGIC.len()) else {
            return Ok(incomplete(head, false));
        };
        check_label_len(len)?;
        let need = head + len as usize + NONCE_LEN;
        let label_end = head + len as usize;
        // The label is checked as soon as it has arrived, not once the nonce has.
        let label = &buf[head..buf.len().min(label_end)];
        if !is_valid_label_prefix(label) {
            return Err(DecodeError::BadLabel(label.to_vec()));
        }
        if buf.len() < need {
            return Ok(incomplete(need, true));
        }
        Ok(Frame::Complete(
            Hello {
                label: label_string(label),
                nonce: array(&buf[label_end..need]),
            },
            need,
        ))
    }
}

impl Reply {
    /// Its bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(CHALLENGE_LEN);
        out.extend_from_slice(MAGIC);
        match self {
            Reply::Challenge {
                nonce,
                proof,
                key_id,
            } => {
                out.push(KIND_CHALLENGE);
                out.extend_from_slice(nonce);
                out.extend_from_slice(proof);
                out.extend_from_slice(&key_id.0);
            }
            Reply::WrongService { label } => {
                out.push(KIND_WRONG_SERVICE);
                put_label(&mut out, label);
            }
        }
        out
    }

    /// Decodes a REPLY from the start of `buf`.
    pub fn decode(buf: &[u8]) -> Result<Frame<Reply>, DecodeError> {
        let head = MAGIC.len() + 1;
        check_magic(buf)?;
        match buf.get(MAGIC.len()) {
            None => Ok(incomplete(head, false)),
            Some(&KIND_CHALLENGE) => {
                if buf.len() < CHALLENGE_LEN {
                    return Ok(incomplete(CHALLENGE_LEN, true));
                }
                let body = &buf[head..CHALLENGE_LEN];
                let (nonce, rest) = body.split_at(NONCE_LEN);
                let (proof, key_id) = rest.split_at(PROOF_LEN);
                let reply = Reply::Challenge {
                    nonce: array(nonce),
                    proof: array(proof),
                    key_id: KeyId(array(key_id)),
                };
                Ok(Frame::Complete(reply, CHALLENGE_LEN))
            }
            Some(&KIND_WRONG_SERVICE) => {
                let Some(&len) = buf.get(head) else {
                    return Ok(incomplete(head + 1, false));
                };
                check_label_len(len)?;
                let need = head + 1 + len as usize;
                let label = &buf[head + 1..buf.len().min(need)];
                if !is_valid_label_prefix(label) {
                    return Err(DecodeError::BadLabel(label.to_vec()));
                }
                if buf.len() < need {
                    return Ok(incomplete(need, true));
                }
                let label = label_string(label);
                Ok(Frame::Complete(Reply::WrongService { label }, need))
            }
            Some(&kind) => Err(DecodeError::BadReplyKind(kind)),
        }
    }
}

impl Proof {
    /// Its bytes.
    pub fn encode(&self) -> Vec<u8> {
        [&self.proof[..], &self.key_id.0[..]].concat()
    }

    /// Decodes a PROOF from the start of `buf` (any 36 bytes are a PROOF; whether it is right
    /// is for the server to check).
    pub fn decode(buf: &[u8]) -> Result<Frame<Proof>, DecodeError> {
        if buf.len() < PROOF_MSG_LEN {
            return Ok(incomplete(PROOF_MSG_LEN, true));
        }
        let (proof, key_id) = buf[..PROOF_MSG_LEN].split_at(PROOF_LEN);
        let proof = Proof {
            proof: array(proof),
            key_id: KeyId(array(key_id)),
        };
        Ok(Frame::Complete(proof, PROOF_MSG_LEN))
    }
}

impl Verdict {
    /// Its byte.
    pub fn encode(self) -> Vec<u8> {
        vec![match self {
            Verdict::Admitted => ADMITTED,
            Verdict::Refused => REFUSED,
        }]
    }

    /// Decodes a VERDICT from the start of `buf`.
    pub fn decode(buf: &[u8]) -> Result<Frame<Verdict>, DecodeError> {
        match buf.first() {
            None => Ok(incomplete(VERDICT_LEN, true)),
            Some(&ADMITTED) => Ok(Frame::Complete(Verdict::Admitted, VERDICT_LEN)),
            Some(&REFUSED) => Ok(Frame::Complete(Verdict::Refused, VERDICT_LEN)),
            Some(&other) => Err(DecodeError::BadVerdict(other)),
        }
    }
}

fn incomplete<T>(need: usize, exact: bool) -> Frame<T> {
    Frame::Incomplete { need, exact }
}

fn check_magic(buf: &[u8]) -> Result<(), DecodeError> {
    let n = buf.len().min(MAGIC.len());
    match buf[..n].iter().zip(MAGIC).position(|(a, b)| a != b) {
        Some(_) => Err(DecodeError::BadMagic {
            got: buf[..buf.len().min(SHOWN)].to_vec(),
        }),
        None => Ok(()),
    }
}

fn check_label_len(len: u8) -> Result<(), DecodeError> {
    if len == 0 || len as usize > MAX_LABEL_LEN {
        return Err(DecodeError::BadLabelLength(len));
    }
    Ok(())
}

fn is_valid_label_prefix(label: &[u8]) -> bool {
    label.is_empty() || is_valid_label(label)
}

fn label_string(label: &[u8]) -> String {
    // Checked ASCII by `is_valid_label`.
    label.iter().map(|&b| char::from(b)).collect()
}

fn put_label(out: &mut Vec<u8>, label: &str) {
    // Labels are checked on the way in (`Service`, decoders): at most 32 bytes.
    out.push(label.len() as u8);
    out.extend_from_slice(label.as_bytes());
}

fn array<const N: usize>(bytes: &[u8]) -> [u8; N] {
    let mut out = [0; N];
    out.copy_from_slice(bytes);
    out
}

/// What sort of peer sends these first bytes, if a common one: said in the log line.
fn guess_peer(got: &[u8]) -> &'static str {
    const HTTP: [&[u8]; 6] = [b"GET ", b"POST", b"PUT ", b"HEAD", b"PRI ", b"OPTI"];
    if got.first() == Some(&0) {
        " (PyTorch's TCPStore client sends 00 first: a process without the job secret?)"
    } else if HTTP
        .iter()
        .any(|m| m.starts_with(got) || got.starts_with(m))
        && got.len() >= 2
    {
        " (an HTTP request?)"
    } else if got.starts_with(&[0x16, 0x03]) {
        " (a TLS handshake?)"
    } else {
        ""
    }
}

/// Bytes as a quoted string with everything unprintable escaped.
struct Escaped<'a>(&'a [u8]);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{}\"", self.0.escape_ascii())
    }
}

#[cfg(test)]
#[path = "wire_tests.rs"]
mod tests;
