//! The batching server's dynamic model, worked out by hand.

use super::*;
use crate::build_policy;
use std::path::Path;

/// Slots and slowdown as given; every job costs `overhead_ms` alone, or 100 ms plus 10 ms per
/// output token when the arrival has output tokens.
fn upstream(slots: u32, slowdown: f64) -> Scenario {
    let text = format!(
        r#"
name = "batching"
duration_s = 10
[upstream]
slots = {slots}
overhead_ms = 100
decode_ms_per_token = 10
batch_slowdown = {slowdown}
[arrivals]
rate = 1.0
[[classes]]
name = "a"
[[classes]]
name = "b"
deadline_ms = 1000
"#
    );
    Scenario::parse("t.toml", &text, Path::new(".")).unwrap()
}

/// A request at `at_ms` of class `class` with `output` tokens (alone: 100 + 10 x output ms).
fn arrival(request: u64, at_ms: u64, class: usize, output: u32) -> Arrival {
    Arrival {
        request,
        at_ms,
        class,
        prompt_tokens: 0,
        output_tokens: output,
        max_tokens: 4096,
        expected_output_tokens: output,
        forced_service_ms: None,
        tenant: None,
    }
}

fn run_named(s: &Scenario, arrivals: &[Arrival], policy: &str) -> RunResult {
    let mut p = build_policy(s, policy).unwrap();
    let r = run(s, arrivals, p.as_mut());
    assert_eq!(r.protocol_errors, 0);
    r
}

/// When each request was answered.
fn answered(r: &RunResult) -> Vec<u64> {
    r.requests.iter().map(|q| q.answered_at_ms).collect()
}

#[test]
fn two_equal_jobs_together_with_plain_time_sharing_each_take_twice_alone() {
    let s = upstream(2, 1.0);
    // 100 + 10 x 90 = 1000 ms alone; together at half speed: 2000 ms each.
    let a = [arrival(0, 0, 0, 90), arrival(1, 0, 0, 90)];
    let r = run_named(&s, &a, "none");
    assert_eq!(answered(&r), vec![2000, 2000]);
    assert!(r.requests.iter().all(|q| q.outcome == Outcome::OnTime));
    // Upstream time is what the jobs really held their slots; their size stays alone time.
    assert_eq!(r.requests[0].busy_ms, 2000);
    assert_eq!(r.requests[0].size_ms, 1000);
    // First token: 100 + 10 = 110 ms of work, at half speed.
    assert_eq!(r.requests[0].ttft_ms, Some(220));
    // With a batching gain (0.5) the pair takes 1.5x alone.
    let r = run_named(&upstream(2, 0.5), &a, "none");
    assert_eq!(answered(&r), vec![1500, 1500]);
}

#[test]
fn a_job_joined_halfway_slows_from_then_on_and_speeds_up_when_the_other_ends() {
    let a = [arrival(0, 0, 0, 90), arrival(1, 500, 0, 90)];
    // s = 1. A: 500 ms of work alone by 500, the other 500 at half speed: ends at 1500.
    // B: 500 of work by 1500 at half speed, the other 500 alone: ends at 2000.
    let r = run_named(&upstream(2, 1.0), &a, "none");
    assert_eq!(answered(&r), vec![1500, 2000]);
    // s = 0.5 (factor 1.5 for two): A ends at 500 + 500 x 1.5 = 1250; B has done
    // 750 / 1.5 = 500 by then and ends at 1750.
    let r = run_named(&upstream(2, 0.5), &a, "none");
    assert_eq!(answered(&r), vec![1250, 1750]);
    // A third job, queued behind the two slots, takes A's slot at 1250: two still run, so B
    // keeps its pace (500 left x 1.5: ends at 2000) and C does 500 by then, 500 alone after.
    let a3 = [
        arrival(0, 0, 0, 90),
        arrival(1, 500, 0, 90),
        arrival(2, 600, 0, 90),
    ];
    let r = run_named(&upstream(2, 0.5), &a3, "none");
    assert_eq!(answered(&r), vec![1250, 2000, 2500]);
    // Three slots, s = 0.5, C (1000 ms) joins A and B at 600: A has 500 + 100 / 1.5 = 566.67
    // done, then runs at 1 / 2 and ends at 600 + 433.33 x 2 = 1466.67 (1467 on the ms clock).
    let r = run_named(&upstream(3, 0.5), &a3, "none");
    assert_eq!(r.requests[0].answered_at_ms, 1467);
}

#[test]
fn a_cancelled_job_leaves_the_server_and_the_other_speeds_up() {
    let s = upstream(2, 1.0);
    // A (class b, deadline 1000) and B (no deadline), 1000 ms alone each, together at half
    // speed: at 1000 A's client gives up with 500 ms of work done; the gate cancels it, and B
    // does its remaining 500 alone: ends at 1500.
    let a = [arrival(0, 0, 1, 90), arrival(1, 0, 0, 90)];
    let r = run_named(&s, &a, "max-queue");
    assert_eq!(r.requests[0].outcome, Outcome::Abandoned);
    assert_eq!(r.requests[0].busy_ms, 1000);
    assert_eq!(r.requests[1].answered_at_ms, 1500);
    // Without a gate to cancel it, A runs on to 2000 for nobody, and so does B.
    let r = run_named(&s, &a, "none");
    assert_eq!(r.requests[0].outcome, Outcome::Late);
    assert_eq!(r.requests[1].answered_at_ms, 2000);
}

#[test]
fn with_no_slowdown_the_dynamic_model_is_the_fixed_one() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scenarios");
    for name in [
        "seed-000-burst.toml",
        "faults.toml",
        "seed-002-stuck-slot.toml",
    ] {
        let s = Scenario::load(&dir.join(name)).unwrap();
        assert_eq!(s.upstream.batch_slowdown, 0.0);
        let arrivals = crate::workload::generate(&s).unwrap();
        for policy in ["none", "slackgate", "admit-always", "codel"] {
            let mut p = build_policy(&s, policy).unwrap();
            let fixed = run_with_model(&s, &arrivals, p.as_mut(), false);
            let mut p = build_policy(&s, policy).unwrap();
            let dynamic = run_with_model(&s, &arrivals, p.as_mut(), true);
            // Every request's fate, timing and cost is the same. (The run's end and its chart
            // samples may not be: the fixed model leaves a cancelled job's finish event in its
            // heap, which moves the clock on for nothing, while the dynamic one re-times it
            // away.)
            let differs = (0..fixed.requests.len())
                .find(|&i| fixed.requests[i] != dynamic.requests[i])
                .map(|i| (i, &fixed.requests[i], &dynamic.requests[i]));
            assert_eq!(differs, None, "{name} {policy}");
            assert_eq!(fixed.requests.len(), dynamic.requests.len());
            assert!(dynamic.end_ms <= fixed.end_ms, "{name} {policy}");
        }
    }
}

#[test]
fn context_term_arithmetic() {
    let mut s = upstream(4, 0.0);
    let u = &mut s.upstream;
    (u.overhead_ms, u.prefill_ms_per_token, u.decode_ms_per_token) = (50.0, 0.9, 7.5);
    u.decode_ms_per_1k_context = 14.0;
    // 500-token prompt, 256 out: 50 + 450 + 7.5 x 256 + 14 x 256 x (500 + 128) / 1000.
    let (total, first) = s.service(500, 256, 1.0);
    assert!(
        (total - (50.0 + 450.0 + 1920.0 + 2250.752)).abs() < 1e-9,
        "{total}"
    );
    // First token: prefill, then one step at a context of 500.5 tokens.
    assert!((first - (500.0 + 7.5 + 7.007)).abs() < 1e-9, "{first}");
    // The total is the sum of the per-token steps the stub takes.
    let steps: f64 = (0..256)
        .map(|i| 7.5 + 14.0 * (500.0 + f64::from(i) + 0.5) / 1000.0)
        .sum();
    assert!((total - 500.0 - steps).abs() < 1e-6);
    // No output: the prefill alone.
    assert_eq!(s.service(500, 0, 1.0), (500.0, 500.0));
    // Without the context term the figures are the plain linear model's.
    s.upstream.decode_ms_per_1k_context = 0.0;
    assert_eq!(s.service(500, 256, 1.0), (2420.0, 507.5));
}

#[test]
fn batching_capacity_is_the_best_rate_over_running_counts() {
    let mut s = upstream(4, 0.8);
    // Four at once: each at 1 / 3.4, 1.176 alone-speeds in all.
    assert!((s.upstream.speed() - 4.0 / 3.4).abs() < 1e-12);
    s.upstream.batch_slowdown = 2.0;
    // Worse than one at a time: the best is one alone.
    assert_eq!(s.upstream.speed(), 1.0);
    s.upstream.batch_slowdown = 0.0;
    assert_eq!(s.upstream.speed(), 4.0);
}
