//! `rallypoint._native.FtManager` (the pyo3 binding in crates/torch) from
//! real Python against torchft's own lighthouse: `tests/py/native_manager.py`
//! (two groups, a quorum with healing, should_commit, the status dict, bad
//! arguments, shutdown). Builds `rallypoint-torch` once, as the torch
//! backend's tests do.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const LIMIT: Duration = Duration::from_secs(120);

fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("RALLY_PYTHON") {
        return p.into();
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python")
}

/// `target/.../lib_native.so`, built by cargo.
fn native_module() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(&root)
        .args([
            "build",
            "--quiet",
            "-p",
            "rallypoint-torch",
            "--message-format=json",
        ])
        .stderr(Stdio::inherit())
        .output()
        .expect("running cargo build -p rallypoint-torch");
    assert!(
        out.status.success(),
        "cargo build -p rallypoint-torch failed"
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["reason"] == "compiler-artifact" && v["target"]["name"] == "_native")
        .find_map(|v| v["filenames"][0].as_str().map(PathBuf::from))
        .expect("cargo reported no _native artifact")
}

#[test]
fn ft_manager_from_python_against_torchfts_lighthouse() {
    let dir = tempfile::tempdir().unwrap();
    // A `rallypoint` package holding only the extension module.
    let pkg = dir.path().join("rallypoint");
    std::fs::create_dir(&pkg).unwrap();
    std::fs::write(pkg.join("__init__.py"), "").unwrap();
    std::os::unix::fs::symlink(native_module(), pkg.join("_native.abi3.so")).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/native_manager.py");
    let mut child = Command::new(python())
        .arg(script)
        .env("PYTHONPATH", dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting python");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > LIMIT {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("native_manager.py did not end within {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(status.success(), "{status}\n{stdout}\n{stderr}");
    assert_eq!(stdout.trim(), "ok", "{stderr}");
}
