//! Hand-computed cases for the gate. Every expected figure is derived in a comment.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use crate::config::{ClassConfig, PoolConfig, PriorConfig};

/// One pool, fixed service times per class via the class prior: the estimator is frozen and
/// has no per-token cost, so every job costs `overhead_ms`. Classes get distinct pools when
/// they need distinct service times, so here both classes share one cost.
pub(super) fn cfg(slots: u32, service_ms: f64) -> GateConfig {
    GateConfig {
        pools: vec![PoolConfig {
            name: "free".into(),
            slots,
            max_depth_factor: None,
            max_queued: 10_000,
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
            upstream: None,
            // The projections here are exact: no time kept in hand.
            promise_guard_ms: 0,
            ..PoolConfig::default()
        }],
        classes: vec![
            ClassConfig {
                name: "prod".into(),
                aliases: vec!["sync".into()],
                priority: 100,
                deadline_ms: Some(4000),
                pool: "free".into(),
                retry_hint: Some("dedicated_pool".into()),
                ..ClassConfig::default()
            },
            ClassConfig {
                name: "probe".into(),
                aliases: vec!["eval".into()],
                priority: 10,
                deadline_ms: None,
                max_queue_age_ms: Some(500),
                pool: "free".into(),
                ..ClassConfig::default()
            },
        ],
        default_class: None,
        ..GateConfig::default()
    }
}

pub(super) fn req(g: &Gate, label: &str) -> Request {
    Request {
        class: g.classify(Some(label)),
        ..Request::default()
    }
}

pub(super) fn drain(g: &mut Gate, now: Millis) -> Vec<Event> {
    let mut out = Vec::new();
    while let Some(e) = g.poll(now) {
        out.push(e);
    }
    out
}

#[test]
fn classify_uses_aliases_and_unlabeled_policy() {
    let g = Gate::new(cfg(1, 800.0)).unwrap();
    assert_eq!(g.classify(Some("SYNC")), Some(LaneId(0)));
    assert_eq!(g.classify(Some(" eval ")), Some(LaneId(1)));
    assert_eq!(g.classify(Some("nightly")), None);
    assert_eq!(g.classify(None), None);
    let mut g = Gate::new(cfg(1, 800.0)).unwrap();
    let d = g.offer(0, Request::default());
    assert_eq!(
        (d.action, d.reason),
        (Action::Reject, Reason::RejectUnlabeled)
    );
    assert!(!d.should_retry, "unlabeled work cannot succeed by retrying");

    let mut c = cfg(1, 800.0);
    c.default_class = Some("probe".into());
    let g = Gate::new(c).unwrap();
    assert_eq!(g.classify(Some("nightly")), Some(LaneId(1)));
}

#[test]
fn projected_wait_counts_in_flight_and_queued_work_ahead() {
    // One slot, 800 ms per job, prod deadline 4000 -> slack 3200.
    // Job 1 takes the slot (wait 0). Job 2 waits for job 1: 800. Job 3: 800 + 800 = 1600.
    // Job 4: 2400. Job 5: 3200 (== slack, admitted). Job 6: 4000 > 3200: rejected.
    let mut g = Gate::new(cfg(1, 800.0)).unwrap();
    let mut waits = Vec::new();
    for _ in 0..6 {
        let d = g.offer(0, req(&g, "prod"));
        waits.push((d.projected_wait_ms, d.action));
        drain(&mut g, 0);
    }
    assert_eq!(
        waits,
        vec![
            (0, Action::Admit),
            (800, Action::Admit),
            (1600, Action::Admit),
            (2400, Action::Admit),
            (3200, Action::Admit),
            (4000, Action::Reject),
        ]
    );
    let last = g.offer(0, req(&g, "prod"));
    assert_eq!(last.reason, Reason::ProjectedWaitExceedsSlack);
    assert_eq!(last.deadline_slack_ms, Some(3200));
    // Retry-After: the wait must shrink by 4000 - 3200 = 800 ms, floored at 1000 ms, plus up
    // to 20% jitter.
    let after = last.retry_after_ms.unwrap();
    assert!((1000..=1200).contains(&after), "{after}");
    assert!(last.should_retry);
}

#[test]
fn the_promise_guard_refuses_what_would_end_inside_it() {
    // As above, with 50 ms kept in hand: job 5 would end exactly at its deadline (wait 3200
    // = slack) and is refused now; job 4, 800 ms inside it, still fits.
    // Seed 003's drill, on a busy CI machine, once finished a request admitted 20 ms inside
    // its deadline after it.
    let mut c = cfg(1, 800.0);
    c.pools[0].promise_guard_ms = 50;
    let mut g = Gate::new(c).unwrap();
    let mut seen = Vec::new();
    for _ in 0..5 {
        let d = g.offer(0, req(&g, "prod"));
        seen.push((d.projected_wait_ms, d.action));
        drain(&mut g, 0);
    }
    assert_eq!(
        seen,
        vec![
            (0, Action::Admit),
            (800, Action::Admit),
            (1600, Action::Admit),
            (2400, Action::Admit),
            (3200, Action::Reject),
        ]
    );
    // A guard longer than a whole deadline is refused by the config's check.
    let mut c = cfg(1, 800.0);
    c.pools[0].promise_guard_ms = 60_001;
    let err = Gate::new(c).unwrap_err().to_string();
    assert!(err.contains("promise_guard_ms"), "{err}");
}

#[test]
fn lower_priority_work_is_not_counted_ahead() {
    // Ten probes queued behind one in-flight probe do not delay prod: prod's wait is only the
    // in-flight remainder (800 ms).
    let mut g = Gate::new(cfg(1, 800.0)).unwrap();
    for _ in 0..11 {
        assert!(g.offer(0, req(&g, "probe")).admitted());
        drain(&mut g, 0);
    }
    let d = g.offer(0, req(&g, "prod"));
    assert_eq!(d.projected_wait_ms, 800);
    assert_eq!(d.queued_ahead, 0);
    assert!(d.admitted());
    // The next dispatch after the probe completes is prod, not the older probes.
    let first_probe = JobId(1);
    g.on_complete(800, first_probe, Completion::default())
        .unwrap();
    let ev = drain(&mut g, 800);
    assert!(
        matches!(
            ev[0],
            Event::Dispatch {
                class: LaneId(0),
                ..
            }
        ),
        "{ev:?}"
    );
}

#[test]
fn queue_age_rejects_probe_but_not_prod() {
    let mut g = Gate::new(cfg(1, 800.0)).unwrap();
    for _ in 0..3 {
        g.offer(0, req(&g, "probe"));
        drain(&mut g, 0);
    }
    // At t=600 the oldest queued probe (enqueued at 0) is 600 ms old > 500.
    let d = g.offer(600, req(&g, "probe"));
    assert_eq!(d.reason, Reason::QueueAgeExceeded);
    assert_eq!(d.queue_age_ms, 600);
    // Prod has no age limit and waits behind no queued prod: admitted (wait = 200 left).
    let d = g.offer(600, req(&g, "prod"));
    assert!(d.admitted(), "{d:?}");
    assert_eq!(d.projected_wait_ms, 200);
}

#[test]
fn depth_rule_needs_all_slots_busy() {
    let mut c = cfg(2, 1000.0);
    c.pools[0].max_depth_factor = Some(1.0);
    c.classes[0].deadline_ms = None;
    let mut g = Gate::new(c).unwrap();
    // 2 run, then 2 may queue (depth 2 <= 1 x 2); the 5th sees depth 2... the 6th sees 3 > 2.
    let mut actions = Vec::new();
    for _ in 0..6 {
        let d = g.offer(0, req(&g, "prod"));
        actions.push((d.queued_ahead, d.reason));
        drain(&mut g, 0);
    }
    assert_eq!(actions[4], (2, Reason::WithinSlack));
    assert_eq!(actions[5], (3, Reason::QueueDepthExceeded));
}

#[test]
fn disabled_class_and_admit_always() {
    let mut g = Gate::new(cfg(1, 800.0)).unwrap();
    g.set_class_enabled(LaneId(1), false);
    let d = g.offer(0, req(&g, "probe"));
    assert_eq!(d.reason, Reason::ClassDisabled);
    assert!(!d.should_retry);
    g.set_admit_always(true);
    // Even a request that cannot possibly make its deadline is admitted and later dispatched.
    for _ in 0..10 {
        assert_eq!(g.offer(0, req(&g, "prod")).reason, Reason::AdmitAlways);
    }
    g.tick(100_000);
    let ev = drain(&mut g, 100_000);
    assert!(
        matches!(ev[..], [Event::Dispatch { .. }]),
        "no drops under admit_always: {ev:?}"
    );
}

#[test]
fn dispatch_drops_jobs_that_cannot_finish() {
    // Slot stuck with a job; a queued prod (deadline 4000, service 800) is dispatched at 3500:
    // 3500 + 800 > 4000, so it is dropped instead of sent.
    let mut g = Gate::new(cfg(1, 800.0)).unwrap();
    g.offer(0, req(&g, "probe"));
    drain(&mut g, 0);
    let d = g.offer(0, req(&g, "prod"));
    assert!(d.admitted());
    g.on_complete(3500, JobId(1), Completion::default())
        .unwrap();
    let ev = drain(&mut g, 3500);
    assert!(
        matches!(
            ev[..],
            [Event::Drop {
                reason: Reason::DeadlineUnmeetable,
                ..
            }]
        ),
        "{ev:?}"
    );
    assert_eq!(g.live_jobs(), 0);
}

#[test]
fn tick_drops_queued_jobs_whose_slack_died() {
    // A stuck in-flight job (estimated 800) overruns. At t=2000 its remaining is taken as its
    // overrun, 1200 ms. A queued prod (deadline 4000, own 800) would start at 3200 and end at
    // 4000: slack 0, kept. At t=2200: remaining 1400, start 3600, end 4400 > 4000: dropped now,
    // long before its timeout.
    let mut g = Gate::new(cfg(1, 800.0)).unwrap();
    g.offer(0, req(&g, "probe"));
    drain(&mut g, 0);
    assert!(g.offer(0, req(&g, "prod")).admitted());
    g.tick(2000);
    assert!(drain(&mut g, 2000).is_empty());
    g.tick(2200);
    let ev = drain(&mut g, 2200);
    assert!(
        matches!(
            ev[..],
            [Event::Drop {
                job_id: JobId(2),
                ..
            }]
        ),
        "{ev:?}"
    );
}

#[test]
fn completion_and_cancel_end_a_job_exactly_once() {
    let mut g = Gate::new(cfg(1, 800.0)).unwrap();
    g.offer(0, req(&g, "prod"));
    g.offer(0, req(&g, "prod"));
    drain(&mut g, 0);
    let done = g.on_complete(
        500,
        JobId(1),
        Completion {
            ok: true,
            ..Completion::default()
        },
    );
    assert_eq!(done.map(|c| c.service_ms), Some(500));
    // Job 2 is dispatched at 500 when the slot frees.
    let ev = drain(&mut g, 500);
    assert!(g
        .on_complete(600, JobId(1), Completion::default())
        .is_none());
    assert!(g.cancel(600, JobId(1)).is_none());
    assert!(matches!(
        ev[..],
        [Event::Dispatch {
            job_id: JobId(2),
            queue_wait_ms: 500,
            ..
        }]
    ));
    let c = g.cancel(700, JobId(2)).unwrap();
    assert!(c.dispatched);
    assert!(g.cancel(700, JobId(2)).is_none());
    assert_eq!(g.snapshot(700).pools[0].in_flight, 0);
}

#[test]
fn first_token_deadline_is_checked() {
    // Tokens model: 100 ms overhead + 1 ms per prompt token; 10 ms per output token.
    let mut c = cfg(1, 100.0);
    c.pools[0].prior.prefill_ms_per_token = 1.0;
    c.pools[0].prior.decode_ms_per_token = 10.0;
    c.classes[0].deadline_ms = None;
    let mut g = Gate::new(c).unwrap();
    let mut r = req(&g, "prod");
    r.prompt_tokens = 900; // first token after 100 + 900 + one 10 ms decode step = 1010 ms
    r.max_tokens = Some(10);
    r.first_token_deadline = Some(1009);
    let d = g.offer(0, r.clone());
    assert_eq!(d.reason, Reason::ProjectedWaitExceedsSlack);
    assert_eq!(d.deadline_slack_ms, Some(-1));
    assert!(!d.should_retry, "even an empty pool cannot meet it");
    r.first_token_deadline = Some(1010);
    assert!(g.offer(0, r).admitted());
}

#[test]
fn estimator_learns_class_output_length() {
    let mut c = cfg(1, 100.0);
    c.pools[0].prior.decode_ms_per_token = 10.0;
    c.pools[0].prior.learn = true;
    c.classes[0].deadline_ms = None;
    let mut g = Gate::new(c).unwrap();
    for i in 0..50u64 {
        let mut r = req(&g, "prod");
        r.max_tokens = Some(1000);
        let d = g.offer(i * 1000, r);
        drain(&mut g, i * 1000);
        // The upstream always writes 20 tokens, in 100 + 20 x 10 = 300 ms.
        g.on_complete(
            i * 1000 + 300,
            d.job_id,
            Completion {
                ok: true,
                prompt_tokens: Some(0),
                completion_tokens: Some(20),
            },
        );
    }
    let s = g.snapshot(60_000);
    assert_eq!(s.classes[0].expected_output_tokens, 20);
    let mut r = req(&g, "prod");
    r.max_tokens = Some(1000);
    let d = g.offer(60_000, r);
    assert!((280..=320).contains(&d.est_service_ms), "{d:?}");
}

#[test]
fn time_never_runs_backwards() {
    let mut g = Gate::new(cfg(1, 800.0)).unwrap();
    g.offer(1000, req(&g, "prod"));
    drain(&mut g, 1000);
    let c = g.on_complete(10, JobId(1), Completion::default()).unwrap();
    assert_eq!(c.service_ms, 0);
}

#[test]
fn huge_deadline_sorts_before_best_effort() {
    let mut c = cfg(1, 1.0);
    c.classes[1].max_queue_age_ms = None;
    let mut g = Gate::new(c).unwrap();
    g.offer(0, req(&g, "probe"));
    let ev = drain(&mut g, 0);
    assert!(
        matches!(
            ev[..],
            [Event::Dispatch {
                job_id: JobId(1),
                ..
            }]
        ),
        "{ev:?}"
    );
    g.offer(0, req(&g, "probe"));
    let mut r = req(&g, "probe");
    r.deadline = Some(Millis::MAX);
    let d = g.offer(0, r);
    assert!(d.admitted(), "{d:?}");
    assert!(drain(&mut g, 0).is_empty());
    g.on_complete(5, JobId(1), Completion::default()).unwrap();
    let ev = drain(&mut g, 5);
    assert!(
        matches!(
            ev[..],
            [Event::Dispatch {
                job_id: JobId(3),
                ..
            }]
        ),
        "{ev:?}"
    );
}

#[test]
fn water_fill_spreads_queued_work_over_slots_as_they_free() {
    // Slots free at 100, 200, 1000. 300 ms of work ahead: slots 1 and 2 absorb it by
    // t = (300 + 100 + 200) / 2 = 300 (< 1000), so the job starts at 300.
    assert_eq!(water_fill(&[100, 200, 1000], 300), 300);
    // Nothing ahead: the first slot to free.
    assert_eq!(water_fill(&[100, 200, 1000], 0), 100);
    // Free slots (0) take work at once.
    assert_eq!(water_fill(&[0, 0, 0, 0], 400), 100);
    // All three slots needed: (2000 + 1300) / 3 = 1100.
    assert_eq!(water_fill(&[100, 200, 1000], 2000), 1100);
    assert_eq!(water_fill(&[u64::MAX, u64::MAX], u64::MAX), u64::MAX);
}

#[test]
fn the_unordered_water_fill_equals_the_sorted_one() {
    use super::projection::water_fill_unordered;
    // A fixed pseudo-random walk over slot counts, spreads and amounts of work, so both the
    // mean shortcut and the sorted fill are taken (and the edge where the mean equals the
    // highest slot).
    let mut rng = crate::test_rng::XorShift(0x9e37_79b9_7f4a_7c15);
    let mut next = |m: u64| rng.below(m);
    let (mut shortcut, mut sorted) = (0, 0);
    for case in 0..20_000 {
        let n = 1 + next(40) as usize;
        let spread = [1, 10, 1_000, 100_000][case % 4];
        let r: Vec<u64> = (0..n).map(|_| next(spread)).collect();
        let work = match case % 5 {
            0 => 0,
            1 => next(spread),
            2 => next(spread * n as u64 + 1),
            3 => r.iter().map(|&v| r.iter().max().unwrap_or(&0) - v).sum(),
            _ => next(u64::MAX / 2),
        };
        let mut want = r.clone();
        want.sort_unstable();
        let want = water_fill(&want, work);
        let mut got = r.clone();
        assert_eq!(water_fill_unordered(&mut got, work), want, "{r:?} {work}");
        // The shortcut's condition: the mean level strictly above the highest slot.
        let total: u128 = r.iter().map(|&v| u128::from(v)).sum::<u128>() + u128::from(work);
        let top = u128::from(*r.iter().max().unwrap_or(&0));
        match total.div_ceil(n as u128) > top {
            true => shortcut += 1,
            false => sorted += 1,
        }
    }
    assert!(shortcut > 1_000 && sorted > 1_000, "{shortcut} {sorted}");
    assert_eq!(water_fill_unordered(&mut [], 5), 0);
    assert_eq!(water_fill_unordered(&mut [u64::MAX, 3], u64::MAX), u64::MAX);
}

#[test]
fn one_long_job_does_not_poison_a_wide_pool() {
    // 8 slots: 7 jobs with 500 ms to go and one 80 s batch job. A new request waits for the
    // first of the short ones (500 ms), not the average (10.4 s).
    let mut c = cfg(8, 500.0);
    c.classes[1].max_queue_age_ms = None;
    c.pools[0].prior.decode_ms_per_token = 1.0;
    let mut g = Gate::new(c).unwrap();
    let mut long = req(&g, "probe");
    long.max_tokens = Some(79_500); // 500 + 79 500 x 1 ms = 80 s
    long.expected_output_tokens = Some(79_500); // a trusted size: nothing is learned yet
    g.offer(0, long);
    for _ in 0..7 {
        let mut r = req(&g, "probe");
        r.max_tokens = Some(0);
        g.offer(0, r);
    }
    drain(&mut g, 0);
    let mut r = req(&g, "prod");
    r.max_tokens = Some(0);
    let d = g.offer(0, r);
    assert_eq!(d.projected_wait_ms, 500, "{d:?}");
    assert!(d.admitted());
}

#[test]
fn a_stuck_slot_ages_the_queue_seed_002() {
    // One slot held by an eval the gate expects to take 800 ms. At t = 2000 the queue is
    // empty but the only slot has not freed for 2 s: sync (max age 1500) is rejected on age.
    let mut c = cfg(1, 800.0);
    c.classes[0].max_queue_age_ms = Some(1500);
    let mut g = Gate::new(c).unwrap();
    g.offer(0, req(&g, "eval"));
    drain(&mut g, 0);
    let d = g.offer(1000, req(&g, "sync"));
    assert!(d.admitted(), "1 s in, the slot is not stuck yet: {d:?}");
    g.cancel(1000, d.job_id);
    let d = g.offer(2000, req(&g, "sync"));
    assert_eq!(
        (d.reason, d.queue_age_ms),
        (Reason::QueueAgeExceeded, 2000),
        "{d:?}"
    );
    assert_eq!(g.retry_hint(LaneId(0)), Some("dedicated_pool"));
}

#[test]
fn warm_up_admits_on_an_idle_pool_until_the_estimator_has_learned() {
    // The prior guesses 256 output tokens at 20 ms each (5.1 s); the deadline is 3 s. On an
    // idle, still-learning pool the request is admitted (and never dropped on that guess).
    let mut c = cfg(1, 100.0);
    c.pools[0].prior.decode_ms_per_token = 20.0;
    c.pools[0].prior.default_output_tokens = 256;
    c.pools[0].prior.learn = true;
    c.classes[0].deadline_ms = Some(3000);
    let mut g = Gate::new(c).unwrap();
    let d = g.offer(0, req(&g, "prod"));
    assert_eq!(d.reason, Reason::EstimatorWarmup, "{d:?}");
    let ev = drain(&mut g, 0);
    assert!(
        matches!(ev[..], [Event::Dispatch { .. }]),
        "warm-up jobs are not dropped: {ev:?}"
    );
    // While busy, the usual rule applies.
    let d = g.offer(0, req(&g, "prod"));
    assert_eq!(d.reason, Reason::ProjectedWaitExceedsSlack);
    g.cancel(0, d.job_id);
    // After a few real completions (20 tokens in 500 ms) the estimate is the upstream's and
    // the ordinary rule decides: a 20-token request now fits the 3 s deadline on its merits.
    g.on_complete(
        500,
        JobId(1),
        Completion {
            ok: true,
            prompt_tokens: Some(1),
            completion_tokens: Some(20),
        },
    );
    let mut t = 1000;
    for _ in 0..5 {
        let d = g.offer(t, req(&g, "prod"));
        assert!(d.admitted(), "{d:?}");
        drain(&mut g, t);
        let done = Completion {
            ok: true,
            prompt_tokens: Some(1),
            completion_tokens: Some(20),
        };
        g.on_complete(t + 500, d.job_id, done).unwrap();
        t += 1000;
    }
    let d = g.offer(t, req(&g, "prod"));
    assert_eq!(d.reason, Reason::WithinSlack, "{d:?}");
    assert!((300..=700).contains(&d.est_service_ms), "{d:?}");
}

#[test]
fn embeddings_cost_no_decode_and_teach_prefill() {
    let mut c = cfg(1, 100.0);
    c.pools[0].prior.decode_ms_per_token = 20.0;
    c.pools[0].prior.learn = true;
    c.classes[0].deadline_ms = Some(1000);
    let mut g = Gate::new(c).unwrap();
    let mut r = req(&g, "prod");
    r.max_tokens = Some(0);
    r.prompt_tokens = 100;
    let d = g.offer(0, r);
    assert_eq!(
        (d.reason, d.est_service_ms),
        (Reason::WithinSlack, 100),
        "{d:?}"
    );
    drain(&mut g, 0);
    // No completion tokens reported: still a sample, as output 0.
    g.on_complete(
        40,
        d.job_id,
        Completion {
            ok: true,
            prompt_tokens: Some(100),
            completion_tokens: None,
        },
    );
    assert_eq!(g.snapshot(40).pools[0].estimator.samples, 1);
}

#[test]
fn absolute_deadlines_are_told_not_to_retry() {
    let mut g = Gate::new(cfg(1, 800.0)).unwrap();
    g.offer(0, req(&g, "prod"));
    drain(&mut g, 0);
    let mut r = req(&g, "prod");
    r.deadline = Some(1000);
    let relative = g.offer(0, r.clone());
    assert_eq!(relative.reason, Reason::ProjectedWaitExceedsSlack);
    assert!(relative.should_retry);
    r.deadline_is_absolute = true;
    let absolute = g.offer(0, r);
    assert!(!absolute.should_retry, "{absolute:?}");
}

#[test]
fn the_pool_queue_is_capped_for_best_effort_work_too() {
    let mut c = cfg(1, 800.0);
    c.pools[0].max_queued = 3;
    c.classes[1].max_queue_age_ms = None;
    let mut g = Gate::new(c).unwrap();
    let reasons: Vec<Reason> = (0..6)
        .map(|_| {
            let d = g.offer(0, req(&g, "probe"));
            drain(&mut g, 0);
            d.reason
        })
        .collect();
    // One runs, three queue, the rest are refused.
    assert_eq!(&reasons[..4], &[Reason::WithinSlack; 4]);
    assert_eq!(&reasons[4..], &[Reason::QueueDepthExceeded; 2]);
}

#[test]
fn retry_after_is_jittered_deterministically() {
    // Five clients rejected at the same instant for the same reason get spread-out times,
    // each within [base, base x 1.2], and the same job id always gets the same figure.
    let mut g = Gate::new(cfg(1, 800.0)).unwrap();
    for _ in 0..6 {
        g.offer(0, req(&g, "prod"));
        drain(&mut g, 0);
    }
    let afters: Vec<u64> = (0..5)
        .map(|_| g.offer(0, req(&g, "prod")).retry_after_ms.unwrap())
        .collect();
    let distinct: std::collections::BTreeSet<_> = afters.iter().collect();
    assert!(distinct.len() >= 4, "{afters:?}");
    assert!(
        afters.iter().all(|a| (1000..=1200).contains(a)),
        "{afters:?}"
    );
    assert_eq!(jitter(1000, JobId(42), 20), jitter(1000, JobId(42), 20));
    assert_eq!(jitter(1000, JobId(42), 0), 1000);
    assert!(jitter(u64::MAX, JobId(1), 100) == u64::MAX);
}

#[test]
fn incremental_water_fill_matches_the_direct_one() {
    let mut rng = crate::test_rng::XorShift(0x1234_5678);
    let mut next = move || rng.next();
    for _ in 0..500 {
        let n = (next() % 9) as usize;
        let mut r: Vec<u64> = (0..n).map(|_| next() % 10_000).collect();
        r.sort_unstable();
        let mut filler = WaterFiller::new(&r);
        let mut work = 0u64;
        for _ in 0..20 {
            work += next() % 5_000;
            assert_eq!(
                filler.level(work),
                water_fill(&r, work),
                "r={r:?} work={work}"
            );
        }
    }
}

#[test]
fn a_size_hint_steers_the_estimate_but_never_lowers_the_hold() {
    let mut c = cfg(1, 100.0);
    c.pools[0].prior.decode_ms_per_token = 10.0;
    c.classes[0].deadline_ms = None;
    let mut g = Gate::new(c).unwrap();
    // Nothing learned yet: the class's own estimate is the cap, 1000 tokens: 100 + 10 000 ms.
    let mut r = req(&g, "prod");
    r.max_tokens = Some(1000);
    r.prompt_tokens = 50;
    let plain = g.offer(0, r.clone());
    assert_eq!(plain.est_service_ms, 10_100);
    assert_eq!(plain.tokens_held, 1_050);
    // A hint of 20 tokens: 100 + 200 ms, but the hold stays at the class's own 1000.
    r.expected_output_tokens = Some(20);
    let hinted = g.offer(1, r.clone());
    assert_eq!(hinted.est_service_ms, 300);
    assert_eq!(hinted.tokens_held, 1_050);
    // A hint of 0 cannot shrink the hold to the prompt alone either.
    r.expected_output_tokens = Some(0);
    assert_eq!(g.offer(2, r.clone()).tokens_held, 1_050);
    // A hint above the cap is capped; above the class's estimate it raises nothing past it.
    r.expected_output_tokens = Some(5_000);
    let big = g.offer(3, r);
    assert_eq!(big.est_service_ms, 10_100);
    assert_eq!(big.tokens_held, 1_050);
}

/// Without a size from the caller, a request must fit its deadline with the 0.9 quantile of
/// its class's outputs, not the mean: a long one would otherwise be admitted and dropped
/// later. Its queued work still counts at the mean.
#[test]
fn requests_without_a_size_must_fit_an_upper_quantile_of_their_class() {
    let mut c = cfg(1, 0.0);
    c.pools[0].prior.decode_ms_per_token = 10.0;
    c.pools[0].prior.learn = false;
    c.classes[0].deadline_ms = None;
    let mut g = Gate::new(c).unwrap();
    // Outputs 100, 200, ..., 1000 tokens, over and over: mean 550, 0.9 quantile about 900-1000.
    let mut t = 0u64;
    for i in 0..400u64 {
        let out = 100 * (1 + (i * 7) % 10) as u32;
        let mut r = req(&g, "prod");
        r.max_tokens = Some(2000);
        let d = g.offer(t, r);
        drain(&mut g, t);
        t += u64::from(out) * 10;
        g.on_complete(
            t,
            d.job_id,
            Completion {
                ok: true,
                prompt_tokens: Some(0),
                completion_tokens: Some(out),
            },
        );
    }
    let mean = g.classes[0].expected_output.unwrap();
    let q = g.classes[0].output_q.unwrap();
    assert!((300.0..=800.0).contains(&mean), "mean {mean}");
    assert!((850.0..=1050.0).contains(&q), "0.9 quantile tracked as {q}");
    // A 7 s budget on an idle slot: the mean (about 5.5 s) fits, the quantile (about 9 s)
    // does not.
    let mut r = req(&g, "prod");
    r.max_tokens = Some(2000);
    r.deadline = Some(t + 7_000);
    let d = g.offer(t, r.clone());
    assert_eq!(d.action, Action::Reject, "{d:?}");
    assert_eq!(d.reason, Reason::ProjectedWaitExceedsSlack);
    // The estimate it reports for its own service is still the mean.
    assert!(d.est_service_ms < 7_000, "{d:?}");
    // A caller that says its size is judged on it.
    r.expected_output_tokens = Some(300);
    let hinted = g.offer(t, r.clone());
    assert_eq!(hinted.action, Action::Admit);
    g.cancel(t, hinted.job_id);
    drain(&mut g, t);
    // A tight max_tokens caps the quantile too.
    r.expected_output_tokens = None;
    r.max_tokens = Some(500);
    assert_eq!(g.offer(t, r).action, Action::Admit);
}

/// A proxied hold of 100 tokens placed at 500 by another process (`owner`), as a shared
/// store would hold it (90 spent when done).
fn shared_hold(
    key: &str,
    state: crate::ledger::HoldState,
    owner: Option<&str>,
) -> crate::ledger::HoldRecord {
    crate::ledger::HoldRecord {
        key: key.into(),
        tenant: Some("t".into()),
        state,
        attempt: 0,
        tokens_held: 100,
        tokens_spent: if state == crate::ledger::HoldState::Done {
            90
        } else {
            0
        },
        tokens_wasted: 0,
        created_at_ms: 500,
        // A proxied request's hold is not timed (its connection settles it).
        expires_at_ms: if state == crate::ledger::HoldState::Held {
            crate::ledger::NEVER
        } else {
            900_000
        },
        updated_at_ms: 500,
        version: 500,
        prior_spent: 0,
        prior_wasted: 0,
        reservation: false,
        owner: owner.map(Into::into),
        dispatched: None,
    }
}

#[test]
fn a_gate_adopting_a_shared_ledger_keeps_its_own_live_holds_and_expires_a_dead_processes() {
    use crate::ledger::{HoldRecord, HoldState};
    let mut g = Gate::new(cfg(2, 800.0)).unwrap();
    let mut r = req(&g, "prod");
    r.idempotency_key = Some("mine".into());
    assert!(g.offer(1_000, r).admitted());
    drain(&mut g, 1_000);
    let other = |key: &str, state: HoldState, reservation: bool| HoldRecord {
        reservation,
        ..shared_hold(key, state, None)
    };
    // What the shared store holds: the dead leader's proxied hold, a worker's reservation, a
    // settled key; it does not have this gate's own hold yet.
    let shared = vec![
        other("dead", HoldState::Held, false),
        other("worker", HoldState::Held, true),
        other("settled", HoldState::Done, false),
    ];
    g.adopt_ledger(shared, 2_000, &std::collections::HashSet::new(), false, 0);
    let l = g.ledger();
    assert_eq!(l.get("mine").map(|h| h.state), Some(HoldState::Held));
    assert_eq!(l.get("dead").map(|h| h.state), Some(HoldState::Expired));
    assert_eq!(l.get("worker").map(|h| h.state), Some(HoldState::Held));
    assert_eq!(l.get("settled").map(|h| h.state), Some(HoldState::Done));
    // The expiry is queued for the store; this gate's own job still settles its hold.
    let out = g.take_ledger_records();
    assert!(out
        .iter()
        .any(|h| &*h.key == "dead" && h.state == HoldState::Expired));
    let mut dup = req(&g, "prod");
    dup.idempotency_key = Some("settled".into());
    assert_eq!(g.offer(2_001, dup).reason, Reason::RejectDuplicate);
}

#[test]
fn a_gate_adopting_an_emptied_shared_ledger_keeps_what_it_knew_and_writes_it_back() {
    use crate::ledger::HoldState;
    let mut g = Gate::new(cfg(2, 800.0)).unwrap();
    let mut r = req(&g, "prod");
    r.idempotency_key = Some("k".into());
    let d = g.offer(1_000, r);
    drain(&mut g, 1_000);
    g.on_complete(
        1_500,
        d.job_id,
        Completion {
            ok: true,
            ..Completion::default()
        },
    );
    drain(&mut g, 1_500);
    g.take_ledger_records();
    // The store restarted empty: the settled key survives in this gate and goes back to it.
    g.adopt_ledger(
        Vec::new(),
        2_000,
        &std::collections::HashSet::new(),
        true,
        0,
    );
    assert_eq!(g.ledger().get("k").map(|h| h.state), Some(HoldState::Done));
    let out = g.take_ledger_records();
    assert!(out
        .iter()
        .any(|h| &*h.key == "k" && h.state == HoldState::Done));
    let mut dup = req(&g, "prod");
    dup.idempotency_key = Some("k".into());
    assert_eq!(g.offer(2_001, dup).reason, Reason::RejectDuplicate);
}

#[test]
fn adopting_without_data_loss_brings_back_no_pruned_key_and_keeps_live_replicas_holds() {
    use crate::ledger::HoldState;
    let mut g = Gate::new(cfg(2, 800.0)).unwrap();
    g.set_hold_owner("b");
    let rec = |key: &str, state: HoldState, owner: &str| shared_hold(key, state, Some(owner));
    // This gate learned "old" at start (settled by replica a); the store has since pruned it
    // (its 90 tokens folded into a carry record).
    g.restore_ledger(vec![rec("old", HoldState::Done, "a")], 1_000);
    g.take_ledger_records();
    let store = vec![
        rec("c-live", HoldState::Held, "c"),
        rec("a-dead", HoldState::Held, "a"),
    ];
    let alive: std::collections::HashSet<String> = ["c".to_string()].into();
    g.adopt_ledger(store, 2_000, &alive, false, 0);
    let l = g.ledger();
    assert!(l.get("old").is_none(), "a pruned key must not come back");
    assert_eq!(l.get("c-live").map(|h| h.state), Some(HoldState::Held));
    assert_eq!(l.get("a-dead").map(|h| h.state), Some(HoldState::Expired));
    let out = g.take_ledger_records();
    assert!(out.iter().all(|h| &*h.key != "old"));
    // Replica c stops checking in: its proxied hold is an orphan now.
    assert_eq!(
        g.expire_orphans(3_000, &std::collections::HashSet::new()),
        1
    );
    assert_eq!(
        g.ledger().get("c-live").map(|h| h.state),
        Some(HoldState::Expired)
    );
    // This gate's own holds carry its name.
    let mut r = req(&g, "prod");
    r.idempotency_key = Some("new".into());
    assert!(g.offer(3_001, r).admitted());
    assert_eq!(
        g.ledger()
            .get("new")
            .and_then(|h| h.owner.clone())
            .as_deref(),
        Some("b")
    );
}

/// Dispatch events `drain` saw: how many jobs started.
fn started(g: &mut Gate, now: Millis) -> usize {
    let mut n = 0;
    while let Some(ev) = g.poll(now) {
        n += usize::from(matches!(ev, Event::Dispatch { .. }));
    }
    n
}

#[test]
fn a_gate_taking_a_cluster_over_counts_the_old_leaders_running_requests_in_their_slots() {
    use crate::ledger::HoldState;
    // Leader a runs two requests on a 2-slot pool (estimate 800 ms each, sent at 1 000).
    let mut a = Gate::new(cfg(2, 800.0)).unwrap();
    a.set_hold_owner("a");
    for key in ["a1", "a2"] {
        let mut r = req(&a, "probe");
        r.idempotency_key = Some(key.into());
        assert!(a.offer(1_000, r).admitted());
    }
    assert_eq!(started(&mut a, 1_000), 2);
    // Their holds say where and when they went, for whoever leads next.
    let store = a.take_ledger_records();
    let mark = store
        .iter()
        .filter(|r| &*r.key == "a1")
        .filter_map(|r| r.dispatched.clone())
        .next_back()
        .expect("a dispatched hold records its dispatch");
    assert_eq!(
        (mark.pool.as_str(), mark.at_ms, mark.est_ms),
        ("free", 1_000, 800)
    );

    // a stops checking in; b takes over at 1 500 with a grace of 500 ms: a's requests hold
    // their slots until 1 000 + 800 + 500 = 2 300.
    let mut b = Gate::new(cfg(2, 800.0)).unwrap();
    b.set_hold_owner("b");
    b.adopt_ledger(store, 1_500, &std::collections::HashSet::new(), false, 500);
    let mut r = req(&b, "probe");
    r.idempotency_key = Some("b1".into());
    assert!(b.offer(1_500, r).admitted());
    assert_eq!(started(&mut b, 1_500), 0, "both slots are a's until 2 300");
    assert_eq!(started(&mut b, 2_299), 0);
    // a's holds are not expired meanwhile: a retry of their key is a duplicate, not a rerun.
    assert_eq!(b.ledger().get("a1").map(|h| h.state), Some(HoldState::Held));
    let mut dup = req(&b, "probe");
    dup.idempotency_key = Some("a1".into());
    assert_eq!(b.offer(2_000, dup).reason, Reason::RejectDuplicate);
    assert_eq!(
        started(&mut b, 2_300),
        1,
        "the slots free once the estimate has run out"
    );
    // Its key stays held for the hold's TTL (placed at 1 000, 900 s): whether it ran to its
    // end is unknown.
    b.tick(2_301);
    assert_eq!(b.ledger().get("a1").map(|h| h.state), Some(HoldState::Held));
    b.tick(901_000);
    assert_eq!(
        b.ledger().get("a1").map(|h| h.state),
        Some(HoldState::Expired)
    );
}

#[test]
fn a_dead_leaders_queued_holds_expire_at_once_and_a_gate_alone_marks_no_dispatch() {
    use crate::ledger::HoldState;
    let mut a = Gate::new(cfg(1, 800.0)).unwrap();
    a.set_hold_owner("a");
    for key in ["run", "queued"] {
        let mut r = req(&a, "probe");
        r.idempotency_key = Some(key.into());
        assert!(a.offer(1_000, r).admitted());
    }
    assert_eq!(started(&mut a, 1_000), 1);
    let store = a.take_ledger_records();
    let mut b = Gate::new(cfg(1, 800.0)).unwrap();
    b.set_hold_owner("b");
    b.adopt_ledger(store, 1_500, &std::collections::HashSet::new(), false, 0);
    // Never sent: nothing runs for it, so its key is free at once.
    assert_eq!(
        b.ledger().get("queued").map(|h| h.state),
        Some(HoldState::Expired)
    );
    assert_eq!(
        b.ledger().get("run").map(|h| h.state),
        Some(HoldState::Held)
    );
    // A gate alone (no owner) writes no dispatch marks.
    let mut g = Gate::new(cfg(1, 800.0)).unwrap();
    let mut r = req(&g, "probe");
    r.idempotency_key = Some("solo".into());
    assert!(g.offer(1_000, r).admitted());
    assert_eq!(started(&mut g, 1_000), 1);
    assert!(g
        .take_ledger_records()
        .iter()
        .all(|r| r.dispatched.is_none()));
}

#[test]
fn a_leader_learns_another_gates_settlement_of_a_hold_it_keeps_for_it() {
    use crate::ledger::{HoldRecord, HoldState};
    let mut g = Gate::new(cfg(2, 800.0)).unwrap();
    g.set_hold_owner("b");
    let held = shared_hold("k", HoldState::Held, Some("c"));
    g.adopt_ledger(
        vec![held.clone()],
        2_000,
        &["c".to_string()].into(),
        false,
        0,
    );
    g.take_ledger_records();
    assert_eq!(g.foreign_held(10), vec!["k".to_string()]);
    // Another hold of the key (a different owner) settling changes nothing here.
    let other = HoldRecord {
        state: HoldState::Done,
        owner: Some("x".into()),
        version: 600,
        ..held.clone()
    };
    assert_eq!(g.learn_settled(2_100, &[other]), 0);
    assert_eq!(g.ledger().get("k").map(|h| h.state), Some(HoldState::Held));
    // Its own replica's `done`: taken, with its spend, and nothing to write back.
    let done = HoldRecord {
        state: HoldState::Done,
        tokens_spent: 90,
        version: 600,
        ..held
    };
    assert_eq!(g.learn_settled(2_100, &[done]), 1);
    assert_eq!(g.ledger().get("k").map(|h| h.state), Some(HoldState::Done));
    assert_eq!(g.ledger().get("k").map(|h| h.tokens_spent), Some(90));
    assert!(g.take_ledger_records().is_empty());
    assert!(g.foreign_held(10).is_empty());
}
