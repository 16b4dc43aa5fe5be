//! What to start and where its output goes: per-rank redirect and tee settings in
//! torchrun's syntax, the console filter, and the line prefix template.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

/// Which standard streams a setting applies to (torchrun's `0`–`3`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Std {
    #[default]
    None = 0,
    Out = 1,
    Err = 2,
    All = 3,
}

impl Std {
    pub fn stdout(self) -> bool {
        matches!(self, Std::Out | Std::All)
    }

    pub fn stderr(self) -> bool {
        matches!(self, Std::Err | Std::All)
    }

    fn from_digit(s: &str) -> Result<Std, SpecError> {
        match s.trim() {
            "0" => Ok(Std::None),
            "1" => Ok(Std::Out),
            "2" => Ok(Std::Err),
            "3" => Ok(Std::All),
            other => Err(SpecError::BadStd(other.to_owned())),
        }
    }
}

/// A setting for every local rank, or per rank (`0:1,1:2`; ranks not named get
/// [`Std::None`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PerRank {
    All(Std),
    Ranks(BTreeMap<usize, Std>),
}

impl Default for PerRank {
    fn default() -> Self {
        PerRank::All(Std::None)
    }
}

impl PerRank {
    /// Parses torchrun's `-r`/`-t` syntax: `N` or `rank:N,rank:N`.
    pub fn parse(s: &str) -> Result<PerRank, SpecError> {
        if !s.contains(':') {
            return Std::from_digit(s).map(PerRank::All);
        }
        let mut map = BTreeMap::new();
        for part in s.split(',').filter(|p| !p.trim().is_empty()) {
            let (rank, std) = part
                .split_once(':')
                .ok_or_else(|| SpecError::BadStd(part.to_owned()))?;
            let rank = rank
                .trim()
                .parse()
                .map_err(|_| SpecError::BadStd(part.to_owned()))?;
            map.insert(rank, Std::from_digit(std)?);
        }
        Ok(PerRank::Ranks(map))
    }

    pub fn get(&self, local_rank: usize) -> Std {
        match self {
            PerRank::All(s) => *s,
            PerRank::Ranks(m) => m.get(&local_rank).copied().unwrap_or_default(),
        }
    }
}

/// Where logs go and what reaches the console.
#[derive(Debug, Clone)]
pub struct LogsSpec {
    /// Base directory; `None` makes a `torchelastic_*`-style temporary one (kept).
    /// The per-run directory is `<log_dir>/<run_id>_<suffix>/attempt_<n>/<rank>/`.
    pub log_dir: Option<PathBuf>,
    /// Streams written to files only (not the console).
    pub redirects: PerRank,
    /// Streams written to files and the console. Tee implies redirect.
    pub tee: PerRank,
    /// Local ranks whose console output is shown (`None`: all). Files are unaffected.
    pub local_ranks_filter: Option<BTreeSet<usize>>,
    /// Prefix of teed console lines; `${role_name}`, `${local_rank}`, `${rank}`
    /// and `${hostname}` expand (torchrun's `--log-line-prefix-template`).
    pub prefix_template: String,
}

/// torchrun's default console prefix.
pub const DEFAULT_PREFIX_TEMPLATE: &str = "[${role_name}${local_rank}]:";

impl Default for LogsSpec {
    fn default() -> Self {
        LogsSpec {
            log_dir: None,
            redirects: PerRank::default(),
            tee: PerRank::default(),
            local_ranks_filter: None,
            prefix_template: DEFAULT_PREFIX_TEMPLATE.to_owned(),
        }
    }
}

/// Expands a prefix template for one worker.
pub fn expand_prefix(
    template: &str,
    role: &str,
    local_rank: usize,
    rank: usize,
    hostname: &str,
) -> String {
    template
        .replace("${hostname}", hostname)
        .replace("${role_name}", role)
        .replace("${local_rank}", &local_rank.to_string())
        .replace("${rank}", &rank.to_string())
}

/// A bad redirect/tee setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("{0:?} is not a stream setting: use 0-3, or rank:0-3 pairs like 0:1,1:2")]
    BadStd(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torchrun_redirect_syntax() {
        assert_eq!(PerRank::parse("3").unwrap(), PerRank::All(Std::All));
        let p = PerRank::parse("0:1,2:2").unwrap();
        assert_eq!(
            (p.get(0), p.get(1), p.get(2)),
            (Std::Out, Std::None, Std::Err)
        );
        assert!(PerRank::parse("4").is_err());
        assert!(PerRank::parse("x:1").is_err());
        assert!(PerRank::parse("0:9").is_err());
    }

    #[test]
    fn prefix_templates_expand() {
        assert_eq!(
            expand_prefix(DEFAULT_PREFIX_TEMPLATE, "trainer", 3, 11, "h"),
            "[trainer3]:"
        );
        assert_eq!(
            expand_prefix("${hostname}:${rank}|${local_rank}", "r", 1, 9, "n8"),
            "n8:9|1"
        );
    }
}
