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

pub mod agent;
pub mod devices;
pub mod errors;
pub mod multiprocessing;
pub mod numa;
mod time;
