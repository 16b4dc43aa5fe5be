//! The `rally` binary end to end.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rallypoint_store::{blocking, TcpStore};

#[test]
fn store_serve_prints_its_address_serves_and_stops_on_sigterm() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_rally"))
        .args(["store", "serve", "--host", "127.0.0.1", "--port", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr: std::net::SocketAddr = line
        .trim()
        .strip_prefix("rally store listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .parse()
        .unwrap();
    assert_ne!(addr.port(), 0, "port 0 must be replaced by the bound port");

    let store = blocking::connect(
        TcpStore::builder("127.0.0.1", addr.port()).timeout(Duration::from_secs(5)),
    )
    .unwrap();
    store.set("k", b"v").unwrap();
    assert_eq!(store.get("k").unwrap(), b"v");

    // SIGTERM: a clean shutdown with exit status 0, promptly.
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "rally did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(status.success(), "{status}");
    // The client sees the connection go.
    assert!(store.add("n", 1).is_err());
}

#[test]
fn bad_arguments_get_a_message_not_a_trace() {
    let out = Command::new(env!("CARGO_BIN_EXE_rally"))
        .args(["store", "serve", "--port", "not-a-port"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("invalid value 'not-a-port'"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// `rally store serve --job-secret-file` (via `RALLY_JOB_SECRET_FILE` here):
/// a client with the secret is served, one without is told at once that a
/// secret is needed, and the secret never appears in the output.
#[test]
fn store_serve_with_a_job_secret_serves_only_its_holders() {
    use std::io::Read;
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("secret");
    std::fs::write(&path, b"correct-horse-battery-staple-42\n").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_rally"))
        .args(["store", "serve", "--host", "127.0.0.1", "--port", "0"])
        .env("RALLY_JOB_SECRET_FILE", &path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr: std::net::SocketAddr = line
        .trim()
        .strip_prefix("rally store listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .parse()
        .unwrap();
    let secret = rallypoint_auth::JobSecret::from_file(&path).unwrap();
    let builder = || TcpStore::builder("127.0.0.1", addr.port()).timeout(Duration::from_secs(20));
    let store = blocking::connect(builder().secret(Some(secret))).unwrap();
    store.set("k", b"v").unwrap();
    let t0 = Instant::now();
    let Err(err) = blocking::connect(builder().secret(None)) else {
        panic!("a client without the secret was served");
    };
    assert!(
        err.to_string().contains("requires the job's secret"),
        "{err}"
    );
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(err.contains("job secret on (key id"), "{err}");
    assert!(!err.contains("correct-horse"), "{err}");
}
