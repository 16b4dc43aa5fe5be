//! Holds a cluster of test hosts for a program in another language (a
//! Python benchmark), and tears it down when that program is done, however
//! it ends.
//!
//! `hold N` makes N hosts ([`rallypoint_testhosts::Cluster`]), prints one
//! JSON line that describes them, then serves commands, one a line, on its
//! standard input:
//!
//! ```text
//! {"hosts":[{"name":"node1","addr":"10.77.0.1","ns":"rpt-…-1","prefix":["ip","netns","exec",…,"--"]},…]}
//! cut 2      -> ok <unix time, s, once the host is off the bridge>
//! heal 2     -> ok <unix time>
//! bogus      -> error: <what was wrong>
//! ```
//!
//! A host is named by its index from 0 (`node<i+1>`). A program runs on a
//! host as `prefix + [program, args...]`: the argv of [`Host::command`]
//! (its network namespace and hostname). The answer's time is taken after
//! the `ip` command returned, so the fault is in effect by then.
//!
//! Tear-down: the cluster is dropped (every process on its hosts killed,
//! links, namespaces and `/etc/netns` files deleted) when standard input
//! ends, which it does whenever the controlling program exits, by a signal
//! or a crash included, and on SIGTERM, SIGINT or SIGHUP to this process. A
//! SIGKILL of this process leaves the hosts to the next cluster's sweep of
//! leftovers (the crate's docs). A controller that wants Ctrl-C to reach
//! itself first starts this program in its own session.
//!
//! [`Host::command`]: rallypoint_testhosts::Host::command

use std::io::{BufRead, Write};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use rallypoint_testhosts::{Cluster, Host};

fn main() {
    let n: usize = match std::env::args().nth(1).map(|a| a.parse()) {
        Some(Ok(n)) if (1..=15).contains(&n) => n,
        _ => {
            eprintln!("usage: hold N (1 to 15 hosts); see the example's docs");
            std::process::exit(2);
        }
    };
    // Blocked here, before any thread starts, so that only the signal
    // thread below receives them.
    let signals = blocked_signals();
    let cluster = match Cluster::new(n) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("hold: cannot make {n} test hosts: {e}");
            std::process::exit(1);
        }
    };
    println!("{}", describe(&cluster));
    let _ = std::io::stdout().flush();
    let held = Arc::new(Mutex::new(Some(cluster)));
    let on_signal = Arc::clone(&held);
    std::thread::spawn(move || {
        let sig = wait_signal(&signals);
        eprintln!("hold: signal {sig}: tearing the hosts down");
        tear_down(&on_signal);
        std::process::exit(128 + sig);
    });
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let answer = serve(&held, line.trim());
        println!("{answer}");
        let _ = std::io::stdout().flush();
    }
    tear_down(&held);
}

/// The answer to one command.
fn serve(held: &Mutex<Option<Cluster>>, line: &str) -> String {
    let mut words = line.split_whitespace();
    let (verb, arg) = (words.next().unwrap_or(""), words.next());
    let guard = held.lock().unwrap_or_else(|e| e.into_inner());
    let Some(cluster) = guard.as_ref() else {
        return "error: the hosts are being torn down".into();
    };
    let i = match arg.map(str::parse::<usize>) {
        Some(Ok(i)) if i < cluster.hosts().len() => i,
        _ => {
            return format!(
                "error: {line:?}: expected `cut I` or `heal I` with I from 0 to {}",
                cluster.hosts().len() - 1
            )
        }
    };
    let act: fn(&Host) = match verb {
        "cut" => Host::cut,
        "heal" => Host::heal,
        _ => return format!("error: {line:?}: unknown command (cut I, heal I)"),
    };
    let host = cluster.host(i);
    // cut and heal panic (saying why) when `ip` fails: answered, not fatal.
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| act(host))) {
        Ok(()) => format!("ok {:.6}", unix_now()),
        Err(p) => format!("error: {verb} {i}: {}", panic_text(&p)),
    }
}

fn tear_down(held: &Mutex<Option<Cluster>>) {
    let taken = held.lock().unwrap_or_else(|e| e.into_inner()).take();
    drop(taken);
}

/// One JSON line: each host's name, address, namespace and argv prefix.
fn describe(c: &Cluster) -> String {
    let hosts: Vec<String> = c
        .hosts()
        .iter()
        .map(|h| {
            let cmd = h.command("");
            let mut argv = vec![cmd.get_program().to_string_lossy().into_owned()];
            argv.extend(cmd.get_args().map(|a| a.to_string_lossy().into_owned()));
            argv.pop(); // the empty program
            let argv: Vec<String> = argv.iter().map(|a| json_str(a)).collect();
            format!(
                "{{\"name\":{},\"addr\":\"{}\",\"ns\":{},\"prefix\":[{}]}}",
                json_str(&h.name),
                h.addr,
                json_str(h.ns()),
                argv.join(",")
            )
        })
        .collect();
    format!("{{\"hosts\":[{}]}}", hosts.join(","))
}

fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "panicked".into())
}

/// SIGTERM, SIGINT and SIGHUP, blocked in this thread (and so in every
/// thread it starts).
fn blocked_signals() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset initialise the set we own;
    // pthread_sigmask only changes this thread's mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

fn wait_signal(set: &libc::sigset_t) -> i32 {
    let mut sig = 0;
    // SAFETY: `set` is initialised and its signals are blocked; sigwait
    // writes the signal's number into `sig`.
    unsafe { libc::sigwait(set, &mut sig) };
    sig
}
