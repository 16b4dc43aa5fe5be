//! The `rally` backend for torch.distributed against gloo, through torch:
//! the package both sides need (the extension module, built here) and
//! `rallypoint-bench torch-ddp`, DDP step time over each backend.
//!
//! The collectives through torch are a side of `rallypoint-bench
//! collectives` (`--sides rally,torch-rally,gloo`): the crate from Rust, the
//! crate from torch, and gloo from torch, in one run.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use anyhow::{bail, Context, Result};
use clap::Args;

/// A directory to put on PYTHONPATH: `rallypoint/` as `pip install .` lays
/// it out, its extension module built now (release; a no-op when fresh).
pub(crate) fn package() -> Result<PathBuf> {
    static SITE: OnceLock<PathBuf> = OnceLock::new();
    if let Some(s) = SITE.get() {
        return Ok(s.clone());
    }
    let root = crate::fixtures::repo_root();
    let out = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
        .current_dir(&root)
        .args([
            "build",
            "--release",
            "--quiet",
            "-p",
            "rallypoint-torch",
            "--message-format=json",
        ])
        .stderr(Stdio::inherit())
        .output()
        .context("running cargo build -p rallypoint-torch")?;
    if !out.status.success() {
        bail!("cargo build --release -p rallypoint-torch failed");
    }
    let so = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["reason"] == "compiler-artifact" && v["target"]["name"] == "_native")
        .find_map(|v| v["filenames"][0].as_str().map(PathBuf::from))
        .context("cargo reported no _native artifact")?;
    let site = root.join("target/rallypoint-bench-torch");
    let pkg = site.join("rallypoint");
    std::fs::create_dir_all(&pkg)?;
    for e in std::fs::read_dir(root.join("python/rallypoint"))? {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "py") {
            std::fs::copy(&p, pkg.join(p.file_name().expect("a file")))?;
        }
    }
    let link = pkg.join("_native.abi3.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(so, &link)?;
    Ok(SITE.get_or_init(|| site).clone())
}

#[derive(Args)]
pub struct TorchDdpArgs {
    /// Group sizes.
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    ranks: Vec<usize>,
    /// Backends, alternating within each repetition; "none" is DDP whose
    /// comm hook communicates nothing (the floor: no backend can beat it).
    #[arg(long, value_delimiter = ',', default_value = "none,gloo,rally")]
    backends: Vec<String>,
    /// Repetitions of the whole comparison.
    #[arg(long, default_value_t = 2)]
    repeat: usize,
    /// Timed steps per run (after 3 untimed).
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// The MLP's width and depth: 6 × 2048² is 25.2M parameters.
    #[arg(long, default_value_t = 2048)]
    width: usize,
    #[arg(long, default_value_t = 6)]
    layers: usize,
    /// DDP's bucket_cap_mb (torch's default, 25).
    #[arg(long, default_value_t = 25.0)]
    bucket_mb: f64,
    /// DDP's gradient_as_bucket_view (gradients live in the buckets).
    #[arg(long)]
    bucket_view: bool,
}

pub fn run(args: TorchDdpArgs) -> Result<()> {
    let site = package()?;
    println!(
        "# DDP step time, MLP of {} x {}^2 parameters, batch 8, f32, one host, buckets of {} MB, gradient_as_bucket_view {}; slowest rank, mean of {} steps",
        args.layers, args.width, args.bucket_mb, args.bucket_view, args.steps
    );
    for rep in 0..args.repeat {
        for &n in &args.ranks {
            let mut times = Vec::new();
            for b in &args.backends {
                let t = ddp(b, n, &args, &site).with_context(|| format!("{b} at {n} ranks"))?;
                println!(
                    "rep {} | {n} ranks | {b:>5} | {:.1} ms per step",
                    rep + 1,
                    t * 1e3
                );
                times.push((b.clone(), t));
            }
            if let (Some((_, g)), Some((_, r))) = (
                times.iter().find(|(b, _)| b == "gloo"),
                times.iter().find(|(b, _)| b == "rally"),
            ) {
                println!("rep {} | {n} ranks | gloo / rally {:.2}", rep + 1, g / r);
                if let Some((_, f)) = times.iter().find(|(b, _)| b == "none") {
                    println!(
                        "rep {} | {n} ranks | communication's share of a step: gloo {:.0}%, rally {:.0}%; the most gloo / rally can be (rally at the floor): {:.2}",
                        rep + 1,
                        (g - f) / g * 100.0,
                        (r - f) / r * 100.0,
                        g / f
                    );
                }
            }
        }
    }
    Ok(())
}

/// One run of `n` ranks of ddp_bench.py over `backend`: seconds per step.
fn ddp(backend: &str, n: usize, args: &TorchDdpArgs, site: &PathBuf) -> Result<f64> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut children = Vec::new();
    for r in 0..n {
        let c = Command::new(crate::fixtures::python())
            .arg(crate::fixtures::repo_root().join("crates/bench/py/ddp_bench.py"))
            .env("BACKEND", backend)
            .env("PYTHONPATH", site)
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("OMP_NUM_THREADS", "1")
            .env("STEPS", args.steps.to_string())
            .env("WIDTH", args.width.to_string())
            .env("LAYERS", args.layers.to_string())
            .env("BUCKET_MB", args.bucket_mb.to_string())
            .env("BUCKET_VIEW", if args.bucket_view { "1" } else { "0" })
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        children.push(c);
    }
    let mut result = None;
    for c in children {
        let out = c.wait_with_output()?;
        if !out.status.success() {
            bail!("a rank failed: {}", out.status);
        }
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if let Some(v) = line.strip_prefix("RESULT ") {
                result = Some(v.trim().parse::<f64>()?);
            }
        }
    }
    result.context("rank 0 printed no RESULT")
}
