//! A raw TCPStore-protocol connection for the load generator: requests
//! encoded and replies decoded with the store crate's codec, no client
//! library in between, so every server is driven the same way.

use std::net::SocketAddr;

use anyhow::{bail, Result};
use rallypoint_store::protocol::{
    decode_reply, Decoded, Reply, ReplyKind, Request, VALIDATE_MAGIC,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A raw protocol connection for the load generator.
pub(super) struct Conn {
    stream: TcpStream,
    wbuf: Vec<u8>,
    rbuf: Vec<u8>,
}

impl Conn {
    pub(super) async fn open(addr: SocketAddr) -> Result<Conn> {
        Self::open_from(addr, None).await
    }

    /// Connects from source address 127.0.0.`source` when given. Thousands of
    /// connections from one address to one server make each `connect()` scan the
    /// ephemeral port range; a real storm comes from many hosts, so the storm spreads
    /// its clients over loopback addresses (for every server alike).
    pub(super) async fn open_from(addr: SocketAddr, source: Option<u8>) -> Result<Conn> {
        let stream = match source {
            None => TcpStream::connect(addr).await?,
            Some(host) => {
                let socket = tokio::net::TcpSocket::new_v4()?;
                let one: libc::c_int = 1;
                // SAFETY: setsockopt with a valid fd and an int option value.
                unsafe {
                    libc::setsockopt(
                        std::os::fd::AsRawFd::as_raw_fd(&socket),
                        libc::IPPROTO_IP,
                        libc::IP_BIND_ADDRESS_NO_PORT,
                        (&one as *const libc::c_int).cast(),
                        std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                    );
                }
                socket.bind(SocketAddr::from(([127, 0, 0, host], 0)))?;
                socket.connect(addr).await?
            }
        };
        stream.set_nodelay(true)?;
        let mut c = Conn {
            stream,
            wbuf: Vec::new(),
            rbuf: Vec::with_capacity(256),
        };
        c.wbuf.clear();
        Request::Validate {
            magic: VALIDATE_MAGIC,
        }
        .encode(&mut c.wbuf);
        c.stream.write_all(&c.wbuf).await?;
        c.call(&Request::Ping { nonce: 7 }, ReplyKind::Nonce)
            .await?;
        Ok(c)
    }

    pub(super) async fn send(&mut self, req: &Request<'_>) -> Result<()> {
        self.wbuf.clear();
        req.encode(&mut self.wbuf);
        self.stream.write_all(&self.wbuf).await?;
        Ok(())
    }

    pub(super) async fn call(&mut self, req: &Request<'_>, kind: ReplyKind) -> Result<Reply> {
        self.send(req).await?;
        self.reply(kind).await
    }

    async fn reply(&mut self, kind: ReplyKind) -> Result<Reply> {
        loop {
            if let Decoded::Complete(r, n) = decode_reply(kind, &self.rbuf, 1 << 30)? {
                self.rbuf.drain(..n);
                return Ok(r);
            }
            if self.stream.read_buf(&mut self.rbuf).await? == 0 {
                bail!("server closed the connection");
            }
        }
    }
}
