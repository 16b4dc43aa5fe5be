//! PyTorch's TCPStore wire protocol, byte for byte.
//!
//! Every connection starts with `VALIDATE` (code 0 and the magic `0x3C85F7CE`,
//! never answered), after which the client sends one request at a time (it may
//! pipeline the commands that have no reply). A request is a command byte followed
//! by its fields; there is no overall length prefix and no request id, so the
//! server decodes incrementally and must tell an *incomplete* request (wait for
//! more bytes) from an *invalid* one (close the connection).
//!
//! Field encodings, all little-endian (PyTorch copies native integers, and every
//! platform it ships on is little-endian):
//!
//! | field | bytes |
//! |---|---|
//! | command | `u8` |
//! | string (key or value) | `u64` length, then the raw bytes |
//! | key count (CHECK, WAIT, MULTI_GET) | `u64` |
//! | pair count (MULTI_SET) | `i64` |
//! | counter delta, world size | `i64` |
//! | magic, ping nonce | `u32` |
//!
//! [`request`] holds the request type with its decoder (server side) and encoder
//! (client side); [`reply`] the reply encoders (server side) and the decoder the
//! client uses. Both decoders are pure functions over a byte slice, property-tested
//! and fuzzed (`fuzz/`), and never allocate more than the bytes in hand justify.

pub mod reply;
pub mod request;

pub use reply::{decode_reply, Reply, ReplyKind};
pub use request::{decode_request, Request};

/// The magic that follows the `VALIDATE` command byte.
pub const VALIDATE_MAGIC: u32 = 0x3C85_F7CE;

/// `CHECK` reply: every key exists.
pub const CHECK_READY: u8 = 0;
/// `CHECK` reply: some key is missing.
pub const CHECK_NOT_READY: u8 = 1;
/// `WAIT` / `BARRIER` reply: the awaited keys exist (or the barrier filled).
pub const STOP_WAITING: u8 = 0;
/// `CANCEL_WAIT` reply: the connection's pending waits are gone.
pub const WAIT_CANCELED: u8 = 1;

/// The key PyTorch clients `ADD` to when they are built with a world size. It is the
/// only key a PyTorch client sends without a leading `/`.
pub const WORKER_COUNT_KEY: &str = "init/";

/// Command codes. New codes are only ever appended upstream, so these are stable
/// from PyTorch 2.2 on (see `tcpstore-protocol.md` §0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Command {
    Validate = 0,
    Set = 1,
    CompareSet = 2,
    Get = 3,
    Add = 4,
    Check = 5,
    Wait = 6,
    GetNumKeys = 7,
    DeleteKey = 8,
    Append = 9,
    MultiGet = 10,
    MultiSet = 11,
    CancelWait = 12,
    Ping = 13,
    QueuePush = 14,
    QueuePop = 15,
    QueueLen = 16,
    ListKeys = 17,
    Barrier = 18,
}

impl Command {
    /// Every command, in code order.
    pub const ALL: [Command; 19] = [
        Command::Validate,
        Command::Set,
        Command::CompareSet,
        Command::Get,
        Command::Add,
        Command::Check,
        Command::Wait,
        Command::GetNumKeys,
        Command::DeleteKey,
        Command::Append,
        Command::MultiGet,
        Command::MultiSet,
        Command::CancelWait,
        Command::Ping,
        Command::QueuePush,
        Command::QueuePop,
        Command::QueueLen,
        Command::ListKeys,
        Command::Barrier,
    ];

    /// The command for a code byte, if it is one.
    pub fn from_code(code: u8) -> Option<Command> {
        Command::ALL.get(usize::from(code)).copied()
    }

    /// PyTorch's upper-case name, for logs and errors.
    pub fn name(self) -> &'static str {
        match self {
            Command::Validate => "VALIDATE",
            Command::Set => "SET",
            Command::CompareSet => "COMPARE_SET",
            Command::Get => "GET",
            Command::Add => "ADD",
            Command::Check => "CHECK",
            Command::Wait => "WAIT",
            Command::GetNumKeys => "GETNUMKEYS",
            Command::DeleteKey => "DELETE_KEY",
            Command::Append => "APPEND",
            Command::MultiGet => "MULTI_GET",
            Command::MultiSet => "MULTI_SET",
            Command::CancelWait => "CANCEL_WAIT",
            Command::Ping => "PING",
            Command::QueuePush => "QUEUE_PUSH",
            Command::QueuePop => "QUEUE_POP",
            Command::QueueLen => "QUEUE_LEN",
            Command::ListKeys => "LIST_KEYS",
            Command::Barrier => "BARRIER",
        }
    }
}

/// Size limits a decoder enforces before it buffers anything. The defaults are the
/// libuv server's, so anything a PyTorch user does today fits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest key, in bytes.
    pub max_key_len: u64,
    /// Longest value, in bytes (also the longest a value may grow to by APPEND).
    pub max_value_len: u64,
    /// Most keys in one CHECK, WAIT, MULTI_GET or MULTI_SET.
    pub max_keys: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_key_len: 8 * 1024,
            max_value_len: 8 * 1024 * 1024,
            max_keys: 128 * 1024,
        }
    }
}

/// Why bytes could not be decoded. Messages read well after "failed to decode:".
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("unknown command code {0}")]
    UnknownCommand(u8),
    #[error("{what} is {len} bytes, over the limit of {max}")]
    TooLong {
        what: &'static str,
        len: u64,
        max: u64,
    },
    #[error("{what} count {count} is over the limit of {max}")]
    TooMany {
        what: &'static str,
        count: u64,
        max: u64,
    },
    #[error("{what} count {count} is negative")]
    NegativeCount { what: &'static str, count: i64 },
}

/// Outcome of decoding from a buffer that may hold a partial message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded<T> {
    /// A whole message, and how many bytes it took.
    Complete(T, usize),
    /// More bytes are needed: at least `needed` in total (a hint that lets the
    /// caller skip re-decoding until that many have arrived).
    Incomplete { needed: usize },
}

/// A little-endian reader over a byte slice that reports *where* it ran out.
pub(crate) struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// Why a [`Cursor`] read stopped.
pub(crate) enum Stop {
    /// The buffer ends before the field does; the total bytes needed is a lower bound.
    Short(usize),
    Invalid(DecodeError),
}

impl From<DecodeError> for Stop {
    fn from(e: DecodeError) -> Self {
        Stop::Invalid(e)
    }
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Cursor { buf, pos: 0 }
    }

    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], Stop> {
        let end = self.pos.saturating_add(n);
        if end > self.buf.len() {
            return Err(Stop::Short(end));
        }
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], Stop> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    pub(crate) fn u8(&mut self) -> Result<u8, Stop> {
        Ok(self.array::<1>()?[0])
    }

    pub(crate) fn u32(&mut self) -> Result<u32, Stop> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    pub(crate) fn u64(&mut self) -> Result<u64, Stop> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    pub(crate) fn i64(&mut self) -> Result<i64, Stop> {
        Ok(i64::from_le_bytes(self.array()?))
    }

    /// A length-prefixed string of at most `max` bytes. The limit is checked on the
    /// length field, before waiting for (or buffering) the bytes themselves.
    pub(crate) fn str(&mut self, what: &'static str, max: u64) -> Result<&'a [u8], Stop> {
        let len = self.u64()?;
        if len > max {
            return Err(DecodeError::TooLong { what, len, max }.into());
        }
        // `len <= max`, and every limit fits comfortably in usize.
        self.take(len as usize)
    }

    /// A `u64` count of at most `max`.
    pub(crate) fn count(&mut self, what: &'static str, max: u64) -> Result<usize, Stop> {
        let count = self.u64()?;
        if count > max {
            return Err(DecodeError::TooMany { what, count, max }.into());
        }
        Ok(count as usize)
    }
}

/// Runs a decoder body over a cursor and turns its outcome into a [`Decoded`].
pub(crate) fn run_decoder<'a, T>(
    buf: &'a [u8],
    body: impl FnOnce(&mut Cursor<'a>) -> Result<T, Stop>,
) -> Result<Decoded<T>, DecodeError> {
    let mut cur = Cursor::new(buf);
    match body(&mut cur) {
        Ok(v) => Ok(Decoded::Complete(v, cur.pos())),
        Err(Stop::Short(needed)) => Ok(Decoded::Incomplete { needed }),
        Err(Stop::Invalid(e)) => Err(e),
    }
}

/// Appends a length-prefixed string.
pub(crate) fn put_str(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s);
}
