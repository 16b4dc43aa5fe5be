//! The rendezvous half of `rally run`'s plan: the node counts, the backend,
//! endpoint and run id (`--standalone` picks all three), the backend's
//! options, and how long the rendezvous store may stay unreachable.
//!
//! torchrun's default run id, `none`, is the same for every job; a job that
//! would share an endpoint with others gets one that is not: the
//! scheduler's job id, else a random id for a single node. The `static`
//! backend's store is the job's own, at `--master-addr:--master-port`.

use std::time::Duration;

use anyhow::{bail, Context};
use rallypoint_rendezvous::static_tcp;
use rallypoint_rendezvous::RendezvousParameters;

use super::args::RunArgs;

/// What the rendezvous flags decide, checked.
pub(super) struct Rendezvous {
    pub(super) params: RendezvousParameters,
    pub(super) min_nodes: usize,
    pub(super) max_nodes: usize,
    /// How long the rendezvous store may stay unreachable (the agent's
    /// `lost_grace`).
    pub(super) lost_grace: Duration,
}

/// `N` or `MIN:MAX`.
pub(super) fn parse_nnodes(s: &str) -> anyhow::Result<(usize, usize)> {
    let parse = |v: &str| {
        v.trim()
            .parse::<usize>()
            .with_context(|| format!("--nnodes {s:?}: {v:?} is not a number of nodes"))
    };
    let (min, max) = match s.split_once(':') {
        Some((a, b)) => (parse(a)?, parse(b)?),
        None => {
            let n = parse(s)?;
            (n, n)
        }
    };
    if min == 0 || min > max {
        bail!("--nnodes {s:?}: need 0 < MIN <= MAX");
    }
    Ok((min, max))
}

/// The rendezvous of `a`, on `(min_nodes, max_nodes)` from `--nnodes`.
pub(super) fn plan(a: &RunArgs, nodes: (usize, usize)) -> anyhow::Result<Rendezvous> {
    let (mut min_nodes, mut max_nodes) = nodes;
    let (mut backend, mut endpoint, mut run_id) = (
        a.rdzv_backend.clone(),
        a.rdzv_endpoint.clone(),
        a.rdzv_id.clone(),
    );
    if a.standalone {
        backend = "c10d".into();
        endpoint = "localhost:0".into();
        run_id = random_run_id();
        (min_nodes, max_nodes) = (1, 1);
    } else if run_id == "none" {
        run_id = default_run_id(&backend, max_nodes);
    }
    let mut config = RendezvousParameters::parse_conf(&a.rdzv_conf)?;
    if backend == "static" {
        if endpoint.is_empty() {
            let port = a.master_port.unwrap_or(static_tcp::DEFAULT_PORT);
            endpoint = format!("{}:{port}", a.master_addr);
        }
        config.insert("rank".into(), a.node_rank.to_string());
        config
            .entry("timeout".into())
            .or_insert_with(|| "900".into());
    }
    let mut params = RendezvousParameters::new(&backend, &endpoint, &run_id, min_nodes, max_nodes)?;
    params.local_addr = a.local_addr.clone();
    params.config = config;
    let lost_grace = match a.rdzv_lost_timeout {
        Some(s) => Duration::from_secs_f64(s),
        None => lost_grace(&params)?,
    };
    Ok(Rendezvous {
        params,
        min_nodes,
        max_nodes,
        lost_grace,
    })
}

/// The store's read timeout
/// ([`DEFAULT_READ_TIMEOUT`](rallypoint_rendezvous::api::DEFAULT_READ_TIMEOUT)
/// unless `--rdzv-conf read_timeout` says), which must be positive here: a busy store is never
/// taken for a lost one.
fn lost_grace(params: &RendezvousParameters) -> anyhow::Result<Duration> {
    params
        .read_timeout()
        .ok()
        .filter(|d| !d.is_zero())
        .with_context(|| {
            let v = params.get("read_timeout").unwrap_or_default();
            format!("--rdzv-conf read_timeout={v}: expected seconds")
        })
}

/// The run id when none was given: torchrun's default id is the same for
/// every job; make one that is not.
fn default_run_id(backend: &str, max_nodes: usize) -> String {
    let scheduler = ["SLURM_JOB_ID", "LSB_JOBID", "PBS_JOBID", "FLUX_JOB_ID"]
        .iter()
        .find_map(|v| {
            std::env::var(v)
                .ok()
                .map(|id| format!("{}-{id}", v.to_lowercase()))
        });
    match (scheduler, max_nodes) {
        (Some(id), _) => id,
        (None, 1) => random_run_id(),
        // The static backend's store is the job's own (its port): no
        // other job shares it, and torchrun does not warn either.
        (None, _) if backend == "static" => "none".into(),
        (None, _) => {
            say!("rally run: warning: no --rdzv-id; jobs sharing this rendezvous endpoint will collide (run id \"none\")");
            "none".into()
        }
    }
}

/// A run id no other job will have: 128 random bits, uuid-shaped.
fn random_run_id() -> String {
    let mut b = [0u8; 16];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .is_err()
    {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        b = (t ^ (u128::from(std::process::id()) << 64)).to_le_bytes();
    }
    // Version 4, variant 1, like Python's uuid4().
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        run: RunArgs,
    }

    fn rendezvous(flags: &[&str]) -> anyhow::Result<Rendezvous> {
        let argv = ["rally"].iter().chain(flags).chain(&["train.py"]);
        let a = Cli::try_parse_from(argv)?.run;
        plan(&a, parse_nnodes(&a.nnodes)?)
    }

    #[test]
    fn nnodes_is_n_or_min_max() {
        assert_eq!(parse_nnodes("2").unwrap(), (2, 2));
        assert_eq!(parse_nnodes("1:4").unwrap(), (1, 4));
        for bad in ["0", "3:2", "x", "1:", ""] {
            assert!(parse_nnodes(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn static_store_defaults_to_torchruns_port() {
        let r = rendezvous(&["--nnodes", "2", "--node-rank", "1", "--rdzv-id", "j"]).unwrap();
        assert_eq!(r.params.endpoint, "127.0.0.1:29500");
        assert_eq!(r.params.get("rank"), Some("1"));
        let r = rendezvous(&["--nnodes", "2", "--master-port", "7", "--rdzv-id", "j"]).unwrap();
        assert_eq!(r.params.endpoint, "127.0.0.1:7");
    }

    #[test]
    fn lost_grace_is_the_read_timeout_unless_given() {
        let r = rendezvous(&[]).unwrap();
        assert_eq!(r.lost_grace, Duration::from_secs(60));
        let r = rendezvous(&["--rdzv-conf", "read_timeout=2.5"]).unwrap();
        assert_eq!(r.lost_grace, Duration::from_millis(2500));
        let r = rendezvous(&["--rdzv-conf", "read_timeout=x", "--rdzv-lost-timeout", "3"]);
        assert_eq!(r.unwrap().lost_grace, Duration::from_secs(3));
        for bad in ["0", "-1", "x", "inf"] {
            let e = rendezvous(&["--rdzv-conf", &format!("read_timeout={bad}")])
                .err()
                .unwrap_or_else(|| panic!("read_timeout={bad} accepted"));
            assert_eq!(
                e.to_string(),
                format!("--rdzv-conf read_timeout={bad}: expected seconds")
            );
        }
    }
}
