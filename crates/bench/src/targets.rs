//! The servers under test, each in its own process so that measuring one
//! never shares a runtime with the load generator: our store (`rally store
//! serve`), PyTorch's (`crates/store/tests/py/torch_server.py`, libuv or
//! legacy), and the raw TCP echo that is the latency baseline
//! (`rallypoint-bench echo`). Each prints the port it bound on its first
//! line; a [`Target`] is killed when dropped. Also what is read of a target
//! from `/proc`: its CPU time and resident memory.

use std::io::Read;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::fixtures::python;
use crate::fixtures::repo_root;

/// A server under test, in its own process.
pub(crate) struct Target {
    pub(crate) name: String,
    pub(crate) child: Child,
    pub(crate) addr: SocketAddr,
}

impl Drop for Target {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a target: `rally`, `torch`, `torch-legacy`, or a raw echo
/// (`raw-ping`, `raw-get`).
pub(crate) fn start(name: &str, rally_threads: Option<usize>) -> Result<Target> {
    start_pinned(name, rally_threads, None)
}

/// Starts a target, optionally with all its threads pinned to one CPU.
pub(crate) fn start_pinned(
    name: &str,
    rally_threads: Option<usize>,
    cpu: Option<usize>,
) -> Result<Target> {
    let mut cmd = match name {
        "rally" => {
            let exe = std::env::current_exe()?.with_file_name("rally");
            let mut c = Command::new(&exe);
            c.args(["store", "serve", "--host", "127.0.0.1", "--port", "0"]);
            if let Some(n) = rally_threads {
                c.args(["--threads", &n.to_string()]);
            }
            c.env("RALLY_LOG", "warn");
            c
        }
        "torch" | "torch-legacy" => {
            let mut c = Command::new(python());
            c.arg(repo_root().join("crates/store/tests/py/torch_server.py"));
            c.arg(if name == "torch" { "libuv" } else { "legacy" });
            c
        }
        "raw-ping" | "raw-get" => {
            let mut c = Command::new(std::env::current_exe()?);
            let (req, reply) = if name == "raw-ping" {
                (5, 4)
            } else {
                (GET_REQ_LEN, 40)
            };
            c.args(["echo", &req.to_string(), &reply.to_string()]);
            c
        }
        other => bail!("unknown server {other}"),
    };
    if let Some(cpu) = cpu {
        let program = cmd.get_program().to_owned();
        let rest: Vec<_> = cmd.get_args().map(|a| a.to_owned()).collect();
        let envs: Vec<_> = cmd
            .get_envs()
            .filter_map(|(k, v)| Some((k.to_owned(), v?.to_owned())))
            .collect();
        cmd = Command::new("taskset");
        cmd.args(["-c", &cpu.to_string()])
            .arg(program)
            .args(rest)
            .envs(envs);
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {name} (build rally with --release first)"))?;
    let mut out = child.stdout.take().context("stdout")?;
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while out.read(&mut b)? == 1 && b[0] != b'\n' {
        line.push(b[0]);
    }
    let line = String::from_utf8_lossy(&line).into_owned();
    let port: u16 = if let Some(p) = line.strip_prefix("PORT ") {
        p.trim().parse()?
    } else if let Some(a) = line.strip_prefix("rally store listening on ") {
        a.trim().parse::<SocketAddr>()?.port()
    } else {
        bail!("{name} printed {line:?}");
    };
    Ok(Target {
        name: name.to_owned(),
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
    })
}

/// Size of the latency test's GET request (`GET "/lat"`).
pub(crate) const GET_REQ_LEN: usize = 1 + 8 + 4;

/// The latency baseline: a raw TCP echo of fixed sizes (read `req_len` bytes, write
/// `reply_len`) on one epoll-driven thread, the way both store servers wait for
/// input, so the comparison isolates protocol handling from how the machine wakes
/// threads (a thread blocked in `read` wakes ten times slower here).
pub(crate) fn async_echo(req_len: usize, reply_len: usize) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        println!("PORT {}", l.local_addr()?.port());
        loop {
            let (mut s, _) = l.accept().await?;
            s.set_nodelay(true)?;
            tokio::spawn(async move {
                let mut req = vec![0u8; req_len];
                let reply = vec![0u8; reply_len];
                while s.read_exact(&mut req).await.is_ok() {
                    if s.write_all(&reply).await.is_err() {
                        return;
                    }
                }
            });
        }
    })
}

/// CPU time (user + system) the process has used.
pub(crate) fn cpu_time(pid: u32) -> Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')').context("stat format")? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>()? + f[12].parse::<u64>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    Ok(Duration::from_micros(ticks * 1_000_000 / hz))
}

pub(crate) fn rss_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .context("no VmRSS")?;
    Ok(line
        .split_whitespace()
        .nth(1)
        .context("VmRSS value")?
        .parse()?)
}
