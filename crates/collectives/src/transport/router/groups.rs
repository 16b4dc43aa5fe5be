//! Each group's state on this rank, one entry per group: its members, what
//! else hears its aborts, its links to its internal groups and to its own
//! group, how far the telling of its abort has come, and the calls found
//! diverged held for it; or, once it is dropped here, that it was retired.
//!
//! The entries live in the router, under its lock, so that forming a group
//! (its members, hearer and links, which arrive one by one), aborting it and
//! retiring it each touch one entry under one lock, and a decision that
//! reads a group's abort and its other state sees both at one moment.
//! An entry is made by whatever names the group first (a group's members
//! may be registered after a peer told of its abort, say) and stays until
//! the group is retired; then it becomes [`Entry::Retired`], which nothing
//! makes live again (ids are never reused).

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use tokio::sync::watch;

use super::super::diverged::Held;
use super::super::{ChildLink, HearsAborts, Members, Telling};

/// A live group's state here.
#[derive(Default)]
pub(crate) struct Group {
    /// Its name and members, once registered.
    pub members: Option<Members>,
    /// What else hears its aborts and this rank's kill (its shared memory).
    pub hearer: Option<Weak<dyn HearsAborts>>,
    /// Its internal groups (see [`ChildLink`]).
    pub children: Vec<Arc<ChildLink>>,
    /// For an internal group, its link to its group.
    pub parent: Option<Arc<ChildLink>>,
    /// How far the telling of its abort has come (once aborted here).
    pub telling: Option<watch::Receiver<Telling>>,
    /// Calls found diverged here, or told so by a member that left (see
    /// `diverged.rs`).
    pub finding: Option<Held>,
}

/// A group's entry.
pub(crate) enum Entry {
    /// Boxed: most entries are retired ones.
    Live(Box<Group>),
    /// Dropped here: frames, wants and aborts for it are dropped.
    Retired,
}

#[derive(Default)]
pub(crate) struct Groups {
    map: HashMap<u64, Entry>,
}

impl Groups {
    /// Group `comm`'s state, if it is live here.
    pub fn get(&self, comm: u64) -> Option<&Group> {
        match self.map.get(&comm) {
            Some(Entry::Live(g)) => Some(g),
            _ => None,
        }
    }

    /// Group `comm`'s state, made if it has none; `None` once retired.
    pub fn entry(&mut self, comm: u64) -> Option<&mut Group> {
        match self
            .map
            .entry(comm)
            .or_insert_with(|| Entry::Live(Box::default()))
        {
            Entry::Live(g) => Some(g),
            Entry::Retired => None,
        }
    }

    /// Group `comm`'s state, if it is live here (made by nothing).
    pub fn get_mut(&mut self, comm: u64) -> Option<&mut Group> {
        match self.map.get_mut(&comm) {
            Some(Entry::Live(g)) => Some(g),
            _ => None,
        }
    }

    pub fn is_retired(&self, comm: u64) -> bool {
        matches!(self.map.get(&comm), Some(Entry::Retired))
    }

    /// Group `comm`'s members, if registered.
    pub fn members(&self, comm: u64) -> Option<&Members> {
        self.get(comm)?.members.as_ref()
    }

    /// The live groups.
    pub fn live(&self) -> impl Iterator<Item = (u64, &Group)> + '_ {
        self.map.iter().filter_map(|(&c, e)| match e {
            Entry::Live(g) => Some((c, &**g)),
            Entry::Retired => None,
        })
    }

    /// Links internal group `child` to group `parent`.
    pub fn add_child(&mut self, parent: u64, child: Arc<ChildLink>) {
        if let Some(g) = self.entry(child.comm) {
            g.parent = Some(child.clone());
        }
        if let Some(g) = self.entry(parent) {
            g.children.push(child);
        }
    }

    /// Forgets group `comm`'s state (it becomes retired), and its link in
    /// its group's list of internal groups.
    pub fn retire(&mut self, comm: u64) {
        let old = self.map.insert(comm, Entry::Retired);
        let Some(Entry::Live(g)) = old else {
            return;
        };
        if let Some(link) = &g.parent {
            if let Some(p) = self.get_mut(link.parent) {
                p.children.retain(|l| l.comm != comm);
            }
        }
    }

    /// The size of each table here: live groups, and what they hold.
    #[cfg(test)]
    pub fn sizes(&self) -> [(&'static str, usize); 7] {
        let count = |f: fn(&Group) -> bool| self.live().filter(|(_, g)| f(g)).count();
        [
            ("groups", self.live().count()),
            ("members", count(|g| g.members.is_some())),
            ("hearers", count(|g| g.hearer.is_some())),
            ("children", self.live().map(|(_, g)| g.children.len()).sum()),
            ("parents", count(|g| g.parent.is_some())),
            ("telling", count(|g| g.telling.is_some())),
            ("diverged", count(|g| g.finding.is_some())),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(ranks: &[usize]) -> Members {
        Members {
            name: "g".into(),
            ranks: ranks.into(),
        }
    }

    #[test]
    fn retiring_an_internal_group_unlinks_it_from_its_group() {
        let mut g = Groups::default();
        g.entry(1).unwrap().members = Some(members(&[0, 1]));
        g.add_child(1, Arc::new(ChildLink::new(2, 1, 3)));
        g.add_child(1, Arc::new(ChildLink::new(3, 1, 3)));
        assert_eq!(g.get(1).unwrap().children.len(), 2);
        g.retire(2);
        assert!(g.is_retired(2) && g.get(2).is_none() && g.entry(2).is_none());
        let left: Vec<u64> = g.get(1).unwrap().children.iter().map(|l| l.comm).collect();
        assert_eq!(left, [3]);
        g.retire(3);
        g.retire(1);
        assert!(g.sizes().iter().all(|(_, n)| *n == 0), "{:?}", g.sizes());
    }

    #[test]
    fn a_link_made_before_either_group_registers_makes_both_entries() {
        let mut g = Groups::default();
        g.add_child(1, Arc::new(ChildLink::new(2, 1, 1)));
        assert!(g.get(2).unwrap().parent.is_some());
        assert!(g.members(1).is_none());
        g.entry(1).unwrap().members = Some(members(&[4]));
        assert_eq!(&*g.members(1).unwrap().ranks, [4]);
    }
}
