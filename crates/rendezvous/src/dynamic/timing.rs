//! The timing of a dynamic rendezvous, from `--rdzv-conf` with PyTorch's
//! defaults.

use std::time::Duration;

use crate::api::{RendezvousError, RendezvousParameters};

/// Timing of a dynamic rendezvous (PyTorch's defaults).
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Bounds a whole `next_rendezvous` (`join_timeout`, 600 s).
    pub join: Duration,
    /// How long a round stays open after reaching `min_nodes` (`last_call_timeout`, 30 s).
    pub last_call: Duration,
    /// Heartbeat period (`keep_alive_interval`, 5 s).
    pub keep_alive: Duration,
    /// Missed heartbeats before a peer counts as dead (`keep_alive_max_attempt`, 3).
    pub max_misses: u32,
}

impl Timing {
    /// The timing options of `--rdzv-conf` (`join_timeout`, `last_call_timeout`,
    /// `keep_alive_interval`, `keep_alive_max_attempt`), with the defaults.
    pub fn from_params(p: &RendezvousParameters) -> Result<Self, RendezvousError> {
        let d = Timing::default();
        Ok(Timing {
            join: p.get_as_secs("join_timeout", d.join)?,
            last_call: p.get_as_secs("last_call_timeout", d.last_call)?,
            keep_alive: p.get_as_secs("keep_alive_interval", d.keep_alive)?,
            max_misses: p
                .get_as_int("keep_alive_max_attempt")?
                .map_or(Ok(d.max_misses), |v| {
                    u32::try_from(v).ok().filter(|v| *v > 0).ok_or_else(|| {
                        crate::api::config_error(
                            "keep_alive_max_attempt",
                            &v.to_string(),
                            "a positive integer",
                        )
                    })
                })?,
        })
    }
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            join: Duration::from_secs(600),
            last_call: Duration::from_secs(30),
            keep_alive: Duration::from_secs(5),
            max_misses: 3,
        }
    }
}
