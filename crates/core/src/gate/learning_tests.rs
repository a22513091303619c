//! Hand-computed cases for what the gate learns from completions: concurrency, the token
//! count, per-class estimate errors, and probes (the gate never locks itself in).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::tests::{cfg, drain, req};
use super::*;

fn done(prompt: u32, out: u32) -> Completion {
    Completion {
        ok: true,
        prompt_tokens: Some(prompt),
        completion_tokens: Some(out),
    }
}

/// A job's concurrency is the mean in-flight count over its life. A runs 0..300, B 100..400
/// on two slots: A shared 200 of its 300 ms, (100 x 1 + 200 x 2) / 300 = 1.667; B the same,
/// (200 x 2 + 100 x 1) / 300.
#[test]
fn concurrency_is_the_mean_in_flight_over_a_jobs_life() {
    let mut g = Gate::new(cfg(2, 100.0)).unwrap();
    let a = g.offer(0, req(&g, "prod"));
    drain(&mut g, 0);
    let b = g.offer(100, req(&g, "prod"));
    drain(&mut g, 100);
    let ca = g.on_complete(300, a.job_id, done(1, 1)).unwrap();
    let cb = g.on_complete(400, b.job_id, done(1, 1)).unwrap();
    assert!((ca.concurrency - 5.0 / 3.0).abs() < 1e-9, "{ca:?}");
    assert!((cb.concurrency - 5.0 / 3.0).abs() < 1e-9, "{cb:?}");
    // Recent mean: 1 + 0.1 x (5/3 - 1) = 1.0667, then + 0.1 x (5/3 - 1.0667) = 1.1267.
    let m = g.snapshot(400).pools[0].mean_concurrency;
    assert!((m - 1.126_666).abs() < 1e-3, "{m}");
    // A job cancelled while queued never ran: concurrency 0.
    let c = g.offer(400, req(&g, "prod"));
    let cc = g.cancel(400, c.job_id).unwrap();
    assert!(!cc.dispatched && cc.concurrency == 0.0, "{cc:?}");
}

/// The others' context over a job's life: A (1000-token prompt) runs 0..300, B (200) runs
/// 100..400. A had B beside it for 200 of its 300 ms: 200 x 200 / 300 = 133.3 tokens; B had A
/// for 200 of 300: 1000 x 200 / 300 = 666.7.
#[test]
fn others_context_is_the_time_mean_of_what_ran_beside() {
    let mut g = Gate::new(cfg(2, 100.0)).unwrap();
    let mut ra = req(&g, "prod");
    ra.prompt_tokens = 1000;
    let a = g.offer(0, ra);
    drain(&mut g, 0);
    let mut rb = req(&g, "prod");
    rb.prompt_tokens = 200;
    let b = g.offer(100, rb);
    drain(&mut g, 100);
    let ca = g.on_complete(300, a.job_id, done(1000, 0)).unwrap();
    let cb = g.on_complete(400, b.job_id, done(200, 0)).unwrap();
    assert!((ca.others_context - 400.0 / 3.0).abs() < 1e-6, "{ca:?}");
    assert!((cb.others_context - 2000.0 / 3.0).abs() < 1e-6, "{cb:?}");
    // Idle again: nothing left in flight, no context left over.
    assert_eq!(g.pools[0].context_now, 0.0);
}

/// A waiting request is estimated at full concurrency (every slot busy while it runs); one on
/// a free slot at what runs now plus itself.
#[test]
fn the_estimate_uses_the_concurrency_the_request_will_see() {
    // 100 ms alone; each other request in flight adds 50%.
    let mut c = cfg(4, 100.0);
    c.pools[0].prior.batch_slowdown = 0.5;
    c.classes[0].deadline_ms = None;
    let mut g = Gate::new(c).unwrap();
    let d = g.offer(0, req(&g, "prod"));
    assert_eq!(d.est_service_ms, 100, "alone: {d:?}");
    drain(&mut g, 0);
    let d = g.offer(0, req(&g, "prod"));
    assert_eq!(d.est_service_ms, 150, "beside one: {d:?}");
    drain(&mut g, 0);
    g.offer(0, req(&g, "prod"));
    g.offer(0, req(&g, "prod"));
    drain(&mut g, 0);
    // All four slots busy: a fifth waits, then runs among four: 100 x (1 + 3 x 0.5) = 250.
    let d = g.offer(0, req(&g, "prod"));
    assert!(d.projected_wait_ms > 0, "{d:?}");
    assert_eq!(d.est_service_ms, 250, "{d:?}");
    // Everything ends together (each ran among four): the recent mean is high, but a pool
    // that is idle now estimates a newcomer alone.
    g.cancel(0, d.job_id);
    for id in 1..=4 {
        g.on_complete(250, JobId(id), done(1, 1)).unwrap();
    }
    assert!(g.snapshot(250).pools[0].mean_concurrency > 1.2);
    assert_eq!(g.offer(250, req(&g, "prod")).est_service_ms, 100);
}

/// The gate counts prompt tokens from characters with the relation it learns from the
/// upstream's usage: 4 characters per token at first, then the upstream's 1.2.
#[test]
fn prompt_tokens_are_counted_the_way_the_upstream_counts_them() {
    // 1 ms per prompt token, nothing else.
    let mut c = cfg(1, 0.0);
    c.pools[0].prior.prefill_ms_per_token = 1.0;
    c.classes[0].deadline_ms = None;
    let mut g = Gate::new(c).unwrap();
    let mut r = req(&g, "prod");
    r.prompt_chars = Some(1200);
    r.model = Some("tiny".into());
    r.max_tokens = Some(0);
    let d = g.offer(0, r.clone());
    assert_eq!(d.est_service_ms, 300, "1200 chars / 4 = 300 tokens: {d:?}");
    drain(&mut g, 0);
    g.on_complete(10, d.job_id, done(1000, 0)).unwrap();
    let mut t = 10;
    for chars in [120u32, 600, 2400, 1200, 360, 900].repeat(4) {
        let mut q = r.clone();
        q.prompt_chars = Some(chars);
        let d = g.offer(t, q);
        drain(&mut g, t);
        let tokens = (f64::from(chars) / 1.2).round() as u32;
        g.on_complete(t + 5, d.job_id, done(tokens, 0)).unwrap();
        t += 10;
    }
    let d = g.offer(t, r);
    assert!(
        (950..=1050).contains(&d.est_service_ms),
        "1200 chars at 1.2 per token = 1000 tokens: {d:?}"
    );
    let (ratio, template) = (
        g.snapshot(t).pools[0].chars_per_token,
        g.snapshot(t).pools[0].template_tokens,
    );
    assert!(
        (ratio - 1.2).abs() < 0.1 && template < 20.0,
        "{ratio} {template}"
    );
}

/// Locking in: a class's requests are refused for their own size on an idle pool, and
/// refused requests teach nothing. Here the class's outputs drift: it used to write 1000
/// tokens (10 s, against a 3 s deadline), now it writes 10. Without probes every request
/// is refused for ever. With them, one request per `probe_interval_ms` is let through on a
/// free slot once nothing of the class was admitted for that long; each teaches the class's
/// output length, and the gate soon admits on the merits.
#[test]
fn probes_keep_the_gate_from_locking_itself_in() {
    // 10 ms per output token, learned.
    let mut c = cfg(1, 0.0);
    c.pools[0].prior.decode_ms_per_token = 10.0;
    c.pools[0].prior.learn = true;
    c.classes[0].deadline_ms = Some(30_000);
    c.classes[0].probe_interval_ms = 1000;
    let mut g = Gate::new(c.clone()).unwrap();
    let mut t = 0;
    for _ in 0..30 {
        let d = g.offer(t, req(&g, "prod"));
        assert!(d.admitted(), "{d:?}");
        drain(&mut g, t);
        g.on_complete(t + 10_000, d.job_id, done(1, 1000)).unwrap();
        t += 10_000;
    }
    // The deadline tightens to 3 s (a reload keeps what was learned).
    c.classes[0].deadline_ms = Some(3000);
    g.reconfigure(t, c).unwrap();
    let mut admitted_on_merit = None;
    let mut refusals = 0;
    let start = t;
    for i in 0..400 {
        let d = g.offer(t, req(&g, "prod"));
        match d.reason {
            Reason::Probe => {
                // A second request while the probe is live is refused.
                let again = g.offer(t, req(&g, "prod"));
                assert_eq!(again.reason, Reason::ProjectedWaitExceedsSlack, "{again:?}");
                drain(&mut g, t);
                g.on_complete(t + 100, d.job_id, done(1, 10)).unwrap();
            }
            Reason::WithinSlack => {
                admitted_on_merit = Some(i);
                break;
            }
            Reason::ProjectedWaitExceedsSlack => {
                refusals += 1;
                assert!(
                    d.should_retry,
                    "the class's record does not confirm it: {d:?}"
                );
            }
            other => panic!("unexpected {other:?}: {d:?}"),
        }
        t += 250;
    }
    assert!(admitted_on_merit.is_some(), "the gate stayed locked");
    // Probes were bounded: at most one per interval (4 offers each), the rest refused.
    let probes = g.snapshot(t).classes[0].probes;
    assert!(
        probes >= 1 && probes <= 1 + (t - start) / 1000 && refusals >= 2 * probes,
        "{probes} probes, {refusals} refusals in {} ms",
        t - start
    );
}

/// With evidence that confirms the estimate, a request too big for its own deadline is
/// refused for good (`x-should-retry: false`), with no probe.
#[test]
fn a_confirmed_estimate_refuses_for_good() {
    // 1 ms per output token, learned and confirmed by completions that match it.
    let mut c = cfg(1, 0.0);
    c.pools[0].prior.decode_ms_per_token = 1.0;
    c.pools[0].prior.learn = true;
    c.classes[0].deadline_ms = Some(1000);
    let mut g = Gate::new(c).unwrap();
    let mut t = 0;
    for _ in 0..10 {
        let mut r = req(&g, "prod");
        r.max_tokens = Some(100);
        let d = g.offer(t, r);
        assert!(d.admitted(), "{d:?}");
        drain(&mut g, t);
        g.on_complete(t + 100, d.job_id, done(0, 100)).unwrap();
        t += 200;
    }
    let mut r = req(&g, "prod");
    r.max_tokens = Some(5000);
    r.expected_output_tokens = Some(5000); // 5 s of work against a 1 s deadline
    let d = g.offer(t, r);
    assert_eq!(d.reason, Reason::ProjectedWaitExceedsSlack, "{d:?}");
    assert!(!d.should_retry, "confirmed: {d:?}");
    assert_eq!(g.snapshot(t).classes[0].probes, 0);
}

/// The warm-up is over for a learning estimator (so the probe rule is what decides).
fn c_check(g: &Gate, learn: bool) {
    assert!(!learn || !g.pools[0].estimator.warming_up());
}

/// Shadow mode admits anyway: no probes there (they would be counted twice); nor with a
/// frozen estimator, which a probe cannot teach.
#[test]
fn shadow_mode_and_frozen_estimators_take_no_probes() {
    for (shadow, learn) in [(true, true), (false, false)] {
        let mut c = cfg(1, 10_000.0);
        c.pools[0].prior.learn = learn;
        c.classes[0].deadline_ms = Some(3000);
        c.classes[0].probe_interval_ms = 1;
        c.shadow = shadow;
        let mut g = Gate::new(c).unwrap();
        // Past the warm-up (five completions of 200 ms against the 10 s prior), so that only
        // shadow mode or the frozen estimator can be what keeps probes out.
        for t in 0..5 {
            let d = g.offer(t * 1000, req(&g, "prod"));
            drain(&mut g, t * 1000);
            g.on_complete(t * 1000 + 200, d.job_id, done(1, 1));
        }
        c_check(&g, learn);
        for t in [60_000, 61_000, 62_000] {
            let d = g.offer(t, req(&g, "prod"));
            assert_ne!(d.reason, Reason::Probe, "{d:?}");
            g.cancel(t, d.job_id);
        }
        assert_eq!(g.snapshot(63_000).classes[0].probes, 0);
    }
}

/// A class the shared fit serves badly is corrected by its own recent record: here the
/// estimator is frozen at 100 ms (its figures are the operator's: no correction) and then
/// learning with a prior of 100 ms on a server where every request takes 300 ms. The first
/// completions teach the shared fit; the class's correction takes out whatever ratio is left.
#[test]
fn a_class_is_corrected_by_its_own_record() {
    let mut c = cfg(1, 100.0);
    c.classes[0].deadline_ms = None;
    let mut g = Gate::new(c.clone()).unwrap();
    for t in 0..10 {
        let d = g.offer(t * 1000, req(&g, "prod"));
        drain(&mut g, t * 1000);
        g.on_complete(t * 1000 + 300, d.job_id, done(1, 1)).unwrap();
    }
    // Frozen: the operator's 100 ms stands.
    assert_eq!(g.offer(20_000, req(&g, "prod")).est_service_ms, 100);
    // Learning: after ten 300 ms completions the estimate is 300 ms (shared fit and class
    // correction together), whatever share each took.
    c.pools[0].prior.learn = true;
    let mut g = Gate::new(c).unwrap();
    for t in 0..10 {
        let d = g.offer(t * 1000, req(&g, "prod"));
        drain(&mut g, t * 1000);
        g.on_complete(t * 1000 + 300, d.job_id, done(1, 1)).unwrap();
    }
    let est = g.offer(20_000, req(&g, "prod")).est_service_ms;
    assert!((285..=315).contains(&est), "{est}");
}

/// Admission keeps room for the estimator's error: with a class whose recent estimates were
/// off by m at their 90th percentile, a request is admitted only if its wait and service,
/// padded by m, fit
/// its deadline: one at the unpadded edge is refused.
#[test]
fn admission_pads_with_the_class_s_recent_error() {
    // 1 slot, 1000 ms jobs, learning; completions alternate 800 and 1200 ms.
    let mut c = cfg(1, 1000.0);
    c.pools[0].prior.learn = true;
    c.classes[0].deadline_ms = None;
    c.classes[0].probe_interval_ms = 0;
    let mut g = Gate::new(c).unwrap();
    let mut t = 0;
    for i in 0..20 {
        let d = g.offer(t, req(&g, "prod"));
        drain(&mut g, t);
        let took = if i % 2 == 0 { 800 } else { 1200 };
        g.on_complete(t + took, d.job_id, done(1, 1)).unwrap();
        t += 2000;
    }
    let m = g.snapshot(t).classes[0].est_error.p90.min(MAX_MARGIN);
    assert!(m > 0.1 && m <= MAX_MARGIN, "{m}");
    // One job in flight, just started: a newcomer waits its service, then runs its own.
    let first = g.offer(t, req(&g, "prod"));
    drain(&mut g, t);
    let own = first.est_service_ms;
    let padded = own + ((2 * own) as f64 * m).round() as u64;
    let mut r = req(&g, "prod");
    // Unpadded, wait + own = 2 x own fits exactly; padded it does not.
    r.deadline = Some(t + 2 * own);
    let d = g.offer(t, r.clone());
    assert_eq!(d.reason, Reason::ProjectedWaitExceedsSlack, "{d:?}");
    assert_eq!(
        d.projected_wait_ms, own,
        "the wait reported is the unpadded one"
    );
    r.deadline = Some(t + own + padded + 2);
    let d = g.offer(t, r);
    assert!(d.admitted(), "{d:?}");
}
