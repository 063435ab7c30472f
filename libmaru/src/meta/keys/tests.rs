//! Tests of the key directory.

use super::*;

fn scope(ns: &str, layout: &str) -> Scope {
    Scope {
        namespace: ns.into(),
        layout: layout.into(),
        backend: Backend::RemoteCxl,
    }
}

fn loc(region_id: u64, offset: u64) -> Location {
    Location {
        region_id,
        offset,
        length: 10,
    }
}

#[test]
fn keys_are_scoped_by_namespace_layout_and_backend() {
    let mut d = KeyDirectory::new();
    let a = d.scope_id(scope("ns", "l1"));
    let b = d.scope_id(scope("ns", "l2"));
    let c = d.scope_id(scope("other", "l1"));
    let cxl = d.scope_id(Scope {
        backend: Backend::Cxl,
        ..scope("ns", "l1")
    });
    assert_eq!(d.scope_id(scope("ns", "l1")), a, "interned");
    assert!(matches!(
        d.publish(a, "k", loc(1, 0), None),
        Published::New(_)
    ));
    assert!(d.find(a, "k").is_some());
    for s in [b, c, cxl] {
        assert!(d.find(s, "k").is_none());
    }
}

#[test]
fn the_first_publish_wins() {
    let mut d = KeyDirectory::new();
    let s = d.scope_id(scope("ns", "l"));
    let Published::New(id) = d.publish(s, "k", loc(1, 0), None) else {
        panic!("first publish is new");
    };
    assert_eq!(d.publish(s, "k", loc(2, 0), None), Published::Exists(id));
    assert_eq!(d.get(id).unwrap().loc, loc(1, 0));
    assert_eq!(d.at(2, 0), None, "the loser's page holds nothing");
}

#[test]
fn lru_order_follows_reads_and_regions_drop_at_once() {
    let mut d = KeyDirectory::new();
    let s = d.scope_id(scope("ns", "l"));
    let ids: Vec<KeyId> = (0..3)
        .map(
            |i| match d.publish(s, &format!("k{i}"), loc(1, i * 10), None) {
                Published::New(id) => id,
                other => panic!("{other:?}"),
            },
        )
        .collect();
    d.touch(ids[0]);
    let order: Vec<KeyId> = d.ranked_keys(1).map(|(_, id)| id).collect();
    assert_eq!(order, vec![ids[1], ids[2], ids[0]]);
    assert_eq!((d.region_keys(1), d.region_bytes(1)), (3, 30));
    d.publish(s, "other", loc(2, 0), None);
    assert_eq!(d.drop_region(1).len(), 3);
    assert!(d.find(s, "k0").is_none());
    assert_eq!(d.at(1, 0), None);
    assert_eq!((d.region_keys(1), d.region_bytes(1), d.len()), (0, 0, 1));
    assert!(d.remove(ids[0]).is_none(), "already gone");
}

fn tails_of(d: &KeyDirectory, region_id: u64) -> Vec<String> {
    d.tails(region_id)
        .map(|(_, id)| d.get(id).unwrap().name.to_string())
        .collect()
}

#[test]
fn a_key_is_a_tail_until_a_stored_key_names_it_as_its_previous_one() {
    let mut d = KeyDirectory::new();
    let s = d.scope_id(scope("ns", "l"));
    d.publish(s, "a", loc(1, 0), None);
    assert_eq!(tails_of(&d, 1), ["a"]);
    d.publish(s, "b", loc(1, 10), Some("a"));
    d.publish(s, "c", loc(1, 20), Some("b"));
    assert_eq!(tails_of(&d, 1), ["c"], "a and b have successors");
    assert_eq!(d.successors_of(s, "a"), 1);
    // A second continuation of the same prefix.
    d.publish(s, "b2", loc(1, 30), Some("a"));
    assert_eq!(d.successors_of(s, "a"), 2);
    let c = d.find(s, "c").unwrap();
    d.remove(c);
    assert_eq!(tails_of(&d, 1), ["b", "b2"], "b is a tail again");
    let b2 = d.find(s, "b2").unwrap();
    d.remove(b2);
    assert_eq!(d.successors_of(s, "a"), 1, "b still follows a");
    let b = d.find(s, "b").unwrap();
    d.remove(b);
    assert_eq!(tails_of(&d, 1), ["a"]);
    assert_eq!(d.names_held(), d.len(), "no count outlives its keys");
}

#[test]
fn a_successor_published_first_still_counts_and_reads_keep_tail_order() {
    let mut d = KeyDirectory::new();
    let s = d.scope_id(scope("ns", "l"));
    // Chunks of one chain may be published out of order, across regions.
    d.publish(s, "b", loc(2, 0), Some("a"));
    d.publish(s, "a", loc(1, 0), None);
    assert_eq!(tails_of(&d, 1), Vec::<String>::new(), "b follows a");
    assert_eq!(tails_of(&d, 2), ["b"]);
    d.publish(s, "x", loc(2, 10), None);
    let b = d.find(s, "b").unwrap();
    d.touch(b);
    assert_eq!(
        tails_of(&d, 2),
        ["x", "b"],
        "a read moves a tail to the back"
    );
    // Chains are per scope: a key of another scope naming `x` is no successor.
    let other = d.scope_id(scope("other", "l"));
    d.publish(other, "y", loc(3, 0), Some("x"));
    assert_eq!(tails_of(&d, 2), ["x", "b"]);
    // A key naming itself is a chain's head, not its own successor.
    d.publish(s, "self", loc(1, 10), Some("self"));
    assert!(tails_of(&d, 1).contains(&"self".to_string()));
}

#[test]
fn under_the_recency_order_chained_publishes_and_reads_cost_no_tree_node() {
    let mut d = KeyDirectory::new();
    let s = d.scope_id(scope("ns", "l"));
    for i in 0..64u64 {
        let prev = (i % 16 != 0).then(|| format!("k{}", i - 1));
        d.publish(s, &format!("k{i}"), loc(1, i * 10), prev.as_deref());
    }
    for i in (0..64).step_by(3) {
        let id = d.find(s, &format!("k{i}")).unwrap();
        d.touch(id);
    }
    let r = &d.by_region[&1];
    assert_eq!(r.order[LRU].len, 64);
    assert_eq!(
        (r.order[LRU].tree.len(), r.order[TAILS].tree.len()),
        (0, 0),
        "every key linked through its slot (8 bytes, no allocation)"
    );
    assert_eq!(d.tails(1).count(), 4, "one tail per prompt of 16");
}

/// The order of every region as the directory gives it: (rank, key) of its
/// keys, sorted, and its tails among them.
fn check_orders(d: &KeyDirectory) -> Result<(), proptest::test_runner::TestCaseError> {
    use proptest::prelude::*;
    for rid in 0..3u64 {
        let mut want: Vec<(u64, KeyId)> = d
            .iter()
            .filter(|(_, e)| e.loc.region_id == rid)
            .map(|(id, e)| (e.rank(), id))
            .collect();
        want.sort_unstable();
        let got: Vec<(u64, KeyId)> = d.ranked_keys(rid).collect();
        prop_assert_eq!(&got, &want, "order of region {}", rid);
        prop_assert_eq!(d.region_keys(rid), want.len());
        let tails: Vec<(u64, KeyId)> = want
            .iter()
            .copied()
            .filter(|&(_, id)| {
                let e = d.get(id).unwrap();
                d.successors_of(e.scope, e.name) == 0
            })
            .collect();
        let got: Vec<(u64, KeyId)> = d.tails(rid).collect();
        prop_assert_eq!(&got, &tails, "tails of region {}", rid);
    }
    Ok(())
}

proptest::proptest! {
    /// Under every ranking, whatever the publishes (chained or not), reads,
    /// removals, restores out of order and dropped regions, each region's order
    /// is its keys sorted by (rank, key) and its tails those no stored key
    /// follows: the lists linked through the slots and the trees beside them
    /// merge into the order a sorted set gave.
    #[test]
    fn each_region_order_is_its_keys_sorted_by_rank(
        ranking in 0u8..3,
        ops in proptest::collection::vec((0u8..6, 0u8..32, 0u8..32, 0u16..2000), 0..120),
    ) {
        let ranking = [Ranking::Recency, Ranking::Reuse, Ranking::ReuseEnds][ranking as usize];
        let mut d = KeyDirectory::ranked(ranking);
        let s = d.scope_id(scope("ns", "l"));
        let mut page = 0u64;
        let mut next_restored = 100_000u64;
        for (op, a, b, used) in ops {
            let name = format!("k{}", a % 24);
            let prev = (b % 3 != 0).then(|| format!("k{}", b % 24));
            page += 1;
            let at = loc(u64::from(a % 3), page * 10);
            match op {
                0 => {
                    d.publish(s, &name, at, prev.as_deref());
                }
                1 => {
                    if let Some(id) = d.find(s, &name) {
                        d.touch(id);
                    }
                }
                2 => {
                    if let Some(id) = d.find(s, &name) {
                        proptest::prop_assert!(d.remove(id).is_some());
                        proptest::prop_assert!(d.find(s, &name).is_none());
                    }
                }
                3 => {
                    // Recorded ids are unique: after every id given.
                    next_restored = next_restored.max(d.last_id()) + 1;
                    d.restore(next_restored, s, name.clone(), at, prev.as_deref(), u64::from(used));
                }
                4 => {
                    d.drop_region(u64::from(a % 3));
                }
                // Restores (and publishes, reads) between these are ordered
                // at once, at the end.
                _ if d.restoring => d.finish_restore(),
                _ => d.begin_restore(),
            }
            if !d.restoring {
                check_orders(&d)?;
            }
        }
        d.finish_restore();
        check_orders(&d)?;
        let ids: Vec<KeyId> = d.iter().map(|(id, _)| id).collect();
        for id in ids {
            d.remove(id);
        }
        proptest::prop_assert_eq!(d.names_held(), 0, "no name outlives its keys");
    }
}
