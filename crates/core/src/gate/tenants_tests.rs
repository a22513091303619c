//! Fair share between tenants inside a class, on hand-computed cases.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::tests::{cfg, drain, req};
use super::*;
use crate::config::Unlisted;

/// Two slots, every job 1000 ms, `prod` with a 4000 ms deadline: a newcomer's slack is
/// 3000 ms. Tenants `a` and `b` weigh 1 each.
fn fair_cfg() -> GateConfig {
    let mut c = cfg(2, 1000.0);
    c.fairness.weights.insert("a".into(), 1.0);
    c.fairness.weights.insert("b".into(), 1.0);
    c
}

fn offer_as(g: &mut Gate, now: Millis, tenant: &str) -> Decision {
    let mut r = req(g, "prod");
    r.fairness_id = Some(tenant.into());
    g.offer(now, r)
}

/// `a` floods from t=10 ms while `b` is active (it sent one request at 0): the requests of
/// `a` that find more than its share's worth queued are refused early, and `b` still gets in.
fn flood(c: GateConfig) -> (Vec<Decision>, Decision) {
    let mut g = Gate::new(c).unwrap();
    assert!(offer_as(&mut g, 0, "b").admitted());
    drain(&mut g, 0);
    let flood: Vec<Decision> = (0..20).map(|i| offer_as(&mut g, 10 + i, "a")).collect();
    drain(&mut g, 30);
    let b = offer_as(&mut g, 100, "b");
    (flood, b)
}

#[test]
fn a_flooding_tenant_is_refused_on_its_share_and_the_other_keeps_its_slack() {
    // Without fairness (no weights: one bucket) the flood fills the queue up to everyone's
    // slack and b is refused although its own traffic did not change.
    let mut plain = cfg(2, 1000.0);
    plain.fairness = Default::default();
    let (_, b) = flood(plain);
    assert_eq!(b.reason, Reason::ProjectedWaitExceedsSlack);
    assert_eq!(b.tenant_share, None);

    let (flood, b) = flood(fair_cfg());
    // a's share is 1/2 of 2 slots: one slot's worth. b's job and a's first take the two
    // slots (about 1000 ms left each: 1000 ms of running work per slot), so a's queued work
    // may be at most its slack less that, about 2990 - 1000 ms at one slot: two of its jobs
    // queue (2000 ms), the third would find 2000 ms queued (2000 + 1000 ms, over its
    // slack) and is refused, as is every later one.
    let admitted = flood.iter().filter(|d| d.admitted()).count();
    assert_eq!(admitted, 3, "{flood:#?}");
    let refused = &flood[3];
    assert_eq!(refused.reason, Reason::TenantShareExceeded);
    assert_eq!(refused.tenant_share, Some(0.5));
    assert!(refused.should_retry);
    // Retry-After: its backlog drains at its share (1 slot) to what fits its slack: about
    // 3000 ms against 4000 - 1000 - 13 = 2987 ms of slack -> some ms; the floor applies.
    let r = GateConfig::default().retry;
    let after = refused.retry_after_ms.unwrap();
    let most = r.min_retry_after_ms * u64::from(100 + r.jitter_percent) / 100;
    assert!(after >= r.min_retry_after_ms && after <= most, "{after}");
    assert!(flood[3..]
        .iter()
        .all(|d| d.reason == Reason::TenantShareExceeded));
    // b: its wait is a's two queued jobs behind the two running ones, about 2000 ms, within
    // its 3000 ms slack.
    assert!(b.admitted(), "{b:#?}");
    assert_eq!(b.reason, Reason::WithinSlack);
    assert!(b.projected_wait_ms <= 3000, "{}", b.projected_wait_ms);
}

#[test]
fn alone_a_tenant_has_the_whole_pool() {
    // b never came: a's share is the whole pool, and it is refused (like any class) only
    // when the wait passes its slack.
    let mut g = Gate::new(fair_cfg()).unwrap();
    let d: Vec<Decision> = (0..20).map(|i| offer_as(&mut g, i, "a")).collect();
    assert!(d.iter().all(|d| d.tenant_share == Some(1.0)));
    assert!(d.iter().all(|d| d.reason != Reason::TenantShareExceeded));
    assert_eq!(
        d.iter().filter(|d| d.admitted()).count(),
        7,
        "2 running, then the k-th queued job waits 1000 + 500 k ms: k = 0..4 fit 3000 ms"
    );
}

#[test]
fn a_tenant_back_from_idle_banks_no_credit_and_idle_shares_go_to_the_others() {
    let mut g = Gate::new(fair_cfg()).unwrap();
    assert!(offer_as(&mut g, 0, "b").admitted());
    // Past active_ms, b has left the share: a alone again.
    let later = g.cfg.fairness.active_ms + 10;
    g.tick(later);
    let d = offer_as(&mut g, later, "a");
    assert_eq!(d.tenant_share, Some(1.0));
    assert_eq!(g.snapshot(later).classes[0].tenants_tracked, 1);
}

#[test]
fn unlisted_ids_share_one_bucket_so_minted_ids_gain_nothing() {
    let mut g = Gate::new(fair_cfg()).unwrap();
    assert!(offer_as(&mut g, 0, "a").admitted());
    // A hundred fresh ids: one bucket, `other`, with the default weight.
    let minted: Vec<Decision> = (0..100)
        .map(|i| offer_as(&mut g, 1, &format!("minted-{i}")))
        .collect();
    let snap = g.snapshot(2);
    assert_eq!(snap.classes[0].tenants_tracked, 2, "a and other");
    assert!(snap.classes[0].tenants.iter().any(|t| t.tenant == "other"));
    assert!(minted
        .iter()
        .any(|d| d.reason == Reason::TenantShareExceeded));
    // A request with no id at all is in `other` too.
    let none = g.offer(3, req(&g, "prod"));
    assert_eq!(none.tenant_share, Some(0.5));
}

#[test]
fn own_buckets_for_unlisted_ids_are_bounded() {
    let mut c = fair_cfg();
    c.fairness.unlisted = Unlisted::Own;
    c.fairness.max_tenants = 5;
    let mut g = Gate::new(c).unwrap();
    for i in 0..50 {
        offer_as(&mut g, i, &format!("id-{i}"));
    }
    let snap = g.snapshot(60);
    // Five ids of their own, then `other` for the rest.
    assert_eq!(snap.classes[0].tenants_tracked, 6);
    assert!(snap.classes[0].tenants.iter().any(|t| t.tenant == "other"));
}

#[test]
fn the_default_config_has_no_shares_and_decides_as_before() {
    let mut g = Gate::new(cfg(2, 1000.0)).unwrap();
    let d = offer_as(&mut g, 0, "a");
    assert_eq!(d.tenant_share, None);
    assert_eq!(g.snapshot(0).classes[0].tenants_tracked, 0);
}

#[test]
fn queued_work_leaves_the_bucket_however_the_job_leaves_the_queue() {
    let mut g = Gate::new(fair_cfg()).unwrap();
    for i in 0..6 {
        offer_as(&mut g, i, "a");
    }
    let queued = |g: &Gate| g.snapshot(10).classes[0].tenants[0].queued_work_ms;
    assert_eq!(queued(&g), 6000);
    drain(&mut g, 10); // two dispatched
    assert_eq!(queued(&g), 4000);
    let id = JobId(5);
    assert!(g.cancel(20, id).is_some());
    assert_eq!(queued(&g), 3000);
    // Past every deadline: the rest are dropped, and nothing stays counted.
    g.tick(10_000);
    drain(&mut g, 10_000);
    assert_eq!(g.snapshot(10_000).classes[0].tenants[0].queued_work_ms, 0);
}

/// One slot at 1 ms per output token (a request's estimate is its size hint), `prod` with a
/// 4000 ms deadline and a 1000 ms displacement window.
fn displacing(fair: bool) -> Gate {
    let mut c = if fair { fair_cfg() } else { cfg(1, 0.0) };
    c.pools[0].slots = 1;
    c.pools[0].prior.overhead_ms = 0.0;
    c.pools[0].prior.decode_ms_per_token = 1.0;
    c.classes[0].displace_within_ms = Some(1000);
    Gate::new(c).unwrap()
}

fn sized_as(g: &mut Gate, now: Millis, tenant: &str, tokens: u32) -> Decision {
    let mut r = req(g, "prod");
    r.fairness_id = Some(tenant.into());
    r.expected_output_tokens = Some(tokens);
    g.offer(now, r)
}

#[test]
fn a_newcomer_does_not_displace_a_tenant_further_within_its_share() {
    for fair in [false, true] {
        let mut g = displacing(fair);
        // a runs 1000 ms and queues 1000 more; b queues 1600 (wait 2000, slack 2400).
        assert!(sized_as(&mut g, 0, "a", 1000).admitted());
        drain(&mut g, 0);
        assert!(sized_as(&mut g, 0, "a", 1000).admitted());
        let b = sized_as(&mut g, 0, "b", 1600);
        assert!(b.admitted(), "{b:?}");
        // a's 1500 ms newcomer: wait 3600 > slack 2500. Without b's job it would wait 2000
        // and fit; but a would then have 2500 ms queued at half the pool (5000 ms) against
        // b's 1600 (3200): b is further within its share, and keeps its place.
        let c = sized_as(&mut g, 0, "a", 1500);
        if fair {
            assert_eq!(
                (c.reason, c.displaced),
                (Reason::ProjectedWaitExceedsSlack, None)
            );
        } else {
            assert_eq!(
                (c.reason, c.displaced),
                (Reason::WithinSlack, Some(b.job_id))
            );
        }
    }
}

#[test]
fn a_tenant_cannot_widen_its_share_by_asking_for_a_longer_deadline() {
    let mut g = Gate::new(fair_cfg()).unwrap();
    assert!(offer_as(&mut g, 0, "b").admitted());
    drain(&mut g, 0);
    // a asks for a day on each request: its share is still held to the class's 4000 ms.
    let flood: Vec<Decision> = (0..20)
        .map(|i| {
            let mut r = req(&g, "prod");
            r.fairness_id = Some("a".into());
            r.deadline = Some(10 + i + 86_400_000);
            g.offer(10 + i, r)
        })
        .collect();
    assert_eq!(
        flood.iter().filter(|d| d.admitted()).count(),
        3,
        "{flood:#?}"
    );
    assert!(flood[3..]
        .iter()
        .all(|d| d.reason == Reason::TenantShareExceeded));
    drain(&mut g, 30);
    assert!(offer_as(&mut g, 100, "b").admitted(), "b keeps its slack");
}
