//! Just enough URL parsing for rendezvous URLs: `scheme://authority/path?query`.

use std::collections::BTreeMap;

/// A parsed rendezvous URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Url {
    pub scheme: String,
    /// `host[:port]`, possibly empty (`file:///path`, `env://`).
    pub authority: String,
    pub path: String,
    pub query: BTreeMap<String, String>,
}

impl Url {
    pub fn parse(s: &str) -> Result<Url, String> {
        let (scheme, rest) = s
            .split_once("://")
            .ok_or_else(|| format!("{s:?} is not a URL of the form scheme://..."))?;
        if scheme.is_empty()
            || !scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
        {
            return Err(format!("{s:?} has no valid scheme"));
        }
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, q),
            None => (rest, ""),
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        let mut q = BTreeMap::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            if q.insert(k.to_owned(), v.to_owned()).is_some() {
                return Err(format!("query parameter {k:?} is given twice in {s:?}"));
            }
        }
        Ok(Url {
            scheme: scheme.to_ascii_lowercase(),
            authority: authority.to_owned(),
            path: path.to_owned(),
            query: q,
        })
    }

    /// Splits the authority into host and port (`[v6]:port` allowed).
    pub fn host_port(&self) -> Result<(String, Option<u16>), String> {
        let a = &self.authority;
        let (host, port) = if let Some(rest) = a.strip_prefix('[') {
            let (h, p) = rest
                .split_once(']')
                .ok_or_else(|| format!("bad IPv6 host in {a:?}"))?;
            (h.to_owned(), p.strip_prefix(':'))
        } else {
            match a.rsplit_once(':') {
                Some((h, p)) => (h.to_owned(), Some(p)),
                None => (a.clone(), None),
            }
        };
        let port = match port {
            None | Some("") => None,
            Some(p) => Some(
                p.parse::<u16>()
                    .map_err(|_| format!("port {p:?} is not in 0..65535"))?,
            ),
        };
        Ok((host, port))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_rendezvous_urls() {
        let u = Url::parse("tcp://10.0.0.1:29500?rank=3&world_size=8").unwrap();
        assert_eq!(
            (u.scheme.as_str(), u.authority.as_str()),
            ("tcp", "10.0.0.1:29500")
        );
        assert_eq!(u.query["rank"], "3");
        assert_eq!(u.host_port().unwrap(), ("10.0.0.1".into(), Some(29500)));
        let u = Url::parse("file:///tmp/x/store?world_size=2").unwrap();
        assert_eq!(
            (u.authority.as_str(), u.path.as_str()),
            ("", "/tmp/x/store")
        );
        let u = Url::parse("env://").unwrap();
        assert_eq!(u.scheme, "env");
        assert_eq!(
            Url::parse("tcp://[::1]:80").unwrap().host_port().unwrap(),
            ("::1".into(), Some(80))
        );
        assert!(Url::parse("tcp://h:99999").unwrap().host_port().is_err());
        assert!(Url::parse("nonsense").is_err());
        assert!(Url::parse("tcp://h:1?rank=1&rank=2").is_err());
    }
}
