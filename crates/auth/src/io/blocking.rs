//! The handshake over a blocking stream (`std::net::TcpStream`, `UnixStream`), with a deadline.
//!
//! Each read and write is given the time left to the deadline as the socket's timeout, and a
//! wake-up before the deadline (a signal, a short timeout) reads again: the handshake fails
//! with [`TransportError::TimedOut`] only once the deadline has passed. The stream's own
//! timeouts are put back afterwards. The stream must be in blocking mode.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use super::{client_error, failed, refusal, DriveError, Machine, READ_BUF};
use crate::failure::{ClientError, TransportError, Waiting};
use crate::handshake::{ClientHandshake, Message, Progress, ServerHandshake, Service, Step};
use crate::metrics::Refusal;
use crate::secret::JobSecret;

/// A blocking stream whose reads and writes can be given timeouts.
pub trait TimeoutStream: Read + Write {
    /// Its read and write timeouts.
    fn timeouts(&self) -> io::Result<(Option<Duration>, Option<Duration>)>;
    /// Sets its read timeout.
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    /// Sets its write timeout.
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
}

macro_rules! timeout_stream {
    ($t:ty) => {
        impl TimeoutStream for $t {
            fn timeouts(&self) -> io::Result<(Option<Duration>, Option<Duration>)> {
                Ok((<$t>::read_timeout(self)?, <$t>::write_timeout(self)?))
            }
            fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
                <$t>::set_read_timeout(self, timeout)
            }
            fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
                <$t>::set_write_timeout(self, timeout)
            }
        }
    };
}

timeout_stream!(TcpStream);
timeout_stream!(UnixStream);

/// Runs the server's side of the handshake for `service` with the client at `peer` (which
/// names it in the refusal), until `deadline`. `Ok` admits it: its next byte is the service's.
pub fn server_handshake<S: TimeoutStream>(
    stream: &mut S,
    peer: SocketAddr,
    secret: &JobSecret,
    service: Service,
    deadline: Instant,
) -> Result<(), Refusal> {
    let result = ServerHandshake::new(secret, service)
        .map_err(|e| DriveError::Transport(e.into()))
        .and_then(|mut machine| drive(stream, &mut machine, deadline));
    result.map_err(|e| refusal(peer, e))
}

/// Runs the client's side of the handshake with `service` at `server` (which names it in the
/// error), until `deadline`. `Ok`: admitted, the next byte is the service's.
pub fn client_handshake<S: TimeoutStream>(
    stream: &mut S,
    server: SocketAddr,
    secret: &JobSecret,
    service: Service,
    deadline: Instant,
) -> Result<(), ClientError> {
    let result = ClientHandshake::new(secret, service)
        .map_err(|e| DriveError::Transport(e.into()))
        .and_then(|mut machine| drive(stream, &mut machine, deadline));
    result.map_err(|e| client_error(server, e))
}

fn drive<S: TimeoutStream, M: Machine>(
    stream: &mut S,
    machine: &mut M,
    deadline: Instant,
) -> Result<(), DriveError<M::Error>> {
    let clock = Clock {
        deadline,
        within: deadline.saturating_duration_since(Instant::now()),
    };
    let setup = Waiting::SocketSetup;
    let saved = stream.timeouts().map_err(|e| clock.io(setup, e))?;
    let result = run(stream, machine, &clock);
    let restored = stream
        .set_read_timeout(saved.0)
        .and_then(|()| stream.set_write_timeout(saved.1));
    match (result, restored) {
        (Ok(()), Err(e)) => Err(clock.io(setup, e).into()),
        (result, _) => result,
    }
}

fn run<S: TimeoutStream, M: Machine>(
    stream: &mut S,
    machine: &mut M,
    clock: &Clock,
) -> Result<(), DriveError<M::Error>> {
    let mut buf = [0; READ_BUF];
    loop {
        match machine.step().map_err(DriveError::Machine)? {
            Step::Done => return Ok(()),
            Step::Write { message, bytes } => write_all(stream, message, &bytes, clock)?,
            Step::Read(progress) => {
                let room = progress.missing().min(buf.len());
                let n = read_some(stream, &mut buf[..room], progress, clock)?;
                machine.receive(&buf[..n]);
            }
        }
    }
}

/// The deadline, and the span it gives (for the error's text).
struct Clock {
    deadline: Instant,
    within: Duration,
}

impl Clock {
    /// The time left, or the timeout error.
    fn left(&self, waiting: Waiting) -> Result<Duration, TransportError> {
        match self.deadline.checked_duration_since(Instant::now()) {
            Some(left) if !left.is_zero() => Ok(left),
            _ => Err(TransportError::TimedOut {
                waiting,
                within: self.within,
            }),
        }
    }

    fn io(&self, waiting: Waiting, source: io::Error) -> TransportError {
        failed(waiting, source)
    }
}

/// Whether an error is a socket timeout (or a signal): try again while time is left.
fn is_retry(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

fn read_some<S: TimeoutStream>(
    stream: &mut S,
    buf: &mut [u8],
    progress: Progress,
    clock: &Clock,
) -> Result<usize, TransportError> {
    let waiting = Waiting::Receiving(progress);
    loop {
        let left = clock.left(waiting)?;
        stream
            .set_read_timeout(Some(left))
            .map_err(|e| clock.io(waiting, e))?;
        match stream.read(buf) {
            Ok(0) => return Err(TransportError::Closed { waiting }),
            Ok(n) => return Ok(n),
            Err(e) if is_retry(&e) => continue,
            Err(e) => return Err(clock.io(waiting, e)),
        }
    }
}

fn write_all<S: TimeoutStream>(
    stream: &mut S,
    message: Message,
    bytes: &[u8],
    clock: &Clock,
) -> Result<(), TransportError> {
    let mut sent = 0;
    let waiting = |sent| Waiting::Sending {
        message,
        sent,
        total: bytes.len(),
    };
    while sent < bytes.len() {
        let left = clock.left(waiting(sent))?;
        stream
            .set_write_timeout(Some(left))
            .map_err(|e| clock.io(waiting(sent), e))?;
        match stream.write(&bytes[sent..]) {
            Ok(0) => {
                return Err(TransportError::Closed {
                    waiting: waiting(sent),
                })
            }
            Ok(n) => sent += n,
            Err(e) if is_retry(&e) => continue,
            Err(e) => return Err(clock.io(waiting(sent), e)),
        }
    }
    stream.flush().map_err(|e| clock.io(waiting(sent), e))
}
