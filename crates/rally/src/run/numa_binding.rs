//! `--numa-binding`: where each local rank runs, near its GPU, read from
//! this machine's sysfs and said on the console before the workers start.

use anyhow::Context;
use rallypoint_elastic::numa;

/// Where each of `nproc` local ranks runs under `--numa-binding mode`, from
/// this machine's sysfs (`RALLY_SYSFS_ROOT`, for tests, holds another
/// machine's); printed on the console. No GPU: said, and unbound.
pub(super) fn bindings(mode: &str, nproc: usize) -> anyhow::Result<Vec<numa::Binding>> {
    let flag = || format!("--numa-binding {mode}");
    let parsed: numa::Mode = mode
        .parse()
        .map_err(|e: String| anyhow::anyhow!(e))
        .with_context(flag)?;
    let root = std::env::var_os("RALLY_SYSFS_ROOT").unwrap_or_else(|| "/".into());
    let topo = numa::Topology::new(root);
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let allowed = numa::allowed_cpus();
    let Some(mut bindings) =
        numa::plan(&topo, parsed, nproc, &allowed, visible.as_deref()).with_context(flag)?
    else {
        say!(
            "rally run: {}: this machine has no GPU to bind near; the workers run unbound",
            flag()
        );
        return Ok(Vec::new());
    };
    let memory = numa::memory_policy_allowed();
    for (rank, b) in bindings.iter_mut().enumerate() {
        if !memory {
            b.mem_nodes.clear();
        }
        say!(
            "rally run: {}: local rank {rank} (GPU {}, NUMA node {}) on CPUs {}{}",
            flag(),
            b.gpu,
            b.node,
            numa::format_list(&b.cpus),
            match b.mem_nodes.is_empty() {
                true => ", memory unbound (set_mempolicy is not permitted here)".to_owned(),
                false => format!(
                    ", memory preferred on node(s) {}",
                    numa::format_list(&b.mem_nodes)
                ),
            }
        );
    }
    Ok(bindings)
}
