//! The registry's `c10d` creators (a TCP store at the endpoint, or a file
//! store with `store_type=file`) and the node's id and advertised address.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

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

/// The address this node advertises: `--local-addr`, else `$HOSTNAME`, else
/// `localhost`.
pub fn advertised_addr(p: &RendezvousParameters) -> String {
    p.local_addr
        .clone()
        .unwrap_or_else(|| std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into()))
}

/// The registry's creator for `c10d`: a TCP store at the endpoint (default port
/// 29400), hosted by this node when `is_host` says so (or the endpoint is this
/// machine and the port is free), else a client.
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
        let read_timeout = p.get_as_secs("read_timeout", Duration::from_secs(60))?;
        let local = matches!(host.as_str(), "localhost" | "127.0.0.1" | "::1" | "")
            || std::env::var("HOSTNAME").is_ok_and(|h| h == host);
        let is_host = p.get_as_bool("is_host")?.unwrap_or(local);
        let connect = |master: bool| {
            TcpStore::builder(host.clone(), port)
                .is_master(master)
                .timeout(read_timeout)
                .connect()
        };
        let store = match is_host {
            true => match connect(true).await {
                Ok(s) => s,
                // Somebody else hosts it (or the port is taken): be a client.
                Err(_) => connect(false).await.map_err(conn(&p.run_id))?,
            },
            false => connect(false).await.map_err(conn(&p.run_id))?,
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
