//! The unseen-neighbour drill (issue 16), live on 127.0.0.1: a stub loaded both through the
//! gate and by a client that bypasses it. Three runs (gate on with the server's signal, gate
//! on without it, gate off) from one invocation; the neighbour's requests are reported on
//! their own line and never counted in a class. Without the signal the gate over-admits: its
//! admitted requests are not all on time.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::Duration;

use slackgate_drill::{admitted_on_time, default_modes, Drill, DrillOptions, Mode, Target};
use slackgate_sim::scenario::Scenario;
use slackgate_sim::workload;

/// Longest the drill may run before the test fails.
const LIMIT: Duration = Duration::from_secs(240);

fn scenario() -> Scenario {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scenarios/neighbours-stub.toml");
    Scenario::load(&path).unwrap()
}

fn drill(s: &Scenario, time_scale: f64, modes: Vec<Mode>) -> Drill {
    let opts = DrillOptions {
        time_scale,
        modes,
        ..DrillOptions::default()
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async { tokio::time::timeout(LIMIT, slackgate_drill::run(s, &opts)).await })
        .expect("drill ran over its time limit")
        .unwrap()
}

fn share(d: &Drill, label: &str) -> f64 {
    let i = d.summaries.iter().position(|r| r.label == label).unwrap();
    let a = admitted_on_time(&d.runs[i], &d.summaries[i].counters);
    a[0].share.unwrap()
}

#[test]
fn a_neighbour_runs_three_modes_and_stays_out_of_the_class_table() {
    let s = scenario();
    let modes = default_modes(&s, &Target::InProcess);
    assert_eq!(modes, vec![Mode::Signal, Mode::On, Mode::Off]);
    let d = drill(&s, 0.1, modes);
    assert!(d.healthy(), "{}", d.to_markdown());
    let gated = workload::generate(&s).unwrap().len();
    let neighbours = workload::neighbour_arrivals(&s).len() as u64;
    assert!(neighbours > 50, "{neighbours}");
    let labels: Vec<&str> = d.summaries.iter().map(|r| r.label).collect();
    assert_eq!(labels, ["gate-on-signal", "gate-on", "gate-off"]);
    for (r, run) in d.summaries.iter().zip(&d.runs) {
        // Only the gate's clients are in the class figures.
        assert_eq!(run.requests.len(), gated, "{}", r.label);
        let n = r.neighbour.as_ref().unwrap();
        assert_eq!(n.sent, neighbours, "{}", r.label);
        assert_eq!(n.completed + n.failed, n.sent, "{}", r.label);
        assert!(n.completed * 10 >= n.sent * 9, "{}: {n:?}", r.label);
        assert!(n.p99_ms >= n.p50_ms && n.p50_ms > 0, "{n:?}");
        // The simulator models no neighbour: no comparison is made.
        assert!(r.agreement.is_none());
    }
    let md = d.to_markdown();
    assert!(md.contains("## Unseen neighbour"), "{md}");
    assert!(md.contains("| gate-on-signal | interactive |"), "{md}");
    // The gate without the signal sees only its own work: what it admits is not all on time
    // (measured about 84%; 99% is the bar for the signal run). Gate off is far worse.
    let (on, off) = (share(&d, "gate-on"), share(&d, "gate-off"));
    eprintln!(
        "admitted on time: signal {:.1}%, on {:.1}%, off {:.1}%",
        share(&d, "gate-on-signal") * 100.0,
        on * 100.0,
        off * 100.0
    );
    let signal = share(&d, "gate-on-signal");
    assert!(on < 0.97, "gate on without the signal: {on}");
    assert!(off < on, "gate off {off} vs on {on}");
    // With the signal the promises hold (measured 99.0% at time scale 0.5, see
    // BENCHMARKS.md), well above the gate's own view.
    assert!(signal >= 0.94, "gate on with the signal: {signal}");
    assert!(signal >= on + 0.05, "signal {signal} vs on {on}");
}

#[test]
fn signal_is_refused_against_an_external_gate() {
    let s = scenario();
    let target = Target::External {
        gate: "http://127.0.0.1:9".into(),
        upstream: "http://127.0.0.1:9".into(),
    };
    assert_eq!(default_modes(&s, &target), vec![Mode::On, Mode::Off]);
    let opts = DrillOptions {
        target,
        modes: vec![Mode::Signal],
        ..DrillOptions::default()
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let e = rt
        .block_on(slackgate_drill::run(&s, &opts))
        .map(|_| ())
        .unwrap_err();
    assert!(e.to_string().contains("server_metrics"), "{e}");
    // A mode twice is refused too.
    let opts = DrillOptions {
        modes: vec![Mode::Signal, Mode::On, Mode::Signal],
        ..DrillOptions::default()
    };
    assert!(rt.block_on(slackgate_drill::run(&s, &opts)).is_err());
}

#[test]
fn the_signal_run_scrapes_llamacpp_metrics_and_the_others_do_not() {
    let s = scenario();
    let on = slackgate_drill::gate_config(&s, 0.1, Mode::Signal, "http://127.0.0.1:9");
    let m = on.gate.pools[0].server_metrics.clone().unwrap();
    assert_eq!(m.kind, slackgate_core::config::ServerKind::Llamacpp);
    assert_eq!(m.interval_ms, 100, "250 scenario ms at 0.1, floored at 100");
    assert!(m.stale_ms >= m.interval_ms);
    for mode in [Mode::On, Mode::Off] {
        let c = slackgate_drill::gate_config(&s, 0.1, mode, "http://127.0.0.1:9");
        assert!(c.gate.pools[0].server_metrics.is_none(), "{mode:?}");
    }
}
