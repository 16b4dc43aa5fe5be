//! Worker rank assignment across nodes in O(n), and each worker's environment.
//!
//! Every agent writes its role and local world size under
//! `role_info/<group_rank>`; agent 0 reads them all in one `multi_get`, computes
//! each node's base global rank and role rank by prefix sums in group-rank order,
//! and writes them back in one `multi_set`; the others read their own entry. So a
//! node costs O(1) store operations and agent 0 O(n) bytes, as in PyTorch.

use std::collections::{BTreeMap, HashMap};

use rallypoint_store::{Store, StoreError};

/// Where one node's workers sit in the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NodeRanks {
    /// Global rank of this node's local rank 0.
    pub base_rank: usize,
    /// All workers of the job.
    pub world_size: usize,
    /// Role rank of this node's local rank 0.
    pub base_role_rank: usize,
    /// Workers with this node's role.
    pub role_world_size: usize,
}

/// Prefix sums over `(role, local_world_size)` per group rank.
pub fn compute(nodes: &[(String, usize)]) -> Vec<NodeRanks> {
    let world_size = nodes.iter().map(|n| n.1).sum();
    let mut role_world: HashMap<&str, usize> = HashMap::new();
    for (role, n) in nodes {
        *role_world.entry(role).or_default() += n;
    }
    let mut role_next: HashMap<&str, usize> = HashMap::new();
    let mut next = 0;
    nodes
        .iter()
        .map(|(role, n)| {
            let base_role_rank = role_next.entry(role).or_default();
            let r = NodeRanks {
                base_rank: next,
                world_size,
                base_role_rank: *base_role_rank,
                role_world_size: role_world[role.as_str()],
            };
            next += n;
            *base_role_rank += n;
            r
        })
        .collect()
}

fn bad(key: &str, v: &[u8]) -> StoreError {
    StoreError::UnexpectedReply {
        op: "assign worker ranks",
        addr: key.to_owned(),
        reply: format!("{:?}", String::from_utf8_lossy(v)),
    }
}

/// Agrees on this node's ranks with the others through `store`, under `prefix`.
pub async fn assign(
    store: &dyn Store,
    prefix: &str,
    group_rank: usize,
    group_world_size: usize,
    role: &str,
    local_world_size: usize,
) -> Result<NodeRanks, StoreError> {
    store
        .set(
            &format!("{prefix}/role_info/{group_rank}"),
            format!("{local_world_size} {role}").as_bytes(),
        )
        .await?;
    let mine = format!("{prefix}/assigned_ranks/{group_rank}");
    if group_rank == 0 {
        let keys: Vec<String> = (0..group_world_size)
            .map(|i| format!("{prefix}/role_info/{i}"))
            .collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let infos = store.multi_get(&refs).await?;
        let nodes = infos
            .iter()
            .zip(&keys)
            .map(|(v, k)| {
                let s = String::from_utf8_lossy(v);
                let (n, role) = s.split_once(' ').ok_or_else(|| bad(k, v))?;
                Ok((role.to_owned(), n.parse().map_err(|_| bad(k, v))?))
            })
            .collect::<Result<Vec<(String, usize)>, StoreError>>()?;
        let ranks = compute(&nodes);
        let out: Vec<(String, String)> = ranks
            .iter()
            .enumerate()
            .map(|(i, r)| {
                (
                    format!("{prefix}/assigned_ranks/{i}"),
                    format!(
                        "{} {} {} {}",
                        r.base_rank, r.world_size, r.base_role_rank, r.role_world_size
                    ),
                )
            })
            .collect();
        let pairs: Vec<(&str, &[u8])> = out
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_bytes()))
            .collect();
        store.multi_set(&pairs).await?;
        return Ok(ranks[0]);
    }
    let v = store.get(&mine).await?;
    let s = String::from_utf8_lossy(&v);
    let f: Vec<usize> = s
        .split(' ')
        .map(str::parse)
        .collect::<Result<_, _>>()
        .map_err(|_| bad(&mine, &v))?;
    match f[..] {
        [base_rank, world_size, base_role_rank, role_world_size] => Ok(NodeRanks {
            base_rank,
            world_size,
            base_role_rank,
            role_world_size,
        }),
        _ => Err(bad(&mine, &v)),
    }
}

/// What a worker's environment is made from.
#[derive(Debug, Clone)]
pub struct WorkerContext<'a> {
    pub role: &'a str,
    pub local_world_size: usize,
    pub group_rank: usize,
    pub group_world_size: usize,
    pub ranks: NodeRanks,
    pub master_addr: &'a str,
    pub master_port: u16,
    pub restart_count: u64,
    pub max_restarts: u32,
    pub run_id: &'a str,
    pub use_agent_store: bool,
    pub virtual_local_rank: bool,
}

/// The variables torchrun sets for local rank `local_rank` (the error file is
/// added by the process launcher).
pub fn worker_env(c: &WorkerContext<'_>, local_rank: usize) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    let mut put = |k: &str, v: String| {
        env.insert(k.to_owned(), v);
    };
    let local = if c.virtual_local_rank { 0 } else { local_rank };
    put("LOCAL_RANK", local.to_string());
    put("RANK", (c.ranks.base_rank + local_rank).to_string());
    put("GROUP_RANK", c.group_rank.to_string());
    put(
        "ROLE_RANK",
        (c.ranks.base_role_rank + local_rank).to_string(),
    );
    put("ROLE_NAME", c.role.to_owned());
    put("LOCAL_WORLD_SIZE", c.local_world_size.to_string());
    put("WORLD_SIZE", c.ranks.world_size.to_string());
    put("GROUP_WORLD_SIZE", c.group_world_size.to_string());
    put("ROLE_WORLD_SIZE", c.ranks.role_world_size.to_string());
    put("MASTER_ADDR", c.master_addr.to_owned());
    put("MASTER_PORT", c.master_port.to_string());
    put("TORCHELASTIC_RESTART_COUNT", c.restart_count.to_string());
    put("TORCHELASTIC_MAX_RESTARTS", c.max_restarts.to_string());
    put("TORCHELASTIC_RUN_ID", c.run_id.to_owned());
    put(
        "TORCHELASTIC_USE_AGENT_STORE",
        if c.use_agent_store { "True" } else { "False" }.to_owned(),
    );
    put(
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        std::env::var("TORCH_NCCL_ASYNC_ERROR_HANDLING").unwrap_or_else(|_| "1".into()),
    );
    if c.virtual_local_rank {
        if let Ok(devices) = std::env::var("CUDA_VISIBLE_DEVICES") {
            if let Some(d) = devices.split(',').nth(local_rank) {
                put("CUDA_VISIBLE_DEVICES", d.to_owned());
            }
        } else {
            put("CUDA_VISIBLE_DEVICES", local_rank.to_string());
        }
    }
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_sums_follow_group_rank_order_per_role() {
        let nodes = vec![
            ("trainer".to_owned(), 2),
            ("ps".to_owned(), 1),
            ("trainer".to_owned(), 3),
        ];
        let r = compute(&nodes);
        assert_eq!(r.iter().map(|n| n.base_rank).collect::<Vec<_>>(), [0, 2, 3]);
        assert!(r.iter().all(|n| n.world_size == 6));
        assert_eq!(r[2].base_role_rank, 2);
        assert_eq!(r[2].role_world_size, 5);
        assert_eq!((r[1].base_role_rank, r[1].role_world_size), (0, 1));
    }

    #[tokio::test]
    async fn nodes_agree_through_a_store() {
        let store = std::sync::Arc::new(rallypoint_store::MemoryStore::new());
        let tasks: Vec<_> = (0..4)
            .map(|g| {
                let s = store.clone();
                tokio::spawn(async move { assign(&*s, "p", g, 4, "default", 2).await.unwrap() })
            })
            .collect();
        let mut bases = Vec::new();
        for t in tasks {
            bases.push(t.await.unwrap().base_rank);
        }
        assert_eq!(bases, [0, 2, 4, 6]);
    }
}
