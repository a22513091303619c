//! Hand-computed cases for the operator controls: shadow mode, drains, shutdown, reload and
//! overflow pools. The base config is `tests::cfg`: pool `free`, classes `prod` (priority
//! 100, deadline 4000 ms, retry hint `dedicated_pool`) and `probe` (priority 10, best effort,
//! max queue age 500 ms), every job costing the given service time.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::tests::{cfg, drain, req};
use super::*;
use crate::config::{ClassConfig, OverflowMode, PoolConfig, PriorConfig};

fn pool(name: &str, slots: u32, service_ms: f64) -> PoolConfig {
    PoolConfig {
        name: name.into(),
        slots,
        prior: PriorConfig {
            overhead_ms: service_ms,
            prefill_ms_per_token: 0.0,
            decode_ms_per_token: 0.0,
            decode_ms_per_1k_context: 0.0,
            batch_slowdown: 0.0,
            chars_per_token: 4.0,
            default_output_tokens: 0,
            learn: false,
        },
        promise_guard_ms: 0,
        ..PoolConfig::default()
    }
}

#[test]
fn shadow_admits_would_be_rejections_and_reports_the_reason() {
    // One slot, 800 ms jobs, prod slack 3200: the sixth prod would wait 4000 > 3200.
    let mut g = Gate::new(cfg(1, 800.0)).unwrap();
    g.set_shadow(true);
    for _ in 0..5 {
        assert_eq!(g.offer(0, req(&g, "prod")).action, Action::Admit);
        drain(&mut g, 0);
    }
    let d = g.offer(0, req(&g, "prod"));
    let shadowed = d.job_id;
    assert_eq!(d.action, Action::ShadowReject);
    assert_eq!(d.reason, Reason::ProjectedWaitExceedsSlack);
    assert!(d.admitted(), "shadow mode admits");
    assert!(d.tokens_held > 0 || d.idempotency_key.starts_with("gen-"));
    assert_eq!(g.live_jobs(), 6);
    // Nothing is dropped on its deadline either: at t=4000 most prod jobs are hopeless.
    g.tick(4_000);
    assert!(drain(&mut g, 4_000).is_empty());
    assert_eq!(g.live_jobs(), 6);
    // An operator's switch is not a threshold: a disabled class stays refused.
    g.set_class_enabled(LaneId(1), false);
    let d = g.offer(4_000, req(&g, "probe"));
    assert_eq!(
        (d.action, d.reason),
        (Action::Reject, Reason::ClassDisabled)
    );
    // Back to enforcing: the same request is rejected.
    g.set_shadow(false);
    let d = g.offer(4_000, req(&g, "prod"));
    assert_eq!(d.action, Action::Reject);
    // The jobs admitted under the rules are held to their deadlines again (the four queued
    // ones are past theirs); the one shadow mode admitted against them was promised no
    // deadline, and keeps that promise.
    g.tick(4_000);
    let dropped: Vec<JobId> = drain(&mut g, 4_000)
        .iter()
        .filter(|e| matches!(e, Event::Drop { .. }))
        .map(Event::job_id)
        .collect();
    assert_eq!(dropped.len(), 4, "{dropped:?}");
    assert!(!dropped.contains(&shadowed));
    assert_eq!(g.live_jobs(), 2, "the running job and the shadowed one");
}

#[test]
fn drain_refuses_new_work_and_reports_when_the_pool_is_idle() {
    let mut g = Gate::new(cfg(1, 800.0)).unwrap();
    // A probe runs, another waits.
    let running = g.offer(0, req(&g, "probe")).job_id;
    drain(&mut g, 0);
    let queued = g.offer(0, req(&g, "probe")).job_id;
    drain(&mut g, 0);
    let probe = g.class_by_name("probe").unwrap();
    assert!(g.drain(10, &[probe], false).is_empty(), "no cancel asked");
    let d = g.offer(10, req(&g, "probe"));
    assert_eq!(d.reason, Reason::ClassDisabled);
    assert!(
        g.offer(10, req(&g, "prod")).admitted(),
        "prod still admitted"
    );
    drain(&mut g, 10);
    let st = g.drain_status();
    assert_eq!(
        (st.classes[0].queued, st.classes[0].in_flight),
        (1, 1),
        "{st:?}"
    );
    assert!(!st.drained && !st.idle);
    // Cancel: the queued probe is dropped at once (`drained`), the running one is handed
    // back to the caller to cancel upstream.
    let cancel = g.drain(20, &[probe], true);
    assert_eq!(cancel, vec![running]);
    let ev = drain(&mut g, 20);
    assert!(
        ev.iter().any(|e| matches!(e, Event::Drop { job_id, reason: Reason::Drained, .. } if *job_id == queued)),
        "{ev:?}"
    );
    g.cancel(30, running).unwrap();
    let st = g.drain_status();
    assert!(st.drained, "{st:?}");
    // Prod took the slot after the probe: the pool is not idle until it ends.
    assert!(!st.idle, "{st:?}");
    let prod: Vec<JobId> = drain(&mut g, 30).iter().map(Event::job_id).collect();
    for id in prod.iter().chain([JobId(4)].iter()) {
        let _ = g.on_complete(900, *id, Completion::default());
    }
    assert!(g.drain_status().idle, "{:?}", g.drain_status());
    g.end_drain(&[probe]);
    assert!(g.offer(1_000, req(&g, "probe")).admitted());
}

#[test]
fn a_drain_can_suspend_unlabeled_work() {
    let mut c = cfg(1, 800.0);
    c.default_class = Some("probe".into());
    let mut g = Gate::new(c).unwrap();
    assert!(g.classify(None).is_some());
    g.suspend_unlabeled(true);
    assert_eq!(g.classify(None), None);
    assert_eq!(g.classify(Some("nightly")), None);
    assert_eq!(
        g.classify(Some("prod")),
        Some(LaneId(0)),
        "labels still work"
    );
    g.suspend_unlabeled(false);
    assert!(g.classify(None).is_some());
}

#[test]
fn shutdown_keeps_work_that_fits_and_tells_the_rest_at_once() {
    // One slot, 800 ms jobs. At t=0 one runs and three queue (best effort: probes).
    let mut g = Gate::new(cfg(1, 800.0)).unwrap();
    let mut ids = Vec::new();
    for _ in 0..4 {
        ids.push(g.offer(0, req(&g, "probe")).job_id);
        drain(&mut g, 0);
    }
    // Shutdown at t=100 with a deadline at 2000: the running job frees at 800; the first
    // queued one runs 800..1600 (fits), the second would end at 2400 (dropped), so would the
    // third.
    g.begin_shutdown(100, 2_000);
    let ev = drain(&mut g, 100);
    let dropped: Vec<JobId> = ev
        .iter()
        .filter_map(|e| match e {
            Event::Drop {
                job_id,
                reason: Reason::ShuttingDown,
                ..
            } => Some(*job_id),
            _ => None,
        })
        .collect();
    assert_eq!(dropped, vec![ids[2], ids[3]]);
    // New work is refused, with a retry (another replica can take it).
    let d = g.offer(100, req(&g, "prod"));
    assert_eq!(d.reason, Reason::ShuttingDown);
    assert!(d.should_retry);
    // Its Retry-After is jittered like any other: a replica's clients must not all return at
    // the same instant.
    let afters: std::collections::BTreeSet<u64> = (0..20)
        .map(|_| g.offer(100, req(&g, "prod")).retry_after_ms.unwrap())
        .collect();
    assert!(afters.len() >= 10, "{afters:?}");
    assert!(
        afters.iter().all(|a| (1_000..=1_200).contains(a)),
        "{afters:?}"
    );
    // The one that fits still runs when the slot frees.
    g.on_complete(800, ids[0], Completion::default()).unwrap();
    let ev = drain(&mut g, 800);
    assert!(matches!(ev[..], [Event::Dispatch { job_id, .. }] if job_id == ids[1]));
    // A job that would start too late is not started: it is told, not cut off.
    let mut g = Gate::new(cfg(1, 800.0)).unwrap();
    let a = g.offer(0, req(&g, "probe")).job_id;
    drain(&mut g, 0);
    let b = g.offer(0, req(&g, "probe")).job_id;
    g.begin_shutdown(0, 1_700);
    assert!(drain(&mut g, 0).is_empty(), "b fits: 800 + 800 <= 1700");
    // The running job overruns: at 1000 it ends, and b (800 ms) would end at 1800 > 1700.
    g.on_complete(1_000, a, Completion::default()).unwrap();
    let ev = drain(&mut g, 1_000);
    assert!(
        matches!(ev[..], [Event::Drop { job_id, reason: Reason::ShuttingDown, .. }] if job_id == b),
        "{ev:?}"
    );
}

#[test]
fn reconfigure_keeps_queued_and_in_flight_work() {
    let mut g = Gate::new(cfg(1, 800.0)).unwrap();
    let running = g.offer(0, req(&g, "probe")).job_id;
    drain(&mut g, 0);
    let queued = g.offer(0, req(&g, "probe")).job_id;
    let prod = g.offer(0, req(&g, "prod")).job_id;
    drain(&mut g, 0);
    // A bad config changes nothing.
    let mut bad = cfg(1, 800.0);
    bad.classes[0].pool = "gpu".into();
    assert_eq!(
        g.reconfigure(10, bad).unwrap_err().path,
        "classes[0].pool".to_string()
    );
    assert_eq!(g.live_jobs(), 3);
    // A good one: two slots, probe removed, a new class `chat`.
    let mut good = cfg(2, 800.0);
    good.classes.truncate(1);
    good.classes.push(ClassConfig {
        name: "chat".into(),
        priority: 50,
        pool: "free".into(),
        ..ClassConfig::default()
    });
    let r = g.reconfigure(10, good).unwrap();
    assert_eq!(r.classes_removed, vec!["probe".to_string()]);
    assert_eq!(r.classes_added, vec!["chat".to_string()]);
    assert!(r.estimators_reset.is_empty(), "same prior, same upstream");
    assert_eq!(g.live_jobs(), 3, "nothing dropped by a reload");
    // The new slot goes to prod at once (higher priority than the retired probe lane).
    let ev = drain(&mut g, 10);
    assert!(
        matches!(ev[..], [Event::Dispatch { job_id, .. }] if job_id == prod),
        "{ev:?}"
    );
    // Probe labels are gone (no default class: unlabeled), but its queued job still runs.
    assert_eq!(g.classify(Some("probe")), None);
    g.on_complete(800, running, Completion::default()).unwrap();
    let ev = drain(&mut g, 800);
    assert!(
        matches!(ev[..], [Event::Dispatch { job_id, .. }] if job_id == queued),
        "{ev:?}"
    );
    let snap = g.snapshot(800);
    assert!(snap.classes.iter().any(|c| c.name == "probe" && c.retired));
    g.on_complete(1_600, queued, Completion::default()).unwrap();
    g.on_complete(1_600, prod, Completion::default()).unwrap();
    let snap = g.snapshot(1_600);
    assert!(
        !snap.classes.iter().any(|c| c.name == "probe"),
        "an empty retired lane leaves the snapshot"
    );
    // A changed prior restarts the pool's estimator.
    let mut changed = g.config().clone();
    changed.pools[0].prior.overhead_ms = 500.0;
    let r = g.reconfigure(1_700, changed).unwrap();
    assert_eq!(r.estimators_reset, vec!["free".to_string()]);
    assert_eq!(g.offer(1_700, req(&g, "prod")).est_service_ms, 500);
}

#[test]
fn a_removed_pool_keeps_its_slots_until_its_work_ends() {
    let mut c = cfg(1, 800.0);
    c.pools.push(pool("paid", 1, 100.0));
    c.classes[1].pool = "paid".into();
    let mut g = Gate::new(c).unwrap();
    let on_paid = g.offer(0, req(&g, "probe")).job_id;
    drain(&mut g, 0);
    let queued_paid = g.offer(0, req(&g, "probe")).job_id;
    let mut c = cfg(1, 800.0);
    c.classes.truncate(1);
    let r = g.reconfigure(10, c).unwrap();
    assert_eq!(r.pools_removed, vec!["paid".to_string()]);
    assert!(g
        .snapshot(10)
        .pools
        .iter()
        .any(|p| p.name == "paid" && p.retired));
    g.on_complete(100, on_paid, Completion::default()).unwrap();
    let ev = drain(&mut g, 100);
    assert!(
        matches!(ev[..], [Event::Dispatch { job_id, pool: PoolId(1), .. }] if job_id == queued_paid)
    );
    g.on_complete(200, queued_paid, Completion::default())
        .unwrap();
    assert!(!g.snapshot(200).pools.iter().any(|p| p.name == "paid"));
}

fn overflow_cfg(mode: OverflowMode) -> GateConfig {
    // `free`: 1 slot, 800 ms jobs. `paid`: 2 slots, 300 ms jobs. prod (4000 ms deadline)
    // may overflow to `paid`; no retry_hint of its own.
    let mut c = cfg(1, 800.0);
    c.pools.push(pool("paid", 2, 300.0));
    c.classes[0].retry_hint = None;
    c.classes[0].overflow_pool = Some("paid".into());
    c.classes[0].overflow = mode;
    c
}

#[test]
fn overflow_route_admits_on_the_overflow_pool_when_it_fits() {
    let mut g = Gate::new(overflow_cfg(OverflowMode::Route)).unwrap();
    // Five prod fill free's slack (waits 0..3200); the sixth would wait 4000 > 3200.
    for _ in 0..5 {
        assert_eq!(g.offer(0, req(&g, "prod")).reason, Reason::WithinSlack);
        drain(&mut g, 0);
    }
    let d = g.offer(0, req(&g, "prod"));
    assert_eq!(
        (d.action, d.reason),
        (Action::Admit, Reason::OverflowRouted)
    );
    assert_eq!(d.pool, Some(PoolId(1)));
    assert_eq!((d.projected_wait_ms, d.est_service_ms), (0, 300));
    assert_eq!(g.class_name(d.class.unwrap()), "prod");
    let ev = drain(&mut g, 0);
    assert!(
        matches!(ev[..], [Event::Dispatch { job_id, pool: PoolId(1), .. }] if job_id == d.job_id),
        "{ev:?}"
    );
    // Its completion frees the paid slot, not free's.
    g.on_complete(300, d.job_id, Completion::default()).unwrap();
    let snap = g.snapshot(300);
    assert_eq!(snap.pools[1].in_flight, 0);
    assert_eq!(snap.pools[0].in_flight, 1);
    let lane = snap.classes.iter().find(|c| c.overflow).unwrap();
    assert_eq!((lane.name.as_str(), lane.pool.as_str()), ("prod", "paid"));
    // Shadow mode reports the route instead of taking it.
    g.set_shadow(true);
    let d = g.offer(300, req(&g, "prod"));
    assert_eq!(
        (d.action, d.reason, d.pool),
        (
            Action::ShadowReject,
            Reason::OverflowRouted,
            Some(PoolId(0))
        )
    );
}

#[test]
fn overflow_route_rejects_when_the_overflow_pool_cannot_make_it_either() {
    let mut c = overflow_cfg(OverflowMode::Route);
    c.pools[1].slots = 1;
    c.pools[1].prior.overhead_ms = 3_000.0;
    let mut g = Gate::new(c).unwrap();
    for _ in 0..5 {
        g.offer(0, req(&g, "prod"));
        drain(&mut g, 0);
    }
    // On paid: slack 4000 - 3000 = 1000, wait 0: routed once; the next waits 3000 > 1000.
    assert_eq!(g.offer(0, req(&g, "prod")).reason, Reason::OverflowRouted);
    drain(&mut g, 0);
    let d = g.offer(0, req(&g, "prod"));
    assert_eq!(
        (d.action, d.reason),
        (Action::Reject, Reason::ProjectedWaitExceedsSlack)
    );
    assert_eq!(
        d.pool,
        Some(PoolId(0)),
        "the figures are the class's own pool's"
    );
    assert_eq!(g.retry_hint(d.class.unwrap()), Some("paid"));
}

#[test]
fn overflow_hint_names_the_pool_in_the_retry_hint() {
    let mut g = Gate::new(overflow_cfg(OverflowMode::Hint)).unwrap();
    for _ in 0..5 {
        g.offer(0, req(&g, "prod"));
        drain(&mut g, 0);
    }
    let d = g.offer(0, req(&g, "prod"));
    assert_eq!(d.reason, Reason::ProjectedWaitExceedsSlack);
    assert_eq!(g.retry_hint(d.class.unwrap()), Some("paid"));
    // A configured retry_hint wins over the pool name.
    let mut c = overflow_cfg(OverflowMode::Hint);
    c.classes[0].retry_hint = Some("dedicated_pool".into());
    let g = Gate::new(c).unwrap();
    assert_eq!(g.retry_hint(LaneId(0)), Some("dedicated_pool"));
}

#[test]
fn rejected_clients_get_spread_retry_afters() {
    // Twenty identical rejections at the same instant: the jitter spreads them.
    let mut g = Gate::new(cfg(1, 800.0)).unwrap();
    for _ in 0..5 {
        g.offer(0, req(&g, "prod"));
        drain(&mut g, 0);
    }
    let afters: std::collections::BTreeSet<u64> = (0..20)
        .map(|_| g.offer(0, req(&g, "prod")).retry_after_ms.unwrap())
        .collect();
    assert!(afters.len() >= 10, "{afters:?}");
    assert!(
        afters.iter().all(|a| (1_000..=1_200).contains(a)),
        "{afters:?}"
    );
}

#[test]
fn a_drain_follows_its_class_to_another_pool() {
    let mut c = cfg(1, 800.0);
    c.pools.push(pool("paid", 1, 100.0));
    let mut g = Gate::new(c.clone()).unwrap();
    // A probe runs on `free` and another waits there; then the probe class is drained.
    g.offer(0, req(&g, "probe"));
    drain(&mut g, 0);
    g.offer(0, req(&g, "probe"));
    let probe = g.class_by_name("probe").unwrap();
    g.drain(10, &[probe], false);
    // A reload moves probe to `paid`: a new lane, still drained.
    c.classes[1].pool = "paid".into();
    g.reconfigure(20, c.clone()).unwrap();
    let d = g.offer(30, req(&g, "probe"));
    assert_eq!(
        (d.action, d.reason),
        (Action::Reject, Reason::ClassDisabled)
    );
    let st = g.drain_status();
    assert_eq!(st.classes.len(), 1, "one entry per class: {st:?}");
    assert_eq!(
        (
            st.classes[0].name.as_str(),
            st.classes[0].queued,
            st.classes[0].in_flight
        ),
        ("probe", 1, 1),
        "the work left on the old pool is the class's: {st:?}"
    );
    let pools: Vec<&str> = st.pools.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(pools, vec!["free", "paid"], "{st:?}");
    let snap = g.snapshot(30);
    assert!(snap
        .classes
        .iter()
        .filter(|c| c.name == "probe" && !c.retired)
        .all(|c| c.draining));
    // Moving back to `free` reuses the old lane: still drained, once.
    c.classes[1].pool = "free".into();
    g.reconfigure(40, c.clone()).unwrap();
    assert_eq!(g.offer(50, req(&g, "probe")).reason, Reason::ClassDisabled);
    c.classes[1].pool = "paid".into();
    g.reconfigure(60, c.clone()).unwrap();
    // Ending the drain by the live class ends it for every lane of the class.
    let probe = g.class_by_name("probe").unwrap();
    g.end_drain(&[probe]);
    assert!(g.drain_status().classes.is_empty());
    assert!(g.offer(70, req(&g, "probe")).admitted());
    c.classes[1].pool = "free".into();
    g.reconfigure(80, c).unwrap();
    assert!(
        g.offer(90, req(&g, "probe")).admitted(),
        "no drain comes back"
    );
}
