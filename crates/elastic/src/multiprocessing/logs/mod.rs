//! Log directories and the pumps that carry worker output to files and the
//! console, one concern a file:
//!
//! - `dirs.rs`: the layout, `<log_dir>/<run_id>_<suffix>/attempt_<n>/<local_rank>/`.
//! - `routing.rs`: where each worker stream goes (inherited, a file, nowhere,
//!   or teed through the launcher), as torchrun decides it.
//! - `pump.rs`: the one thread that reads every teed pipe of a group, and
//!   when it stops (end of file, or a quiet pipe after the worker's exit).
//! - `stream.rs`: one teed stream: to its file at once, to the console as the
//!   console takes it, read back from the file when the console falls behind.
//! - `lines.rs`: cutting a stream into prefixed console segments (lines,
//!   `\r` updates, partial and over-long lines).
//! - `console.rs`: the console writer thread behind its bounded queue, which
//!   keeps lines of different workers from interleaving.

mod console;
mod dirs;
mod lines;
mod pump;
mod routing;
mod stream;

pub(crate) use console::flush_console;
pub use console::{console_lines_dropped, CONSOLE_STALL};
pub use dirs::{LogDirError, RunLogs, WorkerLogs, DEV_NULL};
pub use lines::MAX_LINE;
pub(crate) use pump::{Pump, Stream};
pub use pump::{DRAIN_AFTER_EXIT, PARTIAL_AFTER};
pub(crate) use routing::{route, Route};
