//! Where each worker stream goes, as torchrun's `DefaultLogsSpecs` sends it
//! ([`route`]): by default the worker inherits the launcher's stdin, stdout and
//! stderr, so a terminal stays a terminal (`isatty()`, colours, `\r` progress
//! bars, `breakpoint()`) and lines carry no prefix. `-r` hands the worker its log
//! file directly. A rank hidden by the console filter and not redirected writes
//! to `/dev/null`. Only `-t` (tee) involves the launcher: the stream is a pipe,
//! and the pump (`pump.rs`) writes its bytes to the file and echoes them,
//! prefixed, to the console. torchrun tails the file instead, which shows
//! output up to 0.1 s late.

use std::path::{Path, PathBuf};

use super::console::Console;
use super::dirs::DEV_NULL;
use crate::multiprocessing::spec::{LogsSpec, Std};

/// Where one worker stream goes, decided as torchrun's `DefaultLogsSpecs.reify`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Route {
    /// The launcher's own stream, handed to the worker as is (torchrun's
    /// default): a terminal stays a terminal.
    Inherit,
    /// Neither kept nor shown: a rank the console filter hides, not redirected.
    Discard,
    /// The worker writes the file directly (`-r`, or `-t` for a hidden rank).
    File(PathBuf),
    /// Through a pipe to the pump, which writes the file and echoes prefixed
    /// lines to the console (`-t`).
    Tee {
        file: PathBuf,
        console: Console,
        prefix: String,
    },
}

/// Decides the route of one stream from the spec. With logging off
/// (`log_dir=/dev/null`, `file` is `/dev/null`) every stream is inherited, as in
/// torchrun, which then has nowhere to redirect to.
pub(crate) fn route(
    spec: &LogsSpec,
    local_rank: usize,
    stream: Std,
    file: &Path,
    prefix: &str,
) -> Route {
    if file == Path::new(DEV_NULL) {
        return Route::Inherit;
    }
    let pick = |s: Std| {
        if stream == Std::Out {
            s.stdout()
        } else {
            s.stderr()
        }
    };
    let tee = pick(spec.tee.get(local_rank));
    let redirect = tee || pick(spec.redirects.get(local_rank));
    // As torchrun: an empty filter filters nothing.
    let shown = spec
        .local_ranks_filter
        .as_ref()
        .is_none_or(|f| f.is_empty() || f.contains(&local_rank));
    match (redirect, tee && shown, shown) {
        (true, true, _) => Route::Tee {
            file: file.to_owned(),
            console: if stream == Std::Out {
                Console::Stdout
            } else {
                Console::Stderr
            },
            prefix: prefix.to_owned(),
        },
        (true, false, _) => Route::File(file.to_owned()),
        (false, _, true) => Route::Inherit,
        (false, _, false) => Route::Discard,
    }
}
