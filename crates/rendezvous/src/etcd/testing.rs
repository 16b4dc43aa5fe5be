//! A throw-away etcd server on loopback, for tests and benchmarks: started from
//! Debian's `etcd-server` (or the binary named by `RALLY_ETCD`), killed and its
//! data removed on drop.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::EtcdStore;

/// A running etcd.
pub struct EtcdServer {
    child: Child,
    dir: PathBuf,
    /// `127.0.0.1:<client port>`.
    pub endpoint: String,
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

impl EtcdServer {
    /// Starts etcd and waits until it answers (up to 30 s).
    pub async fn start() -> std::io::Result<EtcdServer> {
        let bin = std::env::var("RALLY_ETCD").unwrap_or_else(|_| "etcd".into());
        let (client, peer) = (free_port()?, free_port()?);
        let dir = std::env::temp_dir().join(format!("rally-etcd-{}-{client}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let client_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let log = std::fs::File::create(dir.join("etcd.log"))?;
        let child = Command::new(&bin)
            .args(["--name", "t", "--data-dir"])
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &client_url])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("t={peer_url}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!("cannot start {bin:?} ({e}); install Debian's etcd-server or set RALLY_ETCD"),
                )
            })?;
        let server = EtcdServer {
            child,
            dir,
            endpoint: format!("127.0.0.1:{client}"),
        };
        let t0 = Instant::now();
        loop {
            let up = EtcdStore::connect(
                &[format!("http://{}", server.endpoint)],
                "/probe/",
                Duration::from_secs(1),
            )
            .await;
            match up {
                Ok(_) => return Ok(server),
                Err(e) if t0.elapsed() > Duration::from_secs(30) => {
                    let log =
                        std::fs::read_to_string(server.dir.join("etcd.log")).unwrap_or_default();
                    return Err(std::io::Error::other(format!(
                        "etcd did not come up ({e}): {log}"
                    )));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// A store on this server under `root`.
    pub async fn store(&self, root: &str) -> rallypoint_store::Result<EtcdStore> {
        EtcdStore::connect(
            &[format!("http://{}", self.endpoint)],
            root,
            Duration::from_secs(10),
        )
        .await
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
