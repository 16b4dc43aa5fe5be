//! Error files: how a worker tells its launcher why it failed.
//!
//! The launcher gives each worker a path in `TORCHELASTIC_ERROR_FILE`. A Python
//! worker decorated with PyTorch's `@record` writes, on an uncaught exception:
//!
//! ```json
//! {"message": {"message": "ValueError: bad input",
//!              "extraInfo": {"py_callstack": "Traceback ...",
//!                            "timestamp": "1732233600"}}}
//! ```
//!
//! The reader also accepts the "new format", where `message` is a plain string and
//! `timestamp` sits at the top level. When the launcher copies a child's file into
//! its own it adds `message.errorCode`, the exit code the child could not know.
//! [`install_panic_hook`] and [`record`] are the Rust equivalents of `@record`: they
//! write the same layout, so Rust and Python workers are reported alike.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

/// The variable that carries a worker's error-file path.
pub const ERROR_FILE_ENV: &str = "TORCHELASTIC_ERROR_FILE";

/// What a worker's error file said.
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorReport {
    /// `"<ExceptionClass>: <text>"` for Python workers.
    pub message: String,
    /// The traceback or backtrace, if any.
    pub callstack: Option<String>,
    /// When the worker recorded the error.
    pub timestamp: Option<SystemTime>,
    /// The exit code, once a launcher has added it.
    pub error_code: Option<i32>,
    /// The whole file, for copying it on unchanged.
    pub raw: Value,
}

/// Why an error file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ErrorFileError {
    #[error("cannot read error file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write error file {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("error file {path} is not valid JSON")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

fn parse_timestamp(v: Option<&Value>) -> Option<SystemTime> {
    let secs = match v? {
        Value::String(s) => s.trim().parse::<f64>().ok()?,
        Value::Number(n) => n.as_f64()?,
        _ => return None,
    };
    (secs >= 0.0).then(|| UNIX_EPOCH + Duration::from_secs_f64(secs))
}

impl ErrorReport {
    /// Interprets error-file JSON, in either of PyTorch's layouts.
    pub fn from_json(raw: Value) -> ErrorReport {
        let msg = raw.get("message");
        let (message, callstack, timestamp, error_code) = match msg {
            Some(Value::Object(m)) => {
                let extra = m.get("extraInfo");
                (
                    m.get("message")
                        .and_then(Value::as_str)
                        .unwrap_or("<NONE>")
                        .to_owned(),
                    extra
                        .and_then(|e| e.get("py_callstack"))
                        .and_then(Value::as_str)
                        .map(str::to_owned),
                    parse_timestamp(extra.and_then(|e| e.get("timestamp"))),
                    m.get("errorCode").and_then(Value::as_i64).map(|c| c as i32),
                )
            }
            Some(Value::String(s)) => {
                (s.clone(), None, parse_timestamp(raw.get("timestamp")), None)
            }
            _ => ("<NONE>".to_owned(), None, None, None),
        };
        ErrorReport {
            message,
            callstack,
            timestamp,
            error_code,
            raw,
        }
    }

    /// Reads an error file; `Ok(None)` if the worker did not write one.
    pub fn read(path: &Path) -> Result<Option<ErrorReport>, ErrorFileError> {
        let text = match std::fs::read(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(ErrorFileError::Read {
                    path: path.to_owned(),
                    source,
                })
            }
        };
        let raw = serde_json::from_slice(&text).map_err(|source| ErrorFileError::Json {
            path: path.to_owned(),
            source,
        })?;
        Ok(Some(ErrorReport::from_json(raw)))
    }
}

/// The JSON PyTorch's `@record` writes.
pub fn error_json(message: &str, callstack: &str, when: SystemTime) -> Value {
    let secs = when.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    json!({
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": callstack,
                "timestamp": secs.to_string(),
            }
        }
    })
}

/// Writes `value` to `path` (creating parent directories).
pub fn write_error_file(path: &Path, value: &Value) -> Result<(), ErrorFileError> {
    let io = |source| ErrorFileError::Write {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let text = serde_json::to_vec(value).expect("JSON values always serialise");
    std::fs::write(path, text).map_err(io)
}

/// Copies a child's report into `parent_file`, adding the exit code the way
/// PyTorch's launcher does (only to the object layout, only when non-zero).
pub fn copy_with_exit_code(
    report: &ErrorReport,
    exit_code: Option<i32>,
    parent_file: &Path,
) -> Result<(), ErrorFileError> {
    let mut value = report.raw.clone();
    if let (Some(code), Some(Value::Object(m))) = (exit_code, value.get_mut("message")) {
        if code != 0 {
            m.insert("errorCode".into(), json!(code));
        }
    }
    write_error_file(parent_file, &value)
}

/// The last Python traceback in `text` (the tail of a worker's stderr) and its
/// exception line, e.g. `ModuleNotFoundError: No module named 'x'`: how a
/// worker that wrote no error file (no `@record`, or a failure before it ran,
/// such as an import at the top of the script) is still described. A
/// `SyntaxError` in the script itself has no `Traceback` header; its block is
/// found from the `File` line of the script. `None` when there is no
/// traceback, or nothing unindented after its header.
pub fn last_python_traceback(text: &str) -> Option<(String, String)> {
    const HEADER: &str = "Traceback (most recent call last):";
    let start = text
        .rfind(HEADER)
        .filter(|&i| i == 0 || text[..i].ends_with('\n'))
        .or_else(|| {
            // An uncompilable script: `  File "x.py", line N` starts the block.
            let i = text
                .rfind("\n  File \"")
                .map(|i| i + 1)
                .or_else(|| text.starts_with("  File \"").then_some(0))?;
            text[i..].contains("Error: ").then_some(i)
        })?;
    let block = &text[start..];
    let mut end = 0;
    let mut message = None;
    for line in block.split_inclusive('\n').skip(1) {
        end += line.len();
        let l = line.trim_end();
        if !l.is_empty() && !l.starts_with(' ') && !l.starts_with('\t') {
            message = Some(l.to_owned());
            break;
        }
    }
    let first = block.split_inclusive('\n').next().map_or(0, str::len);
    let message = message?;
    Some((message, block[..first + end].trim_end().to_owned()))
}

/// Installs a panic hook that writes the panic into `$TORCHELASTIC_ERROR_FILE` (when
/// set) before the default hook runs: `@record` for Rust workers.
pub fn install_panic_hook() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if let Some(path) = std::env::var_os(ERROR_FILE_ENV).filter(|p| !p.is_empty()) {
            let payload = info
                .payload()
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| info.payload().downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "panic".to_owned());
            let location = info
                .location()
                .map(|l| format!(" at {}:{}", l.file(), l.line()))
                .unwrap_or_default();
            let backtrace = std::backtrace::Backtrace::force_capture().to_string();
            let value = error_json(
                &format!("panic: {payload}{location}"),
                &backtrace,
                SystemTime::now(),
            );
            let _ = write_error_file(Path::new(&path), &value);
        }
        previous(info);
    }));
}

/// Runs a worker's main, recording an error it returns into
/// `$TORCHELASTIC_ERROR_FILE` (and panics, via [`install_panic_hook`]).
pub fn record<T, E: std::fmt::Display>(f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    install_panic_hook();
    let result = f();
    if let Err(e) = &result {
        if let Some(path) = std::env::var_os(ERROR_FILE_ENV).filter(|p| !p.is_empty()) {
            let value = error_json(&format!("error: {e}"), "", SystemTime::now());
            let _ = write_error_file(Path::new(&path), &value);
        }
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_both_pytorch_layouts() {
        let old = error_json(
            "ValueError: nope",
            "Traceback...",
            UNIX_EPOCH + Duration::from_secs(100),
        );
        let r = ErrorReport::from_json(old);
        assert_eq!(r.message, "ValueError: nope");
        assert_eq!(r.callstack.as_deref(), Some("Traceback..."));
        assert_eq!(r.timestamp, Some(UNIX_EPOCH + Duration::from_secs(100)));
        let new = json!({"message": "plain", "timestamp": 7});
        let r = ErrorReport::from_json(new);
        assert_eq!(
            (r.message.as_str(), r.timestamp),
            ("plain", Some(UNIX_EPOCH + Duration::from_secs(7)))
        );
        assert_eq!(ErrorReport::from_json(json!({})).message, "<NONE>");
    }

    #[test]
    fn the_last_traceback_in_stderr_and_its_exception_line() {
        let text = "loading\nTraceback (most recent call last):\n  File \"/t/a.py\", line 1, in <module>\n    import foo\nModuleNotFoundError: No module named 'foo'\n";
        let (m, tb) = last_python_traceback(text).unwrap();
        assert_eq!(m, "ModuleNotFoundError: No module named 'foo'");
        assert!(tb.starts_with("Traceback (most recent call last):\n  File"));
        assert!(tb.ends_with("'foo'"));
        // Chained: the last block is the one that ended the process.
        let chained = format!("{text}\nDuring handling of the above exception, another exception occurred:\n\nTraceback (most recent call last):\n  File \"/t/a.py\", line 3, in <module>\n    raise SystemError(\"x\")\n    ^^^^\nSystemError: x\nexiting\n");
        let (m, tb) = last_python_traceback(&chained).unwrap();
        assert_eq!(m, "SystemError: x");
        assert!(!tb.contains("exiting") && tb.contains("^^^^"));
        // A script that does not compile has no header.
        let syntax =
            "  File \"/t/a.py\", line 2\n    x = \n        ^\nSyntaxError: invalid syntax\n";
        assert_eq!(
            last_python_traceback(syntax).unwrap().0,
            "SyntaxError: invalid syntax"
        );
        assert_eq!(last_python_traceback("just output\n"), None);
        assert_eq!(
            last_python_traceback("Traceback (most recent call last):\n  File \"a\""),
            None
        );
        // A header inside a line is not a traceback.
        assert_eq!(
            last_python_traceback("print('Traceback (most recent call last):')\nX: y\n"),
            None
        );
    }

    proptest::proptest! {
        /// Any stderr tail (cut anywhere, mixed with tracebacks) is read
        /// without a panic, and what is found is text of the input.
        #[test]
        fn any_stderr_tail_is_read_safely(parts in proptest::collection::vec(
            proptest::prop_oneof![
                proptest::strategy::Just("Traceback (most recent call last):\n".to_owned()),
                proptest::strategy::Just("  File \"a.py\", line 1\n".to_owned()),
                proptest::strategy::Just("Error: x\n".to_owned()),
                "[ -~\n\té]{0,12}",
            ], 0..12)) {
            let text = parts.concat();
            if let Some((message, tb)) = last_python_traceback(&text) {
                proptest::prop_assert!(text.contains(&tb));
                proptest::prop_assert!(tb.ends_with(&message));
                proptest::prop_assert!(!message.starts_with(' '));
            }
        }
    }

    #[test]
    fn copy_adds_the_exit_code_only_when_non_zero() {
        let dir = tempfile::tempdir().unwrap();
        let report = ErrorReport::from_json(error_json("E: x", "", SystemTime::now()));
        let p = dir.path().join("a/error.json");
        copy_with_exit_code(&report, Some(-11), &p).unwrap();
        assert_eq!(
            ErrorReport::read(&p).unwrap().unwrap().error_code,
            Some(-11)
        );
        copy_with_exit_code(&report, Some(0), &p).unwrap();
        assert_eq!(ErrorReport::read(&p).unwrap().unwrap().error_code, None);
        assert!(ErrorReport::read(&dir.path().join("missing"))
            .unwrap()
            .is_none());
    }
}
