//! Forwarding the launcher's signals to its workers.
//!
//! Workers run in their own process groups, so a Ctrl-C at the terminal or a
//! scheduler's SIGTERM reaches only the launcher. [`Signals::install`] traps a set
//! of signals (torchrun's default: `SIGTERM,SIGINT,SIGHUP,SIGQUIT`; `SIGUSR1` and
//! `SIGUSR2` are common for Slurm); [`ProcessContext::wait_forwarding`] then stops
//! the workers with the same signal and reports which one arrived. The handler only
//! records the signal number in an atomic: everything else happens in the wait loop.
//!
//! [`ProcessContext::wait_forwarding`]: super::ProcessContext::wait_forwarding

use std::sync::atomic::{AtomicI32, Ordering};

/// torchrun's default `--signals-to-handle`.
pub const DEFAULT_SIGNALS: &str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT";

static PENDING: AtomicI32 = AtomicI32::new(0);

extern "C" fn record_signal(sig: libc::c_int) {
    PENDING.store(sig, Ordering::SeqCst);
}

/// A signal name that is not one we forward.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a signal that can be forwarded (use e.g. SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2)")]
pub struct UnknownSignal(pub String);

/// Parses a comma-separated list like `SIGTERM,SIGUSR1` (names with or without
/// `SIG`, or numbers).
pub fn parse_signals(list: &str) -> Result<Vec<i32>, UnknownSignal> {
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            let name = s.to_ascii_uppercase();
            let name = name.strip_prefix("SIG").unwrap_or(&name);
            Ok(match name {
                "TERM" => libc::SIGTERM,
                "INT" => libc::SIGINT,
                "HUP" => libc::SIGHUP,
                "QUIT" => libc::SIGQUIT,
                "USR1" => libc::SIGUSR1,
                "USR2" => libc::SIGUSR2,
                "ALRM" => libc::SIGALRM,
                n => match n.parse::<i32>() {
                    Ok(v) if v > 0 && v != libc::SIGKILL && v != libc::SIGSTOP && v < 32 => v,
                    _ => return Err(UnknownSignal(s.to_owned())),
                },
            })
        })
        .collect()
}

/// Trapped signals. Installing is process-wide; the last signal received wins.
#[derive(Debug)]
pub struct Signals {
    set: Vec<i32>,
}

impl Signals {
    /// Traps every signal in `set`.
    pub fn install(set: &[i32]) -> std::io::Result<Signals> {
        for &sig in set {
            // SAFETY: installs an async-signal-safe handler (one atomic store).
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = record_signal as *const () as usize;
                action.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut action.sa_mask);
                if libc::sigaction(sig, &action, std::ptr::null_mut()) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
        }
        Ok(Signals { set: set.to_vec() })
    }

    /// The trapped signals.
    pub fn set(&self) -> &[i32] {
        &self.set
    }

    /// The signal received since the last `take`, if any, without taking it.
    pub fn peek(&self) -> Option<i32> {
        match PENDING.load(Ordering::SeqCst) {
            0 => None,
            s => Some(s),
        }
    }

    /// Takes the signal received since the last call, if any.
    pub fn take(&self) -> Option<i32> {
        match PENDING.swap(0, Ordering::SeqCst) {
            0 => None,
            s => Some(s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_torchrun_signal_lists() {
        assert_eq!(
            parse_signals(DEFAULT_SIGNALS).unwrap(),
            [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGQUIT]
        );
        assert_eq!(
            parse_signals("usr1, SIGUSR2").unwrap(),
            [libc::SIGUSR1, libc::SIGUSR2]
        );
        assert_eq!(parse_signals("15").unwrap(), [15]);
        assert!(parse_signals("SIGKILL").is_err());
        assert!(parse_signals("9").is_err());
        assert!(parse_signals("SIGNOPE").is_err());
    }
}
