//! The forecast of higher-priority work, computed by hand.
#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::tests::drain;
use super::*;
use crate::config::{ClassConfig, PoolConfig, PriorConfig};

/// One slot; every job costs 1000 ms (frozen estimator). `inter` (priority 100, deadline
/// 10 s) above `batch` (priority 10, deadline 60 s). A 12 s window: buckets of 1 s.
fn two_class(refused_weight: f64, batch_forecast: bool) -> Gate {
    gate(refused_weight, batch_forecast, 10_000, 12_000)
}

fn gate(refused_weight: f64, batch_forecast: bool, inter_deadline: u64, window: u64) -> Gate {
    let class = |name: &str, priority, deadline| ClassConfig {
        name: name.into(),
        priority,
        deadline_ms: Some(deadline),
        pool: "p".into(),
        probe_interval_ms: 0,
        forecast: batch_forecast || priority == 100,
        ..ClassConfig::default()
    };
    Gate::new(GateConfig {
        pools: vec![PoolConfig {
            name: "p".into(),
            slots: 1,
            // Exact projections: no time kept in hand.
            promise_guard_ms: 0,
            prior: PriorConfig {
                overhead_ms: 1000.0,
                prefill_ms_per_token: 0.0,
                decode_ms_per_token: 0.0,
                decode_ms_per_1k_context: 0.0,
                batch_slowdown: 0.0,
                default_output_tokens: 0,
                learn: false,
                ..PriorConfig::default()
            },
            forecast_window_ms: window,
            forecast_refused_weight: refused_weight,
            ..PoolConfig::default()
        }],
        classes: vec![
            class("inter", 100, inter_deadline),
            class("batch", 10, 60_000),
        ],
        ..GateConfig::default()
    })
    .unwrap()
}

fn offer(g: &mut Gate, now: Millis, class: &str) -> Decision {
    let r = Request {
        class: g.classify(Some(class)),
        ..Request::default()
    };
    let d = g.offer(now, r);
    drain(g, now);
    d
}

fn done(g: &mut Gate, now: Millis, id: JobId) {
    g.on_complete(
        now,
        id,
        Completion {
            ok: true,
            ..Completion::default()
        },
    )
    .unwrap();
    drain(g, now);
}

/// An interactive job every 2 s from t = 0 to t = 12 s, each running 1 s: half the slot.
fn steady_stream(g: &mut Gate) -> JobId {
    let mut last = JobId(0);
    for k in 0..=6u64 {
        let t = k * 2_000;
        let d = offer(g, t, "inter");
        assert_eq!(d.action, Action::Admit);
        assert_eq!(d.forecast_wait_ms, 0, "nothing is above the top priority");
        last = d.job_id;
        if k < 6 {
            done(g, t + 1_000, d.job_id);
        }
    }
    last
}

#[test]
fn a_batch_request_lets_a_steady_interactive_stream_pass() {
    let mut g = two_class(1.0, true);
    steady_stream(&mut g);
    // At 12.5 s the job started at 12 s has 500 ms left: the base wait. The 12 s window
    // (0.5 s .. 12.5 s) holds the jobs of 2, 4, ..., 12 s (1000 ms each) and half of the
    // bucket of 0 s (its job counts for 500): rho = 6500 / 12000, and the forecast part of the
    // wait is 500 x rho / (1 - rho) = 500 x 6500 / 5500 = 590.9 -> 591.
    let d = offer(&mut g, 12_500, "batch");
    assert_eq!(d.action, Action::Admit);
    assert_eq!(d.forecast_wait_ms, 591);
    assert_eq!(d.projected_wait_ms, 1_091);
}

#[test]
fn without_forecast_only_the_work_ahead_now_counts() {
    let mut g = two_class(1.0, false);
    steady_stream(&mut g);
    let d = offer(&mut g, 12_500, "batch");
    assert_eq!(d.forecast_wait_ms, 0);
    assert_eq!(d.projected_wait_ms, 500);
}

#[test]
fn the_forecast_decays_when_the_stream_stops() {
    let mut g = two_class(1.0, true);
    let last = steady_stream(&mut g);
    done(&mut g, 13_000, last);
    // At 20 s a batch job takes the free slot (no wait, no forecast: nothing overtakes a job
    // that is running). Another batch request then waits 1000 ms for it. The window (8 s ..
    // 20 s) still holds the interactive work of 8, 10 and 12 s: rho = 3000 / 12000, forecast
    // = 1000 x (1/4) / (3/4) = 333.
    let first = offer(&mut g, 20_000, "batch");
    assert_eq!((first.projected_wait_ms, first.forecast_wait_ms), (0, 0));
    let d = offer(&mut g, 20_000, "batch");
    assert_eq!(d.forecast_wait_ms, 333);
    // By 25 s the last interactive bucket (12 s) has left the window: no forecast.
    done(&mut g, 21_000, first.job_id);
    done(&mut g, 22_000, d.job_id);
    let running = offer(&mut g, 25_000, "batch");
    assert_eq!(running.projected_wait_ms, 0);
    let d = offer(&mut g, 25_000, "batch");
    assert_eq!((d.projected_wait_ms, d.forecast_wait_ms), (1_000, 0));
}

#[test]
fn a_flooded_bucket_counts_as_the_whole_slot() {
    // 30 interactive requests at once: slack 10000 - 1000 = 9000 lets waits 0, 1000, ...,
    // 9000 in (10 jobs) and refuses 20. Bucket [0, 1 s) asks 10 s of work (admitted alone)
    // of a slot that serves 1 s in it: capped at 1000 ms, over the half second seen so far
    // (a fresh gate is not diluted by a window of nothing), the class takes the whole slot
    // and more (rho = 2, counted as 0.98).
    for weight in [0.0, 1.0] {
        let mut g = two_class(weight, true);
        let refused = (0..30)
            .filter(|_| offer(&mut g, 0, "inter").action == Action::Reject)
            .count();
        assert_eq!(refused, 20);
        let rho = g.higher_demand(500, PoolId(0), 10);
        assert!((rho - 2.0).abs() < 1e-9, "{rho}");
        // A batch request behind 9.5 s of interactive work: the wait is inflated by the
        // largest factor there is, 1 / (1 - 0.98) = 50, and it is refused at once, with a
        // Retry-After from the same forecast (far beyond a minute).
        let d = offer(&mut g, 500, "batch");
        assert_eq!(d.action, Action::Reject);
        assert_eq!(d.reason, Reason::ProjectedWaitExceedsSlack);
        assert_eq!(d.projected_wait_ms, 9_500 * 50);
        assert!(d.retry_after_ms.unwrap() > 60_000);
    }
}

#[test]
fn refused_work_is_what_tells_a_saturated_class_from_a_light_one() {
    // Every 2 s, three interactive requests of 1 s with a 1.5 s deadline (slack 500 ms): the
    // first is admitted, the two others would wait 1 s and are refused. Admitted work alone
    // is half the slot; counting the refusals (buckets of 2 s: 3 s asked, capped at the 2 s
    // the slot serves) it is the whole slot.
    let mut rho = Vec::new();
    for weight in [0.0, 1.0] {
        let mut g = gate(weight, true, 1_500, 24_000);
        for k in 0..6u64 {
            let t = k * 2_000;
            let mut admitted = Vec::new();
            for _ in 0..3 {
                let d = offer(&mut g, t, "inter");
                if d.action == Action::Admit {
                    admitted.push(d.job_id);
                }
            }
            assert_eq!(admitted.len(), 1);
            done(&mut g, t + 1_000, admitted[0]);
        }
        // At 12 s the window (0 .. 12 s) holds the six buckets of 2 s seen.
        rho.push(g.higher_demand(12_000, PoolId(0), 10));
    }
    assert!((rho[0] - 0.5).abs() < 1e-9, "admitted only: {}", rho[0]);
    assert!((rho[1] - 1.0).abs() < 1e-9, "with refusals: {}", rho[1]);
}

#[test]
fn rate_window_buckets_roll_and_clear() {
    let mut w = RateWindow::default();
    w.record(0, 100, 1_000);
    w.record(999, 50, 1_000);
    w.record(1_000, 7, 1_000);
    assert_eq!(w.at(0, 1_000), 150);
    assert_eq!(w.at(1_000, 1_000), 7);
    // Twelve buckets on, bucket 0 is the oldest still kept (the window starts inside it);
    // thirteen on, it is gone.
    w.record(12_000, 1, 1_000);
    assert_eq!(w.at(0, 1_000), 150);
    w.record(13_000, 1, 1_000);
    assert_eq!(w.at(0, 1_000), 0);
    assert_eq!(w.at(1_000, 1_000), 7);
    // A long silence clears everything; a new width starts again.
    w.record(1_000_000, 3, 1_000);
    assert_eq!(w.at(1_000, 1_000), 0);
    assert_eq!(w.at(1_000_000, 1_000), 3);
    w.record(1_000_000, 5, 2_000);
    assert_eq!(w.at(1_000_000, 1_000), 0);
    assert_eq!(w.at(1_000_000, 2_000), 5);
}

#[test]
fn a_reload_that_changes_the_window_starts_its_history_again() {
    let mut g = two_class(1.0, true);
    steady_stream(&mut g);
    let mut cfg = g.config().clone();
    assert_eq!(cfg.pools.len(), 1);
    cfg.pools[0].forecast_window_ms = 24_000;
    g.reconfigure(12_100, cfg).unwrap();
    // Buckets of 1 s are no history for buckets of 2 s: nothing to forecast from (not a
    // window of 12 buckets of 2 s holding one bucket of work, which would read as a light
    // class for the next 24 s).
    let d = offer(&mut g, 12_500, "batch");
    assert_eq!((d.projected_wait_ms, d.forecast_wait_ms), (500, 0));
    // The next interactive admission starts the new history. At 13.5 s: 1000 ms asked, seen
    // for 0.1 s, over at least a quarter bucket (0.5 s): rho = 2, counted as 0.98. The base
    // wait of a batch request is the batch job running since 13 s (500 ms left) and the
    // interactive job queued ahead of it (1000): 1500 x 0.98 / 0.02 = 73500.
    done(&mut g, 13_000, JobId(7));
    let i = offer(&mut g, 13_400, "inter");
    assert_eq!(i.action, Action::Admit);
    let d = offer(&mut g, 13_500, "batch");
    assert_eq!(d.forecast_wait_ms, 73_500);
}
