//! The client's side of the handshake, as a machine: bytes in, bytes out, no I/O.
//!
//! It sends a HELLO; checks the server's proof in the CHALLENGE; sends its PROOF; and awaits
//! the VERDICT. A server whose proof is wrong still gets the client's PROOF, so that its own
//! log and counters say a client with a different secret came (this gives a server without
//! the secret nothing it could use: a proof covers the client's fresh nonce, and the only way
//! to use it is on the one connection to a real server whose nonce it carries, which such a
//! server could have relayed anyway); the client then ends at once with
//! [`ServerMismatch::DifferentSecret`], without awaiting the verdict.

use std::fmt;

use super::proof::{client_proof, fresh_nonce, is_server_proof, NonceError};
use super::service::Service;
use super::step::{Message, Progress, Step};
use super::wire::{DecodeError, Frame, Hello, Nonce, Proof, Reply, Verdict};
use crate::secret::{JobSecret, KeyId};

/// Why a client gave up on a server, or was refused by it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerMismatch {
    /// The server's proof is wrong.
    DifferentSecret {
        /// The key id it sent.
        theirs: KeyId,
        /// The client's.
        ours: KeyId,
    },
    /// The server is another service.
    WrongService {
        /// The service the client asked for.
        asked: Service,
        /// The label of the service the server is.
        theirs: String,
    },
    /// The server refused the client's proof.
    Refused,
    /// Its bytes are not this handshake.
    NotOurProtocol(DecodeError),
}

impl fmt::Display for ServerMismatch {
    /// A phrase that follows "the server at ADDR".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ServerMismatch::DifferentSecret { theirs, ours } if theirs == ours => write!(
                f,
                "sent a wrong proof though its key id {theirs} is ours (an impostor replaying a \
                 recorded challenge?)"
            ),
            ServerMismatch::DifferentSecret { theirs, ours } => write!(
                f,
                "holds a different job secret (its key id {theirs}, ours {ours})"
            ),
            ServerMismatch::WrongService { asked, theirs } => {
                write!(
                    f,
                    "is the \"{theirs}\" service, not the \"{asked}\" asked for"
                )
            }
            ServerMismatch::Refused => {
                f.write_str("refused us: its verdict is that our proof of the job secret is wrong")
            }
            ServerMismatch::NotOurProtocol(e) => {
                write!(f, "does not speak the rallypoint job-secret handshake: {e}")
            }
        }
    }
}

impl std::error::Error for ServerMismatch {}

enum State {
    AwaitChallenge,
    AwaitVerdict,
    Finished(Result<(), ServerMismatch>),
}

/// The client's side of one handshake.
pub struct ClientHandshake {
    secret: JobSecret,
    service: Service,
    nc: Nonce,
    buf: Vec<u8>,
    state: State,
    outbox: Option<(Message, Vec<u8>)>,
}

impl ClientHandshake {
    /// A handshake with a `service`, with a fresh client nonce; its first step writes the HELLO.
    pub fn new(secret: &JobSecret, service: Service) -> Result<ClientHandshake, NonceError> {
        Ok(ClientHandshake::with_nonce(secret, service, fresh_nonce()?))
    }

    /// The same with a given nonce: for tests that need one exchange twice.
    pub(crate) fn with_nonce(secret: &JobSecret, service: Service, nc: Nonce) -> ClientHandshake {
        let hello = Hello {
            label: service.label().to_owned(),
            nonce: nc,
        };
        ClientHandshake {
            secret: secret.clone(),
            service,
            nc,
            buf: Vec::new(),
            state: State::AwaitChallenge,
            outbox: Some((Message::Hello, hello.encode())),
        }
    }

    /// Bytes received from the server.
    pub fn receive(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes received past the VERDICT (none, when the transport reads no more than each
    /// [`Step::Read`] asks for): the first bytes of the service's own protocol.
    pub fn leftover(&self) -> &[u8] {
        match self.state {
            State::Finished(_) => &self.buf,
            _ => &[],
        }
    }

    /// What to do next: write, read, or done (admitted). `Err` once the bytes still owed to the
    /// server, if any, have been asked to be written.
    pub fn step(&mut self) -> Result<Step, ServerMismatch> {
        loop {
            if let Some((message, bytes)) = self.outbox.take() {
                return Ok(Step::Write { message, bytes });
            }
            match &self.state {
                State::AwaitChallenge => match Reply::decode(&self.buf) {
                    Err(e) => self.finish(Err(ServerMismatch::NotOurProtocol(e))),
                    Ok(Frame::Incomplete { need, exact }) => {
                        return Ok(self.read(Message::Challenge, need, exact))
                    }
                    Ok(Frame::Complete(reply, n)) => {
                        self.buf.drain(..n);
                        self.on_reply(reply);
                    }
                },
                State::AwaitVerdict => match Verdict::decode(&self.buf) {
                    Err(e) => self.finish(Err(ServerMismatch::NotOurProtocol(e))),
                    Ok(Frame::Incomplete { need, exact }) => {
                        return Ok(self.read(Message::Verdict, need, exact))
                    }
                    Ok(Frame::Complete(verdict, n)) => {
                        self.buf.drain(..n);
                        self.finish(match verdict {
                            Verdict::Admitted => Ok(()),
                            Verdict::Refused => Err(ServerMismatch::Refused),
                        });
                    }
                },
                State::Finished(outcome) => return outcome.clone().map(|()| Step::Done),
            }
        }
    }

    fn read(&self, message: Message, need: usize, exact: bool) -> Step {
        Step::Read(Progress {
            message,
            got: self.buf.len(),
            need,
            exact,
        })
    }

    fn finish(&mut self, outcome: Result<(), ServerMismatch>) {
        self.state = State::Finished(outcome);
    }

    fn on_reply(&mut self, reply: Reply) {
        let (ns, ps, theirs) = match reply {
            Reply::Challenge {
                nonce,
                proof,
                key_id,
            } => (nonce, proof, key_id),
            Reply::WrongService { label } => {
                let asked = self.service;
                return self.finish(Err(ServerMismatch::WrongService {
                    asked,
                    theirs: label,
                }));
            }
        };
        let label = self.service.label();
        let proof = Proof {
            proof: client_proof(&self.secret, label, &self.nc, &ns),
            key_id: self.secret.key_id(),
        };
        self.outbox = Some((Message::Proof, proof.encode()));
        if is_server_proof(&self.secret, label, &self.nc, &ns, &ps) {
            self.state = State::AwaitVerdict;
        } else {
            let ours = self.secret.key_id();
            self.finish(Err(ServerMismatch::DifferentSecret { theirs, ours }));
        }
    }
}
