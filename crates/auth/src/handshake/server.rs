//! The server's side of the handshake, as a machine: bytes in, bytes out, no I/O.
//!
//! It awaits a HELLO; answers a wrong service with a WRONG SERVICE reply, or else with a
//! CHALLENGE (a fresh Ns, Ps and its key id); awaits the PROOF; and answers with a VERDICT.
//! Whatever it refuses ends in a [`Rejection`], after the bytes that tell the client why.
//! Bytes that are not this protocol end it at once; the machine sends nothing back (the
//! listener may, in its own protocol).

use std::fmt;

use super::proof::{fresh_nonce, is_client_proof, server_proof, NonceError};
use super::service::Service;
use super::step::{Message, Progress, Step};
use super::wire::{DecodeError, Frame, Hello, Nonce, Proof, Reply, Verdict};
use crate::secret::{JobSecret, KeyId};

/// Why a server refused a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    /// Its proof is wrong.
    WrongProof {
        /// The key id it sent.
        theirs: KeyId,
        /// The server's.
        ours: KeyId,
    },
    /// Its bytes are not this handshake.
    NotOurProtocol(DecodeError),
    /// It asked for another service.
    WrongService {
        /// The label it sent.
        asked: String,
        /// This listener's.
        ours: Service,
    },
}

impl fmt::Display for Rejection {
    /// A phrase that follows "it" (the client).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rejection::WrongProof { theirs, ours } if theirs == ours => write!(
                f,
                "sent a wrong proof though its key id {theirs} is ours (a replayed or forged proof)"
            ),
            Rejection::WrongProof { theirs, ours } => write!(
                f,
                "holds a different job secret (its key id {theirs}, ours {ours})"
            ),
            Rejection::NotOurProtocol(e) => {
                write!(f, "does not speak the rallypoint job-secret handshake: {e}")
            }
            Rejection::WrongService { asked, ours } => write!(
                f,
                "asked for the \"{asked}\" service, but this listener is the \"{ours}\""
            ),
        }
    }
}

impl std::error::Error for Rejection {}

enum State {
    AwaitHello,
    AwaitProof { nc: Nonce },
    Finished(Result<(), Rejection>),
}

/// The server's side of one handshake.
pub struct ServerHandshake {
    secret: JobSecret,
    service: Service,
    ns: Nonce,
    buf: Vec<u8>,
    state: State,
    outbox: Option<(Message, Vec<u8>)>,
}

impl ServerHandshake {
    /// A handshake for a connection to `service`, with a fresh server nonce.
    pub fn new(secret: &JobSecret, service: Service) -> Result<ServerHandshake, NonceError> {
        Ok(ServerHandshake::with_nonce(secret, service, fresh_nonce()?))
    }

    /// The same with a given nonce: for tests that need one exchange twice.
    pub(crate) fn with_nonce(secret: &JobSecret, service: Service, ns: Nonce) -> ServerHandshake {
        ServerHandshake {
            secret: secret.clone(),
            service,
            ns,
            buf: Vec::new(),
            state: State::AwaitHello,
            outbox: None,
        }
    }

    /// Bytes received from the client.
    pub fn receive(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes received past the handshake's last message (none, when the transport reads no
    /// more than each [`Step::Read`] asks for).
    pub fn leftover(&self) -> &[u8] {
        match self.state {
            State::Finished(_) => &self.buf,
            _ => &[],
        }
    }

    /// What to do next: write, read, or done (admitted). `Err` once a refusal's bytes, if any,
    /// have been asked to be written.
    pub fn step(&mut self) -> Result<Step, Rejection> {
        loop {
            if let Some((message, bytes)) = self.outbox.take() {
                return Ok(Step::Write { message, bytes });
            }
            match &self.state {
                State::AwaitHello => match Hello::decode(&self.buf) {
                    Err(e) => self.finish(Err(Rejection::NotOurProtocol(e))),
                    Ok(Frame::Incomplete { need, exact }) => {
                        return Ok(self.read(Message::Hello, need, exact))
                    }
                    Ok(Frame::Complete(hello, n)) => {
                        self.buf.drain(..n);
                        self.on_hello(hello);
                    }
                },
                State::AwaitProof { nc } => {
                    let nc = *nc;
                    match Proof::decode(&self.buf) {
                        Err(e) => self.finish(Err(Rejection::NotOurProtocol(e))),
                        Ok(Frame::Incomplete { need, exact }) => {
                            return Ok(self.read(Message::Proof, need, exact))
                        }
                        Ok(Frame::Complete(proof, n)) => {
                            self.buf.drain(..n);
                            self.on_proof(&nc, proof);
                        }
                    }
                }
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

    fn finish(&mut self, outcome: Result<(), Rejection>) {
        self.state = State::Finished(outcome);
    }

    fn on_hello(&mut self, hello: Hello) {
        if hello.label != self.service.label() {
            let reply = Reply::WrongService {
                label: self.service.label().to_owned(),
            };
            self.outbox = Some((Message::Challenge, reply.encode()));
            let asked = hello.label;
            let ours = self.service;
            return self.finish(Err(Rejection::WrongService { asked, ours }));
        }
        let label = self.service.label();
        let reply = Reply::Challenge {
            nonce: self.ns,
            proof: server_proof(&self.secret, label, &hello.nonce, &self.ns),
            key_id: self.secret.key_id(),
        };
        self.outbox = Some((Message::Challenge, reply.encode()));
        self.state = State::AwaitProof { nc: hello.nonce };
    }

    fn on_proof(&mut self, nc: &Nonce, proof: Proof) {
        let label = self.service.label();
        let right = is_client_proof(&self.secret, label, nc, &self.ns, &proof.proof);
        let (verdict, outcome) = if right {
            (Verdict::Admitted, Ok(()))
        } else {
            let theirs = proof.key_id;
            let ours = self.secret.key_id();
            (
                Verdict::Refused,
                Err(Rejection::WrongProof { theirs, ours }),
            )
        };
        self.outbox = Some((Message::Verdict, verdict.encode()));
        self.finish(outcome);
    }
}
