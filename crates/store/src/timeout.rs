//! A store's default timeout, changeable through a shared reference.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A `Duration` (with millisecond-or-better precision, up to ~584 years) that can be
/// read and replaced through `&self`.
#[derive(Debug)]
pub struct TimeoutCell(AtomicU64);

impl TimeoutCell {
    pub fn new(d: Duration) -> Self {
        TimeoutCell(AtomicU64::new(Self::nanos(d)))
    }

    fn nanos(d: Duration) -> u64 {
        u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
    }

    pub fn get(&self) -> Duration {
        Duration::from_nanos(self.0.load(Ordering::Relaxed))
    }

    pub fn set(&self, d: Duration) {
        self.0.store(Self::nanos(d), Ordering::Relaxed)
    }
}

impl Default for TimeoutCell {
    fn default() -> Self {
        TimeoutCell::new(crate::DEFAULT_TIMEOUT)
    }
}
