//! Vectored writes to a TCP socket that never raise `SIGPIPE`.
//!
//! Writing to a socket whose peer has gone makes the kernel send the writer
//! `SIGPIPE`, and that signal's default action ends the process, unless the
//! write asked it not to (`MSG_NOSIGNAL`). Rust's `main` and Python set
//! `SIGPIPE` to ignored at start, so in a Rust program or a torch worker the
//! write just fails with `EPIPE`. A library cannot count on that: a C or C++
//! host program, or code that runs before Rust's `main` (a test role started
//! from a constructor), keeps the default, and there a peer that dies in the
//! middle of an all_reduce took the survivors with it, killed by the signal
//! before they could report the dead rank (found by
//! `collectives::a_rank_killed_mid_all_reduce_is_named_by_every_other_rank`).
//!
//! std and tokio pass `MSG_NOSIGNAL` on their single-buffer writes (`send`),
//! but their vectored writes call `writev`, which takes no flags. So the
//! vectored writes of our own transports (the collectives' frames, RPC's
//! lines) go through here: `sendmsg` with `MSG_NOSIGNAL`, on tokio's
//! readiness. One path still writes with `writev`: hyper's HTTP/2 (h2) on
//! the lighthouse's gRPC connections, both ends. Those run in `rally`
//! (Rust's `main`) or in a Python worker (`rallypoint._native`), both of
//! which ignore `SIGPIPE`; a C host embedding the ft manager must ignore it
//! too.

use std::io::{self, IoSlice};
use std::os::fd::AsRawFd;

use tokio::io::Interest;
use tokio::net::TcpStream;

/// Writes as much of `bufs` as the socket takes now, or `WouldBlock`.
pub fn try_send_vectored(s: &TcpStream, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
    s.try_io(Interest::WRITABLE, || send_vectored_now(s, bufs))
}

/// Writes some of `bufs` once the socket can take bytes: how many it took.
pub async fn send_vectored(s: &TcpStream, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
    loop {
        s.writable().await?;
        match try_send_vectored(s, bufs) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            r => return r,
        }
    }
}

/// One `sendmsg(MSG_NOSIGNAL)` of `bufs` (at most `IOV_MAX` of them).
fn send_vectored_now(s: &TcpStream, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
    // Linux's IOV_MAX: writev takes no more slices than this either.
    const IOV_MAX: usize = 1024;
    let bufs = &bufs[..bufs.len().min(IOV_MAX)];
    // SAFETY: an all-zero msghdr is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // IoSlice is ABI-compatible with iovec on Unix (std documents it); the
    // kernel only reads through msg_iov.
    msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = bufs.len() as _;
    // SAFETY: the fd is the stream's, open while `s` is borrowed; msg points
    // at `bufs`, which outlive the call.
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Restores `SIGPIPE`'s disposition on drop.
    struct DefaultSigpipe(libc::sighandler_t);

    impl DefaultSigpipe {
        fn set() -> Self {
            // SAFETY: changing a signal's disposition; restored on drop.
            Self(unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) })
        }
    }

    impl Drop for DefaultSigpipe {
        fn drop(&mut self) {
            // SAFETY: puts back the disposition `set` replaced.
            unsafe { libc::signal(libc::SIGPIPE, self.0) };
        }
    }

    /// With `SIGPIPE` at its default (as in a C host program), writing to a
    /// peer that has gone fails with an error and the process lives on. With
    /// tokio's `write_vectored` here the test process died of the signal.
    #[tokio::test]
    async fn a_gone_peer_is_an_error_not_a_signal() {
        let _default = DefaultSigpipe::set();
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (peer, _) = l.accept().await.unwrap();
        // Closed with nothing read: the next bytes we send are reset.
        drop(peer);
        let data = vec![7u8; 64 << 10];
        let bufs = [IoSlice::new(b"head"), IoSlice::new(&data)];
        let err = loop {
            match send_vectored(&s, &bufs).await {
                Ok(n) => assert!(n > 0),
                Err(e) => break e,
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        };
        assert!(
            matches!(
                err.kind(),
                io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
            ),
            "{err}"
        );
        // Past the reset, every write is EPIPE: the case that raised SIGPIPE.
        let again = send_vectored(&s, &bufs).await.unwrap_err();
        assert_eq!(again.kind(), io::ErrorKind::BrokenPipe, "{again}");
    }

    #[tokio::test]
    async fn every_byte_of_every_slice_arrives_in_order() {
        use tokio::io::AsyncReadExt;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (mut peer, _) = l.accept().await.unwrap();
        let parts: Vec<Vec<u8>> = (0..1500u32)
            .map(|i| (0..(i % 97) as u8).map(|b| b ^ i as u8).collect())
            .collect();
        let want: Vec<u8> = parts.concat();
        let reader = tokio::spawn(async move {
            let mut got = vec![0u8; want.len()];
            peer.read_exact(&mut got).await.unwrap();
            assert_eq!(got, want);
        });
        let mut slices: Vec<IoSlice> = parts.iter().map(|p| IoSlice::new(p)).collect();
        let mut bufs = &mut slices[..];
        while !bufs.is_empty() {
            let n = send_vectored(&s, bufs).await.unwrap();
            IoSlice::advance_slices(&mut bufs, n);
        }
        reader.await.unwrap();
    }
}
