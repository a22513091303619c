//! Every seed's drill, live: a real stub and a real gate on 127.0.0.1, real HTTP clients, gate
//! on and gate off, each run bounded in time. The assertions are the seeds' own expectations,
//! plus agreement with the simulator on the same requests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use slackgate_drill::{ClassCounters, Drill, DrillOptions, Mode};
use slackgate_sim::engine::Outcome;
use slackgate_sim::scenario::Scenario;

/// The drills are timing experiments: one at a time, so they do not share the two cores.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Longest a drill test may run before it fails.
const LIMIT: Duration = Duration::from_secs(240);

fn scenario(name: &str) -> Scenario {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../scenarios")
        .join(name);
    Scenario::load(&path).unwrap()
}

fn drill(name: &str, time_scale: f64) -> (Scenario, Drill) {
    drill_with(scenario(name), time_scale, vec![Mode::On, Mode::Off])
}

fn drill_with(s: Scenario, time_scale: f64, modes: Vec<Mode>) -> (Scenario, Drill) {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let opts = DrillOptions {
        time_scale,
        modes,
        ..DrillOptions::default()
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let d = rt
        .block_on(async { tokio::time::timeout(LIMIT, slackgate_drill::run(&s, &opts)).await })
        .expect("drill ran over its time limit")
        .unwrap();
    (s, d)
}

fn counters<'a>(d: &'a Drill, run: &str, class: &str) -> &'a ClassCounters {
    d.summary(run)
        .and_then(|r| r.counters.iter().find(|c| c.class == class))
        .unwrap()
}

/// The drill and the simulator agree within `tol` on on-time completions and refusals.
fn assert_agrees(d: &Drill, tol: f64) {
    for r in &d.summaries {
        let a = r.agreement.as_ref().unwrap();
        assert!(
            a.on_time_diff <= tol && a.refused_diff <= tol,
            "{}: drill and simulator disagree beyond {:.0}% (clients sent up to {:.0} ms late): \
             {a:?}\n{}",
            r.label,
            tol * 100.0,
            r.send_late_ms,
            d.to_markdown()
        );
    }
}

/// A drill is a live timing experiment: on a machine busy with other work, its clients' timers,
/// the stub's service times and the gate's own all fire late, and the run then measures the
/// machine, not the gate. The drill reports how late its clients sent (`send_late_ms`;
/// measured on this 2-core machine with seed 000 at time scale 0.05 in a debug build: 5-6 ms
/// idle, 14-16 ms beside four busy loops). A run that disagrees with the simulator while its
/// clients sent more than this late is run once more; a second disagreement fails, with the
/// lateness in the message.
const STARVED_MS: f64 = 10.0;

fn agrees(d: &Drill, tol: f64) -> bool {
    d.summaries.iter().all(|r| {
        r.agreement
            .as_ref()
            .is_some_and(|a| a.on_time_diff <= tol && a.refused_diff <= tol)
    })
}

fn latest_send_ms(d: &Drill) -> f64 {
    d.summaries
        .iter()
        .map(|r| r.send_late_ms)
        .fold(0.0, f64::max)
}

/// Run a drill (`run`) that must agree with the simulator within `tol`: once, and once more
/// only if it disagreed on a starved machine.
fn agreeing(tol: f64, run: impl Fn() -> (Scenario, Drill)) -> (Scenario, Drill) {
    let first = run();
    let late = latest_send_ms(&first.1);
    if agrees(&first.1, tol) || late <= STARVED_MS {
        return first;
    }
    eprintln!(
        "the drill disagreed with the simulator while its clients sent up to {late:.0} ms late \
         (a machine busy with other work): running it once more"
    );
    run()
}

/// Every offer reached the gate, every completion is in the stub's accounting.
fn sane(d: &Drill) {
    assert!(d.healthy(), "{}", d.to_markdown());
    assert!(d.summaries.iter().all(|r| r.stub_accounted));
}

#[test]
fn seed_000_burst_gate_sheds_in_the_burst_and_breaches_less() {
    let (_s, d) = agreeing(0.10, || drill("seed-000-burst.toml", 0.05));
    sane(&d);
    assert_agrees(&d, 0.10);
    let on = counters(&d, "gate-on", "interactive");
    let off = counters(&d, "gate-off", "interactive");
    // The gate refuses work; without it everything is admitted and most of it breaches.
    assert!(on.rejected > 100, "{on:?}");
    assert_eq!(off.rejected, 0);
    assert!(
        on.slo_breach * 10 < off.slo_breach,
        "gate on {on:?} vs off {off:?}"
    );
    assert!(on.done > 2 * off.done, "gate on {on:?} vs off {off:?}");
    // Refusals cluster in the burst (arrivals double in [120, 240) s): the load before it is
    // already over capacity, so the gate refuses some work from the start, but at least twice
    // as fast during the burst.
    let gate_on = &d.runs[0];
    let refused_at = |from: u64, to: u64| {
        gate_on
            .requests
            .iter()
            .filter(|r| r.outcome == Outcome::Rejected && (from..to).contains(&r.first_at_ms))
            .count()
    };
    let before = refused_at(0, 120_000);
    let during = refused_at(120_000, 240_000);
    assert!(
        during >= 2 * before && during > 60,
        "{before} refusals in the 120 s before the burst, {during} in the 120 s of it"
    );
}

/// Production clients send no size hint: the gate then estimates each request with its
/// class's learned output length. The drill must still match the simulator run the same way.
#[test]
fn seed_000_without_size_hints_agrees_with_the_simulator() {
    let mut s = scenario("seed-000-burst.toml");
    s.size_hint = false;
    let (_s, d) = agreeing(0.10, || drill_with(s.clone(), 0.05, vec![Mode::On]));
    sane(&d);
    assert!(!d.size_hint);
    assert_agrees(&d, 0.10);
}

#[test]
fn seed_001_one_retry_beats_admitting_everything() {
    let (_s, d) = agreeing(0.15, || drill("seed-001-reservations.toml", 0.1));
    sane(&d);
    assert_agrees(&d, 0.15);
    let on = &d.report.policies[0].total;
    let off = &d.report.policies[1].total;
    assert!(on.on_time > 2 * off.on_time, "{on:?}\n{off:?}");
    assert!(on.wasted_fraction < 0.05 && off.wasted_fraction > 0.3);
    // Refused clients replay once, after the advertised Retry-After, and never more.
    let replays: Vec<u32> = d.runs[0].requests.iter().map(|r| r.offers).collect();
    assert!(replays.contains(&2), "nobody replayed: {replays:?}");
    assert!(replays.iter().all(|&n| n <= 2), "{replays:?}");
}

#[test]
fn seed_002_stuck_slot_gate_refuses_fast_instead_of_timing_out() {
    let (_s, d) = agreeing(0.15, || drill("seed-002-stuck-slot.toml", 0.05));
    sane(&d);
    assert_agrees(&d, 0.15);
    let on = counters(&d, "gate-on", "sync");
    let off = counters(&d, "gate-off", "sync");
    // Behind the stuck eval, sync requests with the gate off wait out their 4 s and time
    // out; with the gate on they are refused at once and none breaches.
    assert!(off.slo_breach > 10, "{off:?}");
    assert_eq!(on.slo_breach, 0, "{on:?}");
    assert!(on.rejected > 10, "{on:?}");
    let sync = &d.report.policies[0].classes[0].1;
    assert!(
        sync.rejection_latency_ms.p99 < 2_000,
        "refusals must come at once: {:?}",
        sync.rejection_latency_ms
    );
    // The eval itself is not refused: it is the work that was stuck, not the victim.
    assert_eq!(counters(&d, "gate-on", "eval").rejected, 0);
}

#[test]
fn seed_003_probe_burst_no_prod_completes_after_slack_zero_with_the_gate() {
    // At the seed's own pace (800 ms jobs, 4 s deadlines): compressed to half, the last prod
    // request admitted ended 20 ms inside its deadline, and a hiccup on a busy CI machine
    // once ate that (the pool's `promise_guard_ms` now keeps 50 ms in hand; here it measured
    // 50 ms to spare, against 25 ms kept in real time at half pace).
    let (_s, d) = agreeing(0.10, || drill("seed-003-probe-burst.toml", 1.0));
    sane(&d);
    assert_agrees(&d, 0.10);
    // The seed: "Expected after a disabled gate: bad greater than zero. Expected after the
    // restored gate: bad equal to zero." Its prod clients wait for their completions.
    let off = counters(&d, "gate-off", "prod");
    assert!(off.completed_after_slack_zero > 10, "{off:?}");
    assert_eq!(
        counters(&d, "gate-on", "prod").completed_after_slack_zero,
        0
    );
    // Probes are shed, and no admitted prod request is left to finish late or be abandoned:
    // it completes in time, or (when timing noise ate its slack) the gate drops it with a
    // reason before it is sent upstream.
    assert!(counters(&d, "gate-on", "probe").rejected > 0);
    let prod = &d.report.policies[0].classes[0].1;
    assert_eq!((prod.late, prod.abandoned), (0, 0), "{prod:?}");
    assert!(prod.on_time >= 4, "{prod:?}");
}

#[test]
fn injected_faults_fail_the_same_requests_as_in_the_simulator() {
    let (s, d) = agreeing(0.15, || drill("faults.toml", 0.1));
    sane(&d);
    assert_agrees(&d, 0.15);
    // Gate off refuses nothing, so every request reaches the stub: the requests that fail
    // (errors, resets) and the hung ones the clients give up on are the simulator's.
    let arrivals = slackgate_sim::workload::generate(&s).unwrap();
    let mut p = slackgate_sim::build_policy(&s, "admit-always").unwrap();
    let sim = slackgate_sim::engine::run(&s, &arrivals, p.as_mut());
    let live = &d.runs[1];
    let of = |r: &slackgate_sim::engine::RunResult, o: Outcome| -> Vec<usize> {
        r.requests
            .iter()
            .enumerate()
            .filter(|(_, q)| q.outcome == o)
            .map(|(i, _)| i)
            .collect()
    };
    let failed = of(&sim, Outcome::Failed);
    assert!(failed.len() > 5, "the scenario should fail some requests");
    assert_eq!(of(live, Outcome::Failed), failed, "{}", d.to_markdown());
    let hung: Vec<usize> = (0..arrivals.len())
        .filter(|&i| {
            let a = &arrivals[i];
            s.fault_for(a.request, a.at_ms, a.class)
                .is_some_and(|f| f.kind == slackgate_sim::scenario::FaultKind::Hang)
        })
        .collect();
    assert!(!hung.is_empty());
    for i in hung {
        assert_eq!(sim.requests[i].outcome, Outcome::Abandoned);
        assert_eq!(live.requests[i].outcome, Outcome::Abandoned, "request {i}");
    }
    // The stub measured the upstream time of the failed requests: they are waste.
    assert!(d.report.policies[1].total.wasted_work_s > 0.0);
}

/// A continuous-batching upstream: the stub slows every request it serves by the others in
/// service, step by step, as the simulator's batching model does, so the drill of
/// `llama-mixed` (its first 30 s) matches the simulator's.
#[test]
fn batching_upstream_drill_agrees_with_the_simulator() {
    let mut s = scenario("llama-mixed.toml");
    assert!(s.upstream.batching() && s.upstream.decode_ms_per_1k_context > 0.0);
    s.duration_s = 30.0;
    let (_s, d) = agreeing(0.3, || {
        drill_with(s.clone(), 0.25, vec![Mode::On, Mode::Off])
    });
    sane(&d);
    // Looser than the linear scenarios' 15%: the gate pads admission by the p90 of its own
    // measured estimate errors, which the live gate measures on the stub's real pacing (timer
    // granularity at a quarter of real time, scheduling) and the simulator on exact times; the
    // padding differs and moves the requests near the edge (measured: on time 117 against
    // 107, refused 30 against 40, with the padding; 124/126 and 23/21 without it).
    assert_agrees(&d, 0.3);
    // The shape of the full scenario, already in its first 30 s: admitting everything loses
    // a large share of interactive requests to their deadline (half of them by 30 s, most
    // by 120 s); the gate serves more of them, and what it admits is on time.
    let on = counters(&d, "gate-on", "interactive");
    let off = counters(&d, "gate-off", "interactive");
    assert!(off.slo_breach * 5 >= off.admitted * 2, "{off:?}");
    assert!(on.done * 4 > off.done * 5, "gate on {on:?} vs off {off:?}");
    assert!(
        on.slo_breach * 10 < off.slo_breach,
        "gate on {on:?} vs off {off:?}"
    );
}

/// Issue 14: two deadline classes on the production trace (`trace-azure-two-class`: the quarter
/// of requests with the longest prompts is batch, 120 s). Its first 400 s at 2x load (about
/// 5,400 requests), live at a quarter of real time: the gate keeps every batch admission (none
/// is dropped after waiting), and the run agrees with the simulator's prediction for the same
/// requests. Without the forecast the simulator drops batch requests in that window after
/// they waited (checked here too, in the simulator only: the contrast costs no second drill).
#[test]
fn two_deadline_classes_keep_their_admissions_live_as_in_the_simulator() {
    if slackgate_testkit::production_trace(
        "seeds::two_deadline_classes_keep_their_admissions_live_as_in_the_simulator",
    )
    .is_none()
    {
        return;
    }
    let mut s = scenario("trace-azure-two-class.toml");
    s.duration_s = 400.0;
    let batch = |rep: &slackgate_sim::report::Report| {
        rep.policies[0]
            .classes
            .iter()
            .find(|(n, _)| n == "batch")
            .map(|(_, st)| st.clone())
            .unwrap()
    };
    let mut without = s.clone();
    without.slackgate.forecast = false;
    let (sim_without, _) =
        slackgate_sim::simulate_with(&without, &["slackgate".into()], false).unwrap();
    let wo = batch(&sim_without);
    assert!(
        wo.dropped * 10 >= wo.admitted,
        "without the forecast: {wo:?}"
    );
    let (_s, d) = agreeing(0.15, || drill_with(s.clone(), 0.25, vec![Mode::On]));
    sane(&d);
    assert_agrees(&d, 0.15);
    let w = batch(&d.report);
    assert!(
        w.dropped * 100 <= w.admitted,
        "live, with the forecast: {w:?}"
    );
    assert!(w.admitted_slo_attainment >= 0.99, "{w:?}");
}

#[test]
fn bad_options_are_refused_before_any_traffic() {
    let s = scenario("seed-003-probe-burst.toml");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 11.0] {
        let opts = DrillOptions {
            time_scale: bad,
            ..DrillOptions::default()
        };
        let e = rt.block_on(slackgate_drill::run(&s, &opts)).unwrap_err();
        assert!(e.to_string().contains("--time-scale"), "{bad}: {e}");
    }
    for modes in [
        vec![],
        vec![Mode::On, Mode::On],
        vec![Mode::On, Mode::Off, Mode::On],
    ] {
        let opts = DrillOptions {
            modes,
            ..DrillOptions::default()
        };
        let e = rt.block_on(slackgate_drill::run(&s, &opts)).unwrap_err();
        assert!(e.to_string().contains("at most once"), "{e}");
    }
    // What the drill cannot reproduce live is refused, not silently ignored.
    let mut slow = s.clone();
    slow.upstream.concurrency_slowdown = 0.1;
    let e = rt
        .block_on(slackgate_drill::run(&slow, &DrillOptions::default()))
        .unwrap_err();
    assert!(e.to_string().contains("concurrency_slowdown"), "{e}");
    let mut blind = s;
    blind.cancel_on_disconnect = false;
    let e = rt
        .block_on(slackgate_drill::run(&blind, &DrillOptions::default()))
        .unwrap_err();
    assert!(e.to_string().contains("cancel_on_disconnect"), "{e}");
}
