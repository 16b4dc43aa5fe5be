//! Elastic launch: the hands of the launcher.
//!
//! [`multiprocessing`] starts N copies of a worker, each with its own arguments and
//! environment, hands them the launcher's stdio or routes their output to per-rank
//! log files and (prefixed) to the console as torchrun's flags say, learns
//! exactly how each one ended, and stops them all: PyTorch's `torch.distributed.elastic.multiprocessing`. [`errors`] is the
//! `TORCHELASTIC_ERROR_FILE` mechanism, with PyTorch's JSON layout. [`devices`]
//! counts the GPUs a process sees, honouring `CUDA_VISIBLE_DEVICES`. [`agent`] is
//! the elastic agent behind `rally run`: rendezvous, start, monitor, restart.
//! [`numa`] works out where each local rank runs under `--numa-binding`, and
//! [`multiprocessing::stacks`] reads where running Python workers are.
//!
//! Starting two workers and learning how each ended, as
//! `torch.distributed.elastic.multiprocessing.start_processes` does:
//!
//! ```
//! use std::collections::BTreeMap;
//! use std::ffi::OsString;
//! use std::time::Duration;
//!
//! use rallypoint_elastic::multiprocessing::{
//!     start_processes, Entrypoint, Exit, LogsSpec, RunLogs, StartSpec,
//! };
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let scripts = ["exit 0", "exit 3"];
//! let spec = StartSpec {
//!     name: "trainer".into(),
//!     entrypoint: Entrypoint::Program("sh".into()),
//!     args: (0..2).map(|r| (r, vec![OsString::from("-c"), scripts[r].into()])).collect(),
//!     envs: (0..2).map(|r| (r, BTreeMap::new())).collect(),
//!     global_ranks: BTreeMap::new(),
//!     bindings: BTreeMap::new(),
//! };
//! let logs = LogsSpec::default();
//! let run = RunLogs::create(&logs, "example")?;
//! let mut workers = start_processes(&spec, &logs, &run.attempt(0, 2)?)?;
//! let ended = workers
//!     .wait(Some(Duration::from_secs(30)), Duration::from_millis(5))
//!     .expect("both end within 30 s");
//! assert_eq!(ended.exits[&0], Exit::Code(0));
//! assert_eq!(ended.exits[&1], Exit::Code(3));
//! assert!(ended.is_failed());
//! # Ok(())
//! # }
//! ```
//!
//! # Layers
//!
//! The first row is the lowest layer. A module imports only from its own row
//! (never in a circle) and the rows above it; `.ci/module-cycles` checks both.
//!
//! | layer | modules |
//! |---|---|
//! | pieces | `errors`, `time`, `devices`, `numa` |
//! | starting and stopping workers | `multiprocessing` |
//! | the agent | `agent` |

pub mod agent;
pub mod devices;
pub mod errors;
pub mod multiprocessing;
pub mod numa;
mod time;
