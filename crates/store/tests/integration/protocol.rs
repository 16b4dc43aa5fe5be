//! Byte-exact protocol tests against our server over raw sockets: every command code,
//! segmentation, pipelining, waits, cancellation, disconnects and bad input.

use std::io::Write;
use std::time::Duration;

use rallypoint_store::blocking;
use rallypoint_store::protocol::Limits;
use rallypoint_store::server::{ServerConfig, ServerHandle};

use crate::support::{cat, closed_by_peer, raw, raw_unvalidated, read_n, s, silent_for};

fn serve() -> ServerHandle {
    blocking::serve("127.0.0.1:0".parse().unwrap(), ServerConfig::default()).unwrap()
}

fn i64le(v: i64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

fn u64le(v: u64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

fn wait_until(what: &str, f: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !f() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out until {what}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn every_command_code_byte_for_byte() {
    let server = serve();
    let mut c = raw(server.local_addr());
    // 13 PING echoes the nonce (captured: 0d 4f 1f 00 00 -> 4f 1f 00 00)
    c.write_all(&[0x0d, 0x4f, 0x1f, 0, 0]).unwrap();
    assert_eq!(read_n(&mut c, 4), [0x4f, 0x1f, 0, 0]);
    // 1 SET: no reply; 6 WAIT on a present key: 00; 3 GET
    c.write_all(&cat(&[&[1], &s(b"/k1"), &s(b"v1")])).unwrap();
    c.write_all(&cat(&[&[6], &u64le(1), &s(b"/k1")])).unwrap();
    assert_eq!(read_n(&mut c, 1), [0]);
    c.write_all(&cat(&[&[3], &s(b"/k1")])).unwrap();
    assert_eq!(read_n(&mut c, 10), s(b"v1"));
    // 3 GET of a missing key: empty value (libuv behaviour), connection stays up
    c.write_all(&cat(&[&[3], &s(b"/none")])).unwrap();
    assert_eq!(read_n(&mut c, 8), u64le(0));
    // 4 ADD -2 on a missing key then +5: replies are i64 new values
    c.write_all(&cat(&[&[4], &s(b"/cnt"), &i64le(-2)])).unwrap();
    assert_eq!(read_n(&mut c, 8), i64le(-2));
    c.write_all(&cat(&[&[4], &s(b"/cnt"), &i64le(5)])).unwrap();
    assert_eq!(read_n(&mut c, 8), i64le(3));
    // 2 COMPARE_SET: missing+non-empty expected replies expected
    c.write_all(&cat(&[&[2], &s(b"/cs"), &s(b"exp"), &s(b"des")]))
        .unwrap();
    assert_eq!(read_n(&mut c, 11), s(b"exp"));
    c.write_all(&cat(&[&[2], &s(b"/cs"), &s(b""), &s(b"des")]))
        .unwrap();
    assert_eq!(read_n(&mut c, 11), s(b"des"));
    // 5 CHECK: 00 ready, 01 not ready
    c.write_all(&cat(&[&[5], &u64le(2), &s(b"/k1"), &s(b"/nope")]))
        .unwrap();
    assert_eq!(read_n(&mut c, 1), [1]);
    c.write_all(&cat(&[&[5], &u64le(2), &s(b"/k1"), &s(b"/cs")]))
        .unwrap();
    assert_eq!(read_n(&mut c, 1), [0]);
    // 7 GETNUMKEYS: /k1 /cnt /cs
    c.write_all(&[7]).unwrap();
    assert_eq!(read_n(&mut c, 8), i64le(3));
    // 8 DELETE_KEY: 1 then 0
    c.write_all(&cat(&[&[8], &s(b"/cs")])).unwrap();
    assert_eq!(read_n(&mut c, 8), i64le(1));
    c.write_all(&cat(&[&[8], &s(b"/cs")])).unwrap();
    assert_eq!(read_n(&mut c, 8), i64le(0));
    // 9 APPEND: no reply
    c.write_all(&cat(&[&[9], &s(b"/ap"), &s(b"ab")])).unwrap();
    c.write_all(&cat(&[&[9], &s(b"/ap"), &s(b"cd")])).unwrap();
    // 11 MULTI_SET (i64 count), then 10 MULTI_GET in order
    c.write_all(&cat(&[
        &[11],
        &i64le(2),
        &s(b"/m1"),
        &s(b"x"),
        &s(b"/m2"),
        &s(b"yy"),
    ]))
    .unwrap();
    c.write_all(&cat(&[
        &[10],
        &u64le(3),
        &s(b"/m2"),
        &s(b"/ap"),
        &s(b"/m1"),
    ]))
    .unwrap();
    assert_eq!(
        read_n(&mut c, 8 * 3 + 2 + 4 + 1),
        cat(&[&s(b"yy"), &s(b"abcd"), &s(b"x")])
    );
    // 12 CANCEL_WAIT with nothing pending still answers 01
    c.write_all(&[12]).unwrap();
    assert_eq!(read_n(&mut c, 1), [1]);
    // 14 QUEUE_PUSH, 16 QUEUE_LEN, 15 QUEUE_POP (len before pop, then item), empty pop
    c.write_all(&cat(&[&[14], &s(b"/q"), &s(b"item1")]))
        .unwrap();
    c.write_all(&cat(&[&[14], &s(b"/q"), &s(b"item2")]))
        .unwrap();
    c.write_all(&cat(&[&[16], &s(b"/q")])).unwrap();
    assert_eq!(read_n(&mut c, 8), i64le(2));
    c.write_all(&cat(&[&[15], &s(b"/q")])).unwrap();
    assert_eq!(read_n(&mut c, 8 + 8 + 5), cat(&[&i64le(2), &s(b"item1")]));
    c.write_all(&cat(&[&[15], &s(b"/q")])).unwrap();
    assert_eq!(read_n(&mut c, 8 + 8 + 5), cat(&[&i64le(1), &s(b"item2")]));
    c.write_all(&cat(&[&[15], &s(b"/q")])).unwrap();
    assert_eq!(read_n(&mut c, 8), i64le(0));
    c.write_all(&cat(&[&[16], &s(b"/unknown")])).unwrap();
    assert_eq!(read_n(&mut c, 8), i64le(0));
    // 17 LIST_KEYS: count then every raw key (queues are not keys)
    c.write_all(&[17]).unwrap();
    let n = i64::from_le_bytes(read_n(&mut c, 8).try_into().unwrap());
    let mut keys = Vec::new();
    for _ in 0..n {
        let len = u64::from_le_bytes(read_n(&mut c, 8).try_into().unwrap()) as usize;
        keys.push(String::from_utf8(read_n(&mut c, len)).unwrap());
    }
    keys.sort();
    assert_eq!(keys, ["/ap", "/cnt", "/k1", "/m1", "/m2"]);
    // 18 BARRIER with world size 1 releases at once
    c.write_all(&cat(&[&[18], &s(b"/bar"), &i64le(1)])).unwrap();
    assert_eq!(read_n(&mut c, 1), [0]);
    assert!(
        silent_for(&mut c, Duration::from_millis(50)),
        "no stray bytes"
    );
    assert_eq!(server.stats().protocol_errors, 0);
}

#[test]
fn requests_split_into_single_bytes_and_pipelined_requests_work() {
    let server = serve();
    let mut c = raw_unvalidated(server.local_addr());
    let mut stream = vec![0x00, 0xce, 0xf7, 0x85, 0x3c]; // VALIDATE, split below too
    stream.extend(cat(&[&[1], &s(b"/a"), &s(b"value-a")]));
    stream.extend(cat(&[&[4], &s(b"/n"), &i64le(7)]));
    stream.extend(cat(&[&[3], &s(b"/a")]));
    stream.extend([0x0d, 1, 2, 3, 4]);
    for b in &stream {
        c.write_all(&[*b]).unwrap();
        std::thread::sleep(Duration::from_micros(200));
    }
    assert_eq!(read_n(&mut c, 8), i64le(7));
    assert_eq!(read_n(&mut c, 15), s(b"value-a"));
    assert_eq!(read_n(&mut c, 4), [1, 2, 3, 4]);
    // And the same requests pipelined in one write.
    let mut c2 = raw(server.local_addr());
    c2.write_all(&stream[5..]).unwrap();
    assert_eq!(
        read_n(&mut c2, 8 + 15 + 4),
        cat(&[&i64le(14), &s(b"value-a"), &[1, 2, 3, 4]])
    );
}

#[test]
fn wait_is_answered_when_the_last_key_arrives() {
    let server = serve();
    let mut waiter = raw(server.local_addr());
    let mut setter = raw(server.local_addr());
    waiter
        .write_all(&cat(&[&[6], &u64le(3), &s(b"/x"), &s(b"/y"), &s(b"/x")]))
        .unwrap();
    wait_until("the wait is registered", || server.pending_waits() == 1);
    setter
        .write_all(&cat(&[&[1], &s(b"/y"), &s(b"1")]))
        .unwrap();
    assert!(silent_for(&mut waiter, Duration::from_millis(50)));
    // A failed compare_set on a missing key must not release it (libuv does).
    setter
        .write_all(&cat(&[&[2], &s(b"/x"), &s(b"e"), &s(b"d")]))
        .unwrap();
    assert_eq!(read_n(&mut setter, 9), s(b"e"));
    assert!(silent_for(&mut waiter, Duration::from_millis(50)));
    // One write of /x satisfies both of its registrations.
    setter
        .write_all(&cat(&[&[4], &s(b"/x"), &i64le(1)]))
        .unwrap();
    assert_eq!(read_n(&mut setter, 8), i64le(1));
    assert_eq!(read_n(&mut waiter, 1), [0]);
    assert_eq!(server.pending_waits(), 0);
}

#[test]
fn cancel_wait_answers_once_and_races_are_ordered() {
    let server = serve();
    let mut c = raw(server.local_addr());
    c.write_all(&cat(&[&[6], &u64le(1), &s(b"/never")]))
        .unwrap();
    wait_until("registered", || server.pending_waits() == 1);
    c.write_all(&[12]).unwrap();
    assert_eq!(read_n(&mut c, 1), [1]);
    assert_eq!(server.pending_waits(), 0);
    // The key arriving later sends nothing to a cancelled waiter.
    let mut other = raw(server.local_addr());
    other
        .write_all(&cat(&[&[1], &s(b"/never"), &s(b"1")]))
        .unwrap();
    assert!(silent_for(&mut c, Duration::from_millis(50)));
    // Race: the wait completes before the cancel is read: 00 then 01.
    c.write_all(&cat(&[&[6], &u64le(1), &s(b"/race")])).unwrap();
    wait_until("registered", || server.pending_waits() == 1);
    other
        .write_all(&cat(&[&[1], &s(b"/race"), &s(b"1")]))
        .unwrap();
    wait_until("fired", || server.pending_waits() == 0);
    c.write_all(&[12]).unwrap();
    assert_eq!(read_n(&mut c, 2), [0, 1]);
}

#[test]
fn a_disconnected_waiter_is_forgotten() {
    let server = serve();
    let mut waiters: Vec<_> = (0..20).map(|_| raw(server.local_addr())).collect();
    for w in &mut waiters {
        w.write_all(&cat(&[&[6], &u64le(1), &s(b"/gone")])).unwrap();
    }
    wait_until("all registered", || server.pending_waits() == 20);
    drop(waiters);
    wait_until("all dropped", || server.pending_waits() == 0);
    let mut c = raw(server.local_addr());
    c.write_all(&cat(&[&[1], &s(b"/gone"), &s(b"1")])).unwrap();
    c.write_all(&[7]).unwrap();
    assert_eq!(read_n(&mut c, 8), i64le(1));
}

#[test]
fn many_concurrent_waiters_all_wake_on_one_set() {
    let server = serve();
    let mut waiters: Vec<_> = (0..300).map(|_| raw(server.local_addr())).collect();
    for w in &mut waiters {
        w.write_all(&cat(&[&[6], &u64le(1), &s(b"/go")])).unwrap();
    }
    wait_until("all registered", || server.pending_waits() == 300);
    raw(server.local_addr())
        .write_all(&cat(&[&[1], &s(b"/go"), &s(b"1")]))
        .unwrap();
    for w in &mut waiters {
        assert_eq!(read_n(w, 1), [0]);
    }
}

#[test]
fn queue_push_wakes_one_blocked_popper() {
    let server = serve();
    let (mut a, mut b) = (raw(server.local_addr()), raw(server.local_addr()));
    a.write_all(&cat(&[&[6], &u64le(1), &s(b"/q")])).unwrap();
    wait_until("a registered", || server.pending_waits() == 1);
    b.write_all(&cat(&[&[6], &u64le(1), &s(b"/q")])).unwrap();
    wait_until("b registered", || server.pending_waits() == 2);
    raw(server.local_addr())
        .write_all(&cat(&[&[14], &s(b"/q"), &s(b"job")]))
        .unwrap();
    assert_eq!(read_n(&mut a, 1), [0]);
    assert!(silent_for(&mut b, Duration::from_millis(50)));
    assert_eq!(server.pending_waits(), 1);
}

#[test]
fn barrier_command_releases_all_at_world_size() {
    let server = serve();
    let mut cs: Vec<_> = (0..3).map(|_| raw(server.local_addr())).collect();
    for c in &mut cs[..2] {
        c.write_all(&cat(&[&[18], &s(b"/b"), &i64le(3)])).unwrap();
    }
    wait_until("two waiting", || server.pending_waits() == 2);
    cs[2]
        .write_all(&cat(&[&[18], &s(b"/b"), &i64le(3)]))
        .unwrap();
    for c in &mut cs {
        assert_eq!(read_n(c, 1), [0]);
    }
}

/// Each kind of bad input closes just the offending connection, counts a protocol
/// error, and leaves a bystander with a pending wait untouched.
#[test]
fn bad_input_closes_only_that_connection() {
    let server = serve();
    let mut bystander = raw(server.local_addr());
    bystander
        .write_all(&cat(&[&[6], &u64le(1), &s(b"/later")]))
        .unwrap();
    wait_until("bystander waiting", || server.pending_waits() == 1);

    let limits = Limits::default();
    let huge_key = vec![b'k'; limits.max_key_len as usize + 1];
    let cases: Vec<(&str, Vec<u8>, bool)> = vec![
        (
            "no VALIDATE first",
            cat(&[&[1], &s(b"/a"), &s(b"b")]),
            false,
        ),
        ("wrong magic", vec![0, 1, 2, 3, 4], false),
        ("HTTP instead", b"GET / HTTP/1.1\r\n\r\n".to_vec(), false),
        ("second VALIDATE", vec![0x00, 0xce, 0xf7, 0x85, 0x3c], true),
        ("unknown command", vec![19], true),
        ("unknown command 0xff", vec![0xff, 0, 0], true),
        ("key over the limit", cat(&[&[3], &s(&huge_key)]), true),
        (
            "value length over the limit",
            cat(&[&[1], &s(b"/v"), &u64le(9 << 20)]),
            true,
        ),
        ("absurd key count", cat(&[&[6], &u64le(u64::MAX)]), true),
        ("negative MULTI_SET count", cat(&[&[11], &i64le(-3)]), true),
        (
            "ADD on a non-number",
            cat(&[&[1], &s(b"/t"), &s(b"text"), &[4], &s(b"/t"), &i64le(1)]),
            true,
        ),
        (
            "ADD overflow",
            cat(&[
                &[4],
                &s(b"/o"),
                &i64le(i64::MAX),
                &[4],
                &s(b"/o"),
                &i64le(1),
            ]),
            true,
        ),
    ];
    for (i, (what, bytes, validate)) in cases.into_iter().enumerate() {
        let mut c = if validate {
            raw(server.local_addr())
        } else {
            raw_unvalidated(server.local_addr())
        };
        c.write_all(&bytes).unwrap();
        // The ADD cases answer their first request before the bad one.
        if what.starts_with("ADD overflow") {
            assert_eq!(read_n(&mut c, 8), i64le(i64::MAX));
        }
        assert!(closed_by_peer(&mut c), "{what}: connection left open");
        wait_until(what, || server.stats().protocol_errors == i as u64 + 1);
    }
    // The bystander's wait survived all of it and completes.
    let mut setter = raw(server.local_addr());
    setter
        .write_all(&cat(&[&[1], &s(b"/later"), &s(b"1")]))
        .unwrap();
    assert_eq!(read_n(&mut bystander, 1), [0]);
}

#[test]
fn a_truncated_request_then_disconnect_harms_nothing() {
    let server = serve();
    let mut c = raw(server.local_addr());
    // Half a SET with a 1 MiB value, then gone.
    c.write_all(&cat(&[&[1], &s(b"/big"), &u64le(1 << 20), &[0; 1000]]))
        .unwrap();
    drop(c);
    wait_until("closed", || server.stats().open == 0);
    let mut d = raw(server.local_addr());
    d.write_all(&cat(&[&[5], &u64le(1), &s(b"/big")])).unwrap();
    assert_eq!(read_n(&mut d, 1), [1], "nothing half-written was stored");
    assert_eq!(
        server.stats().protocol_errors,
        0,
        "a disconnect is not bad input"
    );
}

#[test]
fn large_values_at_the_limit_round_trip() {
    let server = serve();
    let mut c = raw(server.local_addr());
    let value: Vec<u8> = (0..Limits::default().max_value_len)
        .map(|i| i as u8)
        .collect();
    c.write_all(&cat(&[&[1], &s(b"/big"), &s(&value)])).unwrap();
    c.write_all(&cat(&[&[3], &s(b"/big")])).unwrap();
    assert_eq!(read_n(&mut c, value.len() + 8), s(&value));
}

#[test]
fn shutdown_closes_connections() {
    let server = serve();
    let mut c = raw(server.local_addr());
    c.write_all(&cat(&[&[6], &u64le(1), &s(b"/x")])).unwrap();
    wait_until("registered", || server.pending_waits() == 1);
    blocking::block_on(server.shutdown());
    assert!(closed_by_peer(&mut c));
}

/// A log sink for the test below.
#[derive(Clone, Default)]
struct LogBuf(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for LogBuf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn bad_input_is_logged_with_its_reason() {
    let logs = LogBuf::default();
    let sink = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || sink.clone())
        .with_ansi(false)
        .finish();
    // nextest runs each test in its own process; under `cargo test` another test
    // may have set it first, and then this one's lines still land in the global one.
    if tracing::subscriber::set_global_default(subscriber).is_err() {
        return;
    }
    let server = serve();
    let mut c = raw(server.local_addr());
    c.write_all(&[19]).unwrap();
    assert!(closed_by_peer(&mut c));
    let text = || String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned();
    wait_until("the reason is logged", || {
        text().contains("unknown command code 19")
    });
    let line = text();
    assert!(
        line.contains("closing store connection after bad input"),
        "{line}"
    );
    assert!(line.contains("127.0.0.1:"), "the peer is named: {line}");
}

#[test]
fn a_client_that_stops_reading_stalls_nobody_else() {
    let server = serve();
    let mut setup = raw(server.local_addr());
    let value = vec![7u8; 1 << 20];
    setup
        .write_all(&cat(&[&[1], &s(b"/big"), &s(&value)]))
        .unwrap();
    // 64 GETs of 1 MiB, replies never read: the server's writes to it block.
    let mut hog = raw(server.local_addr());
    let get = cat(&[&[3], &s(b"/big")]);
    for _ in 0..64 {
        hog.write_all(&get).unwrap();
    }
    std::thread::sleep(Duration::from_millis(100));
    // Everyone else is served promptly.
    for _ in 0..20 {
        let mut c = raw(server.local_addr());
        c.write_all(&cat(&[&[4], &s(b"/n"), &i64le(1)])).unwrap();
        read_n(&mut c, 8);
    }
    drop(hog);
    wait_until("the hog's connection is closed", || {
        server.stats().open <= 1
    });
}

/// MULTI_GET naming one large value many times would ask for a reply far over
/// any limit: refused before anything is built, that connection closed with the
/// reason, a bystander unharmed.
#[test]
fn a_hostile_multi_get_is_refused_without_allocating_its_reply() {
    let server = serve();
    let mut setup = raw(server.local_addr());
    let value = vec![7u8; Limits::default().max_value_len as usize];
    setup
        .write_all(&cat(&[&[1], &s(b"/big"), &s(&value)]))
        .unwrap();
    setup.write_all(&cat(&[&[3], &s(b"/big")])).unwrap();
    read_n(&mut setup, value.len() + 8);
    let mut bystander = raw(server.local_addr());
    bystander
        .write_all(&cat(&[&[6], &u64le(1), &s(b"/later")]))
        .unwrap();
    wait_until("bystander waiting", || server.pending_waits() == 1);
    // 100,000 × 8 MiB: an 800 GB reply.
    let n = 100_000u64;
    let mut req = cat(&[&[10], &u64le(n)]);
    for _ in 0..n {
        req.extend_from_slice(&s(b"/big"));
    }
    let mut hostile = raw(server.local_addr());
    hostile.write_all(&req).unwrap();
    assert!(closed_by_peer(&mut hostile));
    wait_until("counted", || server.stats().protocol_errors == 1);
    setup
        .write_all(&cat(&[&[1], &s(b"/later"), &s(b"x")]))
        .unwrap();
    assert_eq!(read_n(&mut bystander, 1), [0]);
}

/// Pipelined replies larger than the output high-water mark are written as they
/// go and arrive whole and in order.
#[test]
fn pipelined_replies_over_the_output_bound_arrive_whole() {
    let server = serve();
    let mut c = raw(server.local_addr());
    let value: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    c.write_all(&cat(&[&[1], &s(b"/v"), &s(&value)])).unwrap();
    // 160 GETs of 1 MiB (2.5 times the bound), then one ADD.
    let get = cat(&[&[3], &s(b"/v")]);
    let mut batch = Vec::new();
    for _ in 0..160 {
        batch.extend_from_slice(&get);
    }
    batch.extend_from_slice(&cat(&[&[4], &s(b"/n"), &i64le(5)]));
    let writer = {
        let mut w = c.try_clone().unwrap();
        std::thread::spawn(move || w.write_all(&batch).unwrap())
    };
    let expected = s(&value);
    for i in 0..160 {
        assert_eq!(read_n(&mut c, expected.len()), expected, "reply {i}");
    }
    assert_eq!(read_n(&mut c, 8), i64le(5));
    writer.join().unwrap();
}

/// The server's side of the connection from `client` (Linux: its timer in
/// `/proc/net/tcp`, 2 while a keep-alive timer runs, and when it fires, in
/// clock ticks).
fn server_side_timer(server: std::net::SocketAddr, client: std::net::SocketAddr) -> (u32, u64) {
    let tcp = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let port = |a: &str| u16::from_str_radix(a.rsplit(':').next().unwrap(), 16).unwrap();
    for l in tcp.lines().skip(1) {
        let f: Vec<&str> = l.split_whitespace().collect();
        if port(f[1]) == server.port() && port(f[2]) == client.port() {
            let (tr, when) = f[5].split_once(':').unwrap();
            return (tr.parse().unwrap(), u64::from_str_radix(when, 16).unwrap());
        }
    }
    panic!("no server side for {client} in /proc/net/tcp")
}

/// Every accepted connection has TCP keep-alive (30 s idle by default), so a
/// client whose host died or was cut off is closed and stops counting as
/// open (an agent keeps its job store up while any client is); `None`
/// leaves the system's default (off).
#[test]
fn accepted_connections_keep_alive_as_configured() {
    for (keepalive, want) in [(Some(Duration::from_secs(30)), 2), (None, 0)] {
        let server = blocking::serve(
            "127.0.0.1:0".parse().unwrap(),
            ServerConfig {
                keepalive,
                ..ServerConfig::default()
            },
        )
        .unwrap();
        let c = raw(server.local_addr());
        wait_until("accepted", || server.stats().open == 1);
        let (tr, when) = server_side_timer(server.local_addr(), c.local_addr().unwrap());
        assert_eq!(tr, want, "keepalive {keepalive:?}");
        if keepalive.is_some() {
            // In clock ticks (USER_HZ, 100 here): within the idle time.
            let hz = 100;
            assert!(when > 20 * hz && when <= 30 * hz, "fires in {when} ticks");
        }
    }
}
