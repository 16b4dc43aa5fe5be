//! Connect-and-handshake time on loopback against a plain connect, for the figures of the
//! job secret (issue 49). A program, not a test: it prints figures and asserts nothing.
//!
//!     cargo run --release -p rallypoint-auth --example handshake_time [CONNECTIONS]
//!
//! For each of CONNECTIONS (default 2000) sequential connections to a listener on 127.0.0.1,
//! it times, from before `connect` on the client's side:
//! - connect: until `connect` returns (the kernel's TCP handshake);
//! - connect + 1 round trip: until a 1-byte echo returns (what any protocol's first request
//!   costs at least);
//! - connect + job-secret handshake: until the server's VERDICT admits the client (HELLO,
//!   CHALLENGE, PROOF, VERDICT: two round trips and four HMAC-SHA256s).
//!
//! and prints the median and the 99th percentile of each.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use rallypoint_auth::io::{blocking, CLIENT_DEADLINE, SERVER_DEADLINE};
use rallypoint_auth::{JobSecret, Service};

#[derive(Clone, Copy)]
enum Mode {
    Connect,
    RoundTrip,
    Handshake,
}

fn main() -> anyhow::Result<()> {
    let n: usize = match std::env::args().nth(1) {
        Some(arg) => arg.parse()?,
        None => 2000,
    };
    let secret = JobSecret::from_bytes(vec![0x5a; 32])?;
    println!("{n} connections each, on loopback (µs)");
    println!("{:<34} {:>8} {:>8}", "", "median", "p99");
    for (mode, name) in [
        (Mode::Connect, "connect"),
        (Mode::RoundTrip, "connect + 1 round trip"),
        (Mode::Handshake, "connect + job-secret handshake"),
    ] {
        let mut times = run(mode, n, &secret)?;
        times.sort_unstable();
        let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        println!("{name:<34} {:>8.1} {:>8.1}", us(at(0.5)), us(at(0.99)));
    }
    Ok(())
}

fn run(mode: Mode, n: usize, secret: &JobSecret) -> anyhow::Result<Vec<Duration>> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let server_secret = secret.clone();
    let server = std::thread::spawn(move || serve(listener, mode, n, &server_secret));
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        times.push(one(mode, addr, secret)?);
    }
    server
        .join()
        .map_err(|_| anyhow::anyhow!("the server thread panicked"))??;
    Ok(times)
}

fn one(mode: Mode, addr: SocketAddr, secret: &JobSecret) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let mut conn = TcpStream::connect(addr)?;
    conn.set_nodelay(true)?;
    match mode {
        Mode::Connect => {}
        Mode::RoundTrip => {
            conn.set_read_timeout(Some(CLIENT_DEADLINE))?;
            conn.write_all(b"x")?;
            conn.read_exact(&mut [0])?;
        }
        Mode::Handshake => {
            let deadline = start + CLIENT_DEADLINE;
            blocking::client_handshake(&mut conn, addr, secret, Service::STORE, deadline)?;
        }
    }
    Ok(start.elapsed())
}

fn serve(listener: TcpListener, mode: Mode, n: usize, secret: &JobSecret) -> anyhow::Result<()> {
    for _ in 0..n {
        let (mut conn, peer) = listener.accept()?;
        conn.set_nodelay(true)?;
        match mode {
            Mode::Connect => {}
            Mode::RoundTrip => {
                conn.set_read_timeout(Some(SERVER_DEADLINE))?;
                let mut byte = [0];
                conn.read_exact(&mut byte)?;
                conn.write_all(&byte)?;
            }
            Mode::Handshake => {
                let deadline = Instant::now() + SERVER_DEADLINE;
                blocking::server_handshake(&mut conn, peer, secret, Service::STORE, deadline)?;
            }
        }
    }
    Ok(())
}
