//! `--job-secret-file PATH` (or `RALLY_JOB_SECRET_FILE`), the same on `rally
//! run`, `rally store serve` and `rally lighthouse`: the opt-in job secret of
//! issue 49 ([`rallypoint_auth`]). The file is read once at start (refused
//! if group or others may read it, or if it holds under 16 bytes), and the
//! secret becomes the process's ([`rallypoint_store::secret`]): every store
//! server and client it makes proves it. Only its public key id is ever
//! printed.

use std::path::PathBuf;

use anyhow::Context;
use rallypoint_store::secret::{self, JobSecret};

/// The flag, for `#[command(flatten)]`.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct SecretArgs {
    /// (rallypoint) Admit only connections that prove they hold the secret in
    /// this file (the store, the rendezvous, ...; see docs/job-secret.md).
    /// Every node of the job reads the same file; it must be readable by its
    /// owner only and hold at least 16 bytes (`head -c 32 /dev/urandom >
    /// PATH`). Never the secret itself on a command line.
    #[arg(
        long = "job-secret-file",
        visible_alias = "job_secret_file",
        env = "RALLY_JOB_SECRET_FILE",
        value_name = "PATH"
    )]
    pub job_secret_file: Option<PathBuf>,
}

impl SecretArgs {
    /// Reads the secret (if asked for) and makes it the process's; says so
    /// on stderr with its key id, prefixed by `who`. The file's absolute
    /// path is put in this process's environment as `RALLY_JOB_SECRET_FILE`,
    /// for the workers it starts: the collectives, RPC and fault-tolerance
    /// endpoints they serve prove the secret too (their PyTorch store client
    /// cannot, and goes through the agent's proxy). Call it before any
    /// thread starts.
    pub fn apply(&self, who: &str) -> anyhow::Result<Option<JobSecret>> {
        let Some(path) = self
            .job_secret_file
            .as_ref()
            .filter(|p| !p.as_os_str().is_empty())
        else {
            return Ok(None);
        };
        let s = JobSecret::from_file(path).context("--job-secret-file")?;
        if !secret::set_process_secret(s.clone()) {
            anyhow::bail!("--job-secret-file: this process already has another job secret");
        }
        let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.clone());
        std::env::set_var(rallypoint_auth::secret::ENV_VAR, &path);
        say!(
            "{who}: job secret on (key id {}, from {}): only connections that prove it are admitted",
            s.key_id(),
            path.display()
        );
        Ok(Some(s))
    }
}
