//! The decision's table, and the entry's decoder against any input.

use proptest::prelude::*;

use super::*;

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, 1], port))
}

/// A member holding lineage `nonce` as `link`, having found `gone` gone.
fn holder(nonce: u64, link: u32, gone: &[u32]) -> Entry {
    Entry {
        held: Some(Held {
            nonce,
            link,
            addr: addr(link as u16),
            name: format!("lineage {nonce:x}"),
            gone: gone.to_vec(),
        }),
        ..newcomer(1000 + link)
    }
}

/// A member with no lineage, proposing `link`.
fn newcomer(link: u32) -> Entry {
    Entry {
        held: None,
        spare: addr(20000 + link as u16),
        link,
        fresh: 0xf000 + u64::from(link),
        pid: link,
        host: "h".into(),
    }
}

/// (link, keeps) per group rank, and the lineage's nonce.
fn shape(d: &Decision) -> (u64, Vec<(u32, bool)>) {
    (
        d.nonce,
        d.members.iter().map(|m| (m.link, m.keeps)).collect(),
    )
}

#[test]
fn the_table() {
    #[allow(clippy::type_complexity)]
    let rows: Vec<(&str, Vec<Entry>, Result<(u64, Vec<(u32, bool)>), &str>)> = vec![
        (
            "first generation: nobody holds one, rank 0's fresh nonce",
            vec![newcomer(7), newcomer(8)],
            Ok((0xf007, vec![(7, false), (8, false)])),
        ),
        (
            "3 -> 2: both survivors keep",
            vec![holder(1, 10, &[12]), holder(1, 11, &[12])],
            Ok((1, vec![(10, true), (11, true)])),
        ),
        (
            "2 -> 3: survivors keep, a newcomer joins with its link",
            vec![holder(1, 10, &[]), newcomer(5), holder(1, 11, &[])],
            Ok((1, vec![(10, true), (5, false), (11, true)])),
        ),
        (
            "a survivor another found gone (stopped past its keep-alive) joins anew",
            vec![
                holder(1, 10, &[11]),
                holder(1, 11, &[]),
                holder(1, 12, &[11]),
            ],
            Ok((1, vec![(10, true), (1011, false), (12, true)])),
        ),
        (
            "found gone by each other: both join anew",
            vec![holder(1, 10, &[11]), holder(1, 11, &[10])],
            Ok((1, vec![(1010, false), (1011, false)])),
        ),
        (
            "a holder of another lineage (the minority) joins the majority's",
            vec![holder(2, 20, &[]), holder(1, 10, &[]), holder(1, 11, &[])],
            Ok((1, vec![(1020, false), (10, true), (11, true)])),
        ),
        (
            "a tie goes to the lineage of the lowest group rank",
            vec![holder(2, 20, &[]), holder(1, 10, &[])],
            Ok((2, vec![(20, true), (1010, false)])),
        ),
        (
            "two holders claiming one link: neither keeps",
            vec![
                holder(1, 10, &[]),
                Entry {
                    link: 77,
                    ..holder(1, 10, &[])
                },
                holder(1, 11, &[]),
            ],
            Ok((1, vec![(1010, false), (77, false), (11, true)])),
        ),
        (
            "a newcomer drawing a member's link fails the round",
            vec![holder(1, 10, &[]), newcomer(10)],
            Err("drew one link id"),
        ),
        (
            "a newcomer drawing a link a keeper found gone fails the round",
            vec![holder(1, 10, &[9]), newcomer(9)],
            Err("link id of a member gone"),
        ),
        (
            "a lone survivor keeps",
            vec![holder(1, 10, &[11, 12])],
            Ok((1, vec![(10, true)])),
        ),
    ];
    for (what, entries, want) in rows {
        let got = decide(&entries, "fresh").map(|d| shape(&d));
        match (&got, &want) {
            (Ok(g), Ok(w)) => assert_eq!(g, w, "{what}"),
            (Err(g), Err(w)) => assert!(g.contains(w), "{what}: {g}"),
            _ => panic!("{what}: got {got:?}, want {want:?}"),
        }
    }
}

#[test]
fn a_fresh_lineage_takes_the_given_name_and_a_kept_one_its_own() {
    let d = decide(&[newcomer(1), newcomer(2)], "torchft/3/0").unwrap();
    assert_eq!(d.name, "torchft/3/0");
    let d = decide(&[holder(4, 1, &[]), newcomer(2)], "torchft/5/0").unwrap();
    assert_eq!(d.name, "lineage 4");
    assert_eq!(
        d.members[1].addr,
        addr(20002),
        "a joiner listens on its spare"
    );
    assert_eq!(d.members[0].addr, addr(1), "a keeper where it listened");
}

#[test]
fn no_member_is_an_error() {
    assert!(decide(&[], "x").is_err());
}

#[test]
fn bad_entries_are_named() {
    let good = holder(1, 2, &[3]).encode();
    let rows: Vec<(String, &str)> = vec![
        ("nonsense".into(), "does not begin"),
        (good.replace("link ", "lnk "), "unknown field"),
        (
            good.replace("spare 10.0.0.1:21002", "spare nowhere"),
            "not an address",
        ),
        (good.replace("fresh ", "fresh zz"), "not 64-bit hex"),
        (good.replace("gone 00000003", "gone 3,x"), "not 32-bit hex"),
        (format!("{good}link 00000001\n"), "given twice"),
        (good.replace("host 1002 h", "host 1002"), "pid key"),
        (newcomer(1).encode() + "name x\n", "without held"),
        ("x".repeat(MAX_ENTRY + 1), "over"),
    ];
    for (raw, want) in rows {
        let e = Entry::decode(raw.as_bytes()).unwrap_err();
        assert!(e.contains(want), "{raw:?}: {e}");
    }
}

fn any_entry() -> impl Strategy<Value = Entry> {
    let held = prop::option::of((
        any::<u64>(),
        any::<u32>(),
        any::<u16>(),
        "[a-z0-9/ ._-]{0,40}",
        prop::collection::vec(any::<u32>(), 0..20),
    ));
    (
        held,
        any::<u16>(),
        any::<u32>(),
        any::<u64>(),
        any::<u32>(),
        "[a-z0-9-]{1,20}",
    )
        .prop_map(|(held, spare, link, fresh, pid, host)| Entry {
            held: held.map(|(nonce, link, port, name, gone)| Held {
                nonce,
                link,
                addr: addr(port),
                name,
                gone,
            }),
            spare: addr(spare),
            link,
            fresh,
            pid,
            host,
        })
}

proptest! {
    #[test]
    fn entries_read_back_as_written(e in any_entry()) {
        prop_assert_eq!(Entry::decode(e.encode().as_bytes()), Ok(e));
    }

    #[test]
    fn any_bytes_decode_or_fail_without_panicking(raw in prop::collection::vec(any::<u8>(), 0..300)) {
        let _ = Entry::decode(&raw);
    }

    #[test]
    fn mangled_entries_decode_or_fail_without_panicking(e in any_entry(), at in any::<usize>(), b in any::<u8>()) {
        let mut raw = e.encode().into_bytes();
        let i = at % raw.len();
        raw[i] = b;
        let _ = Entry::decode(&raw);
    }

    /// Every member decides alike whatever the entries; a kept link is the
    /// one its holder held, and no two members share a link.
    #[test]
    fn decisions_are_consistent(es in prop::collection::vec(any_entry(), 1..6)) {
        if let Ok(d) = decide(&es, "n") {
            for (e, m) in es.iter().zip(&d.members) {
                if m.keeps {
                    let h = e.held.as_ref().unwrap();
                    prop_assert_eq!((h.nonce, h.link, h.addr), (d.nonce, m.link, m.addr));
                } else {
                    prop_assert_eq!((m.link, m.addr), (e.link, e.spare));
                }
            }
            let mut links: Vec<u32> = d.members.iter().map(|m| m.link).collect();
            links.sort_unstable();
            links.dedup();
            prop_assert_eq!(links.len(), d.members.len());
        }
    }
}
