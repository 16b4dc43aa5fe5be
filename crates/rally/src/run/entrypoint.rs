//! What the workers run: the program itself, or a Python interpreter
//! (`-u`, with `-m` for a module) and the script, as torchrun decides; and,
//! when a Python worker failed in a way a wrong interpreter explains, a hint
//! that names the interpreter rally chose and why.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use rallypoint_elastic::agent::FailureRecord;
use rallypoint_elastic::multiprocessing::Entrypoint;

use super::args::RunArgs;

/// Whether the workers run under a Python interpreter rally chose.
pub(super) fn runs_python(a: &RunArgs) -> bool {
    let Some(script) = a.command.first() else {
        return false;
    };
    let is_py = Path::new(script).extension().is_some_and(|e| e == "py");
    // A file that is neither .py nor executable is a Python script too.
    let not_executable = || {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(script).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 == 0)
    };
    a.module || a.run_path || (!a.no_python && (is_py || not_executable()))
}

/// The worker entrypoint and its arguments.
pub(super) fn entrypoint(a: &RunArgs) -> anyhow::Result<(Entrypoint, Vec<OsString>)> {
    let (script, rest) = a
        .command
        .split_first()
        .context("no training script given")?;
    if a.module && a.no_python {
        bail!("--module and --no-python cannot be used together");
    }
    if !runs_python(a) {
        return Ok((Entrypoint::Program(script.clone()), rest.to_vec()));
    }
    let exe = python();
    let mut args: Vec<OsString> = vec!["-u".into()];
    if a.module {
        args.push("-m".into());
    }
    args.push(script.clone());
    args.extend(rest.iter().cloned());
    Ok((Entrypoint::Program(exe), args))
}

/// The interpreter for Python workers: `PYTHON_EXEC`; else a `python` beside
/// this executable (a virtual environment's `bin`, where pip puts `rally`), so
/// a venv's `rally` works without activating the venv, as its `torchrun` does;
/// else `python3` from `PATH`.
fn python() -> OsString {
    python_choice().0
}

/// [`python`] and why it was chosen (for the failure summary).
fn python_choice() -> (OsString, String) {
    if let Some(p) = std::env::var_os("PYTHON_EXEC").filter(|p| !p.is_empty()) {
        let why = "PYTHON_EXEC is set".to_owned();
        return (p, why);
    }
    let exe = std::env::current_exe().ok();
    let beside = exe
        .as_ref()
        .and_then(|exe| Some(exe.parent()?.join("python")));
    match beside {
        Some(p) if is_executable(&p) => {
            let why = format!(
                "PYTHON_EXEC is not set, and it is the python beside this rally ({})",
                exe.as_deref().unwrap_or(Path::new("?")).display()
            );
            (p.into_os_string(), why)
        }
        _ => {
            let why = format!(
                "PYTHON_EXEC is not set, and there is no python beside this rally ({}), so python3 was taken from PATH",
                exe.as_deref().unwrap_or(Path::new("?")).display()
            );
            ("python3".into(), why)
        }
    }
}

/// `name` as `PATH` resolves it, for messages.
fn on_path(name: &OsString) -> PathBuf {
    let p = Path::new(name);
    if p.components().count() > 1 {
        return p.to_owned();
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|d| d.join(p))
        .find(|c| is_executable(c))
        .unwrap_or_else(|| p.to_owned())
}

/// What to tell a user whose Python worker failed (`root`, on this host) in
/// a way a wrong interpreter explains: a `ModuleNotFoundError` seen in its
/// error file or stderr names the interpreter, why it was chosen and how to
/// choose another; a failure whose traceback rally could not see (stderr on
/// the terminal) names the interpreter in one line. Nothing when
/// `PYTHON_EXEC` chose it: the user did.
pub(super) fn interpreter_hint(root: &FailureRecord) -> Option<String> {
    let (exe, why) = python_choice();
    if std::env::var_os("PYTHON_EXEC").is_some_and(|p| !p.is_empty()) {
        return None;
    }
    let exe = on_path(&exe);
    let text = format!("{}\n{}", root.message, root.traceback);
    let missing = text.lines().rev().find_map(|l| {
        l.trim()
            .strip_prefix("ModuleNotFoundError: No module named ")
    });
    if let Some(module) = missing {
        return Some(format!(
            "rally run: the workers ran {} ({why}), and it has no module {module}. \
             Choose the interpreter with PYTHON_EXEC (e.g. PYTHON_EXEC=/path/to/venv/bin/python rally run ...), \
             or run the rally installed in the environment that has the module (/path/to/venv/bin/rally).",
            exe.display()
        ));
    }
    let unseen = root.exitcode == 1
        && root.traceback.is_empty()
        && root.error_file == rallypoint_elastic::agent::NOT_AVAILABLE
        && root.host == rallypoint_elastic::multiprocessing::hostname();
    unseen.then(|| {
        format!(
            "rally run: the workers ran {} ({why}); if the traceback above is a ModuleNotFoundError, set PYTHON_EXEC to the interpreter that has the module.",
            exe.display()
        )
    })
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}
