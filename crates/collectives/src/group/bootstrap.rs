//! Forming a group: from a store (`ProcessGroup::new`), a URL or the
//! environment, and the address peers connect to.

use std::net::{IpAddr, Ipv4Addr, ToSocketAddrs};
use std::sync::Arc;

use rallypoint_auth::JobSecret;
use rallypoint_store::{PrefixStore, Store};
use tokio::net::TcpListener;

use super::ProcessGroup;
use crate::error::{Error, Result};
use crate::frame::MAX_PAYLOAD;
use crate::op::Comm;
use crate::options::Options;
use crate::plan::{self};
use crate::transport::{Config, Members, Transport};

pub(super) fn setup_err(group: String) -> impl Fn(String) -> Error {
    move |reason| Error::Setup {
        group: group.clone(),
        reason,
    }
}

/// A rank in the group and options a group can use, or why not.
pub(super) fn check_args(rank: usize, size: usize, opts: &Options) -> Result<()> {
    if size == 0 || rank >= size {
        return Err(Error::Invalid(format!(
            "rank {rank} is not in a group of {size}"
        )));
    }
    if opts.segment_bytes < 8 || opts.segment_bytes as u64 > MAX_PAYLOAD {
        return Err(Error::Invalid(format!(
            "segment_bytes {} is outside 8..={MAX_PAYLOAD}",
            opts.segment_bytes
        )));
    }
    Ok(())
}

/// What forming a group or a generation starts with: its arguments
/// checked (the job secret read), the store under the group's prefix, and
/// a listener on the address peers will reach (`opts.advertise`, else
/// [`default_ip`]).
pub(super) async fn set_up(
    store: Arc<dyn Store>,
    rank: usize,
    size: usize,
    opts: &Options,
) -> Result<(Arc<dyn Store>, TcpListener, Option<JobSecret>)> {
    check_args(rank, size, opts)?;
    let secret = job_secret(opts)?;
    let name = &opts.prefix;
    let store: Arc<dyn Store> = Arc::new(PrefixStore::new(
        format!("rallypoint/collectives/{name}"),
        store,
    ));
    let ip = opts.advertise.unwrap_or_else(default_ip);
    let listener = TcpListener::bind((ip, 0))
        .await
        .map_err(|e| setup_err(name.clone())(format!("listening on {ip}: {e}")))?;
    Ok((store, listener, secret))
}

/// The job secret `opts` name, or why there is none to be had (a bad
/// `RALLY_JOB_SECRET_FILE`).
fn job_secret(opts: &Options) -> Result<Option<JobSecret>> {
    opts.secret.clone().map_err(|e| Error::Setup {
        group: opts.prefix.clone(),
        reason: format!("reading the job secret: {e}"),
    })
}

/// A transport's settings: `rank` of `world`, the instance's `nonce`, the
/// job secret `set_up` read, and the rest from `opts`.
pub(super) fn transport_config(
    opts: &Options,
    secret: Option<JobSecret>,
    name: String,
    rank: usize,
    world: usize,
    nonce: u64,
) -> Config {
    Config {
        name,
        rank,
        world,
        nonce,
        layout: opts.layout_hash(),
        streams: opts.streams_per_peer.max(1),
        probe_after: opts.probe_after,
        handshake_timeout: opts.handshake_timeout,
        peer_timeout: opts.peer_timeout,
        segment_bytes: opts.segment_bytes,
        receive_window: opts.receive_window as u64,
        secret,
    }
}

/// The generation record rank 0 publishes: the group's nonce (16 hex
/// digits, as ever without a secret), and with a job secret its key id (a
/// public fingerprint, the one logs show), so that a rank holding another
/// secret, or none where rank 0 holds one, fails forming the group at once
/// and says so, rather than at its first connection. A hint only: the
/// handshake on every connection is what keeps the secret's outsiders out.
fn generation_record(nonce: u64, secret: Option<&JobSecret>) -> String {
    match secret {
        None => format!("{nonce:016x}"),
        Some(s) => format!("{nonce:016x} key {}", s.key_id()),
    }
}

/// The nonce of rank 0's generation record, if this rank's job secret
/// (`secret`) agrees with the one the record names; else why not.
fn read_generation(record: &str, secret: Option<&JobSecret>) -> std::result::Result<u64, String> {
    let (nonce, theirs) = match record.split_once(" key ") {
        Some((nonce, key)) => (nonce, Some(key)),
        None => (record, None),
    };
    let nonce = u64::from_str_radix(nonce, 16)
        .map_err(|_| format!("bad generation {record:?} in the store"))?;
    let ours = secret.map(|s| s.key_id().to_string());
    match (theirs, ours.as_deref()) {
        (None, None) => Ok(nonce),
        (Some(theirs), Some(ours)) if theirs == ours => Ok(nonce),
        (Some(theirs), Some(ours)) => Err(format!(
            "rank 0 holds a different job secret (its key id {theirs}, ours {ours}): every rank of the job must read the same secret file"
        )),
        (Some(theirs), None) => Err(format!(
            "rank 0 holds a job secret (key id {theirs}) and this rank none: give every rank the job's secret file (RALLY_JOB_SECRET_FILE)"
        )),
        (None, Some(ours)) => Err(format!(
            "this rank holds a job secret (key id {ours}) and rank 0 none: give every rank the same secret file, or none"
        )),
    }
}

/// The local address on the route to `host`.
pub fn route_ip(host: &str) -> Option<IpAddr> {
    let to = (host, 9).to_socket_addrs().ok()?.next()?;
    rallypoint_store::host::source_addr_towards(to)
}

/// The host of `host:port` or `[v6]:port`.
pub(super) fn host_of(authority: &str) -> &str {
    if let Some(rest) = authority.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    authority.rsplit_once(':').map_or(authority, |(h, _)| h)
}

pub(super) fn default_ip() -> IpAddr {
    // Behind a job secret, `MASTER_ADDR` is the agent's loopback proxy to
    // the job store, and `RALLY_JOB_STORE_HOST` the store's own host.
    std::env::var("RALLY_JOB_STORE_HOST")
        .ok()
        .and_then(|h| route_ip(&h))
        .or_else(|| std::env::var("MASTER_ADDR").ok().and_then(|h| route_ip(&h)))
        .or_else(|| route_ip(&rallypoint_store::host::advertised_addr()))
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

impl ProcessGroup {
    /// Forms a group of `size` ranks through `store`, as rank `rank`.
    ///
    /// Binds a listener, publishes its address under the group's prefix and
    /// returns without waiting for the others: connections open when an
    /// operation first needs them. Rank 0 publishes the group's generation (a
    /// random nonce); a prefix that already holds one is an error, so stale keys
    /// of an earlier group are never mistaken for this one's.
    pub async fn new(
        store: Arc<dyn Store>,
        rank: usize,
        size: usize,
        opts: Options,
    ) -> Result<ProcessGroup> {
        let (store, listener, secret) = set_up(store, rank, size, &opts).await?;
        let name = opts.prefix.clone();
        let err = setup_err(name.clone());
        let addr = listener.local_addr().map_err(|e| err(e.to_string()))?;
        let store_err = |what: &str, e: rallypoint_store::StoreError| err(format!("{what}: {e}"));

        let nonce = if rank == 0 {
            let mine = generation_record(fastrand::u64(1..), secret.as_ref());
            let now = store
                .compare_set("generation", b"", mine.as_bytes())
                .await
                .map_err(|e| store_err("publishing the generation", e))?;
            if now != mine.as_bytes() {
                return Err(err(format!(
                    "the prefix already holds a group (generation {}); form a new group under a new prefix",
                    String::from_utf8_lossy(&now)
                )));
            }
            mine
        } else {
            store
                .wait_timeout(&["generation"], opts.timeout)
                .await
                .map_err(|e| store_err("waiting for rank 0 to publish the generation", e))?;
            String::from_utf8_lossy(
                &store
                    .get_now("generation")
                    .await
                    .map_err(|e| store_err("reading the generation", e))?,
            )
            .into_owned()
        };
        let nonce = read_generation(&nonce, secret.as_ref()).map_err(&err)?;
        let me = addr.to_string();
        let key = format!("addr/{rank}");
        let now = store
            .compare_set(&key, b"", me.as_bytes())
            .await
            .map_err(|e| store_err("publishing this rank's address", e))?;
        if now != me.as_bytes() {
            return Err(err(format!(
                "rank {rank} is already taken under this prefix (by {}): two processes with one rank, or an earlier group",
                String::from_utf8_lossy(&now)
            )));
        }
        let cfg = transport_config(&opts, secret, name.clone(), rank, size, nonce);
        let t = Transport::start(cfg, store, listener).map_err(|e| err(e.to_string()))?;
        let members = Members {
            name,
            ranks: (0..size).collect(),
        };
        t.shared.register_members(0, members.clone());
        if size >= 2 {
            let entry = plan::host_entry(rank, opts.shared_memory, opts.host_id.as_deref());
            t.shared
                .store()
                .set(&format!("host/{rank}"), entry.as_bytes())
                .await
                .map_err(|e| store_err("publishing this rank's host", e))?;
        }
        Ok(ProcessGroup::with_comm(Comm::new(
            Arc::new(t),
            0,
            members,
            rank,
            Arc::new(opts),
        )))
    }

    /// Forms a group through PyTorch's URL init: `env://` (the default under
    /// `rally run`: `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`),
    /// `tcp://host:port?rank=R&world_size=N` or `file:///path?rank=R&world_size=N`.
    ///
    /// Under `rally run` the prefix gets the restart count
    /// (`TORCHELASTIC_RESTART_COUNT`), so each round of an elastic job forms a
    /// fresh group on the job's store.
    pub async fn from_url(url: &str, mut opts: Options) -> Result<ProcessGroup> {
        let args = rallypoint_rendezvous::init::InitArgs {
            timeout: opts.timeout.min(rallypoint_store::DEFAULT_TIMEOUT),
            ..Default::default()
        };
        let err = setup_err(opts.prefix.clone());
        let mut rdzv =
            rallypoint_rendezvous::init::rendezvous(url, args).map_err(|e| err(e.to_string()))?;
        let r = rdzv.next().await.map_err(|e| err(e.to_string()))?;
        if let Ok(n) = std::env::var("TORCHELASTIC_RESTART_COUNT") {
            opts.prefix = format!("round{n}/{}", opts.prefix);
        }
        if opts.advertise.is_none() {
            let from_url = rallypoint_rendezvous::url::Url::parse(url)
                .ok()
                .filter(|u| u.scheme == "tcp")
                .map(|u| host_of(&u.authority).to_owned());
            if let Some(host) = from_url.or_else(|| std::env::var("MASTER_ADDR").ok()) {
                opts.advertise = route_ip(&host);
            }
        }
        ProcessGroup::new(r.store, r.rank, r.world_size, opts).await
    }

    /// [`ProcessGroup::from_url`] with `env://`.
    pub async fn from_env(opts: Options) -> Result<ProcessGroup> {
        ProcessGroup::from_url("env://", opts).await
    }

    pub(super) fn with_comm(comm: Comm) -> ProcessGroup {
        ProcessGroup {
            timeout: comm.opts.timeout,
            comm: Arc::new(comm),
            plan: Arc::default(),
            all_reduce_algo: None,
            broadcast_algo: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(byte: u8) -> JobSecret {
        JobSecret::from_bytes(vec![byte; 32]).unwrap()
    }

    #[test]
    fn without_a_secret_the_generation_record_is_as_it_was() {
        assert_eq!(generation_record(0xab, None), "00000000000000ab");
        assert_eq!(read_generation("00000000000000ab", None), Ok(0xab));
        let bad = read_generation("zz", None).unwrap_err();
        assert_eq!(bad, "bad generation \"zz\" in the store");
    }

    #[test]
    fn the_generation_record_tells_a_rank_with_another_secret_or_none() {
        let (a, b) = (secret(1), secret(2));
        let (ka, kb) = (a.key_id(), b.key_id());
        let record = generation_record(7, Some(&a));
        assert_eq!(record, format!("0000000000000007 key {ka}"));
        assert_eq!(read_generation(&record, Some(&a)), Ok(7));
        let cases = [
            (
                read_generation(&record, Some(&b)),
                format!("rank 0 holds a different job secret (its key id {ka}, ours {kb}): every rank of the job must read the same secret file"),
            ),
            (
                read_generation(&record, None),
                format!("rank 0 holds a job secret (key id {ka}) and this rank none: give every rank the job's secret file (RALLY_JOB_SECRET_FILE)"),
            ),
            (
                read_generation(&generation_record(7, None), Some(&b)),
                format!("this rank holds a job secret (key id {kb}) and rank 0 none: give every rank the same secret file, or none"),
            ),
        ];
        for (got, want) in cases {
            assert_eq!(got, Err(want));
        }
    }
}
