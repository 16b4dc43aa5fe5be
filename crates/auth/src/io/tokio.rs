//! The handshake over a tokio stream (`AsyncRead + AsyncWrite + Unpin`), with a deadline.
//!
//! Each read and write runs under `tokio::time::timeout_at` the deadline, so a peer that stalls
//! costs its task nothing but a timer. Cancelling the future (dropping it) stops the handshake
//! where it is; the stream is then of no use.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ::tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use ::tokio::time::{timeout_at, Instant as TokioInstant};

use super::{client_error, failed, refusal, DriveError, Machine, READ_BUF};
use crate::failure::{ClientError, TransportError, Waiting};
use crate::handshake::{ClientHandshake, Message, Progress, ServerHandshake, Service, Step};
use crate::metrics::Refusal;
use crate::secret::JobSecret;

/// Runs the server's side of the handshake for `service` with the client at `peer` (which
/// names it in the refusal), until `deadline`. `Ok` admits it: its next byte is the service's.
pub async fn server_handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    peer: SocketAddr,
    secret: &JobSecret,
    service: Service,
    deadline: Instant,
) -> Result<(), Refusal> {
    let result = match ServerHandshake::new(secret, service) {
        Ok(mut machine) => drive(stream, &mut machine, deadline).await,
        Err(e) => Err(DriveError::Transport(e.into())),
    };
    result.map_err(|e| refusal(peer, e))
}

/// Runs the client's side of the handshake with `service` at `server` (which names it in the
/// error), until `deadline`. `Ok`: admitted, the next byte is the service's.
pub async fn client_handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    server: SocketAddr,
    secret: &JobSecret,
    service: Service,
    deadline: Instant,
) -> Result<(), ClientError> {
    let result = match ClientHandshake::new(secret, service) {
        Ok(mut machine) => drive(stream, &mut machine, deadline).await,
        Err(e) => Err(DriveError::Transport(e.into())),
    };
    result.map_err(|e| client_error(server, e))
}

async fn drive<S: AsyncRead + AsyncWrite + Unpin, M: Machine>(
    stream: &mut S,
    machine: &mut M,
    deadline: Instant,
) -> Result<(), DriveError<M::Error>> {
    let clock = Clock {
        deadline: TokioInstant::from_std(deadline),
        within: deadline.saturating_duration_since(Instant::now()),
    };
    let mut buf = [0; READ_BUF];
    loop {
        match machine.step().map_err(DriveError::Machine)? {
            Step::Done => return Ok(()),
            Step::Write { message, bytes } => write_all(stream, message, &bytes, &clock).await?,
            Step::Read(progress) => {
                let room = progress.missing().min(buf.len());
                let n = read_some(stream, &mut buf[..room], progress, &clock).await?;
                machine.receive(&buf[..n]);
            }
        }
    }
}

struct Clock {
    deadline: TokioInstant,
    within: Duration,
}

impl Clock {
    fn timed_out(&self, waiting: Waiting) -> TransportError {
        TransportError::TimedOut {
            waiting,
            within: self.within,
        }
    }
}

async fn read_some<S: AsyncRead + Unpin>(
    stream: &mut S,
    buf: &mut [u8],
    progress: Progress,
    clock: &Clock,
) -> Result<usize, TransportError> {
    let waiting = Waiting::Receiving(progress);
    match timeout_at(clock.deadline, stream.read(buf)).await {
        Err(_elapsed) => Err(clock.timed_out(waiting)),
        Ok(Ok(0)) => Err(TransportError::Closed { waiting }),
        Ok(Ok(n)) => Ok(n),
        Ok(Err(source)) => Err(failed(waiting, source)),
    }
}

async fn write_all<S: AsyncWrite + Unpin>(
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
        match timeout_at(clock.deadline, stream.write(&bytes[sent..])).await {
            Err(_elapsed) => return Err(clock.timed_out(waiting(sent))),
            Ok(Ok(0)) => {
                return Err(TransportError::Closed {
                    waiting: waiting(sent),
                })
            }
            Ok(Ok(n)) => sent += n,
            Ok(Err(source)) => return Err(failed(waiting(sent), source)),
        }
    }
    match timeout_at(clock.deadline, stream.flush()).await {
        Err(_elapsed) => Err(clock.timed_out(waiting(sent))),
        Ok(Ok(())) => Ok(()),
        Ok(Err(source)) => Err(failed(waiting(sent), source)),
    }
}
