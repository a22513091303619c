//! Unit tests of the estimator, with the expected figures computed by hand in the comments.

use super::*;
use crate::test_rng::XorShift;

const ALONE: Sharing = Sharing::ALONE;

/// `k` requests of this shape at once.
fn sh(k: f64, p: u32, o: u32) -> Sharing {
    Sharing::with(k, f64::from(p) + f64::from(o) / 2.0)
}

fn prior(overhead: f64, prefill: f64, decode: f64) -> PriorConfig {
    PriorConfig {
        overhead_ms: overhead,
        prefill_ms_per_token: prefill,
        decode_ms_per_token: decode,
        decode_ms_per_1k_context: 0.0,
        batch_slowdown: 0.0,
        ..PriorConfig::default()
    }
}

fn rel(got: u64, want: f64) -> f64 {
    (got as f64 - want).abs() / want
}

/// A linear endpoint unlike the priors: 350 ms + 0.05 ms/prompt token + 12 ms/output token.
fn linear(p: u32, o: u32) -> f64 {
    350.0 + f64::from(p) * 0.05 + f64::from(o) * 12.0
}

/// llama.cpp on one CPU core, as measured (TOOLS.md): 50 ms overhead, 0.9 ms per prompt
/// token, 7.5 ms per output token plus 14 ms per output token per 1000 tokens of context,
/// and each other request in flight adds 80% of the time alone.
fn llama(p: u32, o: u32, k: f64) -> f64 {
    let (pf, of) = (f64::from(p), f64::from(o));
    let alone = 50.0 + 0.9 * pf + 7.5 * of + 14.0 * of * (pf + of / 2.0) / 1000.0;
    alone * (1.0 + 0.8 * (k - 1.0))
}

#[test]
fn starts_at_the_prior() {
    // 200 + 100 x 0.2 + 10 x 20 = 420 ms; first token 200 + 20 + 20 = 240 ms.
    let est = Estimator::new(&prior(200.0, 0.2, 20.0));
    assert_eq!(
        est.estimate(100, 10, ALONE),
        Estimate {
            service_ms: 420,
            first_token_ms: 240
        }
    );
    // With a batch_slowdown prior of 0.5, three others in flight add 1.5x: 420 x 2.5.
    let mut p = prior(200.0, 0.2, 20.0);
    p.batch_slowdown = 0.5;
    assert_eq!(
        Estimator::new(&p)
            .estimate(100, 10, sh(4.0, 100, 10))
            .service_ms,
        1050
    );
    // The context term: 10 output tokens x (100 + 5) context / 1000 x 14 ms = 14.7 ms.
    let mut p = prior(200.0, 0.2, 20.0);
    p.decode_ms_per_1k_context = 14.0;
    assert_eq!(Estimator::new(&p).estimate(100, 10, ALONE).service_ms, 435);
}

#[test]
fn converges_to_a_known_model_within_ten_percent() {
    let mut est = Estimator::new(&prior(1000.0, 1.0, 40.0));
    let mut rng = XorShift(42);
    for _ in 0..300 {
        let (p, o) = (rng.range(10, 8000), rng.range(1, 600));
        let noise = 0.95 + 0.1 * rng.unit(); // +-5%, as real latencies have
        est.observe(p, o, ALONE, (linear(p, o) * noise) as u64);
    }
    for (p, o) in [(100, 10), (4000, 50), (50, 500), (8000, 300), (1, 1)] {
        let err = rel(est.estimate(p, o, ALONE).service_ms, linear(p, o));
        assert!(err < 0.10, "p={p} o={o}: err {err} ({:?})", est.snapshot());
    }
    assert_eq!(est.snapshot().samples, 300);
}

/// Real traffic comes in a few shapes. Two shapes cannot pin nine coefficients, yet the
/// estimate must predict both shapes and stay put (no coefficient swinging from one
/// completion to the next), and an unseen shape must stay within reach of the prior.
#[test]
fn two_shapes_only_stay_stable_and_predict_both() {
    let mut est = Estimator::new(&PriorConfig::default());
    let chat = (40, 32, 3.0); // short chat at the usual concurrency
    let batch = (800, 256, 3.0); // long-prompt batch work
    let mut history = Vec::new();
    for i in 0..400 {
        let (p, o, k) = if i % 3 == 0 { batch } else { chat };
        est.observe(p, o, sh(k, p, o), llama(p, o, k) as u64);
        if i >= 100 {
            history.push(
                est.estimate(batch.0, batch.1, sh(batch.2, batch.0, batch.1))
                    .service_ms,
            );
        }
    }
    for (p, o, k) in [chat, batch] {
        let err = rel(est.estimate(p, o, sh(k, p, o)).service_ms, llama(p, o, k));
        assert!(
            err < 0.05,
            "shape {p}/{o}: err {err} ({:?})",
            est.snapshot()
        );
    }
    // Stable: after the first 100 completions the batch estimate moves less than 2%.
    let (lo, hi) = (
        *history.iter().min().unwrap_or(&0),
        *history.iter().max().unwrap_or(&0),
    );
    assert!(
        (hi - lo) as f64 / lo as f64 <= 0.02,
        "estimate wandered {lo}..{hi}"
    );
    let s = est.snapshot();
    for v in [
        s.overhead_ms,
        s.prefill_ms_per_token,
        s.decode_ms_per_token,
        s.decode_ms_per_1k_context,
        s.batch_slowdown,
    ] {
        assert!(v.is_finite() && v >= 0.0, "{s:?}");
    }
}

/// One request stuck on its slot for 90 s among 165 ms ones must barely move the
/// estimate (Huber: it pulls like one completion 50% off), and a lasting slowdown must still
/// be learned.
#[test]
fn an_outlier_does_not_swing_the_model() {
    let mut est = Estimator::new(&prior(5.0, 0.0, 10.0));
    for _ in 0..30 {
        est.observe(10, 16, ALONE, 165);
    }
    let before = est.estimate(10, 16, ALONE).service_ms;
    est.observe(10, 16, ALONE, 90_000);
    let after = est.estimate(10, 16, ALONE).service_ms;
    assert!((160..=170).contains(&before), "{before}");
    assert!(
        after <= before + before / 20,
        "one outlier moved the estimate from {before} to {after} ms"
    );
    // A real, lasting slowdown (10x) is learned within a few dozen completions.
    for _ in 0..60 {
        est.observe(10, 16, ALONE, 1_650);
    }
    let slow = est.estimate(10, 16, ALONE).service_ms;
    assert!(rel(slow, 1650.0) < 0.15, "slowdown learned as {slow} ms");
}

/// A server that slows down under concurrency: the same request takes 1x alone, 1.8x beside
/// one other, 3.4x beside three. Learned from a mix of concurrencies, the estimate at each
/// concurrency is right, and the slowdown is reported.
#[test]
fn learns_a_server_that_slows_down_under_concurrency() {
    let mut est = Estimator::new(&PriorConfig::default());
    let mut rng = XorShift(9);
    for _ in 0..300 {
        let p = rng.range(20, 1000);
        let o = rng.range(16, 256);
        let k = 1.0 + 3.0 * rng.unit();
        est.observe(p, o, sh(k, p, o), llama(p, o, k) as u64);
    }
    for k in [1.0, 2.0, 4.0] {
        for (p, o) in [(30, 32), (500, 128), (1000, 256)] {
            let err = rel(est.estimate(p, o, sh(k, p, o)).service_ms, llama(p, o, k));
            assert!(
                err < 0.10,
                "p={p} o={o} k={k}: err {err} ({:?})",
                est.snapshot()
            );
        }
    }
    let s = est.snapshot();
    assert!((s.batch_slowdown - 0.8).abs() < 0.1, "{s:?}");
    assert!((s.decode_ms_per_token - 7.5).abs() < 1.5, "{s:?}");
}

/// A prior ten times too slow, and one ten times too fast: both converge to the server.
#[test]
fn a_prior_ten_times_wrong_converges() {
    for scale in [10.0, 0.1] {
        let mut est = Estimator::new(&prior(350.0 * scale, 0.05 * scale, 12.0 * scale));
        let mut rng = XorShift(3);
        for _ in 0..150 {
            let (p, o) = (rng.range(10, 4000), rng.range(1, 400));
            est.observe(p, o, ALONE, linear(p, o) as u64);
        }
        for (p, o) in [(100, 10), (2000, 200), (50, 400)] {
            let err = rel(est.estimate(p, o, ALONE).service_ms, linear(p, o));
            assert!(err < 0.10, "prior x{scale}, p={p} o={o}: err {err}");
        }
    }
}

/// Data whose unconstrained least-squares fit has a negative coefficient (longer prompts
/// finishing sooner, as a server's cache can make them look): the constrained fit keeps
/// every coefficient >= 0, fits the data as well as it can, and no estimate runs away.
#[test]
fn negative_raw_coefficients_do_not_run_away() {
    let mut est = Estimator::new(&PriorConfig::default());
    // y = 1000 - 0.4 x P + 10 x O: the raw prefill coefficient is -0.4 ms/token.
    let shapes = [(100, 50), (2000, 50), (100, 200), (2000, 200)];
    for i in 0..400 {
        let (p, o) = shapes[i % 4];
        let y = 1000.0 - 0.4 * f64::from(p) + 10.0 * f64::from(o);
        est.observe(p, o, ALONE, y as u64);
    }
    let s = est.snapshot();
    assert!(
        s.prefill_ms_per_token >= 0.0 && s.overhead_ms >= 0.0,
        "{s:?}"
    );
    // Without a negative prefill the best fit is off at the extremes, but it stays within
    // the data's range and keeps the output slope: 150 output tokens x 10 ms = 1500 ms.
    for (p, o) in shapes {
        let got = est.estimate(p, o, ALONE).service_ms;
        assert!((600..=3300).contains(&got), "p={p} o={o}: {got} ({s:?})");
    }
    let slope = est.estimate(1000, 200, ALONE).service_ms as f64
        - est.estimate(1000, 50, ALONE).service_ms as f64;
    assert!(
        (slope - 1500.0).abs() < 300.0,
        "output slope {slope} ({s:?})"
    );
    // Far outside the data, nothing runs away (no sign flips, no absurd figures).
    let far = est
        .estimate(50_000, 2_000, sh(4.0, 50_000, 2_000))
        .service_ms;
    assert!(far > 0 && far < 10_000_000, "{far}");
}

#[test]
fn identical_requests_still_predict_right() {
    let mut est = Estimator::new(&PriorConfig::default());
    for _ in 0..200 {
        est.observe(0, 0, ALONE, 800);
    }
    let got = est.estimate(0, 0, ALONE).service_ms;
    assert!((790..=810).contains(&got), "{got}");
}

#[test]
fn frozen_estimator_keeps_priors() {
    let mut p = prior(800.0, 0.0, 0.0);
    p.learn = false;
    let mut est = Estimator::new(&p);
    est.observe(10, 10, ALONE, 5);
    assert_eq!(est.estimate(10, 10, ALONE).service_ms, 800);
}

#[test]
fn absurd_observations_do_not_poison_it() {
    let mut est = Estimator::new(&PriorConfig::default());
    let odd = |k: f64, c: f64| Sharing {
        concurrency: k,
        others_context: c,
        others_prefill: c,
    };
    est.observe(u32::MAX, u32::MAX, odd(f64::NAN, 0.0), u64::MAX);
    est.observe(0, 0, odd(f64::INFINITY, f64::NAN), 0);
    est.observe(10, 10, odd(-5.0, -1.0), 100);
    est.observe(10, 10, odd(2.0, 1e300), 100);
    let e = est.estimate(100, 100, ALONE);
    assert!(e.service_ms >= 1 && e.service_ms < 1_000_000, "{e:?}");
    assert!(e.first_token_ms <= e.service_ms);
    let big = est.estimate(u32::MAX, u32::MAX, odd(1e300, 1e300));
    assert!(big.first_token_ms <= big.service_ms);
}

/// Thousands of near-exact completions of a real trace's shape (long prompts, mostly short
/// outputs, a long tail) stay exact: no drift, no runaway.
#[test]
fn stays_exact_over_a_long_replay() {
    let mut e = Estimator::new(&prior(30.0, 0.05, 15.0));
    let mut rng = XorShift(0x5eed);
    for i in 0..20_000u32 {
        let p = rng.range(50, 8_000);
        let o = if rng.unit() < 0.8 {
            rng.range(1, 40)
        } else {
            rng.range(40, 1_900)
        };
        let truth = (30.0 + 0.05 * f64::from(p) + 15.0 * f64::from(o)).round();
        let est = e.estimate(p, o, ALONE).service_ms as f64;
        assert!(
            (est - truth).abs() <= truth * 0.05 + 2.0,
            "sample {i}: estimate {est} vs {truth} ({:?})",
            e.snapshot()
        );
        e.observe(p, o, ALONE, truth as u64);
    }
}

#[test]
fn error_tracker_reports_median_p90_and_bias() {
    let mut t = ErrorTracker::default();
    assert_eq!(t.summary(), ErrorSummary::default());
    // Ten completions of 1000 ms predicted at 1100 (nine) and 3000 (one): errors +0.1 x9, +2.
    for _ in 0..9 {
        t.record(1100, 1000);
    }
    t.record(3000, 1000);
    let s = t.summary();
    assert_eq!(s.samples, 10);
    assert!((s.median - 0.1).abs() < 1e-9, "{s:?}");
    assert!((s.p90 - 0.1).abs() < 1e-9, "{s:?}"); // nearest rank 9 of 10
    assert!((s.bias - 0.1).abs() < 1e-9, "{s:?}");
    assert!((t.recent_max(1) - 2.0).abs() < 1e-9, "the last was +2");
    assert!((t.recent_max(3) - 2.0).abs() < 1e-9);
    t.record(1000, 1000);
    assert_eq!(t.recent_max(1), 0.0);
    // The window keeps the last 64 only.
    for _ in 0..64 {
        t.record(500, 1000);
    }
    let s = t.summary();
    assert_eq!(s.samples, 64);
    assert!((s.bias + 0.5).abs() < 1e-9, "{s:?}");
    t.record(4000, 1000);
    assert!(
        (t.recent_max(2) - 3.0).abs() < 1e-9,
        "wrapped ring: {}",
        t.recent_max(2)
    );
}

#[test]
fn nonneg_solver_matches_hand_solution() {
    // minimise (u0 - 1)^2 + (u1 + 1)^2 over u >= 0 (as u^T M u / 2 - q^T u with M = 2I,
    // q = (2, -2)): u = (1, 0).
    let mut m = [[0.0; DIM]; DIM];
    for (i, row) in m.iter_mut().enumerate() {
        row[i] = 2.0;
    }
    let mut q = [0.0; DIM];
    q[0] = 2.0;
    q[1] = -2.0;
    let u = nonneg_quadratic_min(&m, &q, &[0.5; DIM]).unwrap_or([f64::NAN; DIM]);
    assert!((u[0] - 1.0).abs() < 1e-9 && u[1] == 0.0, "{u:?}");
    assert!(u[2..].iter().all(|v| *v == 0.0), "{u:?}");
}

/// What a request shares the server with matters, not only how many: beside three
/// long-context batch jobs a request decodes far slower than beside three short chats (every
/// step reads every sequence's context). Truth: llama's alone cost, plus per other request
/// 20 ms + 0.5 ms per prompt token + 3 ms per output token, plus 14 ms per output token per
/// 1000 tokens of the others' context.
#[test]
fn learns_that_long_neighbours_slow_more_than_short_ones() {
    let truth = |p: u32, o: u32, s: Sharing| {
        let (pf, of) = (f64::from(p), f64::from(o));
        llama(p, o, 1.0)
            + (s.concurrency - 1.0) * (20.0 + 0.5 * pf + 3.0 * of)
            + 14.0 * of * s.others_context / 1000.0
    };
    let mut est = Estimator::new(&PriorConfig::default());
    let mut rng = XorShift(11);
    for _ in 0..400 {
        let (p, o) = (rng.range(20, 1000), rng.range(16, 256));
        let k = f64::from(rng.range(1, 4));
        let s = Sharing::with(k, f64::from(rng.range(100, 1200)));
        est.observe(p, o, s, truth(p, o, s) as u64);
    }
    let short = Sharing::with(4.0, 100.0);
    let long = Sharing::with(4.0, 1200.0);
    for s in [short, long, Sharing::ALONE] {
        let err = rel(est.estimate(500, 200, s).service_ms, truth(500, 200, s));
        assert!(err < 0.08, "{s:?}: err {err} ({:?})", est.snapshot());
    }
    // 200 output tokens x 3 x 1100 more context x 14 ms / 1000 = 9.24 s slower.
    let gap = est.estimate(500, 200, long).service_ms as f64
        - est.estimate(500, 200, short).service_ms as f64;
    assert!((gap - 9240.0).abs() < 1500.0, "gap {gap} ms");
    let s = est.snapshot();
    assert!(
        (s.decode_ms_per_1k_shared_context - 14.0).abs() < 3.0,
        "{s:?}"
    );
}

#[test]
fn a_quantile_is_the_sorted_value_at_its_rank() {
    use crate::estimator::{quantile, Rank};
    let mut x: u64 = 12345;
    for n in 1..80 {
        let v: Vec<f64> = (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 33) % 1000) as f64 / 7.0 - 50.0
            })
            .collect();
        let mut sorted = v.clone();
        sorted.sort_unstable_by(f64::total_cmp);
        for q in [0.0, 0.1, 0.5, 0.9, 1.0] {
            let nearest = sorted[((q * n as f64).ceil() as usize).clamp(1, n) - 1];
            let upper = sorted[((q * n as f64) as usize).min(n - 1)];
            assert_eq!(
                quantile(&mut v.clone(), q, Rank::Nearest),
                nearest,
                "{n} {q}"
            );
            assert_eq!(quantile(&mut v.clone(), q, Rank::Upper), upper, "{n} {q}");
        }
    }
    assert_eq!(quantile(&mut [], 0.5, Rank::Nearest), 0.0);
}
