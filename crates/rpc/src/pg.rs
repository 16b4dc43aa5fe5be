//! The PROCESS_GROUP backend: RPC over the process group's send and receive,
//! as PyTorch had up to 1.9.
//!
//! Each message is two point-to-point sends under fixed tags: a 16-byte head
//! (envelope and bulk lengths) and the body. One task per peer receives from it
//! in a loop, with no deadline (an idle agent is not an error, unlike PyTorch's,
//! whose process-group timeout killed idle RPC, #38531). Sends to one peer are
//! serialised so heads and bodies pair up. Static groups only. A dead worker
//! aborts the process group, which fails every call in flight, naming it: the
//! group cannot go on without a member, as PyTorch's agent could not.
//!
//! A send runs in a task of its own: a caller that gives up (its deadline)
//! leaves it to finish, because a send of the process group dropped half-way
//! aborts the whole group (as it must: the peer would take the next message
//! for the rest of this one).

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use rallypoint_collectives::ProcessGroup;
use rallypoint_sync::MutexExt;
use tokio::task::JoinHandle;

use crate::transport::{BoxFuture, Deliver, Event, Outgoing, Transport, FOREVER};

const TAG_HEAD: u32 = 0x5250_0001;
const TAG_BODY: u32 = 0x5250_0002;
const CLOSE: u64 = u64::MAX;

/// The process-group transport.
pub struct PgTransport {
    pg: ProcessGroup,
    sends: Vec<Arc<tokio::sync::Mutex<()>>>,
    in_flight: Arc<tokio::sync::Semaphore>,
    loops: Mutex<Vec<JoinHandle<()>>>,
}

impl PgTransport {
    /// Serves `pg`; a peer announcing a message over `max_message_bytes`
    /// (the backend options' limit, as for TCP) is refused.
    /// At most `send_recv_threads` sends are in flight at once (PyTorch's
    /// `num_send_recv_threads`).
    pub fn start(
        pg: ProcessGroup,
        deliver: Deliver,
        max_message_bytes: u64,
        send_recv_threads: usize,
    ) -> PgTransport {
        let pg = pg.with_timeout(FOREVER);
        let me = pg.rank();
        let loops = (0..pg.size())
            .filter(|&p| p != me)
            .map(|p| tokio::spawn(recv_loop(pg.clone(), p, deliver.clone(), max_message_bytes)))
            .collect();
        PgTransport {
            sends: (0..pg.size()).map(|_| Arc::default()).collect(),
            in_flight: Arc::new(tokio::sync::Semaphore::new(send_recv_threads.max(1))),
            pg,
            loops: Mutex::new(loops),
        }
    }
}

/// The body length a head announces: envelope plus bulk, each within its
/// limit, before anything is allocated for it.
fn announced(head: [u64; 2], max_bulk: u64) -> Result<usize, String> {
    let [env, bulk] = head;
    if env > u64::from(crate::wire::MAX_ENVELOPE) || bulk > max_bulk {
        return Err(format!(
            "it announced a message of {env} + {bulk} bytes, over this worker's limits ({} envelope, {max_bulk} bulk)",
            crate::wire::MAX_ENVELOPE
        ));
    }
    env.checked_add(bulk)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| format!("it announced {env} + {bulk} bytes"))
}

async fn recv_loop(pg: ProcessGroup, src: usize, deliver: Deliver, max_bulk: u64) {
    let reason = loop {
        let mut head = [0u64; 2];
        if let Err(e) = pg.recv(&mut head, src, TAG_HEAD).await {
            break e.to_string();
        }
        if head[0] == CLOSE {
            return;
        }
        let len = match announced(head, max_bulk) {
            Ok(len) => len,
            Err(e) => break e,
        };
        let mut body = vec![0u8; len];
        if let Err(e) = pg.recv(&mut body, src, TAG_BODY).await {
            break e.to_string();
        }
        let bulk = Bytes::from(body);
        let env = bulk.slice(..head[0] as usize).to_vec();
        deliver(Event::Message {
            from: src as u32,
            env,
            bulk: bulk.slice(head[0] as usize..),
        });
    };
    deliver(Event::Gone {
        peer: src as u32,
        reason,
    });
}

impl Transport for PgTransport {
    fn address(&self) -> String {
        String::new()
    }

    fn add_peer(&self, _id: u32, _addr: &str) {}

    fn remove_peer(&self, _id: u32) {}

    fn send(&self, to: u32, msg: Outgoing) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            let to = to as usize;
            if to == self.pg.rank() {
                return Err("the PROCESS_GROUP backend does not send to itself".into());
            }
            let lock = self
                .sends
                .get(to)
                .ok_or_else(|| format!("no worker {to}"))?
                .clone();
            let (pg, in_flight) = (self.pg.clone(), self.in_flight.clone());
            let sending = tokio::spawn(async move {
                let _slot = in_flight.acquire_owned().await;
                let _g = lock.lock().await;
                let mut body = Vec::with_capacity(msg.env.len() + msg.bulk_len() as usize);
                body.extend_from_slice(&msg.env);
                for b in &msg.bulk {
                    body.extend_from_slice(b);
                }
                let head = [msg.env.len() as u64, msg.bulk_len()];
                pg.send(&head, to, TAG_HEAD)
                    .await
                    .map_err(|e| e.to_string())?;
                pg.send(&body, to, TAG_BODY)
                    .await
                    .map_err(|e| e.to_string())
            });
            sending.await.unwrap_or_else(|e| Err(e.to_string()))
        })
    }

    fn shutdown(&self, graceful: bool) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if graceful {
                for p in (0..self.pg.size()).filter(|&p| p != self.pg.rank()) {
                    // The bound covers the wait for a send still in progress.
                    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), async {
                        let _g = self.sends[p].lock().await;
                        self.pg.send(&[CLOSE, 0], p, TAG_HEAD).await
                    })
                    .await;
                }
                let loops = std::mem::take(&mut *self.loops.locked());
                for l in loops {
                    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), l).await;
                }
            } else {
                self.pg.abort("the RPC agent shut down");
                for l in self.loops.locked().drain(..) {
                    l.abort();
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn announced_lengths_are_held_to_the_limits_before_allocation() {
        assert_eq!(announced([10, 20], 100), Ok(30));
        assert_eq!(announced([0, 100], 100), Ok(100));
        let e = announced([0, 1 << 40], 8 << 30).unwrap_err();
        assert!(e.contains("over this worker's limits"), "{e}");
        assert!(announced([u64::MAX, u64::MAX], u64::MAX).is_err());
        assert!(announced([(64 << 20) + 1, 0], u64::MAX).is_err());
        assert!(announced([1, u64::MAX], u64::MAX).is_err());
    }
}
