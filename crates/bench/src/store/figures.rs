//! The store benchmark's figures: each printed as it is measured, one row
//! per measurement and server, and at the end the ratio of ours to every
//! other server's on the same measurement.

/// Every figure of the run so far: (measurement, server, value, unit).
#[derive(Default)]
pub(super) struct Figures {
    rows: Vec<(String, String, f64, String)>,
}

impl Figures {
    /// Prints one figure and keeps it for the ratios.
    pub(super) fn record(&mut self, test: &str, server: &str, value: f64, unit: &str) {
        println!("{test:<34} {server:<13} {value:>12.1} {unit}");
        self.rows
            .push((test.to_owned(), server.to_owned(), value, unit.to_owned()));
    }

    /// Ratios, rally against each other server.
    pub(super) fn print_ratios(&self) {
        let rows = &self.rows;
        println!("\n# ratios (rally vs other; >1 means rally is better)");
        let find = |test: &str, server: &str| {
            rows.iter()
                .find(|r| r.0 == test && r.1 == server)
                .map(|r| r.2)
        };
        let tests: Vec<String> = rows
            .iter()
            .map(|r| r.0.clone())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        for test in tests {
            let Some(ours) = find(&test, "rally") else {
                continue;
            };
            // Throughput: higher is better; latency and server CPU: lower.
            let higher_is_better = test.starts_with("throughput");
            for other in rows.iter().filter(|r| r.0 == test && r.1 != "rally") {
                let ratio = if higher_is_better {
                    ours / other.2
                } else {
                    other.2 / ours
                };
                println!("{test:<34} rally vs {:<13} {ratio:>6.2}x", other.1);
            }
        }
    }
}

/// The `p` quantile of sorted nanoseconds, in microseconds.
pub(super) fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    f64::from(sorted[i]) / 1000.0
}
