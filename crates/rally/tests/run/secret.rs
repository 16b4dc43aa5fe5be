//! `rally run --job-secret-file` on loopback (issue 49): a two-node c10d job
//! whose unchanged PyTorch workers (gloo DDP over `env://`) reach the job
//! store through their agent's loopback proxy trains to the right result,
//! while a `rally run` without the secret, or with another, is refused at
//! once at the rendezvous, naming why; bad secret files are refused before
//! anything starts.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::*;

/// A secret file of `fill` bytes, readable by its owner only.
pub(super) fn secret_file(dir: &Path, name: &str, fill: u8) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, [fill; 32]).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p
}

fn c10d(endpoint: &str) -> Vec<String> {
    [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        "secret",
    ]
    .map(str::to_owned)
    .to_vec()
}

/// An outsider `rally run` at the job's rendezvous: it must fail at once
/// (well inside its 60 s join timeout) saying `why`.
fn outsider_refused(dir: &Path, endpoint: &str, secret: Option<&Path>, why: &str) {
    let mut args = c10d(endpoint);
    let path;
    if let Some(p) = secret {
        path = p.display().to_string();
        args.extend(["--job-secret-file".to_owned(), path]);
    }
    args.push(script("exit_cleanly.py").display().to_string());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let t0 = Instant::now();
    let mut job = Job::spawn(rally(&args), dir, "outsider");
    let status = job.wait(LIMIT);
    let took = t0.elapsed();
    let log = job.output();
    assert!(!status.success(), "{log}");
    assert!(log.contains(why), "{log}");
    assert!(took < Duration::from_secs(30), "{took:?}: {log}");
}

#[test]
fn a_job_with_a_secret_trains_and_outsiders_are_refused_at_the_rendezvous() {
    let (dir, out) = with_results();
    let good = secret_file(dir.path(), "secret", 1);
    let other = secret_file(dir.path(), "other", 2);
    let endpoint = format!("127.0.0.1:{}", free_port());
    let mut args = c10d(&endpoint);
    args.extend(["--job-secret-file".to_owned(), good.display().to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut a = ddp_job(dir.path(), &out, &args, &[], "a");
    // Node a hosts the rendezvous; wait until it answers.
    let t0 = Instant::now();
    while std::net::TcpStream::connect(&endpoint).is_err() {
        assert!(t0.elapsed() < LIMIT, "{}", a.output());
        std::thread::sleep(Duration::from_millis(20));
    }
    outsider_refused(dir.path(), &endpoint, None, "requires the job's secret");
    outsider_refused(dir.path(), &endpoint, Some(&other), "different job secret");
    let mut b = ddp_job(dir.path(), &out, &args, &[], "b");
    let (sa, sb) = (a.wait(LIMIT), b.wait(LIMIT));
    assert!(
        sa.success() && sb.success(),
        "{}\n---\n{}",
        a.output(),
        b.output()
    );
    let r = results(&out);
    assert_eq!(r.len(), 2, "{}", a.output());
    assert!(r.values().all(|v| v["world_size"] == 2), "{r:?}");
    let log = a.output();
    assert!(log.contains("job secret on (key id"), "{log}");
    assert!(!log.contains(&String::from_utf8_lossy(&[1u8; 32]).to_string()));
}

#[test]
fn bad_secret_files_are_refused_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    let open = dir.path().join("open");
    std::fs::write(&open, [1u8; 32]).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644)).unwrap();
    let short = dir.path().join("short");
    std::fs::write(&short, b"tooshort").unwrap();
    std::fs::set_permissions(&short, std::fs::Permissions::from_mode(0o600)).unwrap();
    let missing = dir.path().join("missing");
    for (path, expect) in [(&open, "chmod 600"), (&short, "16"), (&missing, "missing")] {
        let p = path.display().to_string();
        let o = rally(&["--standalone", "--job-secret-file", &p, "x"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{p}: {err}");
        assert!(err.contains(expect), "{p}: {err}");
        assert!(err.contains("--job-secret-file"), "{p}: {err}");
    }
}
