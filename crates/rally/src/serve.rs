//! `rally store serve`: a standalone store server speaking PyTorch's TCPStore
//! protocol, on a runtime of the threads asked for, until Ctrl-C or SIGTERM.
//! The bound address is printed on stdout, where scripts read the port.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use anyhow::Context;
use rallypoint_rendezvous::static_tcp;
use rallypoint_store::protocol::Limits;
use rallypoint_store::server::{Server, ServerConfig};

#[derive(clap::Args)]
pub struct ServeArgs {
    /// Address to listen on; `::` (the default) also accepts IPv4 (dual-stack).
    #[arg(long, default_value = "::")]
    host: IpAddr,
    /// Port to listen on; 0 picks a free one. The bound address is printed.
    #[arg(long, default_value_t = static_tcp::DEFAULT_PORT)]
    port: u16,
    /// Longest key accepted, in bytes.
    #[arg(long, default_value_t = Limits::default().max_key_len)]
    max_key_len: u64,
    /// Longest value accepted, in bytes.
    #[arg(long, default_value_t = Limits::default().max_value_len)]
    max_value_len: u64,
    /// Worker threads (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    #[command(flatten)]
    secret: crate::secret::SecretArgs,
}

/// Serves until Ctrl-C or SIGTERM.
pub fn serve(args: ServeArgs) -> anyhow::Result<()> {
    args.secret.apply("rally store serve")?;
    // One thread means one thread: a current-thread runtime keeps the I/O driver
    // and the connection tasks together, with no hand-off between threads.
    let mut rt = match args.threads {
        Some(0 | 1) => tokio::runtime::Builder::new_current_thread(),
        Some(n) => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n);
            b
        }
        None => tokio::runtime::Builder::new_multi_thread(),
    };
    let rt = rt
        .enable_all()
        .build()
        .context("failed to start the runtime")?;
    rt.block_on(async move {
        let config = ServerConfig {
            limits: Limits {
                max_key_len: args.max_key_len,
                max_value_len: args.max_value_len,
                ..Limits::default()
            },
            shutdown_grace: Duration::from_secs(5),
            ..ServerConfig::default()
        };
        let addr = SocketAddr::new(args.host, args.port);
        let server = Server::bind(addr, config)
            .await
            .with_context(|| format!("failed to listen on {addr}"))?;
        // Scripts read this line to learn the port.
        println!("rally store listening on {}", server.local_addr());
        let handle = server.spawn();
        handle.run_until(shutdown_signal()).await;
        tracing::info!("store server stopped");
        anyhow::Ok(())
    })
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
