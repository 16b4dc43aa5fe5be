//! A hand-written member of a group, for orders the real ranks would make
//! only by chance: it publishes an address, accepts the members'
//! connections, and reads and writes frames as the test says.

use std::sync::Arc;

use rallypoint_collectives::wire::{Header, Hello, ACCEPTED, HEADER_LEN, HELLO_LEN};
use rallypoint_store::Store;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The store prefix of the default group.
pub const PREFIX: &str = "rallypoint/collectives/default_pg/";

pub struct FakePeer {
    listener: TcpListener,
}

impl FakePeer {
    /// Listens on loopback and publishes the address as rank `rank`'s.
    pub async fn publish(store: &Arc<dyn Store>, rank: usize) -> FakePeer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        store
            .set(&format!("{PREFIX}addr/{rank}"), addr.as_bytes())
            .await
            .unwrap();
        FakePeer { listener }
    }

    /// Accepts a member's connection and its handshake: the member's rank
    /// and the stream.
    pub async fn accept(&self) -> (u32, TcpStream) {
        let (mut s, _) = self.listener.accept().await.unwrap();
        let mut hello = [0u8; HELLO_LEN];
        s.read_exact(&mut hello).await.unwrap();
        let (hello, name_len) = Hello::decode_fixed(&hello).unwrap();
        s.read_exact(&mut vec![0u8; name_len]).await.unwrap();
        s.write_all(&[ACCEPTED]).await.unwrap();
        (hello.src, s)
    }
}

/// The next frame on `s`: its header and payload.
pub async fn read_frame(s: &mut TcpStream) -> (Header, Vec<u8>) {
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h).await.unwrap();
    let header = Header::decode(&h).unwrap();
    let mut payload = vec![0u8; header.payload_len() as usize];
    s.read_exact(&mut payload).await.unwrap();
    (header, payload)
}

pub async fn write_frame(s: &mut TcpStream, h: &Header, payload: &[u8]) {
    s.write_all(&h.encode()).await.unwrap();
    s.write_all(payload).await.unwrap();
}

/// An abort of group `comm` from op `from`, with `reason`.
pub async fn write_abort(s: &mut TcpStream, comm: u64, from: u64, provisional: bool, reason: &str) {
    let h = Header::Abort {
        comm,
        len: reason.len() as u64,
        own: false,
        from,
        provisional,
    };
    write_frame(s, &h, reason.as_bytes()).await;
}
