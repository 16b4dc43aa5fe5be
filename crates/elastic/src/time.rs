//! Wall-clock times as the failure summary and stack dumps print them
//! (torchelastic's layout), below both the agent and multiprocessing.

/// UTC `YYYY-MM-DD HH:MM:SS.mmm`.
pub fn format_time(secs: f64) -> String {
    let total = secs.max(0.0);
    let days = (total / 86400.0).floor() as i64;
    let rem = total - days as f64 * 86400.0;
    let (h, m, s) = (
        (rem / 3600.0) as u32,
        ((rem % 3600.0) / 60.0) as u32,
        rem % 60.0,
    );
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let mo = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(mo <= 2);
    format!("{y:04}-{mo:02}-{d:02} {h:02}:{m:02}:{s:06.3} UTC")
}
