//! Each policy's defining behaviour on scenarios small enough to work out by hand, driven
//! through the whole simulator (workload, engine, policy, report).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use slackgate_sim::engine::Outcome;
use slackgate_sim::scenario::Scenario;
use std::path::Path;

/// One slot, 1000 ms per request, five requests sent 1 ms apart at t = 0, each with a
/// 2500 ms deadline: at most two can finish in time (at 1000 and 2000 ms).
const FIVE_AT_ONCE: &str = r#"
name = "five-at-once"
duration_s = 1
tick_ms = 10
[upstream]
slots = 1
overhead_ms = 1000
decode_ms_per_token = 0
[arrivals]
process = "uniform"
rate = 1000
count = 5
[[classes]]
name = "interactive"
priority = 100
deadline_ms = 2500
[baselines]
max_queue = 1
seed000_max_age_ms = 60000
seed000_depth_factor = 2.0
"#;

fn scenario(text: &str) -> Scenario {
    Scenario::parse("test.toml", text, Path::new(".")).unwrap()
}

fn outcomes(s: &Scenario, policy: &str) -> Vec<Outcome> {
    let (_, runs) = slackgate_sim::simulate(s, &[policy.to_string()]).unwrap();
    assert_eq!(runs[0].protocol_errors, 0, "{policy}");
    runs[0].requests.iter().map(|r| r.outcome).collect()
}

#[test]
fn no_gate_serves_everything_late_after_the_second() {
    use Outcome::*;
    let s = scenario(FIVE_AT_ONCE);
    // FIFO with no gate: 1000, 2000 on time; 3000, 4000, 5000 finish for nobody.
    assert_eq!(outcomes(&s, "none"), vec![OnTime, OnTime, Late, Late, Late]);
    let (rep, _) = slackgate_sim::simulate(&s, &["none".into()]).unwrap();
    let t = &rep.policies[0].total;
    assert_eq!(t.wasted_work_s, 3.0);
    assert_eq!(t.busy_s, 5.0);
    assert_eq!(t.turnaround_ms.p50, 1000);
}

#[test]
fn max_queue_refuses_beyond_its_cap() {
    use Outcome::*;
    // One running, one queued (cap 1), three refused at once.
    assert_eq!(
        outcomes(&scenario(FIVE_AT_ONCE), "max-queue"),
        vec![OnTime, OnTime, Rejected, Rejected, Rejected]
    );
}

#[test]
fn seed000_refuses_on_depth_then_loses_the_queued_to_their_deadline() {
    use Outcome::*;
    // Depth rule: reject when the slot is busy and more than 2 x 1 wait. Requests 2-4 queue
    // (depth 0, 1, 2), the fifth is refused; 3 and 4 are still queued at 2500 ms and their
    // clients give up (the gate sees it and drops them).
    assert_eq!(
        outcomes(&scenario(FIVE_AT_ONCE), "seed000"),
        vec![OnTime, OnTime, Abandoned, Abandoned, Rejected]
    );
}

#[test]
fn slackgate_refuses_exactly_what_cannot_make_it() {
    use Outcome::*;
    let s = scenario(FIVE_AT_ONCE);
    // Slack 2500 - 1000 = 1500 ms: the second waits 1000 (admit), the third would wait 2000.
    assert_eq!(
        outcomes(&s, "slackgate"),
        vec![OnTime, OnTime, Rejected, Rejected, Rejected]
    );
    let (rep, _) = slackgate_sim::simulate(&s, &["slackgate".into()]).unwrap();
    let t = &rep.policies[0].total;
    assert_eq!(t.wasted_work_s, 0.0);
    assert_eq!(t.rejection_latency_ms.p99, 0, "told at once");
    assert_eq!(t.false_rejections, 0);
    // The bound: ~2500 ms of window on one slot; two whole requests fit.
    assert_eq!(rep.bound_work_s, 2.504); // the last deadline is at 2504 ms
    assert_eq!(rep.bound_count, 2);
    assert_eq!(t.on_time_work_s, 2.0);
}

#[test]
fn clairvoyant_keeps_the_short_ones() {
    use Outcome::*;
    // A 2400 ms job arrives at 0 beside the 1000 ms ones (deadline 2500 for all): it can
    // only finish in time if it starts by 100 ms, but the first short job already runs.
    let s = scenario(&format!(
        "{FIVE_AT_ONCE}[[stuck]]\nat_s = 0\nduration_s = 2.4\nclass = \"interactive\"\n"
    ));
    let out = outcomes(&s, "clairvoyant");
    // Request 1 is the injected job (same instant as request 0, listed after it). The
    // clairvoyant refuses it up front instead of letting it make others late, and serves
    // two short ones.
    assert_eq!(
        out,
        vec![OnTime, Rejected, OnTime, Rejected, Rejected, Rejected]
    );
}

#[test]
fn retries_are_counted_as_amplification() {
    let text = FIVE_AT_ONCE.replace(
        "deadline_ms = 2500",
        "deadline_ms = 2500\nretry = \"storm\"\nstorm_retries = 3",
    );
    let s = scenario(&text);
    let (rep, _) = slackgate_sim::simulate(&s, &["max-queue".into()]).unwrap();
    let t = &rep.policies[0].total;
    // Three refused requests retry 3 times each at once and are refused again (the queue
    // is still full): 5 + 9 offers.
    assert_eq!(t.offered, 14);
    assert!((t.retry_amplification - 2.8).abs() < 1e-9);
}

/// One slot, four requests 2 s apart, each 1000 ms of service with a 5 s deadline, and one
/// fault per request: a x3 latency spike, an error, a reset after the third of ten tokens,
/// and a hang.
const ONE_FAULT_EACH: &str = r#"
name = "faults"
duration_s = 8
tick_ms = 10
[upstream]
slots = 1
overhead_ms = 0
decode_ms_per_token = 100
[arrivals]
process = "uniform"
rate = 0.5
count = 4
[[classes]]
name = "interactive"
priority = 100
deadline_ms = 5000
output_tokens = { dist = "fixed", value = 10 }
max_tokens = 10
[[faults]]
kind = "latency"
at_s = 0
duration_s = 1
factor = 3.0
[[faults]]
kind = "error"
at_s = 1
duration_s = 2
status = 500
[[faults]]
kind = "reset"
at_s = 3
duration_s = 2
[[faults]]
kind = "hang"
at_s = 5
duration_s = 2
"#;

#[test]
fn faults_slow_fail_cut_and_hang_their_requests() {
    use Outcome::*;
    let s = scenario(ONE_FAULT_EACH);
    let (rep, runs) = slackgate_sim::simulate(&s, &["none".into()]).unwrap();
    let r = &runs[0].requests;
    let arrivals: Vec<u64> = r.iter().map(|q| q.first_at_ms).collect();
    assert_eq!(arrivals, [0, 2000, 4000, 6000]);
    // 0: 3000 ms instead of 1000, still on time. 1: an error after 1 ms. 2: cut after the
    // third token (300 ms). 3: hangs; its client gives up at its deadline (11 s), and with
    // no gate to cancel it the slot stays held until the run's end.
    assert_eq!(
        r.iter().map(|q| q.outcome).collect::<Vec<_>>(),
        [OnTime, Failed, Failed, Abandoned]
    );
    assert_eq!(r[0].answered_at_ms, 3000);
    assert_eq!(r[0].busy_ms, 3000);
    assert_eq!((r[1].busy_ms, r[1].answered_at_ms), (1, 3001));
    assert_eq!((r[2].busy_ms, r[2].answered_at_ms), (300, 4300));
    assert_eq!(r[3].answered_at_ms, 11_000);
    assert_eq!(r[1].reason, "upstream_error");
    let t = &rep.policies[0].total;
    assert_eq!((t.on_time, t.failed, t.abandoned), (1, 2, 1));
}

/// One slot at 100 ms per output token, one class with a 2500 ms deadline, replayed from a
/// five-row trace: a 1000 ms request at 0, a 1400 ms one at 0 (listed second), then three
/// 1000 ms ones at 1, 2 and 3 ms. Written to a fresh directory: traces are read from files.
fn long_among_short() -> Scenario {
    let dir = slackgate_testkit::temp_dir("by-hand");
    std::fs::write(
        dir.join("t.csv"),
        "TIMESTAMP,ContextTokens,GeneratedTokens\n\
         2023-01-01 00:00:00.000,0,10\n\
         2023-01-01 00:00:00.000,0,14\n\
         2023-01-01 00:00:00.001,0,10\n\
         2023-01-01 00:00:00.002,0,10\n\
         2023-01-01 00:00:00.003,0,10\n",
    )
    .unwrap();
    let text = r#"
name = "long-among-short"
duration_s = 10
tick_ms = 10
[upstream]
slots = 1
overhead_ms = 0
prefill_ms_per_token = 0
decode_ms_per_token = 100
[arrivals]
process = "trace"
[trace]
path = "t.csv"
[[classes]]
name = "interactive"
priority = 100
deadline_ms = 2500
"#;
    Scenario::parse("long-among-short.toml", text, &dir).unwrap()
}

#[test]
fn displacement_and_revocation_trade_a_long_admission_for_a_short_newcomer() {
    use Outcome::*;
    let s = long_among_short();
    // slackgate (admission is a promise): the first runs 0-1000; the long one waits 1000 <=
    // its slack 2500 - 1400 = 1100 and is admitted (it ends at 2400, on time). The third
    // (at 1 ms) would wait 999 + 1400 = 2399 > its slack 1500: refused, as are the rest.
    assert_eq!(
        outcomes(&s, "slackgate"),
        vec![OnTime, OnTime, Rejected, Rejected, Rejected]
    );
    // The clairvoyant without revocation decides the same: it never drops what it admitted.
    assert_eq!(
        outcomes(&s, "clairvoyant-firm"),
        vec![OnTime, OnTime, Rejected, Rejected, Rejected]
    );
    // With displacement (window: the 2500 ms deadline) the third takes the long one's place:
    // without it, its wait is 999 <= 1500. The long one is told `displaced` at 1 ms. The
    // fourth (wait 998 + 1000 > 1500) finds nothing longer than itself to displace.
    assert_eq!(
        outcomes(&s, "slackgate-displace"),
        vec![OnTime, Dropped, OnTime, Rejected, Rejected]
    );
    // The revoking clairvoyant drops the longest job of the late prefix: the same schedule.
    assert_eq!(
        outcomes(&s, "clairvoyant"),
        vec![OnTime, Dropped, OnTime, Rejected, Rejected]
    );
    let (rep, runs) =
        slackgate_sim::simulate(&s, &["slackgate".into(), "slackgate-displace".into()]).unwrap();
    let displaced = &runs[1].requests[1];
    assert_eq!(
        (displaced.reason, displaced.answered_at_ms),
        ("displaced", 1)
    );
    // Against the revoking reference, slackgate's refusal of the third is a false rejection
    // (1 of its 3 refusals); the displacing gate has none, but one admitted request of its
    // three was not served: admitted SLO attainment 2/3.
    let ours = &rep.policies[0].total;
    let displacing = &rep.policies[1].total;
    assert_eq!((ours.false_rejections, ours.rejected), (1, 3));
    assert_eq!(ours.admitted_slo_attainment, 1.0);
    assert_eq!((displacing.false_rejections, displacing.dropped), (0, 1));
    assert!((displacing.admitted_slo_attainment - 2.0 / 3.0).abs() < 1e-9);
}
