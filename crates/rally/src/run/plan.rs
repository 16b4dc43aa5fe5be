//! The run's plan: `rally run`'s flags turned into the agent's [`AgentSpec`]
//! and the rendezvous parameters, every value checked before anything
//! starts. Flags rally does not support are errors here rather than being
//! ignored, and each error names its flag.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{bail, Context};
use rallypoint_elastic::agent::AgentSpec;
use rallypoint_elastic::multiprocessing::signals::parse_signals;
use rallypoint_elastic::multiprocessing::watchdog;
use rallypoint_elastic::multiprocessing::{LogsSpec, PerRank, DEFAULT_PREFIX_TEMPLATE};
use rallypoint_rendezvous::RendezvousParameters;

use super::args::RunArgs;
use super::{entrypoint, numa_binding, rendezvous};

/// Everything the flags decide, checked.
pub(super) struct Plan {
    pub(super) spec: AgentSpec,
    pub(super) params: RendezvousParameters,
    pub(super) min_nodes: usize,
    pub(super) max_nodes: usize,
}

/// The plan of `a`, or the first flag that is wrong.
pub(super) fn plan(a: &RunArgs) -> anyhow::Result<Plan> {
    check_supported(a)?;
    check_seconds(a)?;
    let nodes = rendezvous::parse_nnodes(&a.nnodes)?;
    let nproc = parse_nproc(&a.nproc_per_node)?;
    let rdzv = rendezvous::plan(a, nodes)?;
    let signals = parse_signals(&a.signals_to_handle)
        .map_err(|e| anyhow::anyhow!("--signals-to-handle {:?}: {e}", a.signals_to_handle))?;
    let shutdown = shutdown_timeout(a)?;
    let logs = logs(a)?;
    let (entrypoint, args) = entrypoint::entrypoint(a)?;
    let numa = match &a.numa_binding {
        Some(mode) => numa_binding::bindings(mode, nproc)?,
        None => Vec::new(),
    };
    let spec = AgentSpec {
        role: a.role.clone(),
        local_world_size: nproc,
        entrypoint,
        args,
        max_restarts: a.max_restarts,
        monitor_interval: Duration::from_secs_f64(a.monitor_interval),
        logs,
        signals,
        shutdown_timeout: Duration::from_secs(shutdown),
        exit_barrier_timeout: Duration::from_secs_f64(a.exit_barrier_timeout),
        lost_grace: rdzv.lost_grace,
        virtual_local_rank: a.virtual_local_rank,
        hostname: rallypoint_elastic::multiprocessing::hostname(),
        local_addr: a.local_addr.clone(),
        mark: Some(watchdog::new_mark()),
        stack_dump: (!a.no_stack_dump).then(|| Duration::from_secs_f64(a.stack_dump_timeout)),
        numa,
    };
    Ok(Plan {
        spec,
        params: rdzv.params,
        min_nodes: rdzv.min_nodes,
        max_nodes: rdzv.max_nodes,
    })
}

/// torchrun flags rally accepts but cannot honour yet: an error, not a
/// silent difference.
fn check_supported(a: &RunArgs) -> anyhow::Result<()> {
    if !a.duplicate_stdout_filters.is_empty() || !a.duplicate_stderr_filters.is_empty() {
        bail!("--duplicate-stdout-filters/--duplicate-stderr-filters are not supported by rally run yet");
    }
    if let Some(s) = &a.logs_specs {
        bail!("--logs-specs {s:?}: Python entry points cannot be loaded by rally run; use --log-dir, -r and -t");
    }
    Ok(())
}

/// Every flag given in seconds is a positive number.
fn check_seconds(a: &RunArgs) -> anyhow::Result<()> {
    for (flag, v) in [
        ("--monitor-interval", a.monitor_interval),
        ("--exit-barrier-timeout", a.exit_barrier_timeout),
        ("--rdzv-lost-timeout", a.rdzv_lost_timeout.unwrap_or(1.0)),
        ("--stack-dump-timeout", a.stack_dump_timeout),
    ] {
        if !(v.is_finite() && v > 0.0) {
            bail!("{flag} {v}: expected a positive number of seconds");
        }
    }
    Ok(())
}

fn gpu_count() -> usize {
    rallypoint_elastic::devices::visible_gpus()
}

fn cpu_count() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `--nproc-per-node`: a number, `cpu`, `gpu` or `auto`.
fn parse_nproc(s: &str) -> anyhow::Result<usize> {
    let n = match s {
        "cpu" => cpu_count(),
        "gpu" => match gpu_count() {
            0 => bail!("--nproc-per-node gpu: no GPUs visible (driver listing /proc/driver/nvidia/gpus, CUDA_VISIBLE_DEVICES={:?})", std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "<unset>".into())),
            n => n,
        },
        "auto" => match gpu_count() {
            0 => cpu_count(),
            n => n,
        },
        "xpu" => bail!("--nproc-per-node xpu: XPU devices are not supported"),
        n => n.parse().ok().filter(|n| *n > 0).with_context(|| {
            format!("--nproc-per-node {n:?}: expected a positive number, cpu, gpu or auto")
        })?,
    };
    Ok(n)
}

/// Seconds between the stop signal and SIGKILL: the flag, else
/// `TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, else 30.
fn shutdown_timeout(a: &RunArgs) -> anyhow::Result<u64> {
    Ok(match a.shutdown_timeout {
        Some(s) => s,
        None => match std::env::var("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") {
            Ok(v) => v.trim().parse().with_context(|| {
                format!("TORCH_ELASTIC_SHUTDOWN_TIMEOUT={v:?} is not a number of seconds")
            })?,
            Err(_) => 30,
        },
    })
}

/// Where the workers' output goes: `--log-dir`, `-r`, `-t`, the local ranks
/// shown and the prefix of teed lines.
fn logs(a: &RunArgs) -> anyhow::Result<LogsSpec> {
    let local_ranks_filter = match a.local_ranks_filter.trim() {
        "" => None,
        s => Some(
            s.split(',')
                .map(|r| {
                    r.trim()
                        .parse::<usize>()
                        .with_context(|| format!("--local-ranks-filter {s:?}: {r:?} is not a rank"))
                })
                .collect::<anyhow::Result<BTreeSet<usize>>>()?,
        ),
    };
    Ok(LogsSpec {
        log_dir: a.log_dir.clone(),
        redirects: PerRank::parse(&a.redirects).map_err(|e| anyhow::anyhow!("--redirects: {e}"))?,
        tee: PerRank::parse(&a.tee).map_err(|e| anyhow::anyhow!("--tee: {e}"))?,
        local_ranks_filter,
        // As torchrun: the flag, else the variable, else the default.
        prefix_template: a
            .log_line_prefix_template
            .clone()
            .filter(|t| !t.is_empty())
            .or_else(|| {
                std::env::var("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
                    .ok()
                    .filter(|t| !t.is_empty())
            })
            .unwrap_or_else(|| DEFAULT_PREFIX_TEMPLATE.into()),
    })
}
