//! Tables of the machine's transitions: events in, actions out.

use std::time::Duration;

use super::*;

fn member(id: &str) -> Member {
    Member {
        replica_id: id.to_owned(),
        address: format!("addr-{id}"),
        store_address: format!("store-{id}"),
        step: 1,
        world_size: 1,
        shrink_only: false,
        commit_failures: 0,
        data: String::new(),
    }
}

#[test]
fn two_joins_make_a_quorum() {
    let t0 = Instant::now();
    let mut lh = Lighthouse::new(Knobs::ours(2), 100);
    let a = lh.handle(
        t0,
        Event::Join {
            session: 1,
            member: member("a"),
        },
    );
    assert!(a.is_empty(), "{a:?}");
    let a = lh.handle(
        t0,
        Event::Join {
            session: 2,
            member: member("b"),
        },
    );
    let [Action::Issue(q)] = a.as_slice() else {
        panic!("{a:?}")
    };
    assert_eq!(q.id, 101);
    assert_eq!(q.participants, vec![member("a"), member("b")]);
    let _ = Duration::ZERO;
}
