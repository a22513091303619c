//! Seed 001's ledger rules, computed by hand.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;

fn cfg() -> LedgerConfig {
    LedgerConfig {
        hold_ttl_ms: 20_000,
        retry_cap: 1,
        ..LedgerConfig::default()
    }
}

#[test]
fn seed_001_duplicate_and_retry_cap() {
    let mut l = Ledger::new(cfg());
    l.reserve(0, "job-17", None, 0, 800).unwrap();
    l.reserve(0, "job-18", None, 0, 800).unwrap();
    // A replay of a held key never reserves again, and reports what the hold holds.
    assert_eq!(
        l.reserve(1, "job-17", None, 1, 800),
        Err(LedgerReject::Duplicate {
            state: HoldState::Held,
            tokens_held: 800
        })
    );
    assert_eq!(
        l.reserve(1, "job-20", None, 2, 800),
        Err(LedgerReject::RetryCap {
            attempt: 2,
            retry_cap: 1
        })
    );
    let s = l.stats();
    assert_eq!((s.held, s.tokens_held), (2, 1600));
}

#[test]
fn amplification_is_one_after_commit_and_above_one_after_expiry() {
    let mut l = Ledger::new(cfg());
    l.reserve(0, "a", None, 0, 800).unwrap();
    let done = l.commit(12_000, "a", 800).unwrap();
    assert_eq!((done.state, done.tokens_spent), (HoldState::Done, 800));
    assert_eq!(l.stats().amplification, Some(1.0));
    // A done key still answers duplicates.
    assert!(matches!(
        l.reserve(13_000, "a", None, 1, 800),
        Err(LedgerReject::Duplicate {
            state: HoldState::Done,
            ..
        })
    ));

    l.reserve(0, "b", None, 0, 800).unwrap();
    let expired = l.expire_due(20_000);
    assert_eq!(expired.len(), 1);
    assert_eq!(
        (expired[0].state, expired[0].tokens_wasted),
        (HoldState::Expired, 800)
    );
    assert_eq!(l.stats().amplification, Some(2.0)); // (800 + 800) / 800
                                                    // Committing an expired hold is refused and changes nothing.
    assert!(matches!(
        l.commit(21_000, "b", 800),
        Err(SettleError::HoldExpired(_))
    ));
    assert_eq!(l.stats().tokens_spent, 800);
}

#[test]
fn commit_after_ttl_expires_the_hold_instead() {
    let mut l = Ledger::new(cfg());
    l.reserve(0, "a", None, 0, 500).unwrap();
    match l.commit(20_000, "a", 500) {
        Err(SettleError::HoldExpired(r)) => {
            assert_eq!((r.state, r.tokens_wasted), (HoldState::Expired, 500))
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(l.stats().held, 0);
}

#[test]
fn a_cancelled_or_rejected_key_may_be_retried_within_the_cap() {
    let mut l = Ledger::new(cfg());
    l.record_rejection(0, "k", None, 0, 100).unwrap();
    let r = l.reserve(5, "k", None, 1, 100).unwrap();
    // A new hold's version is at least the time of the change (5), so versions never go
    // back even for a key forgotten and reserved again; a settlement is the next version.
    assert_eq!((r.state, r.version), (HoldState::Held, 5));
    let c = l.cancel(6, "k", 30).unwrap();
    assert_eq!(
        (c.state, c.tokens_wasted, c.version),
        (HoldState::Cancelled, 30, 6)
    );
    assert_eq!(
        l.commit(7, "k", 1),
        Err(SettleError::NotHeld(HoldState::Cancelled))
    );
    assert_eq!(l.commit(7, "nope", 1), Err(SettleError::MissingHold));
    let s = l.stats();
    assert_eq!((s.cancelled, s.rejected, s.tokens_wasted), (1, 1, 30));
}

#[test]
fn tenant_grants_cover_holds_spend_and_waste() {
    let mut c = cfg();
    c.grants.insert("k:team".into(), 1000);
    let mut l = Ledger::new(c);
    l.reserve(0, "a", Some("k:team"), 0, 600).unwrap();
    assert_eq!(
        l.reserve(0, "b", Some("k:team"), 0, 500),
        Err(LedgerReject::BudgetExhausted {
            remaining: 400,
            requested: 500
        })
    );
    l.commit(1, "a", 550).unwrap();
    assert_eq!(l.remaining(Some("k:team")), Some(450));
    assert_eq!(
        l.remaining(Some("k:other")),
        None,
        "no default grant: unlimited"
    );
}

#[test]
fn restore_keeps_live_holds_expires_stale_ones_and_remembers_done_keys() {
    let mut l = Ledger::new(cfg());
    l.reserve(0, "live", None, 0, 100).unwrap();
    l.reserve(0, "stale", None, 0, 200).unwrap();
    l.commit(1, "stale", 0).ok();
    l.reserve(0, "gone", None, 0, 300).unwrap();
    let mut records: Vec<HoldRecord> = ["live", "stale", "gone"]
        .iter()
        .map(|k| l.get(k).unwrap().clone())
        .collect();
    // An older version of "stale" arrives too (a replayed write): the newer one wins.
    let mut old = records[1].clone();
    old.version = 1;
    old.state = HoldState::Held;
    records.push(old);
    // The process restarts at t = 20 000: "live" and "gone" were both placed at 0 with a
    // 20 s TTL, so both expire on load; "stale" is done and still answers duplicates.
    let (r, changed) = Ledger::restore(cfg(), records, 20_000);
    assert_eq!(changed.len(), 2);
    assert!(changed.iter().all(|c| c.state == HoldState::Expired));
    assert!(matches!(
        r.check("stale", None, 0, 1),
        Err(LedgerReject::Duplicate {
            state: HoldState::Done,
            ..
        })
    ));
    let s = r.stats();
    assert_eq!((s.held, s.tokens_wasted), (0, 400));
}

#[test]
fn settled_keys_are_forgotten_after_the_retention() {
    let mut c = cfg();
    c.retention_ms = 1000;
    let mut l = Ledger::new(c);
    l.reserve(0, "a", None, 0, 1).unwrap();
    l.commit(10, "a", 1).unwrap();
    l.expire_due(500);
    assert_eq!(l.len(), 1);
    l.expire_due(1011);
    assert_eq!(l.len(), 0);
    assert_eq!(l.stats().tokens_spent, 1, "totals survive forgetting");
}

/// Two ledgers fed the same changes by two routes end in the same state: the same records,
/// totals and per-tenant budgets, and the same indexes (what expires, what is forgotten).
fn assert_same(a: &Ledger, b: &Ledger) {
    let sorted = |l: &Ledger| {
        let mut v: Vec<HoldRecord> = l.records().cloned().collect();
        v.sort_by(|x, y| x.key.cmp(&y.key));
        v
    };
    assert_eq!(sorted(a), sorted(b));
    assert_eq!(a.stats(), b.stats());
    assert_eq!(a.expiry, b.expiry, "the expiry index");
    assert_eq!(a.settled, b.settled, "the retention index");
    for t in [None, Some("t1")] {
        assert_eq!(a.remaining(t), b.remaining(t));
    }
}

/// The two-step route the gate took before [`Placing::untimed`]: a hold placed with its TTL,
/// then taken off the expiry index. The reference the one-step route is checked against.
fn untrack_expiry(l: &mut Ledger, key: &str) -> Option<HoldRecord> {
    let r = l.holds.get_mut(key)?;
    if r.state != HoldState::Held {
        return None;
    }
    l.expiry.untrack(r);
    r.expires_at_ms = NEVER;
    Some(r.clone())
}

#[test]
fn an_untimed_hold_is_the_hold_untrack_expiry_leaves() {
    let mut c = cfg();
    c.default_grant_tokens = Some(10_000);
    let (mut a, mut b) = (Ledger::new(c.clone()), Ledger::new(c));
    let untimed = Placing {
        untimed: true,
        ..Placing::default()
    };
    for (i, tenant) in [(0, None), (1, Some("t1"))] {
        let key = Shared::from(format!("k{i}"));
        let ra = a.reserve(5, &key, tenant, 0, 100).unwrap();
        let ra = untrack_expiry(&mut a, &key).unwrap_or(ra);
        let rb = b.reserve_shared(5, &key, tenant, 0, 100, untimed).unwrap();
        assert_eq!(ra, rb);
        assert_eq!(rb.expires_at_ms, NEVER);
    }
    assert!(
        b.expiry.entries().is_empty(),
        "an untimed hold is never due"
    );
    assert_same(&a, &b);
    // Past every TTL nothing expires in either, and both settle alike.
    assert!(a.expire_due(1_000_000).is_empty() && b.expire_due(1_000_000).is_empty());
    assert_eq!(a.commit(1_000_001, "k0", 7), b.commit(1_000_001, "k0", 7));
    assert_eq!(a.cancel(1_000_002, "k1", 3), b.cancel(1_000_002, "k1", 3));
    assert_same(&a, &b);
}

#[test]
fn settling_without_remembering_is_settling_then_forgetting() {
    let mut c = cfg();
    c.retention_ms = 60_000;
    let (mut a, mut b) = (Ledger::new(c.clone()), Ledger::new(c));
    for l in [&mut a, &mut b] {
        l.reserve(0, "done", Some("t1"), 0, 100).unwrap();
        l.reserve(0, "gone", None, 0, 100).unwrap();
        l.reserve(0, "late", None, 0, 100).unwrap();
        l.reserve(0, "kept", None, 0, 100).unwrap();
    }
    // Done, cancelled, and past its TTL (it ends expired, reported as such).
    let ra = a.commit(10, "done", 60);
    a.forget("done");
    let rb = b.settle_as(10, "done", Settlement::Done { spent: 60 }, false);
    assert_eq!(ra, rb);
    let ra = a.cancel(11, "gone", 5);
    a.forget("gone");
    let rb = b.settle_as(11, "gone", Settlement::Cancelled { wasted: 5 }, false);
    assert_eq!(ra, rb);
    let ra = a.commit(30_000, "late", 1);
    assert!(matches!(ra, Err(SettleError::HoldExpired(_))));
    a.forget("late");
    let rb = b.settle_as(30_000, "late", Settlement::Done { spent: 1 }, false);
    assert_eq!(ra, rb);
    // Already expired by the ledger: reported again, and forgotten.
    assert_eq!(a.expire_due(30_001), b.expire_due(30_001));
    let ra = a.commit(30_002, "kept", 1);
    a.forget("kept");
    let rb = b.settle_as(30_002, "kept", Settlement::Done { spent: 1 }, false);
    assert_eq!(ra, rb);
    assert_same(&a, &b);
    assert!(b.is_empty(), "every key forgotten");
    assert_eq!(
        b.settle_as(30_003, "done", Settlement::Done { spent: 1 }, false),
        Err(SettleError::MissingHold)
    );
}

#[test]
fn a_restored_untimed_hold_is_not_in_the_expiry_index_and_settles() {
    let mut l = Ledger::new(cfg());
    let how = Placing {
        untimed: true,
        ..Placing::default()
    };
    let r = l
        .reserve_shared(0, &Shared::from("k"), None, 0, 50, how)
        .unwrap();
    let (mut back, changed) =
        Ledger::restore_keeping(cfg(), [r], 100_000, &["k".to_owned()].into(), &[].into());
    assert!(changed.is_empty(), "a live key keeps its hold: {changed:?}");
    assert!(back.expiry.entries().is_empty());
    let done = back.commit(100_001, "k", 40).unwrap();
    assert_eq!((done.state, done.tokens_spent), (HoldState::Done, 40));
    assert_eq!(back.stats().tokens_held, 0);
}

/// The ledger's indexes agree with its records: a held record with a TTL is in the expiry
/// index under its expiry, a settled one in the retention index under its last change, and
/// nothing else is in either.
fn assert_indexes(l: &Ledger) {
    let mut expiry = std::collections::BTreeSet::new();
    let mut settled = std::collections::BTreeSet::new();
    for r in l.records() {
        match r.state {
            HoldState::Held if r.expires_at_ms != NEVER => {
                expiry.insert((r.expires_at_ms, r.key.clone()));
            }
            HoldState::Held => {}
            _ => {
                settled.insert((r.updated_at_ms, r.key.clone()));
            }
        }
    }
    assert_eq!(l.expiry.entries(), &expiry, "the expiry index");
    assert_eq!(l.settled, settled, "the retention index");
}

#[test]
fn one_step_and_two_step_routes_agree_over_random_histories() {
    // Route a: reserve, then untrack the TTL; settle, then forget a generated key. Route b:
    // the one-step calls the gate now makes. Random histories of both, state for state,
    // restarts included, with every index checked against the records after every step.
    let mut rng = crate::test_rng::XorShift(0x2545_f491_4f6c_dd1d);
    let mut next = |m: u64| rng.below(m);
    for _history in 0..300 {
        let mut c = cfg();
        c.retry_cap = 3;
        c.retention_ms = 500;
        c.default_grant_tokens = Some(5_000);
        let (mut a, mut b) = (Ledger::new(c.clone()), Ledger::new(c.clone()));
        let mut now = 0;
        for _step in 0..120 {
            let key = format!("k{}", next(6));
            let generated = key == "k0" || key == "k1";
            let tenant = [None, Some("t1")][next(2) as usize];
            match next(7) {
                0 => now += next(40_000),
                1 | 2 => {
                    let (attempt, tokens, untimed) = (next(3) as u32, next(900), next(2) == 0);
                    let ra = a.reserve(now, &key, tenant, attempt, tokens);
                    let ra = match (ra, untimed) {
                        (Ok(r), true) => Ok(untrack_expiry(&mut a, &key).unwrap_or(r)),
                        (r, _) => r,
                    };
                    let how = Placing {
                        untimed,
                        ..Placing::default()
                    };
                    let rb = b.reserve_shared(
                        now,
                        &Shared::from(key.as_str()),
                        tenant,
                        attempt,
                        tokens,
                        how,
                    );
                    assert_eq!(ra, rb);
                }
                3 | 4 => {
                    let (n, done) = (next(900), next(2) == 0);
                    let ra = match done {
                        true => a.commit(now, &key, n),
                        false => a.cancel(now, &key, n),
                    };
                    if generated && matches!(ra, Ok(_) | Err(SettleError::HoldExpired(_))) {
                        a.forget(&key);
                    }
                    let how = match done {
                        true => Settlement::Done { spent: n },
                        false => Settlement::Cancelled { wasted: n },
                    };
                    assert_eq!(ra, b.settle_as(now, &key, how, !generated));
                }
                5 => assert_eq!(a.expire_due(now), b.expire_due(now)),
                _ => {
                    let records = |l: &Ledger| l.records().cloned().collect::<Vec<_>>();
                    let (ra, rb) = (records(&a), records(&b));
                    let (na, ca) = Ledger::restore(c.clone(), ra, now);
                    let (nb, cb) = Ledger::restore(c.clone(), rb, now);
                    let sort = |mut v: Vec<HoldRecord>| {
                        v.sort_by(|x, y| x.key.cmp(&y.key));
                        v
                    };
                    assert_eq!(sort(ca), sort(cb));
                    (a, b) = (na, nb);
                }
            }
            assert_same(&a, &b);
            assert_indexes(&a);
            assert_indexes(&b);
        }
    }
}
