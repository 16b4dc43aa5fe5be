//! The log layout, as torchrun's: `<log_dir>/<run_id>_<suffix>/attempt_<n>/<local_rank>/`
//! holding `stdout.log`, `stderr.log` and `error.json`. The attempt directory is
//! wiped and recreated for each attempt. With logging off (`log_dir=/dev/null`)
//! there are no files, only a scratch directory for function workers' return
//! values.

use std::path::{Path, PathBuf};

use crate::multiprocessing::spec::LogsSpec;

/// The per-run log directory (`<log_dir>/<run_id>_<suffix>`), or `/dev/null` when
/// logging is off (as `log_dir=os.devnull` in PyTorch: no files, and an empty
/// `TORCHELASTIC_ERROR_FILE`).
#[derive(Debug)]
pub struct RunLogs {
    pub dir: PathBuf,
    /// With logging off, where function workers' return values go; removed on drop.
    scratch: Option<PathBuf>,
}

impl Drop for RunLogs {
    fn drop(&mut self) {
        if let Some(s) = &self.scratch {
            let _ = std::fs::remove_dir_all(s);
        }
    }
}

/// The `log_dir` that turns log files off.
pub const DEV_NULL: &str = "/dev/null";

/// Paths of one worker's files in one attempt.
#[derive(Debug, Clone)]
pub struct WorkerLogs {
    pub dir: PathBuf,
    pub stdout: PathBuf,
    pub stderr: PathBuf,
    pub error_file: PathBuf,
    /// Where a function worker writes its return value.
    pub return_value: PathBuf,
}

/// Why a log directory could not be prepared.
#[derive(Debug, thiserror::Error)]
#[error("cannot prepare log directory {path}")]
pub struct LogDirError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

fn suffix() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    format!("{:08x}", h.finish() as u32)
}

impl RunLogs {
    /// Creates `<log_dir>/<run_id>_<suffix>` (a fresh temporary base when the spec
    /// has no `log_dir`).
    pub fn create(spec: &LogsSpec, run_id: &str) -> Result<RunLogs, LogDirError> {
        if spec.log_dir.as_deref() == Some(Path::new(DEV_NULL)) {
            let scratch = std::env::temp_dir().join(format!("rally_{run_id}_{}", suffix()));
            std::fs::create_dir_all(&scratch).map_err(|source| LogDirError {
                path: scratch.clone(),
                source,
            })?;
            return Ok(RunLogs {
                dir: PathBuf::from(DEV_NULL),
                scratch: Some(scratch),
            });
        }
        let base = match &spec.log_dir {
            Some(d) => d.clone(),
            None => std::env::temp_dir().join(format!("torchelastic_{}", suffix())),
        };
        let dir = base.join(format!("{run_id}_{}", suffix()));
        std::fs::create_dir_all(&dir).map_err(|source| LogDirError {
            path: dir.clone(),
            source,
        })?;
        Ok(RunLogs { dir, scratch: None })
    }

    /// Wipes and recreates `attempt_<n>/<rank>/` for every local rank.
    pub fn attempt(&self, attempt: u32, nprocs: usize) -> Result<Vec<WorkerLogs>, LogDirError> {
        if let Some(scratch) = &self.scratch {
            let null = PathBuf::from(DEV_NULL);
            return Ok((0..nprocs)
                .map(|rank| WorkerLogs {
                    dir: null.clone(),
                    stdout: null.clone(),
                    stderr: null.clone(),
                    error_file: PathBuf::new(),
                    return_value: scratch.join(format!("{attempt}_{rank}")),
                })
                .collect());
        }
        let dir = self.dir.join(format!("attempt_{attempt}"));
        let err = |path: &Path| {
            let path = path.to_owned();
            move |source| LogDirError { path, source }
        };
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(&dir)(e)),
        }
        (0..nprocs)
            .map(|rank| {
                let d = dir.join(rank.to_string());
                std::fs::create_dir_all(&d).map_err(err(&d))?;
                Ok(WorkerLogs {
                    stdout: d.join("stdout.log"),
                    stderr: d.join("stderr.log"),
                    error_file: d.join("error.json"),
                    return_value: d.join("return_value"),
                    dir: d,
                })
            })
            .collect()
    }
}
