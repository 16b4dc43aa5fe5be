//! What a side of the handshake asks its transport to do next, and how far a read has got.

use std::fmt;

/// One of the handshake's messages, named as the protocol's docs name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Message {
    /// The client's first message.
    Hello,
    /// The server's answer to it (a challenge, or a wrong-service refusal).
    Challenge,
    /// The client's proof.
    Proof,
    /// The server's verdict.
    Verdict,
}

impl fmt::Display for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Message::Hello => "HELLO",
            Message::Challenge => "CHALLENGE",
            Message::Proof => "PROOF",
            Message::Verdict => "VERDICT",
        })
    }
}

/// How much of the peer's next message has arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// The message awaited.
    pub message: Message,
    /// Its bytes received so far.
    pub got: usize,
    /// Its length as far as known.
    pub need: usize,
    /// Whether `need` is its length (else a lower bound: its length byte has not arrived).
    pub exact: bool,
}

impl Progress {
    /// How many bytes to read at most: reading no more than this never takes a byte past the
    /// handshake, so the service's own protocol starts at the next byte of the stream.
    pub fn missing(&self) -> usize {
        self.need - self.got
    }
}

impl fmt::Display for Progress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let at_least = if self.exact { "" } else { "at least " };
        write!(
            f,
            "waiting for its {}: got {} of {at_least}{} bytes",
            self.message, self.got, self.need
        )
    }
}

/// The next thing a side of the handshake needs done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Write these bytes to the peer, then ask again.
    Write {
        /// Which message they are.
        message: Message,
        /// Its bytes.
        bytes: Vec<u8>,
    },
    /// Read at most [`Progress::missing`] bytes, hand them to `receive`, then ask again.
    Read(Progress),
    /// The handshake succeeded: the connection carries the service's protocol from here.
    Done,
}
