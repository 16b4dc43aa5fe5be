//! The harness itself: names, addresses, faults and clean-up, checked with
//! real programs on the hosts.

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
    let Some(c) = cluster(3) else { return };
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
    let Some(c) = cluster(2) else { return };
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
    let Some(mut c) = cluster(2) else { return };
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
    assert!(l.wait().is_ok() && s.wait().is_ok());
    assert_eq!(connect(c.host(1), "node1", 5002), "timeout");
    // Back on: its name and address stay, nothing listens.
    c.host(0).heal();
    assert_eq!(connect(c.host(1), "node1", 5002), "refused");
    let _ = &mut c;
}

#[test]
fn a_dropped_cluster_leaves_nothing_and_leftovers_of_dead_processes_are_swept() {
    let Some(c) = cluster(2) else { return };
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
