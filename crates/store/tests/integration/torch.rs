//! Interop with real PyTorch (`pip install torch`; `.ci/run` installs it into `.venv`).
//!
//! PyTorch's clients against our server, our client against PyTorch's servers (libuv
//! and legacy), PyTorch's FileStore and ours on one file, and a gloo job whose store
//! is our server. These tests fail, not skip, when PyTorch is missing.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rallypoint_store::{blocking, FileStore, Store, TcpStore};

use crate::support::{python, script};
use rallypoint_store::conformance::{conformance, Queues};

/// Runs a helper script to completion (bounded), returning its stdout; panics with
/// its output if it fails.
fn run_py(args: &[&str], envs: &[(&str, String)]) -> String {
    let child = spawn_py(args, envs, Stdio::null());
    finish(child, Duration::from_secs(180), &args.join(" "))
}

fn spawn_py(args: &[&str], envs: &[(&str, String)], stdin: Stdio) -> Child {
    let py = python();
    let mut cmd = Command::new(&py);
    cmd.arg(script(args[0])).args(&args[1..]);
    cmd.envs(envs.iter().map(|(k, v)| (k, v)));
    cmd.stdin(stdin)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd.spawn().unwrap_or_else(|e| {
        panic!(
            "cannot run {} ({e}): PyTorch interop tests need Python with torch; \
             run .ci/run or set RALLY_PYTHON",
            py.display()
        )
    })
}

fn finish(mut child: Child, limit: Duration, what: &str) -> String {
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        out.status.success(),
        "{what} failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        out.status
    );
    stdout
}

/// PyTorch's own server in a child process; stops when dropped (stdin closes).
struct TorchServer {
    child: Child,
    port: u16,
}

impl TorchServer {
    fn start(kind: &str) -> TorchServer {
        let mut child = spawn_py(&["torch_server.py", kind], &[], Stdio::piped());
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line
            .trim()
            .strip_prefix("PORT ")
            .unwrap_or_else(|| panic!("torch_server.py printed {line:?}"))
            .parse()
            .unwrap();
        TorchServer { child, port }
    }
}

impl Drop for TorchServer {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn pytorch_client_against_our_server() {
    // "localhost" may resolve to ::1 first: the dual-stack bind must serve both.
    for host in ["127.0.0.1", "localhost"] {
        let server = blocking::serve("[::]:0".parse().unwrap(), Default::default()).unwrap();
        let port = server.local_addr().port().to_string();
        let out = run_py(&["torch_client.py", host, &port], &[]);
        assert!(out.contains("OK"), "{out}");
        assert_eq!(server.stats().protocol_errors, 0);
    }
}

/// PyTorch's own client, which cannot prove a job secret, through the
/// loopback proxy to a server that requires one (what `rally run
/// --job-secret-file` gives unchanged workers); directly, it is refused.
#[test]
fn pytorch_client_through_the_proxy_to_a_server_with_a_secret() {
    let secret = rallypoint_store::secret::JobSecret::from_bytes(vec![7; 32]).unwrap();
    let config = rallypoint_store::server::ServerConfig {
        secret: Some(secret.clone()),
        ..Default::default()
    };
    let server = blocking::serve("127.0.0.1:0".parse().unwrap(), config).unwrap();
    let upstream = server.local_addr().to_string();
    let proxy =
        blocking::block_on(rallypoint_store::proxy::Proxy::start(&upstream, secret)).unwrap();
    let port = proxy.local_addr().port().to_string();
    let out = run_py(&["torch_client.py", "127.0.0.1", &port], &[]);
    assert!(out.contains("OK"), "{out}");
    let stats = server.stats();
    assert_eq!(
        (stats.protocol_errors, stats.refused.total()),
        (0, 0),
        "{stats:?}"
    );
    assert!(proxy.stats().admitted >= 2, "{:?}", proxy.stats());

    // Directly, PyTorch's client is refused at once (its timeout is 10 s).
    let direct = server.local_addr().port().to_string();
    let py = python();
    let t0 = Instant::now();
    let out = Command::new(&py)
        .arg(script("torch_client.py"))
        .args(["127.0.0.1", &direct])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", t0.elapsed());
    assert!(
        server.stats().refused.not_our_protocol >= 1,
        "{:?}",
        server.stats()
    );
}

async fn our_client_against(kind: &str, queues: Queues) {
    let torch = TorchServer::start(kind);
    let store = TcpStore::builder("127.0.0.1", torch.port)
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .unwrap();
    conformance(Arc::new(store), queues).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_client_against_pytorch_libuv_server() {
    our_client_against("libuv", Queues::Supported).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_client_against_pytorch_legacy_server() {
    // The legacy server has no queues (it closes the connection on codes 14-16).
    let torch = TorchServer::start("legacy");
    let store = TcpStore::builder("127.0.0.1", torch.port)
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .unwrap();
    let store: Arc<dyn Store> = Arc::new(store);
    conformance(store.clone(), Queues::Skip).await;
    assert!(store.queue_len("q").await.is_err());
    // ... and the store still works after the server dropped that connection.
    store.set("after", b"1").await.unwrap();
    assert_eq!(store.get("after").await.unwrap(), b"1");
}

#[test]
fn file_store_bytes_match_pytorchs() {
    let dir = tempfile::tempdir().unwrap();
    let theirs = dir.path().join("theirs");
    let hex = run_py(
        &["torch_filestore.py", "layout", theirs.to_str().unwrap()],
        &[],
    );
    let ours_path = dir.path().join("ours");
    let ours = FileStore::open_blocking(&ours_path, 2).unwrap();
    let store = blocking::BlockingStore::new(ours);
    store.set("a", b"xy").unwrap();
    store.add("c", 3).unwrap();
    store.add("c", 4).unwrap();
    store.delete_key("a").unwrap();
    store.compare_set("cs", b"", b"v").unwrap();
    let bytes = std::fs::read(&ours_path).unwrap();
    let mine: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(mine, hex.trim());
}

#[test]
fn file_store_shared_with_pytorch() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shared");
    let store = blocking::BlockingStore::new(FileStore::open_blocking(&path, 2).unwrap());
    store.set_timeout(Duration::from_secs(10));
    store.set("from_rust", b"hello").unwrap();
    assert_eq!(store.add("counter", 5).unwrap(), 5);
    store.set("deleted_by_rust", b"x").unwrap();
    assert!(store.delete_key("deleted_by_rust").unwrap());
    store.set("cas", b"r1").unwrap();
    let out = run_py(
        &["torch_filestore.py", "share", path.to_str().unwrap()],
        &[],
    );
    assert!(out.contains("OK"), "{out}");
    // What PyTorch wrote, read back by us.
    assert_eq!(store.get("from_py").unwrap(), b"world");
    assert_eq!(store.get("cas").unwrap(), b"p1");
    assert_eq!(store.add("counter", 1).unwrap(), 16);
    assert!(store.delete_key("to_delete").unwrap());
    assert!(path.exists(), "the file outlives the first of two users");
    // Last user out (cleanup/ reaches 2, refcount/ reaches 0) removes the file.
    drop(store);
    assert!(!path.exists(), "the last user removes the file");
}

#[test]
fn gloo_all_reduce_through_our_server() {
    const WORLD: usize = 3;
    let server = blocking::serve("127.0.0.1:0".parse().unwrap(), Default::default()).unwrap();
    let port = server.local_addr().port();
    let children: Vec<Child> = (0..WORLD)
        .map(|rank| {
            let envs = [
                ("RANK", rank.to_string()),
                ("WORLD_SIZE", WORLD.to_string()),
                ("MASTER_ADDR", "127.0.0.1".to_string()),
                ("MASTER_PORT", port.to_string()),
                ("TORCHELASTIC_USE_AGENT_STORE", "True".to_string()),
                ("GLOO_SOCKET_IFNAME", "lo".to_string()),
                ("OMP_NUM_THREADS", "1".to_string()),
            ];
            spawn_py(&["torch_gloo.py"], &envs, Stdio::null())
        })
        .collect();
    for (rank, child) in children.into_iter().enumerate() {
        let out = finish(
            child,
            Duration::from_secs(180),
            &format!("gloo rank {rank}"),
        );
        assert!(out.contains(&format!("rank {rank} OK sum=6")), "{out}");
    }
    // Every worker counted itself into init/, through our server.
    let store = blocking::connect(TcpStore::builder("127.0.0.1", port)).unwrap();
    assert_eq!(
        blocking::block_on(store.inner().worker_count()).unwrap(),
        WORLD as i64
    );
    assert!(store.check(&["default_pg/0//cpu//0/0"]).is_ok());
    assert_eq!(server.stats().protocol_errors, 0);
}
