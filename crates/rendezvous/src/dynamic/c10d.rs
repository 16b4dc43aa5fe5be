//! The registry's `c10d` creators (a TCP store at the endpoint, or a file
//! store with `store_type=file`) and the node's id and advertised address.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rallypoint_store::TcpStore;

use super::state::Bounds;
use super::{conn, DynamicRendezvous, Timing, DEFAULT_PORT};
use crate::api::{
    BootstrapStoreInfo, Created, RendezvousError, RendezvousHandler, RendezvousParameters,
};

/// A node id unique within this process: `<addr>:<pid>:<n>`.
pub fn default_node_id(addr: &str) -> String {
    static LOCAL: AtomicU64 = AtomicU64::new(0);
    format!(
        "{addr}:{}:{}",
        std::process::id(),
        LOCAL.fetch_add(1, Ordering::Relaxed)
    )
}

/// The address this node advertises: `--local-addr`, else the address other
/// hosts reach this one at ([`rallypoint_store::host::advertised_addr`]: never
/// `localhost` while the host has another address).
pub fn advertised_addr(p: &RendezvousParameters) -> String {
    p.local_addr
        .clone()
        .unwrap_or_else(rallypoint_store::host::advertised_addr)
}

/// The registry's creator for `c10d`: a TCP store at the endpoint (default port
/// 29400), hosted by this node when `is_host` says so (or the endpoint names
/// this host, [`rallypoint_store::host::is_this_host`], and the port is free),
/// else a client.
pub fn create(p: RendezvousParameters) -> Created {
    Box::pin(async move {
        match p.get("store_type").map(str::to_ascii_lowercase).as_deref() {
            None | Some("tcp") => {}
            Some("file") => return create_on_file(p).await,
            Some(other) => {
                return Err(crate::api::config_error("store_type", other, "tcp or file"))
            }
        }
        let (host, port) = p.endpoint_host_port()?;
        let port = port.unwrap_or(DEFAULT_PORT);
        let timing = Timing::from_params(&p)?;
        let read_timeout = p.read_timeout()?;
        let is_host = match p.get_as_bool("is_host")? {
            Some(yes) => yes,
            None => {
                let h = host.clone();
                tokio::task::spawn_blocking(move || rallypoint_store::host::is_this_host(&h))
                    .await
                    .unwrap_or(false)
            }
        };
        let store = match is_host {
            // Whoever binds first hosts; the others join it.
            true => TcpStore::builder(host.clone(), port)
                .timeout(read_timeout)
                .host_or_join()
                .await
                .map_err(conn(&p.run_id))?,
            false => TcpStore::builder(host.clone(), port)
                .timeout(read_timeout)
                .connect()
                .await
                .map_err(conn(&p.run_id))?,
        };
        let endpoint = format!("{host}:{port}");
        let port = store.port();
        let hosts = store.server().is_some();
        let addr = advertised_addr(&p);
        let mut h = DynamicRendezvous::new(
            Arc::new(store),
            &p.run_id,
            default_node_id(&addr),
            Bounds {
                min: p.min_nodes,
                max: p.max_nodes,
            },
            timing,
            BootstrapStoreInfo {
                master_addr: host,
                master_port: port,
            },
        );
        if hosts {
            h = h.hosting_store();
        } else {
            h = h.served_by_peer();
        }
        Ok(Box::new(h.with_endpoint(endpoint)) as Box<dyn RendezvousHandler>)
    })
}

/// `store_type=file`: the rendezvous on a file store shared by every node (the
/// endpoint is its path; empty: a file in the temporary directory named after
/// the run). Workers cannot use a file store as their job store, so rank 0's
/// worker hosts one, as with etcd.
async fn create_on_file(
    p: RendezvousParameters,
) -> Result<Box<dyn RendezvousHandler>, RendezvousError> {
    let timing = Timing::from_params(&p)?;
    let path = match p.endpoint.as_str() {
        "" => std::env::temp_dir().join(format!("rally-rendezvous-{}", p.run_id)),
        e => std::path::PathBuf::from(e),
    };
    let store = rallypoint_store::FileStore::open(&path, -1)
        .await
        .map_err(conn(&p.run_id))?;
    Ok(Box::new(DynamicRendezvous::worker_hosted(
        Arc::new(store),
        &p,
        timing,
    )))
}
