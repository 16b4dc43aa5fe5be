//! The harness itself: names, addresses, faults and clean-up, checked with
//! real programs on the hosts.

use std::io::BufRead;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rallypoint_testhosts::{cluster, sweep_leftovers, Host};

/// Runs `python3 -c code` on `host`; its stdout, trimmed.
fn py(host: &Host, code: &str) -> String {
    let out = host.command("python3").args(["-c", code]).output().unwrap();
    assert!(
        out.status.success(),
        "{}: {}",
        host.name,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Tries a TCP connection from `from` to `to`'s name at `port` (2 s): "ok",
/// "refused" or "timeout".
fn connect(from: &Host, to: &str, port: u16) -> String {
    py(
        from,
        &format!(
            "import socket\n\
             try:\n    socket.create_connection(('{to}', {port}), timeout=2); print('ok')\n\
             except ConnectionRefusedError: print('refused')\n\
             except OSError as e: print('timeout' if 'timed out' in str(e) else repr(e))"
        ),
    )
}

/// A listener on `host` at `port`, accepting forever.
fn listen(host: &Host, port: u16) -> std::process::Child {
    let child = host
        .command("python3")
        .args([
            "-c",
            &format!(
                "import socket\ns = socket.create_server(('0.0.0.0', {port}))\nprint('up', flush=True)\n\
                 while True: s.accept()"
            ),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while !host.running().iter().any(|p| *p == child.id() as i32)
        || connect(host, "localhost", port) != "ok"
    {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "listener never came up"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

#[test]
fn hosts_have_their_own_names_addresses_and_hosts_files() {
    let c = cluster(3);
    for (i, h) in c.hosts().iter().enumerate() {
        assert_eq!(h.name, format!("node{}", i + 1));
        assert_eq!(py(h, "import socket; print(socket.gethostname())"), h.name);
        let mine = py(
            h,
            "import socket; print(socket.gethostbyname(socket.gethostname()))",
        );
        assert_eq!(mine, h.addr.to_string());
        for other in c.hosts() {
            let seen = py(
                h,
                &format!(
                    "import socket; print(socket.gethostbyname('{}'))",
                    other.name
                ),
            );
            assert_eq!(
                seen,
                other.addr.to_string(),
                "{} resolving {}",
                h.name,
                other.name
            );
        }
    }
    let mut l = listen(c.host(0), 5000);
    assert_eq!(connect(c.host(1), "node1", 5000), "ok");
    assert_eq!(connect(c.host(2), &c.host(0).addr.to_string(), 5000), "ok");
    let _ = l.kill();
    let _ = l.wait();
}

#[test]
fn a_cut_off_host_loses_packets_silently_and_heals() {
    let c = cluster(2);
    let mut l = listen(c.host(0), 5001);
    c.host(1).cut();
    // Silent loss: no reset, no unreachable, the connect times out.
    assert_eq!(connect(c.host(1), "node1", 5001), "timeout");
    assert_eq!(connect(c.host(0), "node2", 5001), "timeout");
    // Its link stays up.
    let link = Command::new("ip")
        .args(["-n", c.host(1).ns(), "link", "show", "eth0"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&link.stdout).contains("LOWER_UP"));
    c.host(1).heal();
    assert_eq!(connect(c.host(1), "node1", 5001), "ok");
    let _ = l.kill();
    let _ = l.wait();
}

#[test]
fn powering_a_host_off_kills_everything_on_it() {
    let mut c = cluster(2);
    let mut l = listen(c.host(0), 5002);
    // A process that forks a grandchild in a new session: it must die too.
    let mut s = c
        .host(0)
        .command("sh")
        .args(["-c", "setsid sleep 1000 & sleep 1000"])
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while c.host(0).running().len() < 4 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{:?}",
            c.host(0).running()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    c.hosts_mut()[0].power_off();
    assert!(c.host(0).running().is_empty(), "{:?}", c.host(0).running());
    // Both were killed by power_off's SIGKILL: neither exited on its own,
    // which `wait()` succeeding would not tell (it succeeds for any end).
    let (ls, ss) = (l.wait().unwrap(), s.wait().unwrap());
    assert_eq!(
        (ls.signal(), ss.signal()),
        (Some(libc::SIGKILL), Some(libc::SIGKILL)),
        "listener: {ls}, shell: {ss}"
    );
    assert_eq!(connect(c.host(1), "node1", 5002), "timeout");
    // Back on: its name and address stay, nothing listens.
    c.host(0).heal();
    assert_eq!(connect(c.host(1), "node1", 5002), "refused");
    let _ = &mut c;
}

/// A sink: `python3 -c SINK <port> <n>` listens on `port`, prints `up`,
/// then for each connection reads `n` bytes and answers one byte, `k`.
const SINK: &str = r#"
import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
s = socket.create_server(('0.0.0.0', port))
print('up', flush=True)
while True:
    c, _ = s.accept()
    got = 0
    while got < n:
        b = c.recv(1 << 20)
        if not b:
            break
        got += len(b)
    if got == n:
        c.sendall(b'k')
    c.close()
"#;

/// `python3 -c SEND <host> <port> <n>` sends `n` bytes to the sink at
/// `host:port` and prints the seconds from the first byte sent to the sink's
/// answer (so every byte has gone through).
const SEND: &str = r#"
import socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
c = socket.create_connection((host, port), timeout=120)
buf = bytes(1 << 16)
t0 = time.monotonic()
left = n
while left > 0:
    k = min(left, len(buf))
    c.sendall(buf[:k])
    left -= k
if c.recv(1) != b'k':
    sys.exit('the sink did not answer')
print(time.monotonic() - t0)
"#;

/// A [`SINK`] on `host` at `port` for `n` bytes; listening when this returns
/// (it said `up`, which it prints once it listens).
fn sink(host: &Host, port: u16, n: usize) -> std::process::Child {
    let mut child = host
        .command("python3")
        .args(["-c", SINK, &port.to_string(), &n.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    assert!(
        out.read_line(&mut line).unwrap() > 0 && line.trim() == "up",
        "the sink on {} never came up: {line:?}",
        host.name
    );
    child
}

/// How long `from` takes to send `n` bytes to the sink on `to` at `port`.
fn transfer(from: &Host, to: &Host, port: u16, n: usize) -> Duration {
    let out = from
        .command("python3")
        .args(["-c", SEND, &to.name, &port.to_string(), &n.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{} -> {}: {}",
        from.name,
        to.name,
        String::from_utf8_lossy(&out.stderr)
    );
    let secs: f64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    Duration::from_secs_f64(secs)
}

/// `Host::cap` limits what the host sends and what it receives: 4 MiB each
/// way through a 16 Mbit/s cap take at least what the cap implies (a lower
/// bound: a cap can only make a transfer slower), where the same transfer
/// uncapped takes milliseconds. (There is no uncap to check: a cap lasts as
/// long as the cluster.)
#[test]
fn a_capped_host_sends_and_receives_no_faster_than_its_cap() {
    let c = cluster(2);
    const MBIT: u32 = 16;
    const BYTES: usize = 4 << 20;
    let mut sinks = [sink(c.host(0), 5003, BYTES), sink(c.host(1), 5004, BYTES)];
    // Uncapped, for the messages below (and a check of the sink and sender).
    let free = transfer(c.host(1), c.host(0), 5003, BYTES);
    c.host(1).cap(MBIT);
    // In t seconds tbf lets through at most its burst plus rate × t bytes,
    // and the payload is less than what goes on the wire (headers), so
    // t >= (payload - burst) / rate. The burst is 64 KiB at this rate; 1 MiB
    // is allowed for it, and then four fifths of the time for tc's rounding
    // of the rate: 1.26 s, against the 2.1 s the cap implies.
    let rate = f64::from(MBIT) * 1e6 / 8.0;
    let implied = Duration::from_secs_f64(BYTES as f64 / rate);
    let least = Duration::from_secs_f64(0.8 * (BYTES - (1 << 20)) as f64 / rate);
    // An upper bound ten times what the cap implies, plus 10 s: only a cap
    // far tighter than asked (a unit wrong) exceeds it.
    let most = implied * 10 + Duration::from_secs(10);
    for (what, from, to, port) in [
        ("sending", c.host(1), c.host(0), 5003),
        ("receiving", c.host(0), c.host(1), 5004),
    ] {
        let took = transfer(from, to, port, BYTES);
        eprintln!("node2 {what} 4 MiB at {MBIT} Mbit/s: {took:?} (uncapped {free:?})");
        assert!(
            took >= least,
            "node2 {what} 4 MiB capped at {MBIT} Mbit/s took {took:?}, less than the \
             {least:?} the cap allows (uncapped: {free:?})"
        );
        assert!(
            took < most,
            "node2 {what} 4 MiB capped at {MBIT} Mbit/s took {took:?} (the cap implies \
             {implied:?})"
        );
    }
    for s in &mut sinks {
        let _ = s.kill();
        let _ = s.wait();
    }
}

#[test]
fn a_dropped_cluster_leaves_nothing_and_leftovers_of_dead_processes_are_swept() {
    let c = cluster(2);
    let names: Vec<String> = c.hosts().iter().map(|h| h.ns().to_owned()).collect();
    let pids: Vec<i32> = {
        let mut sl = c.host(1).command("sleep").arg("1000").spawn().unwrap();
        let t0 = Instant::now();
        while c.host(1).running().is_empty() {
            assert!(t0.elapsed() < Duration::from_secs(10));
            std::thread::sleep(Duration::from_millis(10));
        }
        let p = c.host(1).running();
        drop(c);
        let _ = sl.wait();
        p
    };
    let listed = String::from_utf8(
        Command::new("ip")
            .args(["netns", "list"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    for ns in &names {
        assert!(!listed.contains(ns.as_str()), "{ns} left: {listed}");
        assert!(!std::path::Path::new("/etc/netns").join(ns).exists());
    }
    for p in pids {
        assert!(
            !std::path::Path::new(&format!("/proc/{p}")).exists(),
            "pid {p} left"
        );
    }

    // Leftovers of a process that is gone (a test killed from outside).
    let mut gone = Command::new("true").spawn().unwrap();
    gone.wait().unwrap();
    let dead = gone.id();
    let ns = format!("rpt-{dead:x}-00-1");
    let bridge = format!("rpb{dead:x}00");
    let veth = format!("rpv{dead:x}001");
    let ok = |args: &[&str]| {
        assert!(
            Command::new("ip").args(args).status().unwrap().success(),
            "{args:?}"
        )
    };
    ok(&["netns", "add", &ns]);
    ok(&["link", "add", &bridge, "type", "bridge"]);
    ok(&[
        "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
    ]);
    std::fs::create_dir_all(format!("/etc/netns/{ns}")).unwrap();
    sweep_leftovers();
    let listed = String::from_utf8(
        Command::new("ip")
            .args(["netns", "list"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    assert!(!listed.contains(&ns), "{listed}");
    assert!(!std::path::Path::new(&format!("/sys/class/net/{bridge}")).exists());
    assert!(!std::path::Path::new(&format!("/sys/class/net/{veth}")).exists());
    assert!(!std::path::Path::new(&format!("/etc/netns/{ns}")).exists());
}
