//! Who keeps their connections when a group changes members: the decision
//! of a generation's round, as a pure function with its table.
//!
//! A group that changes members ([`ProcessGroup::next_generation`]) is a
//! *lineage*: one transport per process (its listener, its connections),
//! shared by every generation the process takes part in, each generation a
//! group over it. Peers of a lineage are named by *link ids*, drawn at random
//! by each process when it joins the lineage, never by their rank in a
//! generation: ranks change from one generation to the next, links do not,
//! so a survivor's connections stay addressed right.
//!
//! At each generation every member publishes one [`Entry`] under the
//! generation's prefix: the lineage it holds (its nonce, its link, its
//! address, its name, the links it has found gone), a listener bound for
//! this round (its *spare*), and what it proposes should it join (a link id,
//! a fresh nonce). Every member reads every entry and [`decide`]s, the same
//! on each:
//!
//! - the lineage held by most members (on a tie, the one of the lowest group
//!   rank) continues; none held: a fresh one, with group rank 0's nonce;
//! - its holders *keep* their transport, unless another holder has found them
//!   gone (a member stopped or cut off past its keep-alive and back now: its
//!   peers' connections with it are closed and its link is dead to them) or
//!   two holders claim one link;
//! - every other member *joins*: a new transport of the lineage, on its spare
//!   listener, with the link it proposed.
//!
//! A joiner's link must be new to the lineage: one equal to a member's, or to
//! a link some keeper has found gone, fails the round on every member alike
//! (ids are 32 random bits: about one round in a billion; the next
//! generation draws anew). A keeper that knows a member's link at another
//! address than the one published (a link id reused for another process,
//! which a keeper that missed the generations in between could know) fails
//! the round there (see `reform.rs`).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::SocketAddr;

/// The first line of every entry: its format.
const MAGIC: &str = "rally-generation 1";
/// The largest entry accepted (the gone list is capped well within it).
pub(crate) const MAX_ENTRY: usize = 64 << 10;
/// Gone links published at most (a keeper that found more keeps the rest to
/// itself: a joiner drawing one of those fails at its keeper, see
/// `reform.rs`).
pub(crate) const MAX_GONE: usize = 4096;

/// The lineage a member holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Held {
    pub nonce: u64,
    pub link: u32,
    pub addr: SocketAddr,
    pub name: String,
    pub gone: Vec<u32>,
}

/// What one member publishes at a generation's round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    pub held: Option<Held>,
    /// A listener bound for this round, used if the member joins.
    pub spare: SocketAddr,
    /// The link id this member takes if it joins.
    pub link: u32,
    /// The nonce of a fresh lineage, should this member's be the one used.
    pub fresh: u64,
    /// Its process id and host key (`plan::host_entry`).
    pub pid: u32,
    pub host: String,
}

/// One member's place in the generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Member {
    pub link: u32,
    pub addr: SocketAddr,
    /// It keeps its transport (else it starts a new one on its spare).
    pub keeps: bool,
}

/// The generation, as every member decides it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Decision {
    /// The lineage: its nonce and name.
    pub nonce: u64,
    pub name: String,
    /// In group-rank order.
    pub members: Vec<Member>,
}

/// Decides the generation from every member's entry (in group-rank order);
/// `name` names a fresh lineage. `Err` says why the round failed.
pub(crate) fn decide(entries: &[Entry], name: &str) -> Result<Decision, String> {
    let Some(first) = entries.first() else {
        return Err("a generation needs a member".into());
    };
    // The lineage most members hold; a tie goes to the lowest group rank's.
    let mut count: HashMap<u64, (usize, usize)> = HashMap::new();
    for (g, e) in entries.iter().enumerate() {
        if let Some(h) = &e.held {
            count.entry(h.nonce).or_insert((0, g)).0 += 1;
        }
    }
    let chosen = count
        .iter()
        .max_by_key(|(_, &(n, first_g))| (n, std::cmp::Reverse(first_g)))
        .map(|(&nonce, _)| nonce);
    fn holds(e: &Entry, chosen: Option<u64>) -> Option<&Held> {
        e.held.as_ref().filter(|h| Some(h.nonce) == chosen)
    }
    let holders: Vec<&Held> = entries.iter().filter_map(|e| holds(e, chosen)).collect();
    let keeps = |h: &Held| {
        holders
            .iter()
            .all(|o| std::ptr::eq(*o, h) || (o.link != h.link && !o.gone.contains(&h.link)))
    };
    let (nonce, lineage_name) = match holders.first() {
        Some(h) => (h.nonce, h.name.clone()),
        None => (first.fresh, name.to_owned()),
    };
    let members: Vec<Member> = entries
        .iter()
        .map(|e| match holds(e, chosen).filter(|h| keeps(h)) {
            Some(h) => Member {
                link: h.link,
                addr: h.addr,
                keeps: true,
            },
            None => Member {
                link: e.link,
                addr: e.spare,
                keeps: false,
            },
        })
        .collect();
    let keepers: Vec<&Held> = holders.iter().copied().filter(|h| keeps(h)).collect();
    for (g, m) in members.iter().enumerate() {
        if let Some(o) = members[..g].iter().position(|o| o.link == m.link) {
            return Err(format!(
                "group ranks {o} and {g} drew one link id ({:08x}); the next generation draws anew",
                m.link
            ));
        }
        if !m.keeps && keepers.iter().any(|k| k.gone.contains(&m.link)) {
            return Err(format!(
                "group rank {g} drew the link id of a member gone ({:08x}); the next generation draws anew",
                m.link
            ));
        }
    }
    Ok(Decision {
        nonce,
        name: lineage_name,
        members,
    })
}

impl Entry {
    /// The entry as published: one `key value` line each.
    pub fn encode(&self) -> String {
        let mut s = format!(
            "{MAGIC}\nspare {}\nlink {:08x}\nfresh {:016x}\nhost {} {}\n",
            self.spare, self.link, self.fresh, self.pid, self.host
        );
        if let Some(h) = &self.held {
            let _ = writeln!(s, "held {:016x} {:08x} {}", h.nonce, h.link, h.addr);
            let gone: Vec<String> = h
                .gone
                .iter()
                .take(MAX_GONE)
                .map(|l| format!("{l:08x}"))
                .collect();
            let _ = writeln!(s, "gone {}", gone.join(","));
            // Last: the name is the rest of its line.
            let _ = writeln!(s, "name {}", h.name);
        }
        s
    }

    /// Reads an entry, or says what is wrong with it.
    pub fn decode(raw: &[u8]) -> Result<Entry, String> {
        if raw.len() > MAX_ENTRY {
            return Err(format!("{} bytes, over {MAX_ENTRY}", raw.len()));
        }
        let text = std::str::from_utf8(raw).map_err(|_| "not UTF-8".to_owned())?;
        let mut lines = text.lines();
        if lines.next() != Some(MAGIC) {
            return Err(format!("it does not begin with {MAGIC:?}"));
        }
        let mut fields: HashMap<&str, &str> = HashMap::new();
        for line in lines {
            let (k, v) = line.split_once(' ').unwrap_or((line, ""));
            if fields.insert(k, v).is_some() {
                return Err(format!("{k:?} given twice"));
            }
        }
        let field = |k: &str| fields.get(k).copied().ok_or(format!("no {k:?}"));
        let hex32 = |k: &str, v: &str| {
            u32::from_str_radix(v, 16).map_err(|_| format!("{k} {v:?} is not 32-bit hex"))
        };
        let hex64 = |k: &str, v: &str| {
            u64::from_str_radix(v, 16).map_err(|_| format!("{k} {v:?} is not 64-bit hex"))
        };
        let addr = |k: &str, v: &str| {
            v.parse::<SocketAddr>()
                .map_err(|_| format!("{k} {v:?} is not an address"))
        };
        let (pid, host) = field("host")?
            .split_once(' ')
            .ok_or("host is not \"pid key\"")?;
        let held = match fields.get("held") {
            None => None,
            Some(v) => {
                let mut p = v.splitn(3, ' ');
                let (n, l, a) = (p.next(), p.next(), p.next());
                let (Some(n), Some(l), Some(a)) = (n, l, a) else {
                    return Err(format!("held {v:?} is not \"nonce link address\""));
                };
                let gone = match field("gone")? {
                    "" => Vec::new(),
                    g => g
                        .split(',')
                        .map(|x| hex32("gone", x))
                        .collect::<Result<_, _>>()?,
                };
                Some(Held {
                    nonce: hex64("held", n)?,
                    link: hex32("held", l)?,
                    addr: addr("held", a)?,
                    name: field("name")?.to_owned(),
                    gone,
                })
            }
        };
        let known = ["spare", "link", "fresh", "host", "held", "gone", "name"];
        if let Some(k) = fields.keys().find(|k| !known.contains(k)) {
            return Err(format!("unknown field {k:?}"));
        }
        if held.is_none() && (fields.contains_key("gone") || fields.contains_key("name")) {
            return Err("gone or name without held".into());
        }
        Ok(Entry {
            held,
            spare: addr("spare", field("spare")?)?,
            link: hex32("link", field("link")?)?,
            fresh: hex64("fresh", field("fresh")?)?,
            pid: pid
                .parse()
                .map_err(|_| format!("pid {pid:?} is not a number"))?,
            host: host.to_owned(),
        })
    }
}

#[cfg(test)]
mod tests;
