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
    /// Prefix of teed console lines; `role_name`, `local_rank`, `rank` and
    /// `hostname` expand as `$name` or `${name}`, and `$$` is a `$`
    /// (torchrun's `--log-line-prefix-template`, [`expand_prefix`]).
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

/// Expands a prefix template for one worker as torchrun does, with Python's
/// `string.Template.safe_substitute`: `$name` and `${name}` expand, `$$` is a
/// `$`, and an unknown name or a `$` that starts neither is left as written.
pub fn expand_prefix(
    template: &str,
    role: &str,
    local_rank: usize,
    rank: usize,
    hostname: &str,
) -> String {
    let value = |name: &str| match name {
        "hostname" => Some(hostname.to_owned()),
        "role_name" => Some(role.to_owned()),
        "local_rank" => Some(local_rank.to_string()),
        "rank" => Some(rank.to_string()),
        _ => None,
    };
    // Python's idpattern: `[_a-z][_a-z0-9]*`, ASCII, any case.
    let ident = |s: &str| {
        let b = s.as_bytes();
        if b.first()
            .is_some_and(|c| c.is_ascii_alphabetic() || *c == b'_')
        {
            b.iter()
                .position(|c| !(c.is_ascii_alphanumeric() || *c == b'_'))
                .unwrap_or(b.len())
        } else {
            0
        }
    };
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
            continue;
        }
        if let Some(inner) = after.strip_prefix('{') {
            let n = ident(inner);
            if n > 0 && inner[n..].starts_with('}') {
                let whole = &rest[at..at + 2 + n + 1];
                out.push_str(&value(&inner[..n]).unwrap_or_else(|| whole.to_owned()));
                rest = &inner[n + 1..];
                continue;
            }
        } else {
            let n = ident(after);
            if n > 0 {
                match value(&after[..n]) {
                    Some(v) => out.push_str(&v),
                    None => out.push_str(&rest[at..at + 1 + n]),
                }
                rest = &after[n..];
                continue;
            }
        }
        // Neither: the `$` stays as it is.
        out.push('$');
        rest = after;
    }
    out.push_str(rest);
    out
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

    /// Against Python's own `string.Template.safe_substitute`, which torchrun
    /// uses: the same templates, the same mapping.
    #[test]
    fn prefix_templates_expand_as_python_safe_substitute() {
        let templates = [
            "[${role_name}${local_rank}]:",
            "$role_name$local_rank|",
            "$$rank=$rank",
            "$$$rank",
            "${rank}x $rankx ${rank",
            "${unknown} $unknown $ $1 ${1} $-",
            "$hostname:${hostname}:$HOSTNAME",
            "trailing $",
            "${ rank }",
            "$_x ${_x} é$rank",
        ]
        .map(String::from)
        .to_vec();
        // And 500 random ones over the characters that matter (a fixed seed).
        let alphabet: Vec<char> = "$${}_r1ankhostme :é".chars().collect();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut templates = templates;
        for _ in 0..500 {
            let mut t = String::new();
            for _ in 0..(x % 12 + 1) {
                x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                t.push(alphabet[(x >> 33) as usize % alphabet.len()]);
            }
            templates.push(t);
        }
        let script = "import sys, string\n\
            m = dict(role_name='trainer', local_rank=3, rank=11, hostname='node-7')\n\
            for t in sys.argv[1:]:\n    print(string.Template(t).safe_substitute(m))";
        let python = std::env::var("RALLY_PYTHON").unwrap_or_else(|_| "python3".into());
        let out = std::process::Command::new(python)
            .arg("-c")
            .arg(script)
            .args(&templates)
            .output()
            .expect("python3 runs");
        assert!(out.status.success(), "{out:?}");
        let theirs = String::from_utf8(out.stdout).unwrap();
        for (t, want) in templates.iter().zip(theirs.lines()) {
            assert_eq!(
                expand_prefix(t, "trainer", 3, 11, "node-7"),
                want,
                "template {t:?}"
            );
        }
        assert_eq!(theirs.lines().count(), templates.len());
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
