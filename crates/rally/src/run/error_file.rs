//! The launcher's own error file: when `rally run` was given
//! `TORCHELASTIC_ERROR_FILE`, the outcome is written there as torchrun's
//! `@record` writes it, for the scheduler or outer launcher that reads it.

use std::path::{Path, PathBuf};

use anyhow::Context;
use rallypoint_elastic::agent::Outcome;

/// When the launcher itself was given `TORCHELASTIC_ERROR_FILE` (by a scheduler
/// or an outer launcher), puts the root cause there as torchrun's `@record`
/// does: a copy of the worker's error file with `errorCode` added, or, when the
/// worker wrote none (or it is on another node), the failure described in the
/// same layout. Stopped by a signal, it writes what torchrun writes then: a
/// `SignalException` (`Process <pid> got signal: <n>`), so a scheduler reads
/// the same thing whichever launcher ran (the exit code stays 128+N).
pub(super) fn write_launcher_error_file(outcome: &Outcome) -> anyhow::Result<()> {
    use rallypoint_elastic::errors::{
        copy_with_exit_code, error_json, write_error_file, ErrorReport,
    };
    let Some(path) =
        std::env::var_os(rallypoint_elastic::errors::ERROR_FILE_ENV).filter(|p| !p.is_empty())
    else {
        return Ok(());
    };
    let path = PathBuf::from(path);
    let cannot = || {
        format!(
            "cannot write the launcher's error file ({})",
            path.display()
        )
    };
    let root_cause = match outcome {
        Outcome::Failed { root_cause, .. } => root_cause,
        Outcome::Signaled { signal, .. } => {
            let message = format!(
                "SignalException: Process {} got signal: {signal}",
                std::process::id()
            );
            let stack = format!(
                "rally run received {} ({signal}) and sent it to its workers, as torchrun does\n",
                rallypoint_elastic::multiprocessing::signal_name(*signal)
            );
            let value = error_json(&message, &stack, std::time::SystemTime::now());
            return write_error_file(&path, &value).with_context(cannot);
        }
        _ => return Ok(()),
    };
    let Some(root) = root_cause else {
        return Ok(());
    };
    let from_worker = (root.host == rallypoint_elastic::multiprocessing::hostname())
        .then(|| {
            ErrorReport::read(Path::new(&root.error_file))
                .ok()
                .flatten()
        })
        .flatten();
    match from_worker {
        Some(report) => copy_with_exit_code(&report, Some(root.exitcode), &path),
        None => write_error_file(&path, &root.error_json()),
    }
    .with_context(cannot)
}
