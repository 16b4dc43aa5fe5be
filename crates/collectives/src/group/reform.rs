//! A group that changes members: each generation formed over the
//! connections of the last ([`ProcessGroup::next_generation`]).
//!
//! The round, one store round per generation:
//!
//! 1. bind a spare listener (used only if this member starts a new
//!    transport) and publish this member's entry under `member/<rank>` in
//!    the generation's prefix (`lineage.rs` says what it holds);
//! 2. wait, within the timeout, for every member's entry, and read them;
//! 3. decide, the same on every member (`lineage::decide`): survivors keep
//!    their transport, and with it their connections to each other, its
//!    flow credit and the peers it found gone; a newcomer starts one on its
//!    spare listener;
//! 4. learn every member's address and host from the entries: no store
//!    lookup at the first op, and a keeper that knows a member's link at
//!    another address fails the round here (see `lineage.rs`).
//!
//! The generation is a group over the transport, like a subgroup: its own
//! id (from the lineage's nonce and the prefix), its own sequence of ops,
//! its own abort. Aborting the last generation (torchft's Manager does, on
//! a failure) fails its ops and leaves the transport to the next.
//! Connections open lazily as ever: between survivors they are open
//! already, so the next generation's first op opens one per newcomer.
//! Shared memory is per generation (a region is laid out for its members),
//! attached at the generation's first collective as for any group.

use std::sync::Arc;

use rallypoint_store::{Store, StoreError};

use super::bootstrap::{set_up, setup_err, transport_config};
use super::lineage::{decide, Entry, Held, MAX_GONE};
use super::ProcessGroup;
use crate::error::Result;
use crate::hash::{fnv1a, stable_hash};
use crate::op::Comm;
use crate::options::Options;
use crate::plan;
use crate::transport::{Members, Transport};

/// The world of a transport a lineage's generations share: every link id
/// (32 bits, drawn at random) is below it, and the hello says it, so that
/// a lineage's transport never talks with a group's formed by
/// [`ProcessGroup::new`].
pub(crate) const LINK_SPACE: usize = u32::MAX as usize;

/// Tags the ids of generations (see [`generation_id`]).
const GENERATION_TAG: u64 = 0x6765_6e65_7261_7465;

/// A generation's group id: every member computes the same from the
/// lineage's nonce and the generation's prefix (fresh each generation).
fn generation_id(nonce: u64, prefix: &str) -> u64 {
    stable_hash(&[GENERATION_TAG, nonce, fnv1a(prefix.bytes())]) | 1
}

impl ProcessGroup {
    /// Forms the next generation of a group whose members change, as rank
    /// `rank` of `size`, under `opts.prefix` (fresh each generation, as
    /// torchft's quorum ids make it) on `store`.
    ///
    /// `prev` is this process's group of the last generation it took part
    /// in (`None` at the first): where the other members held the same
    /// lineage, its connections to them are kept, so only newcomers
    /// connect. Members may come and go between generations; a member
    /// that another found gone (stopped past its keep-alive) starts anew.
    /// See the module's doc for the round. A member that does not publish
    /// its entry within `opts.timeout` fails the round, named. `prev` is
    /// left as it was (its ops run on; abort it to fail them).
    pub async fn next_generation(
        prev: Option<&ProcessGroup>,
        store: Arc<dyn Store>,
        rank: usize,
        size: usize,
        opts: Options,
    ) -> Result<ProcessGroup> {
        let (store, spare, secret) = set_up(store, rank, size, &opts).await?;
        let name = opts.prefix.clone();
        let err = setup_err(name.clone());
        let prev = prev
            .map(|p| p.comm.t.clone())
            .filter(|t| t.shared.cfg.world == LINK_SPACE && !t.shared.is_dead());
        let spare_addr = spare.local_addr().map_err(|e| err(e.to_string()))?;
        let (proposed, fresh) = draw(spare_addr);
        let host = plan::host_entry(
            proposed as usize,
            opts.shared_memory,
            opts.host_id.as_deref(),
        );
        let (pid, host) = host.split_once(' ').expect("a host entry is \"pid key\"");
        let mine = Entry {
            held: prev.as_ref().map(|t| held(t, &name)),
            spare: spare_addr,
            link: proposed,
            fresh,
            pid: pid.parse().expect("a pid"),
            host: host.to_owned(),
        };
        let entries = round(&store, rank, size, &mine, &opts)
            .await
            .map_err(&err)?;
        let d = decide(&entries, &name).map_err(&err)?;
        let me = &d.members[rank];
        let t = match prev.filter(|_| me.keeps) {
            Some(t) => {
                t.shared.set_store(store);
                t
            }
            None => {
                let cfg = transport_config(
                    &opts,
                    secret,
                    d.name.clone(),
                    me.link as usize,
                    LINK_SPACE,
                    d.nonce,
                );
                Arc::new(Transport::start(cfg, store, spare).map_err(|e| err(e.to_string()))?)
            }
        };
        for (g, (m, e)) in d.members.iter().zip(&entries).enumerate() {
            let learnt = t
                .shared
                .learn_peer(m.link as usize, m.addr, (e.pid, e.host.clone()));
            if let (Err(known), true) = (learnt, g != rank) {
                return Err(err(format!(
                    "group rank {g}'s link {:08x} is at {}, but this member knew that link at {known}: a link id drawn twice in the lineage; the next generation draws anew",
                    m.link, m.addr
                )));
            }
        }
        let members = Members {
            name: name.clone(),
            ranks: d.members.iter().map(|m| m.link as usize).collect(),
        };
        let id = generation_id(d.nonce, &name);
        t.shared.register_members(id, members.clone());
        Ok(ProcessGroup::with_comm(Comm::new(
            t,
            id,
            members,
            rank,
            Arc::new(opts),
        )))
    }

    /// Connections this rank's transport has established with peers
    /// (opened or accepted), over every generation that shared it: a
    /// membership change adds one per newcomer, none between survivors.
    pub fn handshakes(&self) -> u64 {
        self.comm.sh().handshakes()
    }
}

/// A link id to propose and a fresh lineage's nonce: random, mixed with
/// what no other process on this host shares (its pid, its spare port), so
/// that processes forked with one generator's state still draw apart.
fn draw(spare: std::net::SocketAddr) -> (u32, u64) {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mix = |salt: u64| {
        stable_hash(&[
            salt,
            fastrand::u64(..),
            u64::from(std::process::id()),
            u64::from(spare.port()),
            nanos,
        ])
    };
    let link = (mix(1) % u64::from(u32::MAX)) as u32;
    (link, mix(2).max(1))
}

/// What this member's transport holds, for its entry.
fn held(t: &Transport, name: &str) -> Held {
    let sh = &t.shared;
    let gone: Vec<u32> = sh.gone_peers().into_iter().map(|p| p as u32).collect();
    if gone.len() > MAX_GONE {
        tracing::debug!(
            group = name,
            gone = gone.len(),
            "publishing the first {MAX_GONE} peers found gone"
        );
    }
    Held {
        nonce: sh.cfg.nonce,
        link: sh.cfg.rank as u32,
        addr: sh.local_addr,
        name: sh.cfg.name.clone(),
        gone,
    }
}

/// Publishes this member's entry and reads every member's (in group-rank
/// order), within the timeout.
async fn round(
    store: &Arc<dyn Store>,
    rank: usize,
    size: usize,
    mine: &Entry,
    opts: &Options,
) -> std::result::Result<Vec<Entry>, String> {
    let text = mine.encode();
    let key = format!("member/{rank}");
    let now = store
        .compare_set(&key, b"", text.as_bytes())
        .await
        .map_err(|e| format!("publishing this member's entry: {e}"))?;
    if now != text.as_bytes() {
        return Err(format!(
            "group rank {rank} is already taken under this prefix: two processes with one rank, or an earlier generation's prefix"
        ));
    }
    let keys: Vec<String> = (0..size).map(|g| format!("member/{g}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    match store.wait_timeout(&refs, opts.timeout).await {
        Ok(()) => {}
        Err(StoreError::Timeout { .. }) => {
            let mut missing = Vec::new();
            for (g, k) in refs.iter().enumerate() {
                if !store.check(&[k]).await.unwrap_or(false) {
                    missing.push(g.to_string());
                }
            }
            return Err(format!(
                "group rank(s) {} of {size} never published their entry within {:?} (not started, or died in the round)",
                missing.join(", "),
                opts.timeout
            ));
        }
        Err(e) => return Err(format!("waiting for the members' entries: {e}")),
    }
    let raw = store
        .multi_get(&refs)
        .await
        .map_err(|e| format!("reading the members' entries: {e}"))?;
    raw.iter()
        .enumerate()
        .map(|(g, r)| Entry::decode(r).map_err(|e| format!("group rank {g}'s entry: {e}")))
        .collect()
}
